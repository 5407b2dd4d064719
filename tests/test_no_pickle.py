"""Nothing crosses a process boundary as pickle: no object collectives, no pickle, no torch.load in atoll, and
states between ranks travel as safetensors + JSON that cannot run code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from atoll.runtime.collective.transfer import decode_state, encode_state

ROOT = Path(__file__).resolve().parents[1] / "atoll"
#: calls that unpickle what another process sent (or a file someone else wrote)
FORBIDDEN = {"gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list",
             "send_object_list", "recv_object_list", "loads", "load"}
MODULES = {"pickle", "dill", "cloudpickle", "marshal", "shelve"}


def _calls(tree: ast.AST) -> list[tuple[str, str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = ast.unparse(node.func.value)
            out.append((base, node.func.attr, node.lineno))
    return out


def test_atoll_never_unpickles() -> None:
    found = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{path}:{node.lineno} imports {n}" for n in names if n and n.split(".")[0] in MODULES]
        for base, attr, line in _calls(tree):
            if attr in FORBIDDEN - {"loads", "load"} or (attr in ("loads", "load") and base in ("pickle", "torch")):
                found.append(f"{path}:{line} calls {base}.{attr}")
    assert not found, found


def test_a_state_round_trips_and_a_pickle_is_not_a_state() -> None:
    state = {"step": 3, "islands": [{"w": torch.arange(6.0).view(2, 3), "lr": 0.1}], "name": "x", "none": None}
    got = decode_state(encode_state(state))
    assert got["step"] == 3 and got["name"] == "x" and got["none"] is None
    assert torch.equal(got["islands"][0]["w"], state["islands"][0]["w"]) and got["islands"][0]["lr"] == 0.1
    import pickle

    class Evil:
        def __reduce__(self):  # what a hostile rank would send: code run by pickle.loads
            return (exec, ("raise SystemExit('pwned')",))

    hostile = torch.frombuffer(bytearray(pickle.dumps(Evil())), dtype=torch.uint8)
    with pytest.raises(Exception) as e:  # it fails to parse; it never runs
        decode_state(hostile)
    assert not isinstance(e.value, SystemExit)

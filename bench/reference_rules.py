"""SparseLoCo and DeMo under their reference code's rules (issue 24), on the micro model, against the committed
diloco runs of ``bench/beyond.py`` (diloco is unchanged by the issue, and its numbers are reproducible).

    python bench/reference_rules.py                 # train (or reuse) every run, then the table
    python bench/reference_rules.py --report-only   # the table of what is in bench/out/beyond_w24

The runs (:func:`atoll.benchmarks.common.train_once` with ``bench/beyond.py``'s micro settings, into
``bench/out/beyond_w24``): sparseloco at the byte budget (16 of 1024, H = 30, 1,200 steps) with the
reference's rules (Templar's median-norm clip, the senders' mean, tiles, the outer rate twice); the same
without the clip (``--sparseloco-clip none``: the release's plain scatter-mean), with atoll's earlier flat
chunks (``--sparseloco-layout flat``), with Templar's k in small tiles (``--sparseloco-tile-k topk``: on
micro only the norms, runs of 32, change: 16 kept instead of 1) and at outer rate 0.7; the byte budget's
other shapes and two past it (8 of 1024 at H = 15, 32 at H = 60, 16 at H = 5, 32 at H = 1: bench/beyond.py's
study 2 on today's rules); the budget's shape at 300 steps (the step-size diagnostic); sparseloco at 64 of
4096, H = 10, 300 and 1,200 steps; demo and one island alone at 300 steps. With ``--report-only`` a run
still in progress (or stopped) is reported at its last evaluation (``steps`` column). The machine's load
(1-minute average) is read before and after each run trained, kept in results.json by run, and its range
over the table's runs written beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/reference_rules.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.benchmarks.common import default_out, finished, pct, train_once, write_results
from bench.beyond import BASE

_BUDGET = {"strategy": "sparseloco", "steps": 1200, "sync_every": 30, "sparseloco_chunk": 1024, "sparseloco_topk": 16}
_DIAG = {**_BUDGET, "steps": 300}
#: the byte budget's other shapes and two past it (bench/beyond.py's study 2): (k of 1024, H)
_SHAPES = ((8, 15), (32, 60), (16, 5), (32, 1))
#: run -> its settings on top of bench/beyond.py's BASE
SETTINGS: dict[str, dict[str, Any]] = {
    "sparseloco_c1024_k16_h30": _BUDGET,
    "sparseloco_c1024_k16_h30_clip_none": {**_BUDGET, "sparseloco_clip": "none"},
    "sparseloco_c1024_k16_h30_layout_flat": {**_BUDGET, "sparseloco_layout": "flat"},
    "sparseloco_c1024_k16_h30_tile_k_topk": {**_BUDGET, "sparseloco_tile_k": "topk"},
    "sparseloco_c1024_k16_h30_lr07": {**_BUDGET, "outer_lr": 0.7},
    **{f"sparseloco_c1024_k{k}_h{h}": {**_BUDGET, "sparseloco_topk": k, "sync_every": h} for k, h in _SHAPES},
    "diag_sparseloco_c1024_k16_h30_300": _DIAG,
    "sparseloco_300": {"strategy": "sparseloco", "steps": 300},
    "sparseloco_1200": {"strategy": "sparseloco", "steps": 1200},
    "demo_300": {"strategy": "demo", "steps": 300},
    "one_island_300": {"strategy": "ddp", "islands": 1, "steps": 300},
}

#: run -> (reference run in bench/out/beyond/results.json or in this folder, what it measures)
ROWS: dict[str, tuple[str, str]] = {
    "sparseloco_c1024_k16_h30": ("diloco_h40", "reference rules (median-norm clip, senders' mean, tiles, rate twice)"),
    "sparseloco_c1024_k16_h30_clip_none": ("diloco_h40", "no clip (the release's plain scatter-mean)"),
    "sparseloco_c1024_k16_h30_layout_flat": ("diloco_h40", "flat chunks (atoll's old rule)"),
    "sparseloco_c1024_k16_h30_tile_k_topk": ("diloco_h40", "Templar's k in small tiles (norms: 16 of 32, not 1)"),
    "sparseloco_c1024_k16_h30_lr07": ("diloco_h40", "outer rate 0.7 (0.49x through accumulator and step)"),
    **{f"sparseloco_c1024_k{k}_h{h}": ("diloco_h40", f"{k} of 1024, H = {h}, reference rules") for k, h in _SHAPES},
    "diag_sparseloco_c1024_k16_h30_300": ("diloco_300", "300 steps, H = 30: step size diagnostic"),
    "sparseloco_300": ("diloco_300", "64 of 4096, H = 10, reference rules"),
    "sparseloco_1200": ("diloco_1200", "64 of 4096, H = 10, reference rules"),
    "demo_300": ("one_island_300", "demo top-32 of 64x64, reference momentum and averaging"),
    "one_island_300": ("one_island_300", "one island alone (ddp, K = 1)"),
}


def _last_eval(folder: Path) -> tuple[int, float] | None:
    evals = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line] if (folder / "metrics.jsonl").is_file() else []
    return (evals[-1]["step"], evals[-1]["eval_loss"]) if evals else None


def main(argv: Sequence[str] | None = None) -> int:
    """Train (unless ``--report-only``) and write bench/out/beyond_w24/results.json and results.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="only the table of the runs already there")
    args = parser.parse_args(argv)
    out = default_out("beyond_w24")
    # run -> the load before and after it trained, kept from the sitting that trained it
    before = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    loads: dict[str, list[float]] = before.get("load") if isinstance(before.get("load"), dict) else {}
    if not args.report_only:
        for name, own in SETTINGS.items():
            settings = {**BASE, **own}
            trains = not finished(out / name, {**settings, "progress": False, "threads": 1})
            start = os.getloadavg()[0]
            train_once(out, name, False, **settings)
            if trains:
                loads[name] = [start, os.getloadavg()[0]]
    committed = json.loads((default_out("beyond") / "results.json").read_text())["runs"]
    rows: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    for name, (ref, what) in ROWS.items():
        folder = out / name
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else None
        last = _last_eval(folder)
        if summary is None and last is None:
            continue
        summaries[name] = summary
        base = committed.get(ref) or (json.loads((out / ref / "summary.json").read_text())
                                      if (out / ref / "summary.json").is_file() else None)
        loss = summary["final_eval_loss"] if summary else last[1]
        sent = summary["bytes_sent_per_island"] if summary else None
        rows.append({"run": name, "what": what, "steps": summary["steps"] if summary else f"{last[0]} (stopped)",
                     "eval_loss": loss, "energy": (summary or {}).get("sparseloco_sent_energy"),
                     "step_ratio": (summary or {}).get("sparseloco_step_ratio"), "vs": ref,
                     "ref_loss": base["final_eval_loss"] if base else None,
                     "gap_pct": pct(loss, base["final_eval_loss"]) if base and summary else None,
                     "bytes": sent, "fewer": (base["bytes_sent_per_island"] / sent
                                              if base and sent and base["bytes_sent_per_island"] else None)})
    seen = [x for name in summaries for x in loads.get(name, [])]
    load = f"machine load {min(seen):.1f}-{max(seen):.1f} on 2 cores" if seen else "machine load not recorded"
    table = write_results(
        out, {"runs": summaries, "rows": rows, "load": loads},
        [("run", "run"), ("what", "what"), ("steps", "steps"), ("eval loss", "eval_loss"),
         ("energy sent", "energy"), ("step / averaging's", "step_ratio"), ("vs", "vs"), ("its loss", "ref_loss"),
         ("gap %", "gap_pct"), ("bytes/island", "bytes"), ("x fewer bytes", "fewer")],
        rows, "issue 24: sparseloco and demo under their reference code's rules, micro model, 4 islands",
        notes=[f"one seed, one torch thread per run, {load} (1-minute average before and after each run); "
               "diloco references: bench/out/beyond/results.json (unchanged code)",
               "command: python bench/reference_rules.py"])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

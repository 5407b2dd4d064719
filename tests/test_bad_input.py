"""Bad input, table-driven: each kind exits with status 2, one line that names the field, and writes nothing."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import run_cli

M = ["--model", "micro", "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--steps", "2",
     "--threads", "1", "--no-progress"]

#: (id, TOML text or None, command-line arguments, the field the one line must name)
CASES: list[tuple[str, str | None, list[str], str]] = [
    ("toml-true-for-an-int", "checkpoint_every = true\n", [], "checkpoint_every"),
    ("toml-false-for-a-float", "lr = false\n", [], "lr"),
    ("toml-true-for-a-path", "cache_dir = true\n", [], "cache_dir"),
    ("toml-unknown-key", "sync_evry = 5\n", [], "sync_evry"),
    ("toml-syntax", "steps = = 3\n", [], "config: '"),
    ("toml-string-for-an-int", 'eval_every = "many"\n', [], "eval_every"),
    # a TOML value has a type: a number in quotes, a float for a whole number, text for a switch are refused
    ("toml-string-for-a-float", 'lr = "1e-3"\n', [], "lr: the string '1e-3' in '"),
    ("toml-number-in-quotes-for-an-int", 'warmup_steps = "0"\n', [], "warmup_steps: the string '0' in '"),
    ("toml-float-for-an-int", "eval_batches = 2.0\n", [], "eval_batches: the float 2.0 in '"),
    ("toml-float-for-an-int-set-by-a-flag", "seq_len = 32.0\n", [], "seq_len: the float 32.0 in '"),
    ("toml-string-for-a-switch", 'compile = "yes"\n', [], "compile: the string 'yes' in '"),
    ("toml-number-for-a-switch", "compile = 1\n", [], "compile: the number 1 in '"),
    ("toml-syntax", "steps = \n", [], "config"),
    ("infinite-lr", None, ["--lr", "inf"], "lr"),
    # a deadline the backends cannot hold (OverflowError) or that no store client can meet (DistNetworkError)
    ("collective-timeout-huge", None, ["--runtime", "collective", "--collective-timeout-s", "1e15"],
     "collective_timeout_s"),
    ("collective-timeout-tiny", None, ["--runtime", "collective", "--collective-timeout-s", "1e-9"],
     "collective_timeout_s"),
    # GPT-2's learned positions (n_positions 16) cannot take --seq-len 32: IndexError at the first evaluation
    ("model-with-fewer-positions", None, ["--model", "__GPT2SHORT__"], "seq_len: 32 tokens, but the model"),
    ("model-with-fewer-positions-collective", None, ["--model", "__GPT2SHORT__", "--runtime", "collective"],
     "seq_len: 32 tokens, but the model"),
    ("nan-outer-lr", None, ["--outer-lr", "nan"], "outer_lr"),
    ("huge-seed", None, ["--seed", "99999999999999999999"], "seed"),
    ("zero-islands", None, ["--islands", "0"], "islands"),
    ("negative-steps", None, ["--steps", "-3"], "steps"),
    ("huge-steps", None, ["--steps", "99999999999999999999"],
     "steps: input should be less than or equal to 1000000000"),
    ("huge-sync-every", None, ["--sync-every", "99999999999999999999"], "sync_every"),
    ("unknown-codec", None, ["--codec", "int3"], "codec"),
    ("missing-data", None, ["--data", "/nonexistent/corpus.txt"], "data"),
    ("unknown-data-type", None, ["--data", "__FILE__.bin"], "data"),
    ("latin-1-text", None, ["--data", "__LATIN1__"], "data"),
    ("random-bytes-as-text", None, ["--data", "__RANDOM__"], "data"),
    ("model-config-wrong-type", None, ["--model", "__BADCONFIG__", "--tokenizer", "bpe"], "model"),
    ("model-weights-truncated", None, ["--model", "__TRUNCATED__", "--tokenizer", "bpe"], "model"),
    # weights that lack tensors the config names: transformers would start them at random
    ("model-weights-lack-a-layer", None, ["--model", "__MISSING__", "--tokenizer", "bpe"],
     "model: '__MISSING__' lacks 9 of the model's weight tensors (model.layers.1.input_layernorm.weight, "
     "model.layers.1.mlp.down_proj.weight, model.layers.1.mlp.gate_proj.weight and 6 more), which would start at "
     "random"),
    ("model-config-deeper-than-its-weights", None, ["--model", "__DEEPER__", "--tokenizer", "bpe"],
     "model: '__DEEPER__' lacks 18 of the model's weight tensors (model.layers.2."),
    # The folder's own tokenizer is loaded first: a damaged config.json is still the model's, not the tokenizer's.
    ("model-config-syntax-with-tokenizer", None, ["--model", "__SYNTAX_TOK__"], "model: '__SYNTAX_TOK__/config.json'"),
    ("model-config-wrong-type-with-tokenizer", None, ["--model", "__TYPES_TOK__"],
     "model: '__TYPES_TOK__/config.json'"),
    ("model-config-missing-with-tokenizer", None, ["--model", "__NOCONFIG_TOK__"],
     "model: '__NOCONFIG_TOK__' has no config.json"),
    ("model-weights-truncated-with-tokenizer", None, ["--model", "__TRUNC_TOK__"], "model: '__TRUNC_TOK__'"),
    ("flag-of-another-strategy", None, ["--strategy", "diloco", "--demo-topk", "8"], "demo_topk"),
    ("sparseloco-bits", None, ["--strategy", "sparseloco", "--sparseloco-bits", "3"], "sparseloco_bits"),
    ("sparseloco-chunk-not-a-square", None, ["--strategy", "sparseloco", "--sparseloco-chunk", "48",
                                             "--sparseloco-topk", "4"], "sparseloco_chunk: 48 is not a square"),
    ("muon-with-demo", None, ["--strategy", "demo", "--inner-optimizer", "muon"], "inner_optimizer"),
    # a setting the strategy or runtime does not read, given explicitly (even at its default value)
    ("fragments-under-diloco", None, ["--strategy", "diloco", "--fragments", "4"],
     "fragments: the diloco strategy does not use it (only streaming, decoupled); drop --fragments or use "
     "--strategy streaming|decoupled"),
    ("fragments-in-toml-under-ddp", 'strategy = "ddp"\nfragments = 2\n', [], "fragments: the ddp strategy"),
    # a switch turned off: the fix names the flag as typed
    ("no-realign-pushes-under-diloco", None, ["--strategy", "diloco", "--no-realign-pushes"],
     "realign_pushes: the diloco strategy does not use it (only decoupled); drop --no-realign-pushes or use "
     "--strategy decoupled"),
    # a key of the file: the fix names the file, not a flag the user never typed
    ("outer-lr-in-toml-under-a-ddp-flag", 'strategy = "diloco"\nouter_lr = 0.7\n', ["--strategy", "ddp"],
     "drop 'outer_lr' from "),
    ("fragments-under-sparseloco", None, ["--strategy", "sparseloco", "--fragments", "2"], "fragments: the sparseloco"),
    ("outer-momentum-under-ddp", None, ["--strategy", "ddp", "--outer-momentum", "0.9"], "outer_momentum: the ddp"),
    ("outer-lr-under-demo", None, ["--strategy", "demo", "--outer-lr", "0.5"], "outer_lr: the demo strategy"),
    ("lr-under-demo", None, ["--strategy", "demo", "--lr", "0.01"],
     "lr: the demo strategy does not use it (only ddp, diloco, streaming, sparseloco, decoupled; "
     "demo reads --demo-lr instead)"),
    ("weight-decay-under-demo", None, ["--strategy", "demo", "--weight-decay", "0"], "weight_decay: the demo"),
    ("sync-every-under-ddp", None, ["--strategy", "ddp", "--sync-every", "10"], "sync_every: the ddp strategy"),
    ("sync-every-in-toml-under-demo", 'strategy = "demo"\nsync_every = 10\n', [], "sync_every: the demo"),
    ("codec-under-sparseloco", None, ["--strategy", "sparseloco", "--codec", "int8"], "codec: the sparseloco"),
    ("overlap-steps-at-default-under-diloco", None, ["--overlap-steps", "1"], "overlap_steps: the diloco strategy"),
    ("ranks-per-island-under-local", None, ["--ranks-per-island", "2"],
     "ranks_per_island: the local runtime does not use it (only collective, service: atoll island); drop "
     "--ranks-per-island or use --runtime collective"),
    ("ranks-per-island-under-ray", None,
     ["--strategy", "decoupled", "--runtime", "ray", "--fragments", "2", "--ranks-per-island", "1"],
     "ranks_per_island: the ray runtime"),
    ("min-islands-in-toml-under-local", "min_islands = 1\n", [], "min_islands: the local runtime"),
    ("link-under-collective", None, ["--runtime", "collective", "--link-bandwidth-mbps", "10"],
     "link_bandwidth_mbps: the collective runtime"),
    # an empty path (an unset shell variable) meant the current folder: a run, a cache or a corpus there
    ("empty-out", None, ["--out="], "out: empty"),
    ("empty-data", None, ["--data="], "data: empty"),
    ("empty-cache-dir", 'cache_dir = ""\n', [], "cache_dir: empty"),
    ("empty-model", None, ["--model="], "model: empty"),
    ("empty-tokenizer", None, ["--tokenizer="], "tokenizer: empty"),
    ("empty-init-from", None, ["--init-from", " "], "init_from: empty"),
    ("speeds-count", None,
     ["--strategy", "decoupled", "--islands", "2", "--fragments", "2", "--island-speeds", "1,1,1"], "island_speeds"),
]


def _damaged_folders_with_tokenizer(root: Path) -> dict[str, str]:
    """Model folders with their own tokenizer: config.json cut short, with a string for a number, missing;
    weights cut in half."""
    import json

    from test_pretrained import make_model_folder

    folders = {name: str(make_model_folder(root / name.strip("_").lower()))
               for name in ("__SYNTAX_TOK__", "__TYPES_TOK__", "__NOCONFIG_TOK__", "__TRUNC_TOK__")}
    config = Path(folders["__SYNTAX_TOK__"]) / "config.json"
    config.write_text(config.read_text()[:-20])
    config = Path(folders["__TYPES_TOK__"]) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "sixty-four"}))
    (Path(folders["__NOCONFIG_TOK__"]) / "config.json").unlink()
    weights = Path(folders["__TRUNC_TOK__"]) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folders


def _damaged_model_folders(root: Path) -> dict[str, str]:
    """Saved micro models (2 layers, tied embeddings): config.json with a string for a number; weights cut in
    half; weights without layer 1's 9 tensors; config.json naming 4 layers for weights of 2."""
    import json

    from safetensors.torch import load_file, save_file

    from atoll.job.model import build_model

    folders = {}
    for name in ("__BADCONFIG__", "__TRUNCATED__", "__MISSING__", "__DEEPER__"):
        folder = root / name.strip("_").lower()
        build_model("micro", 512, 32, seed=0).save_pretrained(folder)
        folders[name] = str(folder)
    config = json.loads((root / "badconfig" / "config.json").read_text())
    (root / "badconfig" / "config.json").write_text(json.dumps({**config, "hidden_size": "sixty-four"}))
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    weights = root / "missing" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.startswith("model.layers.1.")}, weights,
              metadata={"format": "pt"})
    config = json.loads((root / "deeper" / "config.json").read_text())
    (root / "deeper" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    return folders


def _gpt2_short(root: Path) -> dict[str, str]:
    """A GPT-2 whose learned positions (16) cannot take the run's --seq-len 32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = str(root / "gpt2short")
    GPT2LMHeadModel(GPT2Config(n_positions=16, n_embd=32, n_layer=2, n_head=2, vocab_size=600,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return {"__GPT2SHORT__": folder}


#: the model folders a case names, each group made by its function (read only: made once for the module)
MODEL_FOLDERS = {"__BADCONFIG__": _damaged_model_folders, "__TRUNCATED__": _damaged_model_folders,
                 "__MISSING__": _damaged_model_folders, "__DEEPER__": _damaged_model_folders,
                 "__GPT2SHORT__": _gpt2_short, "__SYNTAX_TOK__": _damaged_folders_with_tokenizer,
                 "__TYPES_TOK__": _damaged_folders_with_tokenizer, "__NOCONFIG_TOK__": _damaged_folders_with_tokenizer,
                 "__TRUNC_TOK__": _damaged_folders_with_tokenizer}
#: the data files a case names: (file name, its bytes), written in the case's own folder
DATA_FILES = {
    "__FILE__.bin": ("corpus.bin", lambda: b"\x00\x01" * 100),
    "__LATIN1__": ("latin1.txt",
                   lambda: "\n\n".join(f"caf\u00e9 gar\u00e7on na\u00efve {i}" for i in range(300)).encode("latin-1")),
    "__RANDOM__": ("noise.txt", lambda: random.Random(0).randbytes(50_000)),
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``model_folder("__MISSING__")``: the path of that damaged model folder, its group made on first use."""
    root, made = tmp_path_factory.mktemp("models"), {}

    def path(name: str) -> str:
        if name not in made:
            made.update(MODEL_FOLDERS[name](root))
        return made[name]

    return path


@pytest.mark.parametrize(("toml", "args", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, toml: str | None, args: list[str],
                                                         field: str, monkeypatch: pytest.MonkeyPatch,
                                                         model_folder: Callable[[str], str]) -> None:
    monkeypatch.chdir(tmp_path)  # what a bad path might write in the current folder lands here, and is checked
    out = tmp_path / "run"
    argv = ["train", *M, "--out", str(out)]
    if toml is not None:
        (tmp_path / "run.toml").write_text(toml)
        argv += ["--config", str(tmp_path / "run.toml")]
    places = {}
    for name in args:
        if name in DATA_FILES:
            file, content = DATA_FILES[name]
            (tmp_path / file).write_bytes(content())
            places[name] = str(tmp_path / file)
        elif name in MODEL_FOLDERS:
            places[name] = model_folder(name)
    for name, folder in places.items():
        field = field.replace(name, folder)
    argv += [places.get(a, a) for a in args]
    r = run_cli(*argv)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: ") and field in lines[0], r.stderr
    assert not out.exists()  # refused before anything was written
    assert not [p.name for p in tmp_path.iterdir() if p.suffix in (".npy", ".jsonl", ".json") or p.is_symlink()]


@pytest.mark.parametrize(("name", "damage"), [
    ("string-for-a-number", {"steps": "many"}),
    ("out-of-range", {"islands": -1}),
    ("unknown-strategy", {"strategy": "nope"}),
    ("unknown-key", {"bogus": 1}),
    ("emptied", None),
])
def test_resume_of_a_run_whose_config_json_is_damaged_says_so(tmp_path: Path, name: str, damage: dict | None) -> None:
    """A run folder's config.json that parses but is not a run's settings: the one line names that file and the
    fix (restore it, or a new run), not a flag to set."""
    import json

    from atoll.config import build_config

    run = tmp_path / "run"
    run.mkdir()
    saved = json.loads(build_config(overrides={"model": "micro", "steps": 4, "out": str(run)}).model_dump_json())
    text = json.dumps({**saved, **damage}) if damage is not None else "{}"
    (run / "config.json").write_text(text)
    r = run_cli("train", "--resume", str(run), "--steps", "6")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"atoll: error: resume: '{run / 'config.json'}' "), r.stderr
    assert "TOML" not in lines[0] and "start a new run" in lines[0] and "restore" in lines[0], r.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.json"] and (run / "config.json").read_text() == text


def test_report_of_a_file_names_the_run_not_the_png(tmp_path: Path) -> None:
    """``atoll report FILE``: the run given is what is wrong, not the report.png that would lie under it."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    r = run_cli("report", str(notes))
    assert r.returncode == 2 and r.stderr.strip() == (f"atoll: error: report: '{notes}' has no metrics.jsonl; pass "
                                                       "atoll run folders"), r.stderr
    assert notes.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_report_into_a_missing_folder_is_refused_not_made(tmp_path: Path) -> None:
    """``atoll report RUN --out /nonexistent/dir/x.png`` made the missing folders; a typo should not."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "eval", "step": 1, "tokens": 8, "eval_loss": 5.0}\n')
    out = tmp_path / "no" / "such" / "x.png"
    r = run_cli("report", str(run), "--out", str(out))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"atoll: error: out: the folder '{out.parent}' does not exist; make it first (mkdir -p '{out.parent}') or "
        "pass --out in an existing folder"), r.stderr
    assert not (tmp_path / "no").exists() and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_resume_with_another_out_is_refused_not_ignored(tmp_path: Path) -> None:
    """``--resume RUN --out OTHER`` used to resume RUN in place and drop --out without a word."""
    from atoll.config import build_config, load_run_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(build_config(overrides={"model": "micro", "out": str(run)}).model_dump_json())
    r = run_cli("train", "--resume", str(run), "--out", str(tmp_path / "elsewhere"), "--steps", "6")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"atoll: error: out: a resumed run stays in its folder '{run}'; drop --out"), r.stderr
    assert not (tmp_path / "elsewhere").exists() and sorted(p.name for p in run.iterdir()) == ["config.json"]
    assert load_run_config(run, {"out": str(run / ".")}).out == run  # the same folder: nothing to refuse


def test_sweep_into_a_file_is_one_line_before_any_warning(tmp_path: Path) -> None:
    """A bad --out is said alone, not after warnings about points that will never train."""
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    r = run_cli("sweep", *M, "--sync-every", "5,10", "--out", str(notes))
    assert r.returncode == 2 and r.stderr.strip() == f"atoll: error: out: '{notes}' is a file; pass a folder", r.stderr
    assert notes.read_text() == "precious"


def test_a_decoupled_run_saved_before_realign_pushes_resumes_without_it(tmp_path: Path) -> None:
    """``realign_pushes`` became on by default after decoupled runs were written without the key: such a run
    trained on the paper's fixed schedule and resumes so (EARLIER_DEFAULTS); a run that saved the key keeps it."""
    import json

    from atoll.config import build_config, load_run_config

    for saved, expect in ((None, False), (True, True), (False, False)):
        run = tmp_path / f"run_{saved}"
        run.mkdir()
        config = json.loads(build_config(overrides={"model": "micro", "strategy": "decoupled", "islands": 2,
                                                    "fragments": 2, "out": str(run)}).model_dump_json())
        if saved is None:
            config.pop("realign_pushes")
        else:
            config["realign_pushes"] = saved
        (run / "config.json").write_text(json.dumps(config))
        assert load_run_config(run, {"steps": 8}).strategy_config.realign_pushes is expect

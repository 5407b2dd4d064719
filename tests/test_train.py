"""The job end to end: outputs, resume equality, warm start, and bad input exiting 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

import atoll.job.run as train_mod
from atoll.config import build_config, load_run_config
from atoll.config.applies import applicable
from atoll.job.metrics import read_metrics
from atoll.training import train


@pytest.mark.slow
def test_diloco_run_writes_outputs_and_learns(fast_config: dict) -> None:
    summary = train(build_config(overrides=fast_config))
    out = Path(fast_config["out"])
    for name in ("metrics.jsonl", "summary.json", "report.png", "config.json", "checkpoints/latest"):
        assert (out / name).exists(), name
    saved = json.loads((out / "summary.json").read_text())
    for key in ("strategy", "runtime", "islands", "sync_every", "steps", "params", "tokens", "initial_eval_loss",
                "final_eval_loss", "bytes_sent_per_island", "ddp_bytes_per_island", "compute_s", "sim_wall_s",
                "wall_s"):
        assert key in saved, key
    # 20 steps of 2 islands: from uniform over 512 tokens (6.24 nats) down by more than 0.4
    assert saved["final_eval_loss"] < saved["initial_eval_loss"] - 0.4
    assert saved["tokens"] == 2 * 20 * 4 * 32
    # 20 steps, H=5: 4 outer steps, each a ring all-reduce of the fp32 parameters; ddp would do 20
    assert saved["exchanges"] == 4
    assert saved["ddp_bytes_per_island"] == pytest.approx(5 * saved["bytes_sent_per_island"])
    assert saved["sim_wall_s"] >= saved["compute_s"] > 0
    events = read_metrics(out / "metrics.jsonl")
    assert [e["step"] for e in events if e["event"] == "eval"] == [0, 10, 20]
    assert summary["final_eval_loss"] == saved["final_eval_loss"]
    latest = out / "checkpoints" / "latest"
    assert latest.is_symlink() and latest.resolve() == (out / "checkpoints" / "step_0000020").resolve()
    assert (latest / "model" / "model.safetensors").is_file() and (latest / "model" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_checkpoint_model_loads_with_transformers(fast_config: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train(build_config(overrides={**fast_config, "steps": 10}))
    ckpt = Path(fast_config["out"]) / "checkpoints" / "latest" / "model"  # a stable path to the newest model
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok("def main():", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape[-1] >= tok.vocab_size


class _Crash(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "extra"), [
    ("diloco", {}), ("ddp", {}), ("demo", {}),
    # the agreement-weighted outer step: its per-run statistics must resume with the run
    ("diloco", {"outer_adapt": "agreement"}),
    # the compiled round: the outer momentum and its count of compiled rounds resume with the run
    ("diloco", {"outer_kernel": "compiled"}),
    # ... with int4, stochastic rounding and error feedback: the residuals and random sources it reads and writes
    ("diloco", {"outer_kernel": "compiled", "codec": "int4", "codec_rounding": "stochastic", "error_feedback": True}),
    # sparseloco: each island's error-feedback accumulator and the run's sent-energy statistic resume too
    ("sparseloco", {"sparseloco_chunk": 256, "sparseloco_topk": 8}),
    # ... compiled: the accumulators it swaps in (second buffers) and its count of compiled rounds
    ("sparseloco", {"sparseloco_chunk": 256, "sparseloco_topk": 8, "outer_kernel": "compiled"}),
    # fragment 0 starts an exchange after step 10 that merges after step 11: in flight at the checkpoint;
    # int4 with stochastic rounding and error feedback: residuals and random state must be restored too
    ("streaming", {"fragments": 2, "overlap_steps": 1, "codec": "int4", "codec_rounding": "stochastic",
                   "error_feedback": True}),
    # ... compiled: the mean in flight at the checkpoint is the compiled loop's, and it merges compiled after resume
    ("streaming", {"fragments": 2, "overlap_steps": 1, "codec": "int4", "codec_rounding": "stochastic",
                   "error_feedback": True, "outer_kernel": "compiled"}),
])
def test_resume_halfway_matches_uninterrupted_run(fast_config: dict, tmp_path: Path, monkeypatch, strategy: str,
                                                  extra: dict) -> None:
    # sync_every=3 so the crash at step 10 falls mid-round: islands have diverged and must be restored
    base = {**fast_config, "strategy": strategy, "sync_every": 3, **extra}
    base = applicable(base)  # sync_every: not read by ddp and demo
    full = train(build_config(overrides={**base, "out": str(tmp_path / "full")}))

    real_save = train_mod.save_checkpoint

    def save_then_crash(out, step, *args, **kwargs):
        path = real_save(out, step, *args, **kwargs)
        if step == 10:
            raise _Crash()
        return path

    monkeypatch.setattr(train_mod, "save_checkpoint", save_then_crash)
    with pytest.raises(_Crash):
        train(build_config(overrides={**base, "out": str(tmp_path / "resumed")}))
    monkeypatch.setattr(train_mod, "save_checkpoint", real_save)
    resumed = train(load_run_config(tmp_path / "resumed"), resume=True)
    assert resumed["final_eval_loss"] == pytest.approx(full["final_eval_loss"], abs=1e-4)
    assert resumed["bytes_sent_per_island"] == full["bytes_sent_per_island"]
    assert resumed["tokens"] == full["tokens"]
    for key in ("outer_agreement_mean", "outer_agreement_last", "sparseloco_sent_energy", "sparseloco_step_ratio",
                "outer_rounds_compiled"):
        assert resumed.get(key) == pytest.approx(full.get(key), rel=1e-6) if key in full else key not in resumed
    if extra.get("outer_kernel") == "compiled":  # every round but each fragment's first (the momentum starts eager;
        # sparseloco has no outer momentum)
        first = 0 if strategy == "sparseloco" else extra.get("fragments", 1)
        assert full["outer_rounds_compiled"] == resumed["outer_rounds_compiled"] == full["exchanges"] - first > 0
    evals = [e["step"] for e in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if e["event"] == "eval"]
    assert evals == [0, 10, 20], "the log of a resumed run reads as one run"
    # the clock trace continues the checkpoint's: whole, with the same collectives, waits and marks (compute
    # seconds are measured, so they differ), so the resumed run can be re-timed at another link
    from atoll.runtime.network import Link, load_trace, replay

    traces = [load_trace(tmp_path / name / "clock_trace.json") for name in ("full", "resumed")]
    assert traces[1]["complete"] is True
    # the same events in the same order (their seconds are measured: compute, and with a codec its encode time)
    assert [e[0] for e in traces[1]["events"]] == [e[0] for e in traces[0]["events"]]
    assert sorted(replay(traces[1], Link.from_config(10.0, 50.0))["marks"]) == [10, 20]


@pytest.mark.slow
def test_init_from_starts_from_another_runs_weights(fast_config: dict, tmp_path: Path) -> None:
    warm = train(build_config(overrides=applicable({**fast_config, "strategy": "ddp", "out": str(tmp_path / "warm")})))
    cont = train(build_config(overrides={**fast_config, "steps": 10, "init_from": str(tmp_path / "warm"),
                                         "out": str(tmp_path / "cont")}))
    assert cont["initial_eval_loss"] == pytest.approx(warm["final_eval_loss"], abs=1e-5)


@pytest.mark.slow
def test_tokenizer_cache_is_reused_between_runs(fast_config: dict, tmp_path: Path) -> None:
    cfg = {**fast_config, "steps": 2, "eval_every": 2, "cache_dir": str(tmp_path / "cache")}
    train(build_config(overrides={**cfg, "out": str(tmp_path / "a")}))
    train(build_config(overrides={**cfg, "out": str(tmp_path / "b")}))
    first = [e for e in read_metrics(tmp_path / "a" / "metrics.jsonl") if e["event"] == "start"][0]
    second = [e for e in read_metrics(tmp_path / "b" / "metrics.jsonl") if e["event"] == "start"][0]
    assert first["tokenizer_from_cache"] is False and second["tokenizer_from_cache"] is True
    assert len(list((tmp_path / "cache").glob("tokenizer-*.json"))) == 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--islands", "0"], "islands"),
        (["--sync-every", "-3"], "sync_every"),
        (["--strategy", "fedsgd"], "strategy"),
        (["--outer-lr", "abc"], "outer_lr"),
        (["--link-bandwidth-mbps", "0"], "link_bandwidth_mbps"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_field(args: list[str], field: str) -> None:
    r = run_cli("train", *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: ") and field in lines[0], r.stderr


def test_bad_toml_key_exits_2(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('strategy = "diloco"\nsync_evry = 10\n')
    r = run_cli("train", "--config", str(toml))
    assert r.returncode == 2 and "sync_evry" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_data_path_exits_2(tmp_path: Path) -> None:
    r = run_cli("train", "--data", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("atoll: error: data:") and "nope.txt" in line


def test_resume_of_a_folder_without_a_run_exits_2(tmp_path: Path) -> None:
    r = run_cli("train", "--resume", str(tmp_path))
    assert r.returncode == 2 and "resume" in r.stderr


@pytest.mark.slow
def test_out_folder_of_existing_run_is_not_overwritten(fast_config: dict) -> None:
    train(build_config(overrides={**fast_config, "steps": 2, "eval_every": 2}))
    r = run_cli("train", "--out", fast_config["out"])
    assert r.returncode == 2 and "--resume" in r.stderr


@pytest.mark.slow
def test_resume_refuses_changes_that_define_the_run_and_leaves_the_folder_untouched(fast_config: dict) -> None:
    from atoll.errors import ConfigError

    train(build_config(overrides={**fast_config, "steps": 10}))
    out = Path(fast_config["out"])
    before = (out / "config.json").read_text()
    # (streaming: its 4 fragments would not fit the micro model; the strategy's refusal speaks first)
    for change in ({"strategy": "ddp"}, {"strategy": "streaming"}, {"vocab_size": "1024"}, {"model": "tiny"},
                   {"islands": "3"}):
        with pytest.raises(ConfigError, match=f"^{next(iter(change))}: cannot change on resume"):
            load_run_config(out, change)
    r = run_cli("train", "--resume", str(out), "--steps", "5")
    assert r.returncode == 2 and "below the checkpoint's step 10" in r.stderr
    assert (out / "config.json").read_text() == before
    resumed = train(load_run_config(out, {"steps": "20"}), resume=True)
    assert resumed["steps"] == 20 and resumed["tokens"] == 2 * 20 * 4 * 32


@pytest.mark.slow
def test_resume_falls_back_to_the_previous_checkpoint_when_the_latest_is_damaged(fast_config: dict) -> None:
    train(build_config(overrides={**fast_config, "steps": 20}))
    root = Path(fast_config["out"]) / "checkpoints"
    (root / "step_0000020" / "state.safetensors").write_bytes(b"garbage")
    from atoll.job.run import load_latest_state

    step, state = load_latest_state(Path(fast_config["out"]))
    assert step == 10 and "islands" in state


@pytest.mark.parametrize("args", [["--lr", "inf"], ["--outer-lr", "nan"], ["--seed", "99999999999999999999"]])
def test_non_finite_or_huge_values_exit_2(args: list[str]) -> None:
    r = run_cli("train", *args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_out_that_is_a_file_exits_2(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    r = run_cli("train", "--out", str(f), "--model", "micro", "--steps", "2")
    assert r.returncode == 2 and r.stderr.startswith("atoll: error: out:"), r.stderr


def test_init_from_a_decoupled_run_stopped_before_its_first_checkpoint(tmp_path: Path) -> None:
    """A Ray decoupled run killed early leaves only its syncer's checkpoint (``<out>/syncer``, written at every
    commit): --init-from the run folder, or that folder itself, starts from the syncer's global model."""
    import torch

    from atoll.config import TrainConfig
    from atoll.errors import ConfigError
    from atoll.job.model import build_model
    from atoll.runtime.decoupled_job import syncer_of
    from atoll.strategies.base import model_fragments

    config = TrainConfig(strategy="decoupled", model="micro", vocab_size=512, seq_len=32, islands=2, fragments=2)
    trained = build_model("micro", 512, 32, seed=7)
    flat = torch.nn.utils.parameters_to_vector(trained.parameters()).detach()
    index = model_fragments([(n, tuple(p.shape)) for n, p in trained.named_parameters()], 2)
    syncer = syncer_of(config, flat, index)
    syncer.save(tmp_path / "killed" / "syncer")
    for source in (tmp_path / "killed", tmp_path / "killed" / "syncer"):
        fresh = build_model("micro", 512, 32, seed=0)
        assert not torch.equal(torch.nn.utils.parameters_to_vector(fresh.parameters()), flat)
        train_mod.load_init_weights(fresh, source)
        assert torch.equal(torch.nn.utils.parameters_to_vector(fresh.parameters()).detach(), syncer.global_params())
    with pytest.raises(ConfigError, match="init_from: the syncer's model"):
        train_mod.load_init_weights(build_model("micro", 1024, 32, seed=0), tmp_path / "killed")


def test_atoll_train_stays_callable_however_often_it_is_called() -> None:
    """``import atoll; atoll.train(c); atoll.train(c)``: importing the loop's module never rebinds the package's
    ``train`` (the module is ``atoll.training``), so a second call reaches the loop as the first did; and
    ``from atoll import train`` is the same function. Run in a fresh interpreter (no earlier import of atoll)."""
    import subprocess
    import sys

    code = (
        "import atoll\n"
        "from atoll import ConfigError, TrainConfig, train\n"
        "c = TrainConfig(strategy='decoupled', runtime='service')\n"
        "said = []\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        atoll.train(c)\n"
        "    except ConfigError as e:\n"
        "        said.append(str(e).split(' ')[0])\n"
        "import atoll.training\n"
        "assert atoll.train is train and callable(atoll.train), atoll.train\n"
        "print(said)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "['runtime:', 'runtime:']"  # the loop's own refusal, both times


def test_a_run_whose_checkpoints_lost_their_state_json_is_not_told_it_never_wrote_one(tmp_path: Path) -> None:
    """A checkpoint is whole once its state.json is in place: where every checkpoint folder lacks it, the resume
    says so (naming the newest) instead of "stopped before its first checkpoint ... remove the folder"."""
    from atoll.job.checkpoint import CheckpointError, latest_checkpoint, resume_advice

    (tmp_path / "config.json").write_text("{}")
    assert "no checkpoint was written yet" in resume_advice(tmp_path)
    for step in (20, 30):
        (tmp_path / "checkpoints" / f"step_{step:07d}").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no checkpoint in .* is whole: 2 without a state.json "
                                              r"\(the newest step_0000030\)"):
        latest_checkpoint(tmp_path)
    # what an interrupted or failed command advises says the same, not "start again" as if none was written
    assert resume_advice(tmp_path).startswith(f"no checkpoint in '{tmp_path}' is whole")
    (tmp_path / "checkpoints" / "step_0000020" / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step_0000020"

"""SparseLoCo against DiLoCo by number of outer rounds, and Muon islands against AdamW islands (issue: beyond).

    python bench/beyond.py            # about an hour on one idle CPU core (the tiny runs: about half of it)

The micro Llama (37K parameters, 512-token BPE, 8 x 32 tokens per island per step), 4 islands, on the
stdlib corpus; one torch thread per run. Five studies:

1. SparseLoCo (arXiv:2508.15706; chunk-wise top-k of an error-feedback accumulator, 2-bit values) against
   DiLoCo fp32 at H = 10, 30 outer rounds (300 steps) and 120 (1,200 steps), at the default 64 of 4096 and
   at 256 of 4096 (on micro's small tensors a 4096 chunk holds a whole 1,024-element matrix, so the true
   density is higher than k/chunk: see the density column), and the lossless identity (density 1, 32
   bits, beta 0, no median-norm clip: FedAvg). A sparse round moves about the density's share of the coordinates.
2. SparseLoCo at 1,200 steps in 1,024-element chunks (one per hidden matrix, so k/chunk is the density)
   against DiLoCo fp32 at H = 40 (30 rounds): within the issue's byte budget (at least 30x fewer bytes than
   that DiLoCo: H = 30 at 1.6%, H = 60 at 3.1%, H = 15 at 0.8%) and beyond it (H = 5 and H = 1: the most
   rounds SparseLoCo can have), to tell rounds from the method; and SparseLoCo's knobs (32-bit values, the
   accumulator's decay, the outer rate, an outer momentum on top) at 120 rounds and at the budget.
3. MuLoCo (Muon inner steps, arXiv:2505.23725) against AdamW islands under diloco at fp32 and int4, 300 steps.
4. The agreement-weighted outer step (``--outer-adapt agreement``, :mod:`atoll.algorithms.agreement`) against
   the fixed outer step: H = 40 at 1,200 steps (two seeds, and int4) and H = 10 at 300 steps.
5. SparseLoCo by model size: micro (hidden 32), nano (64, the default) and tiny (160) on the default
   benchmark's data and schedule (1,024-token BPE, 32 x 128 tokens per step, 800 steps, H = 50), 16 of
   1,024 entries per chunk (1.6%), against diloco fp32 and one island alone at the same size; the
   ``energy sent`` column is the share of the error-feedback accumulator each round's payload delivers.

Writes bench/out/beyond/results.json and results.md (``--out``: elsewhere); a finished run is reused
(:func:`atoll.benchmarks.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from atoll.benchmarks.common import default_out, pct, script_error, study_settings, train_once, write_results
from atoll.config.applies import strategy_readers
from atoll.errors import AtollError, ConfigError

#: every run's settings under its own (studies 1 to 4): bench/beyond.toml's [base]
BASE: dict[str, Any] = study_settings(__file__, "base")
#: the default benchmark's data and schedule (atoll train's defaults), for the study by model size: [size_base]
SIZE_BASE: dict[str, Any] = study_settings(__file__, "size_base")

#: (name, reference run it is compared with, settings)
RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("diloco_300", "diloco_300", {"strategy": "diloco", "steps": 300}),
    ("sparseloco_300", "diloco_300", {"strategy": "sparseloco", "steps": 300}),
    ("sparseloco_k256_300", "diloco_300", {"strategy": "sparseloco", "steps": 300, "sparseloco_topk": 256}),
    ("sparseloco_dense_300", "diloco_300", {"strategy": "sparseloco", "steps": 300, "sparseloco_topk": 4096,
                                            "sparseloco_bits": 32, "sparseloco_beta": 0.0,
                                            "sparseloco_clip": "none"}),
    ("diloco_1200", "diloco_1200", {"strategy": "diloco", "steps": 1200}),
    ("sparseloco_1200", "diloco_1200", {"strategy": "sparseloco", "steps": 1200}),
    ("sparseloco_k256_1200", "diloco_1200", {"strategy": "sparseloco", "steps": 1200, "sparseloco_topk": 256}),
    ("muon_300", "diloco_300", {"strategy": "diloco", "steps": 300, "inner_optimizer": "muon"}),
    ("diloco_int4_300", "diloco_300", {"strategy": "diloco", "steps": 300, "codec": "int4"}),
    ("muon_int4_300", "diloco_int4_300", {"strategy": "diloco", "steps": 300, "codec": "int4",
                                          "inner_optimizer": "muon"}),
    # 2. at a byte budget: k of 1024-element chunks, against diloco H=40 (30 rounds)
    ("diloco_h40", "diloco_h40", {"strategy": "diloco", "steps": 1200, "sync_every": 40}),
    *[(f"sparseloco_c1024_k{k}_h{h}", "diloco_h40", {"strategy": "sparseloco", "steps": 1200, "sync_every": h,
                                                  "sparseloco_chunk": 1024, "sparseloco_topk": k})
      for k, h in ((8, 15), (16, 30), (32, 60), (16, 5), (32, 1))],
    # SparseLoCo's knobs: at 120 rounds (H = 10, 64 of 4096) and at the byte budget (16 of 1024, H = 30)
    *[(f"sparseloco_1200_{tag}", "diloco_1200", {"strategy": "sparseloco", "steps": 1200, **knob})
      for tag, knob in (("bits32", {"sparseloco_bits": 32}), ("beta099", {"sparseloco_beta": 0.99}),
                        ("beta08", {"sparseloco_beta": 0.8}), ("lr2", {"outer_lr": 2.0}))],
    *[(f"sparseloco_c1024_k16_h30_{tag}", "diloco_h40", {"strategy": "sparseloco", "steps": 1200, "sync_every": 30,
                                                      "sparseloco_chunk": 1024, "sparseloco_topk": 16, **knob})
      for tag, knob in (("lr2", {"outer_lr": 2.0}), ("momentum05", {"outer_momentum": 0.5}))],
    # 4. the agreement-weighted outer step against the fixed one
    ("agreement_h40", "diloco_h40", {"strategy": "diloco", "steps": 1200, "sync_every": 40,
                                     "outer_adapt": "agreement"}),
    ("diloco_h40_seed1", "diloco_h40_seed1", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "seed": 1}),
    ("agreement_h40_seed1", "diloco_h40_seed1", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "seed": 1,
                                                 "outer_adapt": "agreement"}),
    ("diloco_h40_int4", "diloco_h40_int4", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "codec": "int4"}),
    ("agreement_h40_int4", "diloco_h40_int4", {"strategy": "diloco", "steps": 1200, "sync_every": 40,
                                               "codec": "int4", "outer_adapt": "agreement"}),
    ("agreement_300", "diloco_300", {"strategy": "diloco", "steps": 300, "outer_adapt": "agreement"}),
    # 5. by model size: micro, nano (the default) and tiny on the default data settings, 800 steps, H = 50,
    # 16 of 1024 (1.6%) against diloco fp32 and one island alone at each size
)

#: the models of the study by size on a CPU (``--size-models``: e.g. 20m,125m on a GPU)
SIZE_MODELS = ("micro", "nano", "tiny")


def size_runs(models: Sequence[str], extra: dict[str, Any] | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """Study 5's runs for ``models``: diloco fp32, sparseloco at 16 of 1024 and one island alone at each, on
    the default benchmark's data and schedule; ``extra`` settings (``device``, ``precision``) for all."""
    extra = extra or {}
    runs = []
    for model in models:
        own = {**SIZE_BASE, "model": model, **extra}
        runs += [(f"size_{model}_diloco", f"size_{model}_diloco", {**own, "strategy": "diloco"}),
                 (f"size_{model}_sparseloco", f"size_{model}_diloco",
                  {**own, "strategy": "sparseloco", "sparseloco_chunk": 1024, "sparseloco_topk": 16}),
                 (f"size_{model}_one_island", f"size_{model}_diloco", {**own, "strategy": "ddp", "islands": 1})]
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/beyond.py [--out DIR] [--fresh] [--size-only --size-models M,M --device D --precision P]``;
    the exit status (2: bad input)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="rerun every run, ignoring cached summaries")
    parser.add_argument("--out", default=None, help="output folder [bench/out/beyond; with --size-only: "
                        "bench/out/beyond_size]")
    parser.add_argument("--size-only", action="store_true", help="only study 5, SparseLoCo by model size")
    parser.add_argument("--size-models", default=",".join(SIZE_MODELS),
                        help=f"the models of study 5, comma-separated presets [default: {','.join(SIZE_MODELS)}; "
                        "on a GPU e.g. 20m,125m]")
    parser.add_argument("--device", default=None, help="study 5's --device (auto|cpu|cuda|mps) [default: atoll's]")
    parser.add_argument("--precision", default=None, help="study 5's --precision (fp32|bf16) [default: atoll's]")
    parser.add_argument("--size-references", default=None, metavar="RESULTS_JSON",
                        help="study 5's diloco and one-island runs taken from this results.json (e.g. "
                        "bench/out/beyond/results.json) instead of trained, when their summary matches the plan: "
                        "for a change that touches sparseloco only [default: train them]")
    args = parser.parse_args(argv)
    try:
        benchmark(args)
    except AtollError as e:
        return script_error("beyond", e)
    return 0


def argv_of(args: argparse.Namespace) -> list[str]:
    """The flags that change what runs (for the results' command line)."""
    flags = ["--size-only"] if args.size_only else []
    if args.size_models != ",".join(SIZE_MODELS):
        flags += ["--size-models", args.size_models]
    return flags + [f for k in ("device", "precision", "size_references") if getattr(args, k)
                    for f in (f"--{k.replace('_', '-')}", getattr(args, k))]


#: the summary fields a reused reference run must share with its planned settings
MATCHED = ("strategy", "model", "islands", "steps", "sync_every", "vocab_size", "seed", "device", "precision")


def reference_run(refs: dict[str, Any], name: str, own: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of the committed run ``name`` in ``refs`` (a results.json's ``runs``) if study 5 plans it as
    a diloco or one-island run and the summary matches the plan (:data:`MATCHED` and the tokens), else None.

    Raises:
        ConfigError: the committed run exists but was trained on other settings."""
    from atoll.config import build_config
    from atoll.job.device import resolve_device

    if not name.startswith("size_") or own.get("strategy") not in ("diloco", "ddp") or name not in refs:
        return None
    c, r = build_config(base={**BASE, **own, "progress": False}), refs[name]
    flat = c.model_dump()  # every setting by its name
    want = {k: flat.get(k) for k in MATCHED} | {"tokens": c.steps * c.islands * c.batch_size * c.seq_len,
                                                  "device": resolve_device(c.device)}
    if c.strategy == "ddp":  # ddp's summary records no sync interval
        want.pop("sync_every")
    differ = [k for k, v in want.items() if r.get(k) != v]
    if differ:
        raise ConfigError(f"size_references: run {name} was trained with {differ[0]} {r.get(differ[0])!r}, the plan "
                          f"has {want[differ[0]]!r}; drop --size-references to train it")
    return r


def benchmark(args: argparse.Namespace) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    from pathlib import Path

    from atoll.job.model import PRESETS

    extra = {k: v for k, v in (("device", args.device), ("precision", args.precision)) if v is not None}
    models = [m.strip() for m in args.size_models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if unknown or not models:
        raise ConfigError(f"size_models: {unknown[0] if unknown else 'none'} is not a model preset; pass "
                          f"--size-models with some of {', '.join(PRESETS)}")
    plan = [*([] if args.size_only else RUNS), *size_runs(models, extra)]
    out = Path(args.out) if args.out else default_out("beyond_size" if args.size_only else "beyond")
    refs = json.loads(Path(args.size_references).read_text())["runs"] if args.size_references else {}
    reused = {name: r for name, _, own in plan if (r := reference_run(refs, name, own)) is not None}
    runs = {name: reused.get(name) or train_once(out, name, args.fresh, **{**BASE, **own}) for name, _, own in plan}
    rows = []
    for name, ref, own in plan:
        r, base = runs[name], runs[ref]
        alone = runs.get(ref.replace("_diloco", "_one_island")) if name.startswith("size_") else None
        rows.append({"run": name, "steps": r["steps"], "H": r["sync_every"], "rounds": r["steps"] // r["sync_every"],
                     "strategy": r["strategy"], "inner": own.get("inner_optimizer", "adamw"),
                     # sparseloco encodes in its own way (runs trained before summaries said so recorded fp32)
                     "codec": r["codec"] if r["strategy"] in strategy_readers("codec") else None,
                     "density": r.get("sparseloco_density"), "sent_energy": r.get("sparseloco_sent_energy"),
                     "step_ratio": r.get("sparseloco_step_ratio"),
                     "params": r.get("params"), "final_eval_loss": r["final_eval_loss"], "vs": ref,
                     "gap_pct": pct(r["final_eval_loss"], base["final_eval_loss"]),
                     "gap_one_island_pct": pct(r["final_eval_loss"], alone["final_eval_loss"]) if alone else None,
                     "bytes_sent_per_island": r["bytes_sent_per_island"],
                     "fewer_bytes_than_ref": (base["bytes_sent_per_island"] / r["bytes_sent_per_island"]
                                              if r["bytes_sent_per_island"] else None)})  # one island: none
    table = write_results(
        out, {"settings": BASE, "runs": runs, "rows": rows},
        [("run", "run"), ("params", "params"), ("H", "H"), ("rounds", "rounds"), ("inner", "inner"), ("codec", "codec"),
         ("density", "density"), ("energy sent", "sent_energy"), ("step / averaging's", "step_ratio"),
         ("eval loss", "final_eval_loss"), ("vs", "vs"), ("gap %", "gap_pct"),
         ("gap % vs one island", "gap_one_island_pct"), ("bytes/island", "bytes_sent_per_island"),
         ("x fewer bytes than vs", "fewer_bytes_than_ref")],
        rows, "sparseloco by rounds, at a byte budget and by model size, Muon islands, the agreement-weighted "
        "outer step: 4 islands",
        notes=["one seed unless named, one torch thread per run; gap and bytes against the run in 'vs' (same "
               "steps)",
               *([f"taken from {args.size_references} (trained before, code unchanged): {', '.join(reused)}"]
                 if reused else []),
               " ".join(["command: python bench/beyond.py", *argv_of(args)])])
    print(table)


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

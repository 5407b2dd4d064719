"""DiLoCo's defining result in atoll's own runs, and what it depends on: one benchmark, its causes measured.

    python bench/fidelity.py                      # every study (hours on 2 cores; runs are cached, resumable)
    python bench/fidelity.py --only default,h     # some studies
    python bench/fidelity.py --jobs 2             # two runs at a time (one torch thread each)

Every run is the default ``atoll train`` setting (the TrainConfig defaults: model, corpus, vocabulary, batch,
steps, optimizers, 4 islands) with one factor changed, so each study isolates one cause:

- ``default``: the default run of every strategy and its references: one island alone at equal inner steps
  (a quarter of the tokens), ddp at equal tokens, diloco, streaming (its default int4 fragments), decoupled
  failure-free at equal speeds and at speeds 1,1,0.5,0.25, and demo; with the targets checked (diloco at least
  50x fewer bytes than ddp, at least 5% below one island and within 10% of ddp; streaming and decoupled within
  2% of diloco; decoupled's unequal speeds within 2% of its equal speeds; demo below one island). These runs
  are the suite's (``atoll bench suite``): the same folders, trained once.
- ``h``: the sync interval H (1 to 100), with the default outer optimizer and with plain averaging (FedAvg:
  outer lr 1, momentum 0). At H = 1 averaging AdamW updates is all but ddp: the gap opens with H.
- ``outer``: the outer optimizer at the default H: plain averaging, DiLoCo's 0.7/0.9, lighter momentum.
- ``lr``: the inner learning rate, for one island, ddp and diloco alike.
- ``batch``: tokens per island per inner step at equal total tokens (and equal tokens per outer round).
- ``tokens``: tokens per parameter: half and twice the default steps (the scaling-law view of the gap).
- ``warm``: a warm start, as the DiLoCo paper's: ddp for half the steps, then ddp or diloco for the other half.

Writes ``bench/out/fidelity/results.json``, ``results.md`` (the targets, then one table per study: the loss of
one island, ddp and diloco, diloco's gain over one island and gap to ddp) and ``fidelity.png``. Runs on the
``local`` runtime, one torch thread each; a finished run is reused (``--fresh``: all again).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from atoll.bench.common import default_out, pct, script_error, train_once

#: the studies, in the order of results.md
STUDIES = ("default", "h", "outer", "lr", "batch", "tokens", "warm")
#: H of the h study; (outer lr, momentum) of the outer study besides FedAvg (1, 0)
H_VALUES = (1, 5, 50, 100)
OUTER_VALUES = ((0.7, 0.9), (1.0, 0.5))


def defaults(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default run's settings that the studies vary (``base``: settings over the defaults, e.g. --quick's)."""
    from atoll.config import build_config

    c = build_config(overrides={k: v for k, v in (base or {}).items() if k != "progress"})
    return {"steps": c.steps, "batch_size": c.batch_size, "sync_every": c.sync_every, "lr": c.lr,
            "outer_lr": c.outer_lr, "outer_momentum": c.outer_momentum, "warmup_steps": c.warmup_steps}


def runs(study: str, d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (name, settings) of a study's runs; settings are TrainConfig fields over the defaults."""
    one, ddp = {"strategy": "ddp", "islands": 1}, {"strategy": "ddp"}
    if study == "default":
        return [("one_island", one), ("ddp", ddp), ("diloco", {"strategy": "diloco"}),
                ("streaming", {"strategy": "streaming"}), ("decoupled", {"strategy": "decoupled"}),
                ("decoupled_speeds", {"strategy": "decoupled", "island_speeds": [1.0, 1.0, 0.5, 0.25]}),
                ("demo", {"strategy": "demo"})]
    if study == "h":
        return ([(f"diloco_h{h}", {"strategy": "diloco", "sync_every": h}) for h in H_VALUES if h != d["sync_every"]]
                + [(f"fedavg_h{h}", {"strategy": "diloco", "sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.0})
                   for h in (1, d["sync_every"])])
    if study == "outer":  # plain averaging (FedAvg) is the h study's run at the default H
        return [(f"outer_{lr:g}_{m:g}", {"strategy": "diloco", "outer_lr": lr, "outer_momentum": m})
                for lr, m in OUTER_VALUES if (lr, m) != (d["outer_lr"], d["outer_momentum"])]
    if study == "lr":
        return [(f"{kind}_lr{lr:g}", {**settings, "lr": lr}) for lr in (d["lr"] / 3, d["lr"] * 3)
                for kind, settings in (("one_island", one), ("ddp", ddp), ("diloco", {"strategy": "diloco"}))]
    if study == "batch":
        out = []
        for factor in (0.25, 4.0):  # the batch; steps, warmup and H the other way: equal tokens, equal rounds
            b = int(d["batch_size"] * factor)
            s = {"batch_size": b, "steps": int(d["steps"] / factor), "warmup_steps": int(d["warmup_steps"] / factor)}
            out += [(f"one_island_b{b}", {**one, **s}), (f"ddp_b{b}", {**ddp, **s}),
                    (f"diloco_b{b}", {"strategy": "diloco", **s, "sync_every": max(1, int(d["sync_every"] / factor))})]
        return out
    if study == "tokens":
        out = []
        for factor in (0.5, 2.0):
            s = {"steps": int(d["steps"] * factor)}
            out += [(f"one_island_x{factor:g}", {**one, **s}), (f"ddp_x{factor:g}", {**ddp, **s}),
                    (f"diloco_x{factor:g}", {"strategy": "diloco", **s})]
        return out
    if study == "warm":
        half = {"steps": d["steps"] // 2}
        return [("warm_ddp_first_half", {**ddp, **half}), ("warm_then_ddp", {**ddp, **half, "init_from": "@"}),
                ("warm_then_diloco", {"strategy": "diloco", **half, "init_from": "@"})]
    raise ValueError(f"unknown study {study!r}")


def _train(args: tuple[Path, str, dict[str, Any], bool]) -> tuple[str, dict[str, Any]]:
    folder, name, settings, fresh = args
    return name, train_once(folder, name, fresh, tag="fidelity", **settings)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/fidelity.py [--only a,b] [--jobs N] [--out DIR] [--suite DIR] [--fresh]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STUDIES), help=f"studies to run [{','.join(STUDIES)}]")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one torch thread each) [1]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/fidelity]")
    parser.add_argument("--suite", type=Path, default=None, help="the suite's folder, whose runs the default "
                        "study shares [bench/out/suite]")
    parser.add_argument("--fresh", action="store_true", help="train every run again")
    parser.add_argument("--quick", action="store_true", help="the suite's --quick setting (micro model, 20 "
                        "steps): a smoke run of the script, not a measurement")
    args = parser.parse_args(argv)
    try:
        return benchmark(args)
    except Exception as e:  # one line for bad input (e.g. a folder that is not atoll's)
        return script_error("fidelity", e)


def benchmark(args: argparse.Namespace) -> int:
    from atoll.bench.fidelity_report import report

    out = args.out or default_out("fidelity")
    suite = args.suite or default_out("suite")
    studies = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in studies if s not in STUDIES]
    if unknown:
        from atoll.errors import ConfigError

        raise ConfigError(f"only: unknown study '{unknown[0]}'; use some of {', '.join(STUDIES)}")
    from atoll.bench import suite as suite_mod

    # every run as the suite trains its own (one thread, no checkpoints, the suite's link): the default study's
    # runs that are the suite's rows are its very folders, trained once for both
    base = suite_mod.base_settings(argparse.Namespace(quick=args.quick, steps=None, data=None, cache_dir=None,
                                                      vocab_size=None))
    if args.quick:
        base.update(sync_every=10, fragments=2)
    d = defaults(base)
    suite_rows = {name: suite_mod.run_settings(base, settings, args.quick) for name, _, settings in suite_mod.runs()}
    todo: list[tuple[Path, str, dict[str, Any], bool]] = []
    warm: list[tuple[Path, str, dict[str, Any], bool]] = []
    for study in ["default"] + [s for s in studies if s != "default"]:  # the references of every study
        for name, settings in runs(study, d):
            if study == "default" and name in suite_rows:
                todo.append((suite, name, suite_rows[name], args.fresh))
                continue
            job = (out, name, {**base, **settings}, args.fresh)
            (warm if settings.get("init_from") == "@" else todo).append(job)
    summaries: dict[str, dict[str, Any]] = {}
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            summaries.update(pool.map(_train, todo))
    else:
        summaries.update(map(_train, todo))
    for folder, name, settings, fresh in warm:  # after the run they start from
        settings = {**settings, "init_from": str(out / "warm_ddp_first_half")}
        summaries[name] = _train((folder, name, settings, fresh))[1]
    text = report(out, suite, studies, summaries, d)
    print(text)
    print(f"wrote {out}/results.json, results.md, fidelity.png")
    return 0


def gap(a: float, b: float) -> float:
    """``a`` against ``b`` in percent (negative: ``a`` is the lower loss)."""
    return pct(a, b) if b and not math.isnan(b) else math.nan


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

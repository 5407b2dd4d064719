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

The other studies train half the default steps (:func:`study_steps`), so that all of them fit in an afternoon
on 2 cores; their references are one island, ddp and diloco at that length (``*_x0.5``, trained once for all):

- ``h``: the sync interval H (5 and the default 50) with the default outer optimizer, and plain averaging (FedAvg: outer
  lr 1, momentum 0) at H = 1 and the default H: whether averaging every step closes the gap to ddp.
- ``outer``: the outer optimizer at the default H: plain averaging (the h study's run), DiLoCo's 0.7/0.9.
- ``lr``: the inner learning rate (a third, three times), for one island and diloco (ddp at the default).
- ``batch``: tokens per island per inner step (a quarter, four times) at equal total tokens and equal tokens
  per outer round (steps and H the other way).
- ``tokens``: tokens per parameter: half and all of the default steps (the scaling-law view; no run of its own).
- ``warm``: a warm start, as the DiLoCo paper's: ddp for half the steps, then ddp or diloco for the other half.

Writes ``bench/out/fidelity/results.json``, ``results.md`` (the targets, then one table per study: the loss of
one island, ddp and diloco, diloco's gain over one island and gap to ddp) and ``fidelity.png``. Runs on the
``local`` runtime, one torch thread each; a finished run is reused (``--fresh``: all again).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/fidelity.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.benchmarks.common import default_out, pct, script_error, train_once
from atoll.benchmarks.folders import check_out_folder
from atoll.errors import AtollError, ConfigError
from bench.fidelity_report import report, triple

#: the studies, in the order of results.md
STUDIES = ("default", "h", "outer", "batch", "lr", "tokens", "warm")
#: H of the h study with the default outer optimizer (the default H is the references' diloco) and with FedAvg
H_VALUES = (5,)
FEDAVG_H = (1,)  # and the default H
#: (outer lr, momentum) of the outer study besides the default and FedAvg (1, 0)
OUTER_VALUES = ((0.7, 0.9),)
#: the other factors: inner lr, per-island batch and steps, each as a multiple of the default (the tokens
#: study's points are the references, at half the steps, and the default run)
LR_FACTORS = (1 / 3, 3.0)
BATCH_FACTORS = (0.25, 4.0)
TOKEN_FACTORS: tuple[float, ...] = ()


def study_steps(d: dict[str, Any]) -> int:
    """The inner steps of every study but ``default``: half the default's."""
    return max(2, d["steps"] // 2)


def defaults(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default run's settings that the studies vary (``base``: settings over the defaults, e.g. --quick's)."""
    from atoll.config import build_config

    c = build_config(base={k: v for k, v in (base or {}).items() if k != "progress"})
    own = c.strategy_config  # the default strategy's (diloco): H, the inner and the outer rates
    return {"steps": c.steps, "batch_size": c.batch_size, "sync_every": own.sync_every, "lr": own.lr,
            "outer_lr": own.outer_lr, "outer_momentum": own.outer_momentum, "warmup_steps": c.warmup_steps}


def runs(study: str, d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (name, settings) of a study's runs; settings are TrainConfig fields over the defaults ``d``.

    ``references`` is one island, ddp and diloco at the studies' length (:func:`study_steps`), which every
    study but ``default`` compares with.

    Raises:
        ValueError: an unknown study.
    """
    one, ddp, dil = {"strategy": "ddp", "islands": 1}, {"strategy": "ddp"}, {"strategy": "diloco"}
    if study == "default":
        return [("one_island", one), ("ddp", ddp), ("diloco", dil),
                ("streaming", {"strategy": "streaming"}), ("decoupled", {"strategy": "decoupled"}),
                ("decoupled_speeds", {"strategy": "decoupled", "island_speeds": [1.0, 1.0, 0.5, 0.25]}),
                ("demo", {"strategy": "demo"})]
    steps = study_steps(d)
    s = {"steps": steps}
    if study == "references":
        return [("one_island_x0.5", {**one, **s}), ("ddp_x0.5", {**ddp, **s}), ("diloco_x0.5", {**dil, **s})]
    if study == "h":
        return ([(f"diloco_h{h}", {**dil, **s, "sync_every": h}) for h in H_VALUES]
                + [(f"fedavg_h{h}", {**dil, **s, "sync_every": h, "outer_lr": 1.0, "outer_momentum": 0.0})
                   for h in (*FEDAVG_H, d["sync_every"])])
    if study == "outer":  # plain averaging (FedAvg) is the h study's run at the default H
        return [(f"outer_{lr:g}_{m:g}", {**dil, **s, "outer_lr": lr, "outer_momentum": m})
                for lr, m in OUTER_VALUES]
    if study == "lr":
        return [(f"{kind}_lr{d['lr'] * f:.2g}", {**settings, **s, "lr": d["lr"] * f}) for f in LR_FACTORS
                for kind, settings in (("one_island", one), ("diloco", dil))]  # ddp: at the default lr only
    if study == "batch":
        out = []
        for f in BATCH_FACTORS:  # the batch; steps, warmup and H the other way: equal tokens, equal rounds
            b = int(d["batch_size"] * f)
            sb = {"batch_size": b, "steps": int(steps / f), "warmup_steps": int(d["warmup_steps"] / f)}
            out += [(f"one_island_b{b}", {**one, **sb}), (f"ddp_b{b}", {**ddp, **sb}),
                    (f"diloco_b{b}", {**dil, **sb, "sync_every": max(1, int(d["sync_every"] / f))})]
        return out
    if study == "tokens":
        out = []
        for f in TOKEN_FACTORS:
            st = {"steps": max(2, int(d["steps"] * f))}
            out += [(f"one_island_x{f:g}", {**one, **st}), (f"ddp_x{f:g}", {**ddp, **st}),
                    (f"diloco_x{f:g}", {**dil, **st})]
        return out
    if study == "warm":
        half = {"steps": max(1, steps // 2)}
        return [("warm_ddp_first_half", {**ddp, **half}), ("warm_then_ddp", {**ddp, **half, "init_from": "@"}),
                ("warm_then_diloco", {**dil, **half, "init_from": "@"})]
    raise ValueError(f"unknown study {study!r}")


def _train(args: tuple[Path, str, dict[str, Any], bool]) -> tuple[str, dict[str, Any]]:
    folder, name, settings, fresh = args
    return name, train_once(folder, name, fresh, tag="fidelity", **settings)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/fidelity.py [--only a,b] [--jobs N] [--out DIR] [--suite DIR] [--data ...] [--fresh]``;
    returns the exit status (2: bad input, one line on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(STUDIES), help=f"studies to run [{','.join(STUDIES)}]")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one torch thread each) [1]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/fidelity]")
    parser.add_argument("--suite", type=Path, default=None, help="the suite's folder, whose runs the default "
                        "study shares [bench/out/suite]")
    parser.add_argument("--data", default=None, help="corpus (as atoll train --data) [default: stdlib]")
    parser.add_argument("--cache-dir", default=None, help="tokenizer/token cache (as atoll train)")
    parser.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary (as atoll train)")
    parser.add_argument("--fresh", action="store_true", help="train every run again")
    parser.add_argument("--quick", action="store_true", help="the suite's --quick setting (micro model, 20 "
                        "steps): a smoke run of the script, not a measurement")
    args = parser.parse_args(argv)
    try:
        return benchmark(args)
    except AtollError as e:  # one line for bad input (a bug keeps its traceback)
        return script_error("fidelity", e)


def benchmark(args: argparse.Namespace) -> int:
    out = args.out or default_out("fidelity")
    suite = args.suite or default_out("suite-quick" if args.quick else "suite")
    if out.resolve() == suite.resolve():
        raise ConfigError(f"out: '{out}' is also --suite; the studies and the suite's runs need folders of their own")
    check_out_folder(out, "out")
    check_out_folder(suite, "suite")
    if args.jobs < 1:
        raise ConfigError(f"jobs: must be at least 1 (got {args.jobs}); set --jobs")
    studies = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in studies if s not in STUDIES]
    if not studies:
        raise ConfigError(f"only: no study named; use some of {', '.join(STUDIES)}")
    if unknown:
        raise ConfigError(f"only: unknown study '{unknown[0]}'; use some of {', '.join(STUDIES)}")
    from atoll.benchmarks import suite as suite_mod

    # every run as the suite trains its own (one thread, no checkpoints, the suite's link): the default study's
    # runs that are the suite's rows are its very folders, trained once for both
    base = suite_mod.base_settings(argparse.Namespace(quick=args.quick, steps=None, data=args.data,
                                                      cache_dir=args.cache_dir, vocab_size=args.vocab_size))
    if args.quick:
        base.update(sync_every=10, fragments=2)
    d = defaults(base)
    suite_rows = {name: suite_mod.run_settings(base, settings, args.quick) for name, _, settings in suite_mod.runs()}
    todo: list[tuple[Path, str, dict[str, Any], bool]] = []
    warm: list[tuple[Path, str, dict[str, Any], bool]] = []
    order = ["default"] + (["references"] if set(studies) - {"default"} else [])  # every study's references
    for study in order + [s for s in studies if s != "default"]:
        for name, settings in runs(study, d):
            if study == "default" and name in suite_rows:
                todo.append((suite, name, suite_rows[name], args.fresh))
                continue
            job = (out, name, {**base, **settings}, args.fresh)
            (warm if settings.get("init_from") == "@" else todo).append(job)
    def train_all(jobs: list[tuple[Path, str, dict[str, Any], bool]]) -> dict[str, dict[str, Any]]:
        if args.jobs > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(min(args.jobs, len(jobs))) as pool:
                return dict(pool.map(_train, jobs))
        return dict(map(_train, jobs))

    summaries = train_all(todo)
    # the warm starts, side by side, once the run they start from has trained
    summaries.update(train_all([(f, n, {**s, "init_from": str(out / "warm_ddp_first_half")}, fresh)
                                for f, n, s, fresh in warm]))
    rows = {s: study_rows(s, summaries, d) for s in studies if s != "default"}
    text = report(out, suite, rows, summaries, d)
    print(text)
    print(f"wrote {out}/results.json, results.md, fidelity.png")
    return 0


def study_rows(study: str, summaries: dict[str, dict[str, Any]], d: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per setting of a study: one island, ddp and diloco (or the study's variant) side by side, at
    the studies' length (:func:`study_steps`) and otherwise the default setting ``d``. Missing runs: NaN."""
    def row(one: str, ddp: str, dil: str, label: str, x: float | None = None) -> dict[str, Any]:
        return {**triple(summaries, one, ddp, dil, label), "x": x}  # x: the plotted value of the factor

    ref = ("one_island_x0.5", "ddp_x0.5", "diloco_x0.5")
    if study == "h":
        rows = []
        for h in sorted({*H_VALUES, *FEDAVG_H, d["sync_every"]}):  # diloco at H=1: FedAvg only
            dil = ref[2] if h == d["sync_every"] else f"diloco_h{h}"
            r = row(ref[0], ref[1], dil, f"H={h}" + (" (default)" if h == d["sync_every"] else ""), h)
            fed = summaries.get(f"fedavg_h{h}")
            r["fedavg"] = float(fed["final_eval_loss"]) if fed else None
            r["fedavg_vs_ddp"] = pct(r["fedavg"], r["ddp"]) if fed and r["ddp"] else None
            rows.append(r)
        return rows
    if study == "outer":
        rows = [row(*ref, f"{d['outer_lr']:g} / {d['outer_momentum']:g} (default)"),
                row(ref[0], ref[1], f"fedavg_h{d['sync_every']}", "1 / 0 (FedAvg, plain averaging)")]
        return rows + [row(ref[0], ref[1], f"outer_{lr:g}_{m:g}",
                           f"{lr:g} / {m:g}" + (" (DiLoCo paper)" if (lr, m) == (0.7, 0.9) else ""))
                       for lr, m in OUTER_VALUES]
    if study == "lr":
        rows = [row(*(f"{k}_lr{d['lr'] * f:.2g}" for k in ("one_island", "ddp", "diloco")), f"lr {d['lr'] * f:.2g}")
                for f in LR_FACTORS]
        return sorted([*rows, row(*ref, f"lr {d['lr']:.2g} (default)")], key=lambda r: float(r["setting"].split()[1]))
    if study == "batch":
        rows = [row(*ref, f"batch {d['batch_size']} x {study_steps(d)} steps (default)", d["batch_size"])]
        for f in BATCH_FACTORS:
            b = int(d["batch_size"] * f)
            rows.append(row(f"one_island_b{b}", f"ddp_b{b}", f"diloco_b{b}",
                            f"batch {b} x {int(study_steps(d) / f)} steps", b))
        return sorted(rows, key=lambda r: int(r["setting"].split()[1]))
    if study == "tokens":
        kinds = ("one_island", "ddp", "diloco")
        sets = [(f, tuple(f"{k}_x{f:g}" for k in kinds)) for f in TOKEN_FACTORS] + [(0.5, ref), (1.0, kinds)]
        rows = []
        for f, names in sets:
            s = summaries.get(names[1])
            label = f"{int(d['steps'] * f)} steps" + (f", {s['tokens'] / s['params']:.0f} tokens/param" if s else "")
            rows.append(row(*names, label, s["tokens"] / s["params"] if s else None))
        return rows
    if study == "warm":
        return [row(*ref, "cold start (for comparison)"),
                row("warm_ddp_first_half", "warm_then_ddp", "warm_then_diloco",
                    "warm start (one island column: the ddp run it starts from)")]
    return []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The tables, checks and plot of ``python bench/fidelity.py`` (:mod:`bench.fidelity`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import markdown_table, pct, write_results

#: the default study's runs, by the names of the suite's rows they share (see bench.fidelity.runs)
DEFAULT_RUNS = ("one_island", "ddp", "diloco", "streaming", "decoupled", "decoupled_speeds", "demo")


def _loss(s: dict[str, Any] | None) -> float:
    return float(s["final_eval_loss"]) if s else math.nan


def _g(a: float, b: float) -> float:
    return pct(a, b) if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def checks(summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of the default run, each with its measured value and whether it holds."""
    get = {n: _loss(summaries.get(n)) for n in DEFAULT_RUNS}
    dil = summaries.get("diloco")
    red = dil["reduction_vs_ddp"] if dil and dil.get("reduction_vs_ddp") else math.nan
    items = [
        ("diloco sends at least 50x fewer bytes than ddp", red, red >= 50, f"{red:,.0f}x"),
        ("diloco at least 5% below one island (equal inner steps)", _g(get["diloco"], get["one_island"]),
         _g(get["diloco"], get["one_island"]) <= -5, None),
        ("diloco within 10% of ddp (equal tokens)", _g(get["diloco"], get["ddp"]),
         _g(get["diloco"], get["ddp"]) <= 10, None),
        ("streaming (int4) within 2% of diloco", _g(get["streaming"], get["diloco"]),
         abs(_g(get["streaming"], get["diloco"])) <= 2, None),
        ("decoupled (failure-free, equal speeds) within 2% of diloco", _g(get["decoupled"], get["diloco"]),
         abs(_g(get["decoupled"], get["diloco"])) <= 2, None),
        ("decoupled at speeds 1,1,0.5,0.25 within 2% of its equal speeds",
         _g(get["decoupled_speeds"], get["decoupled"]),
         abs(_g(get["decoupled_speeds"], get["decoupled"])) <= 2, None),
        ("demo below one island", _g(get["demo"], get["one_island"]), _g(get["demo"], get["one_island"]) < 0, None),
    ]
    return [{"target": t, "value": v, "holds": bool(ok) and not math.isnan(v),
             "shown": shown if shown else (f"{v:+.1f}%" if not math.isnan(v) else "-")} for t, v, ok, shown in items]


def triple(summaries: dict[str, dict[str, Any]], one: str, ddp: str, dil: str, label: str) -> dict[str, Any]:
    """One study row: the final held-out loss (nats/token) of one island, ddp and diloco (runs by name; NaN
    where missing), diloco's gap to each in percent and its byte reduction against ddp."""
    o, d, x = (_loss(summaries.get(n)) for n in (one, ddp, dil))
    row = {"setting": label, "one_island": o, "ddp": d, "diloco": x, "diloco_vs_one": _g(x, o),
           "diloco_vs_ddp": _g(x, d), "bytes": (summaries.get(dil) or {}).get("reduction_vs_ddp")}
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}  # None: "-"


COLUMNS = [("setting", "setting"), ("one island", "one_island"), ("ddp", "ddp"), ("diloco", "diloco"),
           ("diloco vs one island", "diloco_vs_one", lambda v: f"{v:+.1f}%"),
           ("diloco vs ddp", "diloco_vs_ddp", lambda v: f"{v:+.1f}%"),
           ("fewer bytes than ddp", "bytes", lambda v: f"{v:,.0f}x")]
#: every study but ``tokens`` trains half the default steps (bench.fidelity.study_steps)
TITLES = {"h": "The sync interval H (default outer optimizer; FedAvg: outer lr 1, momentum 0), half the steps",
          "outer": "The outer optimizer (outer lr / Nesterov momentum) at the default H, half the steps",
          "lr": "The inner learning rate (one island and diloco alike; ddp at the default), half the steps",
          "batch": "Tokens per island per inner step at equal total tokens and equal tokens per outer round "
                   "(steps and H the other way), half the steps",
          "tokens": "Tokens per parameter (half and all of the default steps)",
          "warm": "A warm start: ddp for a quarter of the steps, then ddp or diloco for another quarter, against "
                  "a cold start of half the steps (equal tokens)"}


def report(out: Path, suite: Path, studies: dict[str, list[dict[str, Any]]],
           summaries: dict[str, dict[str, Any]], d: dict[str, Any]) -> str:
    """Write results.json, results.md and fidelity.png into ``out``; return the Markdown.

    ``studies``: each study's rows (:func:`triple`); ``summaries``: every run's summary.json by name; ``d``: the
    default settings; ``suite``: the suite's folder, where the default study's curves are read from."""
    results: dict[str, Any] = {"defaults": d, "checks": checks(summaries), "studies": studies, "runs": summaries}
    text = markdown_table([("target", "target"), ("measured", "shown"),
                           ("holds", "holds", lambda v: "yes" if v else "**no**")], results["checks"],
                          title="The default run's targets")
    for study, rows in results["studies"].items():
        cols = COLUMNS + ([("FedAvg", "fedavg"), ("FedAvg vs ddp", "fedavg_vs_ddp", lambda v: f"{v:+.1f}%")]
                          if study == "h" else [])
        text += "\n" + markdown_table(cols, rows, title=TITLES[study])
    write_results(out, results, [("target", "target"), ("measured", "shown")], results["checks"])
    (out / "results.md").write_text(text)
    plot(results, out / "fidelity.png", suite, out)
    return text


def plot(results: dict[str, Any], out_png: Path, suite: Path, out: Path) -> None:
    """The default runs' loss curves; diloco's gap to ddp and one island against H, tokens per parameter and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from atoll.analysis.curves import loss_vs_tokens

    fig, ax = plt.subplots(1, 4, figsize=(21, 4.6))
    for name in DEFAULT_RUNS:
        for folder in (suite, out):
            if (folder / name / "metrics.jsonl").is_file():
                c = loss_vs_tokens(folder / name)
                ax[0].plot(c.xs, c.losses, marker=".", label=name)
                break
    ax[0].set_xlabel("training tokens (all islands)")
    ax[0].set_ylabel("held-out loss (nats/token)")
    ax[0].set_title("the default run of each strategy")
    ax[0].legend(fontsize=7)
    studies = results["studies"]
    series = [(ax[1], "h", "H (inner steps between syncs)"), (ax[2], "tokens", "training tokens per parameter"),
              (ax[3], "batch", "batch (sequences per island per inner step)")]
    for axis, study, key in series:
        lines = [("diloco_vs_ddp", "diloco vs ddp", "-"), ("diloco_vs_one", "diloco vs one island", "--")]
        if study == "h":
            lines.append(("fedavg_vs_ddp", "FedAvg (outer lr 1, momentum 0) vs ddp", ":"))
        for field, label, ls in lines:
            pts = [(r["x"], r[field]) for r in studies.get(study, []) if r.get("x") and r.get(field) is not None]
            if pts:
                axis.plot(*zip(*pts, strict=True), ls=ls, marker="o", label=label)
                axis.set_xscale("log")
        axis.set_xlabel(key)
        axis.axhline(0, color="grey", lw=0.8)
        axis.set_ylabel("% (negative: diloco or FedAvg lower)")
        axis.set_title({"h": "the sync interval H", "tokens": "tokens per parameter",
                        "batch": "tokens per island per inner step"}[study], fontsize=9)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)

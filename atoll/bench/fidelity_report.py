"""The tables, checks and plot of ``python bench/fidelity.py`` (:mod:`atoll.bench.fidelity`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from atoll.bench.common import markdown_table, pct, write_results

#: the default study's runs, by the names of the suite's rows they share (see atoll.bench.fidelity.runs)
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
        ("decoupled at speeds 1,1,0.5,0.25 within 2% of its equal speeds", _g(get["decoupled_speeds"], get["decoupled"]),
         abs(_g(get["decoupled_speeds"], get["decoupled"])) <= 2, None),
        ("demo below one island", _g(get["demo"], get["one_island"]), _g(get["demo"], get["one_island"]) < 0, None),
    ]
    return [{"target": t, "value": v, "holds": bool(ok) and not math.isnan(v),
             "shown": shown if shown else (f"{v:+.1f}%" if not math.isnan(v) else "-")} for t, v, ok, shown in items]


def _triple(summaries: dict[str, dict[str, Any]], one: str, ddp: str, dil: str, label: str) -> dict[str, Any]:
    o, d, x = (_loss(summaries.get(n)) for n in (one, ddp, dil))
    return {"setting": label, "one_island": o, "ddp": d, "diloco": x, "diloco_vs_one": _g(x, o),
            "diloco_vs_ddp": _g(x, d), "bytes": (summaries.get(dil) or {}).get("reduction_vs_ddp")}


def study_rows(study: str, summaries: dict[str, dict[str, Any]], d: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per setting of a study: one island, ddp and diloco (or the study's variants) side by side."""
    if study == "h":
        from atoll.bench.fidelity import H_VALUES

        rows = []
        for h in sorted({*H_VALUES, d["sync_every"]}):
            dil = "diloco" if h == d["sync_every"] else f"diloco_h{h}"
            row = _triple(summaries, "one_island", "ddp", dil, f"H={h}")
            fed = summaries.get(f"fedavg_h{h}")
            row["fedavg"] = _loss(fed) if fed else None
            row["fedavg_vs_ddp"] = _g(_loss(fed), row["ddp"]) if fed else None
            rows.append(row)
        return rows
    if study == "outer":
        from atoll.bench.fidelity import OUTER_VALUES

        rows = [_triple(summaries, "one_island", "ddp", "diloco", f"{d['outer_lr']:g} / {d['outer_momentum']:g} (default)"),
                _triple(summaries, "one_island", "ddp", f"fedavg_h{d['sync_every']}", "1 / 0 (FedAvg, plain averaging)")]
        for lr, m in OUTER_VALUES:
            if (lr, m) != (d["outer_lr"], d["outer_momentum"]):
                rows.append(_triple(summaries, "one_island", "ddp", f"outer_{lr:g}_{m:g}",
                                    f"{lr:g} / {m:g}" + (" (DiLoCo paper)" if (lr, m) == (0.7, 0.9) else "")))
        return rows
    if study == "lr":
        rows = []
        for lr in (d["lr"] / 3, d["lr"], d["lr"] * 3):
            sfx = "" if lr == d["lr"] else f"_lr{lr:g}"
            rows.append(_triple(summaries, f"one_island{sfx}", f"ddp{sfx}", f"diloco{sfx}",
                                f"lr {lr:.3g}" + (" (default)" if not sfx else "")))
        return rows
    if study == "batch":
        rows = []
        for factor in (0.25, 1.0, 4.0):
            b = int(d["batch_size"] * factor)
            sfx = "" if factor == 1 else f"_b{b}"
            rows.append(_triple(summaries, f"one_island{sfx}", f"ddp{sfx}", f"diloco{sfx}",
                                f"batch {b} x {int(d['steps'] / factor)} steps" + (" (default)" if not sfx else "")))
        return rows
    if study == "tokens":
        rows = []
        for factor in (0.5, 1.0, 2.0):
            sfx = "" if factor == 1 else f"_x{factor:g}"
            s = summaries.get(f"ddp{sfx}")
            label = f"{int(d['steps'] * factor)} steps" + (f", {s['tokens'] / s['params']:.0f} tokens/param" if s else "")
            rows.append(_triple(summaries, f"one_island{sfx}", f"ddp{sfx}", f"diloco{sfx}", label))
        return rows
    if study == "warm":
        row = _triple(summaries, "warm_ddp_first_half", "warm_then_ddp", "warm_then_diloco",
                      "ddp for half the steps, then (one island: where it started)")
        return [row]
    return []


COLUMNS = [("setting", "setting"), ("one island", "one_island"), ("ddp", "ddp"), ("diloco", "diloco"),
           ("diloco vs one island", "diloco_vs_one", lambda v: f"{v:+.1f}%"),
           ("diloco vs ddp", "diloco_vs_ddp", lambda v: f"{v:+.1f}%"),
           ("fewer bytes than ddp", "bytes", lambda v: f"{v:,.0f}x")]
TITLES = {"h": "The sync interval H (default outer optimizer; FedAvg: outer lr 1, momentum 0)",
          "outer": "The outer optimizer (outer lr / Nesterov momentum) at the default H",
          "lr": "The inner learning rate (every strategy alike)",
          "batch": "Tokens per island per inner step, at equal total tokens and equal tokens per outer round",
          "tokens": "Tokens per parameter (steps x 0.5, 1, 2)",
          "warm": "A warm start: ddp for half the steps, then ddp or diloco for the other half (equal tokens)"}


def report(out: Path, suite: Path, studies: list[str], summaries: dict[str, dict[str, Any]],
           d: dict[str, Any]) -> str:
    """Write results.json, results.md and fidelity.png; return the Markdown."""
    results: dict[str, Any] = {"defaults": d, "checks": checks(summaries),
                               "studies": {s: study_rows(s, summaries, d) for s in studies if s != "default"},
                               "runs": summaries}
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
    """The default runs' loss curves, and diloco's gap to ddp against H, batch and tokens per parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from atoll.analysis.curves import loss_vs_tokens

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
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
    if "h" in studies:
        hs = [int(r["setting"].split("=")[1]) for r in studies["h"]]
        ax[1].plot(hs, [r["diloco_vs_ddp"] for r in studies["h"]], marker="o", label="diloco (default outer)")
        fed = [(h, r["fedavg_vs_ddp"]) for h, r in zip(hs, studies["h"], strict=True) if r["fedavg_vs_ddp"] is not None]
        if fed:
            ax[1].plot(*zip(*fed, strict=True), marker="s", label="FedAvg (outer lr 1, momentum 0)")
        ax[1].plot(hs, [r["diloco_vs_one"] for r in studies["h"]], ls="--", marker="o", label="diloco vs one island")
        ax[1].set_xscale("log")
        ax[1].set_xlabel("H (inner steps between syncs)")
    ax[1].axhline(0, color="grey", lw=0.8)
    ax[1].set_ylabel("% against ddp (or one island)")
    ax[1].legend(fontsize=7)
    for study, marker in (("batch", "o"), ("tokens", "s")):
        if study in studies:
            ax[2].plot(range(len(studies[study])), [r["diloco_vs_ddp"] for r in studies[study]], marker=marker,
                       label=f"{study}: " + " | ".join(r["setting"].split(",")[0] for r in studies[study]))
    ax[2].axhline(0, color="grey", lw=0.8)
    ax[2].set_xticks([0, 1, 2], ["x 1/4 (batch) / x 1/2 (tokens)", "default", "x 4 / x 2"])
    ax[2].set_ylabel("diloco vs ddp, %")
    ax[2].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)

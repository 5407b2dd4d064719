"""Plots of one or several runs side by side: held-out loss against tokens, simulated wall time and bytes sent.

    atoll report runs/ddp runs/diloco runs/streaming --out cmp.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from atoll.errors import AtollError  # noqa: E402
from atoll.job.metrics import read_metrics  # noqa: E402


def run_label(run_dir: Path) -> str:
    """A legend label from a run's summary (strategy, islands, H), or its folder name."""
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        label = f"{s['strategy']} K={s['islands']}"
        if s["strategy"] not in ("ddp", "demo"):
            label += f" H={s['sync_every']}"
        if s.get("codec", "fp32") != "fp32":
            label += f" {s['codec']}"
        return label
    return Path(run_dir).name


def plot_runs(run_dirs: list[Path], out_png: Path) -> Path:
    """Draw held-out loss against tokens, simulated wall time (s) and bytes sent per island; save a PNG.

    Bytes are on a log axis; a run that sent nothing (one island) has no curve there.

    Args:
        run_dirs: atoll run folders (each with a ``metrics.jsonl``).
        out_png: where to write the figure.

    Raises:
        AtollError: a folder without ``metrics.jsonl``, without an evaluation, or with a damaged one
            (DataError, a subclass: a line that is not an event).
    """
    fig, (ax_tok, ax_time, ax_bytes) = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        if not path.is_file():
            raise AtollError(f"report: '{run}' has no metrics.jsonl; pass atoll run folders")
        evals = [e for e in read_metrics(path) if e["event"] == "eval"]
        needed = ("tokens", "eval_loss", "sim_wall_s")
        bad = next((e for e in evals if not all(isinstance(e.get(k), (int, float)) for k in needed)), None)
        if bad is not None:
            raise AtollError(f"report: an eval event of '{path}' lacks {', '.join(needed)} (step {bad.get('step')}); "
                             "the file is damaged or not atoll's")
        if not evals:
            raise AtollError(f"report: '{run}' has no evaluation yet (its metrics.jsonl holds none); pass a run "
                             "that has evaluated at least once")
        label = run_label(Path(run))
        ax_tok.plot([e["tokens"] for e in evals], [e["eval_loss"] for e in evals], marker=".", label=label)
        ax_time.plot([e["sim_wall_s"] for e in evals], [e["eval_loss"] for e in evals], marker=".", label=label)
        sent = [(e.get("bytes_sent_per_island", 0.0), e["eval_loss"]) for e in evals]
        sent = [(b, v) for b, v in sent if b > 0]
        ax_bytes.plot([b for b, _ in sent], [v for _, v in sent], marker=".", label=label)
    ax_tok.set_xlabel("training tokens (all islands)")
    ax_time.set_xlabel("simulated wall time (s)")
    ax_bytes.set_xlabel("bytes sent per island (log)")
    ax_bytes.set_xscale("log")
    for ax in (ax_tok, ax_time, ax_bytes):
        ax.set_ylabel("held-out loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("atoll: held-out loss of the global model")
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png

"""Plots of one or several runs side by side: held-out and training loss against tokens, simulated wall time
and bytes sent, each run labelled by what sets it apart from the others.

    atoll report runs/ddp runs/diloco runs/streaming          # runs/report.png
    atoll report runs/a runs/b --names baseline,momentum-0.9 --out cmp.png
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from atoll.errors import AtollError, ConfigError
from atoll.job.figures import pyplot
from atoll.job.metrics import read_metrics

#: settings that do not change what a run computes, or that every label already shows: left out of labels
_NOT_IN_LABEL = {"out", "cache_dir", "progress", "progress_every", "tracker", "threads", "checkpoint_every",
                 "collective_timeout_s", "collective_link_mbps", "collective_link_latency_ms", "strategy", "islands",
                 "sync_every", "codec"}


def _settings(run_dir: Path) -> dict[str, Any]:
    """A run's settings: its ``config.json`` (all of them), else what its ``summary.json`` holds, else none."""
    for name in ("config.json", "summary.json"):
        path = Path(run_dir) / name
        if path.is_file():
            try:
                settings = json.loads(path.read_text())
            except ValueError:
                continue
            if isinstance(settings, dict):
                return settings
    return {}


def _short(value: Any) -> str:
    if isinstance(value, str) and ("/" in value or "\\" in value):
        return Path(value).name or value  # a corpus or model path: its last part
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(_short(v) for v in value)
    return str(value)


def run_label(run_dir: Path) -> str:
    """A run's base legend label from its settings (strategy, islands, H, codec), or its folder name."""
    s = _settings(run_dir)
    if "strategy" not in s:
        return Path(run_dir).name
    label = f"{s['strategy']} K={s.get('islands', '?')}"
    if s["strategy"] not in ("ddp", "demo"):
        label += f" H={s.get('sync_every', '?')}"
    if s.get("codec", "fp32") != "fp32":
        label += f" {s['codec']}"
    return label


def run_labels(run_dirs: list[Path], names: list[str] | None = None) -> list[str]:
    """Legend labels that tell runs apart: each run's :func:`run_label` and the settings in which the runs
    differ (``outer_momentum=0.9``, ``seq_len=256``, the corpus' file name), or the folder name where two are
    still alike; or ``names`` as given.

    Raises:
        ConfigError: ``names`` does not give one name per run.
    """
    if names is not None:
        if len(names) != len(run_dirs):
            raise ConfigError(f"names: {len(names)} names for {len(run_dirs)} runs; give one name per RUN_DIR, "
                              "comma-separated")
        return list(names)
    from functools import cache

    from atoll.config import build_config

    @cache
    def defaults(strategy: str) -> dict[str, Any]:  # the settings a run of ``strategy`` gets unless told
        try:
            return build_config(overrides={"strategy": strategy}).model_dump(mode="json")
        except AtollError:
            return {}

    settings = [_settings(r) for r in run_dirs]
    keys = sorted({k for s in settings for k in s} - _NOT_IN_LABEL)
    differ = [k for k in keys if len({json.dumps(s.get(k), sort_keys=True) for s in settings}) > 1
              and all(not isinstance(s.get(k), dict) for s in settings)]
    labels = []
    for run, s in zip(run_dirs, settings, strict=True):
        label = run_label(run)
        own = defaults(str(s.get("strategy", ""))) if differ else {}
        extra = [f"{k}={_short(s[k])}" for k in differ if k in s and (k not in own or s[k] != own[k])]
        labels.append(" ".join([label, *extra]))
    if len(set(labels)) < len(labels):  # alike in every setting read: the folders tell them apart
        labels = [f"{label} ({Path(r).name})" if labels.count(label) > 1 else label
                  for r, label in zip(run_dirs, labels, strict=True)]
    return labels


def default_out(run_dirs: list[Path]) -> Path:
    """Where ``atoll report`` writes without ``--out``: ``<RUN_DIR>/report.png`` for one run, else
    ``report.png`` in the folder that holds the runs (their common parent), else beside the first run."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report.png"
    try:
        common = Path(os.path.commonpath([str(Path(r).resolve()) for r in run_dirs]))
    except ValueError:  # different drives
        common = Path(run_dirs[0]).resolve().parent
    if common == Path(common.anchor):
        common = Path(run_dirs[0]).resolve().parent
    return common / "report.png"


def check_runs(run_dirs: list[Path]) -> None:
    """Refuse a path that is not a run folder (no ``metrics.jsonl``): before anything else is checked.

    Raises:
        AtollError: the first such path, named, with the fix.
    """
    for run in run_dirs:
        if not (Path(run) / "metrics.jsonl").is_file():
            raise AtollError(f"report: '{run}' has no metrics.jsonl; pass atoll run folders")


def image_path(out: Path) -> Path:
    """``out`` as the figure's file: with ``.png`` added when it has no suffix (matplotlib's default format).

    Raises:
        ConfigError: a suffix matplotlib writes no image for (``.txt``, ``.json``, ...; field ``out``).
    """
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(out)
    if not out.suffix:
        return out.with_suffix(".png")
    if out.suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        raise ConfigError(f"out: '{out}' is not an image file name (matplotlib writes no '{out.suffix}'); pass "
                          "e.g. --out report.png (or .svg, .pdf)")
    return out


def plot_runs(run_dirs: list[Path], out_png: Path, labels: list[str] | None = None) -> Path:
    """Draw held-out loss (markers) and training loss (thin line, the islands' mean) against tokens, simulated
    wall time (s) and bytes sent per island; save a PNG.

    Bytes are on a log axis; a run that sent nothing (one island) has no curve there.

    Args:
        run_dirs: atoll run folders (each with a ``metrics.jsonl``).
        out_png: where to write the figure.
        labels: one legend label per run (default: :func:`run_labels`, what differs between the runs).

    Raises:
        AtollError: a folder without ``metrics.jsonl``, without an evaluation, or with a damaged one
            (DataError, a subclass: a line that is not an event); ``labels`` of another length, or ``out_png``
            not an image file name (ConfigError; without a suffix, ``.png`` is added).
    """
    needed = ("tokens", "eval_loss", "sim_wall_s")
    curves = []
    check_runs(run_dirs)
    out_png = image_path(out_png)
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        events = read_metrics(path)
        evals = [e for e in events if e["event"] == "eval"]
        bad = next((e for e in evals if not all(isinstance(e.get(k), (int, float)) for k in needed)), None)
        if bad is not None:
            raise AtollError(f"report: an eval event of '{path}' lacks {', '.join(needed)} (step {bad.get('step')}); "
                             "the file is damaged or not atoll's")
        if not evals:
            raise AtollError(f"report: '{run}' has no evaluation yet (its metrics.jsonl holds none); pass a run "
                             "that has evaluated at least once")
        trains = [e for e in events if e["event"] == "train"
                  and all(isinstance(e.get(k), (int, float)) for k in ("tokens", "loss", "sim_wall_s"))]
        curves.append((evals, trains))
    labels = run_labels([Path(r) for r in run_dirs], labels)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xs = (("tokens", "training tokens (all islands)"), ("sim_wall_s", "simulated wall time (s)"),
          ("bytes_sent_per_island", "bytes sent per island (log)"))
    for (evals, trains), label in zip(curves, labels, strict=True):
        color = None
        for ax, (key, _) in zip(axes, xs, strict=True):
            ev = [(e.get(key, 0.0), e["eval_loss"]) for e in evals]
            tr = [(e.get(key, 0.0), e["loss"]) for e in trains]
            if key == "bytes_sent_per_island":  # log axis: a point at 0 bytes has no place
                ev, tr = [p for p in ev if p[0] > 0], [p for p in tr if p[0] > 0]
            (line,) = ax.plot([x for x, _ in ev], [y for _, y in ev], marker=".", label=label, color=color)
            color = line.get_color()
            if tr:
                ax.plot([x for x, _ in tr], [y for _, y in tr], lw=0.8, alpha=0.45, color=color)
    for ax, (key, xlabel) in zip(axes, xs, strict=True):
        ax.set_xlabel(xlabel)
        if key == "bytes_sent_per_island":
            ax.set_xscale("log")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("atoll: held-out loss of the global model (markers) and training loss, islands' mean (thin)")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png

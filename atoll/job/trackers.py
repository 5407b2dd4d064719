"""Experiment trackers: a run's events mirrored, as ``metrics.jsonl`` receives them, to TensorBoard event
files or to Weights & Biases (online, or offline with ``WANDB_MODE=offline``).

    atoll train --tracker tensorboard                  # <out>/tensorboard: tensorboard --logdir runs
    WANDB_MODE=offline atoll train --tracker wandb     # <out>/wandb: wandb sync <out>/wandb/offline-run-*
    atoll train --tracker tensorboard,wandb

Each is an optional extra (``pip install atoll[tensorboard]``, ``atoll[wandb]``), imported only when a run
asks for it. The metrics, under the same names in both (only the main process of a run writes them):

- ``train/loss`` (the islands' mean training loss), ``train/lr``, ``train/tokens`` (all islands);
  ``islands/loss_<i>`` (island i's training loss), ``islands/bytes_sent_<i>`` and ``islands/bytes_received_<i>``
  (where islands differ);
- ``comm/bytes_sent_per_island``, ``comm/bytes_received_per_island`` (where the driver knows it live),
  ``time/sim_wall_s`` (the run's clock, simulated or real, seconds);
- ``eval/loss``, ``eval/perplexity``: the global model on the held-out windows;
- ``eval_vs_bytes/loss``, ``eval_vs_sim_time/loss``, ``eval_vs_tokens/loss``: the held-out loss against
  bytes one island sent, the run's clock and training tokens;
- ``perf/tokens_per_s`` (training tokens of every island per real second over the logging interval),
  ``perf/peak_accelerator_bytes`` (the interval's peak accelerator memory of the main process; GPUs only);
- ``events/failures``, ``events/rejoins``, ``events/resets``, ``events/refusals``: how many of each run event
  (:mod:`atoll.job.timeline`) so far, at the step of each;
- ``summary/<key>``: the numbers of ``summary.json``, at the last step.

The x-axis of every metric is the inner step, except the ``eval_vs_*`` ones. TensorBoard has a single
integer x-axis, so those take bytes, simulated milliseconds and tokens as their step; in W&B they are
plotted against ``x/bytes_sent_per_island``, ``x/sim_wall_s`` and ``x/tokens`` (``wandb.define_metric``).
A resumed run continues the same TensorBoard folder (events after the checkpoint's step are purged, as
``metrics.jsonl`` drops them) and the same W&B run (its id is kept in ``<out>/wandb/atoll-run-id``; W&B
keeps the history it holds, so the steps it received past the checkpoint are not rewritten: it warns and
skips them).
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from pathlib import Path
from typing import Any, Protocol

from atoll.errors import ConfigError
from atoll.job.timeline import TRACKED_EVENTS

#: tracker name -> the package it needs (the extra of the same name installs it)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_installed(names: list[str]) -> None:
    """Raise a one-line error for the first tracker whose package is missing (nothing is imported).

    Raises:
        ValueError: names the tracker and the ``pip install`` that adds it.
    """
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(f"{name} is not installed; pip install atoll[{name}] (or pip install {name}), "
                             "or leave it out of --tracker")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The metrics of one ``metrics.jsonl`` event (``train``, ``eval``, ``end`` or a tracked run event:
    failure, rejoin, reset, refusal) under the trackers' names; non-finite and non-numeric values are left out."""
    event = record["event"]
    out: dict[str, Any] = {}
    if event == "train":
        out = {"train/loss": record["loss"], "train/lr": record.get("lr"), "train/tokens": record["tokens"],
               "perf/tokens_per_s": record.get("tokens_per_s"),
               "perf/peak_accelerator_bytes": record.get("peak_accelerator_bytes")}
        out.update({f"islands/loss_{i}": v for i, v in enumerate(record.get("island_loss") or [])})
        out.update({f"islands/bytes_sent_{i}": v for i, v in enumerate(record.get("island_bytes_sent") or [])})
        out.update({f"islands/bytes_received_{i}": v
                    for i, v in enumerate(record.get("island_bytes_received") or [])})
    elif event == "eval":
        out = {"eval/loss": record["eval_loss"], "eval/perplexity": record.get("perplexity")}
    elif event in TRACKED_EVENTS:
        out = {f"events/{event}s": record.get("count")}
    elif event == "end":
        return {f"summary/{k}": float(v) for k, v in record.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "step")
                and math.isfinite(v)}
    if event in ("train", "eval"):
        out["comm/bytes_sent_per_island"] = record.get("bytes_sent_per_island")
        out["comm/bytes_received_per_island"] = record.get("bytes_received_per_island")
        out["time/sim_wall_s"] = record.get("sim_wall_s")
    return {k: float(v) for k, v in out.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker(Protocol):
    """Where a run's events go besides ``metrics.jsonl``."""

    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files in ``<out>/tensorboard`` through ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        out: the run folder.
        config: the run's settings (JSON-able), written once as the text ``config``.
        start_step: a resumed run's checkpoint step: events of later steps in the folder are purged.
        history: a resumed run's events up to its checkpoint (``metrics.jsonl`` as kept): the purge also
            drops the ``eval_vs_*`` points, whose steps are bytes, milliseconds and tokens, so they are
            written again.
    """

    def __init__(self, out: Path, config: dict[str, Any], start_step: int | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        import json

        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"),
                                    purge_step=start_step + 1 if start_step is not None else None)
        if start_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
        for record in history or []:  # the purge dropped the points whose step is past the checkpoint's
            if record.get("event") == "eval":
                self._eval_axes(record, scalars(record), above=start_step)

    def _eval_axes(self, record: dict[str, Any], values: dict[str, float], above: int | None = None) -> None:
        """The held-out loss against bytes, simulated milliseconds and tokens (each its step); only the
        points whose step is past ``above`` when given."""
        if "eval/loss" not in values:
            return
        axes = (("eval_vs_bytes/loss", values.get("comm/bytes_sent_per_island")),
                ("eval_vs_sim_time/loss", 1000 * values["time/sim_wall_s"] if "time/sim_wall_s" in values else None),
                ("eval_vs_tokens/loss", float(record.get("tokens", 0))))
        for tag, x in axes:
            if x is not None and (above is None or round(x) > above):
                self.writer.add_scalar(tag, values["eval/loss"], round(x))

    def log(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        values = scalars(record)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        if record["event"] == "eval":
            self._eval_axes(record, values)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (``wandb.init``), its files in ``<out>/wandb``; offline with ``WANDB_MODE=offline``.

    The project is ``$WANDB_PROJECT`` or ``atoll``, the run's name the run folder's; ``WANDB_*`` variables
    (entity, mode, tags, ...) apply as wandb documents them.

    Args:
        out: the run folder.
        config: the run's settings (JSON-able), the W&B run's config.
        start_step: a resumed run's checkpoint step: the same W&B run continues.
    """

    def __init__(self, out: Path, config: dict[str, Any], start_step: int | None = None,
                 history: list[dict[str, Any]] | None = None) -> None:
        import wandb

        self.wandb = wandb
        folder = Path(out) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "atoll-run-id"
        run_id = id_file.read_text().strip() if start_step is not None and id_file.is_file() else None
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "atoll"), name=Path(out).name,
                              dir=str(out), id=run_id, resume="allow", config=config)
        for x in ("x/bytes_sent_per_island", "x/sim_wall_s", "x/tokens"):
            self.run.define_metric(x, hidden=True)
        self.run.define_metric("eval_vs_bytes/loss", step_metric="x/bytes_sent_per_island")
        self.run.define_metric("eval_vs_sim_time/loss", step_metric="x/sim_wall_s")
        self.run.define_metric("eval_vs_tokens/loss", step_metric="x/tokens")
        self.run.define_metric("eval/loss", summary="min")

    def log(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if record["event"] == "end":
            self.run.summary.update(values)
            return
        if record["event"] == "eval" and "eval/loss" in values:
            loss = values["eval/loss"]
            values.update({"eval_vs_bytes/loss": loss, "eval_vs_sim_time/loss": loss, "eval_vs_tokens/loss": loss,
                           "x/bytes_sent_per_island": values.get("comm/bytes_sent_per_island", 0.0),
                           "x/sim_wall_s": values.get("time/sim_wall_s", 0.0),
                           "x/tokens": float(record.get("tokens", 0))})
        self.run.log(values, step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def open_trackers(names: list[str], out: Path, config: dict[str, Any], start_step: int | None = None,
                  history: list[dict[str, Any]] | None = None) -> list[Tracker]:
    """The trackers ``names`` of the run in ``out`` (its ``config``; when resuming, the checkpoint's
    ``start_step`` and the ``history`` of events kept up to it).

    Raises:
        ConfigError: a tracker's package is missing (names the ``pip install``).
    """
    try:
        check_installed(names)
    except ValueError as e:
        raise ConfigError(f"tracker: {e}") from None
    return [TRACKERS[name](out, config, start_step, history) for name in names]

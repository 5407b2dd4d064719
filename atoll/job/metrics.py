"""Metrics: one JSON object per event in ``metrics.jsonl``, and the live progress display.

Events (field ``event``): ``start`` (config, parameters), ``train`` (mean loss over islands, tokens,
bytes, simulated time), ``eval`` (held-out loss and perplexity of the global model), ``checkpoint``,
``end`` (the summary). Units: bytes, seconds, tokens; losses in nats per token.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from atoll.errors import DataError


class MetricsLog:
    """Append-only JSONL event log.

    Args:
        path: the ``metrics.jsonl`` file.
        truncate_after_step: when resuming, drop logged events of steps after the checkpoint's step, so
            the log reads as one uninterrupted run.
    """

    def __init__(self, path: Path, truncate_after_step: int | None = None) -> None:
        self.path = Path(path)
        if truncate_after_step is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if isinstance(event, dict) and event.get("step", 0) <= truncate_after_step and event.get("event") != "end":
                    kept.append(line)
            self.path.write_text("".join(line + "\n" for line in kept))
        self._f = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event with a wall-clock timestamp; return it."""
        record = {"event": event, "time": time.time(), **fields}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        return record

    def close(self) -> None:
        self._f.close()


class NullLog:
    """A :class:`MetricsLog` that writes nothing (the processes of a run other than the one that writes)."""

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        return {"event": event, **fields}

    def close(self) -> None:
        pass


def perplexity(loss: float) -> float | None:
    """``exp(loss)`` of a held-out loss in nats per token; None where it is not a finite number (a diverged
    run's loss overflows ``exp``), so that metrics and summaries stay strict JSON."""
    try:
        value = math.exp(loss)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All events of a ``metrics.jsonl`` file, in order (each a dict with at least ``event``).

    A last line cut short (the writer was killed mid-line) is skipped, as the run's resume does.

    Raises:
        DataError: another line is not a JSON object with an ``event`` (the file is damaged; names the line).
    """
    lines = Path(path).read_text(errors="replace").splitlines()
    events = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            if n == len(lines):  # torn last line
                break
            event = None
        if not isinstance(event, dict) or "event" not in event:
            raise DataError(f"metrics: line {n} of '{path}' is not an atoll event (the file is damaged); restore "
                            "it or remove that line")
        events.append(event)
    return events


def finite_or_none(v: Any) -> Any:
    """``v`` with every float that strict JSON cannot hold (NaN, infinities) replaced by None, through dicts,
    lists and tuples (as lists); anything else unchanged."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite_or_none(x) for x in v]
    return v


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` to ``<out>/summary.json`` atomically (a temporary file, then ``os.replace``), as strict
    JSON: a NaN or infinite figure (a diverged loss) is written as null (:func:`finite_or_none`).

    Raises:
        OSError: the folder is not writable.
    """
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(finite_or_none(summary), indent=2, allow_nan=False))
    os.replace(tmp, out / "summary.json")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KB'`` (powers of 1000, as network rates are)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class ProgressDisplay:
    """A live progress bar of inner steps with loss, tokens/s and bytes sent; silent when disabled."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("sent {task.fields[sent]}/island"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=self.console, disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                           loss="-", tps="-", sent="0 B")

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float, bytes_sent: float) -> None:
        self.progress.update(self.task, completed=step, loss=f"{loss:.3f}", tps=f"{tokens_per_s:,.0f}",
                             sent=human_bytes(bytes_sent))


#: the per-island token buckets of a decoupled run's summary (atoll.strategies.decoupled.accounting), in order
TOKEN_BUCKETS = ("merged", "stale", "rejected", "lost", "in_flight")


def token_bucket_rows(summary: dict[str, Any], most: int = 8) -> list[tuple[str, str]]:
    """Rows of a decoupled run's token buckets: a header naming them, then one row per island (the sum over
    the islands past ``most`` islands), and the tokens no bucket holds when it is not 0."""
    buckets = [(k.replace("_", " "), summary[f"{k}_tokens_by_island"]) for k in TOKEN_BUCKETS
               if summary.get(f"{k}_tokens_by_island") is not None]
    islands = [(f"  island {i}", [b[i] for _, b in buckets]) for i in range(len(buckets[0][1]))]
    if len(islands) > most:
        islands = [("  all islands", [sum(b) for _, b in buckets])]
    rows = [("tokens per island", " / ".join(name for name, _ in buckets))]
    rows += [(label, " / ".join(f"{v:,.0f}" for v in values)) for label, values in islands]
    if summary.get("unaccounted_tokens"):
        rows.append(("tokens in no bucket", f"{summary['unaccounted_tokens']:,.1f}"))
    return rows


def _perplexity_text(value: float | None) -> str:
    if value is None:
        return "- (exp of the loss overflows)"
    return f"{value:.2f}" if value < 1e6 else f"{value:.3g}"


def summary_table(summary: dict[str, Any]) -> Table:
    """A two-column table of the run summary, with units."""
    table = Table(title=f"atoll {summary['strategy']} x{summary['islands']} islands", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("parameters", f"{summary['params']:,}"),
        ("device / precision", f"{summary.get('device', 'cpu')} / {summary.get('precision', 'fp32')}"),
        ("tokens (all islands)", f"{summary['tokens']:,}"),
        ("eval loss: initial -> final", f"{summary['initial_eval_loss']:.4f} -> {summary['final_eval_loss']:.4f}"),
        ("final perplexity", _perplexity_text(summary.get("final_perplexity"))),
        ("bytes sent per island", human_bytes(summary["bytes_sent_per_island"])),
        ("ddp would send per island", human_bytes(summary["ddp_bytes_per_island"])),
        ("reduction vs ddp", f"{summary['reduction_vs_ddp']:.1f}x" if summary["reduction_vs_ddp"] else "-"),
        ("compute (slowest island)" + (", simulated" if "island_utilization" in summary else ""),
         f"{summary['compute_s']:.1f} s"),
        (f"simulated wall @ {summary['link_bandwidth_mbps']:g} Mbit/s" if summary.get("runtime") not in ("collective", "ray")
         else "wall time on the real network", f"{summary['sim_wall_s']:.1f} s"),
        ("compute utilization" + (" (busiest island)" if "island_utilization" in summary else ""),
         f"{summary['compute_utilization']:.1%}"),
        ("real wall time", f"{summary['wall_s']:.1f} s"),
    ]
    if "island_utilization" in summary:  # decoupled: what failures and the syncer cost
        utilization = summary["island_utilization"]
        rows += [("compute utilization per island", " / ".join(f"{u:.0%}" for u in utilization)),
                 ("goodput", f"{summary['goodput']:.1%}" if summary.get("goodput") is not None else "-"),
                 ("failures / rejected / stale pushes", f"{sum(summary.get('failures', []))} / "
                  f"{summary.get('rejected_updates', 0)} / {summary.get('stale_updates', 0)}")]
    if "merged_tokens_by_island" in summary:  # decoupled: where every island's tokens went
        rows += token_bucket_rows(summary)
    if summary.get("skipped_steps"):  # README, "Reliability"
        rows.append(("steps skipped (gradient not finite)", f"{summary['skipped_steps']:,}"))
    if summary.get("island_resets"):
        rows.append(("islands reset (diverged), per island", " / ".join(str(n) for n in summary["island_resets"])))
    if summary.get("diverged"):
        rows.append(("diverged at step", f"{summary['diverged']['step']:,}"))
    for k, v in rows:
        table.add_row(k, v)
    return table

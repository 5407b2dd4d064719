"""Metrics: one JSON object per event in ``metrics.jsonl``, and the live progress display.

Events (field ``event``): ``start`` (config, parameters), ``train`` (mean loss over islands, tokens,
bytes, simulated time), ``eval`` (held-out loss and perplexity of the global model), ``checkpoint``,
``end`` (the summary). Units: bytes, seconds, tokens; losses in nats per token.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
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
)
from rich.table import Table

from atoll.config.section import RuntimeConfig, StrategyConfig
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
                if (isinstance(event, dict) and event.get("step", 0) <= truncate_after_step
                        and event.get("event") != "end"):
                    kept.append(line)
            self.path.write_text("".join(line + "\n" for line in kept))
        self._f = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()  # a background checkpoint's writer logs its commit from its own thread

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event with a wall-clock timestamp, a whole line even from two threads; return it."""
        record = {"event": event, "time": time.time(), **fields}
        with self._lock:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        return record

    def close(self) -> None:
        with self._lock:
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


def status(message: str) -> None:
    """Say what a long step of a run is doing before it starts, as one plain line on stderr,
    ``atoll: <message>`` (e.g. that a tokenizer is being trained, a minute before the first step).

    For any module of a run; printed whatever the progress setting (it is one line), flushed at once.
    """
    print(f"atoll: {message}", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    """``3723.4`` -> ``'1:02:03'``."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def clock_text(seconds: float) -> str:
    """``3723.4`` -> ``'1:02:03'`` (hours, minutes, seconds)."""
    return _clock(seconds)


class TimedLines:
    """Plain progress lines every ``every_s`` seconds of a process that has no steps of its own to count (the
    syncer service: :mod:`atoll.runtime.service.monitor`), each written whole and flushed.

    Args:
        every_s: seconds between two lines; 0: none.
        file: where they go (a text stream; stderr for a command's progress).
    """

    def __init__(self, every_s: float, file: Any) -> None:
        self.every_s, self.file = float(every_s), file
        self.next_at = time.monotonic() + self.every_s

    def due(self) -> bool:
        """Is a line due now (and the next one ``every_s`` from now)?"""
        now = time.monotonic()
        if self.every_s <= 0 or now < self.next_at:
            return False
        self.next_at = now + self.every_s
        return True

    def write(self, line: str) -> None:
        """Write one line and flush it."""
        self.file.write(line + "\n")
        self.file.flush()


class ProgressDisplay:
    """Training progress on stderr: a live bar on a terminal; where stderr is not one (a log file, a cluster
    job's output) one plain line every ``every`` inner steps (at the first update past each multiple, for a
    driver that samples the steps: Ray), at every evaluation and at the last step, never twice for one step;
    nothing when disabled.

    The estimate of the time left is this session's mean seconds per step (evaluations and checkpoints
    included) times the steps left; none before the first step.

    Args:
        total_steps: inner steps of the run.
        start_step: inner steps done before this session (a resumed run).
        enabled: show anything at all.
        console: where to draw (default: stderr); its ``is_terminal`` picks the bar or the lines.
        every: inner steps between two plain lines (default: a twentieth of the run).
    """

    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console | None = None,
                 every: int | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self.total, self.start_step = total_steps, start_step
        self.every = every or max(1, total_steps // 20)
        self.t0 = time.perf_counter()
        self.last_loss = float("nan")
        self.printed = start_step  # the step of the last plain line
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("sent {task.fields[sent]}/island"), TimeElapsedColumn(), TextColumn("eta {task.fields[eta]}"),
            TextColumn("{task.fields[detail]}"),
            console=self.console, disable=not self.live, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                           loss="-", tps="-", sent="0 B", eta="-", detail="")

    def __enter__(self) -> ProgressDisplay:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def eta_s(self, step: int) -> float | None:
        """Seconds left after ``step`` at this session's mean pace; None before its first step."""
        done = step - self.start_step
        return (time.perf_counter() - self.t0) / done * (self.total - step) if done > 0 else None

    def prints(self, step: int, evaluated: bool = False) -> bool:
        """Whether :meth:`update` at inner step ``step`` writes a line (plain-text mode; ``evaluated``: the
        step evaluated), so the caller reads the training loss for it from the device then and only then: at
        the first update past each multiple of ``every`` (a driver that samples the steps, Ray, crosses one),
        at an evaluation and at the last step, never twice for one step."""
        return self.enabled and not self.live and step > self.printed and (
            step // self.every > self.printed // self.every or evaluated or step == self.total)

    def update(self, step: int, loss: float | None, tokens_per_s: float, bytes_sent: float,
               eval_loss: float | None = None, detail: str | None = None, bytes_received: float | None = None) -> None:
        """Inner step ``step`` done (1-based): the islands' mean training loss (None: not read at this step;
        the last one read is shown), this session's tokens per second, bytes one island sent so far, the
        held-out loss when this step evaluated, and ``detail``: a strategy's own state in a few words
        (decoupled: steps per island, merges, staleness, goodput); ``bytes_received``: bytes one island received
        so far (None: not known live, not shown)."""
        if loss is None:
            loss = self.last_loss
        self.last_loss = loss
        eta = self.eta_s(step)
        eta_text = _clock(eta) if eta is not None else "-"
        sent = human_bytes(bytes_sent) + ("" if bytes_received is None
                                          else f", received {human_bytes(bytes_received)}")
        if self.live:
            self.progress.update(self.task, completed=step, loss=f"{loss:.3f}", tps=f"{tokens_per_s:,.0f}",
                                 sent=sent, eta=eta_text, detail=detail or "")
        elif self.prints(step, evaluated=eval_loss is not None):
            self.printed = step
            line = (f"atoll: step {step}/{self.total} ({step / self.total:.0%}) | loss {loss:.3f}"
                    + (f" | eval {eval_loss:.3f}" if eval_loss is not None else "")
                    + f" | {tokens_per_s:,.0f} tok/s | sent {sent}/island"
                    + (f" | {detail}" if detail else "")
                    + f" | {_clock(time.perf_counter() - self.t0)} elapsed, eta {eta_text}")
            self.console.file.write(line + "\n")
            self.console.file.flush()


Row = tuple[str, str]

#: the settings of the simulated network clock a summary reports (where the runtime owns them: ``local``)
LINK_SETTINGS = ("link_bandwidth_mbps", "link_latency_ms")


def owned_settings(strategy: StrategyConfig, runtime: RuntimeConfig, names: tuple[str, ...]) -> dict[str, Any]:
    """Of the settings ``names``, those the run's ``strategy`` config or ``runtime`` config owns -> their values,
    in ``names`` order: a summary reports the settings of the run's owners only (no ``sync_every`` for a
    strategy without outer rounds, no simulated links for a runtime on a real clock), never a default of a
    setting the run did not read."""
    out: dict[str, Any] = {}
    for name in names:
        owner = next((o for o in (strategy, runtime) if name in type(o).model_fields), None)
        if owner is not None:
            out[name] = getattr(owner, name)
    return out


def _model_rows(s: dict[str, Any]) -> list[Row]:
    return [("parameters", f"{s['params']:,}"),
            ("device / precision", f"{s.get('device', 'cpu')} / {s.get('precision', 'fp32')}"),
            ("tokens (all islands)", f"{s['tokens']:,}"),
            ("eval loss: initial -> final", f"{s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}"),
            ("final perplexity", _perplexity_text(s.get("final_perplexity")))]


def _bytes_rows(s: dict[str, Any]) -> list[Row]:
    rows = [("bytes sent per island", human_bytes(s["bytes_sent_per_island"]))]
    if "bytes_received_per_island" in s:  # (a summary from before the received side was counted has none)
        rows.append(("bytes received per island", human_bytes(s["bytes_received_per_island"])))
    rows += [("ddp would send (and receive) per island", human_bytes(s["ddp_bytes_per_island"])),
             ("reduction vs ddp (sent)", f"{s['reduction_vs_ddp']:.1f}x" if s["reduction_vs_ddp"] else "-")]
    if "bytes_received_per_island" in s:
        rows += [("reduction vs ddp (received)",
                  f"{s['reduction_vs_ddp_received']:.1f}x" if s.get("reduction_vs_ddp_received") else "-"),
                 ("reduction vs ddp (both ways)",
                  f"{s['reduction_vs_ddp_total']:.1f}x" if s.get("reduction_vs_ddp_total") else "-")]
    return rows


def _time_rows(s: dict[str, Any]) -> list[Row]:
    per_island = "island_utilization" in s
    rows = [("compute (slowest island)" + (", simulated" if per_island else ""), f"{s['compute_s']:.1f} s")]
    if s.get("runtime") in ("collective", "ray") or "link_bandwidth_mbps" not in s:  # a real clock: one wall time
        rows.append(("real wall time", f"{s['wall_s']:.1f} s"))
        rows.append(("compute utilization" + (" (busiest island)" if per_island else ""),
                     f"{s['compute_utilization']:.1%}"))
        return rows
    return rows + [(f"simulated wall @ {s['link_bandwidth_mbps']:g} Mbit/s", f"{s['sim_wall_s']:.1f} s"),
                   ("compute utilization" + (" (busiest island)" if per_island else ""),
                    f"{s['compute_utilization']:.1%}"),
                   ("real wall time", f"{s['wall_s']:.1f} s")]


def _island_rows(s: dict[str, Any]) -> list[Row]:
    if "island_utilization" not in s:  # decoupled only: what failures and the syncer cost
        return []
    return [("compute utilization per island", " / ".join(f"{u:.0%}" for u in s["island_utilization"])),
            ("goodput", f"{s['goodput']:.1%}" if s.get("goodput") is not None else "-"),
            ("failures / rejected / stale pushes", f"{sum(s.get('failures', []))} / "
             f"{s.get('rejected_updates', 0)} / {s.get('stale_updates', 0)}")]


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


def _bucket_rows(s: dict[str, Any]) -> list[Row]:
    return token_bucket_rows(s) if "merged_tokens_by_island" in s else []  # decoupled: where tokens went


def _health_rows(s: dict[str, Any]) -> list[Row]:
    rows = []  # docs/reliability.md
    if s.get("skipped_steps"):
        rows.append(("steps skipped (gradient not finite)", f"{s['skipped_steps']:,}"))
    if s.get("island_resets"):
        rows.append(("islands reset (diverged), per island", " / ".join(str(n) for n in s["island_resets"])))
    if s.get("diverged"):
        rows.append(("diverged at step", f"{s['diverged']['step']:,}"))
    return rows


def _trust_rows(s: dict[str, Any]) -> list[Row]:
    """decoupled: the syncer's refusals per island and reason, and its robust merge (docs/security.md)."""
    rows = []
    if s.get("robust_merge", "none") != "none":
        rows.append(("robust merge (seconds merging)", f"{s['robust_merge']} ({s.get('merge_s', 0.0):.3g} s)"))
    refused = {k: v for k, v in (s.get("rejected_by_island") or {}).items() if any(v)}
    if refused:
        rows.append(("pushes refused per island", "by reason"))
        rows += [(f"  {reason}", " / ".join(str(n) for n in counts)) for reason, counts in sorted(refused.items())]
    return rows


def _method_rows(s: dict[str, Any]) -> list[Row]:
    """What a strategy's own method did: sparseloco's density, diloco's agreement-weighted outer step."""
    rows = []
    if "sparseloco_density" in s:
        rows.append(("sparseloco density (entries a payload updates)", f"{s['sparseloco_density']:.2%}"))
        if "sparseloco_sent_energy" in s:
            rows.append(("sparseloco energy sent (share of the accumulator per round)",
                         f"{s['sparseloco_sent_energy']:.1%}"))
        if "sparseloco_step_ratio" in s:
            rows.append(("sparseloco outer step / plain averaging's", f"{s['sparseloco_step_ratio']:.3f}"))
    if "outer_agreement_mean" in s:
        rows.append(("outer agreement f̄ (mean / last round)",
                     f"{s['outer_agreement_mean']:.3f} / {s['outer_agreement_last']:.3f}"))
    return rows


#: the groups of rows of the final table, in order: each takes the summary and returns (name, value) rows
#: (none when its entries are absent); a new group is one function and one entry here
SUMMARY_ROWS = (_model_rows, _bytes_rows, _method_rows, _time_rows, _island_rows, _bucket_rows, _trust_rows,
                _health_rows)


def summary_rows(summary: dict[str, Any]) -> list[Row]:
    """The rows of the final table: (metric with its unit, value as text)."""
    return [row for group in SUMMARY_ROWS for row in group(summary)]


def summary_table(summary: dict[str, Any]) -> Table:
    """A two-column table of the run summary, with units (:func:`summary_rows`)."""
    table = Table(title=f"atoll {summary['strategy']} x{summary['islands']} islands", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for k, v in summary_rows(summary):
        table.add_row(k, v)
    return table

"""The syncer's status page over HTTP: ``/`` (HTML), ``/status.json`` and ``/metrics`` (Prometheus).

``atoll syncer --metrics-listen 127.0.0.1:9400`` serves, from the live view of its
:class:`~atoll.runtime.service.monitor.Monitor` (as torchft's lighthouse serves its own page):

- ``/``: one page, reloaded every few seconds: the run's state, one row per island (state, inner steps, its
  last loss, seconds since its last call and its last push, bytes received), merges and versions, refusals by
  reason, and the held-out loss curve (an inline SVG drawn by matplotlib);
- ``/status.json``: the same view as JSON (:meth:`Monitor.look <atoll.runtime.service.monitor.Monitor.look>`);
- ``/metrics``: the view in the Prometheus text exposition format (``prometheus_client``), every name
  ``atoll_syncer_*`` (:class:`ViewCollector`).

The server is off by default and listens on loopback addresses only (the setting is refused otherwise,
:class:`~atoll.config.runtimes.ServiceConfig`): it has no TLS and no login; reach it from another host through
an SSH tunnel (``ssh -L 9400:127.0.0.1:9400 syncer-host``). It only reads the view: nothing it receives reaches
the syncer.
"""

from __future__ import annotations

import html
import io
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from atoll.config.parse import parse_address
from atoll.errors import ConfigError
from atoll.job.metrics import clock_text, finite_or_none, human_bytes

#: seconds between two reloads of the status page in a browser
RELOAD_S = 5
#: the states of an island (:func:`~atoll.runtime.service.monitor.island_states`), in the page's order
STATES = ("alive", "lost", "waiting", "left")


class ViewCollector:
    """A Prometheus collector of the monitor's view (``view()``: :attr:`Monitor.current
    <atoll.runtime.service.monitor.Monitor.current>`), read at each scrape."""

    def __init__(self, view: Callable[[], dict[str, Any]]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        v = self.view()
        if not v:
            return
        counters = (("merges", "outer steps the syncer committed (every fragment's)", v["merges"]),
                    ("merged_tokens", "training tokens merged into the global model", v["merged_tokens"]),
                    ("bytes_received", "bytes of the pushes the islands declared", v["bytes_in"]),
                    ("bytes_sent", "bytes of global fragments served to the islands", v["bytes_out"]))
        for name, text, value in counters:
            yield CounterMetricFamily(f"atoll_syncer_{name}", text, value=float(value))
        gauges = (("steps_reserved", "inner steps granted from the shared budget", v["reserved"]),
                  ("step_budget", "the shared budget of inner steps (islands x steps)", v["budget"]),
                  ("merged_steps", "inner steps per island whose tokens are merged", v["merged_steps"]),
                  ("run_seconds", "the run's clock: seconds from its first inner step", v["run_s"]),
                  ("staleness", "mean staleness of the recently merged pushes (commits)", v["staleness"]),
                  ("goodput", "merged tokens per second over the fastest rate of inner steps seen", v["goodput"]),
                  ("eval_loss", "the last held-out loss of the global model (nats per token)", v["eval_loss"]))
        for name, text, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(f"atoll_syncer_{name}", text, value=float(value))
        states = GaugeMetricFamily("atoll_syncer_islands", "islands by state", labels=["state"])
        for state in STATES:
            states.add_metric([state], sum(i["state"] == state for i in v["islands"]))
        yield states
        per_island = (("island_steps", "inner steps granted to the island", "steps"),
                      ("island_loss", "the island's last training loss (nats per token)", "loss"),
                      ("island_silent_seconds", "seconds since the island's last call", "silent_s"),
                      ("island_since_push_seconds", "seconds of the run's clock since its last push", "since_push_s"),
                      ("island_bytes_received", "bytes of its pushes", "bytes_in"),
                      ("island_bytes_sent", "bytes of the global fragments served to it (safetensors, with "
                       "their headers)", "bytes_out"))
        for name, text, key in per_island:
            family = GaugeMetricFamily(f"atoll_syncer_{name}", text, labels=["island"])
            for i in v["islands"]:
                if i.get(key) is not None:
                    family.add_metric([str(i["island"])], float(i[key]))
            yield family
        up = GaugeMetricFamily("atoll_syncer_island_up", "1 while the island is alive", labels=["island"])
        for i in v["islands"]:
            up.add_metric([str(i["island"])], 1.0 if i["state"] == "alive" else 0.0)
        yield up
        versions = GaugeMetricFamily("atoll_syncer_fragment_version", "each fragment's global version",
                                     labels=["fragment"])
        for p, n in enumerate(v["versions"]):
            versions.add_metric([str(p)], float(n))
        yield versions
        refused = CounterMetricFamily("atoll_syncer_refusals", "refusals by what was refused (push, call) and why",
                                      labels=["what", "reason"])
        for what, key in (("push", "refused_pushes"), ("call", "refused_calls")):
            for reason, n in sorted(v[key].items()):
                refused.add_metric([what, reason], float(n))
        yield refused


def loss_svg(evals: list[dict[str, Any]]) -> str:
    """The held-out loss against merged inner steps as an inline SVG (matplotlib); "" with fewer than two
    points."""
    points = [(e["merged_steps"], e["eval_loss"]) for e in evals if e["eval_loss"] is not None]
    if len(points) < 2:
        return ""
    from matplotlib.figure import Figure  # (not pyplot: its state is global, this runs on a request's thread)

    fig = Figure(figsize=(6.4, 2.8))
    ax = fig.subplots()
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3)
    ax.set_xlabel("merged inner steps per island")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _number(value: Any, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def page(view: dict[str, Any], title: str = "atoll syncer") -> str:
    """The status page of ``view`` (HTML, reloaded every :data:`RELOAD_S` seconds)."""
    if not view:
        return f"<!doctype html><title>{title}</title><p>starting...</p>"
    rows = []
    for i in view["islands"]:
        rows.append(f"<tr class='{i['state']}'><td>{i['island']}</td><td>{i['state']}</td><td>{i['steps']}</td>"
                    f"<td>{_number(i['loss'], '.3f')}</td><td>{_number(i['silent_s'], '.1f')}</td>"
                    f"<td>{_number(i['since_push_s'], '.1f', 'no push yet')}</td><td>{i['joins']}</td>"
                    f"<td>{human_bytes(i['bytes_in'])}</td></tr>")
    refusals = [(what, reason, n) for what, key in (("push", "refused_pushes"), ("call", "refused_calls"))
                for reason, n in sorted(view[key].items()) if n]
    refused = "".join(f"<tr><td>{what}</td><td>{html.escape(reason)}</td><td>{n}</td></tr>"
                      for what, reason, n in refusals) or "<tr><td colspan=3>none</td></tr>"
    alive = sum(i["state"] == "alive" for i in view["islands"])
    state = "done" if view["done"] else "training" if view["reserved"] else "waiting for the islands"
    facts = [("state", state), ("up", clock_text(view["uptime_s"])), ("run clock", clock_text(view["run_s"])),
             ("islands alive", f"{alive}/{len(view['islands'])}"),
             ("inner steps", f"{view['reserved']}/{view['budget']}"), ("merges", str(view["merges"])),
             ("versions", "/".join(str(n) for n in view["versions"])),
             ("merged steps per island", str(view["merged_steps"])),
             ("staleness", _number(view["staleness"], ".2f")),
             ("goodput", _number(view["goodput"], ".0%")),
             ("bytes in / out", f"{human_bytes(view['bytes_in'])} / {human_bytes(view['bytes_out'])}"),
             ("held-out loss", _number(view["eval_loss"], ".4f"))]
    if view.get("shard") is not None:
        facts.insert(1, ("shard", str(view["shard"])))
    if view["starved"]:
        facts.append(("warning", html.escape(view["starved"])))
    fact_rows = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in facts)
    svg = loss_svg(view["evals"]) or "<p>the curve appears after the second evaluation (every eval_every merged " \
                                     "inner steps)</p>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="{RELOAD_S}"><title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.4em; }} h2 {{ font-size: 1.1em; margin-top: 1.2em; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 0.25em 0.8em; border-bottom: 1px solid #ddd;
text-align: left; }}
tr.alive td:nth-child(2) {{ color: #1a7f37; font-weight: bold; }}
tr.lost td:nth-child(2) {{ color: #cf222e; font-weight: bold; }}
tr.left td:nth-child(2), tr.waiting td:nth-child(2) {{ color: #777; }}
.cols {{ display: flex; gap: 3em; flex-wrap: wrap; }}
</style></head><body>
<h1>{title}</h1>
<div class="cols"><div><h2>run</h2><table>{fact_rows}</table></div>
<div><h2>held-out loss of the global model</h2>{svg}</div></div>
<h2>islands</h2>
<table><tr><th>island</th><th>state</th><th>inner steps</th><th>loss</th><th>silent (s)</th>
<th>since its last push (s)</th><th>joins</th><th>bytes in</th></tr>{''.join(rows)}</table>
<h2>refusals</h2><table><tr><th>what</th><th>reason</th><th>count</th></tr>{refused}</table>
<p><a href="/status.json">status.json</a> · <a href="/metrics">metrics</a></p>
</body></html>"""


class StatusServer:
    """The HTTP server of the status page (module docstring), on its own threads.

    Args:
        address: ``HOST:PORT`` on a loopback address (port 0: any free one; :attr:`port` says which).
        view: the live view to serve (:attr:`Monitor.current <atoll.runtime.service.monitor.Monitor.current>`).
        title: the page's title.

    Raises:
        ConfigError: the address cannot be bound.
    """

    def __init__(self, address: str, view: Callable[[], dict[str, Any]], title: str = "atoll syncer") -> None:
        host, port = parse_address(address, "listen")  # (checked as metrics_listen by the config; 0: any port)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ViewCollector(view))  # type: ignore[arg-type]

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, kind = generate_latest(registry), CONTENT_TYPE_LATEST
                elif path == "/status.json":
                    body = json.dumps(finite_or_none(view()), allow_nan=False).encode()
                    kind = "application/json"
                elif path in ("/", "/index.html"):
                    body, kind = page(view(), title).encode(), "text/html; charset=utf-8"
                else:
                    self.send_error(404, "the status page serves /, /status.json and /metrics")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: no line per request
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ConfigError(f"metrics_listen: cannot listen on '{address}' ({e.strerror or e}); pick a free "
                              "port") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="atoll-status", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()

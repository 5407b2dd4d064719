"""The live view of a running ``atoll syncer``: its progress line, the events of ``metrics.jsonl`` as they happen,
the Prometheus metrics and the status page over HTTP (:mod:`atoll.runtime.service.monitor`,
:mod:`atoll.runtime.service.status`)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("prometheus_client")

from atoll.config import build_config  # noqa: E402
from atoll.errors import ConfigError  # noqa: E402
from tests.conftest import free_port
from tests.test_service import start, wait_all  # noqa: E402


def http(url: str) -> tuple[str, str]:
    """(body, content type) of a GET."""
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode(), r.headers["Content-Type"]


def events(path: Path) -> list[dict[str, Any]]:
    """The events of a ``metrics.jsonl`` being written (a torn last line left out)."""
    from atoll.job.metrics import read_metrics

    return read_metrics(path) if path.is_file() else []


def tensorboard_tags(folder: Path) -> set[str]:
    """The scalar tags of the TensorBoard event files in ``folder`` (empty without tensorboard)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {"eval/loss", "train/loss"}
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return set(acc.Tags()["scalars"])


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample of a Prometheus exposition ``text``."""
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert match is not None, (name, labels, text[:2000])
    return float(match.group(1))


def test_metrics_listen_is_loopback_only() -> None:
    with pytest.raises(ConfigError, match="metrics_listen: '0.0.0.0:9400' is reachable from other hosts"):
        build_config(None, {"strategy": "decoupled", "runtime": "service", "metrics_listen": "0.0.0.0:9400"})
    config = build_config(None, {"strategy": "decoupled", "runtime": "service", "metrics_listen": "127.0.0.1:9400"})
    assert config.runtime_config.metrics_listen == "127.0.0.1:9400"
    assert config.runtime_config.progress_every_s == 30.0


def test_status_page_of_a_view() -> None:
    """The page, the JSON and the metrics of a hand-made view (no syncer): every number where it belongs."""
    from atoll.runtime.service.status import StatusServer

    islands = [{"island": 0, "state": "alive", "steps": 40, "loss": 3.5, "silent_s": 0.4, "since_push_s": 2.0,
                "joins": 1, "bytes_in": 1e6},
               {"island": 1, "state": "lost", "steps": 12, "loss": None, "silent_s": 31.0, "since_push_s": None,
                "joins": 2, "bytes_in": 0.0}]
    view = {"uptime_s": 65.0, "run_s": 60.0, "islands": islands, "shard": None, "merges": 7, "versions": [4, 3],
            "reserved": 52, "budget": 80, "merged_tokens": 4096, "merged_steps": 16, "staleness": 0.5,
            "goodput": 0.8, "bytes_in": 1e6, "bytes_out": 2e6, "refused_pushes": {"replay": 3},
            "refused_calls": {"identity": 2}, "calls": {}, "evals": [
                {"merged_steps": 0, "eval_loss": 6.2, "perplexity": 490.0},
                {"merged_steps": 10, "eval_loss": 5.1, "perplexity": 164.0}],
            "eval_loss": 5.1, "checkpoint": 7, "done": False, "starved": ""}
    server = StatusServer("127.0.0.1:0", lambda: view)
    try:
        base = f"http://127.0.0.1:{server.port}"
        text, kind = http(base + "/metrics")
        assert kind.startswith("text/plain")
        assert metric(text, "atoll_syncer_merges_total") == 7
        assert metric(text, "atoll_syncer_islands", '{state="lost"}') == 1
        assert metric(text, "atoll_syncer_island_up", '{island="1"}') == 0
        assert metric(text, "atoll_syncer_refusals_total", '{reason="replay",what="push"}') == 3
        assert metric(text, "atoll_syncer_refusals_total", '{reason="identity",what="call"}') == 2
        assert json.loads(http(base + "/status.json")[0])["islands"][1]["state"] == "lost"
        html, kind = http(base + "/")
        assert kind.startswith("text/html") and "<svg" in html and "lost" in html and "replay" in html
        with pytest.raises(urllib.error.HTTPError):
            http(base + "/nothing")
    finally:
        server.close()


@pytest.mark.slow
def test_a_running_syncer_shows_its_progress_events_metrics_and_page(fast_config: dict, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """A syncer served in this process with 2 island jobs: while it runs, its progress lines, the live events of
    its run folder, /metrics, /status.json and the page; at its end, the merges each counted equal the run's."""
    from atoll.runtime.service.serve import serve

    port, page_port, out = free_port(), free_port(), tmp_path / "syncer"
    settings = {k: v for k, v in fast_config.items() if k not in ("out", "checkpoint_every")}
    settings.update(strategy="decoupled", runtime="service", fragments=2, steps=200, eval_every=50,
                    collective_timeout_s=300,
                    listen=f"127.0.0.1:{port}", metrics_listen=f"127.0.0.1:{page_port}", progress=True,
                    progress_every_s=1.0, out=str(out), tracker=["tensorboard"])
    config = build_config(None, settings)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["summary"] = serve(config)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            result["error"] = e

    syncer = threading.Thread(target=run, daemon=True)
    syncer.start()
    deadline = time.monotonic() + 120
    while not (out / "credentials" / "island_1.token").is_file():
        assert "error" not in result and time.monotonic() < deadline, result
        time.sleep(0.2)
    flags = ["--data", fast_config["data"], "--cache-dir", fast_config["cache_dir"], "--model", "micro",
             "--vocab-size", "512", "--seq-len", "32", "--batch-size", "4", "--islands", "2", "--steps", "200",
             "--sync-every", "5", "--fragments", "2", "--eval-batches", "2", "--eval-every", "50", "--threads", "1",
             "--no-progress"]
    islands = [start(["island", "--syncer", f"127.0.0.1:{port}", "--plaintext", "--island", str(i),
                      "--credential", str(out / "credentials" / f"island_{i}.token"), *flags],
                     tmp_path / f"island_{i}.log") for i in range(2)]
    base = f"http://127.0.0.1:{page_port}"
    live: dict[str, Any] = {}
    stopped = False
    try:
        deadline = time.monotonic() + 300
        while syncer.is_alive() and time.monotonic() < deadline and "metrics" not in live:
            try:
                view = json.loads(http(base + "/status.json")[0])
            except OSError:  # not serving yet
                time.sleep(0.2)
                continue
            # training, island 1 too (it joined: under load it can start after island 0 has reserved steps):
            # island 1 stops answering (SIGSTOP)
            if view and view["reserved"] > 0 and view["islands"][1]["steps"] > 0 and not stopped:
                os.kill(islands[1].pid, signal.SIGSTOP)
                stopped = True
            if view and view["islands"][1]["state"] == "lost" and view["merges"] > 0:  # the run cannot end
                live["view"] = view  # without island 1: look at everything while it runs
                live["metrics"] = http(base + "/metrics")[0]
                live["page"] = http(base + "/")[0]
                live["events"] = [e["event"] for e in events(out / "run" / "metrics.jsonl")]
                live["tensorboard"] = tensorboard_tags(out / "run" / "tensorboard")
            time.sleep(0.1)
    finally:
        if stopped:
            os.kill(islands[1].pid, signal.SIGCONT)
        codes = wait_all(islands, timeout=300)
        syncer.join(timeout=300)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert codes == [0, 0] and "summary" in result, (result, logs)
    summary = result["summary"]
    # seen while it ran: a view with merges, the same in the metrics, the page, and events already on disk
    assert "metrics" in live, "the syncer ended before the test could look at it"
    assert metric(live["metrics"], "atoll_syncer_merges_total") >= live["view"]["merges"] > 0
    assert metric(live["metrics"], "atoll_syncer_islands", '{state="lost"}') == 1
    assert metric(live["metrics"], "atoll_syncer_island_up", '{island="1"}') == 0
    assert metric(live["metrics"], "atoll_syncer_island_steps", '{island="0"}') > 0
    assert "<tr class='lost'><td>1</td><td>lost</td>" in live["page"] and "merges" in live["page"]
    assert {"start", "join", "push", "merge", "lost"} <= set(live["events"]) and "end" not in live["events"]
    assert {"eval/loss", "train/loss"} <= live["tensorboard"]  # the tracker, fed while the run goes on
    # at the end: every merge counted once, by the events, the last progress line and the summary
    logged = events(out / "run" / "metrics.jsonl")
    kinds = [e["event"] for e in logged]
    assert kinds.count("merge") == summary["commits"] > 0
    assert kinds.count("join") == 2 and kinds.count("leave") == 2 and kinds.count("lost") == kinds.count("back") == 1
    assert kinds.count("eval") >= 3  # the initial one, at least one every 50 merged steps, the final one
    assert "checkpoint" in kinds and "train" in kinds
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("atoll syncer: ")]
    assert len(lines) >= 2, lines
    assert f"merges {summary['commits']} " in lines[-1] + " ", lines[-1]
    assert "islands 0/2 alive: 0 left, 1 left" in lines[-1], lines[-1]
    assert (out / "run" / "timeline.png").is_file()
    status = json.loads((out / "service" / "status.json").read_text())
    assert status["islands"] == ["left", "left"]


def test_a_silent_island_is_lost_not_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """island_states: joined and silent past LOST_AFTER_S is lost; alive again once it calls; left stays left."""
    from types import SimpleNamespace

    from atoll.runtime.service import monitor

    now = [100.0]
    service = SimpleNamespace(islands=[SimpleNamespace(heard=h, joins=j) for h, j in
                                       zip([None, 95.0, 80.0, 99.0], [0, 1, 1, 1], strict=True)], _now=lambda: now[0])
    assert monitor.island_states(service, {3}) == ["waiting", "alive", "lost", "left"]  # type: ignore[arg-type]
    service.islands[2].heard = 99.5
    assert monitor.island_states(service, set())[2] == "alive"  # type: ignore[arg-type]


@pytest.mark.parametrize("flag", [["--tracker", "tensorboard"], ["--out", "somewhere"], ["--progress-every", "5"]])
def test_an_island_refuses_the_settings_it_does_not_read(tmp_path: Path, flag: list[str]) -> None:
    """--tracker, --out and --progress-every are the syncer's: atoll island refuses them in one line, status 2."""
    from tests.conftest import run_cli

    token = tmp_path / "island_0.token"
    token.write_text("a" * 32)
    result = run_cli("island", "--syncer", "127.0.0.1:7070", "--island", "0", "--credential", str(token), *flag)
    lines = result.stderr.strip().splitlines()
    name = flag[0][2:].replace("-", "_")
    assert result.returncode == 2 and len(lines) == 1, (result.stdout, result.stderr)
    assert lines[0].startswith(f"atoll: error: {name}: atoll island does not use it"), lines
    assert not (tmp_path / "somewhere").exists()


def test_a_restarted_syncer_keeps_the_events_it_had_written(fast_config: dict, tmp_path: Path) -> None:
    """open_run on a run folder a syncer left unfinished (events, no checkpoint, no summary): its events are kept
    and the run events' counts go on; a folder holding a finished run is refused."""
    from atoll.job.metrics import write_summary
    from atoll.runtime.service.serve import open_run

    config = build_config(None, {**{k: v for k, v in fast_config.items() if k != "checkpoint_every"},
                                 "strategy": "decoupled", "runtime": "service", "fragments": 2})
    folder = tmp_path / "syncer" / "run"
    first = open_run(config, folder)
    first.events.log("merge", 0, fragment=0, version=1, islands=[0, 1], sim_wall_s=1.0)
    first.emit("lost", step=0, island=1, silent_s=11.0, sim_wall_s=2.0)
    first.log.close()
    first.lock.release()  # (a killed syncer's lock goes with its process)
    again = open_run(config, folder)
    kinds = [e["event"] for e in events(folder / "metrics.jsonl")]
    assert kinds == ["start", "eval", "merge", "lost", "start", "eval"]
    assert again.events.log("merge", 0, fragment=1, version=1, islands=[0], sim_wall_s=3.0)["count"] == 2
    again.log.close()
    again.lock.release()
    write_summary(folder, {"done": True})
    with pytest.raises(ConfigError, match="out:"):
        open_run(config, folder)


def test_the_progress_line_of_a_view() -> None:
    """Each island's state, step and last push; merges; refusals of pushes and calls summed by reason."""
    from atoll.runtime.service.monitor import Monitor

    monitor = Monitor.__new__(Monitor)  # (the line reads the view only)
    monitor.islands = 2
    view = {"uptime_s": 65, "shard": None, "reserved": 6, "budget": 40, "merges": 2, "staleness": 0.5,
            "goodput": 0.8, "bytes_in": 1500, "bytes_out": 10, "eval_loss": 5.1234,
            "islands": [{"island": 0, "state": "alive", "steps": 3, "since_push_s": 2.2, "silent_s": 0.1},
                        {"island": 1, "state": "lost", "steps": 3, "since_push_s": 14.0, "silent_s": 12.0}],
            "refused_pushes": {"replay": 1}, "refused_calls": {"replay": 2, "identity": 1}}
    assert monitor.line(view) == (
        "atoll syncer: 0:01:05 | islands 1/2 alive: 0 step 3 (push 2s ago), 1 lost (silent 12s) | steps 6/40 | "
        "merges 2 | staleness 0.50 | goodput 80% | in 1.5 KB, out 10 B | eval 5.123 | refused identity 1, replay 3")

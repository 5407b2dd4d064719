"""A screenshot of ``atoll syncer``'s status page in a real browser (headless Chromium): docs/status_page.png.

    apt-get install -y chromium                 # the distribution's package (Debian, Ubuntu: chromium-browser)
    python bench/status_screenshot.py           # writes docs/status_page.png
    python bench/status_screenshot.py --out /tmp/page.png --islands 3 --steps 400

A small run on loopback: ``atoll syncer --metrics-listen 127.0.0.1:PORT`` (plaintext) and ``--islands``
island jobs of one process (a tiny model on a small corpus of the Python standard library's sources), and one
stranger's call (a wrong secret: refused, counted). Once the global model has been evaluated a few times the
last island is stopped (SIGSTOP), so the page shows an island ``lost``; once it is, the page is rendered by
``chromium --headless --screenshot`` and the island continued (SIGCONT): the run then ends by itself. Also
checks that the page, ``/status.json`` and ``/metrics`` answer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "status_page.png", help="the PNG to write")
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--steps", type=int, default=400, help="inner steps per island")
    p.add_argument("--evals", type=int, default=4, help="evaluations seen on the page before the screenshot")
    p.add_argument("--window-size", default="1280,820", help="the browser's window, WIDTH,HEIGHT pixels")
    p.add_argument("--browser", default=None, help="the browser command (default: chromium or chromium-browser)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def _view(base: str) -> dict[str, Any]:
    try:
        return json.loads(_get(base + "/status.json"))
    except OSError:
        return {}


def _stranger(address: str) -> None:
    """A call to the syncer as island 0 with a wrong secret (refused, counted as ``identity``)."""
    from atoll.errors import ConfigError
    from atoll.runtime.service.client import SyncerClient

    client = SyncerClient(address, 0, "0" * 32, plaintext=True, give_up_s=60.0)
    try:
        client.call("Heartbeat")
    except ConfigError:
        pass
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    browser = args.browser or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("status_screenshot: no chromium found; apt-get install -y chromium (or pass --browser)",
              file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="atoll-status-") as tmp_name:
        tmp = Path(tmp_name)
        corpus = tmp / "corpus.txt"  # a small corpus: the page matters, not the model
        std = Path(sysconfig.get_paths()["stdlib"])
        corpus.write_text("\n\n\n".join(f.read_text(encoding="utf-8") for f in sorted((std / "json").glob("*.py"))))
        port, page_port, out = _free_port(), _free_port(), tmp / "syncer"
        flags = ["--data", str(corpus), "--cache-dir", str(tmp / "cache"), "--model", "micro", "--vocab-size", "512",
                 "--seq-len", "32", "--batch-size", "4", "--islands", str(args.islands), "--steps", str(args.steps),
                 "--sync-every", "5", "--fragments", "2", "--eval-batches", "2", "--eval-every",
                 str(max(1, args.steps // 10)), "--threads", "1", "--no-progress"]
        procs = [subprocess.Popen([sys.executable, "-m", "atoll", "syncer", "--listen", f"127.0.0.1:{port}",
                                   "--metrics-listen", f"127.0.0.1:{page_port}", "--collective-timeout-s", "300",
                                   "--out", str(out), *flags], env=env, stdout=(tmp / "syncer.log").open("w"),
                                  stderr=subprocess.STDOUT)]
        try:
            deadline = time.monotonic() + 300
            while not (out / "credentials" / f"island_{args.islands - 1}.token").is_file():
                assert procs[0].poll() is None and time.monotonic() < deadline, (tmp / "syncer.log").read_text()
                time.sleep(0.2)
            procs += [subprocess.Popen([sys.executable, "-m", "atoll", "island", "--syncer", f"127.0.0.1:{port}",
                                        "--plaintext", "--island", str(i), "--credential",
                                        str(out / "credentials" / f"island_{i}.token"), *flags], env=env,
                                       stdout=(tmp / f"island_{i}.log").open("w"), stderr=subprocess.STDOUT)
                      for i in range(args.islands)]
            base, last = f"http://127.0.0.1:{page_port}", procs[-1]
            _stranger(f"127.0.0.1:{port}")  # the page's refusals: a call with a secret that is not island 0's
            stopped = False
            while True:
                assert procs[0].poll() is None and time.monotonic() < deadline, "the run ended before the screenshot"
                view = _view(base)
                if view and not stopped and len(view["evals"]) >= args.evals:
                    os.kill(last.pid, signal.SIGSTOP)  # the page shows a lost island
                    stopped = True
                if view and stopped and view["islands"][-1]["state"] == "lost":
                    break
                time.sleep(0.2)
            assert b"atoll_syncer_merges_total" in _get(base + "/metrics")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={args.window_size}", f"--screenshot={args.out.resolve()}", base + "/"],
                           check=True, timeout=120, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.kill(last.pid, signal.SIGCONT)
            codes = [p.wait(timeout=600) for p in procs[1:]] + [procs[0].wait(timeout=600)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait()
        print(f"status_screenshot: {args.out} (run exit codes {codes})")
        return 0 if codes == [0] * len(codes) else 1


if __name__ == "__main__":
    sys.exit(main())

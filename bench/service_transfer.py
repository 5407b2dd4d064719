"""The syncer service's wire on loopback: push and pull throughput, and a heartbeat's latency during a transfer.

    python bench/service_transfer.py                          # 20m model, one fragment (~87 MB float32), TLS
    python bench/service_transfer.py --model tiny --repeats 2 --plaintext --out /tmp/service_transfer

One :class:`~atoll.runtime.service.server.SyncerServer` (the ``atoll syncer`` handlers) is served in this
process on 127.0.0.1, with a self-signed certificate (``cryptography``) unless ``--plaintext``. One island's
:class:`~atoll.runtime.service.client.SyncerClient` then, ``--repeats`` times: uploads a fragment's float32
Δ in 1 MiB chunks and commits it (a push; quorum 2, so it waits in the buffer and nothing is merged), and
downloads the global fragment (a pull); seconds are medians, MB/s are 10^6 bytes of safetensors payload per
second. Meanwhile a second thread sends a heartbeat on the control connection every 20 ms: the table gives
its median and worst latency while bulk transfers run, against the same with the link idle (measured first,
in the same run), which is what keeping control apart from bulk is for. Loopback: the figures are the
serialization, TLS and gRPC cost, not a network's; the machine's load is written beside them.

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/service_transfer``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from atoll.benchmarks.common import default_out, script_error, write_results


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="20m", help="model preset; one fragment holds all of it [20m]")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes and pulls [3]")
    parser.add_argument("--plaintext", action="store_true", help="no TLS")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/service_transfer]")
    return parser.parse_args(argv)


def heartbeats(client: Any, stop: threading.Event, out: list[float]) -> None:
    """Heartbeat round trips (seconds) into ``out``, one at once and then every 20 ms until ``stop`` (at least
    one sample, however short the transfers it runs beside)."""
    while True:
        t0 = time.perf_counter()
        client.call("Heartbeat")
        out.append(time.perf_counter() - t0)
        if stop.wait(0.02):
            return


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/service_transfer.py [flags]``; the exit status (2: bad flags)."""
    import grpc

    from atoll.config import build_config
    from atoll.runtime.service import wire
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.server import SyncerServer
    from atoll.runtime.service.tls import loopback_certificate

    args = parse_args(argv)
    if args.repeats < 1:
        return script_error("service_transfer", ValueError("repeats: must be >= 1"))
    out = args.out or default_out("service_transfer")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="atoll-service-transfer-"))
    corpus = tmp / "corpus.txt"  # a small corpus: the bench measures the wire, not the data
    std = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_text("\n\n\n".join(f.read_text(encoding="utf-8") for f in sorted((std / "json").glob("*.py"))))
    config = build_config(None, {"strategy": "decoupled", "model": args.model, "fragments": 1, "islands": 2,
                                 "codec": "fp32", "pull_codec": "fp32", "runtime": "service",
                                 "data": str(corpus), "vocab_size": 512, "cache_dir": str(tmp / "cache"),
                                 "out": str(tmp / "syncer"), "steps": 10, "sync_every": 5, "progress": False})
    creds = ["a" * 32, "b" * 32]
    state = SyncerServer.of_run(config, tmp / "syncer", creds)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), handlers=[state.handler()])
    ca = None
    if args.plaintext:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        key, ca = loopback_certificate()
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, ca)]))
    server.start()
    load_before = os.getloadavg()
    client = SyncerClient(f"127.0.0.1:{port}", 0, creds[0], ca, plaintext=args.plaintext)
    session = client.call("Join", {"numels": state.service.syncer.numels})["session"]
    other = SyncerClient(f"127.0.0.1:{port}", 1, creds[1], ca, plaintext=args.plaintext)
    other.call("Join", {"numels": state.service.syncer.numels})  # the run starts once every island joined
    numel = state.service.syncer.numels[0]
    idle: list[float] = []
    stop = threading.Event()
    beat = threading.Thread(target=heartbeats, args=(client, stop, idle))
    beat.start()
    time.sleep(2.0)
    stop.set()
    beat.join()
    busy: list[float] = []
    stop = threading.Event()
    beat = threading.Thread(target=heartbeats, args=(client, stop, busy))
    beat.start()
    push_s, pull_s, size = [], [], 0
    for i in range(args.repeats):
        client.call("ReserveSteps", {"n": 5})
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(i)) * 1e-4
        t0 = time.perf_counter()
        payload = wire.payload_bytes({"values": delta})  # the fp32 codec's payload: the float32 values
        answer = client.push(payload, 0, ((0, numel),), 5 * config.tokens_per_step, 0, session + i)
        push_s.append(time.perf_counter() - t0)
        assert answer["accepted"], answer
        t0 = time.perf_counter()
        client.download(0)
        pull_s.append(time.perf_counter() - t0)
        size = len(payload)
    stop.set()
    beat.join()
    # channels closed and the server stopped (waited for) before the interpreter's teardown: gRPC's threads of
    # an open channel or a server still stopping are left to the finalizers otherwise
    client.close()
    other.close()
    server.stop(grace=0).wait()
    load_after = os.getloadavg()
    mb = size / 1e6
    row = {"model": args.model, "tls": not args.plaintext, "payload_mb": mb,
           "push_s": statistics.median(push_s), "pull_s": statistics.median(pull_s),
           "push_mbps": mb / statistics.median(push_s), "pull_mbps": mb / statistics.median(pull_s),
           "heartbeat_idle_ms": 1e3 * statistics.median(idle), "heartbeat_busy_ms": 1e3 * statistics.median(busy),
           "heartbeat_busy_max_ms": 1e3 * max(busy), "heartbeats_busy": len(busy)}
    machine = {"cpus": os.cpu_count(), "threads": 1, "loadavg_1m_before": load_before[0],
               "loadavg_1m_after": load_after[0], "grpc": grpc.__version__}
    print(f"[service_transfer] push {row['push_mbps']:.1f} MB/s, pull {row['pull_mbps']:.1f} MB/s, heartbeat "
          f"{row['heartbeat_idle_ms']:.1f} ms idle, {row['heartbeat_busy_ms']:.1f} ms during transfers", flush=True)
    columns = [("model", "model"), ("TLS", "tls"), ("payload MB", "payload_mb"), ("push MB/s", "push_mbps"),
               ("pull MB/s", "pull_mbps"), ("heartbeat ms, idle", "heartbeat_idle_ms"),
               ("heartbeat ms, during transfers", "heartbeat_busy_ms"),
               ("heartbeat ms, worst during transfers", "heartbeat_busy_max_ms")]
    notes = [f"loopback, one process, {args.repeats} pushes (upload in 1 MiB chunks + commit) and pulls, medians; "
             "MB = 10^6 bytes of safetensors payload; heartbeats every 20 ms on the control connection.",
             f"machine: {machine['cpus']} CPUs, load average (1 min) {load_before[0]:.2f} before, "
             f"{load_after[0]:.2f} after (a shared machine: lower bounds for throughput)."]
    print(write_results(out, {"machine": machine, "rows": [row], "push_s": push_s, "pull_s": pull_s}, columns, [row],
                        title="The syncer service's wire (`python bench/service_transfer.py`)", notes=notes))
    return 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

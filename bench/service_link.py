"""One island's push and pull over a shaped, delayed link: the share of the link rate each reaches.

    sudo python bench/service_link.py                                  # 1 Gbit/s, 35 ms each way, TLS, 125m, 2 ranks
    sudo python bench/service_link.py --instrument --mtu 1500 9000 65000   # the link alone: plain TCP, per MTU
    sudo python bench/service_link.py --window-mib 0 --label "gRPC default window"

Needs root (network namespaces, veth, ``tc tbf``; :class:`~atoll.benchmarks.netns.EmulatedWan`). Two
namespaces joined by links of ``--rate-mbps`` in each direction, with ``--delay-ms`` added each way by the
user-space delay line (:mod:`atoll.benchmarks.delay`; the kernel here has no ``netem``), so a round trip
costs ``2 x delay``. The hosts' TCP buffers are raised to ``--tcp-buffer-mib`` in both namespaces (the third
value of ``net.ipv4.tcp_rmem`` / ``tcp_wmem``: what a WAN host is tuned to, docs/deployment.md).

In namespace 0 a syncer (:class:`~atoll.runtime.service.server.SyncerServer` served by
:func:`~atoll.runtime.service.serve.build_server`, the ``atoll syncer`` options, TLS with a self-signed
certificate unless ``--plaintext``) of a decoupled run of ``--model`` cut into ``--fragments`` fragments, fp32
codec (the largest payload, what fills a link); in namespace 1 ``--ranks`` processes of one island, each with
its own :class:`~atoll.runtime.service.client.SyncerClient` (rank 0 with the control connection), as
``atoll island``'s ranks (:class:`~atoll.runtime.service.exchange.ServiceTransport`, ``slice_transfer =
ranks``): a **push** of fragment p is every rank serializing and uploading its slice (1/R of the fragment)
at once, rank 0's upload carrying the push's commit (``--commit riding``, what ``atoll island`` does: the syncer
answers it in that upload's reply once every slice is up), or, ``--commit push``, then rank 0's commit (``Push``:
one more round trip); the lease it claims is taken before, off the clock, as an island takes its leases ahead; a
**pull** is every rank downloading its slice at once. A round
pushes every fragment, then pulls every fragment, ``--in-flight`` at once (1: one after the other; 2: as an
island with two exchanges in flight, whose round trips overlap). One round on fresh connections first (the
"cold" shares: TCP and HTTP/2 windows grown from their start), then ``--repeats`` timed rounds. The share
is the payload's bits per second over the link's rate (the wire also carries TCP/IP/TLS/HTTP2 headers: a
few percent); the upload share (``--commit push``) leaves the commit's round trip out. Meanwhile rank 0 sends a
heartbeat every 20 ms on its control connection: its round trip idle (the link's RTT) and during the transfers.

Nothing is merged: the run has one more island than push (``--islands``), which joins and stays silent, so
the quorum (every island) is never reached; a fragment's first push waits in the buffer, and the later ones
are refused as replays (the same base version) after their slices were received, decoded and reassembled,
as any push's are. The merge's cost is bench/outer_round.py's. A pull serves the syncer's cached
serialization of the fragment (one per version and slice, shared by every island). CPU s/GB: CPU seconds of
the islands' processes (together) and of the syncer's per 10^9 payload bytes, from ``getrusage`` around the
timed rounds; ``--loopback`` (no namespaces, no delay line) gives the CPU's ceiling, and ``--islands 4
--ranks 1 --loopback`` the syncer's ingress with 4 islands pushing at once. ``--perf DIR``: ``perf record``
and ``py-spy record`` of the syncer and island 0's rank 0 during the timed rounds.

``--instrument``: the link alone, before any gRPC: a plain TCP sender in namespace 1 to a receiver in
namespace 0 for ``--seconds``, per ``--mtu``; the rate it carries is the ceiling of the study (the delay
line is Python, so its packets per second are bounded; a larger MTU carries more bytes per packet).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/service_link``); ``--append``
adds this run's rows to those already there (a table of several settings, each run with its own command).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import resource
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import default_out, script_error, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.service_transfer import heartbeats  # noqa: E402 - the heartbeat sampler both transfer studies use

PORT = 7070
TCP_PORT = 5201
CREDENTIALS = [f"{i:02d}" * 16 for i in range(16)]  # island i's secret


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbps", type=float, default=1000.0, help="link rate each way, Mbit/s [1000]")
    parser.add_argument("--delay-ms", type=float, default=35.0, help="one-way delay, ms [35: a 70 ms RTT]")
    parser.add_argument("--mtu", type=int, nargs="+", default=[9000], help="link MTU (several: --instrument) [9000]")
    parser.add_argument("--tbf-latency-ms", type=float, default=50.0, help="tbf queue, ms at the rate [50]")
    parser.add_argument("--tcp-buffer-mib", type=float, default=64.0,
                        help="hosts' TCP buffer limit (tcp_rmem/tcp_wmem max) in both namespaces; 0: the kernel's [64]")
    parser.add_argument("--slow-start-after-idle", type=int, choices=[0, 1], default=1,
                        help="net.ipv4.tcp_slow_start_after_idle in both namespaces: 1, the kernel's default (a "
                             "connection idle for a retransmission timeout restarts from its initial window); 0: "
                             "kept (measured: no difference with BBR here) [1]")
    parser.add_argument("--model", default="125m", help="model preset [125m]")
    parser.add_argument("--fragments", type=int, default=4, help="P, fragments [4]")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of each island [2]")
    parser.add_argument("--islands", type=int, default=1, help="islands pushing and pulling at once [1]")
    parser.add_argument("--commit", choices=["riding", "push"], default="riding",
                        help="riding: rank 0's upload carries the push's commit (atoll's); push: a Push call after "
                             "every slice is up (one more round trip) [riding]")
    parser.add_argument("--in-flight", type=int, default=1,
                        help="fragments pushed (or pulled) at once: an island's exchanges in flight [1]")
    parser.add_argument("--loopback", action="store_true",
                        help="no link: every process on 127.0.0.1 (the CPU's ceiling; no root needed)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds over every fragment [2]")
    parser.add_argument("--window-mib", type=float, default=None,
                        help="bulk_window_mib of syncer and island; 0: gRPC's default window [the setting's default]")
    parser.add_argument("--plaintext", action="store_true", help="no TLS")
    parser.add_argument("--codec", default="fp32", choices=["fp32", "bf16", "int8", "int4"],
                        help="what a push carries: each rank's slice encoded by this codec before the round's clock "
                        "(the syncer decodes it at the commit); pulls stay float32 [fp32]")
    parser.add_argument("--instrument", action="store_true", help="the link alone: plain TCP throughput per MTU")
    parser.add_argument("--seconds", type=float, default=8.0, help="--instrument: seconds per sender [8]")
    parser.add_argument("--label", default="", help="a name for this run's row")
    parser.add_argument("--append", action="store_true", help="add the rows to those in --out")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/service_link]")
    parser.add_argument("--perf", type=Path, default=None,
                        help="record the syncer and island 0's rank 0 in the timed rounds with perf into this folder")
    parser.add_argument("--role", choices=["syncer", "rank", "sink", "source"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--island", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
# the child processes (each in a namespace; JSON lines on stdin and stdout)


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _threads_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's threads, summed by thread name (gRPC's own threads apart from Python's)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _config(spec: dict[str, Any]) -> Any:
    from atoll.config import build_config

    return build_config(None, spec["overrides"])


def _syncer(spec: dict[str, Any]) -> None:
    """The syncer, served with ``atoll syncer``'s server options until stdin closes; says its fragments' sizes,
    and its CPU seconds when asked."""
    import grpc
    import torch

    from atoll.config.runtimes import ServiceConfig
    from atoll.runtime.service.serve import build_server
    from atoll.runtime.service.server import SyncerServer

    torch.set_num_threads(1)
    config = _config(spec)
    state = SyncerServer.of_run(config, Path(spec["tmp"]) / "syncer", CREDENTIALS[:config.islands])
    server = build_server(state, ServiceConfig.of_run(config), config.islands, config.strategy_config.fragments)
    listen = f"{spec['host']}:{PORT}"
    if spec["tls"]:
        pair = (Path(spec["key"]).read_bytes(), Path(spec["cert"]).read_bytes())
        server.add_secure_port(listen, grpc.ssl_server_credentials([pair]))
    else:
        server.add_insecure_port(listen)
    server.start()
    _say({"numels": list(state.service.syncer.numels)})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "cpu":
            _say({"id": cmd.get("id"), "cpu_s": _cpu_s(), "threads": _threads_cpu_s()})
    server.stop(grace=0).wait()


def _rank(spec: dict[str, Any], island: int, rank: int) -> None:
    """One rank of an island: uploads and downloads its slice of a fragment when told (rank 0 also joins its
    island, commits, and sends heartbeats)."""
    import torch

    from atoll.algorithms.fragments import FlatFragment
    from atoll.runtime.service import flow, wire
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.slices import even_parts

    torch.set_num_threads(1)
    numels, ranks = spec["numels"], spec["ranks"]
    ca = Path(spec["cert"]).read_bytes() if spec["tls"] else None
    window = flow.window_bytes(spec["window_mib"]) if spec["window_mib"] else None
    address = f"{spec['host']}:{PORT}"

    def client(island: int, control: bool) -> SyncerClient:
        return SyncerClient(address, island, CREDENTIALS[island], ca, plaintext=not spec["tls"], insecure=True,
                            server_name="localhost", control=control, window=window)

    me = client(island, rank == 0)
    me.probe()
    session = 0
    if rank == 0:
        session = me.call("Join", {"numels": numels})["session"]
    if rank == 0 and island == 0:  # the run starts once every island joined: island 0 joins the silent one
        client(spec["islands"], True).call("Join", {"numels": numels})
    parts = [even_parts(FlatFragment(((0, n),)), ranks)[rank].ranges for n in numels]
    seeds = [7 * p + rank + 1000 * island for p in range(len(parts))]
    deltas = [torch.randn(sum(b - a for a, b in r), generator=torch.Generator().manual_seed(seed)) * 1e-4
              for seed, r in zip(seeds, parts, strict=True)]
    if spec.get("codec", "fp32") == "fp32":
        payloads = [{"values": d} for d in deltas]
    else:  # encoded ahead, as an island encodes its slice before the push starts
        from atoll.algorithms.codecs import make_codec

        codec = make_codec(spec["codec"], block_size=spec["block_size"])
        payloads = [codec.encode(d).tensors for d in deltas]
    beats: list[float] = []
    stop = threading.Event()
    beat: threading.Thread | None = None
    say = threading.Lock()

    def serve(cmd: dict[str, Any]) -> None:  # (one request, in a thread of its own: several may run at once)
        nonlocal beats, stop, beat
        op, t0 = cmd["op"], time.perf_counter()
        reply: dict[str, Any] = {"id": cmd.get("id")}
        if op == "push":
            payload = wire.payload_bytes(payloads[cmd["p"]])
            ids = [f"{cmd['k']}.{cmd['p']}.{r}" for r in range(ranks)]
            if cmd.get("ride") and rank == 0:  # the commit rides on rank 0's slice (ServiceTransport's way)
                request = me.push_request(ids, cmd["p"], 5 * spec["tokens_per_step"], 0, session)
                answer = me.upload_commit(payload, cmd["p"], parts[cmd["p"]], ids[rank], request)
                if answer is None:  # a slice came late: committed as a Push (ServiceTransport's fallback)
                    answer = me.commit(ids, cmd["p"], 5 * spec["tokens_per_step"], 0, session)
                reply["accepted"] = answer["accepted"]
            else:
                me.upload(payload, cmd["p"], parts[cmd["p"]], ids[rank])
            reply["bytes"] = len(payload)
        elif op == "reserve":  # the lease the commit claims (an island takes it ahead, not on a push's path)
            me.call("ReserveSteps", {"n": 5})
        elif op == "commit":
            ids = [f"{cmd['k']}.{cmd['p']}.{r}" for r in range(ranks)]
            reply["accepted"] = me.commit(ids, cmd["p"], 5 * spec["tokens_per_step"], 0, session)["accepted"]
        elif op == "pull":
            version, values = me.download(cmd["p"], parts[cmd["p"]])
            reply["bytes"] = 4 * values.numel()
        elif op == "cpu":
            reply.update(cpu_s=_cpu_s(), threads=_threads_cpu_s())
        elif op == "beats":
            if cmd["on"]:
                beats, stop = [], threading.Event()
                beat = threading.Thread(target=heartbeats, args=(me, stop, beats))
                beat.start()
            elif beat is not None:
                stop.set()
                beat.join()
                reply["beats"] = beats
        reply["s"] = time.perf_counter() - t0
        with say:
            _say(reply)

    pool = ThreadPoolExecutor(max_workers=16)
    _say({"ready": True})
    for line in sys.stdin:
        pool.submit(serve, json.loads(line))
    pool.shutdown(wait=True)
    me.close()


def _sink(spec: dict[str, Any]) -> None:
    """Plain TCP receiver: the bytes it got in each 0.5 s, as one JSON line once the sender closes."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((spec["host"], TCP_PORT))
    srv.listen(1)
    _say({"ready": True})
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    start, marks, got = time.perf_counter(), [], 0
    while True:
        n = conn.recv_into(view)
        if not n:
            break
        got += n
        now = time.perf_counter() - start
        if not marks or now - marks[-1][0] >= 0.5:
            marks.append((now, got))
    marks.append((time.perf_counter() - start, got))
    _say({"marks": marks})


def _source(spec: dict[str, Any]) -> None:
    """Plain TCP sender: as fast as the socket takes bytes, for ``seconds``."""
    s = socket.create_connection((spec["host"], TCP_PORT))
    data = b"\0" * (1 << 20)
    end = time.perf_counter() + spec["seconds"]
    while time.perf_counter() < end:
        s.sendall(data)
    s.close()
    _say({"done": True})


# ----------------------------------------------------------------------------------------------------------
# the harness


class Child:
    """A child process of this script, in namespace ``ns`` of ``wan`` (None: this host), spoken to in JSON
    lines; requests carry an id, so several may be in flight (:meth:`ask` from several threads)."""

    def __init__(self, wan: Any, ns: int, role: str, spec: Path, island: int = 0, rank: int = 0) -> None:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--spec", str(spec), "--island",
                str(island), "--rank", str(rank)]
        kwargs: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
        self.proc = wan.popen(ns, argv, **kwargs) if wan is not None else subprocess.Popen(argv, **kwargs)
        self.lock = threading.Lock()
        self.waiting: dict[int, Future] = {}
        self.next = 0
        self.lines: queue.Queue = queue.Queue()  # lines without an id (a readiness, a sink's count)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.lock:
                future = self.waiting.pop(reply["id"], None) if reply.get("id") is not None else None
            if future is not None:
                future.set_result(reply)
            else:
                self.lines.put(reply)
        error = RuntimeError(f"a child ({' '.join(map(str, self.proc.args[-8:]))}) ended with status "
                             f"{self.proc.wait()}")
        with self.lock:
            for f in self.waiting.values():
                f.set_exception(error)
        self.lines.put(error)

    def line(self) -> dict[str, Any]:
        """The child's next line without an id (its readiness, a sink's count)."""
        got = self.lines.get()
        if isinstance(got, Exception):
            raise got
        return got

    def send(self, obj: dict[str, Any]) -> Future:
        assert self.proc.stdin is not None
        with self.lock:
            self.next += 1
            future: Future = Future()
            self.waiting[self.next] = future
            self.proc.stdin.write(json.dumps({**obj, "id": self.next}) + "\n")
            self.proc.stdin.flush()
        return future

    def ask(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self.send(obj).result()

    def close(self) -> None:
        assert self.proc.stdin is not None
        with self.lock:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _tune(wan: Any, buffer_mib: float, slow_start_after_idle: int = 1) -> None:
    from atoll.benchmarks.namespaces import run_command

    most = int(buffer_mib * (1 << 20))
    for ns in wan.island_ns:
        run_command("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
                    f"net.ipv4.tcp_slow_start_after_idle={slow_start_after_idle}")
        if buffer_mib > 0:
            run_command("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.tcp_rmem=4096 131072 {most}",
                        f"net.ipv4.tcp_wmem=4096 16384 {most}")


def _commit_s(pushes: list[tuple[float, ...]], upload_s: list[float], fragments: int, in_flight: int) -> float | None:
    """A push's commit, seconds per fragment (one fragment at a time): each timed round's seconds less its
    uploads', over its fragments, the mean of the rounds; None with several in flight (the commits overlap)."""
    if in_flight != 1 or not pushes:
        return None
    return statistics.mean((round_s[0] - sum(upload_s[k * fragments:(k + 1) * fragments])) / fragments
                           for k, round_s in enumerate(pushes))


def _machine(load_before: tuple[float, ...]) -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_1m_before": load_before[0], "loadavg_1m_after": os.getloadavg()[0],
            "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def instrument(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Plain TCP over the link, per MTU: Mbit/s after the first second (slow start), and the delay line's
    CPU and drops."""
    from atoll.benchmarks.netns import EmulatedWan, LinkShape

    rows = []
    for mtu in args.mtu:
        shape = LinkShape(rate_mbps=args.rate_mbps, delay_ms=args.delay_ms, mtu=mtu,
                          tbf_latency_ms=args.tbf_latency_ms)
        load = os.getloadavg()
        with EmulatedWan(2, shape) as wan:
            _tune(wan, args.tcp_buffer_mib, args.slow_start_after_idle)
            spec = tmp / f"tcp{mtu}.json"
            spec.write_text(json.dumps({"host": wan.island_ip(0), "seconds": args.seconds}))
            sink = Child(wan, 0, "sink", spec)
            sink.line()
            c0 = _cpu_s()
            source = Child(wan, 1, "source", spec)
            source.line()
            marks = sink.line()["marks"]
            cpu = _cpu_s() - c0
            stats = wan.delay_stats()
        (t1, b1) = next((t, b) for t, b in marks if t >= 1.0)
        (t2, b2) = marks[-1]
        mbps = 8 * (b2 - b1) / (t2 - t1) / 1e6
        row = {"label": args.label or f"plain TCP, MTU {mtu}", "what": "plain TCP", "mtu": mtu,
               "link": f"{args.rate_mbps:g} Mbit/s, {2 * args.delay_ms:g} ms RTT",
               "rate_mbps": args.rate_mbps, "rtt_ms": 2 * args.delay_ms, "mbps": mbps,
               "share": mbps / args.rate_mbps, "delay_cpu_per_s": cpu / marks[-1][0],
               "dropped": sum(s["dropped"] for s in stats), **_machine(load)}
        print(f"[service_link] plain TCP, MTU {mtu}: {mbps:.0f} Mbit/s ({100 * row['share']:.0f}% of "
              f"{args.rate_mbps:g}), delay line {row['delay_cpu_per_s']:.2f} CPU s/s, drops {row['dropped']}, "
              f"load {row['loadavg_1m_before']:.1f}", flush=True)
        rows.append(row)
    return rows


def study(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The syncer and the islands' ranks over the link (or loopback): push and pull seconds per fragment, as a
    share of the link rate, CPU per GB, and the heartbeat's round trip."""
    from atoll.benchmarks.netns import EmulatedWan, LinkShape
    from atoll.config import build_config
    from atoll.config.runtimes import ServiceConfig
    from atoll.runtime.service.tls import loopback_certificate

    corpus = tmp / "corpus.txt"  # a small corpus: the bench measures the wire, not the data
    std = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_text("\n\n\n".join(f.read_text(encoding="utf-8") for f in sorted((std / "json").glob("*.py"))))
    host = "127.0.0.1" if args.loopback else EmulatedWan.island_ip(0)
    # and a silent island: the quorum (every island) is never reached, so nothing is merged: the rounds time the
    # transfers, not the merge (bench/outer_round.py times that). A fragment's first push waits in the buffer; the
    # later ones are refused as replays (same base version) after their slices were received, decoded and
    # assembled, as any push's are
    total = args.islands + 1
    overrides = {"strategy": "decoupled", "model": args.model, "fragments": args.fragments, "islands": total,
                 "quorum": total, "min_quorum": total, "codec": args.codec, "pull_codec": "fp32", "runtime": "service",
                 "data": str(corpus),
                 "vocab_size": 512, "cache_dir": str(tmp / "cache"), "out": str(tmp / "syncer"), "steps": 100000,
                 "sync_every": 5, "progress": False, "listen": f"{host}:{PORT}", "insecure": True}
    if args.window_mib:
        overrides["bulk_window_mib"] = args.window_mib
    config = build_config(None, overrides)  # (the tokenizer trained once, in the cache the children share)
    window_mib = ServiceConfig.of_run(config).bulk_window_mib if args.window_mib != 0 else 0.0
    if args.window_mib == 0:  # gRPC's default window at both ends
        overrides["bulk_window_mib"] = 1 / 16  # (64 KiB: gRPC's default)
    key, cert = loopback_certificate()
    (tmp / "key.pem").write_bytes(key)
    (tmp / "cert.pem").write_bytes(cert)
    spec = {"overrides": overrides, "tmp": str(tmp), "host": host, "tls": not args.plaintext,
            "key": str(tmp / "key.pem"), "cert": str(tmp / "cert.pem"), "ranks": args.ranks, "islands": args.islands,
            "window_mib": window_mib, "tokens_per_step": config.tokens_per_step, "codec": args.codec,
            "block_size": config.strategy_config.codec_block_size}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    shape = LinkShape(rate_mbps=args.rate_mbps, delay_ms=args.delay_ms, mtu=args.mtu[0],
                      tbf_latency_ms=args.tbf_latency_ms)
    load = os.getloadavg()
    perf = args.perf
    with contextlib.ExitStack() as stack:
        wan = None if args.loopback else stack.enter_context(EmulatedWan(2, shape))
        if wan is not None:
            _tune(wan, args.tcp_buffer_mib, args.slow_start_after_idle)
        syncer = Child(wan, 0, "syncer", spec_path)
        numels = syncer.line()["numels"]
        spec["numels"] = numels
        spec_path.write_text(json.dumps(spec))
        ranks = [[Child(wan, 1, "rank", spec_path, i, r) for r in range(args.ranks)] for i in range(args.islands)]
        every = [c for island in ranks for c in island]
        for c in every:
            c.line()
        beater = ranks[0][0]
        idle = _beat_window(beater, 2.0)

        def push(p: int, k: int) -> int:  # every rank uploads its slice at once, then each island's rank 0 commits
            t0 = time.perf_counter()
            ride = args.commit == "riding"
            replies = [f.result() for f in [c.send({"op": "push", "p": p, "k": k, "ride": ride}) for c in every]]
            uploaded = time.perf_counter() - t0
            commits = [r for r in replies if "accepted" in r] if ride else \
                [f.result() for f in [i[0].send({"op": "commit", "p": p, "k": k}) for i in ranks]]
            accepted.extend(c["accepted"] for c in commits)
            upload_s.append(uploaded)
            return sum(x["bytes"] for x in replies)

        def pull(p: int) -> int:  # every rank downloads its slice at once
            return sum(f.result()["bytes"] for f in [c.send({"op": "pull", "p": p}) for c in every])

        def phase(run: Any, k: int) -> tuple[float, int, float, float]:
            """Every fragment's push (or pull) of round k, ``--in-flight`` at once: (seconds, bytes, the islands'
            CPU seconds, the syncer's)."""
            before = [c.ask({"op": "cpu"}) for c in [syncer, *every]]
            if run is push:  # the leases the round's commits claim: an island takes them ahead, off the clock
                for _ in numels:  # (until 2026-12-06 20:00 one per push, on the round's clock: a round trip each)
                    for island in ranks:
                        island[0].ask({"op": "reserve"})
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.in_flight) as pool:
                moved = sum(pool.map(lambda p: run(p, k), range(len(numels))))
            seconds = time.perf_counter() - t0
            after = [c.ask({"op": "cpu"}) for c in [syncer, *every]]
            for name, v in after[0]["threads"].items():
                threads[name] = threads.get(name, 0.0) + v - before[0]["threads"].get(name, 0.0)
            cpu = [a["cpu_s"] - b["cpu_s"] for a, b in zip(after, before, strict=True)]
            return seconds, moved, sum(cpu[1:]), cpu[0]

        upload_s: list[float] = []
        accepted: list[bool] = []
        threads: dict[str, float] = {}
        cold = [phase(push, 0), phase(lambda p, k: pull(p), 0)]  # warm-up: connections made, windows grown
        upload_s.clear()
        beater.ask({"op": "beats", "on": True})
        recorders = [] if perf is None else [  # where the CPU goes in the timed rounds: perf (C: gRPC, TLS, copies)
            subprocess.Popen(["perf", "record", "-q", "-g", "-F", "499", "-p", str(c.proc.pid), "-o",
                              str(perf / f"{name}.data")]) for name, c in (("syncer", syncer), ("rank0", beater))]
        recorders += [] if perf is None else [  # and py-spy (Python's lines, native frames under them)
            subprocess.Popen(["py-spy", "record", "--native", "-r", "200", "-f", "raw", "-p", str(c.proc.pid), "-o",
                              str(perf / f"{name}.pyspy.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, c in (("syncer", syncer), ("rank0", beater))]
        pushes = [phase(push, k) for k in range(1, args.repeats + 1)]
        pulls = [phase(lambda p, k: pull(p), k) for k in range(1, args.repeats + 1)]
        busy = beater.ask({"op": "beats", "on": False})["beats"]
        for rec in recorders:
            rec.send_signal(signal.SIGINT)
            rec.wait(timeout=60)
        stats = wan.delay_stats() if wan is not None else []
        qdisc = wan.qdisc_stats() if wan is not None else []
        for c in [*every, syncer]:
            c.close()
    rate = args.rate_mbps * 1e6 / 8  # bytes per second
    push_b, push_s = sum(x[1] for x in pushes), sum(x[0] for x in pushes)
    pull_b, pull_s = sum(x[1] for x in pulls), sum(x[0] for x in pulls)
    # (one fragment at a time: its uploads timed apart from its commit, the link's share without the round trips)
    apart = args.in_flight == 1 and args.commit == "push"  # (riding: the uploads' time holds the commit)
    upload_share = push_b / sum(upload_s) / rate if apart and not args.loopback else None
    row = {"label": args.label or ("TLS" if not args.plaintext else "plaintext"),
           "what": f"{args.islands} island{'s' if args.islands > 1 else ''} x {args.ranks} ranks",
           "link": "loopback" if args.loopback else f"{args.rate_mbps:g} Mbit/s, {2 * args.delay_ms:g} ms RTT",
           "model": args.model, "codec": args.codec, "fragments": len(numels), "islands": args.islands,
           "ranks": args.ranks,
           "tls": not args.plaintext, "window_mib": window_mib, "mtu": None if args.loopback else args.mtu[0],
           "slow_start_after_idle": None if args.loopback else args.slow_start_after_idle,
           "rate_mbps": None if args.loopback else args.rate_mbps,
           "rtt_ms": None if args.loopback else 2 * args.delay_ms,
           "fragment_mb": statistics.mean(numels) * 4 / 1e6,
           "push_mbps": 8 * push_b / push_s / 1e6, "pull_mbps": 8 * pull_b / pull_s / 1e6,
           "push_share": None if args.loopback else push_b / push_s / rate, "upload_share": upload_share,
           # the warm-up round: fresh connections, TCP and HTTP/2 windows grown from their start
           "cold_push_share": None if args.loopback else cold[0][1] / cold[0][0] / rate,
           "cold_pull_share": None if args.loopback else cold[1][1] / cold[1][0] / rate,
           "pull_share": None if args.loopback else pull_b / pull_s / rate,
           "in_flight": args.in_flight, "push_round_s": [x[0] for x in pushes], "pull_round_s": [x[0] for x in pulls],
           "upload_s": upload_s, "commit": args.commit,
           "commit_s": _commit_s(pushes, upload_s, len(numels), args.in_flight) if apart else None,
           "accepted": sum(accepted), "refused_replays": len(accepted) - sum(accepted),
           "island_push_cpu_s_per_gb": 1e9 * sum(x[2] for x in pushes) / push_b,
           "island_pull_cpu_s_per_gb": 1e9 * sum(x[2] for x in pulls) / pull_b,
           "syncer_push_cpu_s_per_gb": 1e9 * sum(x[3] for x in pushes) / push_b,
           "syncer_pull_cpu_s_per_gb": 1e9 * sum(x[3] for x in pulls) / pull_b,
           "syncer_threads_cpu_s": dict(sorted(threads.items(), key=lambda kv: -kv[1])),
           "heartbeat_idle_ms": 1e3 * statistics.median(idle), "heartbeat_busy_ms": 1e3 * statistics.median(busy),
           "heartbeat_busy_max_ms": 1e3 * max(busy), "heartbeats": len(busy),
           "delay_dropped": sum(s["dropped"] for s in stats),
           "tbf_dropped": sum(q.get("up_dropped", 0) + q.get("down_dropped", 0) for q in qdisc), **_machine(load)}
    share = "" if args.loopback else f" ({100 * row['push_share']:.0f}% / {100 * row['pull_share']:.0f}% of the link)"
    print(f"[service_link] {row['label']}, {row['what']}, {row['link']}: push {row['push_mbps']:.0f} Mbit/s, pull "
          f"{row['pull_mbps']:.0f} Mbit/s{share}; heartbeat {row['heartbeat_idle_ms']:.0f} ms idle, "
          f"{row['heartbeat_busy_max_ms']:.0f} ms worst busy; CPU s/GB push/pull: islands "
          f"{row['island_push_cpu_s_per_gb']:.1f}/{row['island_pull_cpu_s_per_gb']:.1f}, syncer "
          f"{row['syncer_push_cpu_s_per_gb']:.1f}/{row['syncer_pull_cpu_s_per_gb']:.1f}; load "
          f"{row['loadavg_1m_before']:.1f}", flush=True)
    return [row]


def _beat_window(rank0: Child, seconds: float) -> list[float]:
    rank0.ask({"op": "beats", "on": True})
    time.sleep(seconds)
    return rank0.ask({"op": "beats", "on": False})["beats"]


COLUMNS = [("run", "label"), ("what", "what"), ("link", "link"), ("push codec", "codec"), ("MTU", "mtu"),
           ("slow start after idle", "slow_start_after_idle"), ("window MiB", "window_mib"),
           ("in flight", "in_flight"), ("commit", "commit"),
           ("TCP Mbit/s", "mbps"), ("TCP share", "share"), ("push Mbit/s", "push_mbps"), ("push share", "push_share"),
           ("upload share", "upload_share"), ("commit s", "commit_s"), ("pull Mbit/s", "pull_mbps"),
           ("pull share", "pull_share"),
           ("cold push share", "cold_push_share"), ("cold pull share", "cold_pull_share"),
           ("island CPU s/GB push", "island_push_cpu_s_per_gb"), ("island CPU s/GB pull", "island_pull_cpu_s_per_gb"),
           ("syncer CPU s/GB push", "syncer_push_cpu_s_per_gb"), ("syncer CPU s/GB pull", "syncer_pull_cpu_s_per_gb"),
           ("heartbeat ms idle", "heartbeat_idle_ms"), ("heartbeat ms worst, busy", "heartbeat_busy_max_ms"),
           ("load 1m", "loadavg_1m_before"), ("UTC", "utc")]


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/service_link.py [flags]``; the exit status (2: bad flags)."""
    args = parse_args(argv)
    if args.role is not None:
        spec = json.loads(args.spec.read_text())
        {"syncer": lambda: _syncer(spec), "rank": lambda: _rank(spec, args.island, args.rank),
         "sink": lambda: _sink(spec), "source": lambda: _source(spec)}[args.role]()
        return 0
    if args.repeats < 1 or args.ranks < 1:
        return script_error("service_link", ValueError("repeats and ranks: must be >= 1"))
    out = args.out or default_out("service_link")
    tmp = Path(tempfile.mkdtemp(prefix="atoll-service-link-"))
    rows = instrument(args, tmp) if args.instrument else study(args, tmp)
    old = []
    if args.append and (out / "results.json").is_file():
        old = json.loads((out / "results.json").read_text()).get("rows", [])
    rows = [*old, *rows]
    print(write_results(out, {"rows": rows}, COLUMNS, rows, title=TITLE, notes=NOTES))
    return 0


TITLE = "One island's push and pull over a shaped, delayed link (`bench/service_link.py`)"
NOTES = [
    "Commands (as root), each appending its row: `--instrument --mtu 1500 9000 65000 --seconds 8`; then `--label "
    "LABEL --repeats 2` with: (default) nothing; `--window-mib 0`; `--in-flight 2`; `--plaintext`; "
    "`--tcp-buffer-mib 0`; `--loopback`; `--loopback --plaintext`; `--loopback --islands 4 --ranks 1`; "
    "`--mtu 65000`; `--mtu 65000 --in-flight 2`; `--model 20m`; `--model 20m --window-mib 0`. Model 125m "
    "(vocab 512): 4 fragments of 113.7 MB float32, fp32 pushes; TLS unless plaintext; hosts' TCP buffers 64 MiB "
    "(`--tcp-buffer-mib`), BBR.",
    "Shares: payload bits per second over the link rate (TCP/IP/TLS/HTTP2 headers not counted). Push: every "
    "rank uploads its slice at once; commit 'riding' (atoll's since 365e389, the default): rank 0's upload carries "
    "the commit, answered in its reply once every slice is up; 'push' (rows before it): then rank 0 commits "
    "(one more round trip); either way the syncer decodes, "
    "reassembles and checks the fragment before it answers; upload share: the uploads alone; pull: every rank "
    "downloads its slice at once. In flight: fragments moved at once. Cold: the first round, on fresh connections.",
    "CPU s/GB: CPU seconds per 10^9 payload bytes of the islands' processes together and of the syncer's, in the "
    "push rounds and in the pull rounds (1 / it is the GB/s one core carries). Loopback: no link, no delay line.",
    "Commit s: a push's commit per fragment, one at a time (the round's seconds less its uploads', per fragment). "
    "Rows 'before / decode into place' are an A/B, interleaved in one session (before: the code at 498e201, run "
    "with `PYTHONPATH` of a worktree at that commit; the same flags): the syncer decodes each slice of a push into "
    "its place in the fragment instead of decoding, then copying; on loopback a commit takes 0.07 s instead of "
    "0.10-0.16. Timed inside the syncer over the link (MTU 9000), the Push handler takes 0.06-0.09 s of a commit's "
    "0.21-0.25: the rest is the round trip (73 ms idle) and the emulated link's queue behind the uploads (the "
    "heartbeat's worst during transfers).",
    "Rows 'commit after the uploads / commit riding' are an A/B of 365e389/7513ab0, interleaved in one session "
    "(`--commit push` against the default), 14:08-14:22 UTC: one fragment at a time the push reaches 0.695-0.722 "
    "with the commit after the uploads (0.547 in the first row, beside five benchmark processes; the rest with "
    "them stopped) and 0.716-0.758 riding, about the round trip it saves; with two fragments in flight and the "
    "commit riding 0.803 (MTU 9000) and 0.832 (MTU 65000), against 0.747-0.787 before. During the ingress of 4 "
    "islands at once (loopback) a heartbeat's worst round trip is 119-129 ms with the commit after the uploads "
    "and 145-167 ms riding (typical 9 ms both): the 4 commits then start together in the upload threads.",
    "Rows 'before (20300a8) / GIL-free payloads, no copy under the lock' are an A/B of 28b2631 and b10b1eb, "
    "interleaved in one session, 17:01-17:08 UTC (before: a worktree at 20300a8): payloads and pulls written by "
    "torch's copies, which release the GIL (safetensors' writer held it 167-202 ms per 124 MB), and the syncer "
    "buffering a push without copying it, its norm taken outside the lock. During the ingress of 4 islands at "
    "once (loopback, TLS) a heartbeat's worst round trip is 72-97 ms after against 123-160 ms before (typical "
    "9-10 ms both), the push 3.63-3.83 Gbit/s against 2.62-3.48; one fragment at a time over the link the push "
    "reaches 0.743-0.751 against 0.716-0.744. Rows 'kernel's slow start after idle / no slow start after idle' "
    "(`--slow-start-after-idle 1|0`, 17:09-17:12): 0.731-0.754 against 0.751-0.754, no difference with BBR. One "
    "fragment at a time a push's uploads take 1.09-1.14 s of the 0.91 s its bytes need at the link rate (the "
    "first of each round 1.27-1.66 s), and 0.07 s more pass between fragments (the bench's serialization and its "
    "orchestration).",
    "Rows 'before (0f32f33) / payload read from its tensors, slices written in place' are an A/B interleaved in one "
    "session, 19:52-20:01 UTC (before: a worktree at 0f32f33 running this script): an island's payload is read "
    "from its tensors as it is sent (`wire.Payload`: its first byte leaves at once, no whole copy first), and the "
    "syncer writes each chunk of an element-wise codec's slice into its place in the push's fragment as it "
    "arrives (`placement`: at the commit that fragment is the Δ, no decode, no copy). One fragment at a time over "
    "the link the push reaches 0.766-0.863 (mean 0.813) against 0.730-0.790 (mean 0.766); traced (a copy of the "
    "code with timestamps), a fragment's upload reaches the syncer 0.04 s after the push starts, its bytes take "
    "0.90-0.96 s, the commit 0.03-0.05 s after the last byte, the answer 0.036 s later. During the ingress of 4 "
    "islands at once (loopback, TLS) the push 4.57-5.16 Gbit/s against 2.89-3.17, the syncer 1.9-2.0 CPU s/GB "
    "against 3.0-3.2, a heartbeat's worst 46-57 ms against 96-109 ms. After them (20:09-20:10), the new code "
    "alone: two fragments in flight 0.838 (0.803 at 14:14), one at a time at MTU 65000 0.847 (0.748-0.753). "
    "The tree after a review's fixes (0aa4f24, 20:25): 0.869. Since these rows the leases a round's "
    "commits claim are taken before its clock starts, as the text above says and an island does; before, each "
    "push took its lease on the round's clock, one control round trip (0.07 s over the link) per fragment, "
    "which every earlier row's push share includes (the 'before' rows here run the new script).",
    "Rows 'TLS, int4 pushes / TLS, fp32 pushes' (`--codec int4|fp32`, interleaved 22:51-22:55 UTC on 2026-12-06, "
    "the code of 916f2a2; every row before them pushes fp32): an int4 push of a 125m fragment is 16.0 MB (0.5625 "
    "bytes per parameter) and reaches 0.41-0.44 of the link, against 0.80-0.86 for fp32 in the same minutes. Its "
    "uploads alone reach 0.63 (`--commit push`, 0.33 with the commit's extra round trip), and its commit takes "
    "0.18 s after the last byte (fp32: 0.03-0.05): a block codec's slices are decoded at the commit (an "
    "element-wise codec's are placed as they arrive), about 5 ns per parameter here, and the syncer spends 11-13 "
    "CPU s per GB of int4 payload against 5.6 for fp32. Per fragment, 0.13 s of bytes carry about 0.25 s of "
    "round trip and commit that do not shrink with the payload.",
    "Heartbeat: rank 0's round trip on its control connection every 20 ms, idle (the link's RTT) and worst during "
    "the timed rounds. A shared 2-core machine: the 1-minute load average and the time are beside each row; over "
    "the link the delay line (Python) takes 0.47 core at MTU 9000, 0.10 at 65000 (the plain TCP rows).",
]


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

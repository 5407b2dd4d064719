"""An emulated WAN on one machine: one network namespace per island, rate-limited links, optional delay.

    with EmulatedWan(islands=2, rate_mbps=10, delay_ms=0) as wan:
        proc = wan.popen(0, [sys.executable, "-m", "atoll.cli", "train", ...], env=env)
        print(wan.counters())  # bytes each island's interface sent and received so far

Needs root (``ip netns``, veth, bridge, ``tc``); :func:`unavailable_reason` says in one line why it cannot
run here (not root, no iproute2, namespaces refused), and :class:`EmulatedWan` then raises
:class:`WanUnavailable` with that line. Nothing leaves the machine: every address lives inside the
namespaces this module creates.

Topology (K islands)::

    namespace <prefix>-i0          namespace <prefix>-br           namespace <prefix>-i1
    wan0 10.77.0.1/24 ---veth---  i0 --+                     +-- i1  ---veth--- wan0 10.77.0.2/24
      tbf (upload of island 0)    tbf   \\------ br0 -------/   tbf                tbf (upload of island 1)
                                  (download of island 0)       (download of island 1)

Each island's link is limited in both directions with ``tc qdisc ... tbf rate R burst B latency L`` on
the egress of both ends of its veth: the island's end shapes its upload, the bridge's end its download.
Segmentation offloads are off on every veth (``gso_max_segs 1``), so the interfaces carry and count
MTU-sized packets with their own headers, as a real link does (a 1500-byte MTU costs about 5% of TCP/IP/
Ethernet headers on bulk data, plus the ACKs of the traffic received).

Delay (the kernel here has no ``netem``): with ``delay_ms > 0`` each island's traffic to the other islands
is routed into a TUN device ``lat0`` (``/dev/net/tun``, ``TUNSETIFF``). A forwarder in this process reads
every packet from it, holds it ``delay_ms`` (one-way), and sends it out of the island's ``wan0`` through a
packet socket addressed to the destination island's MAC, so it then passes the island's upload ``tbf``. The
replies take the same path in the other island, so a round trip costs ``2 x delay_ms``. The forwarder is
Python (two threads per island), about 10-20 us of CPU per packet: some percent of a core at 100 Mbit/s.
It lives in :mod:`atoll.benchmarks.delay`; the interface counters over time in :mod:`atoll.benchmarks.counters`;
running ``ip``/``tc`` and entering a namespace in :mod:`atoll.benchmarks.namespaces`.

Clean-up: :meth:`EmulatedWan.close` (run by the ``with`` block, also on Ctrl-C, on an exception, and on
SIGTERM, which the context manager turns into ``SystemExit`` in the main thread) stops the forwarder,
ends the processes started with :meth:`EmulatedWan.popen` and any other process left in its namespaces,
and deletes the namespaces (which deletes their veths, bridge and TUN devices). Namespaces left by a
harness whose process died (``kill -9``) are deleted by the next harness, once they hold no process.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from atoll.benchmarks.counters import CounterSampler
from atoll.benchmarks.delay import TUN_IFNAME, DelayLine, open_tun
from atoll.benchmarks.namespaces import (
    IFNAME,
    NETNS_DIR,
    PREFIX,
    WanError,
    WanUnavailable,
    in_netns,
    namespace_exists,
    netns_pids,
    read_netdev,
    remove_stale_namespaces,
    run_command,
    unavailable_reason,
)

__all__ = ["IFNAME", "NETNS_DIR", "PREFIX", "SUBNET", "CounterSampler", "EmulatedWan", "LinkShape", "WanError",
           "WanUnavailable", "namespace_exists", "remove_stale_namespaces", "unavailable_reason"]

SUBNET = "10.77.0"  # island i is 10.77.0.(i+1)/24; private, and only inside this module's namespaces
MAX_ISLANDS = 250


# ----------------------------------------------------------------------------------------------------------
# the harness


@dataclass(frozen=True)
class LinkShape:
    """How each island's link is shaped.

    Attributes:
        rate_mbps: bandwidth of each direction in Mbit/s (10^6 bits per second).
        delay_ms: one-way delay added by the TUN forwarder (0: none; the forwarder is then not used).
        tbf_latency_ms: the longest a packet may wait in a ``tbf`` queue before it is dropped.
        burst_bytes: ``tbf`` bucket size; default: 4 ms at the rate, at least 32 KiB.
        mtu: MTU of every link.
    """

    rate_mbps: float
    delay_ms: float = 0.0
    tbf_latency_ms: float = 200.0
    burst_bytes: int | None = None
    mtu: int = 1500

    def burst(self) -> int:
        return self.burst_bytes or max(32768, int(self.rate_mbps * 1e6 / 8 * 0.004))

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{int(self.rate_mbps * 1e6)}bit", "burst", str(self.burst()),
                "latency", f"{self.tbf_latency_ms:g}ms"]



class EmulatedWan:
    """One namespace per island, each joined to a bridge by a shaped veth pair (see the module docstring).

    Args:
        islands: K, islands (namespaces); at most 250.
        shape: the shape of every island's link (or pass ``rate_mbps`` and the rest as keywords).
        shapes: one shape per island instead (e.g. a faster link for a syncer's site); with delays, each
            island's forwarder holds its outgoing packets its own ``delay_ms``.

    Use as a context manager; :meth:`close` always removes everything it made.

    Raises (on entering):
        WanUnavailable: not root, no iproute2, namespaces or tc refused, or no ``/dev/net/tun`` for a delay.
        WanError: building the network failed (it is removed again).
    """

    def __init__(self, islands: int, shape: LinkShape | None = None, shapes: Sequence[LinkShape] | None = None,
                 **shape_kwargs: Any) -> None:
        if not 1 <= islands <= MAX_ISLANDS:
            raise ValueError(f"islands: between 1 and {MAX_ISLANDS}, got {islands}")
        self.shape = shape or (shapes[0] if shapes else LinkShape(**shape_kwargs))
        self.shapes = list(shapes) if shapes is not None else [self.shape] * islands
        if len(self.shapes) != islands:
            raise ValueError(f"shapes: one per island ({islands}), got {len(self.shapes)}")
        for s in self.shapes:
            if s.rate_mbps <= 0 or s.delay_ms < 0 or s.tbf_latency_ms <= 0:
                raise ValueError(f"link shape: rate > 0, delay >= 0, tbf latency > 0; got {s}")
        self.islands = islands
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.island_ns = [f"{self.prefix}-i{i}" for i in range(islands)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._delay: list[DelayLine] = []
        self._samplers: list[CounterSampler] = []
        self._old_sigterm: Any = None
        self._closed = False

    # --- addresses ---------------------------------------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """Every namespace this harness creates (islands, then the bridge's)."""
        return [*self.island_ns, self.bridge_ns]

    @staticmethod
    def island_ip(island: int) -> str:
        """The address of island ``island`` on its ``wan0``."""
        return f"{SUBNET}.{island + 1}"

    @staticmethod
    def island_mac(island: int) -> str:
        return f"02:77:00:00:{island >> 8:02x}:{island & 0xFF:02x}"

    # --- building ------------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedWan:
        reason = unavailable_reason()
        if reason is not None:
            raise WanUnavailable(reason)
        if any(s.delay_ms > 0 for s in self.shapes) and not os.path.exists("/dev/net/tun"):
            raise WanUnavailable("a delay needs a TUN device and /dev/net/tun is missing; use --delay-ms 0")
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            removed, ended = remove_stale_namespaces()
            if removed:
                print(f"[wan] removed {len(removed)} network namespaces and ended {ended} processes left by a "
                      "killed earlier run", file=sys.stderr, flush=True)
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        run_command("ip", "netns", "add", name)
        self._created.append(name)

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_netns(br)
        run_command("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        run_command("ip", "-n", br, "link", "set", "br0", "up")
        for i, (ns, shape) in enumerate(zip(self.island_ns, self.shapes, strict=True)):
            self._add_netns(ns)
            peer = f"i{i}"
            run_command("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", peer, "netns", br)
            run_command("ip", "-n", ns, "link", "set", "lo", "up")
            # no segmentation offload: the link carries and counts MTU-sized packets, as a real one does
            run_command("ip", "-n", ns, "link", "set", IFNAME, "address", self.island_mac(i), "mtu",
                        str(shape.mtu), "gso_max_segs", "1")
            run_command("ip", "-n", br, "link", "set", peer, "mtu", str(shape.mtu), "gso_max_segs", "1",
                        "master", "br0")
            addr = ["ip", "-n", ns, "addr", "add", f"{self.island_ip(i)}/24", "dev", IFNAME]
            run_command(*addr, *(["noprefixroute"] if shape.delay_ms > 0 else []))
            run_command("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *shape.tbf_args())  # upload
            run_command("tc", "-n", br, "qdisc", "add", "dev", peer, "root", *shape.tbf_args())  # download
            run_command("ip", "-n", ns, "link", "set", IFNAME, "up")
            run_command("ip", "-n", br, "link", "set", peer, "up")
        if any(s.delay_ms > 0 for s in self.shapes):
            self._build_delay()

    def _build_delay(self) -> None:
        macs = {socket.inet_aton(self.island_ip(i)): bytes.fromhex(self.island_mac(i).replace(":", ""))
                for i in range(self.islands)}

        for i, (ns, shape) in enumerate(zip(self.island_ns, self.shapes, strict=True)):
            if shape.delay_ms <= 0:
                continue
            tun, sock = in_netns(ns, open_tun)
            line = DelayLine(i, tun, sock, shape.delay_ms / 1000.0, macs)
            self._delay.append(line)
            run_command("ip", "-n", ns, "link", "set", TUN_IFNAME, "mtu", str(shape.mtu), "up")
            run_command("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "dev", TUN_IFNAME, "src", self.island_ip(i))
            line.start()

    # --- using ---------------------------------------------------------------------------------------
    def popen(self, island: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside island ``island``'s namespace (``ip netns exec``), in a session of its own.

        Keyword arguments go to :class:`subprocess.Popen`. :meth:`close` ends it if it still runs.
        """
        proc = subprocess.Popen(["ip", "netns", "exec", self.island_ns[island], *argv], start_new_session=True,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def counters(self) -> list[dict[str, int]]:
        """Each island's ``wan0`` counters now: ``rx_bytes``, ``rx_packets``, ``tx_bytes``, ``tx_packets``."""
        return [in_netns(ns, lambda: read_netdev()[IFNAME]) for ns in self.island_ns]

    def qdisc_stats(self) -> list[dict[str, int]]:
        """Bytes, packets and drops of each island's upload and download ``tbf``."""
        out = []
        for i, ns in enumerate(self.island_ns):
            row = {}
            for side, where, dev in (("up", ns, IFNAME), ("down", self.bridge_ns, f"i{i}")):
                text = run_command("tc", "-n", where, "-s", "qdisc", "show", "dev", dev)
                m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
                if m:
                    row.update({f"{side}_bytes": int(m[1]), f"{side}_packets": int(m[2]),
                                f"{side}_dropped": int(m[3])})
            out.append(row)
        return out

    def delay_stats(self) -> list[dict[str, int]]:
        """Per island with a delay: packets its forwarder sent, dropped (tbf queue full) and could not route."""
        return [{"island": d.island, "forwarded": d.forwarded, "dropped": d.dropped, "unroutable": d.unroutable}
                for d in self._delay]

    def sampler(self, interval_s: float = 0.05) -> CounterSampler:
        """Start sampling every island's counters; stop it with ``.stop()`` (:meth:`close` also does)."""
        s = CounterSampler(self.island_ns, interval_s)
        self._samplers.append(s)
        return s.start()

    # --- removing ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the forwarder and samplers, end every process in the namespaces, delete the namespaces.

        Idempotent; every step runs even when an earlier one fails (failures are reported on stderr).
        """
        if self._closed:
            return
        self._closed = True
        problems: list[str] = []
        for s in self._samplers:
            s.stop()
        for d in self._delay:
            d.stop()
        _end_processes(self._procs)
        for ns in self._created:
            pids = netns_pids(ns)  # anything else left in our namespaces (started through them)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns in reversed(self._created):
            for attempt in range(20):
                try:
                    run_command("ip", "netns", "del", ns)
                    break
                except WanError as e:
                    if not (NETNS_DIR / ns).exists():
                        break
                    if attempt == 19:
                        problems.append(str(e))
                    time.sleep(0.1)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        for p in problems:
            print(f"atoll: warning: emulated WAN clean-up: {p}", file=sys.stderr)


def _end_processes(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM to the process group of each that still runs, then SIGKILL after ``grace_s``."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def _sigterm_to_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)

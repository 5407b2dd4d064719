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

Clean-up: :meth:`EmulatedWan.close` (run by the ``with`` block, also on Ctrl-C, on an exception, and on
SIGTERM, which the context manager turns into ``SystemExit`` in the main thread) stops the forwarder,
ends the processes started with :meth:`EmulatedWan.popen` and any other process left in its namespaces,
and deletes the namespaces (which deletes their veths, bridge and TUN devices). Namespaces left by a
harness whose process died (``kill -9``) are deleted by the next harness, once they hold no process.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import ctypes
import fcntl
import functools
import os
import re
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

NETNS_DIR = Path("/var/run/netns")
PREFIX = "atoll-wan"
IFNAME = "wan0"  # each island's link, the same name in every island's namespace (for GLOO_SOCKET_IFNAME)
TUN_IFNAME = "lat0"  # the delay forwarder's TUN device in each island's namespace
SUBNET = "10.77.0"  # island i is 10.77.0.(i+1)/24; private, and only inside this module's namespaces
MAX_ISLANDS = 250

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_ETH_P_IP = 0x0800
_STALE = re.compile(rf"^{PREFIX}-(?:probe-)?(\d+)-[0-9a-f]+(?:-|$)")

T = TypeVar("T")


class WanUnavailable(Exception):
    """The emulated WAN cannot be built on this machine; the message is one line saying why."""


class WanError(RuntimeError):
    """A command that builds or removes the emulated WAN failed; the message names it and its error."""


def _run(*cmd: str, check: bool = True) -> str:
    """Run an iproute2 command; return its stdout. Raises :class:`WanError` when it fails (``check``)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WanError(f"'{' '.join(cmd)}' failed: {e}") from None
    if check and r.returncode != 0:
        raise WanError(f"'{' '.join(cmd)}' failed: {(r.stderr or r.stdout).strip() or r.returncode}")
    return r.stdout


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why an emulated WAN cannot be built here (one line), or None when it can.

    Checks root, the ``ip`` and ``tc`` commands, and then really builds a scratch namespace with a veth
    pair, a bridge and a ``tbf`` qdisc (and removes it), since containers often refuse one of them.
    """
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc); run it as root, e.g. with sudo"
    missing = [c for c in ("ip", "tc") if shutil.which(c) is None]
    if missing:
        return f"needs iproute2 ('{' and '.join(missing)}' not found); install iproute2"
    name = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    try:
        _run("ip", "netns", "add", name)
    except WanError as e:
        return f"'ip netns' is unavailable here ({e})"
    try:
        _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _run("ip", "-n", name, "link", "add", "br0", "type", "bridge")
        _run("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit", "burst", "32768",
             "latency", "100ms")
    except WanError as e:
        return f"namespaces work but veth, bridge or tc tbf do not ({e})"
    finally:
        _run("ip", "netns", "del", name, check=False)
    return None


# ----------------------------------------------------------------------------------------------------------
# entering a namespace from one thread (network namespaces are per thread)


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc().setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _open_netns(name: str) -> int:
    return os.open(NETNS_DIR / name, os.O_RDONLY)


def in_netns(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` called on a short-lived thread that joined network namespace ``name``; its result.

    Sockets and TUN devices it creates belong to that namespace (and stay usable from any thread).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = _open_netns(name)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name=f"atoll-netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _read_netdev() -> dict[str, dict[str, int]]:
    """``/proc/net/dev`` of the calling thread's namespace: per interface rx/tx bytes and packets."""
    out: dict[str, dict[str, int]] = {}
    with open("/proc/thread-self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, _, rest = line.partition(":")
            v = [int(x) for x in rest.split()]
            out[name.strip()] = {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9]}
    return out


# ----------------------------------------------------------------------------------------------------------
# the delay forwarder


class _DelayLine:
    """One island's one-way delay: packets read from its TUN device leave through its veth ``delay_s`` later.

    A reader thread takes packets from the TUN device as the kernel routes them there; a sender thread
    sends each at its due time through a packet socket on ``wan0`` (so it passes the island's ``tbf``),
    addressed to the MAC of the island that owns the destination address. A packet the ``tbf`` queue
    refuses is dropped, as on a real link, and counted.
    """

    def __init__(self, island: int, tun: int, sock: socket.socket, delay_s: float,
                 macs: dict[bytes, bytes]) -> None:
        self.island, self.tun, self.sock, self.delay_s, self.macs = island, tun, sock, delay_s, macs
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.stopped = threading.Event()
        self.forwarded = self.dropped = self.unroutable = 0
        self.threads = [threading.Thread(target=self._read, name=f"atoll-delay-read{island}", daemon=True),
                        threading.Thread(target=self._send, name=f"atoll-delay-send{island}", daemon=True)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        while not self.stopped.is_set():
            try:
                readable, _, _ = select.select([self.tun], [], [], 0.2)
            except (OSError, ValueError):
                return
            while readable:
                try:
                    packet = os.read(self.tun, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    return
                with self.ready:
                    self.queue.append((time.monotonic() + self.delay_s, packet))
                    self.ready.notify()

    def _send(self) -> None:
        while True:
            with self.ready:
                while not self.queue and not self.stopped.is_set():
                    self.ready.wait(0.2)
                if self.stopped.is_set():
                    return
                due, packet = self.queue[0]
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            with self.ready:
                self.queue.popleft()
            mac = self.macs.get(packet[16:20]) if len(packet) >= 20 and packet[0] >> 4 == 4 else None
            if mac is None:
                self.unroutable += 1
                continue
            try:
                self.sock.sendto(packet, (IFNAME, _ETH_P_IP, 0, 1, mac))
                self.forwarded += 1
            except OSError:
                self.dropped += 1

    def stop(self) -> None:
        self.stopped.set()
        with self.ready:
            self.ready.notify_all()
        for t in self.threads:
            t.join(timeout=5)
        with contextlib.suppress(OSError):
            os.close(self.tun)
        self.sock.close()


# ----------------------------------------------------------------------------------------------------------
# interface counters over time


class CounterSampler:
    """Samples every island's ``wan0`` counters every ``interval_s`` seconds on a thread of its own.

    ``samples`` holds ``(time.time(), [tx_bytes per island], [rx_bytes per island])``; :meth:`at` reads a
    counter at any moment by linear interpolation (the clock is the one ``metrics.jsonl`` uses).
    """

    def __init__(self, namespaces: Sequence[str], interval_s: float = 0.05) -> None:
        self.namespaces, self.interval_s = list(namespaces), interval_s
        self.samples: list[tuple[float, list[int], list[int]]] = []
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="atoll-wan-sampler", daemon=True)

    def start(self) -> CounterSampler:
        self.thread.start()
        while not self.samples and self.thread.is_alive():
            time.sleep(0.01)
        if self.error is not None:
            raise WanError(f"reading interface counters failed: {self.error}")
        return self

    def _run(self) -> None:
        fds = [_open_netns(n) for n in self.namespaces]
        try:
            while True:
                tx, rx = [], []
                for fd in fds:
                    _setns(fd)  # this thread only
                    dev = _read_netdev()[IFNAME]
                    tx.append(dev["tx_bytes"])
                    rx.append(dev["rx_bytes"])
                self.samples.append((time.time(), tx, rx))
                if self.stopped.wait(self.interval_s):
                    return
        except BaseException as e:
            self.error = e
        finally:
            for fd in fds:
                os.close(fd)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def at(self, t: float, island: int, key: str = "tx", after: bool = False) -> float:
        """The ``tx`` (or ``rx``) byte counter of ``island`` at time ``t``.

        Interpolated linearly between the samples around ``t``; with ``after``, the first sample taken at
        or after ``t`` (right for a moment the link falls idle: everything sent before it is counted).
        """
        if not self.samples:
            raise WanError("no interface counter samples were taken")
        idx = 1 if key == "tx" else 2
        times = [s[0] for s in self.samples]
        j = bisect.bisect_left(times, t)
        if j >= len(times):
            return float(self.samples[-1][idx][island])
        if j == 0 or after:
            return float(self.samples[j][idx][island])
        (t0, *a), (t1, *b) = self.samples[j - 1], self.samples[j]
        v0, v1 = a[idx - 1][island], b[idx - 1][island]
        return v0 + (v1 - v0) * (t - t0) / max(1e-9, t1 - t0)


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(name: str) -> list[int]:
    return [int(p) for p in _run("ip", "netns", "pids", name, check=False).split()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces of this module whose creating process is gone and that hold no process; their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.listdir(NETNS_DIR)):
            m = _STALE.match(entry)
            if m and not _alive(int(m.group(1))) and not _netns_pids(entry):
                _run("ip", "netns", "del", entry, check=False)
                removed.append(entry)
    return removed


class EmulatedWan:
    """One namespace per island, each joined to a bridge by a shaped veth pair (see the module docstring).

    Args:
        islands: K, islands (namespaces); at most 250.
        shape: the shape of every island's link (or pass ``rate_mbps`` and the rest as keywords).

    Use as a context manager; :meth:`close` always removes everything it made.

    Raises (on entering):
        WanUnavailable: not root, no iproute2, namespaces or tc refused, or no ``/dev/net/tun`` for a delay.
        WanError: building the network failed (it is removed again).
    """

    def __init__(self, islands: int, shape: LinkShape | None = None, **shape_kwargs: Any) -> None:
        if not 1 <= islands <= MAX_ISLANDS:
            raise ValueError(f"islands: between 1 and {MAX_ISLANDS}, got {islands}")
        self.shape = shape or LinkShape(**shape_kwargs)
        if self.shape.rate_mbps <= 0 or self.shape.delay_ms < 0 or self.shape.tbf_latency_ms <= 0:
            raise ValueError(f"link shape: rate > 0, delay >= 0, tbf latency > 0; got {self.shape}")
        self.islands = islands
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.island_ns = [f"{self.prefix}-i{i}" for i in range(islands)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._delay: list[_DelayLine] = []
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
        if self.shape.delay_ms > 0 and not os.path.exists("/dev/net/tun"):
            raise WanUnavailable("a delay needs a TUN device and /dev/net/tun is missing; use --delay-ms 0")
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        try:
            remove_stale_namespaces()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)

    def _build(self) -> None:
        shape, br = self.shape, self.bridge_ns
        self._add_netns(br)
        _run("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(self.island_ns):
            self._add_netns(ns)
            peer = f"i{i}"
            _run("ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", peer, "netns", br)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # no segmentation offload: the link carries and counts MTU-sized packets, as a real one does
            _run("ip", "-n", ns, "link", "set", IFNAME, "address", self.island_mac(i), "mtu", str(shape.mtu),
                 "gso_max_segs", "1")
            _run("ip", "-n", br, "link", "set", peer, "mtu", str(shape.mtu), "gso_max_segs", "1", "master", "br0")
            addr = ["ip", "-n", ns, "addr", "add", f"{self.island_ip(i)}/24", "dev", IFNAME]
            _run(*addr, *(["noprefixroute"] if shape.delay_ms > 0 else []))
            _run("tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *shape.tbf_args())  # upload
            _run("tc", "-n", br, "qdisc", "add", "dev", peer, "root", *shape.tbf_args())  # download
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            _run("ip", "-n", br, "link", "set", peer, "up")
        if shape.delay_ms > 0:
            self._build_delay()

    def _build_delay(self) -> None:
        macs = {socket.inet_aton(self.island_ip(i)): bytes.fromhex(self.island_mac(i).replace(":", ""))
                for i in range(self.islands)}

        def make_tun() -> tuple[int, socket.socket]:
            tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(tun, _TUNSETIFF, struct.pack("16sH", TUN_IFNAME.encode(), _IFF_TUN | _IFF_NO_PI))
                sock = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, 0)  # protocol 0: sends only
            except BaseException:
                os.close(tun)
                raise
            # replies arrive on wan0 but the route back is lat0: loose reverse-path filtering
            for conf in ("all", "default", IFNAME):
                Path(f"/proc/sys/net/ipv4/conf/{conf}/rp_filter").write_text("0")
            return tun, sock

        for i, ns in enumerate(self.island_ns):
            tun, sock = in_netns(ns, make_tun)
            line = _DelayLine(i, tun, sock, self.shape.delay_ms / 1000.0, macs)
            self._delay.append(line)
            _run("ip", "-n", ns, "link", "set", TUN_IFNAME, "mtu", str(self.shape.mtu), "up")
            _run("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "dev", TUN_IFNAME, "src", self.island_ip(i))
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
        return [in_netns(ns, lambda: _read_netdev()[IFNAME]) for ns in self.island_ns]

    def qdisc_stats(self) -> list[dict[str, int]]:
        """Bytes, packets and drops of each island's upload and download ``tbf``."""
        out = []
        for i, ns in enumerate(self.island_ns):
            row = {}
            for side, where, dev in (("up", ns, IFNAME), ("down", self.bridge_ns, f"i{i}")):
                text = _run("tc", "-n", where, "-s", "qdisc", "show", "dev", dev)
                m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", text)
                if m:
                    row.update({f"{side}_bytes": int(m[1]), f"{side}_packets": int(m[2]),
                                f"{side}_dropped": int(m[3])})
            out.append(row)
        return out

    def delay_stats(self) -> list[dict[str, int]]:
        """Per island: packets the delay forwarder sent, dropped (tbf queue full) and could not route."""
        return [{"forwarded": d.forwarded, "dropped": d.dropped, "unroutable": d.unroutable} for d in self._delay]

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
            pids = _netns_pids(ns)  # anything else left in our namespaces (started through them)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for ns in reversed(self._created):
            for attempt in range(20):
                try:
                    _run("ip", "netns", "del", ns)
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


def namespace_exists(name: str) -> bool:
    """True when ``ip netns`` still lists ``name``."""
    return (NETNS_DIR / name).exists()

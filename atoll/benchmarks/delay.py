"""The delay forwarder of the emulated WAN: one island's one-way delay, through a TUN device.

Used by :class:`atoll.benchmarks.netns.EmulatedWan` when its links have a delay (``atoll bench wan --delay-ms D``;
the kernel here has no ``netem``). Each island's traffic to the other islands is routed into a TUN device
(``lat0``, opened with :func:`open_tun` inside the island's namespace); a :class:`DelayLine` reads every
packet from it, holds it ``D`` ms, and sends it out of the island's ``wan0`` through a packet socket
addressed to the destination island's MAC, so it then passes the island's upload ``tbf``. The replies take
the same path in the other island, so a round trip costs ``2 x D``. Python, two threads per island: about
10-20 us of CPU per packet.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import select
import socket
import struct
import threading
import time
from pathlib import Path

from atoll.benchmarks.namespaces import IFNAME

TUN_IFNAME = "lat0"  # the delay forwarder's TUN device in each island's namespace

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_ETH_P_IP = 0x0800


def open_tun() -> tuple[int, socket.socket]:
    """Create the TUN device ``lat0`` in the calling thread's namespace (run it through
    :func:`atoll.benchmarks.namespaces.in_netns`); its file descriptor and a packet socket that sends on ``wan0``."""
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


class DelayLine:
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

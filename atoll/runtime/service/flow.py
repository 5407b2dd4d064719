"""Flow control of the bulk connections, sized to the link's bandwidth-delay product.

A sender on a long fat link keeps at most one receive window of data in flight per round trip, so one HTTP/2
stream carries at most ``window / RTT`` bytes per second: 1 Gbit/s at 70 ms RTT needs 8.75 MB in flight
(:func:`bdp_bytes`). gRPC starts a stream at 64 KiB and grows it with its BDP probe; the bulk connections of
``atoll syncer`` and ``atoll island`` start every stream at ``bulk_window_mib`` instead (:func:`bulk_options`:
``grpc.http2.lookahead_bytes``, the stream's initial window, with the BDP probe left on to grow it further);
the control connection keeps gRPC's defaults (small calls). Measured over an emulated 1 Gbit/s, 70 ms link
(bench/out/service_link), the probe alone grew the windows as fast, for 18 MB and 114 MB fragments alike: the
setting is a floor, not where the link share comes from.

The kernel's socket buffers bound a TCP connection's data in flight as well (Linux autotunes them up to the
third value of ``net.ipv4.tcp_wmem`` / ``tcp_rmem``, 4 MiB / 6 MiB by default): a WAN host raises both to at
least the bandwidth-delay product (docs/deployment.md).

**Bound.** A receiver holds at most one window of unread bytes per stream: the syncer at most
``bulk_slots x bulk_window_mib`` MiB of uploads in gRPC's buffers at once (docs/security.md), an island's rank
one window per transfer it runs.
"""

from __future__ import annotations

#: HTTP/2's largest window (2^31 - 1 bytes)
MAX_WINDOW = (1 << 31) - 1
#: the smallest window this module sets: gRPC's default initial stream window (64 KiB)
MIN_WINDOW = 1 << 16


def bdp_bytes(rate_mbps: float, rtt_ms: float) -> int:
    """The bandwidth-delay product of a link: bytes in flight that fill ``rate_mbps`` (10^6 bit/s) over a round
    trip of ``rtt_ms`` milliseconds (1000 Mbit/s x 70 ms = 8,750,000 bytes).

    Raises:
        ValueError: a rate or round trip that is not positive.
    """
    if rate_mbps <= 0 or rtt_ms <= 0:
        raise ValueError(f"rate and round trip must be > 0, got {rate_mbps} Mbit/s and {rtt_ms} ms")
    return int(rate_mbps * 1e6 / 8 * rtt_ms / 1e3)


def window_bytes(window_mib: float) -> int:
    """``window_mib`` MiB as the bytes of an HTTP/2 window: at least :data:`MIN_WINDOW`, at most
    :data:`MAX_WINDOW`.

    Raises:
        ValueError: ``window_mib`` is not positive.
    """
    if window_mib <= 0:
        raise ValueError(f"window must be > 0 MiB, got {window_mib}")
    return max(MIN_WINDOW, min(MAX_WINDOW, int(window_mib * (1 << 20))))


def bulk_options(window: int) -> list[tuple[str, int]]:
    """gRPC channel (and server) options of a bulk connection whose streams start at ``window`` bytes of
    receive window (:func:`window_bytes`): the stream's initial window (``grpc.http2.lookahead_bytes``), the BDP
    probe kept on (it grows the window beyond, and shrinks it again under memory pressure).

    Raises:
        ValueError: ``window`` outside ``MIN_WINDOW..MAX_WINDOW``.
    """
    if not MIN_WINDOW <= window <= MAX_WINDOW:
        raise ValueError(f"window: {MIN_WINDOW}..{MAX_WINDOW} bytes, got {window}")
    return [("grpc.http2.lookahead_bytes", window), ("grpc.http2.bdp_probe", 1)]

"""Interface counters of the emulated WAN over time: every island's ``wan0`` bytes, sampled on a thread.

Used by :mod:`atoll.benchmarks.wan` (through :meth:`atoll.benchmarks.netns.EmulatedWan.sampler`) to count the bytes
each island's interface sent over a run's steady-state window.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence

from atoll.benchmarks.namespaces import IFNAME, WanError, open_netns, read_netdev, setns


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
        fds = [open_netns(n) for n in self.namespaces]
        try:
            while True:
                tx, rx = [], []
                for fd in fds:
                    setns(fd)  # this thread only
                    dev = read_netdev()[IFNAME]
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

"""What a strategy may ask of the network, independent of the runtime that carries it.

A strategy holds the islands *this process* runs (all of them in the ``local`` runtime, one in a real
multi-process runtime) and asks a :class:`Comm` to combine a tensor across *every* island of the job.
It passes one tensor per local island and gets back the combined tensor, so the same strategy code runs
unchanged whether the reduction happens in memory or over ``torch.distributed``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from atoll.algorithms.wire import Wire


class Work(ABC):
    """A collective in flight, as ``torch.distributed``'s ``async_op=True`` handle.

    Attributes:
        done_at: simulated completion time in seconds (0 where time is real).
        weight: of an all-reduce mean, the sum of the weights of every island (known after ``wait()``);
            0 when no island contributed, and the mean is then NaN.
    """

    done_at: float = 0.0
    weight: float = math.nan

    @abstractmethod
    def wait(self) -> torch.Tensor:
        """Block until the collective completes; return its float32 result."""

    def result_for_checkpoint(self) -> torch.Tensor:
        """The result, for a checkpoint taken while in flight (may block on a real network)."""
        return self.wait()


class DoneWork(Work):
    """A collective whose result is already known (restored from a checkpoint)."""

    def __init__(self, result: torch.Tensor) -> None:
        self.result = result

    def wait(self) -> torch.Tensor:
        return self.result


class Comm(ABC):
    """Collective operations across islands, with the bytes each island sends counted.

    Attributes:
        islands: number of islands in the job.
        local_islands: indices of the islands this process runs.
        bytes_sent_per_island: bytes one island has sent so far (payload as encoded on the wire,
            ring-collective cost included).
        bytes_received_per_island: bytes one island has received so far, counted the same way. Every collective
            here is a ring (all-reduce: reduce-scatter then all-gather; all-gather), in which each island
            receives from its predecessor exactly what it sends to its successor, so the two counts are equal;
            kept apart so that an exchange whose directions differ (a pull from a syncer) counts each its own.
        exchanges: number of collectives issued so far.
        peak_bytes_per_exchange: the largest payload one island sent in one collective, bytes.
        in_memory: every island is in this process and a collective is computed in memory (the ``local``
            runtime): a strategy may then compute a mean itself and count it with :meth:`charge_mean`.
    """

    islands: int
    local_islands: list[int]
    in_memory: bool = False

    def __init__(self) -> None:
        self.bytes_sent_per_island = 0.0
        self.bytes_received_per_island = 0.0
        self.exchanges = 0
        self.peak_bytes_per_exchange = 0.0

    def _count(self, bytes_sent: float) -> None:
        """Count one ring collective in which each island sent ``bytes_sent`` bytes, and received as many."""
        self.bytes_sent_per_island += bytes_sent
        self.bytes_received_per_island += bytes_sent
        self.exchanges += 1
        self.peak_bytes_per_exchange = max(self.peak_bytes_per_exchange, bytes_sent)

    def count_island(self, bytes_sent: float) -> None:
        """Count one exchange made outside the comm (torch's DDP hooks, FSDP2's all-reduce hook, both ring
        all-reduces) in which an island sent ``bytes_sent`` bytes in all (its ranks together), and received as
        many: no collective, nothing read."""
        Comm._count(self, bytes_sent)

    def all_reduce_mean(self, per_island: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                        wire: Wire | None = None, key: str = "") -> torch.Tensor:
        """Weighted mean of a 1-D tensor across every island; blocks until done.

        Args:
            per_island: one 1-D tensor per local island, all the same shape; float32 (or the dtype the
                wire carries: without a codec, the element size sets the counted bytes).
            weights: one non-negative weight per local island (e.g. tokens processed); default equal.
                The mean divides by the sum of the weights of the islands that contributed.
            wire: how the tensors travel (:class:`~atoll.algorithms.wire.Wire`): with a lossy codec each
                island's tensor is encoded (its error feedback and random source applied; bytes counted from
                the encoded payload: values, scales, indices), then decoded and accumulated in float32. None,
                or a wire without a codec: sent as is.
            key: names the tensor for error feedback (e.g. ``"fragment2"``). A runtime may accumulate the
                mean of a key in a buffer it reuses for the next exchange of the same key (no allocation per
                round): use the result before then, or copy it.

        Returns:
            The float32 mean, shape of one input, identical on every island; NaN where every weight of the
            job is 0 (nothing to average).
        """
        return self.start_all_reduce_mean(per_island, weights, wire, key).wait()

    def all_reduce_mean_and_weight(self, per_island: Sequence[torch.Tensor], weights: Sequence[float],
                                   wire: Wire | None = None, key: str = "") -> tuple[torch.Tensor, float]:
        """:meth:`all_reduce_mean`, and the sum of the weights of every island of the job (the same on every
        island: it tells each island whether every other one contributed)."""
        work = self.start_all_reduce_mean(per_island, weights, wire, key)
        mean = work.wait()
        return mean, work.weight

    @abstractmethod
    def start_all_reduce_mean(self, per_island: Sequence[torch.Tensor], weights: Sequence[float] | None = None,
                              wire: Wire | None = None, key: str = "") -> Work:
        """Start :meth:`all_reduce_mean` without blocking (overlapped communication, Streaming DiLoCo).

        Returns:
            A :class:`Work`; its ``wait()`` blocks the local islands until the result is there.
        """

    @abstractmethod
    def all_gather(self, per_island: Sequence[Any], payload_bytes: int, replicated: bool = False) -> list[Any]:
        """Gather one payload per island from every island, in island order; blocks until done.

        Args:
            per_island: one payload per local island (any picklable object of tensors).
            payload_bytes: bytes one island's payload occupies on the wire.
            replicated: every rank of an island holds the same payload, even on a sharded island (where
                each rank's payload is otherwise its own shard's); the collective runtime then moves it once.

        Returns:
            The payloads of all ``islands`` islands, ordered by island index.
        """

    def charge_mean(self, payload_bytes: float, codec_s: float = 0.0) -> None:
        """Count (and wait for) an all-reduce mean of ``payload_bytes`` per island that the caller computed
        itself, where :attr:`in_memory`, with ``codec_s`` seconds of its codec's work.

        Raises:
            NotImplementedError: the comm's islands are not all in this process.
        """
        raise NotImplementedError(f"{type(self).__name__}: a mean is computed by the collective itself")

    def start_charged_mean(self, result: torch.Tensor, payload_bytes: float, codec_s: float = 0.0,
                           weight: float = math.nan) -> Work:
        """:meth:`charge_mean` without blocking: a :class:`Work` whose ``wait()`` returns ``result``.

        Raises:
            NotImplementedError: the comm's islands are not all in this process.
        """
        raise NotImplementedError(f"{type(self).__name__}: a mean is computed by the collective itself")

    def restore_work(self, result: torch.Tensor, done_at: float) -> Work:
        """A :class:`Work` for a collective saved in flight by a checkpoint."""
        return DoneWork(result)

    def state_dict(self) -> dict[str, float]:
        """Counters, for checkpoints."""
        return {"bytes_sent_per_island": self.bytes_sent_per_island,
                "bytes_received_per_island": self.bytes_received_per_island, "exchanges": self.exchanges,
                "peak_bytes_per_exchange": self.peak_bytes_per_exchange}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the counters; a checkpoint from before the received side was counted (no
        ``bytes_received_per_island``) had only ring collectives: its received count is its sent count."""
        self.bytes_sent_per_island = float(state["bytes_sent_per_island"])
        self.bytes_received_per_island = float(state.get("bytes_received_per_island", self.bytes_sent_per_island))
        self.exchanges = int(state["exchanges"])
        self.peak_bytes_per_exchange = float(state["peak_bytes_per_exchange"])

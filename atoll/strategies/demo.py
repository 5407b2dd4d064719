"""``demo``: DeMo / DisTrO. Every step, islands all-gather the top-k DCT components of a decoupled momentum.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv:2411.19870), the optimizer
behind Nous Research's DisTrO preliminary report (Aug 2024). Each island keeps its own momentum and sends
only its fast-moving components (top-k per DCT chunk); every island decodes all islands' components in
the same order, averages them and applies the sign. All islands apply the same update and stay identical,
so the inner optimizer *is* the exchange: no outer step. The per-step payload is ``n`` indices (int16
for a 64 x 64 tile) plus ``ceil(n / 4)`` bytes of 2-bit signs per tensor (``n = chunks x k``; ``4n``
bytes of float32 values with ``--no-demo-sign-values``; see
:func:`atoll.algorithms.demo_payload.payload_bytes`), instead of ddp's 4 bytes per parameter.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

from atoll.algorithms.demo import DeMo
from atoll.strategies.base import Strategy


class DeMoStrategy(Strategy):
    """Runs each island's :class:`~atoll.algorithms.demo.DeMo` optimizer in lockstep through ``comm``."""

    name = "demo"

    def step(self, step: int) -> None:
        payloads = []
        for island in self.islands:
            with island.timed():
                island.clip_gradients()
                payloads.append(island.optimizer.encode_step())
        optimizer: DeMo = self.islands[0].optimizer  # type: ignore[assignment]
        gathered = self.comm.all_gather(payloads, payload_bytes=optimizer.bytes_per_step())
        for island in self.islands:
            with island.timed(), warnings.catch_warnings():
                # the scheduler cannot see apply_step() as an optimizer step; the schedule is unaffected
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                island.optimizer.apply_step(gathered)  # type: ignore[attr-defined]
                island.finish_step()

    def global_params(self) -> torch.Tensor:
        return self.islands[0].flat_params()

    def state_dict(self) -> dict[str, Any]:
        return {}

"""An island's parameters as flat float32 vectors, for exchanging: whole or one fragment at a time.

torchft's shape (``local_sgd.py``): the exchange reads and writes the parameters through views, one fragment
at a time, and computes the pseudo-gradient where the parameters live; nothing copies the whole model to
exchange one fragment. :class:`FlatViews` is the part of :class:`atoll.job.island.Island` that does it; it
needs the island's ``params`` (its parameters, in ``model.parameters()`` order) and ``device``.
"""

from __future__ import annotations

from typing import Any

import torch

from atoll.algorithms.fragments import FlatFragment


def check_flat_out(out: torch.Tensor, numel: int) -> None:
    """Whether ``out`` can take a flat copy of ``numel`` parameters (:meth:`FlatViews.flat_params`).

    Raises:
        ValueError: ``out`` is not a contiguous 1-D float32 CPU tensor of ``numel`` elements.
    """
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.dim() != 1 \
            or out.numel() != numel:
        raise ValueError(f"out: a contiguous 1-D float32 CPU tensor of {numel} elements is needed, not "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")


class FlatViews:
    """Flat views of an island's parameters and gradients (a base of :class:`~atoll.job.island.Island`).

    Attributes the island provides:
        params: its parameters, in ``model.parameters()`` order (a sharded island's: this rank's pieces).
        device: where they live.
    """

    params: list[torch.nn.Parameter]
    device: torch.device

    # torchft's shape (``local_sgd.py``): the exchange reads and writes the parameters through views, one
    # fragment at a time, and computes the pseudo-gradient where the parameters live; nothing copies the
    # whole model to exchange one fragment.
    def local_params(self) -> list[torch.Tensor]:
        """The tensors the flat vector concatenates, in ``model.parameters()`` order (detached: writing them
        writes the parameters). A sharded island's are this rank's pieces."""
        return [p.detach() for p in self.params]

    def local_fragment(self, fragment: FlatFragment) -> FlatFragment:
        """``fragment`` (ranges of the whole model's flat vector) as ranges of this island's flat vector
        (:meth:`flat_params`): what it holds of it, in the fragment's element order. An island that holds the
        whole model holds all of it: the fragment itself (a sharded island's is its shard's part)."""
        return fragment

    def param_views(self, fragment: FlatFragment | None = None) -> list[torch.Tensor]:
        """1-D views of every parameter, or of ``fragment``'s elements, in flat order (no copy)."""
        params = self.local_params()
        if fragment is None:
            return [p.reshape(-1) for p in params]
        return fragment.param_views(params)

    def make_contiguous(self) -> None:
        """Move the parameters into one float32 buffer, in flat order (each parameter's ``data`` a view of it), so
        that :meth:`contiguous_params` is one vector over all of them: the compiled outer round
        (:mod:`atoll.algorithms.fused_round`) then runs as one loop, not one call per tensor.
        The values are unchanged; call it before the inner optimizer takes its first step (its state is keyed by
        the parameters, which stay the same objects). A no-op where they are not all float32 on the CPU."""
        params = list(self.params)
        if not params or any(p.dtype != torch.float32 or p.device.type != "cpu" for p in params):
            return
        flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                view = flat[offset:offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                offset += n

    def contiguous_params(self) -> torch.Tensor | None:
        """All parameters as one 1-D float32 view (writing it writes them), where they lie in one buffer in flat
        order (:meth:`make_contiguous`); None otherwise (checked at every call: the parameters may have moved)."""
        params = self.local_params()
        if not params or any(p.dtype != torch.float32 or not p.is_contiguous() for p in params):
            return None
        first, size = params[0], params[0].element_size()
        offset = 0
        for p in params:
            if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or (
                    p.data_ptr() != first.data_ptr() + offset * size):
                return None
            offset += p.numel()
        return first.as_strided((offset,), (1,))

    def flat_params(self, fragment: FlatFragment | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """A float32 CPU copy of all parameters concatenated in ``model.parameters()`` order, (numel,), or of
        ``fragment``'s elements only, (fragment.numel(),): one copy of what is asked, never of the whole model
        for a fragment (on an accelerator: gathered there, then one device-to-host copy).

        Args:
            out: where to write the copy (1-D float32, contiguous, on the CPU, exactly that many elements), returned;
                None: a new tensor. A buffer kept between calls spares the CPU a page fault per 4 KiB that a
                fresh tensor of a large fragment's size costs at its first touch.

        Raises:
            ValueError: ``out`` does not fit (:func:`check_flat_out`).
        """
        views = self.param_views(fragment)
        numel = sum(v.numel() for v in views)
        if out is not None:
            check_flat_out(out, numel)
        if not views:
            return torch.empty(0, dtype=torch.float32) if out is None else out
        if self.device.type == "cpu" and views[0].dtype == torch.float32:
            return torch.cat(views, out=torch.empty(numel, dtype=torch.float32) if out is None else out)
        if out is not None:  # the device-to-host copy and the cast straight into it
            return out.copy_(torch.cat(views))
        return torch.cat(views).to("cpu", torch.float32)

    def set_flat_params(self, flat: torch.Tensor, fragment: FlatFragment | None = None) -> None:
        """Overwrite all parameters (or ``fragment``'s elements) from a flat float32 vector of shape (numel,)
        (or (fragment.numel(),)), on the CPU or the island's device. From pinned host memory the copies are
        non-blocking, one per parameter, and waited for once at the end (``flat`` may change after return).

        Raises:
            ValueError: the vector's length differs from what it overwrites.
        """
        views = self.param_views(fragment)
        total = sum(v.numel() for v in views)
        if flat.numel() != total:
            raise ValueError(f"flat vector of {flat.numel()} elements for parameters of {total}")
        with torch.no_grad():
            offset = 0
            for v in views:
                v.copy_(flat[offset:offset + v.numel()], non_blocking=True)
                offset += v.numel()
        if self.device.type == "cuda" and flat.device.type == "cpu":
            torch.cuda.current_stream(self.device).synchronize()

    def pseudo_gradient(self, global_flat: torch.Tensor, fragment: FlatFragment | None = None) -> torch.Tensor:
        """Δ = θ_global − θ_island (DiLoCo Alg. 1, line 9) of all parameters or of ``fragment``, computed
        where the parameters are: float32 (numel,) on the island's device. On the CPU it is written into a
        buffer kept per fragment (a fresh one costs a page fault per 4 KiB, more than the subtraction), so it
        holds until the next call for the same fragment: copy it to keep it longer.

        ``global_flat``: the global parameters of what is asked, float32 (numel,) (pinned host memory on an
        accelerator, copied there non-blocking). Equal, bit for bit, to
        :func:`atoll.algorithms.outer.pseudo_gradient` of the global and :meth:`flat_params`.

        Raises:
            ValueError: ``global_flat``'s length differs from what it is compared with.
        """
        views = self.param_views(fragment)
        total = sum(v.numel() for v in views)
        if global_flat.numel() != total:
            raise ValueError(f"global vector of {global_flat.numel()} elements for parameters of {total}")
        src = global_flat.reshape(-1).to(self.device, torch.float32, non_blocking=True)
        out = src if src.data_ptr() != global_flat.data_ptr() else self._delta_buffer(fragment, total)
        with torch.no_grad():
            offset = 0
            for v in views:
                n = v.numel()
                torch.sub(src[offset:offset + n], v.to(torch.float32), out=out[offset:offset + n])
                offset += n
        return out

    def _delta_buffer(self, fragment: FlatFragment | None, numel: int) -> torch.Tensor:
        buffers: dict[Any, torch.Tensor] = self.__dict__.setdefault("_delta_buffers", {})
        buf = buffers.get(fragment)
        if buf is None or buf.numel() != numel:
            buf = buffers[fragment] = torch.empty(numel, dtype=torch.float32)
        return buf

    @staticmethod
    def _mix_cpu(views: list[torch.Tensor], global_flat: torch.Tensor, alpha: float) -> None:
        """:meth:`mix_params` on the CPU in slices of 64 Ki elements through one small scratch buffer: per element
        ``θ·α`` rounded, plus ``θ_global·(1 − α)`` rounded (the same two products and sum as on whole tensors),
        with no temporary of the fragment's size."""
        step = 1 << 16
        scratch = torch.empty(step, dtype=torch.float32)
        with torch.no_grad():
            offset = 0
            for v in views:
                n = v.numel()
                for a in range(0, n, step):
                    b = min(a + step, n)
                    scaled = torch.mul(global_flat[offset + a:offset + b], 1 - alpha, out=scratch[:b - a])
                    v[a:b].mul_(alpha).add_(scaled)
                offset += n

    def mix_params(self, global_flat: torch.Tensor, alpha: float, fragment: FlatFragment | None = None) -> None:
        """θ ← α·θ + (1 − α)·θ_global, in place, for all parameters or ``fragment``'s (Streaming DiLoCo's
        mixing, arXiv:2501.18512 §2.3); ``alpha`` = 0 copies the global. ``global_flat``: float32 (numel,).
        The same floats as computing ``alpha * theta + (1 - alpha) * global`` on a copy."""
        if alpha == 0:
            self.set_flat_params(global_flat, fragment)
            return
        views = self.param_views(fragment)
        if self.device.type == "cpu" and global_flat.device.type == "cpu" and global_flat.dtype == torch.float32:
            self._mix_cpu(views, global_flat.reshape(-1), alpha)
            return
        scaled = (1 - alpha) * global_flat.reshape(-1).to(self.device, torch.float32, non_blocking=True)
        with torch.no_grad():
            offset = 0
            for v in views:
                n = v.numel()
                torch.add(alpha * v, scaled[offset:offset + n], out=v)
                offset += n
        if self.device.type == "cuda" and global_flat.device.type == "cpu":  # the host may change it after return
            torch.cuda.current_stream(self.device).synchronize()

    def flat_grads(self) -> torch.Tensor:
        """The gradients, float32 on the CPU, concatenated: shape (numel,). Missing gradients are zeros."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to("cpu", torch.float32)
                          for p in self.params])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        """Overwrite the gradients from a flat float32 vector (shape (numel,))."""
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.device, p.dtype).clone()
            offset += n

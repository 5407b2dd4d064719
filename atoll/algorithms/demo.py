"""DeMo: decoupled momentum with top-k DCT components, exchanged every step, sign-SGD applied.

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (Algorithm 1),
the algorithm behind Nous Research's DisTrO. Each island keeps its own float32 momentum ``m`` and, every
step, sends only the fast-moving part of it: the ``topk`` largest DCT-II coefficients of each chunk. What is
sent is subtracted from ``m`` (the rest keeps accumulating for later steps), every island decodes the
islands' payloads, averages them, and applies the sign of the average.

Usage, one island (a plain optimizer)::

    opt = DeMo(model.parameters(), lr=1e-3, beta=0.999, chunk=64, topk=32)
    loss.backward(); opt.step(); opt.zero_grad()

Usage, several islands in lockstep in one process (what a runtime does)::

    payloads = [opt.encode_step() for opt in opts]      # payloads[island][param]
    for opt in opts:
        opt.apply_step(payloads)                          # every island gets the same list, same order

The pieces live in their own modules: the chunked DCT-II in :mod:`atoll.algorithms.dct`, and what one
island sends per step (:class:`~atoll.algorithms.demo_payload.DemoPayload`, its 2-bit sign format and its
size in bytes, :func:`~atoll.algorithms.demo_payload.payload_bytes`) in :mod:`atoll.algorithms.demo_payload`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from atoll.algorithms.dct import ChunkedDCT, index_dtype_for
from atoll.algorithms.demo_payload import DemoPayload, _check_chunk_topk, pack_ternary, payload_bytes

__all__ = [
    "DeMo",
    "DemoPayload",
]

#: the dtype of the signs decoded once for several islands (:meth:`DeMo.decoded_signs`): -1, 0 and +1 exact, and
#: added to float32 parameters at about float32's speed (int8 needs a slower conversion)
SIGN_DTYPE = torch.bfloat16

AllGatherFn = Callable[[list["DemoPayload"]], list[list["DemoPayload"]]]


def _single_island(payloads: list[DemoPayload]) -> list[list[DemoPayload]]:
    return [payloads]


def _check_scalar(field: str, value: Any, low: float, high: float, high_open: bool, hint: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = low <= value < high if high_open else low <= value <= high
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{field} must be a number in [{low}, {high}{bracket} ({hint}), got {value!r}")
    return float(value)


def _decay_add_(m: torch.Tensor, beta: float, g: torch.Tensor, lr: float) -> None:
    """In place, ``m.mul_(beta).add_(g, alpha=lr)`` (float32, one shape; the same floats): in slices of 64 Ki
    elements where both are contiguous, so ``m`` is read and written once, not once per operation."""
    if not (m.is_contiguous() and g.is_contiguous() and m.shape == g.shape):
        m.mul_(beta).add_(g, alpha=lr)
        return
    flat_m, flat_g, step = m.view(-1), g.view(-1), 1 << 16
    for a in range(0, flat_m.numel(), step):
        flat_m[a:a + step].mul_(beta).add_(flat_g[a:a + step], alpha=lr)


# --------------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------------


class DeMo(torch.optim.Optimizer):
    """DeMo / DisTrO optimizer (arXiv:2411.19870, Algorithm 1), split into phases for a runtime.

    Per parameter with gradient ``g`` (``grad is None`` counts as a zero gradient, so every island sends
    one payload per parameter and the lists line up):

    a. ``m = beta * m + lr_t * g``  (decoupled momentum, float32, never synchronised; lr-weighted as in the
       reference code, bloc97/DeMo, so that warmup and decay weigh what each step adds)
    b. ``C = DCT_chunks(m)``; per chunk keep the ``k = min(topk, chunk_elems)`` largest ``|C|`` entries
    c. ``m -= IDCT(sparse C)``  (what is sent leaves the momentum; the residual accumulates)
    d. all-gather the (indices, values) payloads across islands
    e. scatter every island's payload into zeros (island order as gathered), average each coefficient over
       the islands that selected it (the reference's ``scatter_reduce(mean, include_self=False)``; 0 where
       none did), inverse DCT, ``p *= 1 - lr * weight_decay``, ``p -= lr * sign(avg)``.

    Phases: ``encode_step()`` does a-c and returns the payloads, ``apply_step(gathered)`` does e, and
    ``step()`` is ``apply_step(all_gather_fn(encode_step()))``.

    Args:
        params: parameters or param groups. Groups may override ``lr``, ``beta``, ``weight_decay``;
            ``chunk``, ``topk`` and ``sign_values`` are optimizer-wide (they fix the wire format).
        lr: step size of the sign update (parameter units per step), > 0. Field ``lr``.
        beta: momentum decay in [0, 1). Field ``demo_beta``.
        chunk: DCT tile side. Field ``demo_chunk``.
        topk: coefficients kept per chunk, 1 .. chunk**2. Field ``demo_topk``.
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay`` before the sign update, >= 0.
        sign_values: send ``sign(value)`` in {-1, 0, +1}, packed 2 bits per value (4 per byte, see
            :func:`pack_ternary`), instead of float32 (4 bytes). Psyche sends 1 bit; we keep an exact 0
            as a third state because the top-k of an all-zero chunk (unused embedding rows) would
            otherwise become spurious +1s that the sign step applies. With int16 indices a kept
            coefficient costs 2.25 bytes instead of 6; the indices dominate. The momentum still loses
            the full-precision selected components (step c), as with float values. Default False here
            (DeMo's reference); the ``demo`` strategy's default is ``DemoConfig.demo_sign_values``.
        all_gather_fn: ``payloads -> gathered[island][param]``; must return the same list, in the same
            island order, on every island. Defaults to a single island (``[payloads]``).

    State (all in ``state_dict()``): per parameter ``momentum`` (float32, the parameter's shape, kept in
    float32 across ``load_state_dict`` even for bf16 parameters) and ``step`` (int64 scalar tensor).

    Raises:
        ValueError: a hyperparameter is invalid (message names ``lr``, ``demo_beta``, ``demo_chunk``,
            ``demo_topk``, ``weight_decay`` or ``sign_values``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        beta: float = 0.999,
        chunk: int = 64,
        topk: int = 32,
        weight_decay: float = 0.0,
        sign_values: bool = False,
        all_gather_fn: AllGatherFn | None = None,
    ) -> None:
        _check_chunk_topk(chunk, topk)
        if not isinstance(sign_values, bool):
            raise ValueError(f"sign_values must be true or false, got {sign_values!r}")
        if all_gather_fn is not None and not callable(all_gather_fn):
            raise ValueError(f"all_gather_fn must be callable or None, got {all_gather_fn!r}")
        self.chunk = chunk
        self.topk = topk
        self.sign_values = sign_values
        self.all_gather_fn: AllGatherFn = all_gather_fn if all_gather_fn is not None else _single_island
        self._transforms: dict[tuple[int, ...], ChunkedDCT] = {}
        defaults = {
            "lr": lr,
            "beta": beta,
            "weight_decay": weight_decay,
            "chunk": chunk,
            "topk": topk,
            "sign_values": sign_values,
        }
        super().__init__(params, defaults)

    # ---- configuration ------------------------------------------------------------------------------

    def _validate_group(self, group: dict[str, Any]) -> None:
        lr = group["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0 (sign-SGD step size per step), got {lr!r}")
        _check_scalar("demo_beta", group["beta"], 0.0, 1.0, True, "momentum decay; DeMo uses 0.999")
        _check_scalar("weight_decay", group["weight_decay"], 0.0, math.inf, True, "decoupled, >= 0")
        for key, field in (("chunk", "demo_chunk"), ("topk", "demo_topk"), ("sign_values", "sign_values")):
            if group[key] != getattr(self, key) or type(group[key]) is not type(getattr(self, key)):
                raise ValueError(
                    f"{field} is optimizer-wide (it fixes the wire format): a param group has "
                    f"{group[key]!r}, the optimizer {getattr(self, key)!r}"
                )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch semantics) and validate its hyperparameters. Raises ValueError."""
        self._validate_group({**self.defaults, **param_group})  # before adding: a bad group is never kept
        super().add_param_group(param_group)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def transform_for(self, shape: Sequence[int]) -> ChunkedDCT:
        """The (cached) ``ChunkedDCT`` for a parameter shape under this optimizer's ``chunk``."""
        key = tuple(int(d) for d in shape)
        t = self._transforms.get(key)
        if t is None:
            t = ChunkedDCT(key, self.chunk)
            self._transforms[key] = t
        return t

    def payload_bytes(self, shape: Sequence[int]) -> int:
        """Bytes one island sends per step for a parameter of ``shape`` (``demo_payload.payload_bytes``)."""
        return payload_bytes(shape, self.chunk, self.topk, self.sign_values)

    def bytes_per_step(self) -> int:
        """Bytes one island sends per step for all parameters; equals ``sum(p.nbytes for p in encode_step())``."""
        return sum(self.payload_bytes(p.shape) for p in self._params())

    @property
    def step_count(self) -> int:
        """Steps taken (``encode_step`` calls), read from the first parameter's state; 0 before any."""
        for p in self._params():
            st = self.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    # ---- phases -------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_step(self) -> list[DemoPayload]:
        """Steps a-c for every parameter, in param-group order; returns what this island sends.

        Updates the momentum in place (adds the gradient, removes the transmitted components) and the
        step counter; leaves the parameters untouched (``apply_step`` moves them).

        Returns:
            One ``DemoPayload`` per parameter: indices (num_chunks, k) int8/int16/int32, values
            (num_chunks, k) float32 (with ``sign_values``: the signs packed 2 bits each, uint8 of shape
            ``(ceil(num_chunks * k / 4),)``), on the parameter's device.

        Raises:
            RuntimeError: no parameter has a gradient (call ``backward()`` first), or a gradient is sparse.
        """
        params = self._params()
        if params and all(p.grad is None for p in params):
            raise RuntimeError("DeMo.encode_step: no parameter has a gradient; call backward() first")
        payloads: list[DemoPayload] = []
        for group in self.param_groups:
            beta = group["beta"]
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError("DeMo does not support sparse gradients")
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(
                        p, dtype=torch.float32, memory_format=torch.contiguous_format
                    )
                    state["step"] = torch.zeros((), dtype=torch.int64)
                m: torch.Tensor = state["momentum"]
                state["step"] = state["step"] + 1  # not in place: a loaded state_dict may alias it
                # a. decoupled momentum
                if p.grad is None:
                    m.mul_(beta)
                else:  # bloc97/DeMo: the momentum accumulates lr_t * g_t
                    _decay_add_(m, beta, p.grad.to(torch.float32), group["lr"])
                # b. top-k DCT coefficients per chunk; c. what is sent removed, the residual kept for later steps
                t = self.transform_for(p.shape)
                idx, vals, sent = self._top_components(t, m, self._buffers(p))
                m.sub_(sent)
                payloads.append(
                    DemoPayload(
                        indices=idx.to(index_dtype_for(t.chunk_elems)),
                        values=pack_ternary(torch.sign(vals)) if self.sign_values else vals,
                        shape=t.shape,
                        chunk_elems=t.chunk_elems,
                        sign_values=self.sign_values,
                    )
                )
        return payloads

    def _top_components(self, t: ChunkedDCT, m: torch.Tensor, buffers: list[torch.Tensor] | None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps b-c's arithmetic for a momentum ``m`` (float32, ``t.shape``): the ``k`` coefficients of largest
        magnitude of each chunk of its DCT, as indices (num_chunks, k) int64 and values (num_chunks, k) float32,
        and what they decode to (float32, ``t.shape``; with ``buffers``, a view of the third, valid until they
        are used again)."""
        coeffs = t.encode(m, buffers)
        magnitudes = coeffs.abs() if buffers is None else torch.abs(coeffs, out=buffers[0][:coeffs.numel()]
                                                                    .view_as(coeffs))
        idx = torch.topk(magnitudes, min(self.topk, t.chunk_elems), dim=1, sorted=False).indices
        vals = torch.gather(coeffs, 1, idx)
        # the coefficients' own buffer, no longer read, holds the sparse matrix: no second one of their size
        return idx, vals, t.decode(coeffs.zero_().scatter_(1, idx, vals), buffers)

    def _buffers(self, p: torch.Tensor) -> list[torch.Tensor] | None:
        """Three flat float32 buffers that this optimizer keeps on the CPU for the DCT's intermediates
        (:meth:`ChunkedDCT.encode`), each of the largest CPU parameter's (whole) size: 12 bytes per element of
        that parameter, held for the optimizer's life (grown when a larger one joins, ``add_param_group``). A
        fresh tensor of a large parameter's size costs a page fault per 4 KiB there, more than the arithmetic
        (bench/outer_round.py, ``demo``). None for a parameter on an accelerator, whose caching allocator reuses
        memory already."""
        if p.device.type != "cpu":
            return None
        buffers = self.__dict__.get("_dct_buffers")
        if buffers is None or buffers[0].numel() < math.prod(p.shape):
            n = max(math.prod(q.shape) for q in self._params() if q.device.type == "cpu")
            buffers = self.__dict__["_dct_buffers"] = [torch.empty(n, dtype=torch.float32) for _ in range(3)]
        return buffers

    def _sum_coefficients(
        self, t: ChunkedDCT, payloads: Sequence[DemoPayload], device: torch.device, count: bool = False,
        buffers: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The sum of the payloads' coefficients, (num_chunks, chunk_elems) float32; with ``count`` divided,
        coefficient by coefficient, by the number of payloads that selected it (0 where none did). With
        ``buffers`` (:meth:`_buffers`), the sum is a view of the third and the counts use the first."""
        shape = (t.num_chunks, t.chunk_elems)
        n = t.num_chunks * t.chunk_elems
        if buffers is None:
            total = torch.zeros(shape, dtype=torch.float32, device=device)
            senders = torch.zeros_like(total) if count else None
        else:
            total = buffers[2][:n].view(shape).zero_()
            senders = buffers[0][:n].view(shape).zero_() if count else None
        for island, pl in enumerate(payloads):
            if tuple(pl.shape) != t.shape or pl.chunk_elems != t.chunk_elems or pl.num_chunks != t.num_chunks:
                raise ValueError(
                    f"DeMo.apply_step: island {island} sent a payload for shape {tuple(pl.shape)}, "
                    f"expected {t.shape}"
                )
            # added at the payload's entries only: the floats of adding its dense scatter (x + 0 is x), without
            # a dense (num_chunks, chunk_elems) temporary per island; a row's indices are distinct (a top-k's)
            index = pl.indices.to(device=device, dtype=torch.int64)
            total.scatter_add_(1, index, pl.dense_values(check=False).to(device=device))  # checked by apply_step
            if senders is not None:
                senders.scatter_add_(1, index, torch.ones(pl.indices.shape, dtype=torch.float32, device=device))
        return total if senders is None else total.div_(senders.clamp_(min=1.0))

    def decode_payload(self, payload: DemoPayload) -> torch.Tensor:
        """Dense float32 tensor (the parameter's shape) that one payload stands for: IDCT(scatter(payload)).

        With ``sign_values`` the coefficients are the signs (+-1), not the original values.
        """
        t = self.transform_for(payload.shape)
        return t.decode(self._sum_coefficients(t, [payload], payload.values.device))

    @torch.no_grad()
    def apply_step(self, gathered: Sequence[Sequence[DemoPayload]],
                   updates: Sequence[torch.Tensor] | None = None) -> None:
        """Step e: decode every island's payloads, average, take the sign, update the parameters.

        Args:
            gathered: ``gathered[island][param]``, the same list in the same island order on every island
                (so that every island computes bitwise the same update). Each coefficient is averaged over
                the islands whose payload selected it (DeMo's reference code).
            updates: the signs already decoded from this ``gathered`` by another island's optimizer in this
                process (:meth:`decoded_signs`, bfloat16, one per parameter, of its shape): applied as they are,
                the same floats as decoding them here (``p -= lr * sign``: a sign, -1, 0 or +1, is exact in
                bfloat16).

        Raises:
            ValueError: ``gathered`` is empty, an island's list has the wrong length, a payload's shape
                does not match its parameter, or packed signs are corrupt (checked for every payload before
                any parameter changes: one host read for the whole step).
        """
        params = self._params()
        if updates is None:
            self._check_gathered(gathered)
        elif len(updates) != len(params) or any(u.shape != p.shape for u, p in zip(updates, params, strict=False)):
            raise ValueError(f"DeMo.apply_step: {len(updates)} updates of shapes {[tuple(u.shape) for u in updates]}, "
                             f"expected one per parameter of its shape, in param-group order")
        i = 0
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                # the decoded sign: a fresh tensor or a buffer (this optimizer's, or the one that decoded it)
                self._apply_update(p, self._decoded_sign(p, gathered, i) if updates is None else updates[i], lr, wd)
                i += 1

    @torch.no_grad()
    def decoded_signs(self, gathered: Sequence[Sequence[DemoPayload]]) -> list[torch.Tensor]:
        """Step e's update without applying it: per parameter (param-group order) the sign of the decoded mean
        of ``gathered`` (as :meth:`apply_step`), bfloat16 (-1, 0, +1: torch's sign of a NaN is 0) of the
        parameter's shape, views of one flat buffer this optimizer keeps (2 bytes per
        parameter, overwritten by the next call). For islands in one process, which all apply the same update:
        decoded once, then :meth:`apply_step` (``updates=``) on each.

        Raises:
            ValueError: as :meth:`apply_step`.
        """
        self._check_gathered(gathered)
        params = self._params()
        total = sum(p.numel() for p in params)
        flat = self.__dict__.get("_signs")
        if flat is None or flat.numel() != total or flat.device != params[0].device:
            flat = self.__dict__["_signs"] = torch.empty(total, dtype=SIGN_DTYPE, device=params[0].device)
        signs, at = [], 0
        for i, p in enumerate(params):
            view = flat[at:at + p.numel()].view(p.shape)
            view.copy_(self._decoded_sign(p, gathered, i))
            signs.append(view)
            at += p.numel()
        return signs

    def _decoded_sign(self, p: torch.Tensor, gathered: Sequence[Sequence[DemoPayload]], i: int) -> torch.Tensor:
        """The sign of the mean of parameter ``i``'s payloads, decoded (float32, ``p``'s piece's shape): a fresh
        tensor, or a view of this optimizer's buffers (:meth:`_buffers`) until the next parameter's."""
        t = self.transform_for(p.shape)
        buffers = self._buffers(self._piece(p))
        mean = self._sum_coefficients(t, [pls[i] for pls in gathered], self._piece(p).device, count=True,
                                      buffers=buffers)
        return t.decode(mean, buffers).sign_()

    def _check_gathered(self, gathered: Sequence[Sequence[DemoPayload]]) -> None:
        """Raise ValueError (:meth:`apply_step`'s) unless ``gathered`` holds one payload per parameter per island,
        none with corrupt packed signs."""
        params = self._params()
        if len(gathered) == 0:
            raise ValueError(
                "DeMo.apply_step: gathered is empty; it must hold at least this island's payloads"
            )
        for island, pls in enumerate(gathered):
            if len(pls) != len(params):
                raise ValueError(
                    f"DeMo.apply_step: island {island} sent {len(pls)} payloads, expected {len(params)} "
                    "(one per parameter, in param-group order)"
                )
        flags = [pl.corrupt().to(params[0].device) for pls in gathered for pl in pls if pl.sign_values]
        if flags and bool(torch.stack(flags).any()):
            island = next(j for j, pls in enumerate(gathered) if any(bool(pl.corrupt()) for pl in pls))
            raise ValueError(f"DeMo.apply_step: island {island} sent packed signs with the unused code 0b10; "
                             "the payload is corrupt")

    def _piece(self, p: torch.Tensor) -> torch.Tensor:
        """The part of parameter ``p`` this optimizer writes: all of it (a sharded island's: its rank's rows)."""
        return p

    def _apply_update(self, p: torch.Tensor, update: torch.Tensor, lr: float, wd: float) -> None:
        """Decoupled weight decay, then ``p -= lr * update`` (``update``: the sign of the decoded mean, shaped as
        ``p``, float32, or :data:`SIGN_DTYPE` from :meth:`decoded_signs`, added as it is)."""
        if wd != 0.0:
            p.mul_(1.0 - lr * wd)
        p.add_(update if update.dtype == SIGN_DTYPE else update.to(p.dtype), alpha=-lr)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One full step: ``apply_step(self.all_gather_fn(self.encode_step()))``. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.apply_step(self.all_gather_fn(self.encode_step()))
        return loss

    # ---- state --------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch-format state; momentum stays float32 (torch would cast it to the parameter dtype).

        Raises:
            ValueError: the saved ``chunk``, ``topk`` or ``sign_values`` differ from this optimizer's.
        """
        for group in state_dict.get("param_groups", []):
            for key in ("chunk", "topk", "sign_values"):
                if key in group and group[key] != getattr(self, key):
                    raise ValueError(
                        f"DeMo state has {key}={group[key]!r} but this optimizer has {getattr(self, key)!r}; "
                        "the momentum of a different wire format cannot be resumed"
                    )
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        for index, p in enumerate(self._params()):
            entry = saved.get(index)
            if entry is not None and "momentum" in entry:
                self.state[p]["momentum"] = entry["momentum"].to(
                    device=p.device, dtype=torch.float32, copy=True
                )

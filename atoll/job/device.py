"""Where islands compute and in which precision: device choice, placement of islands, autocast, timing.

``--device auto`` takes CUDA when present (then Apple's MPS), else the CPU. In the ``local`` runtime the
islands are placed on the visible GPUs round-robin (island i on GPU i mod G; several islands may share one
GPU, as when K simulated islands train on one box). The global parameters, the outer optimizer's state
and every codec stay float32 on the CPU (:class:`atoll.job.run.Run`): an island's parameters are copied
to and from its device around an exchange.

``--precision bf16`` runs each island's forward and backward pass under ``torch.autocast`` with bfloat16
(Micikevicius et al. 2018, mixed precision; bfloat16 needs no loss scaling): the weights, their gradients
and the optimizer's state stay float32 (the master weights), so the pseudo-gradients, the outer step and
the codecs see float32 exactly as with ``fp32``.

``--compile`` compiles each island's forward pass with ``torch.compile`` (TorchInductor; Ansel et al.
2024, PyTorch 2). Compilation happens at the first call; when it fails (no C++ compiler or Triton, an
unsupported platform or Python) the island falls back to eager mode with one warning saying why, and the
run records the reason (``compile_skipped`` in summary.json). Only the first call is guarded: an error in
a later call (an out-of-memory error inside the compiled graph) is raised, never hidden by eager mode.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch

from atoll.errors import ConfigError, exception_line

DeviceName = Literal["auto", "cpu", "cuda", "mps"]
Precision = Literal["fp32", "bf16"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(name: str, cuda_count: int | None = None, mps: bool | None = None) -> str:
    """The device type a run computes on: ``cuda``, ``mps`` or ``cpu``.

    Args:
        name: ``auto`` (CUDA when present, then MPS, else the CPU), ``cpu``, ``cuda`` or ``mps``.
        cuda_count: visible CUDA devices (default: ``torch.cuda.device_count()``; tests pass a number).
        mps: whether MPS is available (default: asked from torch).

    Raises:
        ConfigError: a device that is not there (field ``device``), or an unknown name.
    """
    cuda_count = torch.cuda.device_count() if cuda_count is None else cuda_count
    mps = _mps_available() if mps is None else mps
    if name == "auto":
        return "cuda" if cuda_count > 0 else "mps" if mps else "cpu"
    if name == "cuda" and cuda_count == 0:
        raise ConfigError("device: cuda was asked for but torch sees no CUDA device (a CPU-only torch build, or "
                          "no visible GPU); pass --device cpu or install the CUDA build of torch")
    if name == "mps" and not mps:
        raise ConfigError("device: mps was asked for but torch reports it unavailable; pass --device cpu")
    if name not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device: unknown device '{name}'; use auto, cpu, cuda or mps")
    return name


def island_devices(islands: int, name: str, cuda_count: int | None = None, mps: bool | None = None,
                   ) -> list[torch.device]:
    """The device of each of ``islands`` islands in one process: GPUs round-robin, or all on one device.

    Island i goes to ``cuda:(i mod G)`` for G visible GPUs; on ``mps`` or ``cpu`` every island shares it.

    Raises:
        ConfigError: as :func:`resolve_device`.
    """
    kind = resolve_device(name, cuda_count, mps)
    if kind == "cuda":
        count = torch.cuda.device_count() if cuda_count is None else cuda_count
        return [torch.device("cuda", i % count) for i in range(islands)]
    return [torch.device(kind)] * islands


def autocast(device: torch.device, precision: str) -> AbstractContextManager[Any]:
    """The context of an island's forward and backward pass: bfloat16 autocast for ``bf16``, none for
    ``fp32``. Parameters, gradients and optimizer state stay float32 either way.

    Raises:
        ValueError: an unknown precision.
    """
    if precision == "fp32":
        return nullcontext()
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"unknown precision {precision!r}")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer around it measures the work (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextmanager
def peak_memory(device: torch.device) -> Iterator[Callable[[], int]]:
    """Track the device's peak allocated bytes inside the block; yields a function returning it (0 on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield lambda: int(torch.cuda.max_memory_allocated(device))
    else:
        yield lambda: 0


def host_memory_bytes() -> int:
    """This process's resident host memory now, in bytes (``/proc/self/statm`` on Linux; elsewhere the peak,
    ``ru_maxrss``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class CompiledForward:
    """An island's forward pass compiled with ``torch.compile``, falling back to eager when its first call
    (where compilation happens) fails; later calls raise what they raise (an out-of-memory error included).

    Calls take the model's arguments (e.g. ``input_ids``: LongTensor (batch, seq_len)) and return its output.
    The compiled module shares the model's parameters, so optimizers, pseudo-gradients and checkpoints see
    the model unchanged.

    Attributes:
        called: whether the forward pass has run (the first call compiles).
        skipped: why compilation was given up (the exception's one-line summary), or None while compiled.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.skipped: str | None = None
        self.called = False
        self._compiled: Callable[..., Any] | None
        try:
            self._compiled = torch.compile(model)
        except Exception as e:  # noqa: BLE001 - any failure means eager mode, said once
            self._give_up(e)

    def _give_up(self, e: BaseException) -> None:
        self.skipped = exception_line(e)
        self._compiled = None
        warnings.warn(f"--compile skipped, training in eager mode: {self.skipped}", RuntimeWarning, stacklevel=3)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first, self.called = not self.called, True
        if self._compiled is None:
            return self.model(*args, **kwargs)
        if not first:  # compiled once: a later failure (out of memory, a recompilation) is the run's error
            return self._compiled(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except torch.cuda.OutOfMemoryError:  # not a compiler's failure: eager mode would not fit either
            raise
        except Exception as e:  # noqa: BLE001 - compilation errors surface at the first call
            self._give_up(e)
        return self.model(*args, **kwargs)


def peak_accelerator_bytes(reset: bool = True) -> int | None:
    """The most accelerator memory this process's tensors held since the last call (bytes): the maximum of
    ``torch.cuda.max_memory_allocated`` over the visible CUDA devices, whose peaks are then reset (``reset``)
    so that each logging interval reports its own peak. None where no CUDA context was started (the CPU, and
    MPS, whose allocator keeps no peak): asking never initializes CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    devices = range(torch.cuda.device_count())
    peak = max((int(torch.cuda.max_memory_allocated(d)) for d in devices), default=0)
    if reset:
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
    return peak

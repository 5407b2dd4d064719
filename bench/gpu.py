"""atoll on an accelerator: throughput, model FLOP utilization, memory, the outer step and the framework's overhead.

    python bench/gpu.py                           # 20m and 125m (1b if memory allows), bf16, 4 islands on GPU 0
    python bench/gpu.py --device cpu --quick      # the same script on the CPU at the micro size (a smoke run)

Written and tested on the CPU so that it runs first time on a GPU machine. For each model size:

1. **Loops** (:func:`bench.overhead.compare_loops`): one island's inner step (atoll's ``Island``: forward
   and backward under bf16 autocast, the non-finite check, clipping, fused AdamW, the schedule) against the
   plain PyTorch loop on the same device, model, batch and schedule, in interleaved rounds: seconds per step,
   tokens per second, **MFU** and the **overhead** of atoll against the plain loop, as a ratio of the same run.
2. **A diloco job of K islands on one device** (the ``local`` runtime, H inner steps per round, two rounds):
   tokens per second of the whole job, **peak memory** of the device, and three times apart, from the job's
   summary: the **inner steps** (the islands' timed forward, backward and optimizer steps, ``compute_s``),
   the **outer round** (the pseudo-gradients, their exchange and average, the outer Nesterov step and the
   copies around them: the strategy's time outside the islands' inner steps, ``outer_s``, per round) against
   the round's K x H inner steps, and the **evaluation** (on island 0's device, ``eval_s``, per evaluation);
   the job's tokens per second are over its time less the evaluations.
3. **Islands on several GPUs run concurrently** (:func:`measure_concurrency`, with 2 or more GPUs, or
   ``--concurrency N`` to force it, as the CPU smoke run does): the ``local`` runtime's diloco job with one
   island, then with G islands placed round-robin on G GPUs, the same H and steps; the seconds per inner step
   of the whole job (less its evaluations) give the **speed-up** G x one island's / G islands' (G: the islands'
   launches overlap, as they should with no host read per inner step; 1: they ran one after another).
4. **Pinned against pageable host memory** (:func:`measure_copies`) for the copies around an exchange, at
   ``--copy-models`` (default ``1b`` on a GPU, ``tiny`` on the CPU): the parameters gathered on the device
   copied to a flat host vector (device to host, as ``flat_params``), and a flat host vector copied back into
   every parameter, one non-blocking copy each (host to device, as ``set_flat_params``), each timed apart into
   a preallocated pageable buffer and into a pinned one (the same bytes, only the pinning differs), in
   interleaved rounds: seconds, GB/s and the pinned buffer's speed-up per direction. Pinned memory needs an
   accelerator: on the CPU the pageable copies alone are timed (``pinned`` null).
5. **The codec exchange of the collective runtime** (:func:`measure_exchange`), at ``--exchange-models``
   (default ``125m`` on a GPU, ``tiny`` on the CPU): ``DistComm.start_all_reduce_mean`` of a pseudo-gradient of
   the preset's size with a wire (``--exchange-codec``, stochastic rounding, error feedback) over a one-process
   group, on the device (NCCL on a GPU: encoded, packed, gathered, decoded and averaged there, the residual
   and the random source there too) against the host path the runtime took before (the vector copied to the
   host and exchanged by a gloo comm on the CPU): seconds of each (median), the speed-up, and where the
   result, the residual and the random source ended up.
6. **DeMo's step on the device** (:func:`measure_demo`), at ``--demo-models`` (default ``125m`` on a GPU,
   ``micro`` on the CPU): one island's ``encode_step`` and ``apply_step`` of K payloads timed apart, against
   the island's inner step of the same model from item 1: what DeMo adds to every inner step where its momentum
   lives (the CPU figures of bench/outer_round.py are of islands on the CPU).

MFU, model FLOP utilization (Chowdhery et al. 2022, PaLM, appendix B): achieved model FLOPs per second over
the device's peak, with model FLOPs per token = 6 N + 12 L d T (N: parameters that multiply, the tied
head counted once, untied input embeddings not; L layers, d width, T sequence length; the second term is
attention's score and value products, forward and backward). Peak: dense bfloat16 of the device from
:data:`PEAK_TFLOPS` by its name, or ``--peak-tflops``; without one MFU is not reported (the CPU).

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/gpu``). Targets of the issue
(125m, bf16, 4 islands on one H100/H200-class GPU): MFU at least 40%, overhead at most 3%, outer step under
5% of its H = 50 inner steps. The script reports them; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/gpu.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.benchmarks.common import default_out, markdown_table, script_error, write_results
from atoll.errors import AtollError

#: dense bfloat16 peak TFLOP/s by device name (vendor data sheets, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "B200": 2250.0, "A100": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0}
#: per model: (batch sequences per island per step, sequence length) on an accelerator
SHAPES = {"20m": (32, 1024), "125m": (16, 1024), "1b": (4, 2048)}
QUICK = {"models": "micro", "batch": 4, "seq": 32, "sync_every": 3, "rounds": 3, "steps": 2, "vocab": 512,
         "copy_repeats": 3, "exchange_repeats": 2}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copies(name: str, vocab: int, device: torch.device, repeats: int) -> dict[str, Any]:
    """Pinned against pageable host memory for the host copies of one exchange of the model ``name``.

    Parameters of the preset's shapes (float32, random) live on ``device``; a flat float32 host vector of all of
    them is preallocated twice, pageable and (on CUDA) pinned, and touched once. Per round, for each buffer in
    turn: **device to host** (the parameters concatenated on the device beforehand, then one copy into the
    buffer, non-blocking from pinned memory, waited for) and **host to device** (one copy per parameter from
    the buffer, non-blocking, waited for once: ``set_flat_params``), each timed apart; the first round is a
    warm-up, the median of the ``repeats`` others is reported.

    Returns:
        ``model``, ``params``, ``bytes`` (4 per parameter), ``repeats``, ``d2h_pageable_s``, ``h2d_pageable_s``,
        ``d2h_pinned_s``, ``h2d_pinned_s`` (seconds; None without an accelerator), the same as ``*_gbps``
        (10^9 bytes per second), and ``d2h_pinned_speedup``, ``h2d_pinned_speedup`` (pageable seconds over
        pinned seconds; None without an accelerator).
    """
    import statistics

    from atoll.job.model import build_model

    shapes = [tuple(p.shape) for p in build_model(name, vocab, 128, seed=0, meta=True).parameters()]
    gen = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=gen, device=device) for s in shapes]
    numel = sum(p.numel() for p in params)
    flat_device = torch.cat([p.reshape(-1) for p in params])  # what flat_params() gathers on the device
    kinds = {"pageable": torch.empty(numel, dtype=torch.float32)}
    if device.type == "cuda":  # page-locked host memory needs an accelerator's driver
        kinds["pinned"] = torch.empty(numel, dtype=torch.float32, pin_memory=True)
    for buf in kinds.values():  # every page touched once: no first-touch faults in the timings
        buf.copy_(flat_device.cpu() if device.type != "cpu" else flat_device)
    times: dict[str, list[float]] = {f"{d}_{k}": [] for k in kinds for d in ("d2h", "h2d")}

    def timed(fn: Any) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def to_host(buf: torch.Tensor) -> None:
        buf.copy_(flat_device, non_blocking=buf.is_pinned())

    @torch.no_grad()
    def to_device(buf: torch.Tensor) -> None:
        offset = 0
        for p in params:
            p.copy_(buf[offset:offset + p.numel()].view_as(p), non_blocking=True)
            offset += p.numel()

    for r in range(repeats + 1):
        for kind, buf in kinds.items():  # interleaved: both kinds see the same machine
            d2h, h2d = timed(lambda b=buf: to_host(b)), timed(lambda b=buf: to_device(b))
            if r:
                times[f"d2h_{kind}"].append(d2h)
                times[f"h2d_{kind}"].append(h2d)
    row: dict[str, Any] = {"model": name, "params": numel, "bytes": 4 * numel, "repeats": repeats}
    for direction in ("d2h", "h2d"):
        for kind in ("pageable", "pinned"):
            s = statistics.median(times[f"{direction}_{kind}"]) if kind in kinds else None
            row[f"{direction}_{kind}_s"] = s
            row[f"{direction}_{kind}_gbps"] = 4 * numel / s / 1e9 if s else None
        pinned = row[f"{direction}_pinned_s"]
        row[f"{direction}_pinned_speedup"] = row[f"{direction}_pageable_s"] / pinned if pinned else None
    return row


def measure_exchange(name: str, vocab: int, device: torch.device, repeats: int, codec: str = "int4") -> dict[str, Any]:
    """The collective runtime's codec exchange of a pseudo-gradient of the model ``name``, on ``device`` against
    the host path it took before.

    One process is a group of one island (a ``torch.distributed`` group of world size 1: NCCL on CUDA, gloo
    elsewhere; a gloo group beside it for the host path). A flat float32 vector of the preset's parameter count
    lives on ``device``. **Device**: ``DistComm(device=device).start_all_reduce_mean`` with a :class:`Wire`
    (``codec``, stochastic rounding, error feedback), waited for: encode, pack, weight header, all-gather,
    decode and average on the device. **Host**: the vector copied to the host, then the same exchange by a
    comm on the CPU (what the runtime did before: the codec on the host), its result on the host. Each timed
    apart (the device waited for), interleaved, the first round a warm-up, the median of ``repeats`` others.

    Returns:
        ``model``, ``params``, ``codec``, ``payload_bytes`` (one island's), ``repeats``, ``device_s``,
        ``host_s`` (seconds), ``host_over_device`` (their ratio), and where the device path left its result,
        residual and random source (``result_device``, ``residual_device``: ``str`` of the device;
        ``generator_device``: its type).

    Raises:
        RuntimeError: a process group is already initialized in this process.
    """
    import datetime
    import statistics

    import torch.distributed as dist

    from atoll.algorithms.wire import Wire
    from atoll.job.model import build_model
    from atoll.runtime.collective.comm import DistComm

    if dist.is_initialized():
        raise RuntimeError("measure_exchange: a process group is already initialized in this process")
    numel = sum(p.numel() for p in build_model(name, vocab, 128, seed=0, meta=True).parameters())
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(numel, generator=gen, device=device) * 1e-3  # a pseudo-gradient's scale
    timeout = datetime.timedelta(seconds=600)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=timeout)
    try:
        host_group = dist.new_group([0], backend="gloo", timeout=timeout) if device.type == "cuda" \
            else dist.group.WORLD
        paths = {"device": (DistComm(1, 0, 1, 0, dist.group.WORLD, None, device), device),
                 "host": (DistComm(1, 0, 1, 0, host_group, None, torch.device("cpu")), torch.device("cpu"))}
        wires = {k: Wire(codec, [0], rounding="stochastic", error_feedback=True, seed=0) for k in paths}
        times: dict[str, list[float]] = {k: [] for k in paths}
        results: dict[str, torch.Tensor] = {}
        for r in range(repeats + 1):
            for kind, (comm, where) in paths.items():  # interleaved: both see the same machine
                _sync(device)
                t0 = time.perf_counter()
                results[kind] = comm.start_all_reduce_mean([x.to(where)], weights=[1.0], wire=wires[kind],
                                                           key="g").wait()
                _sync(device)
                if r:
                    times[kind].append(time.perf_counter() - t0)
    finally:
        dist.destroy_process_group()
    wire = wires["device"]
    residual = wire.feedback[0].residual("g") if wire.feedback else None
    device_s, host_s = statistics.median(times["device"]), statistics.median(times["host"])
    return {"model": name, "params": numel, "codec": codec,
            "payload_bytes": wire.codec.payload_bytes(numel) if wire.codec is not None else 4 * numel,
            "repeats": repeats, "device_s": device_s, "host_s": host_s, "host_over_device": host_s / device_s,
            "result_device": str(results["device"].device),
            "residual_device": str(residual.device) if residual is not None else None,
            "generator_device": wire.island_state(0)["generator_device"]}


def measure_demo(name: str, vocab: int, device: torch.device, repeats: int, islands: int = 4,
                 island_step_s: float | None = None) -> dict[str, Any]:
    """DeMo's per-step work on ``device`` for the model ``name``: what each island adds to every inner step.

    The preset's parameters (float32, random) and a gradient for each live on ``device``, with a
    :class:`~atoll.algorithms.demo.DeMo` optimizer at the ``demo`` strategy's defaults (its momentum and transforms
    live with the parameters). Per round: **encode** (``encode_step``: the momentum, its tiled DCT, the top-k per
    tile, what is sent removed) and **apply** (``apply_step`` of ``islands`` payloads, as after the all-gather:
    every coefficient averaged over its senders, the inverse DCT, the sign step), each waited for and timed
    apart; the first round a warm-up, the median of ``repeats`` others. The all-gather itself is the link's
    (``atoll project``).

    Returns:
        ``model``, ``params``, ``islands``, ``repeats``, ``payload_bytes`` (one island's per step), ``encode_s``,
        ``apply_s``, ``step_s`` (their sum, seconds), and ``share_of_inner_step_pct``: ``step_s`` against
        ``island_step_s`` (an island's inner step of this model on this device, measured apart; None without).
    """
    import statistics

    from atoll.algorithms.demo import DeMo
    from atoll.job.model import build_model
    from atoll.strategies.demo import DeMoConfig, make_optimizer

    model = build_model(name, vocab, 128, seed=0).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(0)
    opt: DeMo = make_optimizer([{"params": params}], DeMoConfig())  # type: ignore[assignment]
    times: dict[str, list[float]] = {"encode": [], "apply": []}
    for r in range(repeats + 1):
        for p in params:  # a gradient's scale, fresh each round (outside the timed work)
            p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
        _sync(device)
        t0 = time.perf_counter()
        payloads = opt.encode_step()
        _sync(device)
        t1 = time.perf_counter()
        opt.apply_step([payloads] * islands)
        _sync(device)
        if r:
            times["encode"].append(t1 - t0)
            times["apply"].append(time.perf_counter() - t1)
    encode_s, apply_s = statistics.median(times["encode"]), statistics.median(times["apply"])
    step_s = encode_s + apply_s
    return {"model": name, "params": sum(p.numel() for p in params), "islands": islands, "repeats": repeats,
            "payload_bytes": opt.bytes_per_step(), "encode_s": encode_s, "apply_s": apply_s, "step_s": step_s,
            "share_of_inner_step_pct": 100 * step_s / island_step_s if island_step_s else None}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """The device's dense bf16 peak in TFLOP/s: ``override``, else looked up by the CUDA device's name."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, 6 N + 12 L d T (PaLM, appendix B); N counts the parameters that multiply."""
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:  # the input embedding is a lookup; a tied one is the head's matmul too
        n -= model.get_input_embeddings().weight.numel()
    return 6.0 * n + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def fits(model_name: str, islands: int, vocab: int, device: torch.device) -> bool:
    """Whether K islands' fp32 weights, gradients and AdamW state (16 bytes a parameter) fit in 80% of the
    device's memory (always true off CUDA, where the caller chose the size)."""
    if device.type != "cuda":
        return True
    from atoll.job.model import PRESETS

    p = PRESETS[model_name]
    approx = 12 * p.num_hidden_layers * p.hidden_size ** 2 + 2 * vocab * p.hidden_size
    return islands * 16 * approx < 0.8 * torch.cuda.get_device_properties(device).total_memory


def measure(name: str, args: argparse.Namespace, device: torch.device, data: dict[str, Any]) -> dict[str, Any]:
    """Loops and the diloco job for one model size; one row of the results."""
    from atoll.config import build_config
    from atoll.job.device import peak_memory
    from atoll.job.model import build_model, count_parameters
    from bench.overhead import compare_loops

    batch, seq = (args.batch, args.seq) if args.batch else SHAPES.get(name, (8, 256))
    own = {"model": name, "batch_size": batch, "seq_len": seq, "precision": args.precision, "device": args.device,
           "compile": args.compile,
           "vocab_size": args.vocab, **data}
    config = build_config(overrides={**own, "steps": 10_000, "islands": 1, "progress": False})
    model = build_model(name, config.vocab_size, seq, config.seed)
    peak = peak_tflops(device, args.peak_tflops)
    fpt = flops_per_token(model, seq)
    loops = compare_loops(config, model, device, args.rounds, args.steps)
    atoll_s, plain_s = loops["median_s"]["atoll"], loops["median_s"]["plain"]
    tokens_per_step = batch * seq
    row: dict[str, Any] = {
        "model": name, "params": count_parameters(model), "batch": batch, "seq_len": seq,
        "precision": args.precision, "compile": args.compile, "flops_per_token": fpt,
        "island_step_s": atoll_s, "plain_step_s": plain_s, "overhead_pct": 100 * (atoll_s - plain_s) / plain_s,
        "island_tokens_per_s": tokens_per_step / atoll_s,
        "mfu_pct": 100 * fpt * tokens_per_step / atoll_s / (peak * 1e12) if peak else None,
        "max_weight_diff": loops["max_weight_diff"],
    }
    del model
    h = args.sync_every
    with peak_memory(device) as peak_bytes:
        job_s, summary = _diloco_job(own, args.islands, h)
        row["peak_memory_bytes"] = peak_bytes()
    rounds, evals = 2, 2  # two rounds of H; evaluations before training and at the end
    # the round's K x H inner steps as the job timed them (islands in turn on one device; compute_s is the
    # slowest island's, which K islands of one device share)
    inner_round_s = args.islands * summary["compute_s"] / rounds
    outer_s = summary["outer_s"] / rounds
    train_s = job_s - summary["eval_s"]
    row.update({
        "islands": args.islands, "sync_every": h, "job_tokens": summary["tokens"], "job_s": job_s,
        "job_tokens_per_s": summary["tokens"] / train_s, "inner_step_s": summary["compute_s"] / (rounds * h),
        "inner_round_s": inner_round_s, "outer_step_s": outer_s, "eval_s": summary["eval_s"] / evals,
        "outer_vs_inner_round_pct": 100 * outer_s / inner_round_s, "final_eval_loss": summary["final_eval_loss"],
    })
    return row


def _diloco_job(own: dict[str, Any], islands: int, h: int) -> tuple[float, dict[str, Any]]:
    """A diloco job (the ``local`` runtime) of ``islands`` islands, two rounds of H, evaluated before and at
    the end, no checkpoint: its wall seconds and its summary."""
    from atoll.config import build_config
    from atoll.training import train

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        summary = train(build_config(overrides={
            **own, "strategy": "diloco", "islands": islands, "sync_every": h, "steps": 2 * h, "eval_every": 2 * h,
            "eval_batches": 1, "checkpoint_every": 0, "progress": False, "out": str(Path(tmp) / "run")}))
        return time.perf_counter() - t0, summary


def measure_concurrency(name: str, args: argparse.Namespace, gpus: int, data: dict[str, Any]) -> dict[str, Any]:
    """One island against ``gpus`` islands placed round-robin on ``gpus`` devices (the ``local`` runtime's
    :func:`~atoll.job.device.island_devices`), same model, batch, H and steps: seconds per inner step of each
    job (less evaluations) and the speed-up ``gpus`` x one's / all's (``gpus``: fully concurrent; 1: serial)."""
    batch, seq = (args.batch, args.seq) if args.batch else SHAPES.get(name, (8, 256))
    own = {"model": name, "batch_size": batch, "seq_len": seq, "precision": args.precision, "device": args.device,
           "compile": args.compile, "vocab_size": args.vocab, **data}
    steps = 2 * args.sync_every
    (one_job_s, one), (all_job_s, summary) = (_diloco_job(own, k, args.sync_every) for k in (1, gpus))
    one_s, all_s = (one_job_s - one["eval_s"]) / steps, (all_job_s - summary["eval_s"]) / steps
    return {"model": name, "gpus": gpus, "one_island_step_s": one_s, "islands_step_s": all_s,
            "speedup": gpus * one_s / all_s, "final_eval_loss": summary["final_eval_loss"]}


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/gpu.py [--models 20m,125m,1b] [--device auto] [--quick] ...``; the exit status (2: bad input)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="20m,125m,1b", help="model presets [20m,125m,1b; 1b if it fits]")
    parser.add_argument("--device", default="auto", help="auto, cuda, cpu or mps [auto]")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"), help="[bf16]")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="torch.compile both loops' and the islands' forward passes [off]")
    parser.add_argument("--islands", type=int, default=4, help="islands of the diloco job on one device [4]")
    parser.add_argument("--sync-every", type=int, default=50, help="H of the diloco job (two rounds) [50]")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the loops (first discarded) [4]")
    parser.add_argument("--steps", type=int, default=10, help="steps per round of the loops [10]")
    parser.add_argument("--batch", type=int, default=None, help="sequences per island per step [per model]")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence [per model]")
    parser.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary [8192]")
    parser.add_argument("--data", default="stdlib", help="corpus, as atoll train --data [stdlib]")
    parser.add_argument("--cache-dir", default=None, help="tokenizer/token cache, as atoll train")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak [by name]")
    parser.add_argument("--copy-models", default=None,
                        help="presets whose host copies are timed pinned against pageable [1b on a GPU, tiny on "
                             "the CPU; none: skip]")
    parser.add_argument("--copy-repeats", type=int, default=5, help="timed rounds of the copies (after one) [5]")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="islands (one per GPU) of the concurrency check [every GPU when 2 or more; 0: skip]")
    parser.add_argument("--exchange-models", default=None,
                        help="presets whose collective codec exchange is timed on the device against the host "
                             "[125m on a GPU, tiny on the CPU; none: skip]")
    parser.add_argument("--exchange-codec", default="int4", help="the codec of the timed exchange [int4]")
    parser.add_argument("--exchange-repeats", type=int, default=5,
                        help="timed rounds of the exchange (after one) [5]")
    parser.add_argument("--demo-models", default=None,
                        help="model presets whose DeMo step is timed on the device, or none [125m on a GPU, micro "
                             "on the CPU]")
    parser.add_argument("--demo-repeats", type=int, default=5, help="timed DeMo steps (after one) [5]")
    parser.add_argument("--quick", action="store_true", help="micro model, tiny shapes: a smoke run (CPU tests)")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/gpu]")
    args = parser.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    try:
        return benchmark(args)
    except AtollError as e:  # one line for bad input (a bug keeps its traceback)
        return script_error("gpu", e)


def benchmark(args: argparse.Namespace) -> int:
    from atoll.job.device import island_devices

    torch.manual_seed(0)
    device = island_devices(1, args.device)[0]
    out = args.out or default_out("gpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    data = {"data": args.data, **({"cache_dir": args.cache_dir} if args.cache_dir else {})}
    rows, skipped = [], []
    for m in [s.strip() for s in args.models.split(",") if s.strip()]:
        if not fits(m, args.islands, args.vocab, device):
            skipped.append(f"{m}: {args.islands} islands do not fit in the device's memory")
            continue
        rows.append(measure(m, args, device, data))
        print(json.dumps(rows[-1]), file=sys.stderr)
    copy_models = args.copy_models if args.copy_models is not None else ("1b" if device.type == "cuda" else "tiny")
    copies = []
    for m in [s.strip() for s in copy_models.split(",") if s.strip() and s.strip() != "none"]:
        copies.append(measure_copies(m, args.vocab, device, args.copy_repeats))
        print(json.dumps(copies[-1]), file=sys.stderr)
    gpus = args.concurrency if args.concurrency is not None else (
        torch.cuda.device_count() if device.type == "cuda" and torch.cuda.device_count() > 1 else 0)
    concurrency = []
    for m in [r["model"] for r in rows][:1] if gpus > 1 else []:  # the first size measured
        concurrency.append(measure_concurrency(m, args, gpus, data))
        print(json.dumps(concurrency[-1]), file=sys.stderr)
    exchange_models = (args.exchange_models if args.exchange_models is not None
                       else ("125m" if device.type == "cuda" else "tiny"))
    exchanges = []
    for m in [s.strip() for s in exchange_models.split(",") if s.strip() and s.strip() != "none"]:
        exchanges.append(measure_exchange(m, args.vocab, device, args.exchange_repeats, args.exchange_codec))
        print(json.dumps(exchanges[-1]), file=sys.stderr)
    demo_models = args.demo_models if args.demo_models is not None else ("125m" if device.type == "cuda"
                                                                          else "micro")
    demos = []
    for m in [s.strip() for s in demo_models.split(",") if s.strip() and s.strip() != "none"]:
        step_s = next((r["island_step_s"] for r in rows if r["model"] == m), None)
        demos.append(measure_demo(m, args.vocab, device, args.demo_repeats, args.islands, step_s))
        print(json.dumps(demos[-1]), file=sys.stderr)
    result = {"device": name, "device_count": torch.cuda.device_count(), "torch": torch.__version__,
              "precision": args.precision, "rows": rows, "skipped": skipped, "copies": copies,
              "concurrency": concurrency, "exchanges": exchanges, "demo": demos,
              "command": "python bench/gpu.py " + " ".join(sys.argv[1:])}
    pct = lambda v: "-" if v is None else f"{v:.1f}%"  # noqa: E731
    table = write_results(
        out, result,
        [("model", "model"), ("params", "params", lambda v: f"{v / 1e6:.1f}M"), ("batch x seq", "batch"),
         ("island tokens/s", "island_tokens_per_s", lambda v: f"{v:,.0f}"), ("MFU", "mfu_pct", pct),
         ("atoll vs plain loop", "overhead_pct", lambda v: f"{v:+.1f}%"),
         ("job tokens/s (K islands)", "job_tokens_per_s", lambda v: f"{v:,.0f}"),
         ("peak memory", "peak_memory_bytes", lambda v: f"{v / 2**30:.1f} GiB"),
         ("inner step (job)", "inner_step_s", lambda v: f"{v * 1e3:.1f} ms"),
         ("outer round", "outer_step_s", lambda v: f"{v * 1e3:.0f} ms"),
         ("outer / K x H inner steps", "outer_vs_inner_round_pct", pct),
         ("evaluation", "eval_s", lambda v: f"{v * 1e3:.0f} ms")],
        [{**r, "batch": f"{r['batch']} x {r['seq_len']}"} for r in rows],
        f"atoll on {name} ({args.precision}, {args.islands} islands on one device, H={args.sync_every})",
        [f"MFU: 6N + 12LdT model FLOPs per token over the device's dense bf16 peak; skipped: {skipped or 'none'}",
         f"command: {result['command']}"], bullets=False)
    if copies:
        ms = lambda v: "-" if v is None else f"{v * 1e3:.1f} ms"  # noqa: E731
        gbps = lambda v: "-" if v is None else f"{v:.1f} GB/s"  # noqa: E731
        times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        table += "\n" + markdown_table(
            [("model", "model"), ("params", "params", lambda v: f"{v / 1e6:.1f}M"),
             ("device to host, pageable", "d2h_pageable_s", ms), ("pinned", "d2h_pinned_s", ms),
             ("pinned speed-up", "d2h_pinned_speedup", times), ("pinned GB/s", "d2h_pinned_gbps", gbps),
             ("host to device, pageable", "h2d_pageable_s", ms), ("pinned", "h2d_pinned_s", ms),
             ("pinned speed-up", "h2d_pinned_speedup", times), ("pinned GB/s", "h2d_pinned_gbps", gbps)],
            copies, f"host copies of one exchange on {name}, pinned against pageable (median of "
            f"{args.copy_repeats})", ["device to host: the parameters gathered on the device, one copy into a "
                                      "preallocated host vector; host to device: one non-blocking copy per "
                                      "parameter from it; pinned needs an accelerator (-: the CPU)"],
            bullets=False)
    if exchanges:
        msec = lambda v: f"{v * 1e3:.1f} ms"  # noqa: E731
        table += "\n" + markdown_table(
            [("model", "model"), ("params", "params", lambda v: f"{v / 1e6:.1f}M"), ("codec", "codec"),
             ("payload", "payload_bytes", lambda v: f"{v / 2**20:.1f} MiB"), ("on the device", "device_s", msec),
             ("on the host (before)", "host_s", msec), ("host / device", "host_over_device", lambda v: f"{v:.2f}x"),
             ("result on", "result_device"), ("residual on", "residual_device"),
             ("random source on", "generator_device")],
            exchanges, f"the collective runtime's codec exchange on {name} against the host path (median of "
            f"{args.exchange_repeats})", ["one process, a group of one island: encode (stochastic rounding, error "
                                          "feedback), all-gather, decode and average; the host path copies the "
                                          "vector to the host first and runs the codec there"], bullets=False)
    if demos:
        table += "\n" + markdown_table(
            [("model", "model"), ("params", "params", lambda v: f"{v / 1e6:.1f}M"), ("islands", "islands"),
             ("payload per step", "payload_bytes", lambda v: f"{v / 2**20:.2f} MiB"),
             ("encode", "encode_s", lambda v: f"{v * 1e3:.1f} ms"), ("apply", "apply_s", lambda v: f"{v * 1e3:.1f} ms"),
             ("DeMo step", "step_s", lambda v: f"{v * 1e3:.1f} ms"),
             ("of an island's inner step", "share_of_inner_step_pct", pct)],
            demos, f"DeMo's work per inner step on {name} (median of {args.demo_repeats})",
            ["encode: momentum, tiled DCT, top-k per tile, what is sent removed; apply: the islands' payloads "
             "averaged per coefficient, inverse DCT, sign step (the all-gather apart); share: against the "
             "island's inner step of the same model above (-: not measured)"], bullets=False)
    if concurrency:
        table += "\n" + markdown_table(
            [("model", "model"), ("GPUs", "gpus"), ("one island, s/step", "one_island_step_s", lambda v: f"{v:.4f}"),
             ("one island per GPU, s/step", "islands_step_s", lambda v: f"{v:.4f}"),
             ("speed-up", "speedup", lambda v: f"{v:.2f}x")],
            concurrency, "local runtime: islands on several GPUs run concurrently",
            ["speed-up: GPUs x one island's seconds per inner step / one island per GPU's (GPUs: concurrent; "
             "1: one after another); the job's time less its evaluations"], bullets=False)
    if copies or exchanges or concurrency or demos:
        (out / "results.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

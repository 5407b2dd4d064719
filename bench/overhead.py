"""Framework overhead: atoll's inner step against a plain PyTorch AdamW loop on the same model and batch.

    python bench/overhead.py                    # tiny model, batch 8 x 128 tokens, 7 rounds of 20 steps each
    python bench/overhead.py --model micro --rounds 3 --steps 5 --out /tmp/overhead    # a smoke run

The atoll side is what the ``local`` runtime does for one island and one inner step
(:meth:`atoll.job.island.Island.forward_backward` then :meth:`~atoll.job.island.Island.inner_step`: the timed
forward and backward, the non-finite check and gradient clipping, AdamW with decay/no-decay groups, the
warmup-cosine schedule, ``zero_grad``). The plain side is the loop a PyTorch user writes: forward,
cross-entropy, backward, ``clip_grad_norm_``, ``AdamW.step``, ``zero_grad``. Both start from the same
weights, the same batch and the same learning-rate schedule (so their weights agree to round-off, which
the script checks). Rounds interleave (atoll, plain, plain, atoll, ...: which goes first alternates) so
machine load hits both alike; the first round of each is a warm-up and is discarded; each reports the
median seconds per step.

Measured on the earlier default benchmark setting, the TrainConfig defaults before the nano regime (tiny
model, 4096-token vocabulary, batch 8 of 128 tokens: the flags' defaults; warmup 50 in the learning-rate
schedule both sides share), now pinned (:data:`EARLIER_SETTING`) so the committed results reproduce; the
current default setting is measured by ``python bench/fidelity.py``.

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/overhead`` of the repository).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from atoll.benchmarks.common import default_out, study_settings, write_results
from atoll.config import TrainConfig, build_config
from atoll.config.facts import IslandSettings
from atoll.job.device import CompiledForward, autocast, synchronize
from atoll.job.island import adamw, build_island, cosine_with_warmup, inner_optimizer
from atoll.job.loss import next_token_loss
from atoll.job.model import build_model, count_parameters

#: The defaults before the nano regime (TrainConfig up to commit 568f3bb) that differ from today's, which the
#: committed results were measured on: bench/overhead.toml's [earlier] (why each, there).
EARLIER_SETTING: dict[str, Any] = study_settings(__file__, "earlier")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model preset [tiny]")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step [8]")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence [128]")
    parser.add_argument("--vocab-size", type=int, default=4096, help="vocabulary [4096]")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per side, the first discarded [7]")
    parser.add_argument("--steps", type=int, default=20, help="inner steps per round [20]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads [1]")
    parser.add_argument("--out", type=Path, default=default_out("overhead"),
                        help="output folder [bench/out/overhead]")
    return parser.parse_args(argv)


def pinned(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings over :data:`EARLIER_SETTING`: what the config is built from."""
    return {**EARLIER_SETTING, **settings}


def planned_runs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """The one config both loops are built from (its model, batch and schedule) as ``[("overhead", own
    settings)]``, its own settings from the flags ``args``; built with :func:`pinned`. Nothing is trained."""
    return [("overhead", {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                          "vocab_size": args.vocab_size, "steps": 10_000, "islands": 1})]


def compare_loops(config: TrainConfig, model: PreTrainedModel, device: torch.device, rounds: int, steps: int,
                  ) -> dict[str, Any]:
    """Seconds per step of atoll's inner step and of the plain PyTorch loop on the same model, batch, schedule
    and device, in interleaved rounds (the first discarded); both in ``config.precision``.

    The plain loop is what a PyTorch user writes: forward (under bf16 autocast for ``bf16``), cross-entropy,
    backward, ``clip_grad_norm_``, AdamW (fused on CUDA, as the island's), the same warmup-cosine schedule,
    ``zero_grad``. Device work is waited for at the end of each round.

    Returns:
        ``median_s`` and ``rounds_s`` ({"atoll", "plain"}: seconds per step), ``max_weight_diff`` (the largest
        absolute difference of the two models' weights after the same steps; round-off only).
    """
    island = build_island(0, copy.deepcopy(model).to(device), IslandSettings.of(config),
                          inner_optimizer(config.strategy_config))
    plain = copy.deepcopy(model).to(device)
    decay = [p for p in plain.parameters() if p.ndim >= 2]
    no_decay = [p for p in plain.parameters() if p.ndim < 2]
    own = config.strategy_config  # diloco's: the inner AdamW's settings
    opt = adamw([{"params": decay, "weight_decay": own.weight_decay},
                 {"params": no_decay, "weight_decay": 0.0}], own)
    # the same schedule as the island's, so both loops compute the same maths step for step
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, cosine_with_warmup(config.effective_warmup_steps, config.steps, config.min_lr_ratio))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=g)
    on_device = batch.to(device)

    def atoll_step() -> None:
        island.forward_backward(batch)
        island.inner_step()

    forward = CompiledForward(plain) if config.compile else plain  # compiled as the island's is

    def plain_step() -> None:
        with autocast(device, config.precision):
            loss = next_token_loss(forward, on_device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    per_step: dict[str, list[float]] = {"atoll": [], "plain": []}
    sides = (("atoll", atoll_step), ("plain", plain_step))
    for r in range(rounds):
        for name, fn in (sides if r % 2 == 0 else sides[::-1]):  # alternate which side goes first
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            synchronize(device)
            dt = (time.perf_counter() - t0) / steps
            if r > 0:  # round 0 warms up allocators and kernels
                per_step[name].append(dt)
    # both loops took the same steps on the same batch: their weights must agree (float round-off)
    max_weight_diff = max(float((a.detach() - b.detach()).abs().max())
                          for a, b in zip(island.model.parameters(), plain.parameters(), strict=True))
    return {"median_s": {k: statistics.median(v) for k, v in per_step.items()}, "rounds_s": per_step,
            "max_weight_diff": max_weight_diff}


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/overhead.py [--model M] [--rounds N] [--steps N] [--out DIR] ...``; the exit status."""
    args = parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        print("overhead: error: rounds: need --rounds >= 2 (the first is a warm-up) and --steps >= 1", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    (_, own), = planned_runs(args)
    config = build_config(base=pinned(own))
    model = build_model(config.model, config.vocab_size, config.seq_len, config.seed)
    cmp = compare_loops(config, model, torch.device("cpu"), args.rounds, args.steps)
    med, per_step, max_weight_diff = cmp["median_s"], cmp["rounds_s"], cmp["max_weight_diff"]
    result = {
        "model": args.model, "params": count_parameters(model), "batch_size": args.batch_size,
        "seq_len": args.seq_len, "threads": args.threads, "rounds_kept": args.rounds - 1, "steps_per_round": args.steps,
        "atoll_median_s_per_step": med["atoll"], "plain_median_s_per_step": med["plain"],
        "overhead_pct": 100 * (med["atoll"] - med["plain"]) / med["plain"],
        "max_weight_diff": max_weight_diff,
        "atoll_rounds_s_per_step": per_step["atoll"], "plain_rounds_s_per_step": per_step["plain"],
        "command": "python bench/overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
    }
    rows = [{"loop": "plain PyTorch (forward, backward, clip, AdamW, zero_grad)", "s": med["plain"], "vs": "0"},
            {"loop": "atoll Island (the local runtime's inner step)", "s": med["atoll"],
             "vs": result["overhead_pct"]}]
    table = write_results(
        args.out, result,
        [("loop", "loop"), ("median s/step", "s", lambda v: f"{v * 1e3:.2f} ms"),
         ("vs plain", "vs", lambda v: f"{v:+.1f}%")],
        rows, f"atoll inner step vs plain PyTorch AdamW ({args.model}, {result['params']:,} parameters, batch "
        f"{args.batch_size} x {args.seq_len}, {args.threads} thread)",
        [f"Median of {args.rounds - 1} interleaved rounds of {args.steps} steps each (first round discarded; "
         f"which side goes first alternates). Largest weight difference after both: {max_weight_diff:.1e}. "
         f"command: {result['command']}"], bullets=False)
    print(table)
    return 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

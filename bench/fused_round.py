"""diloco's outer round as atoll runs it (eager torch ops) against the same arithmetic compiled into one pass.

    OMP_NUM_THREADS=1 python bench/fused_round.py                     # 10M and 50M, writes bench/out/fused_round/
    python bench/fused_round.py --sizes 10 --repeats 2 --out /tmp/fr   # a quick look

Issue 36 asks for every outer round at one pass per parameter. bench/outer_round.py counts each round in memory
passes (its time over one ``copy_`` of a float32 vector of the model's size): eager torch ops, one kernel per
operation, read and write every vector once per operation, so a K = 2 diloco round takes about 13-24 passes. This
benchmark measures how far fusion goes: the round of ``DiLoCo.outer_step`` (local runtime, K = 2 islands, fp32
exchange, Llama-shaped parameters as bench/outer_round.py builds them) against one ``torch.compile``'d function
per parameter that computes the same arithmetic in one loop: each island's pseudo-gradient Δ_i = θ − θ_i, their
token-weighted mean, the finite check (a sum of each Δ_i), the outer Nesterov step (torch's SGD: m ← μm + Δ,
θ ← θ − lr (Δ + μm)) and every island set to θ. From the same state both give the next globals; the table says
how far apart they are (the compiled loop rounds in its own order, fused multiply-adds included), so a compiled
round would be a setting, measured, not a silent change of the numbers.

Writes ``results.json`` and ``results.md``: ns per parameter, passes, and the largest difference of the
globals, with the machine's load before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import outer_round  # noqa: E402  (bench/: the model and islands of the outer-round study)


def fused_round_fn():  # noqa: ANN201
    """The compiled round of one parameter: (θ, m, θ_1, θ_2, a_1, a_2, μ, lr) -> (Σ Δ_1, Σ Δ_2), writing θ, m,
    θ_1 and θ_2 in place; a_i = w_i / Σ w (0-d float32 tensors, so a new round's weights compile nothing)."""
    import torch

    def round_(g, m, p1, p2, a1, a2, mu, lr):  # noqa: ANN001, ANN202
        d1, d2 = g - p1, g - p2
        mean = d1 * a1 + d2 * a2
        new_m = m * mu + mean
        new_g = g - (mean + new_m * mu) * lr
        m.copy_(new_m)
        g.copy_(new_g)
        p1.copy_(new_g)
        p2.copy_(new_g)
        return d1.sum(), d2.sum()

    return torch.compile(round_, dynamic=True, fullgraph=True)


def measure(size: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from atoll.config import TrainConfig
    from atoll.runtime.local import LocalComm
    from atoll.runtime.network import Link, SimClock
    from atoll.strategies.diloco import DiLoCo

    hidden, layers, vocab = outer_round.SHAPES[size]
    model = outer_round.llama_like(hidden, layers, vocab, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    config = TrainConfig(strategy="diloco", islands=2, steps=100, warmup_steps=0, codec="fp32", sync_every=8,
                         model="tiny")
    islands = outer_round._islands(model, config, 2)
    del model
    comm = LocalComm(2, Link.from_config(100, 10), SimClock(2))
    strategy = outer_round._strategy(DiLoCo, config, islands, comm)
    outer = strategy.outer
    outer_round._nudge(islands)  # tokens trained since the last round: the islands' weights
    strategy.outer_step(8)  # the warm-up round: the momentum exists from here on
    momentum = outer.optimizer.state[outer.params]["momentum_buffer"]
    lr, mu = outer.optimizer.param_groups[0]["lr"], outer.optimizer.param_groups[0]["momentum"]
    fused = fused_round_fn()

    def state() -> list[torch.Tensor]:
        return [outer.params.detach().clone(), momentum.clone(), *[i.flat_params() for i in islands]]

    def restore(saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            outer.params.copy_(saved[0])
            momentum.copy_(saved[1])
        for island, flat in zip(islands, saved[2:], strict=True):
            island.set_flat_params(flat)

    def weights() -> tuple[torch.Tensor, torch.Tensor]:
        w = [float(x) for x in strategy.round_weights()]
        return torch.tensor(w[0] / sum(w)), torch.tensor(w[1] / sum(w))

    def compiled_round(a1: torch.Tensor, a2: torch.Tensor) -> None:
        g, m = outer.params.detach(), momentum
        views = [island.param_views() for island in islands]
        offset, sums = 0, []
        for v1, v2 in zip(*views, strict=True):
            n = v1.numel()
            sums.append(fused(g[offset:offset + n], m[offset:offset + n], v1, v2, a1, a2, mu, lr))
            offset += n
        if not all(bool(torch.isfinite(s1 + s2)) for s1, s2 in sums):
            raise RuntimeError("a pseudo-gradient is not finite")

    # the same state through both: the next globals' largest difference
    outer_round._nudge(islands)
    start, shares = state(), weights()
    strategy.outer_step(16)
    eager_globals = outer.params.detach().clone()
    restore(start)
    compiled_round(*shares)  # compiles here (its seconds are apart)
    diff = float((outer.params.detach() - eager_globals).abs().max())
    step = float((eager_globals - start[0]).abs().max())
    restore(start)
    t0 = time.perf_counter()
    compiled_round(*shares)
    first = time.perf_counter() - t0

    def best(round_) -> float:  # noqa: ANN001  (a warm-up round, then the least of ``repeats``, each after a nudge)
        return min(outer_round._timed_rounds(repeats, lambda r: outer_round._nudge(islands), round_))

    eager_s = best(lambda r: strategy.outer_step(24 + 8 * r))
    compiled_s = best(lambda r: compiled_round(*weights()))  # (the islands' tokens grow: nothing resets them)
    one_pass = outer_round.memory_pass(numel, repeats)
    return {"size_m": size, "params": numel, "eager_ns_per_param": eager_s / numel * 1e9,
            "compiled_ns_per_param": compiled_s / numel * 1e9, "pass_ns_per_param": one_pass / numel * 1e9,
            "eager_passes": eager_s / one_pass, "compiled_passes": compiled_s / one_pass,
            "second_compiled_round_s": first, "max_abs_diff_globals": diff, "max_abs_step": step,
            "equal": diff == 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,50", help="model sizes in millions: "
                        + ",".join(map(str, outer_round.SHAPES)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fused_round")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.repeats)))
        return 0
    import subprocess

    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for size in (int(s) for s in args.sizes.split(",")):
        before = outer_round.load()
        proc = subprocess.run([sys.executable, __file__, "--worker", str(size), "--repeats", str(args.repeats)],
                              env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append({**json.loads(proc.stdout.strip().splitlines()[-1]),
                     "load": f"{before:.2f} -> {outer_round.load():.2f}"})
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["OMP_NUM_THREADS=1 python bench/fused_round.py", *(argv or sys.argv[1:])])
    (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = ["# diloco's outer round (K = 2, fp32): eager torch ops against one compiled pass", "",
             f"Command: `{command}`; one torch thread; torch {__import__('torch').__version__}.", "",
             "| params | eager ns/param | eager passes | compiled ns/param | compiled passes | eager / compiled | "
             "globals' largest difference (largest step) | load 1 min |",
             "|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['params'] / 1e6:.1f}M | {r['eager_ns_per_param']:.2f} | {r['eager_passes']:.1f} | "
                     f"{r['compiled_ns_per_param']:.2f} | {r['compiled_passes']:.1f} | "
                     f"{r['eager_ns_per_param'] / r['compiled_ns_per_param']:.1f}x | "
                     f"{r['max_abs_diff_globals']:.2e} ({r['max_abs_step']:.2e}) | {r['load']} |")
    lines += ["", "A pass: one `copy_` of a float32 vector of the model's size on this core "
              f"({rows[-1]['pass_ns_per_param']:.2f} ns/element at {rows[-1]['params'] / 1e6:.1f}M)."]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The outer round: ``outer_kernel = "eager"`` (torch ops) against ``"compiled"`` (fused loops), per strategy.

    OMP_NUM_THREADS=1 python bench/fused_round.py       # fp32 and int4, 10M and 50M: bench/out/fused_round/
    python bench/fused_round.py --codecs int4 --sizes 10 --repeats 2 --out /tmp/fr   # a quick look

Issue 36 asks for every outer round at one pass per parameter. bench/outer_round.py counts each round in memory
passes (its time over one ``copy_`` of a float32 vector of the model's size): eager torch ops, one kernel per
operation, read and write every vector once per operation, so a K = 2 diloco round takes about 11 passes. The
setting ``outer_kernel = "compiled"`` (:mod:`atoll.algorithms.fused_round`) runs ``DiLoCo.outer_step`` as two
``torch.compile``'d loops per parameter: the finite check (Σ(θ − θ_i) per island: one read of θ and both θ_i),
then the round (each island's pseudo-gradient Δ_i = θ − θ_i, their token-weighted mean, the outer Nesterov step
of torch's SGD: m ← μm + Δ, θ ← θ − lr (Δ + μm), every island set to θ: one read and one write of θ, m and both
θ_i). Both strategies here are atoll's own, built as a run builds them (local runtime, K = 2 islands, fp32
exchange, Llama-shaped parameters as bench/outer_round.py builds them). From the same state both give the next
globals; the table says how far apart they are (the compiled loop rounds in its own order, fused multiply-adds
included). With ``--codecs int4`` (or int8) the exchange is quantized (nearest rounding, no error feedback, the
settings' defaults): eager, each island's pseudo-gradient encoded, packed, decoded and averaged
(bench/outer_round.py's ``diloco_int4``); compiled, one loop over the blocks for the quantized mean, then one for
the step.

``--strategies sparseloco``: the eager round against the compiled accumulation
(:mod:`atoll.algorithms.fused_accumulate`: Δ_i, e_i ← β e_i + α Δ_i, the finite check and the diagnostics' norms in
one loop; the reference's top-k per tile, the aggregation and the step as in the eager round), SparseLoCo's
defaults (tiles of 64 x 64 keeping 64, 2-bit values, median clip); the reference's kernels alone (the tiles copied
out, the top-k, sorted, the values gathered: bench/outer_round.py's ``sparseloco_kernels``) in a column of their
own, the floor neither variant goes under.

Writes ``results.json`` and ``results.md``: ns per parameter, passes (the finite check's apart), the compile's
seconds (the compiled strategy's construction less the eager one's: it compiles as it is built) and the
largest difference of the globals, with the machine's load before and after.
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


def _window(strategy, r: int) -> None:  # noqa: ANN001
    """One outer round: diloco's or sparseloco's, or a window of streaming's (every fragment started and merged,
    tau = 0)."""
    if strategy.name != "streaming":
        strategy.outer_step(32 + 8 * r)
        return
    for p in range(len(strategy.outers)):
        strategy._start(p, 32 + 8 * r + p, overlap=0)


def measure(size: int, repeats: int, codec: str, strategy_name: str = "diloco") -> dict:
    import torch

    torch.set_num_threads(1)
    from atoll.config import TrainConfig
    from atoll.runtime.local import LocalComm
    from atoll.runtime.network import Link, SimClock
    from atoll.strategies.diloco import DiLoCo
    from atoll.strategies.sparseloco import SparseLoCo
    from atoll.strategies.streaming import StreamingDiLoCo

    cls = {"diloco": DiLoCo, "streaming": StreamingDiLoCo, "sparseloco": SparseLoCo}[strategy_name]
    own: dict = {"codec": codec}
    if strategy_name == "streaming":
        own.update(fragments=outer_round.FRAGMENTS, overlap_steps=0, mixing_alpha=0.5)
    elif strategy_name == "sparseloco":  # it compresses its own way: no codec
        own = {}
    hidden, layers, vocab = outer_round.SHAPES[size]
    model = outer_round.llama_like(hidden, layers, vocab, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    islands = None
    runs, built_s = {}, {}
    for kernel in ("eager", "compiled"):  # two strategies, each with its outer optimizer, over the same islands
        config = TrainConfig(strategy=strategy_name, islands=2, steps=100, warmup_steps=0, sync_every=8,
                             model="tiny", outer_kernel=kernel, **own)
        if islands is None:
            islands = outer_round._islands(model, config, 2)
            del model
        comm = LocalComm(2, Link.from_config(100, 10), SimClock(2))
        t0 = time.perf_counter()
        runs[kernel] = outer_round._strategy(cls, config, islands, comm)
        built_s[kernel] = time.perf_counter() - t0
    eager, compiled = runs["eager"], runs["compiled"]
    compile_s = built_s["compiled"] - built_s["eager"]  # the compiled strategy compiles as it is built
    for strategy in (eager, compiled):  # the first round starts the outer momentum (eager either way)
        outer_round._nudge(islands)
        _window(strategy, 0)

    def globals_(strategy) -> torch.Tensor:  # noqa: ANN001
        return torch.cat([o.params.detach() for o in strategy.outers])

    def state(strategy) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
        return ([o.state_dict() for o in strategy.outers], [i.flat_params() for i in islands],
                [e.clone() for e in getattr(strategy, "error", [])])  # (sparseloco's accumulators)

    def restore(strategy, saved: tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]) -> None:  # noqa: ANN001
        for outer, st in zip(strategy.outers, saved[0], strict=True):
            outer.load_state_dict(st)
        for island, flat in zip(islands, saved[1], strict=True):
            island.set_flat_params(flat)
        for error, saved_error in zip(getattr(strategy, "error", []), saved[2], strict=True):
            error.copy_(saved_error)

    # the same state through both: the next globals' largest difference
    outer_round._nudge(islands)
    start = state(eager)
    before = globals_(eager)
    _window(eager, 1)
    eager_globals = globals_(eager)
    restore(compiled, start)
    rounds_before = compiled.compiled_rounds
    _window(compiled, 1)
    assert compiled.compiled_rounds == rounds_before + len(compiled.outers), "the compiled round did not run"
    diff = float((globals_(compiled) - eager_globals).abs().max())
    step = float((eager_globals - before).abs().max())

    def best(round_) -> float:  # noqa: ANN001  (a warm-up round, then the least of ``repeats``, each after a nudge)
        return min(outer_round._timed_rounds(repeats, lambda r: outer_round._nudge(islands), round_))

    eager_s = best(lambda r: _window(eager, 2 + r))
    compiled_s = best(lambda r: _window(compiled, 2 + r))
    assert compiled.fused is not None
    views = [island.contiguous_params() for island in islands]
    # diloco's separate finite check runs for fp32 (and with error feedback), streaming's with error feedback only;
    # else the mean's loop checks (its sums of the pseudo-gradients, or of a codec's block scales)
    # (sparseloco: its one loop's sums)
    separate = (compiled.fused.separate_check if strategy_name == "diloco"
                else strategy_name == "streaming" and compiled.fused.error_feedback)
    check_s = None if not separate else best(
        lambda r: [compiled.fused.finite_deltas(o.params.detach(), views, layout)
                   for o, layout in zip(compiled.outers, getattr(compiled, "layouts", [None]), strict=True)])
    kernels_s = outer_round.sparseloco_kernels(compiled, repeats) if strategy_name == "sparseloco" else None
    one_pass = outer_round.memory_pass(numel, repeats)
    return {"strategy": strategy_name, "codec": codec, "size_m": size, "params": numel,
            "eager_ns_per_param": eager_s / numel * 1e9,
            "compiled_ns_per_param": compiled_s / numel * 1e9, "pass_ns_per_param": one_pass / numel * 1e9,
            "eager_passes": eager_s / one_pass, "compiled_passes": compiled_s / one_pass,
            "finite_check_passes": None if check_s is None else check_s / one_pass, "compile_s": compile_s,
            "reference_kernel_passes": None if kernels_s is None else kernels_s / one_pass,
            "compiled_rounds": compiled.compiled_rounds, "max_abs_diff_globals": diff, "max_abs_step": step,
            "equal": diff == 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,50", help="model sizes in millions: "
                        + ",".join(map(str, outer_round.SHAPES)))
    parser.add_argument("--codecs", default="fp32,int4", help="the exchange's codecs: fp32, int8, int4")
    parser.add_argument("--strategies", default="diloco,streaming,sparseloco",
                        help="diloco, streaming (P = 4, tau = 0), sparseloco (its own compression: --codecs not read)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fused_round")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args.repeats, args.codecs, args.strategies)))
        return 0
    import subprocess

    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [(n, c if n != "sparseloco" else "sparse 2-bit", int(s)) for n in args.strategies.split(",")
            for c in (args.codecs.split(",") if n != "sparseloco" else ["-"]) for s in args.sizes.split(",")]
    for name, codec, size in runs:
        before = outer_round.load()
        proc = subprocess.run([sys.executable, __file__, "--worker", str(size), "--repeats", str(args.repeats),
                               "--codecs", codec, "--strategies", name], env=env, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append({**json.loads(proc.stdout.strip().splitlines()[-1]),
                     "load": f"{before:.2f} -> {outer_round.load():.2f}"})
    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["OMP_NUM_THREADS=1 python bench/fused_round.py", *(argv or sys.argv[1:])])
    (args.out / "results.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    lines = ["# The outer round (K = 2; streaming: a window of P = 4 fragments, tau = 0): outer_kernel eager against "
             "compiled", "",
             f"Command: `{command}`; one torch thread; torch {__import__('torch').__version__}.", "",
             "| strategy | codec | params | eager ns/param | eager passes | compiled ns/param | "
             "compiled passes (its finite check's) | eager / compiled | of which the reference's kernels (passes) | "
             "globals' largest difference (largest step) | compile s | load 1 min |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['codec']} | {r['params'] / 1e6:.1f}M | {r['eager_ns_per_param']:.2f} | "
                     f"{r['eager_passes']:.1f} | "
                     f"{r['compiled_ns_per_param']:.2f} | {r['compiled_passes']:.1f} "
                     + (("(in its accumulation's loop)" if r["strategy"] == "sparseloco" else "(in its mean's loop)")
                        if r["finite_check_passes"] is None
                        else f"({r['finite_check_passes']:.1f})") + " | "
                     f"{r['eager_ns_per_param'] / r['compiled_ns_per_param']:.1f}x | "
                     + ("-" if r.get("reference_kernel_passes") is None else f"{r['reference_kernel_passes']:.1f}")
                     + " | "
                     f"{r['max_abs_diff_globals']:.2e} ({r['max_abs_step']:.2e}) | {r['compile_s']:.1f} | "
                     f"{r['load']} |")
    lines += ["", "A pass: one `copy_` of a float32 vector of the model's size on this core "
              f"({rows[-1]['pass_ns_per_param']:.2f} ns/element at {rows[-1]['params'] / 1e6:.1f}M)."]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

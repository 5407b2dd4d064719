"""The outer round's CPU cost per parameter, before (the code at d2f719d) and after, in the same run.

    OMP_NUM_THREADS=1 python bench/outer_round.py                  # 1M .. 200M, writes bench/out/outer_round/
    python bench/outer_round.py --sizes 1,10 --repeats 2 --out /tmp/or   # a quick look

What is timed, one torch thread, on Llama-shaped parameters (embedding tied to the head, L layers of attention
and SwiGLU MLP, RMSNorm vectors; names as Hugging Face's, so fragments are cut as in a real run), K = 2 islands:

- ``diloco_local``: ``DiLoCo.outer_step`` in the local runtime (both islands in one process): every island's
  pseudo-gradient, the finite checks, the token-weighted mean, the outer Nesterov step, every island set;
- ``diloco_collective``: the same on one rank of the collective runtime (``DistComm`` over a one-process gloo
  group: every host-side copy, pack and division a rank does, without the network's time);
- ``streaming``: one window of Streaming DiLoCo (P = 4 fragments, each started and merged, tau = 0, alpha 0.5);
- ``decoupled``: one window of Decoupled DiLoCo (P = 4): per fragment every island pushes, the syncer validates,
  buffers and merges at the quorum, every island adopts the answer; pushes and pulls as the simulated runtime
  makes them (each push's Δ handed over without a copy, each pull with the version the island holds).

Each row also gives the round in *passes*: its time over one ``copy_`` of a float32 vector of the model's size
(one read and one write, the memory's rate on this core); and for ``demo`` and ``sparseloco``, the time of the
kernels their reference code runs, alone on the same tensors (DeMo: the tiled DCT-II, the top-k per tile and
two inverse DCTs per island; SparseLoCo: the tiles copied out, the top-k per tile, sorted, and the kept values
gathered), so that the rest of the round reads as the round over its kernels.

Exchanges travel fp32 (the codecs' own cost is the same code before and after, bench/codec_speed.py has it).
Each (case, size, variant) runs in its own process (PYTHONPATH = that variant's code; BEFORE is ``git archive``
of d2f719d's ``atoll/``), interleaved before/after so both see the same machine; a warm-up round, then the
best of ``--repeats`` rounds (one fewer from 100M; the median is in the JSON too), in ns per parameter, with
the 1-minute load average before and after (the machine is shared: the best round is the one least slowed). A
micro-benchmark of the finite checks (``isfinite(t).all()`` against ``isfinite(t.sum())``) runs beside them.

Writes ``results.json`` (every measurement) and ``results.md`` (the table, and the projection of
:func:`atoll.analysis.projection.exchange_table` against a GPU's inner step at 1B and 12B).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE_COMMIT = "d2f719d"
CASES = ("diloco_local", "diloco_collective", "streaming", "decoupled", "diloco_int4", "streaming_int4",
         "sparseloco", "demo", "syncer_commit")
#: (hidden, layers, vocab) of each size, about the parameters named (millions)
SHAPES = {1: (128, 4, 2048), 10: (256, 12, 8192), 50: (512, 16, 16384), 100: (768, 12, 32000),
          200: (1024, 12, 50304)}
ISLANDS, FRAGMENTS = 2, 4


def load() -> float:
    return os.getloadavg()[0]


def uptime() -> str:
    """``uptime``'s line (the machine's load over 1, 5 and 15 minutes), recorded before and after a run."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------------------------------------------------
# the worker: one case at one size with the code on sys.path (before or after)

def llama_like(hidden: int, layers: int, vocab: int, seed: int):
    """A module whose parameters have a Hugging Face Llama's names and shapes (tied head), random values."""
    import torch
    from torch import nn

    def param(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape).normal_(0, 0.02, generator=gen))

    gen = torch.Generator().manual_seed(seed)
    inner = 8 * hidden // 3
    root, model = nn.Module(), nn.Module()
    model.embed_tokens = nn.Module()
    model.embed_tokens.weight = param(vocab, hidden)
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, nn.Module())
            getattr(attn, name).weight = param(hidden, hidden)
        for name, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden)),
                            ("down_proj", (hidden, inner))):
            setattr(mlp, name, nn.Module())
            getattr(mlp, name).weight = param(*shape)
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm, layer.post_attention_layernorm = nn.Module(), nn.Module()
        layer.input_layernorm.weight = param(hidden)
        layer.post_attention_layernorm.weight = param(hidden)
        model.layers.append(layer)
    model.norm = nn.Module()
    model.norm.weight = param(hidden)
    root.model = model
    return root


def _islands(model, config, k: int, make_opt=None):
    """K islands around copies of ``model``, each moved a little away from it, with tokens trained."""
    import torch

    from atoll.job.island import Island

    islands = []
    for i in range(k):
        replica = copy.deepcopy(model) if i < k - 1 else model
        with torch.no_grad():
            for p in replica.parameters():
                p.add_(1e-3 * (i + 1))
        opt = torch.optim.SGD(replica.parameters(), lr=0.0) if make_opt is None else make_opt(replica)
        island = Island(i, replica, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        island.tokens = 1000 * (i + 1)
        islands.append(island)
    return islands


def _nudge(islands) -> None:
    """Move every island's parameters a little, by random normal amounts (std 1e-4, a seeded source), so each
    round has a pseudo-gradient whose values vary as training's do: a selection's time depends on them (SparseLoCo's
    per-tile top-k runs several times faster on one value everywhere, the constant this added before)."""
    import torch

    gen = _nudge.__dict__.setdefault("gen", torch.Generator().manual_seed(0))
    with torch.no_grad():
        for island in islands:
            for p in island.params:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype).mul_(1e-4))
            island.tokens += 1000


def _strategy(cls, config, islands, comm):
    """``cls`` built as the code on the path builds a strategy: from its own config and the seed (since the config
    tree, ea756f9), or from the run's whole config (the code before it, as ``BEFORE_COMMIT``)."""
    own = getattr(config, "strategy_config", None)  # pydantic raises AttributeError for a field it lacks
    return cls(config, islands, comm) if own is None else cls(own, islands, comm, config.seed)


def _timed_rounds(repeats: int, prepare, round_) -> list[float]:  # noqa: ANN001
    """Seconds of ``repeats`` calls of ``round_(r)`` (r = 1..repeats) after a warm-up call (r = 0: buffers and the
    outer momentum allocated), each after ``prepare(r)`` (untimed)."""
    times = []
    for r in range(repeats + 1):
        prepare(r)
        t0 = time.perf_counter()
        round_(r)
        if r:
            times.append(time.perf_counter() - t0)
    return times


def _seconds(repeats: int, fn) -> list[float]:  # noqa: ANN001
    """Seconds of each of ``repeats`` calls of ``fn()``, after a warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return runs


def _best(repeats: int, fn) -> float:  # noqa: ANN001
    """The least seconds of ``repeats`` calls of ``fn()`` after a warm-up call."""
    return min(_seconds(repeats, fn))


def memory_pass(numel: int, repeats: int) -> float:
    """Seconds of one pass over a float32 vector of ``numel`` elements: ``dst.copy_(src)`` (one read, one write),
    the unit a round's cost is counted in (``passes``)."""
    import torch

    src, dst = torch.randn(numel), torch.empty(numel)
    return _best(repeats, lambda: dst.copy_(src))


def demo_kernels(islands, repeats: int) -> float:  # noqa: ANN001
    """Seconds of the kernels DeMo's reference step runs per island and parameter, alone, on the islands' own
    momenta: the tiled DCT-II of the momentum, the top-k of its magnitudes per tile, and two inverse DCTs (what is
    sent, removed from the momentum; the islands' mean, applied): bloc97/DeMo's ``transform.encode``, ``topk``
    and two ``transform.decode``, into the buffers the optimizer keeps (no allocation counted as a kernel's).
    Everything else of the round is counted against this floor."""
    import torch

    opt = islands[0].optimizer
    kept = hasattr(opt, "_buffers")  # the code before 2026-12-07 allocated them
    work = [(opt.transform_for(p.shape), island.optimizer.state[p]["momentum"],
             island.optimizer._buffers(p) if kept else None) for island in islands for p in island.params]

    def kernels() -> None:
        for t, m, buffers in work:
            coeffs = t.encode(m, buffers) if kept else t.encode(m)
            magnitudes = coeffs.abs() if buffers is None else torch.abs(coeffs, out=buffers[0][:coeffs.numel()]
                                                                        .view_as(coeffs))
            torch.topk(magnitudes, min(opt.topk, t.chunk_elems), dim=1, sorted=False)
            for _ in range(2):
                t.decode(coeffs, buffers) if kept else t.decode(coeffs)

    return _best(repeats, kernels)


def sparseloco_kernels(strategy, repeats: int) -> float:  # noqa: ANN001
    """Seconds of the selection SparseLoCo's reference runs per island, alone, on the islands' own accumulators:
    every tile copied out of the flat vector, the top-k of its magnitudes, sorted, and the kept values gathered
    (``SparseCompressor._select``). Everything else of the round is counted against this floor."""
    return _best(repeats, lambda: [strategy.compressor._select(e) for e in strategy.error])


def worker(case: str, size: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from atoll.config import TrainConfig
    from atoll.runtime.local import LocalComm
    from atoll.runtime.network import Link, SimClock

    hidden, layers, vocab = SHAPES[size]
    model = llama_like(hidden, layers, vocab, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    common = dict(islands=ISLANDS, steps=100, warmup_steps=0, codec="fp32", sync_every=8, model="tiny")
    times: list[float] = []
    kernels: float | None = None  # the method's own kernels alone (demo, sparseloco), seconds

    if case in ("diloco_local", "diloco_collective"):
        from atoll.strategies.diloco import DiLoCo

        config = TrainConfig(strategy="diloco", **common)
        if case == "diloco_local":
            islands = _islands(model, config, ISLANDS)
            comm = LocalComm(ISLANDS, Link.from_config(100, 10), SimClock(ISLANDS))
        else:
            import torch.distributed as dist

            from atoll.runtime.collective.comm import DistComm

            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            islands = _islands(model, config, 1)
            comm = DistComm(1, 0, 1, 0, dist.group.WORLD, None, torch.device("cpu"))
        del model
        strategy = _strategy(DiLoCo, config, islands, comm)
        times = _timed_rounds(repeats, lambda r: _nudge(islands), lambda r: strategy.outer_step(8 * (r + 1)))
    elif case in ("diloco_int4", "sparseloco"):
        if case == "diloco_int4":
            from atoll.strategies.diloco import DiLoCo as cls

            config = TrainConfig(strategy="diloco", **{**common, "codec": "int4"})
        else:  # sparseloco compresses its own way: no codec
            from atoll.strategies.sparseloco import SparseLoCo as cls

            config = TrainConfig(strategy="sparseloco", **{k: v for k, v in common.items() if k != "codec"})
        islands = _islands(model, config, ISLANDS)
        del model
        comm = LocalComm(ISLANDS, Link.from_config(100, 10), SimClock(ISLANDS))
        strategy = _strategy(cls, config, islands, comm)
        times = _timed_rounds(repeats, lambda r: _nudge(islands), lambda r: strategy.outer_step(8 * (r + 1)))
        if case == "sparseloco" and hasattr(strategy.compressor, "_select"):
            kernels = sparseloco_kernels(strategy, repeats)
    elif case == "demo":
        from atoll.strategies.demo import DeMoStrategy, make_optimizer

        config = TrainConfig(strategy="demo", **{k: v for k, v in common.items() if k not in ("sync_every", "codec")})
        own = config.strategy_config
        islands = _islands(model, config, ISLANDS, lambda m: make_optimizer([{"params": list(m.parameters())}], own))
        del model
        comm = LocalComm(ISLANDS, Link.from_config(100, 10), SimClock(ISLANDS))
        strategy = _strategy(DeMoStrategy, config, islands, comm)
        gen = torch.Generator().manual_seed(1)

        def gradients(r: int) -> None:  # a gradient per parameter and a finite loss, as after a backward pass
            for island in islands:
                island.last_loss = 1.0
                for p in island.params:
                    p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=gen)

        # one step: every island encodes, the payloads are all-gathered, every island applies
        times = _timed_rounds(repeats, gradients, strategy.step)
        kernels = demo_kernels(islands, repeats)
    elif case in ("streaming", "streaming_int4"):
        from atoll.strategies.streaming import StreamingDiLoCo

        config = TrainConfig(strategy="streaming", fragments=FRAGMENTS, overlap_steps=0, mixing_alpha=0.5,
                             **{**common, "codec": "int4" if case == "streaming_int4" else "fp32"})
        islands = _islands(model, config, ISLANDS)
        del model
        comm = LocalComm(ISLANDS, Link.from_config(100, 10), SimClock(ISLANDS))
        strategy = _strategy(StreamingDiLoCo, config, islands, comm)
        def window(r: int) -> None:  # one window: every fragment started and merged (tau = 0)
            for p in range(FRAGMENTS):
                strategy._start(p, 8 * r + p, overlap=0)

        times = _timed_rounds(repeats, lambda r: _nudge(islands), window)
    elif case in ("decoupled", "syncer_commit"):
        from atoll.runtime.decoupled_job import job_of, syncer_of
        from atoll.strategies.decoupled.island import IslandWorker

        config = TrainConfig(strategy="decoupled", fragments=FRAGMENTS, **common)
        job = job_of(config, None, model)  # type: ignore[arg-type]
        workers = [IslandWorker(i, job, 100, "cpu") for i in range(ISLANDS)]
        job.model = None  # the workers hold their copies
        del model
        syncer = syncer_of(config, job.init_flat, job.index)
        for w in workers:
            syncer.grant(w.index, 10 ** 12)
        # as the runtimes hand them over (atoll.runtime.events): each push's Δ is the syncer's own (no copy, where
        # the code measured takes ``owned``), and an island pulls with the version it holds (the pull codec's
        # payloads since then, not the whole fragment)
        owned = {"owned": True} if "owned" in inspect.signature(syncer.push).parameters else {}
        for r in range(repeats + 1):
            _nudge([w.island for w in workers])
            for w in workers:
                w.tokens_since = [1000] * FRAGMENTS
            t0, snapshots = time.perf_counter(), 0.0
            for p in range(FRAGMENTS):  # one window: every island pushes fragment p, the quorum merges, all adopt
                for w in workers:
                    result = syncer.push(w.push(p), now=float(r), **owned)
                    assert result.accepted, result.reason
                if case == "syncer_commit":  # the service checkpoints at every commit: its snapshot of the state,
                    # lent to the writer and given back once written (here at once: a writer that keeps up)
                    t1 = time.perf_counter()
                    if hasattr(syncer, "release"):
                        syncer.release(syncer.state_dict(lend=True))
                    else:  # the code before lent snapshots
                        syncer.state_dict()
                    snapshots += time.perf_counter() - t1
                for w in workers:
                    w.adopt(syncer.pull(p, w.base_version[p]))
            if r:
                times.append(snapshots if case == "syncer_commit" else time.perf_counter() - t0)
        assert syncer.commits == (repeats + 1) * FRAGMENTS
    else:
        raise ValueError(f"case: {case!r} is not one of {CASES}")
    import resource

    one_pass = memory_pass(numel, repeats)
    return {"case": case, "size_m": size, "params": numel, "times_s": times,
            "ns_per_param": min(times) / numel * 1e9, "ns_per_param_median": statistics.median(times) / numel * 1e9,
            "pass_ns_per_param": one_pass / numel * 1e9, "passes": min(times) / one_pass,
            "kernels_ns_per_param": None if kernels is None else kernels / numel * 1e9,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def finite_checks(size: int, repeats: int) -> dict:
    """ns per element of the exact and the one-pass finite check of a float32 vector of ``size`` M elements."""
    import torch

    torch.set_num_threads(1)
    t = torch.randn(size * 10 ** 6)
    out = {}
    for name, fn in (("isfinite_all", lambda: bool(torch.isfinite(t).all())),
                     ("isfinite_sum", lambda: bool(torch.isfinite(t.sum())))):
        out[name] = statistics.median(_seconds(repeats, fn)) / t.numel() * 1e9
    return out


# ---------------------------------------------------------------------------------------------------------
# the driver

def before_tree(folder: Path, commit: str = BEFORE_COMMIT) -> Path:
    """``atoll/`` of ``commit``, extracted under ``folder`` (``git archive``; the repository is untouched)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "atoll"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measure(code: Path, case: str, size: int, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    load_before = load()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", case, "--size", str(size),
                           "--repeats", str(repeats)], env=env, capture_output=True, text=True, cwd=str(code))
    if proc.returncode != 0:
        raise RuntimeError(f"{case} at {size}M with {code} failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.update(load_before=load_before, load_after=load())
    return row


def table(rows: list[dict]) -> str:
    lines = ["| case | params | before ns/param | after ns/param | after / before | after in passes | after's "
             "kernels ns/param | after / its kernels | load 1 min (before: start, end / after: start, end) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    by = {(r["case"], r["size_m"], r["variant"]): r for r in rows}
    for case in CASES:
        for size in sorted({r["size_m"] for r in rows}):
            b, a = by.get((case, size, "before")), by.get((case, size, "after"))
            if b is None or a is None:
                continue
            passes = f"{a['passes']:.1f}" if "passes" in a else "-"
            floor = a.get("kernels_ns_per_param")
            kernels = f"{floor:.1f} | {a['ns_per_param'] / floor:.2f}" if floor else "- | -"
            lines.append(f"| {case} | {a['params'] / 1e6:.1f}M | {b['ns_per_param']:.1f} | {a['ns_per_param']:.1f} | "
                         f"{a['ns_per_param'] / b['ns_per_param']:.2f} | {passes} | {kernels} | "
                         f"{b['load_before']:.2f}, {b['load_after']:.2f} / "
                         f"{a['load_before']:.2f}, {a['load_after']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,10,50,100,200",
                        help="model sizes in millions: " + ",".join(map(str, SHAPES)))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per measurement (after a warm-up)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "outer_round")
    parser.add_argument("--rebuild", nargs="+", type=Path, metavar="ROWS_JSON",
                        help="write results.json/.md from the rows of interrupted runs (rows.partial.json files)")
    parser.add_argument("--command", default=None, help="with --rebuild: the command(s) that measured the rows")
    parser.add_argument("--before", default=BEFORE_COMMIT,
                        help=f"the commit measured as before [{BEFORE_COMMIT}: the round before issue 25; the cases "
                        "after decoupled need a commit from issue 36 on]")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.size, args.repeats)))
        return 0
    if args.rebuild:
        rows = [r for path in args.rebuild for r in json.loads(path.read_text())]
        args.out.mkdir(parents=True, exist_ok=True)
        write_results(rows, args.out, args.command or "(rebuilt)", finite_checks(50, args.repeats))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = args.cases.split(",")
    bad = [s for s in sizes if s not in SHAPES] + [c for c in cases if c not in CASES]
    if bad:
        print(f"outer_round: {bad[0]!r} is not a size ({list(SHAPES)}) or case ({list(CASES)})", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    before_run = uptime()
    with tempfile.TemporaryDirectory(prefix="atoll-before-") as tmp:
        variants = {"before": before_tree(Path(tmp), args.before), "after": ROOT}
        for size in sizes:
            for case in cases:
                order = ("before", "after") if len(rows) % 4 == 0 else ("after", "before")  # alternate who goes first
                for variant in order:
                    repeats = args.repeats if size < 100 else max(1, args.repeats - 1)
                    row = {**measure(variants[variant], case, size, repeats), "variant": variant}
                    rows.append(row)
                    (args.out / "rows.partial.json").write_text(json.dumps(rows, indent=1))  # survives an interruption
                    print(f"{case:18s} {size:4d}M {variant:6s} {row['ns_per_param']:7.1f} ns/param  "
                          f"load {row['load_before']:.2f}->{row['load_after']:.2f}  rss {row['peak_rss_gb']:.1f} GB",
                          flush=True)
    write_results(rows, args.out, "OMP_NUM_THREADS=1 python bench/outer_round.py " + " ".join(argv or sys.argv[1:]),
                  finite_checks(50, args.repeats), (before_run, uptime()), args.before)
    return 0


def write_results(rows: list[dict], out: Path, command: str, checks: dict,
                  uptimes: tuple[str, str] | None = None, before: str = BEFORE_COMMIT) -> None:
    """``results.json`` and ``results.md`` of ``rows`` (the projection at the largest size measured)."""
    sizes = sorted({r["size_m"] for r in rows})
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    from atoll.analysis.projection import exchange_table, format_exchange_table

    by = {(r["case"], r["size_m"], r["variant"]): r["ns_per_param"] for r in rows}
    both = [(c, m) for c in cases for m in sizes if (c, m, "before") in by and (c, m, "after") in by]
    largest = max(m for _, m in both)  # the projection takes each case at the largest size measured both ways
    measured = {c: {v: by[(c, largest, v)] for v in ("before", "after")} for c, m in both if m == largest}
    projection = exchange_table(measured)
    result = {"command": command,
              "before_commit": before, "islands": ISLANDS, "fragments": FRAGMENTS, "torch_threads": 1,
              "cpu_count": os.cpu_count(), "rows": rows, "finite_checks_ns_per_element_50m": checks,
              "projection_size_m": largest, "projection": projection,
              **({"uptime_before": uptimes[0], "uptime_after": uptimes[1]} if uptimes else {})}
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "rows.partial.json").unlink(missing_ok=True)
    md = [f"# Outer round, ns per parameter (one torch thread, K = {ISLANDS}, P = {FRAGMENTS}, fp32 exchanges)", "",
          f"Command: `{result['command']}`; before = `{before}`, after = this commit, in the same run.",
          f"Load is the 1-minute load average of this {os.cpu_count()}-core machine before and after each process.",
          *([f"`uptime` before the run: `{uptimes[0]}`; after: `{uptimes[1]}`."] if uptimes else []), "",
          table(rows), "",
          f"Finite checks at 50M float32 elements: `isfinite(t).all()` {checks['isfinite_all']:.2f} ns/element, "
          f"`isfinite(t.sum())` {checks['isfinite_sum']:.2f}.", "",
          f"## Projection against a GPU's inner step (ns/param measured at {largest}M)", "",
          format_exchange_table(projection),
          *(["", "demo: its round is every inner step (H = 1), so its least H x tokens is the tokens per step. Its "
                 "momentum and transforms live where the parameters do (a GPU's memory in a GPU run), so this "
                 "projection of host work is of islands on the CPU; an accelerator runs them itself."]
            if "demo" in measured else [])]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    raise SystemExit(main())

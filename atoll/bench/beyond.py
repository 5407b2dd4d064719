"""SparseLoCo against DiLoCo by number of outer rounds, and Muon islands against AdamW islands (issue: beyond).

    python bench/beyond.py            # about 10 minutes on 2 idle CPU cores

The micro Llama (37K parameters, 512-token BPE, 8 x 32 tokens per island per step), 4 islands, on the
stdlib corpus; one torch thread per run. Four studies:

1. SparseLoCo (arXiv:2508.15706; chunk-wise top-k of an error-feedback accumulator, 2-bit values) against
   DiLoCo fp32 at H = 10, 30 outer rounds (300 steps) and 120 (1,200 steps), at the default 64 of 4096 and
   at 256 of 4096 (on micro's small tensors a 4096 chunk holds a whole 1,024-element matrix, so the true
   density is higher than k/chunk: see the density column), and the lossless identity (density 1, 32
   bits, beta 0: FedAvg). A sparse round moves about the density's share of the coordinates.
2. SparseLoCo at 1,200 steps in 1,024-element chunks (one per hidden matrix, so k/chunk is the density)
   against DiLoCo fp32 at H = 40 (30 rounds): within the issue's byte budget (at least 30x fewer bytes than
   that DiLoCo: H = 30 at 1.6%, H = 60 at 3.1%, H = 15 at 0.8%) and beyond it (H = 5 and H = 1: the most
   rounds SparseLoCo can have), to tell rounds from the method.
3. MuLoCo (Muon inner steps, arXiv:2505.23725) against AdamW islands under diloco at fp32 and int4, 300 steps.
4. The agreement-weighted outer step (``--outer-adapt agreement``, :mod:`atoll.algorithms.agreement`) against
   the fixed outer step: H = 40 at 1,200 steps (two seeds, and int4) and H = 10 at 300 steps.

Writes bench/out/beyond/results.json and results.md (``--out``: elsewhere); a finished run is reused
(:func:`atoll.bench.common.train_once`), ``--fresh`` reruns all.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from atoll.bench.common import default_out, pct, script_error, train_once, write_results
from atoll.errors import AtollError

BASE: dict[str, Any] = {"model": "micro", "vocab_size": 512, "seq_len": 32, "batch_size": 8, "islands": 4,
                        "sync_every": 10, "warmup_steps": 30, "eval_every": 100}

#: (name, reference run it is compared with, settings)
RUNS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("diloco_300", "diloco_300", {"strategy": "diloco", "steps": 300}),
    ("sparseloco_300", "diloco_300", {"strategy": "sparseloco", "steps": 300}),
    ("sparseloco_k256_300", "diloco_300", {"strategy": "sparseloco", "steps": 300, "sparseloco_topk": 256}),
    ("sparseloco_dense_300", "diloco_300", {"strategy": "sparseloco", "steps": 300, "sparseloco_topk": 4096,
                                            "sparseloco_bits": 32, "sparseloco_beta": 0.0}),
    ("diloco_1200", "diloco_1200", {"strategy": "diloco", "steps": 1200}),
    ("sparseloco_1200", "diloco_1200", {"strategy": "sparseloco", "steps": 1200}),
    ("sparseloco_k256_1200", "diloco_1200", {"strategy": "sparseloco", "steps": 1200, "sparseloco_topk": 256}),
    ("muon_300", "diloco_300", {"strategy": "diloco", "steps": 300, "inner_optimizer": "muon"}),
    ("diloco_int4_300", "diloco_300", {"strategy": "diloco", "steps": 300, "codec": "int4"}),
    ("muon_int4_300", "diloco_int4_300", {"strategy": "diloco", "steps": 300, "codec": "int4",
                                          "inner_optimizer": "muon"}),
    # 2. at a byte budget: k of 1024-element chunks, against diloco H=40 (30 rounds)
    ("diloco_h40", "diloco_h40", {"strategy": "diloco", "steps": 1200, "sync_every": 40}),
    *[(f"sparseloco_c1024_k{k}_h{h}", "diloco_h40", {"strategy": "sparseloco", "steps": 1200, "sync_every": h,
                                                  "sparseloco_chunk": 1024, "sparseloco_topk": k})
      for k, h in ((8, 15), (16, 30), (32, 60), (16, 5), (32, 1))],
    # 4. the agreement-weighted outer step against the fixed one
    ("agreement_h40", "diloco_h40", {"strategy": "diloco", "steps": 1200, "sync_every": 40,
                                     "outer_adapt": "agreement"}),
    ("diloco_h40_seed1", "diloco_h40_seed1", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "seed": 1}),
    ("agreement_h40_seed1", "diloco_h40_seed1", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "seed": 1,
                                                 "outer_adapt": "agreement"}),
    ("diloco_h40_int4", "diloco_h40_int4", {"strategy": "diloco", "steps": 1200, "sync_every": 40, "codec": "int4"}),
    ("agreement_h40_int4", "diloco_h40_int4", {"strategy": "diloco", "steps": 1200, "sync_every": 40,
                                               "codec": "int4", "outer_adapt": "agreement"}),
    ("agreement_300", "diloco_300", {"strategy": "diloco", "steps": 300, "outer_adapt": "agreement"}),
)


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/beyond.py [--out DIR] [--fresh]``; the exit status (2: bad input)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="rerun every run, ignoring cached summaries")
    parser.add_argument("--out", default=None, help="output folder [bench/out/beyond]")
    args = parser.parse_args(argv)
    try:
        benchmark(args)
    except AtollError as e:
        return script_error("beyond", e)
    return 0


def benchmark(args: argparse.Namespace) -> None:
    """Train (or reuse) every run, write results.json and results.md, print the table."""
    from pathlib import Path

    out = Path(args.out) if args.out else default_out("beyond")
    runs = {name: train_once(out, name, args.fresh, **{**BASE, **own}) for name, _, own in RUNS}
    rows = []
    for name, ref, own in RUNS:
        r, base = runs[name], runs[ref]
        rows.append({"run": name, "steps": r["steps"], "H": r["sync_every"], "rounds": r["steps"] // r["sync_every"],
                     "strategy": r["strategy"], "inner": own.get("inner_optimizer", "adamw"), "codec": r["codec"],
                     "density": r.get("sparseloco_density"), "final_eval_loss": r["final_eval_loss"], "vs": ref,
                     "gap_pct": pct(r["final_eval_loss"], base["final_eval_loss"]),
                     "bytes_sent_per_island": r["bytes_sent_per_island"],
                     "fewer_bytes_than_ref": base["bytes_sent_per_island"] / r["bytes_sent_per_island"]})
    table = write_results(
        out, {"settings": BASE, "runs": runs, "rows": rows},
        [("run", "run"), ("H", "H"), ("rounds", "rounds"), ("inner", "inner"), ("codec", "codec"), ("density", "density"),
         ("eval loss", "final_eval_loss"), ("vs", "vs"), ("gap %", "gap_pct"), ("bytes/island", "bytes_sent_per_island"),
         ("x fewer bytes than vs", "fewer_bytes_than_ref")],
        rows, "sparseloco by rounds and at a byte budget, Muon islands, the agreement-weighted outer step: "
        "micro model, 4 islands",
        notes=["one seed unless named, one torch thread per run; gap and bytes against the run in 'vs' (same "
               "steps)",
               "command: python bench/beyond.py"])
    print(table)

"""SparseLoCo and DeMo under their reference code's rules (issue 24), on the micro model, against the committed
diloco runs of ``bench/beyond.py`` (diloco is unchanged by the issue, and its numbers are reproducible).

    python bench/reference_rules.py                 # train (or reuse) every run, then the table
    python bench/reference_rules.py --report-only   # the table of what is in bench/out/beyond_w24

The runs (:func:`atoll.benchmarks.common.train_once` with ``bench/beyond.py``'s micro settings, into
``bench/out/beyond_w24``): sparseloco at the byte budget (16 of 1024, H = 30, 1,200 steps) with the
reference's rules, with atoll's earlier aggregation (``--sparseloco-aggregate all``), with its earlier flat
chunks (``--sparseloco-layout flat``) and with outer rate 2 (which the reference applies twice); the same at
300 steps with outer rate 1 and 0.7 (the step-size diagnostic); sparseloco at 64 of 4096, H = 10, 300 and
1,200 steps; demo and one island alone at 300 steps. With ``--report-only`` a run still in progress (or
stopped) is reported at its last evaluation (``steps`` column).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO = str(Path(__file__).resolve().parents[1])
if _REPO not in sys.path:  # ``python bench/reference_rules.py``: the repository root on the path, for bench.<study>
    sys.path.append(_REPO)

from atoll.benchmarks.common import default_out, pct, train_once, write_results
from bench.beyond import BASE

_BUDGET = {"strategy": "sparseloco", "steps": 1200, "sync_every": 30, "sparseloco_chunk": 1024, "sparseloco_topk": 16}
_DIAG = {**_BUDGET, "steps": 300}
#: run -> its settings on top of bench/beyond.py's BASE
SETTINGS: dict[str, dict[str, Any]] = {
    "sparseloco_c1024_k16_h30": _BUDGET,
    "sparseloco_c1024_k16_h30_aggregate_all": {**_BUDGET, "sparseloco_aggregate": "all"},
    "sparseloco_c1024_k16_h30_layout_flat": {**_BUDGET, "sparseloco_layout": "flat"},
    "sparseloco_c1024_k16_h30_lr2": {**_BUDGET, "outer_lr": 2.0},
    "diag_sparseloco_c1024_k16_h30_300": _DIAG,
    "diag_sparseloco_c1024_k16_h30_300_lr07": {**_DIAG, "outer_lr": 0.7},
    "sparseloco_300": {"strategy": "sparseloco", "steps": 300},
    "sparseloco_1200": {"strategy": "sparseloco", "steps": 1200},
    "demo_300": {"strategy": "demo", "steps": 300},
    "one_island_300": {"strategy": "ddp", "islands": 1, "steps": 300},
}

#: run -> (reference run in bench/out/beyond/results.json or in this folder, what it measures)
ROWS: dict[str, tuple[str, str]] = {
    "sparseloco_c1024_k16_h30": ("diloco_h40", "reference rules (senders' mean, tiles, rate twice)"),
    "sparseloco_c1024_k16_h30_aggregate_all": ("diloco_h40", "divide by every island (atoll's old rule)"),
    "sparseloco_c1024_k16_h30_layout_flat": ("diloco_h40", "flat chunks (atoll's old rule)"),
    "sparseloco_c1024_k16_h30_lr2": ("diloco_h40", "outer rate 2 (into accumulator and step)"),
    "diag_sparseloco_c1024_k16_h30_300": ("diloco_300", "300 steps, H = 30: step size diagnostic"),
    "diag_sparseloco_c1024_k16_h30_300_lr07": ("diloco_300", "300 steps, H = 30, outer rate 0.7"),
    "sparseloco_300": ("diloco_300", "64 of 4096, H = 10, reference rules"),
    "sparseloco_1200": ("diloco_1200", "64 of 4096, H = 10, reference rules"),
    "demo_300": ("one_island_300", "demo top-32 of 64x64, reference momentum and averaging"),
    "one_island_300": ("one_island_300", "one island alone (ddp, K = 1)"),
}


def _last_eval(folder: Path) -> tuple[int, float] | None:
    evals = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line] if (folder / "metrics.jsonl").is_file() else []
    return (evals[-1]["step"], evals[-1]["eval_loss"]) if evals else None


def main(argv: Sequence[str] | None = None) -> int:
    """Train (unless ``--report-only``) and write bench/out/beyond_w24/results.json and results.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-only", action="store_true", help="only the table of the runs already there")
    args = parser.parse_args(argv)
    out = default_out("beyond_w24")
    if not args.report_only:
        for name, own in SETTINGS.items():
            train_once(out, name, False, **{**BASE, **own})
    committed = json.loads((default_out("beyond") / "results.json").read_text())["runs"]
    rows: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    for name, (ref, what) in ROWS.items():
        folder = out / name
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").is_file() else None
        last = _last_eval(folder)
        if summary is None and last is None:
            continue
        summaries[name] = summary
        base = committed.get(ref) or (json.loads((out / ref / "summary.json").read_text())
                                      if (out / ref / "summary.json").is_file() else None)
        loss = summary["final_eval_loss"] if summary else last[1]
        sent = summary["bytes_sent_per_island"] if summary else None
        rows.append({"run": name, "what": what, "steps": summary["steps"] if summary else f"{last[0]} (stopped)",
                     "eval_loss": loss, "energy": (summary or {}).get("sparseloco_sent_energy"),
                     "step_ratio": (summary or {}).get("sparseloco_step_ratio"), "vs": ref,
                     "ref_loss": base["final_eval_loss"] if base else None,
                     "gap_pct": pct(loss, base["final_eval_loss"]) if base and summary else None,
                     "bytes": sent, "fewer": (base["bytes_sent_per_island"] / sent
                                              if base and sent and base["bytes_sent_per_island"] else None)})
    table = write_results(
        out, {"runs": summaries, "rows": rows},
        [("run", "run"), ("what", "what"), ("steps", "steps"), ("eval loss", "eval_loss"),
         ("energy sent", "energy"), ("step / averaging's", "step_ratio"), ("vs", "vs"), ("its loss", "ref_loss"),
         ("gap %", "gap_pct"), ("bytes/island", "bytes"), ("x fewer bytes", "fewer")],
        rows, "issue 24: sparseloco and demo under their reference code's rules, micro model, 4 islands",
        notes=["one seed, one torch thread per run, machine load 14-18 on 2 cores; diloco references: "
               "bench/out/beyond/results.json (unchanged code)",
               "command: python bench/reference_rules.py (the runs stopped early: at their last evaluation)"])
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

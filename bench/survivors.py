"""One island killed mid-run, atoll's collective runtime against torchft's DiLoCo (``python bench/survivors.py``).

The same job on both: the micro Llama, 3 islands (replicas), DiLoCo with H inner steps, AdamW inner and
SGD-Nesterov outer optimizers, the same data per island (:func:`~atoll.job.data.sample_batch`), one island
SIGKILLed as it starts inner step ``--kill-step``. atoll runs ``atoll train --runtime collective``
(survivors re-form their groups, :mod:`atoll.runtime.collective.quorum`); torchft 0.2.0 runs
``torchft.local_sgd.DiLoCo`` with a ``Manager`` per replica, gloo, and a lighthouse whose heartbeat timeout is
5 s (torchft's default), in the Python given by ``--torchft-python`` (a venv where ``pip install torchft==0.2.0``
worked; torchft is no dependency of atoll).

Measured, per framework, on island 0: ``resume_s``, wall seconds from the kill (the victim's clock, same
machine) to the end of the first sync round that completes without it (training goes on from there);
``degraded_sync_s``, the wall seconds of that round (from its start to its end: the failure, the recovery
and the averaging over the survivors); ``final_eval_loss`` on the held-out batches; whether the survivors finished
every step. Writes ``OUT/results.json`` and ``OUT/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from atoll.benchmarks.common import study_settings

#: the settings both frameworks train with (under --steps, --sync-every, --data): bench/survivors.toml's [settings]
SETTINGS: dict[str, Any] = study_settings(__file__, "settings")


def _atoll(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """atoll's collective runtime on the kill; its summary's figures."""
    stamp = out / "atoll_kill_time"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**SETTINGS, "steps": args.steps, "sync_every": args.sync_every,
                                                       "eval_every": args.steps, "out": out / "atoll",
                                                       "data": args.data,
                                                       **({"cache_dir": args.cache_dir} if args.cache_dir else {})
                                                       }.items()]
    env = {**os.environ, "ATOLL_TEST_KILL_RANK_AT_STEP": f"2:{args.kill_step}", "ATOLL_TEST_KILL_STAMP": str(stamp)}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", "--runtime", "collective", "--no-progress",
                        *flags], capture_output=True, text=True, env=env, timeout=args.timeout_s)
    summary = json.loads((out / "atoll" / "summary.json").read_text()) if r.returncode == 0 else {}
    killed = float(stamp.read_text()) if stamp.exists() else float("nan")
    resumed = summary.get("resumed_at", [float("nan")])[0]
    return {"framework": "atoll (collective)", "exit": r.returncode, "wall_s": time.time() - t0,
            "finished_all_steps": r.returncode == 0 and summary.get("steps") == args.steps,
            "resume_s": resumed - killed, "degraded_sync_s": summary.get("interrupted_exchange_s", [None])[0],
            "final_eval_loss": summary.get("final_eval_loss"), "islands_at_end": summary.get("islands_alive"),
            "error": "" if r.returncode == 0 else r.stderr.strip().splitlines()[-1][:200]}


def _torchft(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """torchft's DiLoCo, one process per replica, on the same kill."""
    (out / "torchft").mkdir(parents=True, exist_ok=True)
    config = {**SETTINGS, "steps": args.steps, "sync_every": args.sync_every, "data": args.data}
    if args.cache_dir:
        config["cache_dir"] = args.cache_dir
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = "from bench.survivors_torchft import lighthouse_main; lighthouse_main()"
    import torch.distributed as dist

    starter = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # see replica_main
    t0 = time.time()
    lighthouse = subprocess.Popen([args.torchft_python, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = lighthouse.stdout.readline().strip()  # type: ignore[union-attr]
        procs = []
        for i in range(SETTINGS["islands"]):
            with open(out / "torchft" / f"replica{i}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [args.torchft_python, "-m", "bench.survivors_torchft", address, str(i), json.dumps(config),
                     str(args.kill_step if i == 2 else -1), str(out / "torchft" / f"replica{i}.json"),
                     str(starter.port)],
                    env=env, stdout=subprocess.DEVNULL, stderr=log))
        codes = [p.wait(timeout=args.timeout_s) for p in procs]
    finally:
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)
    results = [json.loads((out / "torchft" / f"replica{i}.json").read_text())
               if (out / "torchft" / f"replica{i}.json").exists() else {} for i in range(2)]
    killed = float((out / "torchft" / "replica2.json.kill").read_text())
    first = results[0]
    degraded = [s for s in first.get("syncs", []) if s["end"] > killed]
    syncs = [s for s in degraded if s["committed"]]
    return {"framework": "torchft 0.2.0 (DiLoCo)", "exit": codes[0], "wall_s": time.time() - t0,
            "finished_all_steps": codes[:2] == [0, 0] and first.get("steps") == args.steps,
            "resume_s": syncs[0]["end"] - killed if syncs else None,
            "degraded_sync_s": degraded[0]["end"] - degraded[0]["start"] if degraded else None,
            "final_eval_loss": first.get("final_eval_loss"), "islands_at_end": first.get("participants"),
            "participants_per_round": [s["participants"] for s in first.get("syncs", [])],
            "uncommitted_rounds": sum(not s["committed"] for s in first.get("syncs", [])), "error": ""}


def main(argv: list[str] | None = None) -> int:
    """Run both, write ``OUT/results.json`` and ``OUT/results.md``; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torchft-python", default="/tmp/tftvenv/bin/python",
                   help="a Python where torchft 0.2.0 is installed (with atoll's requirements visible)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--kill-step", type=int, default=25, help="the 1-based inner step island 2 dies at")
    p.add_argument("--data", default="stdlib")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=Path("bench/out/survivors"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for sub in ("atoll", "torchft"):
        if (args.out / sub).exists():
            import shutil

            shutil.rmtree(args.out / sub)
    load_before = os.getloadavg()
    rows = [_atoll(args, args.out), _torchft(args, args.out)]
    load_after = os.getloadavg()
    (args.out / "results.json").write_text(json.dumps({"settings": {**SETTINGS, "steps": args.steps,
                                                                      "sync_every": args.sync_every,
                                                                      "kill_step": args.kill_step},
                                                         "results": rows}, indent=2))
    command = " ".join(["python bench/survivors.py", *(argv if argv is not None else sys.argv[1:])])
    lines = [f"Command: `{command}`", "",
             f"Machine load (1-minute average) before {load_before[0]:.1f}, after {load_after[0]:.1f}, on "
             f"{os.cpu_count()} cores; one torch thread per process.", "",
             "| framework | finished all steps | resume after kill (s) | degraded sync round (s) | final eval loss |",
             "|---|---|---|---|---|"]
    def f(x: Any) -> str:
        return "—" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)

    for r in rows:
        lines.append(f"| {r['framework']} | {r['finished_all_steps']} | {f(r['resume_s'])} | "
                     f"{f(r['degraded_sync_s'])} | {f(r['final_eval_loss'])} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

"""An island of 2 ranks at ``atoll syncer``: each rank moving its own slice of a fragment, or the leader moving it
whole. Push + pull seconds per fragment, and bytes per connection.

    python bench/service_slices.py                             # 20m model, 2 fragments, TLS, 3 repeats
    python bench/service_slices.py --model tiny --repeats 1 --out /tmp/service_slices

``atoll syncer`` runs in its own process on 127.0.0.1 with a self-signed certificate (TLS), for a run of one
island (quorum 1: every push is merged at once) and the int4 codec. For each island shape (its 2 ranks holding
the whole model, as under DDP, or FSDP2-sharded) and each ``--slice-transfer`` (``ranks``: every rank uploads
and downloads its slice over its own connection, the ranks then all-gather the pulled slices, or hold them
when sharded; ``leader``: rank 0 gathers the slices, pushes and pulls the whole fragment and broadcasts or
scatters it), ``torchrun --nproc-per-node 2`` starts the island's ranks, which exchange every fragment
``--repeats`` times through :class:`~atoll.runtime.service.exchange.ServiceTransport` (the code the island
jobs run): the seconds from handing the push to the transport to every rank holding the merged fragment
(medians over the exchanges), and each rank's bytes over its own bulk connection per exchange (up: the int4
payload, down: float32 values). One torch thread per process; the machine's load is written beside the
figures. Loopback: the figures are the serialization, TLS, gRPC and gloo cost and how they run in parallel on
this machine's cores, not a network's; on a WAN the ranks' connections (and hosts' links) add up.

Writes ``results.json`` and ``results.md`` into ``--out`` (default ``bench/out/service_slices``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from atoll.benchmarks.common import default_out, script_error, write_results  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="20m", help="model preset [20m]")
    parser.add_argument("--fragments", type=int, default=2, help="fragments of the model [2]")
    parser.add_argument("--repeats", type=int, default=3, help="exchanges of every fragment per setting [3]")
    parser.add_argument("--out", type=Path, default=None, help="output folder [bench/out/service_slices]")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a rank: its settings file
    return parser.parse_args(argv)


def _settings(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"  # a small corpus: the bench measures the exchange, not the data
    std = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_text("\n\n\n".join(f.read_text(encoding="utf-8") for f in sorted((std / "json").glob("*.py"))))
    return {"model": args.model, "fragments": args.fragments, "islands": 1, "steps": 10_000, "sync_every": 10,
            "data": str(corpus), "vocab_size": 512, "cache_dir": str(tmp / "cache"), "seq_len": 32,
            "batch_size": 4, "threads": 1, "progress": False,
            "pull_codec": "fp32"}  # (float32 slices, each rank its own: what this study compares)


def _flags(settings: dict[str, Any]) -> list[str]:
    return [x for k, v in settings.items() for x in
            ([f"--no-{k.replace('_', '-')}"] if v is False else [f"--{k.replace('_', '-')}", str(v)])]


def worker(spec_path: Path) -> int:
    """One rank of the benchmark's island (started by torchrun): exchange every fragment ``repeats`` times."""
    from atoll.algorithms.codecs import make_codec
    from atoll.config import build_config
    from atoll.job.run import prepare_inputs
    from atoll.runtime.decoupled_job import job_of
    from atoll.runtime.service.client import SyncerClient
    from atoll.runtime.service.exchange import ServiceTransport, SlicePlan
    from atoll.runtime.service.group import IslandGroup
    from atoll.strategies.base import make_wire
    from atoll.strategies.decoupled.protocol import Push

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    config = build_config(None, {**spec["settings"], "strategy": "decoupled", "runtime": "service",
                                 "ranks_per_island": 2, "shard_island": spec["sharded"],
                                 "slice_transfer": spec["transfer"]})
    group = IslandGroup.from_env(2, "cpu", 300.0)
    group.start()
    data, model = prepare_inputs(config, notes=False, meta=spec["sharded"])
    job = job_of(config, data, model)
    if spec["sharded"]:
        from atoll.job.island import inner_optimizer
        from atoll.runtime.collective.rank_island import RankIsland

        island = RankIsland(group.size, group.rank, group.device, True, group=group.world)
        island.build(0, model, job.settings, inner_optimizer(job.own), ddp=False, seed=job.facts.seed,
                     init_from=job.facts.init_from)
        assert island.layout is not None
        plan = SlicePlan.sharded_island(job.index, [p.numel() for p in model.parameters()], island.layout.counts,
                                        group.rank, spec["transfer"] == "leader")
    else:
        plan = SlicePlan.whole(job.index, group.rank, 2, spec["transfer"] == "leader")
    client = SyncerClient(spec["address"], 0, spec["token"], root_certificates=Path(spec["ca"]).read_bytes(),
                          control=group.leader)
    joined = client.call("Join", {"numels": plan.numels}) if group.leader else {}
    if group.leader:
        client.call("ReserveSteps", {"n": 5_000})
    session, = group.broadcast_ints([int(joined.get("session", 0))])
    codec = make_codec(config.strategy_config.codec, block_size=config.strategy_config.codec_block_size)
    transport = ServiceTransport(client, group, plan, make_wire(config.strategy_config, [0], config.seed), codec,
                                 session, None, poll_s=0.005)
    versions = {pull.fragment: pull.version for pull in transport.start()}
    gen = torch.Generator().manual_seed(group.rank)
    seconds, up, down = [], [], []
    for _ in range(spec["repeats"]):
        for p in range(len(plan.numels)):
            a, b = plan.send_range(p)
            push = Push(0, p, torch.randn(b - a, generator=gen) * 1e-4, config.tokens_per_step, versions[p])
            bytes0 = (client.bytes_up, client.bytes_down)
            t0 = time.perf_counter()
            transport.send(push)
            (pull,) = transport.settle(p)
            seconds.append(time.perf_counter() - t0)
            versions[p] = pull.version
            up.append(client.bytes_up - bytes0[0])
            down.append(client.bytes_down - bytes0[1])
    transport.close()
    Path(spec["result"] + f".{group.rank}").write_text(json.dumps(
        {"seconds": seconds, "bytes_up": up, "bytes_down": down, "fragment_values": plan.numels,
         "payload_bytes": [codec.payload_bytes(n) for n in plan.numels], "refused": transport.refused}))
    client.close()
    group.close()
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/service_slices.py [flags]``; the exit status (2: bad flags)."""
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    if args.repeats < 1:
        return script_error("service_slices", ValueError("repeats: must be >= 1"))
    from atoll.runtime.service.tls import loopback_certificate

    out = args.out or default_out("service_slices")
    tmp = Path(tempfile.mkdtemp(prefix="atoll-service-slices-"))
    settings = _settings(args, tmp)
    key, cert = loopback_certificate()
    (tmp / "syncer.key").write_bytes(key)
    (tmp / "syncer.pem").write_bytes(cert)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GRPC_VERBOSITY": "ERROR"}
    rows, raw = [], {}
    load_before = os.getloadavg()
    for sharded in (False, True):
        for transfer in ("ranks", "leader"):
            port = _free_port()
            folder = tmp / f"syncer_{int(sharded)}_{transfer}"
            syncer = subprocess.Popen([sys.executable, "-m", "atoll", "syncer", "--listen", f"127.0.0.1:{port}",
                                       "--tls-cert", str(tmp / "syncer.pem"), "--tls-key", str(tmp / "syncer.key"),
                                       "--out", str(folder), *_flags(settings)], env=env,
                                      stdout=(tmp / "syncer.log").open("a"), stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 600
                while not (folder / "credentials" / "island_0.token").is_file():
                    if syncer.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the syncer did not start; see {tmp / 'syncer.log'}")
                    time.sleep(0.2)
                spec = {"settings": settings, "sharded": sharded, "transfer": transfer, "repeats": args.repeats,
                        "address": f"127.0.0.1:{port}", "ca": str(tmp / "syncer.pem"),
                        "token": (folder / "credentials" / "island_0.token").read_text().strip(),
                        "result": str(tmp / f"result_{int(sharded)}_{transfer}")}
                (tmp / "spec.json").write_text(json.dumps(spec))
                code = subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", "2", str(Path(__file__).resolve()), "--worker",
                                        str(tmp / "spec.json")], env=env, timeout=1200)
                if code != 0:
                    raise RuntimeError(f"the island's ranks failed (status {code})")
            finally:
                syncer.terminate()
                syncer.wait(timeout=60)
            ranks = [json.loads(Path(spec["result"] + f".{r}").read_text()) for r in range(2)]
            raw[f"{'fsdp' if sharded else 'ddp'}/{transfer}"] = ranks
            n = len(ranks[0]["seconds"])
            row = {"island": "FSDP2-sharded" if sharded else "whole model (DDP)", "transfer": transfer,
                   "exchange_s": statistics.median(ranks[0]["seconds"]),
                   "fragment_mb": 4 * statistics.mean(ranks[0]["fragment_values"]) / 1e6,
                   "payload_mb": statistics.mean(ranks[0]["payload_bytes"]) / 1e6}
            for r in range(2):
                row[f"up_mb_{r}"] = sum(ranks[r]["bytes_up"]) / n / 1e6
                row[f"down_mb_{r}"] = sum(ranks[r]["bytes_down"]) / n / 1e6
            rows.append(row)
            print(f"[service_slices] {row['island']}, {transfer}: {row['exchange_s']:.2f} s per exchange", flush=True)
    load_after = os.getloadavg()
    for row in rows:  # the ratio in the same run: leader over ranks, per island shape
        ranks_s = next(r["exchange_s"] for r in rows if r["island"] == row["island"] and r["transfer"] == "ranks")
        row["vs_ranks"] = row["exchange_s"] / ranks_s
    machine = {"cpus": os.cpu_count(), "threads": 1, "loadavg_1m_before": load_before[0],
               "loadavg_1m_after": load_after[0], "model": args.model, "fragments": args.fragments}
    columns = [("island of 2 ranks", "island"), ("slice transfer", "transfer"),
               ("push+pull s per fragment (median)", "exchange_s"), ("x ranks", "vs_ranks"),
               ("fragment MB float32", "fragment_mb"), ("push payload MB int4", "payload_mb"),
               ("rank 0 up MB", "up_mb_0"), ("rank 1 up MB", "up_mb_1"),
               ("rank 0 down MB", "down_mb_0"), ("rank 1 down MB", "down_mb_1")]
    notes = [f"{args.model} model, {args.fragments} fragments, int4 pushes, float32 pulls; {args.repeats} exchanges "
             "of every fragment per setting; seconds from handing the push to the transport to every rank holding "
             "the merged fragment (upload, commit, merge, download, the ranks' agreement and all-gather, broadcast "
             "or scatter), median; MB per exchange over each rank's own bulk connection (10^6 bytes).",
             "loopback with TLS (a self-signed certificate), the syncer in its own process, one torch thread per "
             f"process; machine: {machine['cpus']} CPUs, load average (1 min) {load_before[0]:.2f} before, "
             f"{load_after[0]:.2f} after (a shared machine: the ranks, the syncer and other jobs share its cores)."]
    print(write_results(out, {"machine": machine, "rows": rows, "raw": raw}, columns, rows,
                        title="An island of 2 ranks: slices per rank or whole fragments by the leader "
                        "(`python bench/service_slices.py`)", notes=notes))
    return 0


if __name__ == "__main__":  # guarded: worker processes that import this file must not run it
    raise SystemExit(main())

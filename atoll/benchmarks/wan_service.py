"""Decoupled DiLoCo deployed across sites inside the emulated WAN: ``atoll syncer`` in a namespace of its own,
each island job in its own, over TLS with per-island credentials, as docs/deployment.md runs them.

    with EmulatedWan(islands + 1, shapes=[*island_links, syncer_link]) as wan:   # the syncer's site is the last
        res = run_service_in_wan(wan, run_flags, out, timeout_s=3600, kill=Kill(island=1, at_step=120))

Used by :mod:`atoll.benchmarks.wan_decoupled` (``atoll bench wan-decoupled``). The syncer listens on its
namespace's address with a self-signed certificate made for that address (:func:`syncer_certificate`); it makes
the islands' credentials at its start (``island_<i>.token``), and island *i*'s job is given only its own. Each
job is started by :func:`island_command` (one function: an island of one process today, ``torchrun`` with R
ranks once an island is a job of several ranks) inside its island's namespace, so every byte between an island
and the syncer crosses that island's shaped link. A :class:`Kill` SIGKILLs one island job once the syncer has
granted it ``at_step`` inner steps and starts the same command again (it rejoins from the newest global
fragments, docs/deployment.md).

While the run goes on the harness records, every ``poll_s``: the syncer's ``service/status.json`` (commits,
steps granted and tokens merged per island) with the harness's clock, and a hard link of each new checkpoint
the syncer writes after a commit (``<out>/snapshots``; the syncer keeps only its newest two), so that the global
model's held-out loss over time can be evaluated afterwards (:func:`evaluate_snapshots`) without slowing the
run. The syncer's checkpoints carry its own clock, so a snapshot's time is exact, not the poll's.

Files of a run folder ``<out>``: ``syncer/`` (the syncer's ``--out``: ``credentials/``, ``service/status.json``,
``syncer/checkpoints/``, and the run folder ``run/`` with ``summary.json`` and ``metrics.jsonl`` at the end),
``tls/`` (``syncer.pem``, ``syncer.key``), ``snapshots/``, ``syncer.log``, ``island_<i>.log`` (``island_<i>.<n>.log``
for its n-th restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atoll.benchmarks.netns import EmulatedWan

SYNCER_PORT = 7070
#: the status fields recorded over time (the rest of status.json is read from the summary at the end)
STATUS_KEYS = ("commits", "reserved", "budget", "steps_by_island", "merged_tokens_by_island", "rejected_updates",
               "restarts", "done")


@dataclass(frozen=True)
class Kill:
    """One island job SIGKILLed mid-run, then started again with the same command.

    Attributes:
        island: which island.
        at_step: kill it once the syncer has granted it this many inner steps (``status.json``, read every
            ``poll_s``: it may have taken one or two more).
        restart_after_s: start its command again this many seconds after it died (None: never).
    """

    island: int
    at_step: int
    restart_after_s: float | None = 0.0


def island_command(syncer: str, island: int, credential: Path, ca: Path, run_flags: Sequence[str],
                   ranks: int = 1) -> list[str]:
    """The command line of island ``island``'s job: the one place that says how an island is launched.

    One process (``python -m atoll.cli island``) for ``ranks`` 1; otherwise ``torchrun --standalone
    --nproc-per-node R -m atoll island ...`` (docs/deployment.md, "An island of several ranks"): its ranks'
    rendezvous is on the island namespace's loopback, so only their pushes and pulls cross the island's link.
    No ``--max-restarts``: the harness restarts a killed job with this same command.

    Args:
        syncer: ``HOST:PORT`` of the syncer; credential: the island's ``island_<i>.token``; ca: the syncer's
            certificate (self-signed: its own CA); run_flags: the run's settings as flags (the syncer's too);
            ranks: the island job's ranks (``--ranks-per-island``, also in ``run_flags`` or defaulted by torchrun).
    """
    head = [sys.executable, "-m", "atoll.cli"] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "--monitor-interval", "0.5", "-m", "atoll"]
    return [*head, "island", "--syncer", syncer, "--tls-ca", str(ca), "--island", str(island),
            "--credential", str(credential), *run_flags]


def syncer_command(listen: str, cert: Path, key: Path, out: Path, run_flags: Sequence[str]) -> list[str]:
    """The command line of the syncer's job (``atoll syncer``, TLS, its state in ``out``)."""
    return [sys.executable, "-m", "atoll.cli", "syncer", "--listen", listen, "--tls-cert", str(cert),
            "--tls-key", str(key), "--out", str(out), *run_flags]


def syncer_certificate(ip: str, days: float = 1.0) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM): a fresh self-signed certificate (its own CA; ECDSA P-256) whose
    subject alternative name is the address ``ip`` the islands dial, so they verify it with ``--tls-ca`` and no
    ``--tls-server-name``. For the emulated WAN only; a real syncer's certificate is the user's.

    Raises:
        ImportError: ``cryptography`` is not installed (it comes with Ray).
    """
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "atoll-syncer")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))


def descendants(pid: int) -> list[int]:
    """Every process descended from ``pid`` (children first found, then theirs), read from
    ``/proc/<pid>/task/<tid>/children``; a process that ends meanwhile is skipped."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{parent}/task/{tid}/children").read_text().split()]
            except (OSError, ValueError):
                continue
            found += [k for k in kids if k not in found]
            todo += kids
    return found


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL an island job and every process it started, then reap it: its process group, and each descendant
    and its group (torchrun starts each rank in a session of its own, so the group of the job alone would leave
    the ranks training on as orphans)."""
    victims = [proc.pid, *descendants(proc.pid)]
    for pid in victims:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def _read_status(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _snapshot(checkpoints: Path, into: Path, taken: set[str]) -> None:
    """Hard-link the files of every checkpoint in ``checkpoints`` not taken yet into ``into/<step>``; one that
    the syncer removes meanwhile (it keeps two) is skipped."""
    try:
        names = [n for n in os.listdir(checkpoints) if n.startswith("step_") and n not in taken]
    except OSError:
        return
    for name in sorted(names):
        dest = into / name
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for f in ("state.safetensors", "state.json"):
                if not (dest / f).exists():
                    os.link(checkpoints / name / f, dest / f)
            taken.add(name)
        except OSError:  # removed while linking: the next one will do
            with contextlib.suppress(OSError):
                for f in dest.iterdir():
                    f.unlink()
                dest.rmdir()


def run_service_in_wan(wan: EmulatedWan, run_flags: Sequence[str], out: Path, timeout_s: float,
                       kill: Kill | None = None, poll_s: float = 0.2, grace_s: float = 60.0,
                       end_grace_s: float = 30.0, sampler_interval_s: float = 0.05, ranks: int | Sequence[int] = 1,
                       island_flags: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """Run ``atoll syncer`` in the last namespace of ``wan`` and one ``atoll island`` job in each other one.

    Args:
        wan: an emulated WAN of K + 1 namespaces: islands 0..K-1, then the syncer's site.
        run_flags: the run's settings as ``atoll`` flags (the same for every process; ``--islands K``).
        out: the run folder (see the module docstring).
        timeout_s: deadline of the whole run; every process still running then is killed.
        kill: one island job to SIGKILL and restart (:class:`Kill`), or None.
        grace_s: after a process fails (not the one killed on purpose), how long the others may take to stop
            by themselves before they are killed.
        end_grace_s: after the syncer ended the run (status 0), how long an island job may take to exit; one
            still running then is killed and listed in ``stuck_after_end`` (the syncer ends the run
            ``collective_timeout_s`` after the budget is spent even while an island's last pushes wait for their
            grace window; that island then retries its calls until ``--give-up-s``: a known issue of atoll
            syncer, whose run and results are complete by then).
        ranks: ranks of each island job, one number for all or one per island (:func:`island_command`; the
            SIGKILL of :class:`Kill` goes to the job and every process it started, :func:`kill_job`: torchrun and
            its ranks).
        island_flags: per island, flags of its job alone after ``run_flags`` (e.g. ``--emulate-step-s``), or None.

    Returns:
        ``exit_codes`` (``syncer``; ``islands``: each island's last job; ``killed``: the jobs killed on purpose,
        -9), ``ok`` (every job exited 0, or was stuck after the end), ``stuck_after_end`` (islands killed
        after the syncer's end), ``wall_s``, ``error`` (the last lines of the first failing log), ``status`` (a list of
        ``[time.time(), {STATUS_KEYS}]`` whenever status.json changed), ``kill`` (``island``, ``step``, ``time``,
        ``restarted``: the restart's time or None), ``sampler`` (the interface counters, every namespace).
    """
    islands = wan.islands - 1
    per_ranks = [ranks] * islands if isinstance(ranks, int) else list(ranks)
    own_flags = [list(f) for f in island_flags] if island_flags is not None else [[] for _ in range(islands)]
    if len(per_ranks) != islands or len(own_flags) != islands:
        raise ValueError(f"ranks and island_flags: one entry per island ({islands}); got {len(per_ranks)} and "
                         f"{len(own_flags)}")
    out.mkdir(parents=True, exist_ok=True)
    address = f"{wan.island_ip(islands)}:{SYNCER_PORT}"
    key_pem, cert_pem = syncer_certificate(wan.island_ip(islands))
    (out / "tls").mkdir(exist_ok=True)
    cert, key = out / "tls" / "syncer.pem", out / "tls" / "syncer.key"
    cert.write_bytes(cert_pem)
    key.touch(mode=0o600)
    key.write_bytes(key_pem)
    syncer_out, snapshots = out / "syncer", out / "snapshots"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1",
           "GRPC_VERBOSITY": "ERROR", "GLOO_SOCKET_IFNAME": "lo"}  # an island's ranks talk over its site's loopback
    logs: list[Any] = []

    def start(site: int, argv: list[str], log_name: str) -> subprocess.Popen:
        log = open(out / log_name, "w")  # noqa: SIM115 - closed below
        logs.append(log)
        return wan.popen(site, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def island(i: int, restart: int = 0) -> subprocess.Popen:
        credential = syncer_out / "credentials" / f"island_{i}.token"
        return start(i, island_command(address, i, credential, cert, [*run_flags, *own_flags[i]], per_ranks[i]),
                     f"island_{i}.log" if not restart else f"island_{i}.{restart}.log")

    sampler = wan.sampler(sampler_interval_s)
    t0 = time.time()
    deadline = t0 + timeout_s
    status: list[list[Any]] = []
    taken: set[str] = set()
    killed: list[subprocess.Popen] = []
    record: dict[str, Any] | None = None
    failed: str | None = None
    ended: float | None = None  # when the syncer ended the run
    stuck: list[int] = []
    syncer = start(islands, syncer_command(address, cert, key, syncer_out, run_flags), "syncer.log")
    procs: list[subprocess.Popen] = []
    try:
        tokens = [syncer_out / "credentials" / f"island_{i}.token" for i in range(islands)]
        while not all(t.is_file() for t in tokens) and syncer.poll() is None and time.time() < deadline:
            time.sleep(poll_s)
        if syncer.poll() is None:
            procs = [island(i) for i in range(islands)]
        last = ""
        while time.time() < deadline:
            text = _read_status(syncer_out / "service" / "status.json")
            if text is not None and json.dumps(text) != last:
                last = json.dumps(text)
                status.append([time.time(), {k: text.get(k) for k in STATUS_KEYS}])
            _snapshot(syncer_out / "syncer" / "checkpoints", snapshots, taken)
            if kill is not None and record is None and text and \
                    (text.get("steps_by_island") or [0] * islands)[kill.island] >= kill.at_step:
                victim = procs[kill.island]
                kill_job(victim)
                killed.append(victim)
                record = {"island": kill.island, "step": text["steps_by_island"][kill.island],
                          "time": time.time(), "restarted": None}
            if record is not None and record["restarted"] is None and kill is not None and \
                    kill.restart_after_s is not None and time.time() >= record["time"] + kill.restart_after_s:
                procs[kill.island] = island(kill.island, restart=len(killed))
                record["restarted"] = time.time()
            running = [p for p in [syncer, *procs] if p.poll() is None]
            if not running:
                break
            if syncer.returncode == 0 and ended is None:
                ended = time.time()
            if ended is not None and time.time() > ended + end_grace_s:
                stuck = [i for i, p in enumerate(procs) if p.poll() is None]
                break
            bad = [p for p in [syncer, *procs] if p.poll() not in (None, 0)]
            if bad and failed is None:
                failed = "a process failed"
                deadline = min(deadline, time.time() + grace_s)
            time.sleep(poll_s)
        _snapshot(syncer_out / "syncer" / "checkpoints", snapshots, taken)
    finally:
        for p in [syncer, *procs]:
            if p.poll() is None:
                kill_job(p)
        sampler.stop()
        for log in logs:
            log.close()
    wall = time.time() - t0
    codes = {"syncer": syncer.returncode, "islands": [p.returncode for p in procs],
             "killed": [p.returncode for p in killed]}
    timed_out = wall >= timeout_s
    ok = syncer.returncode == 0 and len(procs) == islands and not timed_out and \
        all(c == 0 or i in stuck for i, c in enumerate(codes["islands"])) and (kill is None or record is not None)
    error = None
    if not ok:
        logs_by_code = [("syncer.log", syncer.returncode)] + [(f"island_{i}.log", p.returncode)
                                                             for i, p in enumerate(procs) if i not in stuck]
        name, code = next(((n, c) for n, c in logs_by_code if c != 0), ("syncer.log", syncer.returncode))
        tail = (out / name).read_text(errors="replace").strip().splitlines()[-3:]
        error = (f"timed out after {timeout_s:.0f} s; " if timed_out else "") + \
            (f"{name} exited with {code}: " if code != 0 else "") + \
            ("the kill never happened; " if kill is not None and record is None else "") + " | ".join(tail)
    return {"exit_codes": codes, "ok": ok, "stuck_after_end": stuck, "wall_s": wall, "error": error, "status": status,
            "kill": record, "sampler": sampler}


def evaluate_snapshots(flags: dict[str, Any], snapshots: Path) -> list[dict[str, Any]]:
    """The held-out loss of the syncer's global model at every snapshot: ``[{commits, run_s, eval_loss,
    merged_tokens}]`` by ``run_s`` (the syncer's clock: seconds from the run's first inner step to the commit's
    checkpoint; ``merged_tokens``: the tokens in the global model then, every island's, times fragment share).

    The same evaluation as the run's final one (:class:`atoll.job.run.Run`: :data:`~atoll.job.run.EVAL_ROWS`
    rows of the held-out tokens per batch, ``eval_batches`` batches, float32 on the CPU), so the last snapshot's
    loss is the summary's ``final_eval_loss`` when no commit came after it.

    Args:
        flags: the run's settings (:func:`atoll.config.build_config` overrides).
        snapshots: the folder of snapshots (:func:`run_service_in_wan`).
    """
    from atoll.config import build_config
    from atoll.job.checkpoint import load_checkpoint
    from atoll.job.data import eval_batches
    from atoll.job.evaluation import evaluate
    from atoll.job.island import copy_flat_into
    from atoll.job.run import EVAL_ROWS
    from atoll.runtime.decoupled_job import prepare_job, syncer_of

    config = build_config(None, {**flags, "strategy": "decoupled"})
    job = prepare_job(config)
    syncer = syncer_of(config, job.init_flat, job.index)
    val = eval_batches(job.data.val_tokens, EVAL_ROWS, config.seq_len, config.eval_batches)
    params = list(job.model.parameters())
    points = []
    for folder in sorted(p for p in snapshots.glob("step_*") if (p / "state.json").is_file()):
        _, state = load_checkpoint(folder)
        syncer.load_state_dict(state["syncer"])
        service = state.get("service", {})
        start = service.get("first_step_s")
        if start is None:
            continue  # a checkpoint before the first inner step: the initial model
        copy_flat_into(params, syncer.global_params())
        points.append({"commits": syncer.commits, "run_s": float(service["clock_s"]) - float(start),
                       "eval_loss": evaluate(job.model, val), "merged_tokens": float(syncer.merged_tokens)})
    return sorted(points, key=lambda p: p["run_s"])

"""One island of R ranks (:class:`~atoll.runtime.collective.rank_island.RankIsland`), shared by the collective
runtime and the service's island job (issue 37): each rank's rows, the island's mean gradient and loss, its
tokens, built whole (torch DDP, or the host path's all-reduce) or sharded (FSDP2).

Two gloo ranks on the CPU build the micro model's island each way and take one step's forward and backward pass
on the island's batch; each must end with what one island of one rank computes on the whole batch: the loss, the
tokens and the gradient (a sharded rank's piece gathered into the whole vector).
"""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest
import torch

from atoll.config.facts import IslandSettings
from atoll.job.island import build_island, inner_optimizer
from atoll.job.model import build_model
from atoll.runtime.collective.rank_island import RankIsland
from atoll.strategies.diloco import DiLoCoConfig
from tests.conftest import run_ranks

VOCAB, SEQ, ROWS = 128, 16, 8

_RANK = textwrap.dedent(f"""
    import copy, datetime, json, os, sys
    import torch, torch.distributed as dist
    from atoll.config.facts import IslandSettings
    from atoll.job.island import build_island, inner_optimizer
    from atoll.job.model import build_model
    from atoll.runtime.collective.rank_island import RankIsland
    from atoll.strategies.diloco import DiLoCoConfig

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    settings, optimizer = IslandSettings(steps=10), inner_optimizer(DiLoCoConfig())
    batch = torch.randint(0, {VOCAB}, ({ROWS}, {SEQ} + 1), generator=torch.Generator().manual_seed(3))
    model = build_model("micro", {VOCAB}, {SEQ}, seed=0)
    reference = build_island(0, copy.deepcopy(model), settings, optimizer)
    reference.forward_backward(batch)
    want = torch.cat([p.grad.reshape(-1) for p in reference.params])
    out = {{}}
    for kind, sharded, ddp in (("ddp", False, True), ("host", False, False), ("fsdp", True, False)):
        ranks = RankIsland(2, rank, torch.device("cpu"), sharded, group=dist.group.WORLD)
        island = ranks.build(0, copy.deepcopy(model), settings, optimizer, ddp=ddp, seed=0)
        ranks.forward_backward(island, batch)
        grads = island.flat_grads()
        if sharded:
            grads = ranks.layout.gather(grads)
        out[kind] = {{"loss": float(island.last_loss), "want_loss": float(reference.last_loss),
                     "tokens": island.tokens, "want_tokens": reference.tokens, "ddp": island.ddp is not None,
                     "grad_err": float((grads - want).abs().max() / want.abs().max())}}
    print(json.dumps(out))
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # as atoll island's ranks end: no interpreter teardown racing gloo's threads
""")


def test_one_rank_takes_the_whole_batch_and_nothing_is_exchanged() -> None:
    settings, optimizer = IslandSettings(steps=10), inner_optimizer(DiLoCoConfig())
    batch = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    ranks = RankIsland(1, 0, torch.device("cpu"), sharded=False)  # no group: a collective would fail
    island = ranks.build(0, build_model("micro", VOCAB, SEQ, seed=0), settings, optimizer, ddp=False, seed=0)
    reference = build_island(0, build_model("micro", VOCAB, SEQ, seed=0), settings, optimizer)
    assert ranks.rows(batch).data_ptr() == batch.data_ptr() and ranks.rows(batch).shape == batch.shape
    ranks.forward_backward(island, batch)
    reference.forward_backward(batch)
    assert float(island.last_loss) == float(reference.last_loss)
    assert island.tokens == reference.tokens == ROWS * SEQ
    assert torch.equal(island.flat_grads(), reference.flat_grads())
    assert ranks.layout is None


def test_each_rank_takes_its_own_rows() -> None:
    batch = torch.arange(8 * 3).reshape(8, 3)
    assert [RankIsland(4, p, torch.device("cpu"), False).rows(batch)[:, 0].tolist() for p in range(4)] == [
        [0, 3], [6, 9], [12, 15], [18, 21]]


def test_the_collective_runtime_and_the_island_job_share_it() -> None:
    """Neither re-does the island's forward-backward: both hand the step to their RankIsland."""
    from atoll.runtime.collective.runtime import CollectiveRuntime
    from atoll.runtime.service.island import RankWorker

    for method in (CollectiveRuntime.forward_backward, RankWorker.forward_backward):
        source = inspect.getsource(method)
        assert "rank_island.forward_backward(" in source and "all_reduce" not in source, method


@pytest.mark.slow
def test_two_ranks_end_with_the_whole_batch_loss_tokens_and_gradient() -> None:
    codes, outs, errs = run_ranks(["-c", _RANK], 2, timeout=600)
    assert codes == [0, 0], [e[-2000:] for e in errs]
    for rank, stdout in enumerate(outs):
        got = json.loads(stdout.strip().splitlines()[-1])
        assert set(got) == {"ddp", "host", "fsdp"}
        assert got["ddp"]["ddp"] and not got["host"]["ddp"] and not got["fsdp"]["ddp"]
        for kind, m in got.items():
            assert m["tokens"] == m["want_tokens"] == ROWS * SEQ, (rank, kind)
            assert m["loss"] == pytest.approx(m["want_loss"], rel=1e-5), (rank, kind)
            assert m["grad_err"] < 1e-4, (rank, kind, m["grad_err"])

"""A sharded island's mixed precision (``shard_model(..., precision="bf16")``, FSDP2's MixedPrecisionPolicy):
the forward and backward passes run on bfloat16 parameters all-gathered in bfloat16, while the sharded master
weights, their gradients (reduce-scattered in float32) and so the optimizer state stay float32 (issue 25).

Two gloo ranks on the CPU shard the micro model; each computes its own batch. Checked against the unsharded
float32 model on the same batches: the loss within bfloat16 rounding, and each rank's gradient shard within
bfloat16 rounding of its piece of the float32 mean gradient; with ``fp32`` both to float32 rounding.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.conftest import run_ranks

_RANK = textwrap.dedent("""
    import copy, datetime, json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from atoll.job.model import build_model
    from atoll.runtime.collective.sharding import shard_model

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))


    def measure(precision):
        model = build_model("micro", 128, 32, seed=0)
        reference = copy.deepcopy(model)
        ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1 + rank))
        shard_model(model, dist.group.WORLD, torch.device("cpu"), precision)
        forward_dtypes = set()
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_pre_hook(lambda mod, args: forward_dtypes.add(str(mod.weight.dtype)))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        worst, stored = 0.0, set()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            mean = q.grad.detach().clone()
            dist.all_reduce(mean)
            mean /= 2
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            piece = mean.chunk(2, dim=0)[rank] if isinstance(p, DTensor) else mean
            stored |= {str((p.to_local() if isinstance(p, DTensor) else p).dtype), str(local.dtype)}
            scale = float(piece.abs().max()) or 1.0
            worst = max(worst, float((local - piece[: local.shape[0]]).abs().max()) / scale)
        return {"forward": sorted(forward_dtypes), "stored": sorted(stored), "loss": float(loss.detach()),
                "ref_loss": float(ref_loss.detach()), "grad_rel_err": worst}


    print(json.dumps({precision: measure(precision) for precision in ("bf16", "fp32")}))
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # as atoll island's ranks end: no interpreter teardown racing gloo's threads (a rare SIGABRT)
""")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """What each of the two ranks measured, by precision."""
    codes, outs, errs = run_ranks(["-c", _RANK], 2, timeout=300)
    assert codes == [0, 0], [e[-2000:] for e in errs]
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.slow
def test_bf16_sharded_island_computes_in_bf16_and_keeps_float32_masters(ranks: list[dict]) -> None:
    for rank in ranks:
        bf16 = rank["bf16"]
        assert bf16["forward"] == ["torch.bfloat16"]  # the all-gathered parameters the layers compute with
        assert bf16["stored"] == ["torch.float32"]  # sharded weights and reduce-scattered gradients
        assert bf16["loss"] == pytest.approx(bf16["ref_loss"], rel=2e-2)
        assert bf16["loss"] != bf16["ref_loss"]  # bf16 rounding did happen
        assert bf16["grad_rel_err"] < 5e-2


@pytest.mark.slow
def test_fp32_sharded_island_equals_the_unsharded_model(ranks: list[dict]) -> None:
    for rank in ranks:
        fp32 = rank["fp32"]
        assert fp32["forward"] == ["torch.float32"] and fp32["stored"] == ["torch.float32"]
        assert fp32["loss"] == pytest.approx(fp32["ref_loss"], rel=1e-6)
        assert fp32["grad_rel_err"] < 1e-5

"""``ddp`` on sharded islands (``--shard-island``) through FSDP2's hooks (issue 25, item 7): the island's
gradient reduce-scattered by FSDP2, its shard summed across the islands by the all-reduce hook in the backward
pass (:class:`atoll.runtime.collective.torch_ddp.HybridSync`), never through the host. Against the unsharded
islands on torch's DDP hooks, from the same weights: the same tokens, bytes and exchanges, the same final model
to float round-off, and an island whose weights go NaN is left out of the mean and reset from a peer on both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_flags
from safetensors.torch import load_file

from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.job.checkpoint import save_checkpoint
from atoll.job.run import prepare_inputs

STEPS = 6


@pytest.mark.slow
def test_sharded_ddp_syncs_in_the_backward_pass_and_equals_unsharded_ddp(fast_config: dict) -> None:
    root = Path(fast_config["out"]).parent
    base = {**fast_config, "strategy": "ddp", "runtime": "collective", "ranks_per_island": 2, "steps": STEPS,
            "eval_every": STEPS, "checkpoint_every": STEPS, "seq_len": 16}
    base.pop("sync_every")
    # sharded islands initialise their own pieces on the meta device: both runs start from one checkpoint
    _, model = prepare_inputs(build_config(overrides=applicable({**base, "out": str(root / "seed")})))
    save_checkpoint(root / "seed", 0, {}, model=model)
    base["init_from"] = str(root / "seed")

    def run(name: str, **more) -> tuple[dict, dict[str, torch.Tensor]]:
        out = root / name
        r = subprocess.run([sys.executable, "-m", "atoll.cli", "train", *cli_flags({**base, **more, "out": str(out)})],
                           capture_output=True, text=True, timeout=400,
                           env={**os.environ, "ATOLL_TEST_NAN_AT": f"weights:1:{STEPS}"})
        assert r.returncode == 0, r.stderr[-3000:]
        weights = load_file(str(out / "checkpoints" / f"step_{STEPS:07d}" / "model" / "model.safetensors"))
        return json.loads((out / "summary.json").read_text()), weights

    (whole, whole_w), (sharded, sharded_w) = run("whole", min_islands=2), run("sharded", shard_island=True)
    assert whole["gradient_sync"] == "torch_ddp" and sharded["gradient_sync"] == "fsdp_hybrid"
    for key in ("tokens", "exchanges", "island_resets", "rejected_updates"):
        assert sharded[key] == whole[key], key
    assert sharded["island_resets"] == [0, 1]  # island 1's NaN weights: left out of the mean, then reset
    assert sharded["bytes_sent_per_island"] == pytest.approx(whole["bytes_sent_per_island"])
    assert sharded["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-5)
    assert whole_w.keys() == sharded_w.keys()
    for k in whole_w:
        torch.testing.assert_close(sharded_w[k], whole_w[k], rtol=1e-5, atol=1e-6, msg=k)

"""Sharded islands (``--shard-island``) under the strategies beyond diloco and ddp: streaming, sparseloco, demo.

Each 2-island x 2-rank run sharded is compared with the same run unsharded (both from one ``--init-from``), as
tests/test_fsdp.py does for diloco: the same weights to float round-off, the same evaluation loss and bytes.
Every run is a subprocess with a timeout and a checked exit status.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fsdp import _checkpoint, _every_file, _settings, _train, assert_resumes_bit_for_bit

from atoll.algorithms.codecs import make_codec
from atoll.algorithms.fragments import FlatFragment
from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.job.checkpoint import save_checkpoint
from atoll.job.run import prepare_inputs
from atoll.runtime.network import ring_allgather_bytes
from atoll.runtime.service.slices import shard_parts, shard_pieces


def _per_slice(codec_name: str, block: int, x: torch.Tensor, fragment: FlatFragment, counts: torch.Tensor,
               numels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fragment's values of ``x`` (the whole flat vector) encoded and decoded whole, and encoded and decoded
    rank by rank (each rank its shard's slice, as a sharded island's ranks do), put back in fragment order."""
    codec = make_codec(codec_name, block_size=block)
    whole = codec.decode(codec.encode(fragment.gather(x)))
    sliced = torch.empty_like(whole)
    for part in shard_parts(fragment, shard_pieces(numels, counts)):
        mine = FlatFragment(part.ranges)  # the part's positions in the fragment's element order
        values = fragment.gather(x)
        mine.scatter_(sliced, codec.decode(codec.encode(mine.gather(values))))
    return whole, sliced


def test_per_slice_block_scaling_equals_the_whole_fragment_s_when_blocks_align() -> None:
    """A sharded rank encodes its slice of a fragment with its own scale blocks. Where every piece starts and
    ends on a block boundary of the fragment (here pieces of 16 and 32 elements, blocks of 16) the blocks are the
    same and so is every value; otherwise (blocks of 64) the values differ, each within half its own block's
    step (absmax / 7 / 2 for int4), the codec's bound either way."""
    torch.manual_seed(0)
    numels = [64 * 4, 32, 32 * 2]  # a (64, 4) matrix, a (32,) norm, a (32, 2) matrix: rows cut in two
    counts = torch.tensor([[128, 16, 32], [128, 16, 32]])  # Shard(0) over two ranks
    x = torch.randn(sum(numels)) * torch.linspace(0.1, 3.0, sum(numels))
    fragment = FlatFragment(((0, 256), (256, 272), (272, 288), (288, 352)))  # the whole model, 4 ranges
    whole, sliced = _per_slice("int4", 16, x, fragment, counts, numels)
    assert torch.equal(whole, sliced)
    whole, sliced = _per_slice("int4", 64, x, fragment, counts, numels)
    assert not torch.equal(whole, sliced)
    values = fragment.gather(x)
    # the bound of each: half a step of the block an element was scaled in; the sliced blocks are no larger
    # than 64, so half the step of the whole-fragment block of 64 bounds neither, but 64-element blocks
    # anywhere in the vector bound both: max |x| / 7 / 2 over the vector
    bound = float(values.abs().max()) / 7 / 2 + 1e-6
    assert float((whole - values).abs().max()) <= bound and float((sliced - values).abs().max()) <= bound


@pytest.fixture(scope="module")
def seeded(corpus_file: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The folder of the runs and their settings, which start from the same seeded weights (``--init-from``)."""
    root, settings = tmp_path_factory.mktemp("fsdp_strategies"), _settings(corpus_file, cache_dir)
    _, model = prepare_inputs(build_config(overrides=applicable({**settings, "out": str(root / "seed")})))
    save_checkpoint(root / "seed", 0, {}, model=model)
    return root, {**settings, "init_from": str(root / "seed")}


def _whole_and_sharded(root: Path, settings: dict, strategy: str, **flags: object) -> dict:
    """``strategy`` trained twice from the same weights, 2 islands x 2 ranks: {"whole": (folder, summary),
    "sharded": (folder, summary)}, the second with ``--shard-island``."""
    return {kind: (root / f"{strategy}-{kind}", _train(settings, root / f"{strategy}-{kind}", strategy=strategy,
                                                       shard_island=kind == "sharded", **flags))
            for kind in ("whole", "sharded")}


@pytest.fixture(scope="module")
def streaming(seeded: tuple[Path, dict]) -> dict:
    """streaming, 2 fragments, int4 with blocks of 16 (every piece of the micro model's shards is a multiple of
    16 elements at a multiple of 16 in its fragment: the blocks align), unsharded and sharded."""
    root, settings = seeded
    return _whole_and_sharded(root, settings, "streaming", fragments=2, codec="int4", codec_block_size=16)


def _assert_same_run(whole_dir: Path, whole: dict, sharded_dir: Path, sharded: dict) -> None:
    """The sharded run ended where the unsharded one did: weights to float round-off (the gradient is
    reduce-scattered instead of all-reduced, the clip norm summed shard by shard), loss, tokens, exchanges."""
    a, b = _checkpoint(whole_dir, "model"), _checkpoint(sharded_dir, "model")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert sharded["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-6)
    assert sharded["tokens"] == whole["tokens"] and sharded["exchanges"] == whole["exchanges"]
    per_rank = sharded["params_per_rank"]
    assert len(per_rank) == 2 and sum(per_rank) == sharded["params"] == whole["params"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_streaming_equals_the_unsharded_run(streaming: dict) -> None:
    (whole_dir, whole), (sharded_dir, sharded) = streaming["whole"], streaming["sharded"]
    assert whole["fragments"] == sharded["fragments"] == 2
    _assert_same_run(whole_dir, whole, sharded_dir, sharded)
    # each rank sends its slice of each fragment, int4 with its own blocks: aligned here, the same bytes
    assert sharded["bytes_sent_per_island"] == whole["bytes_sent_per_island"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_streaming_checkpoint_resumes_bit_for_bit(streaming: dict, tmp_path: Path) -> None:
    """Resumed at step 10, where fragment 1's exchange is in flight (H = 5, tau = 1): its result is saved per
    shard, and the resumed run writes the same files as the uninterrupted one."""
    source, _ = streaming["sharded"]
    assert_resumes_bit_for_bit(source, tmp_path / "resumed", 10)
    in_flight = [f for name, f in _every_file(source, 10).items() if "strategy.in_flight.0.result" in f]
    assert len(in_flight) == 2  # island 0's two ranks, each its shard's slice of the fragment in flight


@pytest.fixture(scope="module")
def demo(seeded: tuple[Path, dict]) -> dict:
    """demo (every step, no H), unsharded and sharded."""
    root, settings = seeded
    return _whole_and_sharded(root, {k: v for k, v in settings.items() if k != "sync_every"}, "demo")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_demo_equals_the_unsharded_run(demo: dict) -> None:
    """A sharded island's ranks all-gather each momentum and select from the whole tensor (sharded_demo), so
    the payloads are the unsharded island's (measured: the same weights bit for bit here; sign-SGD could
    turn a round-off into a step of 2 lr, which the tolerance would catch); the payload travels once per
    island, cut over its ranks: the same bytes."""
    (whole_dir, whole), (sharded_dir, sharded) = demo["whole"], demo["sharded"]
    _assert_same_run(whole_dir, whole, sharded_dir, sharded)
    assert sharded["bytes_sent_per_island"] == whole["bytes_sent_per_island"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_demo_checkpoint_resumes_bit_for_bit(demo: dict, tmp_path: Path) -> None:
    """Each rank checkpoints its rows of DeMo's momentum (a DTensor like its parameter), and a run resumed at
    step 10 writes the same files as the uninterrupted one."""
    source, _ = demo["sharded"]
    a = assert_resumes_bit_for_bit(source, tmp_path / "resumed", 10)
    whole = _every_file(demo["whole"][0])
    rank0 = next(v for k, v in whole.items() if k.startswith("ranks/rank_00000/"))
    pieces = [next(v for k, v in a.items() if k.startswith(f"ranks/rank_0000{r}/")) for r in (0, 1)]
    momentum = [k for k in rank0 if k.endswith(".momentum")]
    assert momentum  # the rows of each rank, together the unsharded island's momentum (to round-off)
    for k in momentum:
        torch.testing.assert_close(torch.cat([pieces[0][k], pieces[1][k]]), rank0[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def sparseloco(seeded: tuple[Path, dict]) -> dict:
    """sparseloco (rounds at steps 5, 10 and 12), unsharded and sharded. The micro model's square matrices and
    norms are one tile (one 1-D run) across both ranks' rows: a rank's piece alone could not select them."""
    root, settings = seeded
    return _whole_and_sharded(root, settings, "sparseloco")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_sparseloco_equals_the_unsharded_run(sparseloco: dict) -> None:
    """A sharded island's ranks all-gather each accumulator and select from the whole tensor
    (sharded_sparseloco), so the payloads are the unsharded island's: the same global weights to round-off
    (measured: a max abs difference of 1.1e-8 over every weight, against 0.038 of training movement) and the
    same bytes per round, the payload travelling once per island, cut over its ranks."""
    (whole_dir, whole), (sharded_dir, sharded) = sparseloco["whole"], sparseloco["sharded"]
    _assert_same_run(whole_dir, whole, sharded_dir, sharded)
    a, b = _checkpoint(whole_dir, "model"), _checkpoint(sharded_dir, "model")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    assert sharded["exchanges"] == whole["exchanges"] == 3
    per_round = ring_allgather_bytes(whole["sparseloco_payload_bytes"], 2)
    assert sharded["bytes_sent_per_island"] == whole["bytes_sent_per_island"] == 3 * per_round
    assert sharded["sparseloco_payload_bytes"] == whole["sparseloco_payload_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_sparseloco_checkpoint_resumes_bit_for_bit(sparseloco: dict, tmp_path: Path) -> None:
    """Each rank checkpoints its rows of its island's error-feedback accumulator, and a run resumed at step 10
    writes the same files as the uninterrupted one; the ranks' rows hold the unsharded island's accumulator."""
    source, _ = sparseloco["sharded"]
    a = assert_resumes_bit_for_bit(source, tmp_path / "resumed", 10)
    whole = _every_file(sparseloco["whole"][0])
    rank0 = next(v for k, v in whole.items() if k.startswith("ranks/rank_00000/"))["strategy_island.error"]
    pieces = [next(v for k, v in a.items() if k.startswith(f"ranks/rank_0000{r}/"))["strategy_island.error"]
              for r in (0, 1)]
    assert pieces[0].numel() + pieces[1].numel() == rank0.numel() and pieces[0].numel() < rank0.numel()
    norm = float(pieces[0].square().sum() + pieces[1].square().sum())  # the rows in another order: the norm
    assert norm == pytest.approx(float(rank0.square().sum()), rel=1e-5) and norm > 0

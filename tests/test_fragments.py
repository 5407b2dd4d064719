"""Tests for atoll.algorithms.fragments: strided fragments and the staggered sync schedule."""

from __future__ import annotations

import random

import pytest
import torch

from atoll.algorithms.fragments import (
    Fragment,
    fragment_sync_steps,
    fragments_due,
    layer_index,
    split_fragments,
)


@pytest.fixture(scope="module")
def llama_names() -> list[str]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=4,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = transformers.LlamaForCausalLM(config)
    return [n for n, _ in model.named_parameters()]


@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4])
def test_cover_every_parameter_once(llama_names: list[str], num_fragments: int) -> None:
    frags = split_fragments(llama_names, num_fragments)
    assert [f.index for f in frags] == list(range(num_fragments))
    flat = [n for f in frags for n in f.param_names]
    assert sorted(flat) == sorted(llama_names) and len(flat) == len(llama_names)
    order = {n: i for i, n in enumerate(llama_names)}
    for f in frags:
        assert f.param_names, "no empty fragment"
        assert [order[n] for n in f.param_names] == sorted(order[n] for n in f.param_names)


@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4])
def test_layer_goes_to_l_mod_p(llama_names: list[str], num_fragments: int) -> None:
    frags = split_fragments(llama_names, num_fragments)
    where = {n: f.index for f in frags for n in f.param_names}
    for name in llama_names:
        parsed = layer_index(name)
        if parsed is not None:
            assert where[name] == parsed[1] % num_fragments, name
    assert where["model.embed_tokens.weight"] == 0
    assert where["model.norm.weight"] == num_fragments - 1
    if "lm_head.weight" in where:
        assert where["lm_head.weight"] == num_fragments - 1


def test_deterministic(llama_names: list[str]) -> None:
    a = split_fragments(llama_names, 3)
    b = split_fragments(list(llama_names), 3)
    assert a == b and all(isinstance(f, Fragment) for f in a)
    # a shuffled list gives the same layer assignment, with each fragment following the given order
    shuffled = list(llama_names)
    random.Random(0).shuffle(shuffled)
    c = split_fragments(shuffled, 3)
    where_a = {n: f.index for f in a for n in f.param_names if layer_index(n) is not None}
    where_c = {n: f.index for f in c for n in f.param_names if layer_index(n) is not None}
    assert where_a == where_c
    pos = {n: i for i, n in enumerate(shuffled)}
    for f in c:
        assert [pos[n] for n in f.param_names] == sorted(pos[n] for n in f.param_names)


def test_layer_patterns() -> None:
    assert layer_index("model.layers.12.self_attn.q_proj.weight") == ("model.layers", 12)
    assert layer_index("transformer.h.3.attn.c_attn.weight") == ("transformer.h", 3)
    assert layer_index("blocks.0.mlp.weight") == ("blocks", 0)
    assert layer_index("model.embed_tokens.weight") is None
    assert layer_index("model.layers_norm.weight") is None
    gpt2 = ["transformer.wte.weight", "transformer.wpe.weight"]
    gpt2 += [f"transformer.h.{i}.{p}" for i in range(6) for p in ("ln_1.weight", "attn.c_attn.weight")]
    gpt2 += ["transformer.ln_f.weight", "lm_head.weight"]
    frags = split_fragments(gpt2, 3)
    assert frags[0].param_names[:2] == ("transformer.wte.weight", "transformer.wpe.weight")
    assert frags[2].param_names[-2:] == ("transformer.ln_f.weight", "lm_head.weight")
    assert "transformer.h.4.ln_1.weight" in frags[1].param_names


def test_interleaved_non_layer_parameter_follows_previous_layer() -> None:
    names = ["emb", "blocks.0.w", "blocks.1.w", "shared_gate", "blocks.2.w", "blocks.3.w", "head"]
    frags = split_fragments(names, 2)
    assert frags[0].param_names == ("emb", "blocks.0.w", "blocks.2.w")
    assert frags[1].param_names == ("blocks.1.w", "shared_gate", "blocks.3.w", "head")


def test_no_layers_round_robin() -> None:
    names = ["a", "b", "c", "d", "e"]
    frags = split_fragments(names, 2)
    assert frags[0].param_names == ("a", "c", "e") and frags[1].param_names == ("b", "d")
    with pytest.raises(ValueError, match="fragments"):
        split_fragments(names, 6)


def test_bad_num_fragments(llama_names: list[str]) -> None:
    for bad in (0, -1, 5):
        with pytest.raises(ValueError, match="fragments"):
            split_fragments(llama_names, bad)
    with pytest.raises(ValueError, match="fragments"):
        split_fragments([], 1)
    with pytest.raises(ValueError, match="fragments"):
        split_fragments(["a", "a"], 1)


# -------------------------------------------------------------------------------------------------- schedule


@pytest.mark.parametrize("sync_every", [1, 5, 50])
def test_single_fragment_is_diloco(sync_every: int) -> None:
    assert fragment_sync_steps(1, sync_every) == [sync_every]
    due = [step for step in range(10 * sync_every) if fragments_due(step, 1, sync_every)]
    assert due == [k * sync_every - 1 for k in range(1, 11)]  # after H, 2H, ... completed steps
    assert all(fragments_due(step, 1, sync_every) == [0] for step in due)


@pytest.mark.parametrize(
    ("num_fragments", "sync_every"), [(1, 7), (2, 10), (3, 10), (4, 4), (4, 30), (7, 50)]
)
def test_each_fragment_once_per_window(num_fragments: int, sync_every: int) -> None:
    offsets = fragment_sync_steps(num_fragments, sync_every)
    assert offsets[-1] == sync_every and offsets == sorted(set(offsets)) and offsets[0] >= 1
    windows = 6
    seen: dict[int, list[int]] = {p: [] for p in range(num_fragments)}
    for step in range(windows * sync_every):
        due = fragments_due(step, num_fragments, sync_every)
        assert len(due) <= 1
        for p in due:
            seen[p].append(step)
    for p, steps in seen.items():
        assert len(steps) == windows
        assert [s // sync_every for s in steps] == list(range(windows))  # exactly once per window
        assert steps == [offsets[p] - 1 + k * sync_every for k in range(windows)]


def test_offsets_evenly_spread() -> None:
    assert fragment_sync_steps(2, 10) == [5, 10]
    assert fragment_sync_steps(4, 100) == [25, 50, 75, 100]
    assert fragment_sync_steps(3, 10) == [3, 7, 10]  # 3.33 -> 3, 6.67 -> 7
    assert fragment_sync_steps(4, 10) == [3, 5, 8, 10]  # 2.5 rounds up to 3, 7.5 to 8


def test_schedule_errors() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        fragment_sync_steps(4, 3)
    with pytest.raises(ValueError, match="sync_every"):
        fragments_due(0, 4, 3)
    with pytest.raises(ValueError, match="sync_every"):
        fragment_sync_steps(1, 0)
    with pytest.raises(ValueError, match="fragments"):
        fragment_sync_steps(0, 10)
    with pytest.raises(ValueError, match="step"):
        fragments_due(-1, 2, 10)


def test_flat_indices_cover_every_element_once_and_balance_the_tiny_model() -> None:
    from atoll.algorithms.fragments import fragment_flat_indices
    from atoll.job.model import build_model

    model = build_model("tiny", 4096, 128, seed=0)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    numel = sum(p.numel() for p in model.parameters())
    for p in (1, 2, 4):
        index = fragment_flat_indices(shapes, p)
        assert torch.equal(torch.sort(torch.cat(index)).values, torch.arange(numel))
        assert all(torch.equal(a, b) for a, b in zip(index, fragment_flat_indices(list(shapes), p), strict=True))
    sizes = [len(i) for i in fragment_flat_indices(shapes, 4)]
    assert sizes == [numel // 4] * 4, "4 layers, embedding and norm cut in 4 row blocks: equal fragments"
    # layer 1's parameters all land in fragment 1
    offset = 0
    idx1 = set(fragment_flat_indices(shapes, 4)[1].tolist())
    for name, param in model.named_parameters():
        if ".layers.1." in name:
            assert offset in idx1 and offset + param.numel() - 1 in idx1
        offset += param.numel()


def _old_pseudo_gradient_and_mix(global_frag, flat, idx, alpha):
    """The index path at d2f719d: Δ from a full copy indexed by int64 positions, the mix on a full copy."""
    delta = global_frag.to(torch.float32) - flat[idx].to(torch.float32)
    mixed = flat.clone()
    mixed[idx] = alpha * mixed[idx] + (1 - alpha) * global_frag
    return delta, mixed


@pytest.mark.parametrize("fragments", [1, 2, 3, 4])
def test_fragment_views_equal_the_index_path_bit_for_bit(fragments: int) -> None:
    from atoll.algorithms.fragments import FlatFragment, fragment_flat_indices, fragment_slices
    from atoll.job.island import Island
    from atoll.job.model import build_model

    model = build_model("tiny", 4096, 128, seed=0)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    index, views = fragment_flat_indices(shapes, fragments), fragment_slices(shapes, fragments)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    island = Island(0, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0))
    gen = torch.Generator().manual_seed(fragments)
    for idx, frag in zip(index, views, strict=True):
        assert torch.equal(frag.positions(), idx), "the same elements in the same order"
        assert FlatFragment.of_positions(idx) == FlatFragment(tuple(
            r for r in _merged(frag.ranges))), "ranges recovered from positions (adjacent ones joined)"
        flat = island.flat_params()
        assert torch.equal(frag.gather(flat), flat[idx])
        assert torch.equal(island.flat_params(frag), flat[idx])
        values = torch.randn(frag.numel(), generator=gen)
        expected = flat.clone()
        expected[idx] = values
        scattered = flat.clone()
        frag.scatter_(scattered, values)
        assert torch.equal(scattered, expected)
        # the exchange on the island's views against the old copy-and-index path, for every bit
        global_frag = flat[idx] + 1e-3 * torch.randn(frag.numel(), generator=gen)
        delta_old, mixed_old = _old_pseudo_gradient_and_mix(global_frag, flat, idx, 0.5)
        delta = island.pseudo_gradient(global_frag, frag)
        assert delta.dtype == torch.float32 and torch.equal(delta, delta_old)
        island.mix_params(global_frag, 0.5, frag)
        assert torch.equal(island.flat_params(), mixed_old)
        island.set_flat_params(global_frag, frag)
        expected = mixed_old.clone()
        expected[idx] = global_frag
        assert torch.equal(island.flat_params(), expected)
        island.set_flat_params(flat)
    with pytest.raises(ValueError, match="values"):
        views[0].scatter_(torch.zeros(sum(p.numel() for p in model.parameters())), torch.zeros(3))
    with pytest.raises(ValueError, match="fit"):
        views[-1].gather(torch.zeros(10))


def _merged(ranges):
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def test_fragment_views_hold_ranges_not_an_index_per_element() -> None:
    from atoll.algorithms.fragments import fragment_slices
    from atoll.job.model import build_model

    model = build_model("tiny", 4096, 128, seed=0)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    frags = fragment_slices(shapes, 4)
    assert sum(len(f.ranges) for f in frags) <= len(shapes) + 2 * 4, "about one range per parameter"
    assert sum(f.numel() for f in frags) == sum(p.numel() for p in model.parameters())

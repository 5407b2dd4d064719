"""Decoupled DiLoCo's merge rules as pure maths: radial-directional averaging per tensor, embeddings by the mean.

Hand-computed cases (arXiv:2604.21428, as third-party readings describe the merge): the mean of the pushes'
norms along the normalized mean of their unit directions.
"""

from __future__ import annotations

import math

import pytest
import torch

from atoll.algorithms.fragments import fragment_slices, layer_index
from atoll.algorithms.merge import is_embedding, radial_directional_mean, segmented_mean, weighted_mean


def test_two_orthogonal_pushes_of_norms_1_and_3() -> None:
    u1, u2 = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])
    merged = radial_directional_mean([1.0 * u1, 3.0 * u2])
    # norm 2 (the mean of 1 and 3) along (u1 + u2) / |u1 + u2|
    torch.testing.assert_close(merged, 2.0 * (u1 + u2) / math.sqrt(2.0))
    assert float(merged.norm()) == pytest.approx(2.0, abs=1e-6)
    # the plain mean shrinks: (u1 + 3 u2) / 2 has norm sqrt(10) / 2
    assert float(weighted_mean([u1, 3.0 * u2]).norm()) == pytest.approx(math.sqrt(10.0) / 2, abs=1e-6)


def test_weights_weigh_the_norms_and_the_directions() -> None:
    u1, u2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    merged = radial_directional_mean([u1, 3.0 * u2], weights=[1.0, 3.0])
    # mean norm (1 * 1 + 3 * 3) / 4 = 2.5; direction 1 * u1 + 3 * u2 = (1, 3) / sqrt(10)
    torch.testing.assert_close(merged, 2.5 * torch.tensor([1.0, 3.0]) / math.sqrt(10.0))


def test_equal_pushes_are_kept_and_no_norm_exceeds_the_largest() -> None:
    x = torch.tensor([0.3, -1.2, 2.0])
    torch.testing.assert_close(radial_directional_mean([x, x, x]), x)
    torch.testing.assert_close(radial_directional_mean([x, 2 * x]), 1.5 * x)  # aligned: the plain mean
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        xs = [torch.randn(16, generator=gen) * float(torch.rand(1, generator=gen) * 3) for _ in range(4)]
        w = torch.rand(4, generator=gen).tolist()
        merged = radial_directional_mean(xs, w)
        norms = [float(t.norm()) for t in xs]
        assert float(merged.norm()) == pytest.approx(sum(a * b for a, b in zip(w, norms, strict=True)) / sum(w),
                                                     rel=1e-5)
        assert float(merged.norm()) <= max(norms) + 1e-5


def test_zero_pushes_and_cancelling_directions() -> None:
    zero, up = torch.zeros(2), torch.tensor([0.0, 2.0])
    # a zero push has no direction: it adds its 0 to the mean norm (1) and nothing to the direction
    torch.testing.assert_close(radial_directional_mean([zero, up]), torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(radial_directional_mean([up, -up]), torch.zeros(2))
    torch.testing.assert_close(radial_directional_mean([zero, zero]), torch.zeros(2))


def test_bad_input_raises_value_error() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        radial_directional_mean([])
    with pytest.raises(ValueError, match="weights"):
        radial_directional_mean([torch.ones(2)], [-1.0])
    with pytest.raises(ValueError, match="weights"):
        radial_directional_mean([torch.ones(2), torch.ones(2)], [1.0])
    with pytest.raises(ValueError, match="shapes"):
        radial_directional_mean([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="out"):
        radial_directional_mean([torch.ones(2)], out=torch.zeros(3))


def test_segmented_mean_merges_each_tensor_by_its_rule() -> None:
    u1, u2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    a = torch.cat([u1, torch.tensor([1.0, 1.0]), u1])      # a tensor, an embedding block, another tensor
    b = torch.cat([u2, torch.tensor([3.0, -1.0]), 2 * u1])
    merged = segmented_mean([a, b], None, [(4, 6, True), (0, 2, True), (2, 4, False)])
    torch.testing.assert_close(merged[:2], torch.tensor([math.sqrt(2.0), math.sqrt(2.0)]))
    torch.testing.assert_close(merged[2:4], torch.tensor([2.0, 0.0]))  # the plain mean
    torch.testing.assert_close(merged[4:], torch.tensor([1.5, 0.0]))
    out = torch.empty(6)
    assert segmented_mean([a, b], [1.0, 1.0], [(0, 6, False)], out=out) is out
    torch.testing.assert_close(out, weighted_mean([a, b]))
    for bad in ([(0, 2, True), (3, 6, True)], [(0, 4, True), (2, 6, True)], [(0, 5, True)], []):
        with pytest.raises(ValueError, match="segments"):
            segmented_mean([a, b], None, bad)
    with pytest.raises(ValueError, match="flat"):
        segmented_mean([torch.ones(2, 3)], None, [(0, 6, True)])


def _embeddings_by_identity(model: torch.nn.Module) -> set[str]:
    tables = [m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
    return {n for n, p in model.named_parameters() if any(p is t for t in tables)}


def test_is_embedding_matches_the_models_own_embeddings() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    from atoll.job.model import build_model

    models = [build_model("nano", 256, 64, seed=0), build_model("1b", 256, 64, seed=0, meta=True),
              GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32)),
              GPTNeoXForCausalLM(GPTNeoXConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                               intermediate_size=32, vocab_size=64, tie_word_embeddings=False))]
    for model in models:
        names = [n for n, _ in model.named_parameters()]
        named = {n for n in names if is_embedding(n)}
        tables = _embeddings_by_identity(model)
        assert tables and tables <= named, f"{type(model).__name__}: {tables - named} not recognised"
        assert {n.rsplit(".", 2)[-2] for n in named - tables} <= {"wpe"}, "only position tables besides"
        assert not any(layer_index(n) is not None for n in named), "no layer's tensor is an embedding"
    assert {n for n, _ in models[1].named_parameters() if is_embedding(n)} == {"model.embed_tokens.weight",
                                                                                "lm_head.weight"}


def test_fragment_slices_name_their_tensors() -> None:
    from atoll.job.model import build_model

    model = build_model("nano", 256, 64, seed=0)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    sizes = {n: math.prod(s) for n, s in shapes}
    frags = fragment_slices(shapes, 4)
    seen: dict[str, int] = {}
    for frag in frags:
        segments = frag.tensor_segments()
        assert [a for a, _, _ in segments] == [0] + [b for _, b, _ in segments[:-1]]
        assert segments[-1][1] == frag.numel()
        for a, b, name in segments:
            seen[name] = seen.get(name, 0) + b - a
        assert sum(is_embedding(n) for _, _, n in segments) == 1  # its row block of the tied embedding
    assert seen == sizes, "every tensor's elements once, under its own name"
    assert frags[0].tensor_segments()[0][2] == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="names"):
        type(frags[0])(frags[0].ranges, ("x",) * (len(frags[0].ranges) + 1))

"""Tests for DeMo (atoll/algorithms/demo.py), its tiled DCT (dct.py) and its payload (demo_payload.py)."""

from __future__ import annotations

import copy
import dataclasses
import io
from pathlib import Path

import pytest
import torch

from atoll.algorithms.dct import ChunkedDCT, dct_basis, index_dtype_for, largest_divisor_at_most
from atoll.algorithms.demo import DeMo
from atoll.algorithms.demo_payload import DemoPayload, pack_ternary, payload_bytes, unpack_ternary
from atoll.config import build_config
from atoll.config.applies import applicable
from atoll.training import train


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)


def _backward(model: torch.nn.Module, seed: int) -> float:
    x, y = _batch(seed)
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


# ---- DCT --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 7, 8, 50, 64])
def test_dct_basis_orthonormal(n: int) -> None:
    b = dct_basis(n)
    assert b.shape == (n, n) and b.dtype == torch.float32
    assert torch.allclose(b @ b.T, torch.eye(n), atol=1e-5)
    assert torch.allclose(b.T @ b, torch.eye(n), atol=1e-5)


def test_dct_basis_is_dct2() -> None:
    # A constant vector has all its energy in the DC coefficient; a cosine at frequency 3 in coefficient 3.
    n = 16
    b = dct_basis(n)
    c = b @ torch.ones(n)
    assert c[0] == pytest.approx(n**0.5, rel=1e-5) and torch.allclose(c[1:], torch.zeros(n - 1), atol=1e-5)
    c3 = b @ b[3]
    assert torch.argmax(c3.abs()) == 3


def test_dct_basis_returns_copy() -> None:
    b = dct_basis(8)
    b.zero_()
    assert torch.allclose(dct_basis(8) @ dct_basis(8).T, torch.eye(8), atol=1e-5)


def test_largest_divisor() -> None:
    assert largest_divisor_at_most(4096, 64) == 64
    assert largest_divisor_at_most(100, 64) == 50
    assert largest_divisor_at_most(50, 64) == 50
    assert largest_divisor_at_most(97, 64) == 1
    assert largest_divisor_at_most(384, 64) == 64
    assert largest_divisor_at_most(12, 64) == 12


@pytest.mark.parametrize(
    "shape,tile,num_chunks",
    [
        ((128, 4096), (64, 64), 2 * 64),
        ((384, 128), (64, 64), 6 * 2),
        ((128,), (1, 64), 2),
        ((100, 50), (50, 50), 2),
        ((8, 3, 4, 4), (8, 48), 1),
        ((), (1, 1), 1),
        ((97, 64), (1, 64), 97),
    ],
)
def test_chunked_dct_round_trip(shape: tuple[int, ...], tile: tuple[int, int], num_chunks: int) -> None:
    t = ChunkedDCT(shape, 64)
    assert t.tile == tile and t.num_chunks == num_chunks and t.chunk_elems == tile[0] * tile[1]
    x = torch.randn(shape)
    c = t.encode(x)
    assert c.shape == (num_chunks, tile[0] * tile[1]) and c.dtype == torch.float32
    # orthonormal: energy preserved
    assert torch.allclose(c.square().sum(), x.square().sum(), rtol=1e-4)
    y = t.decode(c)
    assert y.shape == x.shape
    assert torch.allclose(y, x, atol=1e-5)


def test_chunked_dct_tile_is_local() -> None:
    # A spike in tile (1, 0) only produces coefficients in chunk 1 * (cols // w) + 0.
    t = ChunkedDCT((128, 128), 64)
    x = torch.zeros(128, 128)
    x[70, 5] = 1.0
    c = t.encode(x)
    nonzero_chunks = (c.abs() > 1e-7).any(dim=1).nonzero().flatten().tolist()
    assert nonzero_chunks == [2]


def test_chunked_dct_errors() -> None:
    with pytest.raises(ValueError, match="demo_chunk"):
        ChunkedDCT((4, 4), 0)
    t = ChunkedDCT((4, 4), 2)
    with pytest.raises(ValueError):
        t.encode(torch.zeros(4, 5))
    with pytest.raises(ValueError):
        t.decode(torch.zeros(3, 4))


@pytest.mark.parametrize("shape", [(128, 4096), (384, 128), (128,), (100, 50), (8, 3, 4, 4), (), (97, 64)])
def test_chunked_dct_into_buffers_gives_the_same_floats_and_decodes_in_place(shape: tuple[int, ...]) -> None:
    t = ChunkedDCT(shape, 64)
    x = torch.randn(shape)
    n = max(x.numel(), 1)
    buffers = [torch.full((n + 5,), 7.0) for _ in range(3)]  # longer than needed, holding garbage
    c = t.encode(x, buffers)
    assert c.data_ptr() == buffers[2].data_ptr() and torch.equal(c, t.encode(x))
    fresh = t.decode(t.encode(x))
    y = t.decode(c, buffers)  # its input in the buffer its output goes to: read first
    assert y.data_ptr() == buffers[2].data_ptr() and torch.equal(y, fresh)


def test_chunked_dct_refuses_buffers_that_do_not_fit() -> None:
    t = ChunkedDCT((16, 16), 8)
    x = torch.randn(16, 16)
    for buffers in ([torch.empty(256)] * 2, [torch.empty(256), torch.empty(255), torch.empty(256)],
                    [torch.empty(256, dtype=torch.float64)] * 3, [torch.empty(512)[::2]] * 3):
        with pytest.raises(ValueError, match="buffers must be 3 contiguous float32 tensors of at least 256"):
            t.encode(x, buffers)
    with pytest.raises(ValueError, match="on the input's device, cpu"):
        t.encode(x, [torch.empty(256), torch.empty(256, device="meta"), torch.empty(256)])
    same, big, store = torch.empty(256), torch.empty(800), torch.randn(16, 40)
    strided = store[:, :16]  # the input, a strided view: its storage holds the first buffer below
    for source, buffers in ((x, [same, same, torch.empty(256)]),
                            (x, [big[:256], big[1:257], big[513:769]]),  # overlapping, not the same start
                            (x, [x.view(-1), torch.empty(256), torch.empty(256)]),
                            (strided, [store.view(-1)[16:272], torch.empty(256), torch.empty(256)])):
        with pytest.raises(ValueError, match="must not overlap each other, nor the first two the input"):
            t.encode(source, buffers)
    raw = torch.zeros(512 + 3 * 1024, dtype=torch.uint8)  # a bf16 input right before the buffers, one storage
    low = raw[:512].view(torch.bfloat16).view(16, 16)
    low.copy_(x)
    after = [raw[512 + 1024 * i:512 + 1024 * (i + 1)].view(torch.float32) for i in range(3)]
    assert torch.equal(t.encode(low, after), t.encode(low))
    coeffs = t.encode(x)
    t.decode(coeffs.clone(), [torch.empty(256), torch.empty(256), coeffs])  # the third may hold the input


def test_kept_buffers_grow_for_a_larger_parameter_added_later() -> None:
    small, large = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(32, 32))
    opt = DeMo([small], lr=1e-2, chunk=8, topk=3)
    small.grad = torch.randn(8, 8)
    opt.step()
    assert opt.__dict__["_dct_buffers"][0].numel() == 64
    opt.add_param_group({"params": [large]})
    small.grad, large.grad = torch.randn(8, 8), torch.randn(32, 32)
    before = large.detach().clone()
    opt.step()
    assert opt.__dict__["_dct_buffers"][0].numel() == 1024 and not torch.equal(large, before)


@pytest.mark.parametrize("sign_values", [False, True])
def test_kept_buffers_give_the_fresh_tensors_floats_and_are_reused(monkeypatch, sign_values: bool) -> None:
    """On the CPU the DCT's intermediates go into three buffers the optimizer keeps: the same parameters,
    momenta and payloads as fresh tensors, over islands and steps, and the same buffers every step."""
    def run(kept: bool) -> tuple[list, list, list]:
        models = [_model(0), _model(0)]
        opts = [DeMo(m.parameters(), lr=1e-2, beta=0.9, chunk=8, topk=3, sign_values=sign_values) for m in models]
        if not kept:
            for opt in opts:
                monkeypatch.setattr(opt, "_buffers", lambda p: None)
        sent, buffers = [], []
        for step in range(4):
            for island, m in enumerate(models):
                _backward(m, seed=100 * island + step)
            payloads = [opt.encode_step() for opt in opts]
            sent += [(pl.indices.clone(), pl.values.clone()) for pls in payloads for pl in pls]
            for opt in opts:
                opt.apply_step(payloads)
            buffers.append([b.data_ptr() for b in opts[0].__dict__.get("_dct_buffers", [])])
        state = [opt.state[p]["momentum"].clone() for opt, m in zip(opts, models, strict=True) for p in m.parameters()]
        return [p.detach().clone() for m in models for p in m.parameters()] + state, sent, buffers

    kept, fresh = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(kept[0], fresh[0], strict=True))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(kept[1], fresh[1], strict=True))
    assert len(kept[2][0]) == 3 and all(b == kept[2][0] for b in kept[2])  # kept: allocated once, 16 x 32 each
    assert fresh[2][0] == []


# ---- step mechanics ---------------------------------------------------------------------------------


def test_full_topk_transmits_everything() -> None:
    # topk = chunk**2: nothing is dropped, so the residual momentum is ~0, the decoded payload equals the
    # momentum, and the update is exactly -lr * sign(momentum).
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 24))
    b = torch.nn.Parameter(torch.randn(24))
    opt = DeMo([p, b], lr=0.01, beta=0.9, chunk=8, topk=64)
    p0, b0 = p.detach().clone(), b.detach().clone()
    p.grad, b.grad = torch.randn(16, 24), torch.randn(24)
    m_before = [0.01 * p.grad, 0.01 * b.grad]  # first step: m = 0 * beta + lr * g (bloc97/DeMo)
    payloads = opt.encode_step()
    for param, pl, m in zip([p, b], payloads, m_before, strict=True):
        assert torch.allclose(opt.state[param]["momentum"], torch.zeros_like(m), atol=1e-7)
        assert torch.allclose(opt.decode_payload(pl), m, atol=1e-7)
    opt.apply_step([payloads])
    assert torch.equal(p.detach(), p0 - 0.01 * torch.sign(m_before[0]))
    assert torch.equal(b.detach(), b0 - 0.01 * torch.sign(m_before[1]))


def test_conservation_at_small_topk() -> None:
    # transmitted + residual == momentum before removal, at every step.
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(64, 96))
    v = torch.nn.Parameter(torch.randn(100))
    opt = DeMo([p, v], lr=1e-3, beta=0.9, chunk=16, topk=5)
    for step in range(3):
        grads = [torch.randn_like(p), torch.randn_like(v)]
        expected = []
        for param, g in zip([p, v], grads, strict=True):
            prev = opt.state[param]["momentum"].clone() if step else torch.zeros_like(param)
            expected.append(0.9 * prev + 1e-3 * g)  # lr-weighted momentum (bloc97/DeMo)
            param.grad = g
        payloads = opt.encode_step()
        for param, pl, m in zip([p, v], payloads, expected, strict=True):
            residual = opt.state[param]["momentum"]
            assert torch.allclose(opt.decode_payload(pl) + residual, m, atol=1e-8)
            assert not torch.allclose(residual, torch.zeros_like(residual), atol=1e-6)  # something stays
            assert pl.k == 5
        opt.apply_step([payloads])
        assert opt.step_count == step + 1


def test_topk_selects_largest_coefficients() -> None:
    t = ChunkedDCT((8, 8), 8)
    p = torch.nn.Parameter(torch.zeros(8, 8))
    opt = DeMo([p], chunk=8, topk=3, beta=0.5)
    coeffs = torch.zeros(1, 64)
    coeffs[0, [5, 17, 40]] = torch.tensor([3.0, -4.0, 2.5])
    coeffs[0, [1, 2]] = torch.tensor([0.1, -0.2])
    p.grad = t.decode(coeffs)
    (pl,) = opt.encode_step()
    assert pl.indices.dtype == torch.int8
    order = torch.argsort(pl.indices.long().flatten())
    assert pl.indices.flatten()[order].tolist() == [5, 17, 40]
    # the momentum holds lr * g (lr 1e-3, the default)
    assert torch.allclose(pl.values.flatten()[order], 1e-3 * torch.tensor([3.0, -4.0, 2.5]), atol=1e-8)


def test_grad_none_counts_as_zero_and_no_grads_raises() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    q = torch.nn.Parameter(torch.randn(4))
    opt = DeMo([p, q], chunk=4, topk=2)
    with pytest.raises(RuntimeError, match="backward"):
        opt.encode_step()
    p.grad = torch.randn(4, 4)
    payloads = opt.encode_step()
    assert len(payloads) == 2 and torch.count_nonzero(payloads[1].values) == 0
    q0 = q.detach().clone()
    opt.apply_step([payloads])
    assert torch.equal(q.detach(), q0)  # sign(0) == 0: no movement


# ---- bytes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,expected",
    [
        ((128, 4096), 128 * 32 * (2 + 4)),
        ((384, 128), 12 * 32 * (2 + 4)),
        ((128,), 2 * 32 * (1 + 4)),  # 1-D chunks of 64 elements: int8 indices
        ((100, 50), 2 * 32 * (2 + 4)),  # 50 x 50 tiles of 2500 elements
        ((7,), 1 * 7 * (1 + 4)),  # tile of 7 < topk: k clamped to 7
    ],
)
def test_bytes_per_step_matches_formula(shape: tuple[int, ...], expected: int) -> None:
    assert payload_bytes(shape, chunk=64, topk=32) == expected
    p = torch.nn.Parameter(torch.randn(shape))
    opt = DeMo([p], chunk=64, topk=32)
    assert opt.bytes_per_step() == expected
    p.grad = torch.randn(shape)
    (pl,) = opt.encode_step()
    assert isinstance(pl, DemoPayload) and pl.nbytes == expected


@pytest.mark.parametrize("sign_values", [False, True])
@pytest.mark.parametrize(
    "shape,chunk,topk",
    [
        ((128, 4096), 64, 32),
        ((100, 50), 64, 32),  # 50 x 50 tiles
        ((97, 64), 64, 32),  # prime rows: 97 tiles of 1 x 64, int8 indices
        ((128,), 64, 32),  # 1-D
        ((7,), 64, 32),  # 1-D, k clamped to 7: 7 values, 2 packed bytes
        ((5,), 64, 3),  # 3 values: one packed byte, one code of padding
        ((8, 3, 4, 4), 64, 5),  # ndim > 2: one 8 x 48 tile, 5 values
        ((6, 10), 4, 3),  # 3 x 2 tiles of 2 x 5: 10 chunks x 3 = 30 values, 8 packed bytes
        ((), 64, 32),  # a scalar: one tile of 1
    ],
)
def test_nbytes_equals_payload_bytes(shape: tuple[int, ...], chunk: int, topk: int, sign_values: bool) -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape))
    opt = DeMo([p], chunk=chunk, topk=topk, sign_values=sign_values)
    p.grad = torch.randn(shape)
    (pl,) = opt.encode_step()
    expected = payload_bytes(shape, chunk=chunk, topk=topk, sign_values=sign_values)
    assert pl.nbytes == expected == opt.bytes_per_step()
    t = ChunkedDCT(shape, chunk)
    n = t.num_chunks * min(topk, t.chunk_elems)
    index_bytes = pl.indices.element_size()
    assert expected == n * index_bytes + ((n + 3) // 4 if sign_values else 4 * n)
    if sign_values:
        assert pl.values.dtype == torch.uint8 and tuple(pl.values.shape) == ((n + 3) // 4,)
    else:
        assert pl.values.dtype == torch.float32 and tuple(pl.values.shape) == (t.num_chunks, pl.k)


def test_bytes_per_step_model_and_sign_mode() -> None:
    per_mode = {}
    for sign_values in (False, True):
        model = _model()
        opt = DeMo(model.parameters(), chunk=8, topk=4, sign_values=sign_values)
        _backward(model, 0)
        payloads = opt.encode_step()
        assert sum(pl.nbytes for pl in payloads) == opt.bytes_per_step()
        value_dtype = torch.uint8 if sign_values else torch.float32
        assert all(pl.values.dtype == value_dtype and pl.sign_values == sign_values for pl in payloads)
        per_mode[sign_values] = opt.bytes_per_step()
    assert per_mode[True] < per_mode[False]
    # per kept coefficient: int16 index + float32 value = 6 bytes vs int16 + 2-bit sign = 2.25 bytes
    # (128 x 128: 4 tiles of 64 x 64, 4 x 32 = 128 kept coefficients)
    assert payload_bytes((128, 128), topk=32) == 128 * 6
    assert payload_bytes((128, 128), topk=32, sign_values=True) == 128 * 2 + 128 // 4


# ---- packed sign values -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 63, 1001])
def test_pack_ternary_round_trip(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    values = torch.randint(-1, 2, (n,), generator=g, dtype=torch.int8)
    packed = pack_ternary(values)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == ((n + 3) // 4,)
    assert torch.equal(unpack_ternary(packed, n), values)
    # float input of any shape (what torch.sign gives), flattened row-major
    values2d = torch.randint(-1, 2, (n, 3), generator=g).to(torch.float32)
    assert torch.equal(unpack_ternary(pack_ternary(values2d), 3 * n), values2d.reshape(-1).to(torch.int8))


def test_pack_ternary_layout_and_zeros() -> None:
    # value j in bits 2j..2j+1; 0 -> 00, +1 -> 01, -1 -> 11; padding codes are 0
    assert pack_ternary(torch.tensor([1, -1, 0, 1, -1])).tolist() == [0b01_00_11_01, 0b11]
    for n in (1, 3, 4, 5, 9):  # every single value of each kind, at every position in a byte
        for v in (-1, 0, 1):
            values = torch.full((n,), v, dtype=torch.int8)
            assert torch.equal(unpack_ternary(pack_ternary(values), n), values)
    # an all-zero chunk stays zero on the wire (no spurious +1 as one bit per value would send)
    assert torch.count_nonzero(pack_ternary(torch.zeros(10))) == 0


def test_unpack_ternary_errors() -> None:
    with pytest.raises(ValueError, match="bytes"):
        unpack_ternary(torch.zeros(2, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bytes"):
        unpack_ternary(torch.zeros(2, dtype=torch.int8), 8)
    with pytest.raises(ValueError, match="corrupt"):
        unpack_ternary(torch.tensor([0b10], dtype=torch.uint8), 1)
    # padding bits beyond numel are not read
    assert unpack_ternary(torch.tensor([0b10_00_00_01], dtype=torch.uint8), 3).tolist() == [1, 0, 0]


def test_packed_signs_decode_like_int8_signs() -> None:
    # The packed form is a lossless encoding: a sign optimizer's payloads carry the same indices and
    # sign(values) as a float32 optimizer in the same state, and applying them moves the parameters exactly
    # as int8 signs sent as values would ("int8": a float32 optimizer whose payloads are replaced by int8
    # signs, the wire format before packing; it stays in the sign optimizer's state at every step).
    models = {mode: _model(7) for mode in ("float", "sign", "int8")}
    opts = {mode: DeMo(m.parameters(), lr=1e-2, beta=0.9, chunk=8, topk=4, sign_values=mode == "sign")
            for mode, m in models.items()}
    for step in range(4):
        payloads = {}
        for mode, m in models.items():
            _backward(m, seed=step)
            payloads[mode] = opts[mode].encode_step()
        for f, sg in zip(payloads["int8"], payloads["sign"], strict=True):
            assert torch.equal(f.indices, sg.indices)
            assert torch.equal(sg.dense_values(), torch.sign(f.values))
        payloads["int8"] = [DemoPayload(indices=pl.indices, values=torch.sign(pl.values).to(torch.int8),
                                        shape=pl.shape, chunk_elems=pl.chunk_elems)
                            for pl in payloads["int8"]]
        opts["sign"].apply_step([payloads["sign"]])
        opts["int8"].apply_step([payloads["int8"]])
        opts["float"].apply_step([payloads["float"]])
        for a, b in zip(models["sign"].parameters(), models["int8"].parameters(), strict=True):
            assert torch.equal(a, b)
    # float values give another trajectory (what the sign step sees differs): the test is not vacuous
    assert any(not torch.equal(a, b) for a, b in zip(models["sign"].parameters(), models["float"].parameters(),
                                                      strict=True))


def test_index_dtype() -> None:
    assert index_dtype_for(64) == torch.int8
    assert index_dtype_for(128) == torch.int8
    assert index_dtype_for(129) == torch.int16
    assert index_dtype_for(4096) == torch.int16
    assert index_dtype_for(32768) == torch.int16
    assert index_dtype_for(32769) == torch.int32


# ---- islands, training, resume ----------------------------------------------------------------------


def test_two_islands_lockstep_identical_params() -> None:
    models = [_model(0), _model(0)]
    opts = [DeMo(m.parameters(), lr=1e-2, beta=0.9, chunk=8, topk=4) for m in models]
    for step in range(5):
        for island, m in enumerate(models):
            _backward(m, seed=100 * island + step)  # different data per island
        payloads = [opt.encode_step() for opt in opts]
        for opt in opts:
            opt.apply_step(payloads)
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a, b)
    # momenta are decoupled: they differ between islands
    p0, p1 = next(models[0].parameters()), next(models[1].parameters())
    assert not torch.equal(opts[0].state[p0]["momentum"], opts[1].state[p1]["momentum"])


@pytest.mark.parametrize("sign_values", [False, True])
def test_signs_decoded_once_give_every_island_the_floats_of_its_own_decode(sign_values: bool) -> None:
    """Islands in one process decode the islands' mean once (``decoded_signs``, int8) and each applies it
    (``apply_step(updates=)``): the same parameters, bit for bit, as every island decoding its own, with weight
    decay; the signs are those of the decode; a wrong number of updates is refused."""
    def run(shared: bool) -> list[torch.Tensor]:
        models = [_model(0), _model(0), _model(0)]
        opts = [DeMo(m.parameters(), lr=1e-2, beta=0.9, chunk=8, topk=3, weight_decay=0.1,
                     sign_values=sign_values) for m in models]
        for step in range(4):
            for island, m in enumerate(models):
                _backward(m, seed=100 * island + step)
            payloads = [opt.encode_step() for opt in opts]
            signs = opts[0].decoded_signs(payloads) if shared else None
            if signs is not None:
                assert all(s.dtype == torch.bfloat16 and s.shape == p.shape
                           for s, p in zip(signs, models[0].parameters(), strict=True))
                assert set(torch.cat([s.flatten() for s in signs]).tolist()) <= {-1, 0, 1}
            for opt in opts:
                opt.apply_step(payloads, signs)
        return [p.detach().clone() for m in models for p in m.parameters()]

    once, each = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(once, each, strict=True))
    model = _model()
    opt = DeMo(model.parameters(), chunk=8, topk=4)
    _backward(model, 0)
    payloads = opt.encode_step()
    signs = opt.decoded_signs([payloads])
    with pytest.raises(ValueError, match="3 updates of shapes .* expected one per parameter of its shape"):
        opt.apply_step([payloads], signs[:3])
    with pytest.raises(ValueError, match=r"4 updates of shapes \[\(16, 32\), \(16,\), \(4,\), \(4,\)\]"):
        opt.apply_step([payloads], [signs[0], signs[1], signs[2].flatten()[:4], signs[3]])  # (4, 16) expected
    # a mean that is not finite (float values, a momentum that overflowed): the same step as each island's own
    # decode (torch's sign of a NaN is 0)
    payloads[0] = dataclasses.replace(payloads[0], values=torch.full_like(payloads[0].values, float("nan")))
    twin = copy.deepcopy(model)
    DeMo(twin.parameters(), chunk=8, topk=4).apply_step([payloads, payloads])
    opt.apply_step([payloads, payloads], opt.decoded_signs([payloads, payloads]))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_step_uses_all_gather_fn() -> None:
    # An all-gather that returns two identical copies averages to the same update as one island.
    calls: list[int] = []

    def gather(payloads: list[DemoPayload]) -> list[list[DemoPayload]]:
        calls.append(len(payloads))
        return [payloads, payloads]

    m1, m2 = _model(3), _model(3)
    o1 = DeMo(m1.parameters(), lr=1e-2, chunk=8, topk=4, all_gather_fn=gather)
    o2 = DeMo(m2.parameters(), lr=1e-2, chunk=8, topk=4)
    for step in range(3):
        _backward(m1, step)
        _backward(m2, step)
        o1.step()
        o2.step()
    assert calls == [4, 4, 4]
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.allclose(a, b)


def test_apply_step_rejects_bad_gather() -> None:
    model = _model()
    opt = DeMo(model.parameters(), chunk=8, topk=4)
    _backward(model, 0)
    payloads = opt.encode_step()
    with pytest.raises(ValueError, match="empty"):
        opt.apply_step([])
    with pytest.raises(ValueError, match="expected 4"):
        opt.apply_step([payloads[:2]])
    with pytest.raises(ValueError, match="shape"):
        opt.apply_step([list(reversed(payloads))])


def test_apply_step_checks_every_packed_sign_at_once_before_any_parameter_changes(monkeypatch) -> None:
    model = _model()
    opt = DeMo(model.parameters(), chunk=8, topk=4, sign_values=True)
    _backward(model, 0)
    payloads = opt.encode_step()
    before = [p.detach().clone() for p in model.parameters()]
    bad = list(payloads)  # the last parameter's signs of island 1 hold the unused code 0b10
    bad[-1] = dataclasses.replace(bad[-1], values=torch.full_like(bad[-1].values, 0b10_10_10_10))
    with pytest.raises(ValueError, match="island 1 sent packed signs with the unused code 0b10; the payload is "
                                         "corrupt"):
        opt.apply_step([payloads, bad])
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    reads = []  # a healthy step: one read of a flag for every payload of every island
    original = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or original(t))
    opt.apply_step([payloads, payloads])
    assert len(reads) == 1 and not all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_trains_least_squares() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    w_true = torch.randn(32, 8)
    y = x @ w_true
    w = torch.nn.Parameter(torch.zeros(32, 8))
    opt = DeMo([w], lr=0.02, beta=0.9, chunk=8, topk=16)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (x @ w - y).square().mean()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(300):
        opt.step(closure)
    final = (x @ w - y).square().mean().item()
    assert final < 0.05 * first


def test_sign_values_still_trains() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = x @ torch.randn(32, 8)
    w = torch.nn.Parameter(torch.zeros(32, 8))
    opt = DeMo([w], lr=0.02, beta=0.9, chunk=8, topk=16, sign_values=True)
    first = (x @ w - y).square().mean().item()
    for _ in range(300):
        opt.zero_grad()
        (x @ w - y).square().mean().backward()
        opt.step()
    assert (x @ w - y).square().mean().item() < 0.1 * first


def test_weight_decay_decoupled() -> None:
    p = torch.nn.Parameter(torch.full((4, 4), 2.0))
    opt = DeMo([p], lr=0.1, weight_decay=0.5, chunk=4, topk=16)
    p.grad = torch.zeros(4, 4)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((4, 4), 2.0 * (1 - 0.1 * 0.5)))


def _run(model: torch.nn.Module, opt: DeMo, steps: range) -> None:
    for s in steps:
        _backward(model, s)
        opt.step()


@pytest.mark.parametrize("sign_values", [False, True])
def test_state_dict_resume_bitwise(sign_values: bool) -> None:
    kwargs = {"lr": 1e-2, "beta": 0.95, "chunk": 8, "topk": 4, "weight_decay": 0.1, "sign_values": sign_values}
    ref_model = _model(5)
    ref_opt = DeMo(ref_model.parameters(), **kwargs)
    _run(ref_model, ref_opt, range(0, 10))

    a_model = _model(5)
    a_opt = DeMo(a_model.parameters(), **kwargs)
    _run(a_model, a_opt, range(0, 4))
    buf = io.BytesIO()
    torch.save({"model": a_model.state_dict(), "opt": a_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert a_opt.step_count == 4
    assert all(v["momentum"].dtype == torch.float32 for v in saved["opt"]["state"].values())

    b_model = _model(99)  # different init: everything must come from the checkpoint
    b_opt = DeMo(b_model.parameters(), **kwargs)
    b_model.load_state_dict(saved["model"])
    b_opt.load_state_dict(saved["opt"])
    assert b_opt.step_count == 4
    _run(b_model, b_opt, range(4, 10))
    for r, b in zip(ref_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(r, b)
    assert b_opt.step_count == 10


def test_load_does_not_alias_and_keeps_fp32_momentum() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = DeMo([p], chunk=8, topk=4)
    p.grad = torch.randn(8, 8, dtype=torch.bfloat16)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = DeMo([p], chunk=8, topk=4)
    opt2.load_state_dict(sd)
    assert opt2.state[p]["momentum"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["momentum"], sd["state"][0]["momentum"])
    p.grad = torch.randn(8, 8, dtype=torch.bfloat16)
    opt2.step()
    assert int(sd["state"][0]["step"]) == 1 and opt2.step_count == 2


def test_load_rejects_other_wire_format() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = DeMo([p], chunk=8, topk=4)
    with pytest.raises(ValueError, match="topk"):
        DeMo([p], chunk=8, topk=5).load_state_dict(opt.state_dict())


# ---- configuration errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"topk": 0}, "demo_topk"),
        ({"topk": 4097}, "demo_topk"),
        ({"chunk": 4, "topk": 17}, "demo_topk"),
        ({"topk": 2.5}, "demo_topk"),
        ({"chunk": 0}, "demo_chunk"),
        ({"chunk": True}, "demo_chunk"),
        ({"beta": 1.0}, "demo_beta"),
        ({"beta": -0.1}, "demo_beta"),
        ({"beta": float("nan")}, "demo_beta"),
        ({"lr": 0.0}, "lr"),
        ({"lr": -1e-3}, "lr"),
        ({"lr": "fast"}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"sign_values": 1}, "sign_values"),
    ],
)
def test_config_errors(kwargs: dict, field: str) -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=field) as info:
        DeMo([p], **kwargs)
    assert "\n" not in str(info.value)


def test_param_group_cannot_change_wire_format() -> None:
    a, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="demo_topk"):
        DeMo([{"params": [a]}, {"params": [b], "topk": 3}], chunk=4, topk=2)
    opt = DeMo([{"params": [a]}, {"params": [b], "lr": 0.5, "beta": 0.5}], chunk=4, topk=2)
    assert opt.param_groups[1]["lr"] == 0.5
    c = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": [c], "lr": -1.0})
    assert len(opt.param_groups) == 2  # the bad group was not kept
    with pytest.raises(ValueError, match="demo_beta"):
        DeMo([{"params": [a], "beta": 2.0}], chunk=4, topk=2)
    with pytest.raises(ValueError, match="demo_topk"):
        payload_bytes((4, 4), chunk=4, topk=17)


def test_demo_defaults_to_a_constant_rate_after_warmup() -> None:
    from atoll.strategies.registry import spec

    # sign-SGD's best schedule in bench/demo_sweep.py; AdamW keeps its cosine decay; an explicit value wins
    assert build_config(overrides={"strategy": "demo"}).min_lr_ratio == spec("demo").defaults["min_lr_ratio"] == 1.0
    assert build_config(overrides={"strategy": "diloco"}).min_lr_ratio == 0.1
    assert build_config(overrides={"strategy": "demo", "min_lr_ratio": 0.1}).min_lr_ratio == 0.1


@pytest.mark.slow
@pytest.mark.parametrize("sign_values", [False, True])
def test_run_bytes_per_step_equal_the_formula(fast_config: dict, sign_values: bool) -> None:
    # a real run (2 islands, local runtime): each step all-gathers one payload per parameter to K-1 = 1 peer
    from transformers import AutoModelForCausalLM

    config = build_config(overrides=applicable({**fast_config, "strategy": "demo", "steps": 4, "eval_every": 4,
                                                "checkpoint_every": 4, "demo_sign_values": sign_values}))
    summary = train(config)
    model = AutoModelForCausalLM.from_pretrained(Path(fast_config["out"]) / "checkpoints" / "step_0000004" / "model")
    own = config.strategy_config
    per_step = sum(payload_bytes(p.shape, own.demo_chunk, own.demo_topk, sign_values)
                   for p in model.parameters())
    assert summary["bytes_sent_per_island"] == 4 * (config.islands - 1) * per_step
    assert summary["bytes_received_per_island"] == summary["bytes_sent_per_island"]  # the all-gather's other half
    assert summary["exchanges"] == 4


def test_demo_defaults_to_packed_sign_values_and_a_flag_turns_them_off() -> None:
    from atoll.cli import build_parser

    # the best of bench/demo_sweep.py; the DeMo optimizer itself keeps DeMo's float32 values by default
    assert build_config(overrides={"strategy": "demo"}).strategy_config.demo_sign_values is True
    off = build_config(overrides={"strategy": "demo", "demo_sign_values": False})
    assert off.strategy_config.demo_sign_values is False
    assert build_parser().parse_args(["train", "--no-demo-sign-values"]).demo_sign_values is False
    assert build_parser().parse_args(["train", "--demo-sign-values"]).demo_sign_values is True
    assert DeMo([torch.nn.Parameter(torch.zeros(2))]).sign_values is False


# --- the reference's rules (bloc97/DeMo), on small hand-computed cases ---------------------------------------


def test_momentum_accumulates_the_learning_rate_times_the_gradient() -> None:
    # bloc97/DeMo: delta = decay * delta + lr * grad; with 1x1 tiles (chunk 1) the payload is the momentum itself
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DeMo([p], lr=0.1, beta=0.5, chunk=1, topk=1)
    p.grad = torch.tensor([1.0, -2.0])
    sent = opt.encode_step()[0]
    torch.testing.assert_close(sent.values.flatten(), torch.tensor([0.1, -0.2]), rtol=0, atol=0)
    opt.param_groups[0]["lr"] = 0.4  # a scheduler's next rate: the new gradient weighs 0.4, the old nothing left
    p.grad = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(opt.encode_step()[0].values.flatten(), torch.tensor([0.4, 0.4]), rtol=0, atol=0)


def test_each_coefficient_is_averaged_over_the_islands_that_selected_it() -> None:
    # one 4-vector, one DCT chunk of 4, top-2: island A sends coefficients {0, 1} = (1, 1), island B {0, 2} =
    # (1, 0). The reference's mean: c = (1, 1, 0, 0); x = B.T c = 0.5 + (0.653, 0.271, -0.271, -0.653) has
    # signs (+, +, +, -). Dividing by both islands, c = (1, 0.5, 0, 0), every sign is +.
    p = torch.nn.Parameter(torch.zeros(4))
    opt = DeMo([p], lr=1.0, beta=0.9, chunk=4, topk=2)

    def sent(idx: list[int], vals: list[float]) -> DemoPayload:
        return DemoPayload(indices=torch.tensor([idx], dtype=torch.int8), values=torch.tensor([vals]),
                           shape=(4,), chunk_elems=4)

    opt.apply_step([[sent([0, 1], [1.0, 1.0])], [sent([0, 2], [1.0, 0.0])]])
    assert p.detach().tolist() == [-1.0, -1.0, -1.0, 1.0]


def test_dct_basis_entries_zero_in_exact_arithmetic_are_exactly_zero() -> None:
    # n = 6: basis[k, i] ~ cos(pi (2i + 1) k / 12) vanishes exactly at k = 2, i = 1 and i = 4 (cos(pi/2),
    # cos(3 pi/2)); cos() in floating point gives about 1e-17, and sign() of that took a full step
    basis = dct_basis(6)
    assert basis[2, 1].item() == 0.0 and basis[2, 4].item() == 0.0
    assert int((basis == 0).sum()) == 2
    assert int((dct_basis(64) == 0).sum()) == 0  # a power of two has none
    p = torch.nn.Parameter(torch.zeros(6))
    opt = DeMo([p], lr=1.0, beta=0.9, chunk=6, topk=1)
    opt.apply_step([[DemoPayload(indices=torch.tensor([[2]], dtype=torch.int8), values=torch.tensor([[1.0]]),
                                 shape=(6,), chunk_elems=6)]])
    assert p.detach()[1].item() == 0.0 and p.detach()[4].item() == 0.0  # sign(0) = 0: no step there
    assert int((p.detach() != 0).sum()) == 4


def test_islands_in_one_process_decode_the_mean_once_and_each_is_charged_the_decode(monkeypatch) -> None:
    """The local runtime's DeMo step decodes the islands' mean once per parameter for all its islands, not once per
    island, and charges every island (at its speed) the decode's seconds, as an island alone would spend them:
    here a decode made to take at least 0.05 s."""
    from conftest import make_island

    from atoll.config import TrainConfig
    from atoll.job.model import build_model
    from atoll.runtime.local import LocalComm
    from atoll.runtime.network import Link, SimClock
    from atoll.strategies.demo import DeMoStrategy, make_optimizer

    config = TrainConfig(**applicable({"strategy": "demo", "islands": 3, "steps": 4, "warmup_steps": 0,
                                       "seq_len": 16, "batch_size": 2}), demo_chunk=16, demo_topk=8)
    model = build_model("micro", 300, 16, seed=0)
    clock = SimClock(3)
    speeds = (1.0, 0.5, 0.25)
    islands = [make_island(i, copy.deepcopy(model), config, clock, speed=speeds[i], optimizer=make_optimizer)
               for i in range(3)]
    strategy = DeMoStrategy(config.strategy_config, islands, LocalComm(3, Link.from_config(100, 10), clock),
                            config.seed)
    decodes, real = [], DeMo._decoded_sign

    def counted(self, p, gathered, i):  # noqa: ANN001, ANN202
        decodes.append(i)
        return real(self, p, gathered, i)

    signs = DeMo.decoded_signs

    def slow(self, gathered):  # noqa: ANN001, ANN202
        import time

        time.sleep(0.05)
        return signs(self, gathered)

    monkeypatch.setattr(DeMo, "_decoded_sign", counted)
    monkeypatch.setattr(DeMo, "decoded_signs", slow)
    for step in range(2):
        for island in islands:
            island.forward_backward(torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(step)))
        strategy.step(step)
    n = len(list(model.parameters()))
    assert decodes == list(range(n)) * 2  # once per parameter and step, for the 3 islands
    flats = [island.flat_params() for island in islands]
    assert all(torch.equal(f, flats[0]) for f in flats)
    assert all(island.compute_s >= 2 * 0.05 / speed for island, speed in zip(islands, speeds, strict=True))

"""A layer's experts laid out at once (models/expert_layout.py) are, expert by expert, the matrix the per-matrix
layout (`CodedLinear` over the expert's codes and scales) makes: the same numbers, the same products bit for bit,
the packed codes the same bytes, and the bytes `expert_nbytes` counts before a load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmhead.kernels import native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear, SubScales, coded_available
from lmhead.models.expert_layout import build_experts, expert_nbytes, pack_codes, pack_nibbles
from lmhead.models.gguf_codes import block_scales, block_subscales
from lmhead.models.gguf_file import block_codes
from lmhead.models.quant_types import LEVELS, TYPES

pytestmark = pytest.mark.skipif(not coded_available(), reason="no C compiler for the coded kernel")


def _blocks(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random blocks of `kind` holding rows [rows, k], as a file holds them ([rows, bytes a row]): random bits, the
    float16 fields a small number, MXFP4's exponents near a real file's."""
    t = TYPES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // t.block, t.nbytes), dtype=np.uint8)
    for at in t.f16_at:
        blocks[:, at:at + 2] = rng.normal(0.01, 0.003, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    for at in t.e8m0_at:
        blocks[:, at] = rng.integers(118, 126, len(blocks))
    return blocks.reshape(rows, -1)


def _one_matrix(kind: str, blocks: np.ndarray, n: int, k: int) -> CodedLinear:
    """The per-matrix layout of rows [n, k] of raw blocks."""
    b = blocks.reshape(-1, TYPES[kind].nbytes)
    s, o = block_scales(kind, b)
    return CodedLinear(torch.from_numpy(block_codes(kind, b).reshape(n, k)), torch.from_numpy(s.reshape(n, -1)),
                       None if o is None else torch.from_numpy(o.reshape(n, -1)), four_bit=TYPES[kind].four_bit)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_each_expert_laid_out_at_once_is_the_matrix_its_codes_make_alone(kind):
    experts, f, k = 3, 8, 512
    gate, up = _blocks(kind, experts * f, k, 0), _blocks(kind, experts * f, k, 1)
    held = build_experts(kind, [gate, up], [f, f], experts, k)
    assert len(held) == experts and held.nbytes == expert_nbytes(kind, experts, 2 * f, k, [f, f])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    for e in range(experts):
        rows = np.concatenate([gate[e * f:(e + 1) * f], up[e * f:(e + 1) * f]])
        alone = _one_matrix(kind, rows, 2 * f, k)
        got = held[e]
        assert (got.four_bit, got.rows4, got.packed) == (alone.four_bit, alone.rows4, alone.packed)
        assert torch.equal(got.dequantize(), alone.dequantize())
        for m in (1, 5):  # one decode row, and several rows of one expert's group
            assert torch.equal(held.product(e, x[:m]), alone(x[:m]))
    assert held.sub == (TYPES[kind].subscales is not None)  # every K-quant's scales as its blocks hold them


def _one_matrix_by_groups(kind: str, blocks: np.ndarray, n: int, k: int) -> CodedLinear:
    """The per-matrix layout by groups of rows [n, k] of raw blocks, as a file's body matrix is read: a K-quant's
    scales as its blocks hold them (`SubScales`), the others' as float32 numbers."""
    t, b = TYPES[kind], blocks.reshape(-1, TYPES[kind].nbytes)
    codes = torch.from_numpy(block_codes(kind, b).reshape(n, k))
    if t.subscales is None:
        s, o = block_scales(kind, b)
        return CodedLinear(codes, torch.from_numpy(s.reshape(n, -1)),
                           None if o is None else torch.from_numpy(o.reshape(n, -1)), four_bit=t.four_bit,
                           groups16=True, plane=t.plane)
    d, sub, dmin, mn = block_subscales(kind, b)
    subs = []
    for dd, ss in ((d, sub), (dmin, mn)):
        if dd is None:
            continue
        s = SubScales(n, k, t.group)
        s.d.copy_(torch.from_numpy(dd.reshape(n, -1)))
        s.sub.copy_(torch.from_numpy(ss.reshape(n, -1)))
        subs.append(s)
    return CodedLinear.from_chunks(n, k, subs[0], subs[1] if len(subs) > 1 else None, [(0, codes)], t.four_bit,
                                   groups16=True, plane=t.plane)


@pytest.mark.skipif(not groups16.built(), reason="the integer path by groups needs AVX-512 VNNI")
@pytest.mark.parametrize("kind", sorted(TYPES))
def test_experts_of_whole_blocks_of_sixteen_rows_are_laid_out_by_groups_as_each_matrix_alone(kind, monkeypatch):
    monkeypatch.setenv("LMHEAD_GROUPS16", "1")
    experts, f, k = 3, 16, 512
    gate, up = _blocks(kind, experts * f, k, 2), _blocks(kind, experts * f, k, 3)
    held = build_experts(kind, [gate, up], [f, f], experts, k)
    assert held.by_groups  # every type: groups of 32, or of 16 with a K-quant's sub-scales
    assert held.nbytes == expert_nbytes(kind, experts, 2 * f, k, [f, f])
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(0))
    for e in range(experts):
        rows = np.concatenate([gate[e * f:(e + 1) * f], up[e * f:(e + 1) * f]])
        alone = _one_matrix_by_groups(kind, rows, 2 * f, k)
        got = held[e]
        assert alone.by_groups and got.by_groups and got.flags == alone.flags and got.plane == TYPES[kind].plane
        assert torch.equal(got.dequantize(), alone.dequantize())
        assert torch.equal(got.dequantize(), _one_matrix(kind, rows, 2 * f, k).dequantize())  # the file's numbers
        for m in (1, 5, 17):  # a decode row, an expert's few rows, and AMX's tiles where granted
            assert torch.equal(held.product(e, x[:m]), alone(x[:m]))


def test_mxfp4_experts_whose_exponents_leave_float16s_range_keep_the_four_row_layout(monkeypatch):
    monkeypatch.setenv("LMHEAD_GROUPS16", "1")
    experts, f, k = 2, 16, 512
    gate, up = _blocks("MXFP4", experts * f, k, 4), _blocks("MXFP4", experts * f, k, 5)
    gate.reshape(-1, TYPES["MXFP4"].nbytes)[7, 0] = 150  # a scale of 2²², above float16's largest
    held = build_experts("MXFP4", [gate, up], [f, f], experts, k)
    assert not held.by_groups and held.scale.dtype == torch.uint8
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    rows = np.concatenate([gate[:f], up[:f]])
    assert torch.equal(held.product(0, x), _one_matrix("MXFP4", rows, 2 * f, k)(x))


@pytest.mark.parametrize("k", [512, 320])
def test_mxfp4_experts_hold_the_files_exponent_bytes_and_multiply_as_their_float32_numbers(k):
    """Every exponent a product can meet without overflowing (the subnormal scales 2^-128 and 2^-127 and those
    float16 cannot hold among them): the exponent bytes' products are the float32 scales' bits."""
    experts, f = 2, 8
    gate, up = _blocks("MXFP4", experts * f, k, 3), _blocks("MXFP4", experts * f, k, 4)
    rng = np.random.default_rng(5)
    for rows in (gate, up):
        b = rows.reshape(-1, 17)
        b[:, 0] = rng.integers(0, 241, len(b))
        b[:4, 0] = [0, 1, 2, 240]
    held = build_experts("MXFP4", [gate, up], [f, f], experts, k)
    assert held.scale.dtype == torch.uint8 and held.nbytes == experts * 2 * f * k // 32 * 17  # the file's bytes
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    tiny = torch.zeros_like(x)
    tiny[:, :64] = x[:, :64]  # only the groups of exponents 0 and 1 (expert 0's first row): subnormal sums
    for e in range(experts):
        alone = _one_matrix("MXFP4", np.concatenate([gate[e * f:(e + 1) * f], up[e * f:(e + 1) * f]]), 2 * f, k)
        assert alone.scale.dtype == torch.float32  # numbers float16 cannot hold
        assert torch.equal(held[e].dequantize(), alone.dequantize())
        for m in (1, 3):
            assert torch.equal(held.product(e, x[:m]), alone(x[:m]))
            got = held.product(e, tiny[:m])
            assert torch.equal(got, alone(tiny[:m])) and (e > 0 or bool(got[:, 0].ne(0).all()))


@pytest.mark.parametrize("kind", sorted(t.name for t in TYPES.values() if t.four_bit))
def test_packed_codes_are_the_bytes_of_the_kernels_packing(kind):
    t = TYPES[kind]
    n, k = 4, 256
    blocks = _blocks(kind, n, k, 2).reshape(-1, t.nbytes)
    codes = torch.from_numpy(block_codes(kind, blocks).reshape(n, k))
    if t.four_bit in LEVELS:  # a level table's packed nibble is the level's index: the file's own nibble
        start, run = t.nibbles
        qs = blocks[:, start:start + t.block // 2].reshape(len(blocks), -1, 1, run // 2)
        index = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, k)
        assert np.array_equal(LEVELS[t.four_bit][index], codes.numpy())
        want = native.pack4(torch.from_numpy(index.astype(np.int8)))
    else:
        want = native.pack4(codes, t.four_bit == "signed")
        assert torch.equal(pack_codes(codes, t.four_bit == "signed"), want)
    if t.nibbles is not None:  # packed from the blocks' bytes without unpacking them
        assert torch.equal(pack_nibbles(blocks, kind, n, k), want)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_experts_are_held_as_the_file_holds_them(kind):
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
    experts, f, k = 2, 4, 64
    w = torch.randn(experts, 2 * f, k, generator=torch.Generator().manual_seed(3)).to(dtype)
    ints = torch.int32 if kind == "F32" else torch.int16
    gate, up = (w[:, s].contiguous().view(ints).numpy().reshape(experts * f, -1).view(np.uint8)
                for s in (slice(0, f), slice(f, 2 * f)))
    held = build_experts(kind, [gate, up], [f, f], experts, k)
    assert held.codes.dtype == dtype and torch.equal(held.codes, w)
    x = torch.randn(3, k)
    for e in range(experts):
        assert torch.equal(held.product(e, x), CodedLinear.dense16(w[e])(x))


def _moe_of(kind: str, experts: int, d: int, f: int, top_k: int, seed: int):
    """A layer's experts of `kind` (gate_up [2F,D], down [D,F] each) behind a random router, as `MoE`."""
    from lmhead.models.moe import MoE

    def weights(rows: int, k: int, seed: int) -> np.ndarray:
        if kind not in ("F32", "F16"):
            return _blocks(kind, rows, k, seed)
        w = np.random.default_rng(seed).normal(0, 0.05, (rows, k)).astype(kind.lower().replace("f", "float"))
        return w.view(np.uint8)

    gate, up = weights(experts * f, d, seed), weights(experts * f, d, seed + 1)
    down = weights(experts * d, f, seed + 2)
    router = torch.randn(experts, d, generator=torch.Generator().manual_seed(seed))
    return MoE(router=router, gate_up=build_experts(kind, [gate, up], [f, f], experts, d),
               down=build_experts(kind, [down], [d], experts, f), top_k=top_k, renormalise=True)


def _native_gated(act: int):
    """`lmhead_gated` with code `act` on gate_up [n, 2F] (what the lean body's `_gated` runs natively)."""
    lib = native.library()

    def gated(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
        lib.lmhead_gated(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1], act)
        return out

    return gated


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "IQ4_NL", "MXFP4", "F32", "F16"])
def test_the_chosen_experts_in_one_call_are_the_bits_of_one_call_per_expert(kind):
    from lmhead.kernels import experts as experts_kernel
    from lmhead.models.moe import Routing

    if not experts_kernel.available():
        pytest.skip("the experts kernel is not built")
    # one row's four experts: shared out among the threads (two or more), each expert single-threaded; nine rows:
    # each expert over its rows, the threads within its product
    moe = _moe_of(kind, experts=8, d=256, f=256, top_k=4, seed=4)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            for n, t, act in ((1, 2, 1), (1, 1, 0), (4, 2, 1), (9, 2, 0), (9, 1, 1)):
                torch.set_num_threads(t)
                x = torch.randn(n, 256, generator=torch.Generator().manual_seed(n))
                r = moe.route(x)
                if n == 9:  # expert 2 chosen by every row, at a different rank in different rows
                    others = [e for e in range(8) if e != 2]
                    rows = [[2, *(others[(i + j) % 7] for j in range(3))] for i in range(n)]
                    chosen = torch.tensor([row if i % 2 else row[::-1] for i, row in enumerate(rows)])
                    r = Routing(r.logits, chosen, r.weights)
                assert moe.one_call(x, act)
                got = experts_kernel.mlp(x, r.experts, r.weights, moe.gate_up.desc, moe.down.desc, act)
                want = moe._experts(x, r, _native_gated(act))
                assert torch.equal(got, want), (n, t, act)
    finally:
        torch.set_num_threads(threads)


def test_the_experts_call_refuses_ids_out_of_range_or_repeated_and_other_dtypes():
    from lmhead.kernels import experts as experts_kernel

    if not experts_kernel.available():
        pytest.skip("the experts kernel is not built")
    moe = _moe_of("Q8_0", experts=4, d=256, f=256, top_k=2, seed=9)
    x, w = torch.randn(2, 256), torch.full((2, 2), 0.5)
    call = lambda chosen, x=x, w=w: experts_kernel.mlp(x, chosen, w, moe.gate_up.desc, moe.down.desc, 1)  # noqa: E731
    assert call(torch.tensor([[0, 3], [3, 1]])).shape == (2, 256)
    for chosen in (torch.tensor([[0, 4], [1, 2]]), torch.tensor([[0, -1], [1, 2]]), torch.tensor([[1, 2], [2, 2]])):
        with pytest.raises(ValueError, match=r"ids in \[0, 4\), distinct in a row"):
            call(chosen)
    with pytest.raises(TypeError, match="chosen int64"):
        call(torch.tensor([[0, 1], [1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must be \[N, 256\]"):
        call(torch.tensor([[0, 1]]))

"""A layer's experts as one object: every expert's matrix of one product (gate_up or down) in the coded kernel's
layout, one buffer per part for all of them, expert e a slice of each — not one object per expert.

    the file's [E, N_p, K] tensors of one type (gate and up, or down) ──a chunk of experts at a time──▶
        codes int8 [E, N, R]: two a byte where the type packs (a 4-bit type's own nibbles permuted into the
            kernel's lanes, `pack_nibbles`; other types' codes by `pack_codes`), blocked by four rows (ROWS4)
        scale, offset [E, S]: as the blocks hold them (SUB: a float32 d per 256 weights, an int8 per group) for
            every type that declares its sub-scales (the K-quants, IQ4_XS); else float16 where every scale is a
            float16 number (the blocks' d; MXFP4's 2^(e − 128) but at the extremes), else float32
        (F16, BF16, F32: the weights as they are, [E, N, K])
    expert e ──`product(e, x)`: the coded kernel on slice e of each buffer──▶ x [M,K] → y [M,N] float32
        (`experts[e]`: a `CodedLinear` over the same slices, for the reference paths and the tests)

Why: a mixture holds thousands of expert matrices (Qwen3-30B-A3B: 128 experts × 48 layers × 2 products), and
held as the file holds them an expert takes about its bytes in the file (Q4_K: 152 bytes a block of 256 weights
against the file's 144, where float32 scales took 192). A chunk's codes are built by whole-array operations
over many experts at once. The numbers are those of the per-matrix layout (`CodedLinear`), byte for byte
(tests/test_expert_layout.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from lmhead.kernels import experts as experts_kernel
from lmhead.kernels import layout16, native
from lmhead.kernels.layout4 import LEVEL_TABLES
from lmhead.models.coded_linear import CodedLinear, SubScales, coded_available, coded_product
from lmhead.models.gguf_codes import block_scales, block_subscales
from lmhead.models.gguf_file import block_codes
from lmhead.models.groups16 import eligible as eligible_by_groups
from lmhead.models.quant_types import TYPES

__all__ = ["CHUNK_WEIGHTS", "DENSE", "ExpertMatrices", "build_experts", "expert_nbytes", "pack_codes",
           "pack_nibbles"]

CHUNK_WEIGHTS = 1 << 24  # weights converted at once while a layer's experts are laid out (bounds the transients)
DENSE: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}

_LOW = 0x0F0F0F0F0F0F0F0F                 # the low nibble of each byte of a word
_HIGH = 0xF0F0F0F0F0F0F0F0 - (1 << 64)      # the high nibble of each byte, as an int64
_FLIP = 0x8888888888888888 - (1 << 64)      # every nibble XOR 8 (the packed layout's code − 8), as an int64


def _lanes(words: Tensor) -> Tensor:
    """int64 words [4·U] (per 64 codes, word b's byte l holding codes 16·b + l and 16·b + 8 + l in its low and high
    nibbles) → uint8 [U, 8, 4], the kernel's packed units (`native.pack4`: lane l's byte b, each nibble XOR 8, the
    eight lanes little-endian uint32 side by side) as a view (the bytes moved where they are placed)."""
    words ^= _FLIP
    return words.view(torch.uint8).view(-1, 4, 8).transpose(1, 2)


def _pairs(x: Tensor, y: Tensor, out: Tensor) -> None:
    """Words x and y of eight nibbles' bytes each → out [..., 2·w]: the low nibbles of x and y as one word's bytes
    (x's low, y's high), then their high nibbles."""
    w = x.shape[-1]
    torch.bitwise_or(x & _LOW, (y << 4) & _HIGH, out=out[..., :w])
    torch.bitwise_or((x >> 4) & _LOW, y & _HIGH, out=out[..., w:])


def _code_units(codes: Tensor, signed: bool) -> Tensor:
    """Codes [N,K] int8 (0..15, or −8..7 where `signed`; K a multiple of 64) → their packed units [N·K/64, 8, 4]."""
    c = ((codes + 8) if signed else codes).contiguous().view(torch.int64).view(-1, 4, 2)
    words = torch.empty((c.shape[0], 4), dtype=torch.int64)
    torch.bitwise_or(c[:, :, 0], c[:, :, 1] << 4, out=words)
    return _lanes(words.view(-1))


def _nibble_units(blocks: np.ndarray, kind: str) -> Tensor:
    """Raw blocks [nb, bytes] of a type whose codes are its own nibbles (`QuantType.nibbles`) → the packed units of
    their codes [nb·block/64, 8, 4], made from the nibbles' bytes without unpacking them: a run of r weights in
    r/2 bytes holds the first r/2 weights in its low nibbles, so the pairs of its words give its units' words."""
    t = TYPES[kind]
    start, run = t.nibbles
    qs = np.ascontiguousarray(blocks[:, start:start + t.block // 2])
    w = torch.from_numpy(qs).view(torch.int64).view(-1, run // 32, 2)     # each run's words, in pairs
    words = torch.empty((w.shape[0], run // 16), dtype=torch.int64)
    _pairs(w[..., 0], w[..., 1], words)
    return _lanes(words.view(-1))


def pack_codes(codes: Tensor, signed: bool) -> Tensor:
    """Codes [N,K] int8 (0..15, or −8..7 where `signed`; K a multiple of 64) → [N, K/2] int8, `native.pack4`'s
    layout of them."""
    n, k = codes.shape
    return _code_units(codes, signed).reshape(n, k // 2).view(torch.int8)


def pack_nibbles(blocks: np.ndarray, kind: str, n: int, k: int) -> Tensor:
    """Raw blocks [nb, bytes] of a type whose codes are its blocks' own nibbles (`QuantType.nibbles`: their byte
    offset and run) holding rows [N,K] → [N, K/2] int8, the packed layout `pack_codes` makes of the type's codes
    (a level table's: of their index, the nibble itself; Q4_0's signed codes: code + 8, the nibble itself)."""
    return _nibble_units(blocks, kind).reshape(n, k // 2).view(torch.int8)


def _place(dest: Tensor, units: Tensor, rows4: bool) -> None:
    """Codes' 32-byte units [E'·N'·U, ...] (rows in order, a row's U units in order; maybe a view) into `dest`
    [E', N', R] (a slice of the experts' codes) in one copy: blocked by four rows where `rows4` (each block of four
    rows stored unit by unit, `native.block4`)."""
    e, n, _ = dest.shape
    inner = units.shape[1:]
    u = units.shape[0] // (e * n)
    if rows4:
        dest.view(e, n // 4, u, 4, *inner).copy_(units.view(e, n // 4, 4, u, *inner).transpose(2, 3))
    else:
        dest.view(e, n, u, *inner).copy_(units.view(e, n, u, *inner))


class ExpertMatrices:
    """E matrices [N,K] of one layout: `codes` [E, N, R], `scale` and `offset` [E, ...] (one slice per expert:
    float16 or float32 [E, N, K/G], the SUB buffers [E, bytes], or None), `group`, `four_bit`, `rows4`, `sub`;
    for a file's float weights `codes` [E, N, K] of their dtype and no scale; `by_groups`: each slice in the integer
    path by groups' layout (`models/groups16.py`), 5- or 6-bit codes there in `plane`'s layout."""

    def __init__(self, codes: Tensor, scale: Tensor | None, offset: Tensor | None, k: int, group: int,
                 four_bit: str | None, rows4: bool, sub: bool, by_groups: bool = False, plane: str | None = None
                 ) -> None:
        self.codes, self.scale, self.offset = codes, scale, offset
        self.in_features, self.out_features = k, codes.shape[1]
        self.group, self.four_bit, self.rows4, self.sub, self.by_groups = group, four_bit, rows4, sub, by_groups
        self.plane = plane
        self.flags = self[0].flags if len(self) else 0
        self.source: Path | None = None  # the file its buffers are mapped from (models/layout_cache.py), if any

    def __len__(self) -> int:
        return self.codes.shape[0]

    def __getitem__(self, e: int) -> CodedLinear:
        """Expert e as a `CodedLinear` over slice e of the buffers (no copy)."""
        n, k = self.out_features, self.in_features
        if self.sub:
            scale: Tensor | SubScales | None = SubScales.over(self.scale[e], n, k, self.group)
            offset = None if self.offset is None else SubScales.over(self.offset[e], n, k, self.group)
        else:
            scale = None if self.scale is None else self.scale[e]
            offset = None if self.offset is None else self.offset[e]
        return CodedLinear.from_layout(self.codes[e], scale, offset, k, self.group, self.four_bit, self.rows4,
                                       by_groups=self.by_groups, plane=self.plane)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.offset) if t is not None)

    @property
    def desc(self) -> experts_kernel.ExpertsMat:
        """The buffers as experts_kernel.c's descriptor (made once, and again if `codes` is replaced)."""
        desc = getattr(self, "_desc", None)
        if desc is None or desc.codes != self.codes.data_ptr():
            self._desc = experts_kernel.describe(self.codes, self.scale, self.offset, self.in_features, self.group,
                                                 self.flags)
        return self._desc

    def product(self, e: int, x: Tensor) -> Tensor:
        """x [M,K] → expert e's x·Wᵀ [M,N] float32 (the kernel on its slices; `self[e]`'s product where the
        kernel does not serve)."""
        if not coded_available() or x.dtype != torch.float32 or x.device.type != "cpu" or (
                torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, self[e].dequantize().to(x.dtype))
        return coded_product(x, self.codes[e], None if self.scale is None else self.scale[e],
                             None if self.offset is None else self.offset[e], self.group, self.flags)

    def __repr__(self) -> str:
        return (f"ExpertMatrices(experts={len(self)}, out_features={self.out_features}, "
                f"in_features={self.in_features}, flags={self.flags})")


def _sub(kind: str, k: int) -> bool:
    """Whether experts of type `kind`, K = `k` wide, hold their scales as the blocks hold them (SUB)."""
    t = TYPES[kind]
    return t.subscales is not None and k % 256 == 0 and t.group in (16, 32) and k // t.group <= native.HALF_MAX_GROUPS


def _scale_dtype(kind: str, ng: int) -> torch.dtype:
    """How experts of type `kind` (not SUB) with `ng` groups a row hold their scales: MXFP4's exponents as the
    blocks' bytes (E8M0), the types whose scales are float16 numbers as float16, else float32 (the kernel converts
    at most HALF_MAX_GROUPS groups a row of the smaller ones)."""
    t = TYPES[kind]
    if ng > native.HALF_MAX_GROUPS:
        return torch.float32
    return torch.uint8 if t.e8m0_at else torch.float16 if t.half else torch.float32


def expert_nbytes(kind: str, experts: int, n: int, k: int, rows: list[int] | None = None) -> int:
    """Bytes `build_experts` holds for `experts` matrices [n, k] of type `kind` made of parts of `rows` rows (default:
    one part of n): what a load of them needs."""
    if kind in DENSE:
        return experts * n * k * DENSE[kind].itemsize
    t = TYPES[kind]
    ng = k // t.group
    four_bit, _ = CodedLinear.layout(n, k, t.group, t.four_bit, t.offset)
    sub = _sub(kind, k)
    groups = _shape_by_groups(kind, [n] if rows is None else rows, k, four_bit, sub)
    plane = t.plane if groups and four_bit is None else None
    if sub:
        per = n * (k // 256 * 4 + ng)
    elif groups:
        per = n * ng * (1 if t.e8m0_at else 2)  # exponent bytes or float16, sixteen rows a vector
    else:
        per = n * ng * _scale_dtype(kind, ng).itemsize
    return experts * (n * layout16.row_bytes(k, four_bit, plane) + per * (2 if t.offset else 1))


def _dense(parts: list[np.ndarray], rows: list[int], experts: int, k: int, dtype: torch.dtype) -> ExpertMatrices:
    codes = torch.empty((experts, sum(rows), k), dtype=dtype)
    ints = {torch.float32: torch.int32}.get(dtype, torch.int16)
    held = codes.view(ints).numpy()  # the weights' bits copied from the map as integers (numpy has no bfloat16)
    a = 0
    for data, n in zip(parts, rows, strict=True):
        held[:, a:a + n] = data.view(held.dtype).reshape(experts, n, k)
        a += n
    return ExpertMatrices(codes, None, None, k, k, None, False, False)


def build_experts(kind: str, parts: list[np.ndarray], rows: list[int], experts: int, k: int,
                  done: Callable[[int], None] | None = None) -> ExpertMatrices:
    """The experts of `parts` — each a tensor's bytes [E·N_p, bytes a row] of type `kind` (a block type or F16,
    BF16, F32), N_p = `rows[p]` rows a expert of K = `k` weights — as one `ExpertMatrices`, each expert's rows
    the parts' rows in order (gate then up). `done(p)` is called once part p is read (its pages may go)."""
    if kind in DENSE:
        out = _dense(parts, rows, experts, k, DENSE[kind])
        for p in range(len(parts)):
            if done is not None:
                done(p)
        return out
    t = TYPES[kind]
    n, ng = sum(rows), k // t.group
    four_bit, rows4 = CodedLinear.layout(n, k, t.group, t.four_bit, t.offset)
    rows4 = rows4 and all(r % 4 == 0 for r in rows)  # each part's rows whole blocks of four
    sub = _sub(kind, k)
    if _takes_groups(kind, parts, rows, k, four_bit, sub):
        return _by_groups(kind, parts, rows, experts, k, four_bit, sub, done)
    codes = torch.empty((experts, n, k // 2 if four_bit else k), dtype=torch.int8)
    if sub:
        nsup = k // 256
        scale = torch.empty((experts, n * (nsup * 4 + ng)), dtype=torch.uint8)
        offset = torch.empty_like(scale) if t.offset else None
        views = [(b[:, :n * nsup * 4].view(torch.float32).view(experts, n, nsup),
                  b[:, n * nsup * 4:].view(torch.int8).view(experts, n, ng)) for b in (scale, offset) if b is not None]
    else:
        dtype = _scale_dtype(kind, ng)
        exponents = dtype == torch.uint8
        scale = torch.empty((experts, n, ng), dtype=dtype)
        offset = torch.empty_like(scale) if t.offset else None
    for a, rp, e0, e1, blocks in _chunks(t.nbytes, parts, rows, experts, k, done):
        _place(codes[e0:e1, a:a + rp], _units(kind, blocks, (e1 - e0) * rp, k, four_bit), rows4)
        if sub:
            d, sc, dmin, mn = block_subscales(kind, blocks)
            for (dv, sv), (dd, ss) in zip(views, ((d, sc), (dmin, mn)), strict=False):
                dv[e0:e1, a:a + rp] = torch.from_numpy(dd.reshape(e1 - e0, rp, -1))
                sv[e0:e1, a:a + rp] = torch.from_numpy(ss.reshape(e1 - e0, rp, ng))
        elif exponents:
            col = np.ascontiguousarray(blocks[:, t.e8m0_at[0]])  # a copy: the map is read-only
            scale[e0:e1, a:a + rp] = torch.from_numpy(col.reshape(e1 - e0, rp, ng))
        else:
            s, o = block_scales(kind, blocks)
            scale[e0:e1, a:a + rp] = torch.from_numpy(s.reshape(e1 - e0, rp, ng))
            if offset is not None:
                offset[e0:e1, a:a + rp] = torch.from_numpy(o.reshape(e1 - e0, rp, ng))
    if not sub and scale.dtype == torch.float32 and ng <= native.HALF_MAX_GROUPS:
        scale, offset = _halved(scale, offset)
    return ExpertMatrices(codes, scale, offset, k, t.group, four_bit, rows4, sub)


def _chunks(nbytes: int, parts: list[np.ndarray], rows: list[int], experts: int, k: int,
            done: Callable[[int], None] | None) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """The parts' raw blocks a few experts at a time (about CHUNK_WEIGHTS weights): (a, rp, e0, e1, blocks) —
    part p's rows rp of experts e0..e1−1, which go to rows a..a+rp−1 of each expert, as blocks [(e1−e0)·rp·k/
    block, `nbytes`]; `done(p)` once part p is read (its pages may go)."""
    a = 0
    for p, (data, rp) in enumerate(zip(parts, rows, strict=True)):
        step = max(1, CHUNK_WEIGHTS // (rp * k))
        for e0 in range(0, experts, step):
            e1 = min(experts, e0 + step)
            yield a, rp, e0, e1, data[e0 * rp:e1 * rp].reshape(-1, nbytes)
        a += rp
        if done is not None:
            done(p)


def _shape_by_groups(kind: str, rows: list[int], k: int, four_bit: str | None, sub: bool) -> bool:
    """Whether experts of type `kind` whose parts have `rows` rows, K = `k` wide, are of a shape the integer path by
    groups takes: each part whole blocks of sixteen rows, the whole an eligible body matrix (`models/groups16.py`)."""
    return (all(r % layout16.ROWS == 0 for r in rows)
            and eligible_by_groups(sum(rows), k, TYPES[kind].group, four_bit, sub))


def _takes_groups(kind: str, parts: list[np.ndarray], rows: list[int], k: int, four_bit: str | None,
                  sub: bool) -> bool:
    """Whether experts of type `kind` (each part's rows whole blocks of sixteen) take the integer path by groups'
    layout: a body's matrix eligible for it (`models/groups16.py`), with a K-quant's sub-scales, the file's own
    float16 scales, or MXFP4's exponents within float16's range (read here: a byte a block)."""
    t = TYPES[kind]
    if not _shape_by_groups(kind, rows, k, four_bit, sub):
        return False
    if sub:
        return True
    if t.e8m0_at:
        lo, hi = layout16.EXPONENTS
        for data in parts:
            e = data.reshape(-1, t.nbytes)[:, t.e8m0_at[0]]
            if e.size and (int(e.min()) < lo or int(e.max()) > hi):
                return False
        return True
    return t.half and t.subscales is None  # float16 scales (and offsets) in the blocks


def _by_groups(kind: str, parts: list[np.ndarray], rows: list[int], experts: int, k: int, four_bit: str | None,
               sub: bool, done: Callable[[int], None] | None) -> ExpertMatrices:
    """`build_experts` for the integer path by groups: each expert's matrix in `layout16`'s layout (blocks of
    sixteen rows, so that a part's rows — whole blocks — are a run of them), its scales (and offsets) sixteen rows a
    vector — float16, MXFP4's exponent bytes as the file's —, or a K-quant's d and sub laid out so
    (`layout16.subscales_out`, expert by expert); 5- and 6-bit codes in their type's plane (`QuantType.plane`)."""
    t = TYPES[kind]
    n, ng, blocks16 = sum(rows), k // t.group, sum(rows) // layout16.ROWS
    plane = None if four_bit else t.plane
    codes = torch.empty((experts, n, layout16.row_bytes(k, four_bit, plane)), dtype=torch.uint8)
    if sub:
        nsup = k // 256
        scale = torch.empty((experts, n * (nsup * 4 + ng)), dtype=torch.uint8)
        offset = torch.empty_like(scale) if t.offset else None
        views = [(b[:, :n * nsup * 4].view(torch.float32).view(experts, blocks16, nsup, layout16.ROWS),
                  b[:, n * nsup * 4:].view(torch.int8).view(experts, blocks16, ng, layout16.ROWS))
                 for b in (scale, offset) if b is not None]
    else:  # MXFP4's exponent bytes as they are (within layout16.EXPONENTS: `_takes_groups`), other scales float16
        scale = torch.empty((experts, blocks16, ng, layout16.ROWS), dtype=torch.uint8 if t.e8m0_at else torch.float16)
        offset = torch.empty_like(scale) if t.offset else None

    def sixteen(v: np.ndarray, e: int, r: int) -> Tensor:
        """[e·r, c] per row → [e, r/16, c, 16]: sixteen rows side by side."""
        c = v.size // (e * r)
        rows16 = torch.from_numpy(np.ascontiguousarray(v)).reshape(e, r // layout16.ROWS, layout16.ROWS, c)
        return rows16.transpose(2, 3)

    for a, rp, e0, e1, blocks in _chunks(t.nbytes, parts, rows, experts, k, done):
        at = slice(a // layout16.ROWS, (a + rp) // layout16.ROWS)
        if four_bit and t.nibbles is not None:
            laid = _laid_nibbles(kind, blocks, (e1 - e0) * rp, k, four_bit)
        else:
            ints = torch.from_numpy(block_codes(kind, blocks).reshape((e1 - e0) * rp, k))
            laid = layout16.lay_out(ints, four_bit, plane)
        codes[e0:e1, a:a + rp] = laid.view(e1 - e0, rp, -1)
        if sub:
            d, sc, dmin, mn = block_subscales(kind, blocks)
            for (dv, sv), (dd, ss) in zip(views, ((d, sc), (dmin, mn)), strict=False):
                dv[e0:e1, at] = sixteen(dd, e1 - e0, rp)
                sv[e0:e1, at] = sixteen(ss, e1 - e0, rp)
        elif t.e8m0_at:
            scale[e0:e1, at] = sixteen(blocks[:, t.e8m0_at[0]], e1 - e0, rp)
        else:
            for dest, v in zip((scale, offset), block_scales(kind, blocks), strict=True):
                if dest is not None:
                    dest[e0:e1, at] = sixteen(v, e1 - e0, rp).half()
    if not sub:
        scale = scale.view(experts, n, ng)
        offset = None if offset is None else offset.view(experts, n, ng)
    return ExpertMatrices(codes, scale, offset, k, t.group, four_bit, False, sub, by_groups=True, plane=plane)


_LOW32, _HIGH32 = np.uint32(0x0F0F0F0F), np.uint32(0xF0F0F0F0)  # _LOW and _HIGH in a 32-bit word


def _laid_nibbles(kind: str, blocks: np.ndarray, n: int, k: int, four_bit: str) -> Tensor:
    """Raw blocks [nb, bytes] of a type whose codes are its blocks' own nibbles (`QuantType.nibbles`) holding rows
    [N,K] → `layout16.lay_out`'s bytes of them, from the nibbles themselves: the layout's nibble is the file's
    (Q4_0's code + 8, Q4_1's and Q4_K's code, a level table's index — XOR 8, `layout16`'s convention for those),
    so the codes are never made. (MXFP4's level 0 is two indices, 0 and 8: `lay_out` of the codes keeps 0 for
    both, this keeps the file's; the same numbers.)

    A run of the block's weights is its bytes in chunks of eight, [chunk, s, c]: byte 4s + c holds in its low
    nibble weight 8·chunk + 4s + c of the run's first half and in its high nibble that of its second half — so a
    layout byte (steps 2p and 2p + 1 of a vector, code c) is one nibble of each of two bytes four apart: four of
    them a 32-bit word, made from two words of the block (numpy reads the file's unaligned words as they lie)."""
    t = TYPES[kind]
    start, run = t.nibbles
    q = blocks[:, start:start + t.block // 2].view(np.uint32).reshape(-1, t.block // run, run // 16, 2)
    lo, hi = q[..., 0], q[..., 1]
    u = np.empty((q.shape[0], t.block // run, 2, run // 16), dtype=np.uint32)  # [blocks, runs, half, chunk]
    np.bitwise_or(lo & _LOW32, (hi << np.uint32(4)) & _HIGH32, out=u[:, :, 0])
    np.bitwise_or((lo >> np.uint32(4)) & _LOW32, hi & _HIGH32, out=u[:, :, 1])
    if four_bit in LEVEL_TABLES:
        u ^= np.uint32(0x88888888)
    # [N/16, 16, G, vector] → [N/16, G, vector, 16]
    w = u.reshape(n // layout16.ROWS, layout16.ROWS, k // 32, 4).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(w).view(np.uint8).reshape(n, -1))


def _units(kind: str, blocks: np.ndarray, n: int, k: int, four_bit: str | None) -> Tensor:
    """Rows [N,K] of raw blocks as the kernel's codes, in 32-byte units [N·K/64, 8, 4] packed where `four_bit`,
    else [N·K/32, 32] (not yet blocked by rows)."""
    t = TYPES[kind]
    if four_bit and t.nibbles is not None:
        return _nibble_units(blocks, kind)
    codes = torch.from_numpy(block_codes(kind, blocks).reshape(n, k))
    return _code_units(codes, four_bit == "signed") if four_bit else codes.view(-1, 32)


def _halved(scale: Tensor, offset: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """float32 scales (and offsets) as float16 where every one is a float16 number (the same values, half the
    bytes), else as they are."""
    pair = [scale, offset] if offset is not None else [scale]
    halves = [t.half() for t in pair]
    if all(torch.equal(h.float(), t) for h, t in zip(halves, pair, strict=True)):
        return halves[0], halves[1] if offset is not None else None
    return scale, offset

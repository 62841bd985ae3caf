"""The layout of the integer path by groups (`groups_kernel.h`, flag GROUPS16): codes in groups of 32 sixteen weight
rows a vector, float16 scales (and offsets) beside them, or a K-quant's as its blocks hold them. Which matrices take
it: `models/groups16.py`.

    int8 codes [N, K] ──c + bias as unsigned bytes (int8 codes 128, Q4_0's signed nibbles 8, Q4_1's 0; a level
                        table's codes (IQ4_NL, IQ4_XS, MXFP4) as their indices in it XOR 8, the packed nibbles'
                        convention of the other layouts: the kernels' tables are in that order)──▶
        [N/16][K/32][8 steps][16 rows][4 codes]   (packed: steps 2p and 2p + 1 in the low and high nibbles of
                                                   vector p: [N/16][K/32][4][16][4] bytes)
    5- and 6-bit codes (`plane`, `PLANES`: Q5_1's and Q5_K's "unsigned5", Q5_0's "signed5", Q6_K's "signed6")
                        ──c + bias (signed: half the range), its low four bits as packed codes' nibbles and its top
                        hb bits (1, 2) in a plane after them──▶ [N/16][K/32][4 + hb][16][4] bytes
    scales, offsets [N, K/32] ──▶ [N/16][K/32][16] float16
    a K-quant's (`SubScales`: d [N, K/256] float32, sub [N, K/G] int8, G 32 or 16) ──▶ d [N/16][K/256][16], then
        sub [N/16][K/G][16], in one uint8 buffer (a group's scale: the float32 product d·sub, as before)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lmhead.kernels.abi import HIGH1, HIGH2, SIGNED4
from lmhead.kernels.layout4 import LEVEL_TABLES, level_indices

__all__ = ["EXPONENTS", "PLANES", "ROWS", "bias", "exponent_bytes", "laid_back", "lay_out", "plane_flags",
           "row_bytes", "scales_back", "scales_out", "subscales_back", "subscales_out"]

ROWS = 16  # N a multiple of this: the kernel's blocks of sixteen rows
# MXFP4's exponent bytes e the layout holds as they are (groups_kernel.h's G16_E8M0): the scales 2^(e − 128) within
# float16's range, 2⁻²⁴ … 2¹⁵, so that the numbers and the bound are a float16 scale's
EXPONENTS = (104, 143)
# the 5- and 6-bit layouts: (top bits in the plane, signed) by name; the codes they hold: 0 … 2^(4 + hb) − 1, or
# that less its half where signed
PLANES = {"unsigned5": (1, False), "signed5": (1, True), "unsigned6": (2, False), "signed6": (2, True)}


def bias(four_bit: str | None, plane: str | None = None) -> int:
    """What the layout adds to a code to make it an unsigned byte (a level table's: none, its index is stored)."""
    if plane is not None:
        hb, signed = PLANES[plane]
        return 8 << hb if signed else 0
    return {None: 128, "signed": 8}.get(four_bit, 0)


def plane_flags(plane: str | None) -> int:
    """The kernel's flags of a plane layout (HIGH1 or HIGH2, SIGNED4 where signed); 0 for none."""
    if plane is None:
        return 0
    hb, signed = PLANES[plane]
    return (HIGH1 if hb == 1 else HIGH2) | (SIGNED4 if signed else 0)


def row_bytes(k: int, four_bit: str | None, plane: str | None = None) -> int:
    """Bytes a row of K codes takes in the layout."""
    return k * (4 + PLANES[plane][0]) // 8 if plane is not None else k // 2 if four_bit is not None else k


def _words(u: np.ndarray, n: int, k: int) -> np.ndarray:
    """Bytes [N, G, V, 4] (four codes of a row a 32-bit word) → words [N/16, G, V, 16]: sixteen rows a vector."""
    return np.ascontiguousarray(u).view(np.uint32).reshape(n // 16, 16, k // 32, -1).transpose(0, 2, 3, 1)


def lay_out(codes: Tensor, four_bit: str | None, plane: str | None = None) -> Tensor:
    """int8 codes [N, K] → the layout's bytes (uint8, viewed as [N, `row_bytes`]: not row by row). ValueError
    for codes a plane layout does not hold."""
    n, k = codes.shape
    if plane is not None:
        hb, signed = PLANES[plane]
        low, high = (-(8 << hb), (8 << hb) - 1) if signed else (0, (16 << hb) - 1)
        if codes.numel() and (int(codes.min()) < low or int(codes.max()) > high):
            raise ValueError(f"the {plane} layout holds codes in {low}..{high}, got {int(codes.min())}.."
                             f"{int(codes.max())}")
    if four_bit in LEVEL_TABLES:
        u = level_indices(codes.numpy(), four_bit) ^ 8
    else:  # c + bias in 0 … 255: the byte's sum modulo 256
        u = codes.numpy().view(np.uint8) + np.uint8(bias(four_bit, plane))
    top = None
    if plane is not None:  # step q = per·v + i: its top bits at bits hb·i of plane vector v
        hb = PLANES[plane][0]
        per = 8 // hb
        t = (u >> np.uint8(4)).reshape(n, k // 32, hb, per, 4)
        top = np.bitwise_or.reduce(t << (hb * np.arange(per, dtype=np.uint8)).reshape(1, 1, 1, per, 1), axis=3)
        u = u & np.uint8(15)
    if four_bit is not None or plane is not None:  # steps 2p and 2p + 1 a byte: [N, G, 4, 4]
        u = u.reshape(n, k // 32, 4, 2, 4)
        u = u[:, :, :, 0] | (u[:, :, :, 1] << np.uint8(4))
    u = _words(u, n, k)  # four codes a 32-bit word, moved as one
    if top is not None:  # each group's nibbles, then its plane
        u = np.concatenate([u, _words(top, n, k)], axis=2)
    return torch.from_numpy(np.ascontiguousarray(u).view(np.uint8).reshape(n, -1))  # [N, bytes a row]


def laid_back(laid: Tensor, n: int, k: int, four_bit: str | None, plane: str | None = None) -> Tensor:
    """`lay_out`'s inverse: the int8 codes [N, K]."""
    u = laid.numpy()
    top = None
    if plane is not None:
        hb = PLANES[plane][0]
        per = 8 // hb
        u = u.reshape(n // 16, k // 32, 4 + hb, 16, 4)
        t = u[:, :, 4:, None] >> (hb * np.arange(per, dtype=np.uint8)).reshape(1, 1, 1, per, 1, 1)
        top = (t & np.uint8((1 << hb) - 1)).reshape(n // 16, k // 32, 8, 16, 4)
        u = np.ascontiguousarray(u[:, :, :4])
    if four_bit is not None or plane is not None:
        u = u.reshape(n // 16, k // 32, 4, 16, 4)
        u = np.stack([u & 15, u >> 4], axis=3)  # [N/16, G, 4, 2, 16, 4]
    u = u.reshape(n // 16, k // 32, 8, 16, 4)
    if top is not None:
        u = u | (top << np.uint8(4))
    u = u.transpose(0, 3, 1, 2, 4).reshape(n, k)  # [N/16, G, 8, 16, 4] → [N/16, 16, G, 8, 4]
    if four_bit in LEVEL_TABLES:
        return torch.from_numpy(LEVEL_TABLES[four_bit][u ^ 8])
    return torch.from_numpy((u.astype(np.int16) - bias(four_bit, plane)).astype(np.int8))


def scales_out(s: Tensor) -> Tensor:
    """Scales or offsets [N, G] → [N/16, G, 16] float16 (viewed as [N, G]); MXFP4's exponent bytes (uint8) as they
    are."""
    n, g = s.shape
    s = s if s.dtype == torch.uint8 else s.to(torch.float16)
    return s.reshape(n // 16, 16, g).transpose(1, 2).contiguous().reshape(n, g)


def exponent_bytes(scale: Tensor) -> Tensor | None:
    """Scales [N, G] that are all powers of two 2^(e − 128) with e in `EXPONENTS` (MXFP4's) → their exponent bytes
    e (uint8); else None."""
    mantissa, exponent = torch.frexp(scale.float())
    e = exponent + 127  # 2^(e − 128) = 0.5 · 2^(e − 127)
    lo, hi = EXPONENTS
    if not bool((mantissa == 0.5).all()) or not bool(((e >= lo) & (e <= hi)).all()):
        return None
    return e.to(torch.uint8)


def scales_back(s: Tensor, n: int, g: int) -> Tensor:
    """`scales_out`'s inverse: [N, G] float32 (an exponent byte e, within `EXPONENTS`, the number 2^(e − 128): the
    float32 whose exponent bits are e − 1)."""
    s = s.reshape(n // 16, g, 16).transpose(1, 2).reshape(n, g)
    if s.dtype == torch.uint8:
        return ((s.to(torch.int32) - 1) << 23).view(torch.float32)
    return s.float()


def _sixteen(t: Tensor) -> Tensor:
    """[N, C] → [N/16, C, 16]: sixteen rows side by side."""
    n, c = t.shape
    return t.reshape(n // 16, 16, c).transpose(1, 2).contiguous()


def subscales_out(d: Tensor, sub: Tensor) -> Tensor:
    """A K-quant's d [N, K/256] float32 and sub [N, K/G] int8 → the layout's buffer (uint8: d's bytes, then
    sub's)."""
    return torch.cat([_sixteen(d.float()).view(torch.uint8).reshape(-1), _sixteen(sub).view(torch.uint8).reshape(-1)])


def subscales_back(buffer: Tensor, n: int, k: int, group: int) -> tuple[Tensor, Tensor]:
    """`subscales_out`'s inverse: d [N, K/256] float32 and sub [N, K/G] int8."""
    nd = n * (k // 256) * 4
    d = buffer[:nd].view(torch.float32).view(n // 16, k // 256, 16).transpose(1, 2).reshape(n, k // 256)
    sub = buffer[nd:].view(torch.int8).view(n // 16, k // group, 16).transpose(1, 2).reshape(n, k // group)
    return d, sub

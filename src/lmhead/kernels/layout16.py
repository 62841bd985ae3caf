"""The layout of the integer path by groups (`groups_kernel.h`, flag GROUPS16): codes in groups of 32 sixteen weight
rows a vector, float16 scales (and offsets) beside them, or a K-quant's as its blocks hold them. Which matrices take
it: `models/groups16.py`.

    int8 codes [N, K] ──c + bias as unsigned bytes (int8 codes 128, Q4_0's signed nibbles 8, Q4_1's 0; a level
                        table's codes (IQ4_NL, IQ4_XS, MXFP4) as their indices in it XOR 8, the packed nibbles'
                        convention of the other layouts: the kernels' tables are in that order)──▶
        [N/16][K/32][8 steps][16 rows][4 codes]   (packed: steps 2p and 2p + 1 in the low and high nibbles of
                                                   vector p: [N/16][K/32][4][16][4] bytes)
    scales, offsets [N, K/32] ──▶ [N/16][K/32][16] float16
    a K-quant's (`SubScales`: d [N, K/256] float32, sub [N, K/G] int8, G 32 or 16) ──▶ d [N/16][K/256][16], then
        sub [N/16][K/G][16], in one uint8 buffer (a group's scale: the float32 product d·sub, as before)
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lmhead.kernels.layout4 import LEVEL_TABLES, level_indices

__all__ = ["EXPONENTS", "ROWS", "bias", "exponent_bytes", "laid_back", "lay_out", "scales_back", "scales_out",
           "subscales_back", "subscales_out"]

ROWS = 16  # N a multiple of this: the kernel's blocks of sixteen rows
# MXFP4's exponent bytes e the layout holds as they are (groups_kernel.h's G16_E8M0): the scales 2^(e − 128) within
# float16's range, 2⁻²⁴ … 2¹⁵, so that the numbers and the bound are a float16 scale's
EXPONENTS = (104, 143)


def bias(four_bit: str | None) -> int:
    """What the layout adds to a code to make it an unsigned byte (a level table's: none, its index is stored)."""
    return {None: 128, "signed": 8}.get(four_bit, 0)


def lay_out(codes: Tensor, four_bit: str | None) -> Tensor:
    """int8 codes [N, K] → the layout's bytes (uint8, viewed as [N, K] or [N, K/2]: not row by row)."""
    n, k = codes.shape
    if four_bit in LEVEL_TABLES:
        u = level_indices(codes.numpy(), four_bit) ^ 8
    else:  # c + bias in 0 … 255: the byte's sum modulo 256
        u = codes.numpy().view(np.uint8) + np.uint8(bias(four_bit))
    if four_bit is not None:  # steps 2p and 2p + 1 a byte: [N, G, 4, 4]
        u = u.reshape(n, k // 32, 4, 2, 4)
        u = u[:, :, :, 0] | (u[:, :, :, 1] << np.uint8(4))
    # four codes a 32-bit word, moved as one: [N/16, 16, G, steps] → [N/16, G, steps, 16]
    u = np.ascontiguousarray(u).view(np.uint32).reshape(n // 16, 16, k // 32, -1).transpose(0, 2, 3, 1)
    return torch.from_numpy(np.ascontiguousarray(u).view(np.uint8).reshape(n, -1))  # [N, bytes a row]


def laid_back(laid: Tensor, n: int, k: int, four_bit: str | None) -> Tensor:
    """`lay_out`'s inverse: the int8 codes [N, K]."""
    u = laid.numpy()
    if four_bit is not None:
        u = u.reshape(n // 16, k // 32, 4, 16, 4)
        u = np.stack([u & 15, u >> 4], axis=3)  # [N/16, G, 4, 2, 16, 4]
    u = u.reshape(n // 16, k // 32, 8, 16, 4).transpose(0, 3, 1, 2, 4).reshape(n, k)  # [N/16, 16, G, 8, 4]
    if four_bit in LEVEL_TABLES:
        return torch.from_numpy(LEVEL_TABLES[four_bit][u ^ 8])
    return torch.from_numpy((u.astype(np.int16) - bias(four_bit)).astype(np.int8))


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

"""Which matrices take the integer path by groups (`kernels/groups_kernel.h`, laid out by `kernels/layout16.py`):
int8 codes (Q8_0, a Q5_0 head; Q6_K's 6 bits, Q5_0's 5 and, with offsets, Q5_1's and Q5_K's 5 as nibbles with
their top bits in a plane: `quant_types.QuantType.plane`), packed signed ones (Q4_0, Q3_K; with offsets Q2_K),
packed unsigned ones (Q4_1, Q4_K) and packed indices of a level table (IQ4_NL, IQ4_XS, MXFP4), in groups of 32
with float16 scales or a K-quant's sub-scales (`SubScales`), or in groups of 16 with sub-scales; N a multiple of
16, K of 32 (256 with sub-scales) and at least 256 (the kernel's bound holds for any group there); where this
machine's library builds the path and `kernels/paths.py` chose it for that kind of codes. The body's matrices, the
embedding (its rows read by decode_kernels.c's groups_row) and the head (its screen: kernels/groups_screen.h).
"""

from __future__ import annotations

from lmhead.kernels import native, paths
from lmhead.kernels.layout16 import ROWS

__all__ = ["built", "chosen", "eligible"]


def built() -> bool:
    """Whether this machine's library has the path (AVX-512 VNNI)."""
    lib = native.library()
    return lib is not None and lib.lmhead_groups16() > 0


def chosen(kind: str) -> bool:
    """Whether the eligible matrices of `kind` ("packed" 4-bit codes or "int8" codes) take the path here
    (built, and chosen: `paths.groups16_chosen`)."""
    return built() and paths.groups16_chosen(kind)


def eligible(n: int, k: int, group: int, four_bit: str | None, sub: bool) -> bool:
    """Whether a matrix of this shape and kind of codes (`sub`: a K-quant's sub-scales) takes the integer path by
    groups here."""
    return (four_bit in (None, "signed", "unsigned", "iq4", "mxfp4") and (group == 32 or (group == 16 and sub))
            and (k % 256 == 0 if sub else k % 32 == 0) and n % ROWS == 0 and n > 0 and k >= 256
            and chosen("int8" if four_bit is None else "packed"))

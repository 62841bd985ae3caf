"""Every GGUF block type the coded kernel multiplies, each declared once (ggml's `type_traits`, one row a type).

    QuantType(name, block, nbytes, group, four_bit, offset, sub, f16_at, codes, scales, subscales)
        ├─ the loader (models/gguf_file.py, gguf_codes.py): `codes(blocks)` int8 [nb, block] and
        │  `scales(blocks)` (scale, offset or None) float32 [nb, block/group], gguf-py's dequantisation bit for bit
        │  as scale·code + offset; `subscales`: the scales' parts as the blocks hold them (SUB) — a dense layer
        │  holds them so where `sub` says, a mixture's experts for every type that has them; `nibbles`: where the
        │  codes are the block's own 4-bit fields (the experts repack those bytes, models/expert_layout.py)
        ├─ the kernel's layout (models/coded_linear.py): `four_bit` — codes two to a byte as "unsigned" 0..15,
        │  "signed" −8..7, or indices of a level table ("iq4", "mxfp4": `LEVELS`) — and its flag (`LAYOUT_FLAGS`);
        │  `plane` — 5- and 6-bit codes in the integer path by groups as nibbles with their top bits in a plane
        │  (kernels/layout16.py's `PLANES`: "unsigned5", "signed6"), 5/8 or 6/8 of a byte a code
        └─ the tests' parametrisation: `TYPES`, and `f16_at` (where a block holds float16 numbers)

The flags and the level tables are the kernels' (kernels/quant_types.h, mirrored in kernels/native.py and
checked against the library when it loads). A new type is one `QuantType` here; a new level table one line in
that header and its mirror.

Every type is an integer per weight times a per-group float32 product of the block's parts, plus a per-group
offset for some: Q2_K's d·sc·q − dmin·m per 16, Q3_K's d·(sc − 32)·q with q in −4 … 3, IQ4_NL's d·v[q] and
IQ4_XS's d·(ls − 32)·v[q] with v a table of 16 integers (so v[q] is the code), MXFP4's 2^(e − 128)·v[q] with v
e2m1's sixteen values doubled (integers). Each product is exact in float32 (at most 24 significant bits), so
scale·code + offset rounds only where gguf-py's dequantiser rounds too: at the offset's addition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lmhead.kernels import native
from lmhead.kernels.layout4 import LEVEL_TABLES

__all__ = ["LAYOUT_FLAGS", "LEVELS", "TYPES", "QuantType", "e8m0_numbers"]

# the level tables a packed nibble indexes (native.LEVELS, the header's), by CodedLinear's `four_bit` name
LEVELS: dict[str, np.ndarray] = LEVEL_TABLES
# the kernel's flags of each `four_bit` layout (with native.PACKED)
LAYOUT_FLAGS: dict[str, int] = {"unsigned": 0, "signed": native.SIGNED4, "iq4": native.IQ4, "mxfp4": native.MXFP4}


@dataclass(frozen=True)
class QuantType:
    """One GGUF block type: `block` weights in `nbytes` bytes, one scale (and offset) per `group` weights."""

    name: str
    block: int
    nbytes: int
    group: int
    four_bit: str | None       # the kernel's packed layout (None: one int8 code per byte)
    offset: bool               # whether the groups have offsets
    sub: bool                  # scales may be held as the blocks hold them (d per 256 weights · int8 per group:
                               # SubScales) — in a dense layer where `gguf_file.dense_sub` says
    half: bool                 # whether the group scales (and offsets) are float16 numbers (the blocks' d, m)
    f16_at: tuple[int, ...]    # byte offsets of the block's float16 fields (d, dmin)
    codes: Callable[[np.ndarray], np.ndarray]
    scales: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray | None]]
    subscales: Callable[[np.ndarray], tuple] | None = None
    e8m0_at: tuple[int, ...] = ()  # byte offsets of the block's power-of-two exponents (MXFP4's E8M0)
    # where the codes are the block's 4-bit fields as they are (or a level table's index of them): (the byte
    # offset of those fields in a block, the run of weights they hold, low nibbles first then high) — the codes'
    # packed layout is then a permutation of the file's own nibbles (models/expert_layout.py)
    nibbles: tuple[int, int] | None = None
    # the integer path by groups' layout of 5- and 6-bit codes (kernels/layout16.py's PLANES; None: a byte a code)
    plane: str | None = None

    def coded_nbytes(self, count: int, sub: bool | None = None) -> int:
        """Bytes the kernel's layout of `count` weights of this type takes: codes, scales and offsets. `sub`: the
        scales held as the blocks hold them (SUB; a mixture's experts hold every K-quant so, `subscales`), default
        the type's `sub` (a dense layer's). MXFP4's exponents count as float32 numbers (a matrix holds them as
        float16 where every one is a float16 number, 2^-24 … 2^15; a mixture's experts as the blocks' bytes:
        `expert_layout.expert_nbytes` counts those, planes included). A type with a `plane` counts a byte a code,
        the most it takes: by groups its codes take 5/8 or 6/8 of that."""
        groups = count // self.group
        if self.sub if sub is None else sub:
            per_group, per_block = 1, 4
        else:
            per_group, per_block = (2 if self.half else 4), 0
        parts = 2 if self.offset else 1
        return (count // 2 if self.four_bit else count) + parts * (groups * per_group + count // 256 * per_block)


# --- the blocks' bits --------------------------------------------------------------------------------------------

def _f16(a: np.ndarray) -> np.ndarray:
    return a.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes [nb, c·chunk/2] holding `chunk` 4-bit values per run (low nibbles first, then high) → [nb, c·chunk]."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, chunk // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(nb, -1)


def _pairs(qs: np.ndarray) -> np.ndarray:
    """Bytes [nb, 32·r] of 2-bit values, four per byte (bits 0–1 of byte i the first run of 32, 2–3 the second,
    ...) → [nb, 128·r], each run of 32 bytes giving 128 values in order."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return (q & np.uint8(3)).reshape(nb, -1)


def _q5_codes(blocks: np.ndarray, start: int, centre: int) -> np.ndarray:
    nb = blocks.shape[0]
    qh = blocks[:, start:start + 4].copy().view(np.uint32).reshape(nb, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)).astype(np.uint8)
    return (_nibbles(blocks[:, start + 4:], 32) | (high << np.uint8(4))).astype(np.int8) - np.int8(centre)


def _q5k_codes(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    low = _nibbles(blocks[:, 48:], 64).reshape(nb, 8, 32)
    qh = blocks[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return (low | ((qh & np.uint8(1)) << np.uint8(4))).reshape(nb, 256).astype(np.int8)


def _q3k_codes(blocks: np.ndarray) -> np.ndarray:
    """2-bit fields (byte i of each 32-byte run holds weights i, i+32, i+64, i+96); a clear bit of hmask subtracts
    4: codes −4 … 3."""
    nb = blocks.shape[0]
    low = _pairs(blocks[:, 32:96])
    hmask = blocks[:, 0:32].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return low.astype(np.int8) - ((~hmask & np.uint8(1)) << np.uint8(2)).reshape(nb, 256).astype(np.int8)


def _q6k_codes(blocks: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 128).reshape(nb, 8, 32)
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (qh & np.uint8(3)).reshape(nb, 8, 32)
    return ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(nb, 256)


def _q3k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 16 six-bit scales − 32 as float32 [nb, 16]: low 4 bits in bytes 0–7 (low nibbles for scales 0–7,
    high for 8–15), the top 2 bits in bytes 8–11 (scale j: byte 8 + j % 4, bits 2·(j // 4))."""
    nb = packed.shape[0]
    j = np.arange(16)
    low = (packed[:, j % 8] >> (4 * (j // 8)).astype(np.uint8)) & np.uint8(15)
    high = (packed[:, 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & np.uint8(3)
    return ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32).reshape(nb, 16)


def _iq4xs_scales(packed: np.ndarray) -> np.ndarray:
    """IQ4_XS's 8 six-bit scales − 32 as float32 [nb, 8]: bytes 0–1 the top 2 bits (a little-endian uint16, scale
    j at bits 2·j), bytes 2–5 the low 4 bits (scale j: byte 2 + j // 2, low nibble for even j)."""
    j = np.arange(8)
    high = (packed[:, 0:2].copy().view(np.uint16) >> (2 * j).astype(np.uint16)) & np.uint16(3)
    low = (packed[:, 2 + j // 2] >> (4 * (j % 2)).astype(np.uint8)) & np.uint8(15)
    return ((low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)


def _qk_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's d·sc and −(dmin·m) per 32 weights."""
    from gguf.quants import Q4_K

    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _q2k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """d·sc per 16 weights and −(dmin·m): gguf-py's dl·q − ml, the product exact in float32."""
    sc = blocks[:, 0:16]
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    return d * (sc & np.uint8(15)).astype(np.float32), -(dmin * (sc >> np.uint8(4)).astype(np.float32))


def e8m0_numbers(e: np.ndarray) -> np.ndarray:
    """MXFP4's exponent byte as the float32 2^(e − 128) ggml multiplies the doubled levels by
    (ggml_e8m0_to_fp32_half: e < 2 are the subnormals 2^−128 and 2^−127)."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).astype(np.uint32)
    return bits.view(np.float32)


# K-quants' scales as their blocks hold them (SUB): d float32 [nb], sub int8 [nb, groups], and for the types with
# offsets −dmin [nb] and its sub; d·sub and −dmin·sub in float32 are `scales`' numbers bit for bit
def _i8(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).astype(np.int8)


def _q6k_sub(blocks: np.ndarray) -> tuple:
    return _f16(blocks[:, 208:210])[:, 0], _i8(blocks[:, 192:208].view(np.int8)), None, None


def _q2k_sub(blocks: np.ndarray) -> tuple:
    sc = blocks[:, 0:16]
    return (_f16(blocks[:, 80:82])[:, 0], _i8(sc & np.uint8(15)), -_f16(blocks[:, 82:84])[:, 0],
            _i8(sc >> np.uint8(4)))


def _q3k_sub(blocks: np.ndarray) -> tuple:
    return _f16(blocks[:, 108:110])[:, 0], _i8(_q3k_scales(blocks[:, 96:108])), None, None


def _qk_sub(blocks: np.ndarray) -> tuple:
    """Q4_K's and Q5_K's d and sc, −dmin and m (six bits each) per 32 weights: `_qk_scales`' products' parts."""
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return _f16(blocks[:, 0:2])[:, 0], _i8(sc), -_f16(blocks[:, 2:4])[:, 0], _i8(mn)


def _iq4xs_sub(blocks: np.ndarray) -> tuple:
    return _f16(blocks[:, 0:2])[:, 0], _i8(_iq4xs_scales(blocks[:, 2:8])), None, None


_T = QuantType
TYPES: dict[str, QuantType] = {t.name: t for t in (
    _T("Q4_0", 32, 18, 32, "signed", False, False, True, (0,),
       lambda b: _nibbles(b[:, 2:], 32).astype(np.int8) - np.int8(8), lambda b: (_f16(b[:, 0:2]), None),
       nibbles=(2, 32)),
    _T("Q4_1", 32, 20, 32, "unsigned", True, False, True, (0, 2),
       lambda b: _nibbles(b[:, 4:], 32).astype(np.int8), lambda b: (_f16(b[:, 0:2]), _f16(b[:, 2:4])),
       nibbles=(4, 32)),
    # a Q5_0 head keeps its codes a byte each: its screen (kernels/groups_screen.h) reads int8 codes
    _T("Q5_0", 32, 22, 32, None, False, False, True, (0,),
       lambda b: _q5_codes(b, 2, 16), lambda b: (_f16(b[:, 0:2]), None), plane="signed5"),
    _T("Q5_1", 32, 24, 32, None, True, False, True, (0, 2),
       lambda b: _q5_codes(b, 4, 0), lambda b: (_f16(b[:, 0:2]), _f16(b[:, 2:4])), plane="unsigned5"),
    _T("Q8_0", 32, 34, 32, None, False, False, True, (0,),
       lambda b: b[:, 2:].copy().view(np.int8), lambda b: (_f16(b[:, 0:2]), None)),
    # Q2_K's codes 0..3 held signed (the code itself), so that a decode product sums its offsets against the
    # codes' own zero
    _T("Q2_K", 256, 84, 16, "signed", True, True, False, (80, 82),
       lambda b: _pairs(b[:, 16:80]).astype(np.int8), _q2k_scales, _q2k_sub),
    _T("Q3_K", 256, 110, 16, "signed", False, True, False, (108,),
       _q3k_codes, lambda b: (_f16(b[:, 108:110]) * _q3k_scales(b[:, 96:108]), None), _q3k_sub),
    _T("Q4_K", 256, 144, 32, "unsigned", True, True, False, (0, 2),
       lambda b: _nibbles(b[:, 16:], 64).astype(np.int8), _qk_scales, _qk_sub, nibbles=(16, 64)),
    _T("Q5_K", 256, 176, 32, None, True, True, False, (0, 2), _q5k_codes, _qk_scales, _qk_sub,
       plane="unsigned5"),
    _T("Q6_K", 256, 210, 16, None, False, True, False, (208,),
       _q6k_codes, lambda b: (_f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32), None),
       _q6k_sub, plane="signed6"),
    # the code is the table's integer value (kvalues[q]), the scale the block's d
    _T("IQ4_NL", 32, 18, 32, "iq4", False, False, True, (0,),
       lambda b: LEVELS["iq4"][_nibbles(b[:, 2:], 32)], lambda b: (_f16(b[:, 0:2]), None), nibbles=(2, 32)),
    _T("IQ4_XS", 256, 136, 32, "iq4", False, True, False, (0,),
       lambda b: LEVELS["iq4"][_nibbles(b[:, 8:], 32)], lambda b: (_f16(b[:, 0:2]) * _iq4xs_scales(b[:, 2:8]), None),
       _iq4xs_sub, nibbles=(8, 32)),
    # gpt-oss's experts: an E8M0 exponent byte and 32 e2m1 nibbles (low nibbles the first 16 weights); the code is
    # the doubled level, the scale 2^(e − 128) (a float32 number, not a float16 one for most e)
    _T("MXFP4", 32, 17, 32, "mxfp4", False, False, False, (),
       lambda b: LEVELS["mxfp4"][_nibbles(b[:, 1:], 32)], lambda b: (e8m0_numbers(b[:, 0:1]), None), e8m0_at=(0,),
       nibbles=(1, 32)),
)}
del _T

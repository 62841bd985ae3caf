"""lmhead's C kernels: built once per machine with the system C compiler, loaded with ctypes, self-tested.

    coded_kernel.c   the product over GGUF codes (models/coded_linear.py)
    body_kernels.c   the decode step's small work: RMSNorm, residual add + norms, gated activation, and
                     rope + cache write + attention for the new tokens (models/lean.py's step-by-step path)
    decode_kernels.c `lmhead_step`, every block of a decode step in one call over the coded matrices, and
                     `lmhead_decode`, the same from token ids with the step's bookkeeping (models/lean.py)
    row_kernels.c    the decode loop's passes over whole rows: raw logprob and rank of each chosen token
                     (`row_scores`, lmhead/decode/scores.py); a greedy row's argmax and normaliser in one call
                     (`greedy_rows`, lmhead/decode/engine.py); a row's exact top-p set (`top_p_row`,
                     lmhead/sampling/top_p.py); an unseeded row's draw (`sample_row`); `topk`'s candidates
    step_kernels.c   the declared sampler steps' passes over a row, in float64 (lmhead/sampling/steps/moments.py):
                     a row's moments (`row_moments`), locally typical sampling's kept set (`typical_row`), a cut
                     at a threshold (`keep_ge`)
    simd_math.h, body_kernels.h, decode_kernels.h, quant_types.h   what the sources share (vector exp;
                     declarations, structs; the coded layouts' flags and level tables)
      ──cc -O3 -march=native -fopenmp (kernels/builder.py)──▶ <cache>/kernels/lmhead-<hash>.so (a temporary
      file renamed into place; begun in the background by `load_model` while it reads the file)

Why C: torch ships no kernel for grouped int8 codes × float32 activations (its int4/int8 weight-only ops
quantise the activations or measured slower than float32 here: benchmarks/bench_body.py), and a decode step
of a small model is dominated by the dispatch of ~400 tiny element-wise torch ops. The library links the
libgomp torch has already loaded, so the two share one thread pool. Where there is no compiler, or the
library fails its self-test against plain torch math, `library()` is None and every caller uses torch's ops
(the same numbers, slower). LMHEAD_NATIVE=0 switches it off (benchmarks compare with and without).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys

import torch

from lmhead.kernels import builder
from lmhead.kernels.builder import SOURCES, library_path

__all__ = ["BF16", "F16", "F32", "FLAGS", "HALF", "HALF_MAX_GROUPS", "IQ4", "IQ4_LEVELS", "LEVELS", "MXFP4",
           "PACKED", "ROWS4", "SIGNED4", "SOURCES", "SUB", "AttendArgs", "DecodeArgs", "LayerDesc", "MatDesc",
           "StepArgs", "block4", "keep_ge", "keep_ge_unsure", "library", "library_path", "pack4", "row_lse_bounded",
           "row_moments", "row_scores", "select_ge", "topk", "typical_row", "unblock4", "unpack4"]

# The coded kernel's layout flags and level tables, a mirror of quant_types.h (checked against the library when
# it loads: `_facts_mismatch`); which GGUF type takes which is models/quant_types.py's. 4-bit codes two per byte;
# float16 scales and offsets; rows stored in blocks of four; the file's float16, bfloat16 or float32 weights
# themselves (no codes, no scales); with PACKED, signed 4-bit codes (Q4_0, Q3_K, Q2_K) or indices of a level
# table (IQ4: IQ4_NL, IQ4_XS; MXFP4); scales and offsets as K-quant blocks hold them (d per 256 weights times an
# int8 per group: `models.coded_linear.SubScales`)
FLAGS = (PACKED, HALF, ROWS4, F16, BF16, SIGNED4, IQ4, SUB, F32, MXFP4) = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# each table's sixteen levels in index order (the kernels hold them in stored-nibble order, index ^ 8)
LEVELS = {IQ4: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
          MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)}  # e2m1's values doubled
IQ4_LEVELS = LEVELS[IQ4]
HALF_MAX_GROUPS = 1024  # coded_kernel.c: float16 scales for at most this many groups per row
_ABI = 24  # lmhead_coded_abi() of the sources above


class MatDesc(ctypes.Structure):
    """lmhead_mat: a coded matrix (codes, scale, offset or NULL, group, n, k, flags: PACKED | HALF)."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("flags", ctypes.c_int64)]


class LayerDesc(ctypes.Structure):
    """lmhead_layer: one block's coded matrices, bias, norms and which rope/mask it uses."""

    _fields_ = [("qkv", MatDesc), ("o", MatDesc), ("gate_up", MatDesc), ("down", MatDesc),
                ("qkv_bias", ctypes.c_void_p), ("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("pre_mlp_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("rope", ctypes.c_int64), ("sliding", ctypes.c_int64)]


# The entry points of many arguments take one struct each (body_kernels.h, decode_kernels.h): fields by name, not
# 20-42 positions. Pointers are addresses (ints; None for NULL) that the caller keeps alive through the call.
_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class AttendArgs(ctypes.Structure):
    """lmhead_attend_args: one layer's rope, cache write and attention (body_kernels.h for shapes)."""

    _fields_ = [("qk", _P), ("v", _P), ("cos", _P), ("sin", _P), ("keys", _P), ("values", _P), ("mask", _P),
                ("out", _P), *((n, _I64) for n in ("qk_stride", "v_stride", "B", "T", "H", "Hkv", "hd", "cap",
                                                    "start")),
                ("scaling", _F32), ("softcap", _F32), ("threads", _I32)]


class StepArgs(ctypes.Structure):
    """lmhead_step_args: every block of a decode step (decode_kernels.h for shapes); cos, sin and masks are
    addresses of arrays of addresses (one per rope kind; full attention's and sliding layers' masks)."""

    _fields_ = [*((n, _P) for n in ("layers", "final_norm", "x", "h", "keys", "values", "cos", "sin", "masks",
                                    "scratch")),
                *((n, _I64) for n in ("n_layers", "layer_stride", "B", "T", "D", "H", "Hkv", "hd", "F", "cap",
                                      "start")),
                ("eps", _F32), ("scaling", _F32), ("softcap", _F32),
                ("plus_one", _I32), ("act", _I32), ("threads", _I32)]


class DecodeArgs(ctypes.Structure):
    """lmhead_decode_args: a step's arguments (its cos, sin and masks unused) and the bookkeeping's: ids,
    positions, the cache's columns, the rope tables, the embedding (decode_kernels.h)."""

    _fields_ = [("step", StepArgs),
                *((n, _P) for n in ("embed", "embed_codes", "ids", "positions", "new_valid", "cache_valid",
                                    "cache_pos", "cache_tokens", "cos_tables", "sin_tables", "work")),
                *((n, _I64) for n in ("vocab", "n_kinds", "table_rows", "window")),
                ("embed_scale", _F32), ("has_scale", _I32), ("sliding_kinds", _I32)]


_ARGS = {"lmhead_attend_args": AttendArgs, "lmhead_step_args": StepArgs, "lmhead_decode_args": DecodeArgs}


def _layout_mismatch(lib: ctypes.CDLL) -> str | None:
    """Which argument struct the library and its ctypes mirror disagree on the size of (None: none): a call with
    a wrong layout would read and write memory at the wrong places, so the library is not used at all."""
    for name, mirror in _ARGS.items():
        size = getattr(lib, f"{name}_size")
        size.restype = ctypes.c_size_t
        if size() != ctypes.sizeof(mirror):
            return f"{name} is {size()} bytes in C and {ctypes.sizeof(mirror)} in kernels/native.py"
    return None


def _facts_mismatch(lib: ctypes.CDLL) -> str | None:
    """Where the library's flags or level tables (quant_types.h) differ from this module's mirror (None: nowhere):
    codes laid out for other flags or levels would be multiplied as other numbers."""
    values = (ctypes.c_int64 * 64)()
    count = lib.lmhead_flag_values(values, 64)
    if tuple(values[:count]) != FLAGS:
        return f"its flags are {tuple(values[:count])}, kernels/native.py's {FLAGS}"
    table = (ctypes.c_int8 * 16)()
    for flag, levels in LEVELS.items():
        if lib.lmhead_level_table(flag, table) != 0 or tuple(table) != levels:
            return f"its level table of flag {flag} is not kernels/native.py's {levels}"
    return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.lmhead_coded_abi.restype = i32
    lib.lmhead_coded_avx2.restype = i32
    lib.lmhead_flag_values.argtypes = [p, i32]
    lib.lmhead_flag_values.restype = i32
    lib.lmhead_level_table.argtypes = [i32, p]
    lib.lmhead_level_table.restype = i32
    lib.lmhead_coded_matmul.argtypes = [p, i64, i64, p, p, p, i64, i64, i32, p, i32]
    lib.lmhead_coded_matmul.restype = i32
    lib.lmhead_rms_norm.argtypes = [p, p, p, i64, i64, i64, f32, i32]
    lib.lmhead_rms_norm.restype = None
    lib.lmhead_add_norm.argtypes = [p, p, p, p, p, p, i64, i64, f32, i32]
    lib.lmhead_add_norm.restype = None
    lib.lmhead_gated.argtypes = [p, p, i64, i64, i32]
    lib.lmhead_gated.restype = None
    lib.lmhead_row_scores.argtypes = [p, i64, i64, p, p, p, i32]
    lib.lmhead_row_scores.restype = None
    lib.lmhead_row_greedy.argtypes = [p, i64, i64, p, p, i32]
    lib.lmhead_row_greedy.restype = None
    lib.lmhead_top_p_row.argtypes = [p, i64, f32, ctypes.c_double, p, p, i64, i32]
    lib.lmhead_top_p_row.restype = i64
    lib.lmhead_sample_row.argtypes = [p, i64, f32, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double, p, p,
                                      i32]
    lib.lmhead_sample_row.restype = i32
    lib.lmhead_select_ge.argtypes = [p, i64, f32, p, i64]
    lib.lmhead_select_ge.restype = i64
    lib.lmhead_row_moments.argtypes = [p, i64, i32, p, i32]
    lib.lmhead_row_moments.restype = i32
    lib.lmhead_keep_ge.argtypes = [p, i64, f32, p]
    lib.lmhead_keep_ge.restype = None
    lib.lmhead_typical_row.argtypes = [p, i64, ctypes.c_double, p, i32]
    lib.lmhead_typical_row.restype = i64
    lib.lmhead_row_lse_bounded.argtypes = [p, i64, p, i32]
    lib.lmhead_row_lse_bounded.restype = i32
    lib.lmhead_keep_ge_unsure.argtypes = [p, i64, f32, f32, f32, f32, p]
    lib.lmhead_keep_ge_unsure.restype = i64
    lib.lmhead_attend.argtypes = [ctypes.POINTER(AttendArgs)]
    lib.lmhead_attend.restype = i32
    lib.lmhead_step.argtypes = [ctypes.POINTER(StepArgs)]
    lib.lmhead_step.restype = i32
    lib.lmhead_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.lmhead_decode.restype = i32
    lib.lmhead_coded_rows.argtypes = [ctypes.POINTER(MatDesc), p, i64, p]
    lib.lmhead_coded_rows.restype = i32
    lib.lmhead_screen_norms.argtypes = [p, p, i64, i64, p, i32]
    lib.lmhead_screen_norms.restype = i32
    lib.lmhead_screen.argtypes = [p, i64, i64, p, p, i64, p, p, i32]
    lib.lmhead_screen.restype = i32
    lib.lmhead_screen_select.argtypes = [p, i64, i64, p, p, p, i64, p, p, i32]
    lib.lmhead_screen_select.restype = i32
    lib.lmhead_screen_rescore.argtypes = [p, i64, i64, p, p, i64, p, p, i64, p, i32]
    lib.lmhead_screen_rescore.restype = i32
    return lib


@functools.cache
def avx2() -> bool:
    """Whether the library was built with its AVX2 kernels (the screen has no other)."""
    lib = library()
    return lib is not None and bool(lib.lmhead_coded_avx2())


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler, LMHEAD_NATIVE=0, or a failed self-test)."""
    if os.environ.get("LMHEAD_NATIVE", "1") == "0":
        return None
    try:
        path = library_path()
    except OSError:
        return None
    builder.wait()  # a build `builder.start()` began
    for attempt in range(2):
        if path.exists() and not builder.intact(path):
            # a library cut short or damaged in the cache would crash the process when mapped (a bus error)
            print(f"lmhead: the compiled kernels {path} do not match their checksum; building them again",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                path.unlink()
        if not path.exists() and not builder.build(path):
            return None
        try:
            lib = _bind(ctypes.CDLL(str(path)))
            if lib.lmhead_coded_abi() == _ABI:
                mismatch = _layout_mismatch(lib) or _facts_mismatch(lib)
                if mismatch is not None:  # the same sources build the same structs: rebuilding would not help
                    print(f"lmhead: the compiled kernels {path} do not match their loader ({mismatch}); running "
                          "without them", file=sys.stderr, flush=True)
                    return None
                if _self_test(lib):
                    return lib
        except (OSError, AttributeError):
            pass
        if attempt == 0:  # a damaged or foreign file: build it again once
            try:
                path.unlink()
            except OSError:
                return None
    return None


def pack4(codes: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """Unsigned 4-bit codes [N,K] (groups of 32, K a multiple of 64) → [N,K/2] int8, the kernel's packed layout:
    each 64 codes are 32 bytes read as eight little-endian uint32 lanes, nibble i of lane l holding code 8·i + l
    XOR 8 — code − 8 as a signed nibble (so that two shifts put eight consecutive codes − 8, or one shift and one
    mask after an XOR the codes, in the eight lanes of a vector). `signed`: codes in [-8, 7] (the SIGNED4 layout),
    each nibble the code itself as a signed 4-bit number — the unsigned layout of code + 8."""
    n, k = codes.shape
    if signed:
        codes = codes + 8
    c = codes.view(n, k // 64, 4, 2, 8).to(torch.uint8) ^ 8    # [.., byte b, low/high nibble, lane l]
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).transpose(2, 3).reshape(n, k // 2).view(torch.int8)


def block4(rows: torch.Tensor) -> torch.Tensor:
    """Code rows [N,R] (N a multiple of 4, R of 32 bytes: int8 codes or `pack4`'s) → the kernel's ROWS4 layout,
    same shape: each block of four rows stored 32-byte unit by unit (unit u of its rows 0..3 side by side)."""
    n, r = rows.shape
    return rows.reshape(n // 4, 4, r // 32, 32).transpose(1, 2).reshape(n, r).contiguous()


def unblock4(blocked: torch.Tensor) -> torch.Tensor:
    """The inverse of `block4`."""
    n, r = blocked.shape
    return blocked.reshape(n // 4, r // 32, 4, 32).transpose(1, 2).reshape(n, r).contiguous()


def unpack4(packed: torch.Tensor, signed: bool = False) -> torch.Tensor:
    """The inverse of `pack4`: [N,K/2] → int8 codes [N,K]."""
    n, half = packed.shape
    b = packed.view(torch.uint8).view(n, half // 32, 8, 4).transpose(2, 3)   # [.., byte b, lane l]
    codes = (torch.stack([b & 15, b >> 4], dim=3).reshape(n, half * 2) ^ 8).to(torch.int8)
    return codes - 8 if signed else codes


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5))


def _self_test(lib: ctypes.CDLL) -> bool:
    """Every entry point against plain torch math on small random inputs (every path of the coded product:
    1 and several rows, groups 16 and 32, with and without offsets): built with an unknown compiler on an
    unknown machine, it is checked, not assumed."""
    g = torch.Generator().manual_seed(0)
    for group, offset in ((32, False), (32, True), (16, False), (16, True)):
        codes = torch.randint(-32, 32, (37, 4 * group), generator=g, dtype=torch.int8)
        scale = torch.rand(37, 4, generator=g) * 0.01
        off = torch.randn(37, 4, generator=g) * 0.01 if offset else None
        w = codes.float().view(37, 4, group) * scale[..., None]
        if off is not None:
            w = w + off[..., None]
        w = w.view(37, -1)
        for m in (1, 3, 6, 9):
            x = torch.randn(m, 4 * group, generator=g)
            y = torch.empty(m, 37)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 4 * group, codes.data_ptr(), scale.data_ptr(),
                                         None if off is None else off.data_ptr(), 37, group, 0, y.data_ptr(), 2)
            if rc != 0 or not _close(y, x.double() @ w.double().T):
                return False
    # Q6_K's and Q3_K's layout: groups of 16 in blocks of four rows (two groups to a 32-byte unit); Q2_K's: with
    # offsets
    codes = torch.randint(-32, 32, (16, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(16, 8, generator=g) * 0.01
    off = torch.randn(16, 8, generator=g) * 0.01
    blocked = block4(codes)
    for o in (None, off):
        w = (codes.float().view(16, 8, 16) * scale[..., None] + (0 if o is None else o[..., None])).view(16, 128)
        for m in (1, 3, 6, 9):
            x, y = torch.randn(m, 128, generator=g), torch.empty(m, 16)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 128, blocked.data_ptr(), scale.data_ptr(),
                                         None if o is None else o.data_ptr(), 16, 16, ROWS4, y.data_ptr(), 2)
            if rc != 0 or not _close(y, x.double() @ w.double().T):
                return False
    # packed 4-bit codes (the same product from half the bytes), float16 scales, both
    codes = torch.randint(0, 16, (19, 128), generator=g, dtype=torch.int8)
    scale = (torch.rand(19, 4, generator=g) * 0.01).half()
    off = (torch.randn(19, 4, generator=g) * 0.01).half()
    w = (codes.float().view(19, 4, 32) * scale.float()[..., None] + off.float()[..., None]).view(19, 128)
    packed = pack4(codes)  # held: the kernel reads its memory
    for flags in (PACKED, HALF, PACKED | HALF, ROWS4, ROWS4 | PACKED, ROWS4 | PACKED | HALF):
        rows = 16 if flags & ROWS4 else 19  # ROWS4: whole blocks of four rows
        c = packed[:rows] if flags & PACKED else codes[:rows]
        c = block4(c) if flags & ROWS4 else c
        s, o = (scale, off) if flags & HALF else (scale.float(), off.float())
        s, o = s[:rows].contiguous(), o[:rows].contiguous()
        for m in (1, 5, 9):
            x, y = torch.randn(m, 128, generator=g), torch.empty(m, rows)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 128, c.data_ptr(), s.data_ptr(), o.data_ptr(),
                                         rows, 32, flags, y.data_ptr(), 2)
            if rc != 0 or not _close(y, x.double() @ w[:rows].double().T):
                return False
        if flags & ROWS4:  # without offsets too (Q8_0, Q5_0)
            x, y = torch.randn(1, 128, generator=g), torch.empty(1, rows)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), 1, 128, c.data_ptr(), s.data_ptr(), None, rows, 32, flags,
                                         y.data_ptr(), 2)
            wo = (codes[:rows].float().view(rows, 4, 32) * scale[:rows].float()[..., None]).view(rows, 128)
            if rc != 0 or not _close(y, x.double() @ wo.double().T):
                return False
    # signed packed 4-bit codes (Q4_0) and IQ4_NL's levels, without offsets: K = 192 leaves a unit past the 512-bit
    # pairs; signed codes in groups of 16 (Q3_K without offsets, Q2_K with them), float32 scales
    levels = torch.tensor(IQ4_LEVELS)
    for k, iq4, group, offsets in ((128, False, 32, False), (192, False, 32, False), (128, True, 32, False),
                                   (192, True, 32, False), (192, False, 16, False), (192, False, 16, True)):
        index = torch.randint(0, 16, (20, k), generator=g, dtype=torch.int8)
        codes = levels[index.long()] if iq4 else index - 8
        scale = (torch.randn(20, k // group, generator=g) * 0.01).half()
        off = (torch.randn(20, k // group, generator=g) * 0.01).float() if offsets else None
        w = (codes.float().view(20, -1, group) * scale.float()[..., None]).view(20, k)
        w = w if off is None else w + off.repeat_interleave(group, dim=1)
        packed = pack4(index) if iq4 else pack4(codes, signed=True)
        level = IQ4 if iq4 else SIGNED4
        s = scale if group == 32 else scale.float()
        for flags in (PACKED | level, ROWS4 | PACKED | level):
            flags |= HALF if group == 32 else 0
            c = block4(packed) if flags & ROWS4 else packed
            for m in (1, 2, 5, 9):
                x, y = torch.randn(m, k, generator=g), torch.empty(m, 20)
                rc = lib.lmhead_coded_matmul(x.data_ptr(), m, k, c.data_ptr(), s.data_ptr(),
                                             None if off is None else off.data_ptr(), 20, group, flags, y.data_ptr(), 2)
                if rc != 0 or not _close(y, x.double() @ w.double().T):
                    return False
    # K-quant sub-scales (SUB): d per 256 weights times an int8 per group, scales and offsets, int8 and packed codes
    for group, packed in ((16, False), (32, False), (16, True)):
        k, ng, nsup = 512, 512 // group, 2
        codes = torch.randint(-8 if packed else -32, 8 if packed else 32, (20, k), generator=g, dtype=torch.int8)
        bufs, floats = [], []
        for _ in range(2):  # scale, offset
            d = (torch.randn(20, nsup, generator=g) * 1e-3).half().float()
            sub = torch.randint(-8, 8, (20, ng), generator=g, dtype=torch.int8)
            bufs.append(torch.cat([d.contiguous().view(torch.uint8).flatten(), sub.view(torch.uint8).flatten()]))
            floats.append(d.repeat_interleave(ng // nsup, dim=1) * sub.float())
        w = (codes.float().view(20, ng, group) * floats[0][..., None] + floats[1][..., None]).view(20, k)
        c = pack4(codes, signed=True) if packed else codes
        for flags in (SUB | (PACKED | SIGNED4 if packed else 0), SUB | ROWS4 | (PACKED | SIGNED4 if packed else 0)):
            cc = block4(c) if flags & ROWS4 else c
            for m in (1, 2, 5, 9):
                x, y = torch.randn(m, k, generator=g), torch.empty(m, 20)
                rc = lib.lmhead_coded_matmul(x.data_ptr(), m, k, cc.data_ptr(), bufs[0].data_ptr(), bufs[1].data_ptr(),
                                             20, group, flags, y.data_ptr(), 2)
                if rc != 0 or not _close(y, x.double() @ w.double().T):
                    return False
    # float16, bfloat16 and float32 weights, K not a multiple of the vector width
    for flags, dtype in ((F16, torch.float16), (BF16, torch.bfloat16), (F32, torch.float32)):
        w16 = torch.randn(7, 75, generator=g).to(dtype)
        for m in (1, 4, 9):
            x, y = torch.randn(m, 75, generator=g), torch.empty(m, 7)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 75, w16.data_ptr(), None, None, 7, 75, flags,
                                         y.data_ptr(), 2)
            if rc != 0 or not _close(y, x.double() @ w16.double().T):
                return False
    x, a = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w1, w2 = torch.randn(40, generator=g), torch.randn(40, generator=g)
    eps = 1e-6
    for plus_one in (0, 1):
        def norm(v, w, plus_one=plus_one):
            y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
            return y * (1 + w) if plus_one else w * y
        y = torch.empty(3, 40)
        lib.lmhead_rms_norm(x.data_ptr(), w1.data_ptr(), y.data_ptr(), 3, 40, 1, eps, plus_one)
        if not _close(y, norm(x, w1)):
            return False
        xo, h = torch.empty(3, 40), torch.empty(3, 40)
        lib.lmhead_add_norm(x.data_ptr(), a.data_ptr(), w1.data_ptr(), w2.data_ptr(), xo.data_ptr(), h.data_ptr(),
                            3, 40, eps, plus_one)
        if not (_close(xo, x + norm(a, w1)) and _close(h, norm(x + norm(a, w1), w2))):
            return False
    gu, out = torch.randn(2, 80, generator=g), torch.empty(2, 40)
    for act, fn in ((0, lambda t: torch.nn.functional.gelu(t, approximate="tanh")), (1, torch.nn.functional.silu)):
        lib.lmhead_gated(gu.data_ptr(), out.data_ptr(), 2, 40, act)
        if not _close(out, fn(gu[:, :40]) * gu[:, 40:]):
            return False
    rows = torch.randn(3, 1003, generator=g) * 4
    rows[1, 17] = float("-inf")
    lse, greater = _row_scores(lib, rows, torch.tensor([5, 17, 1002]), threads=2)
    if not _close(lse, torch.logsumexp(rows.double(), -1)) or greater.tolist() != [
            int((rows[b] > rows[b, t]).sum()) for b, t in enumerate((5, 17, 1002))]:
        return False
    rows[2, 3] = rows[2, 900] = rows[2].max() + 1  # a tie: the first position
    ids, lse = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.float64)
    lib.lmhead_row_greedy(rows.data_ptr(), 3, 1003, ids.data_ptr(), lse.data_ptr(), 2)
    if ids.tolist() != rows.argmax(-1).tolist() or not _close(lse, torch.logsumexp(rows.double(), -1)):
        return False
    row = torch.randn(1003, generator=g) * 3
    kept = _top_p_row_in(lib, row, 0.7, 0.9)
    xt = row / 0.7
    v, i = torch.sort(xt, descending=True, stable=True)
    probs = torch.softmax(v.double(), -1)
    keep = probs.flip(-1).cumsum(-1).flip(-1) > 1 - 0.9
    keep[0] = True
    if kept is None or not (torch.equal(kept[1][0], i[keep]) and torch.equal(kept[0][0], v[keep])):
        return False
    row = torch.randn(100, generator=g)
    out = torch.empty(100, dtype=torch.int64)
    if lib.lmhead_select_ge(row.data_ptr(), 100, 0.5, out.data_ptr(), 100) != int((row >= 0.5).sum()):
        return False
    if out[:int((row >= 0.5).sum())].tolist() != (row >= 0.5).nonzero().squeeze(1).tolist():
        return False
    return _steps_test(lib, g) and _attend_test(lib, g)


_TOPK_STRIDE = 16  # `topk`: every 16th logit sets the threshold
_TOPK_MIN_WIDTH = 16384  # narrower rows: torch.topk alone
_TOPK_CAP = 1 << 15  # more candidates than this: torch.topk
_TOPK_MAX_ROWS = 4  # rows are thresholded one after another; torch.topk shares more rows over the threads
_TOPK_MAX_K_ROWS = 64  # several rows: only for a small k (four rows with k 257 measured 0.92x torch.topk)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch.topk(x, k, dim=-1) for rows x [b,V] (float32, CPU, V ≥ 16,384, k ≤ V/256) by a threshold: the k-th
    largest of every 16th logit is at most the row's k-th largest, so only the logits at or above it (for a
    language model's logits a few thousand of 262,144; found in one pass in C) are sorted. The same values in
    the same order; among equal values the indices may come in another order. None (the caller uses
    torch.topk) without the library, for a row with a NaN (torch.topk ranks NaN first) and when too many
    logits reach the threshold (a flat row), for more than 4 rows and for several rows with k > 64 (torch.topk
    shares rows over the threads). `benchmarks/bench_kernels.py`, 262,144 logits, quiet: one row, k 41 / 257,
    0.48 / 0.56 ms with torch.topk, 0.15 / 0.39 ms this way; four rows, k 41: 0.92 against 0.45 ms."""
    lib = library()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.requires_grad
            or not 1 <= k <= x.shape[1] // 256 or x.shape[1] < _TOPK_MIN_WIDTH or x.shape[0] > _TOPK_MAX_ROWS
            or (x.shape[0] > 1 and k > _TOPK_MAX_K_ROWS)):
        return None
    x = x.contiguous()
    b, width = x.shape
    thresholds = torch.topk(x[:, ::_TOPK_STRIDE], k, dim=-1).values[:, -1].tolist()
    values = torch.empty(b, k, dtype=torch.float32)
    indices = torch.empty(b, k, dtype=torch.int64)
    found = torch.empty(_TOPK_CAP, dtype=torch.int64)
    for r, t in enumerate(thresholds):
        row = x[r]
        n = lib.lmhead_select_ge(row.data_ptr(), width, t, found.data_ptr(), _TOPK_CAP)
        if n < k:  # a NaN (-2), too many candidates (-1); never fewer than k otherwise
            return None
        cand = found[:n]
        v, i = torch.topk(row.index_select(0, cand), k)
        values[r], indices[r] = v, cand.index_select(0, i)
    return values, indices


def _row_scores(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor,
                threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.to(torch.int64).contiguous()
    lse, greater = torch.empty(x.shape[0], dtype=torch.float64), torch.empty(x.shape[0], dtype=torch.int64)
    lib.lmhead_row_scores(x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), lse.data_ptr(), greater.data_ptr(),
                          threads)
    return lse, greater


def row_scores(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode loop's score of each row's token from logits x [B,V] (float32, CPU) and ids [B]: the
    log-softmax normaliser lse [B] float64 (raw logprob = x[b, id] − lse[b]) and greater [B] int64, the count
    of logits > x[b, id] (rank − 1), in two passes over each row (row_kernels.c). None without the library or
    where a row is not all finite numbers (the caller's torch path then gives torch's answer: NaN, ±inf)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    # the C passes read x[b, ids[b]]: an id outside the row would be read outside the tensor
    if ids.dim() != 1 or ids.shape[0] != x.shape[0] or ids.is_floating_point():
        raise ValueError(f"ids must be [{x.shape[0]}] integer token ids, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= x.shape[1]):
        raise ValueError(f"ids must be in [0, {x.shape[1]}), got {ids.tolist()}")
    lse, greater = _row_scores(lib, x.contiguous(), ids, torch.get_num_threads())
    if not bool(torch.isfinite(lse).all()):
        return None
    return lse, greater


def token_scores(x: torch.Tensor, ids: list[int]) -> tuple[list[float], list[int]] | None:
    """`row_scores` for ids given as a list, answered as Python numbers: each row's raw log-probability of its id
    (x[b, id], in double, minus the normaliser) and rank (1 + the count of logits above it), with no torch
    operation around the C passes (the decode loop's scores of sampled tokens: each torch operation cost ~50 µs
    on the caches a step leaves). x [B,V] float32 CPU. ValueError for ids that are not one int in [0, V) per row;
    None without the library, or where a row is not all finite numbers (the caller's torch path answers)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    b, v = x.shape
    if len(ids) != b or not all(type(t) is int and 0 <= t < v for t in ids):
        raise ValueError(f"ids must be {b} integer token ids in [0, {v}), got {ids!r}")
    x = x if x.is_contiguous() else x.contiguous()
    chosen, lse, greater = (ctypes.c_int64 * b)(*ids), (ctypes.c_double * b)(), (ctypes.c_int64 * b)()
    lib.lmhead_row_scores(x.data_ptr(), b, v, ctypes.addressof(chosen), ctypes.addressof(lse),
                          ctypes.addressof(greater), torch.get_num_threads())
    if not all(math.isfinite(n) for n in lse):
        return None
    base = x.data_ptr()
    raw = [ctypes.c_float.from_address(base + 4 * (r * v + t)).value - lse[r] for r, t in enumerate(ids)]
    return raw, [1 + g for g in greater]


def greedy_rows(x: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Plain greedy rows of logits x [B,V] (float32, CPU) in one C call: ids [B], the first position of each
    row's maximum (`torch.argmax`'s choice), and raw [B], its raw log-probability (the max, in double, minus the
    log-softmax normaliser; its rank is 1), as Python numbers: no torch operation after the call (each cost
    ~50 µs on the caches a decode step leaves). None without the library or where a row is not all finite numbers
    (the caller's torch path then gives torch's answer or its error)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    b, v = x.shape
    ids, lse = (ctypes.c_int64 * b)(), (ctypes.c_double * b)()
    lib.lmhead_row_greedy(x.data_ptr(), b, v, ctypes.addressof(ids), ctypes.addressof(lse), torch.get_num_threads())
    if not all(math.isfinite(n) for n in lse):
        return None
    base = x.data_ptr()
    chosen = list(ids)
    return chosen, [ctypes.c_float.from_address(base + 4 * (r * v + t)).value - lse[r] for r, t in enumerate(chosen)]


TOP_P_CAP = 8192  # `top_p_row`: more candidates than this, the caller's histogram path


def top_p_row(x: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact top-p set of one row of logits x [V] (float32, CPU) at `temperature`, by sampling/top_p.py's rule
    (`top_p_sorted`): (vals [1,m] float32, the kept tokens' x / temperature sorted descending, ties by id;
    ids [1,m] int64), in three passes over the row in C (the first two split over the threads) and a sort of the
    few candidates. None without the library, for a row that is not all finite numbers or too flat for its
    thresholds (more than TOP_P_CAP candidates, or no threshold within 32 of the maximum holds the mass): the
    caller's torch path then answers."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return _top_p_row_in(lib, x, temperature, top_p)


def _top_p_row_in(lib: ctypes.CDLL, x: torch.Tensor, temperature: float,
                 top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    x = x.contiguous()
    ids, vals = torch.empty(TOP_P_CAP, dtype=torch.int64), torch.empty(TOP_P_CAP, dtype=torch.float32)
    n = lib.lmhead_top_p_row(x.data_ptr(), x.shape[0], float(temperature), float(top_p), ids.data_ptr(),
                             vals.data_ptr(), TOP_P_CAP, torch.get_num_threads())
    if n < 1:
        return None
    return vals[:n].unsqueeze(0), ids[:n].unsqueeze(0)


def sample_row(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
               u: float) -> tuple[int, float] | None:
    """One unseeded draw from a row of logits x [V] (float32, CPU) at `temperature` with top-k `top_k` (0: none),
    top-p `top_p` (1: none) and min-p `min_p` (0: none), and nothing else in the pipeline (no bias or penalties):
    (id, its processed log-probability) by inverse CDF with the uniform u in [0, 1), in one C call (the cut-offs
    in the pipeline's order over the top-k set, `top_p_row`'s set or the tokens min-p keeps; or the whole row).
    The same distribution as `sampling.sample`'s for such a row; other ids for the same generator state. None
    without the library, for a row that is not all finite numbers, or a cut not settled in C (a flat row's top-p
    set, a top-k or a min-p alone keeping more than 8,192 tokens): the caller's torch path then answers (and
    raises its errors)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out_id, out_lp = ctypes.c_int64(), ctypes.c_double()
    rc = lib.lmhead_sample_row(x.data_ptr(), x.shape[0], float(temperature), int(top_k), float(top_p), float(min_p),
                               float(u), ctypes.byref(out_id), ctypes.byref(out_lp), torch.get_num_threads())
    return (out_id.value, out_lp.value) if rc == 0 else None


def _row_moments_in(lib: ctypes.CDLL, x: torch.Tensor, sigma: bool, threads: int,
                    exps: bool = True) -> tuple[float, ...] | None:
    out = (ctypes.c_double * 7)()
    if lib.lmhead_row_moments(x.data_ptr(), x.shape[0], int(exps) | 2 * int(sigma), ctypes.addressof(out), threads):
        return None
    return tuple(out)


def row_moments(x: torch.Tensor, sigma: bool = False, exps: bool = True) -> tuple[float, ...] | None:
    """One row of logits x [V] (float32, CPU) → (max, the count of finite logits, S = Σ e^(x − max), A = Σ e^(x −
    max)·(x − max) (NaN without `exps`), the least finite logit, the mean of the finite logits, and with `sigma`
    their population standard deviation, else 0), in float64 from one pass over the row in C, one more for the
    exps and one for `sigma`. None without the library, or for a row with a NaN, +inf or no finite logit (the
    caller's torch path answers)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return _row_moments_in(lib, x if x.is_contiguous() else x.contiguous(), sigma, torch.get_num_threads(), exps)


def row_lse_bounded(x: torch.Tensor) -> tuple[float, float, float, float, float] | None:
    """One row of logits x [V] (float32, CPU) → (max, log S', δ, H', δ_H): the log-normaliser's log Σ e^(x − max)
    and the entropy from float32 exps summed in double, with bounds δ and δ_H on their distances from the exact ones
    (step_kernels.c), in two passes. None without the library or AVX2, or for a row with a NaN, +inf or no finite
    logit."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = (ctypes.c_double * 5)()
    if lib.lmhead_row_lse_bounded(x.data_ptr(), x.shape[0], ctypes.addressof(out), torch.get_num_threads()):
        return None
    return out[0], out[1], out[2], out[3], out[4]


def keep_ge_unsure(x: torch.Tensor, threshold: float, low: float, high: float,
                   top: float) -> tuple[torch.Tensor, int] | None:
    """`keep_ge` (float32 values), and how many logits below `top` lie in [low, high] — the ones a threshold known
    only to lie in [low, high] may not have decided. None without the library."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    unsure = lib.lmhead_keep_ge_unsure(x.data_ptr(), x.shape[0], threshold, low, high, top, out.data_ptr())
    return out, unsure


def keep_ge(x: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """x [V] (float32, CPU) with every logit below `threshold` (a float32 value) at -inf, in one pass in C. None
    without the library."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    lib.lmhead_keep_ge(x.data_ptr(), x.shape[0], threshold, out.data_ptr())
    return out


def select_ge(x: torch.Tensor, threshold: float, cap: int) -> torch.Tensor | None:
    """The positions of x [V] (float32, CPU) holding values ≥ `threshold` (a float32 value), ascending, int64, in
    one pass in C. None without the library, for a NaN, or when more than `cap` reach it."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(max(cap, 1), dtype=torch.int64)
    n = lib.lmhead_select_ge(x.data_ptr(), x.shape[0], threshold, out.data_ptr(), max(cap, 1))
    return out[:n] if n >= 0 else None


def _typical_row_in(lib: ctypes.CDLL, x: torch.Tensor, mass: float, threads: int) -> torch.Tensor | None:
    out = torch.empty_like(x)
    return out if lib.lmhead_typical_row(x.data_ptr(), x.shape[0], float(mass), out.data_ptr(), threads) >= 0 else None


def typical_row(x: torch.Tensor, mass: float) -> torch.Tensor | None:
    """Locally typical sampling on one row of logits x [V] (float32, CPU) with mass `mass`: x with the tokens outside
    the typical set at -inf (step_kernels.c: the reference's rule in float64, in four passes over the row and a
    sort of one bin's tokens). None without the library or for a row with a NaN, +inf or no finite logit."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return _typical_row_in(lib, x if x.is_contiguous() else x.contiguous(), mass, torch.get_num_threads())


def _steps_test(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """step_kernels.c against torch's float64: the moments, a threshold cut, and the typical set by sorting, on a
    row wide enough to be cut into pieces over two threads."""
    row = torch.randn(40_003, generator=g) * 4
    row[7] = float("-inf")
    for threads in (1, 2):
        got = _row_moments_in(lib, row, True, threads)
        d = row.double()
        fin = d[torch.isfinite(d)]
        e = torch.exp(d - d.max())
        want = (float(d.max()), fin.numel(), float(e.sum()), float((e[torch.isfinite(d)] * (fin - d.max())).sum()),
                float(fin.min()), float(fin.mean()), float(((fin - fin.mean()) ** 2).mean().sqrt()))
        if got is None or not all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
                                  for a, b in zip(got, want, strict=True)):
            return False
        mass = 0.7
        p = torch.softmax(d, -1)
        score = (d - (d.max() + got[3] / got[2])).abs()
        order = torch.sort(score, stable=True).indices
        last = int((p[order].cumsum(0) < mass).sum())
        keep = score <= score[order[last]]
        typ = _typical_row_in(lib, row, mass, threads)
        if typ is None or not torch.equal(typ, torch.where(keep, row, float("-inf"))):
            return False
    out, d = (ctypes.c_double * 5)(), row.double()
    if lib.lmhead_coded_avx2():  # the bounded log-normaliser has no path without AVX2
        if lib.lmhead_row_lse_bounded(row.data_ptr(), row.shape[0], ctypes.addressof(out), 2):
            return False
        logp = torch.log_softmax(d, 0)
        exact, entropy = float(torch.logsumexp(d - d.max(), 0)), float(-(logp.exp() * logp).nansum())
        if not (out[0] == float(d.max()) and abs(out[1] - exact) <= out[2] < 1e-4
                and abs(out[3] - entropy) <= out[4] < 1e-4):
            return False
    kept = torch.empty_like(row)
    lib.lmhead_keep_ge(row.data_ptr(), row.shape[0], 0.5, kept.data_ptr())
    if not torch.equal(kept, torch.where(row >= 0.5, row, float("-inf"))):
        return False
    unsure = lib.lmhead_keep_ge_unsure(row.data_ptr(), row.shape[0], 0.5, 0.25, 0.75, float(row.max()), kept.data_ptr())
    return torch.equal(kept, torch.where(row >= 0.5, row, float("-inf"))) and unsure == int(
        ((row >= 0.25) & (row <= 0.75)).sum())


def _attend_test(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """lmhead_attend against torch: rope, cache write, masked grouped attention (2 query heads per key head)."""
    b, t, h, hkv, hd, cap, start = 2, 3, 4, 2, 8, 10, 4
    qk = torch.randn(b, t, h + hkv, hd, generator=g)
    v = torch.randn(b, t, hkv, hd, generator=g)
    cos, sin = torch.randn(b, t, hd, generator=g), torch.randn(b, t, hd, generator=g)
    keys, values = torch.randn(b, hkv, cap, hd, generator=g), torch.randn(b, hkv, cap, hd, generator=g)
    mask = torch.where(torch.rand(b, t, start + t, generator=g) < 0.3, -1e30, 0.0)
    out = torch.empty(b, t, h * hd)
    want_k, want_v = keys.clone(), values.clone()
    rc = lib.lmhead_attend(AttendArgs(
        qk=qk.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
        values=values.data_ptr(), mask=mask.data_ptr(), out=out.data_ptr(), qk_stride=(h + hkv) * hd,
        v_stride=hkv * hd, B=b, T=t, H=h, Hkv=hkv, hd=hd, cap=cap, start=start, scaling=0.5, softcap=0.0, threads=2))
    roped = qk * cos[:, :, None] + qk.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin[:, :, None]
    want_k[:, :, start:start + t] = roped[:, :, h:].transpose(1, 2)
    want_v[:, :, start:start + t] = v.transpose(1, 2)
    q = roped[:, :, :h].transpose(1, 2)                                           # [B,H,T,hd]
    kk = want_k[:, :, :start + t].repeat_interleave(h // hkv, dim=1)
    vv = want_v[:, :, :start + t].repeat_interleave(h // hkv, dim=1)
    scores = q @ kk.transpose(-1, -2) * 0.5 + mask[:, None]
    want = (torch.softmax(scores, -1) @ vv).transpose(1, 2).reshape(b, t, h * hd)
    return rc == 0 and _close(out, want) and _close(keys, want_k) and _close(values, want_v)

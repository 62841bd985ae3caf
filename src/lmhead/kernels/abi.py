"""What the C side declares, mirrored for ctypes: the coded kernel's layout flags and level tables, the argument
structs, and the calls on a given library that both the bindings (`native`) and the self-test make."""

from __future__ import annotations

import ctypes

import torch

# The coded kernel's layout flags and level tables, a mirror of quant_types.h (checked against the library when
# it loads: `_facts_mismatch`); which GGUF type takes which is models/quant_types.py's. 4-bit codes two per byte;
# float16 scales and offsets; rows stored in blocks of four; the file's float16, bfloat16 or float32 weights
# themselves (no codes, no scales); with PACKED, signed 4-bit codes (Q4_0, Q3_K, Q2_K) or indices of a level
# table (IQ4: IQ4_NL, IQ4_XS; MXFP4); scales and offsets as K-quant blocks hold them (d per 256 weights times an
# int8 per group: `models.coded_linear.SubScales`); scales as MXFP4's exponent bytes (E8M0: 2^(e − 128)); codes
# sixteen rows a vector for the integer path by groups (GROUPS16: kernels/groups_kernel.h, `models.groups16`),
# there 5- or 6-bit codes as nibbles with their top bit or two in a plane beside them (HIGH1, HIGH2; SIGNED4: signed)
FLAGS = (PACKED, HALF, ROWS4, F16, BF16, SIGNED4, IQ4, SUB, F32, MXFP4, E8M0, GROUPS16, HIGH1, HIGH2) = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# each table's sixteen levels in index order (the kernels hold them in stored-nibble order, index ^ 8)
LEVELS = {IQ4: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
          MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)}  # e2m1's values doubled
IQ4_LEVELS = LEVELS[IQ4]
HALF_MAX_GROUPS = 1024  # coded_kernel.c: float16 scales for at most this many groups per row

# The gated activations' codes, a mirror of body_kernels.h's LMHEAD_ACT_* (checked against the library when it
# loads: `_facts_mismatch`): transformers' activation names of the dense MLPs the kernels run, and gpt-oss's
# clamped SwiGLU (its experts')
ACT_GELU_TANH, ACT_SILU, ACT_SWIGLU_OAI = ACT_VALUES = (0, 1, 2)
ACTIVATIONS = {"gelu_pytorch_tanh": ACT_GELU_TANH, "silu": ACT_SILU}
# a kernel's result where a buffer could not be had (kernel_results.h's LMHEAD_NO_MEMORY; −1: arguments refused)
NO_MEMORY = -3


class MatDesc(ctypes.Structure):
    """lmhead_mat: a coded matrix (codes, scale, offset or NULL, group, n, k, flags: PACKED | HALF; more: the
    address of its next row block's MatDesc, or None — `models.row_blocks.RowBlocks`)."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("flags", ctypes.c_int64),
                ("more", ctypes.c_void_p)]


class LayerDesc(ctypes.Structure):
    """lmhead_layer: one block's coded matrices, biases, norms and which rope/mask it uses; a mixture of experts'
    products (addresses of `kernels.experts.ExpertsMat`s), biases, top k and activation in place of gate_up and
    down where its experts_gate_up is not None, and its shared expert where shared_gate_up's codes are not None."""

    _fields_ = [("qkv", MatDesc), ("o", MatDesc), ("gate_up", MatDesc), ("down", MatDesc),
                ("qkv_bias", ctypes.c_void_p), ("input_norm", ctypes.c_void_p), ("post_attn_norm", ctypes.c_void_p),
                ("pre_mlp_norm", ctypes.c_void_p), ("post_mlp_norm", ctypes.c_void_p), ("qk_norm", ctypes.c_void_p),
                ("rope", ctypes.c_int64), ("sliding", ctypes.c_int64), ("o_bias", ctypes.c_void_p),
                ("sinks", ctypes.c_void_p), ("experts_gate_up", ctypes.c_void_p), ("experts_down", ctypes.c_void_p),
                ("experts_gate_up_bias", ctypes.c_void_p), ("experts_down_bias", ctypes.c_void_p),
                ("top_k", ctypes.c_int64), ("experts_act", ctypes.c_int64), ("alpha", ctypes.c_float),
                ("limit", ctypes.c_float), ("shared_gate_up", MatDesc), ("shared_down", MatDesc)]


# The entry points of many arguments take one struct each (body_kernels.h, decode_kernels.h): fields by name, not
# 20-42 positions. Pointers are addresses (ints; None for NULL) that the caller keeps alive through the call.
_P, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class SharedArgs(ctypes.Structure):
    """lmhead_shared: the columns rows read from shared blocks (a prefix-cache hit's): per row its blocks'
    addresses (keys, values: [B·n]), its first shared column and how many (start, len: [B] int64)."""

    _fields_ = [("keys", _P), ("values", _P), ("start", _P), ("len", _P), ("n", _I64), ("block", _I64)]


class AttendArgs(ctypes.Structure):
    """lmhead_attend_args: one layer's rope, cache write and attention (body_kernels.h for shapes); shared: the
    address of a SharedArgs or None, layer: which layer's part of its blocks; sinks: [H] float32 or None."""

    _fields_ = [("qk", _P), ("v", _P), ("cos", _P), ("sin", _P), ("keys", _P), ("values", _P), ("mask", _P),
                ("out", _P), *((n, _I64) for n in ("qk_stride", "v_stride", "B", "T", "H", "Hkv", "hd", "cap",
                                                    "start")),
                ("scaling", _F32), ("softcap", _F32), ("threads", _I32), ("shared", _P), ("layer", _I64),
                ("sinks", _P)]


class StepArgs(ctypes.Structure):
    """lmhead_step_args: every block of a decode step (decode_kernels.h for shapes); cos, sin and masks are
    addresses of arrays of addresses (one per rope kind; full attention's and sliding layers' masks)."""

    _fields_ = [*((n, _P) for n in ("layers", "final_norm", "x", "h", "keys", "values", "cos", "sin", "masks",
                                    "scratch")),
                *((n, _I64) for n in ("n_layers", "layer_stride", "B", "T", "D", "H", "Hkv", "hd", "F", "cap",
                                      "start")),
                ("eps", _F32), ("scaling", _F32), ("softcap", _F32),
                ("plus_one", _I32), ("act", _I32), ("threads", _I32), ("shared", _P), ("route", _P)]


# lmhead_route_fn: (layer, h [rows, D], rows, chosen [rows, k] int64, weights [rows, k] float32, shared [rows]
# float32 or NULL) → 0 or nonzero
ROUTE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p, ctypes.c_void_p)


class DecodeArgs(ctypes.Structure):
    """lmhead_decode_args: a step's arguments (its cos, sin and masks unused) and the bookkeeping's: ids,
    positions, the cache's columns, the rope tables, the embedding (decode_kernels.h)."""

    _fields_ = [("step", StepArgs),
                *((n, _P) for n in ("embed", "embed_codes", "ids", "positions", "new_valid", "cache_valid",
                                    "cache_pos", "cache_tokens", "cos_tables", "sin_tables", "work")),
                *((n, _I64) for n in ("vocab", "n_kinds", "table_rows", "window")),
                ("embed_scale", _F32), ("has_scale", _I32), ("sliding_kinds", _I32)]


ARGS = {"lmhead_attend_args": AttendArgs, "lmhead_step_args": StepArgs, "lmhead_decode_args": DecodeArgs,
        "lmhead_mat": MatDesc, "lmhead_layer": LayerDesc}


TOP_P_CAP = 8192  # `top_p_row`: more candidates than this, the caller's histogram path
SAMPLE_CAP = 8192  # `top_k_row`: row_kernels.c's room for a row's kept tokens (a smaller buffer it refuses)


def row_scores_in(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor,
                threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.to(torch.int64).contiguous()
    lse, greater = torch.empty(x.shape[0], dtype=torch.float64), torch.empty(x.shape[0], dtype=torch.int64)
    lib.lmhead_row_scores(x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), lse.data_ptr(), greater.data_ptr(),
                          threads)
    return lse, greater


def top_p_row_in(lib: ctypes.CDLL, x: torch.Tensor, temperature: float,
                 top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    x = x.contiguous()
    ids, vals = torch.empty(TOP_P_CAP, dtype=torch.int64), torch.empty(TOP_P_CAP, dtype=torch.float32)
    n = lib.lmhead_top_p_row(x.data_ptr(), x.shape[0], float(temperature), float(top_p), ids.data_ptr(),
                             vals.data_ptr(), TOP_P_CAP, torch.get_num_threads())
    if n < 1:
        return None
    return vals[:n].unsqueeze(0), ids[:n].unsqueeze(0)


def row_moments_in(lib: ctypes.CDLL, x: torch.Tensor, sigma: bool, threads: int,
                    exps: bool = True) -> tuple[float, ...] | None:
    out = (ctypes.c_double * 7)()
    if lib.lmhead_row_moments(x.data_ptr(), x.shape[0], int(exps) | 2 * int(sigma), ctypes.addressof(out), threads):
        return None
    return tuple(out)


def typical_row_in(lib: ctypes.CDLL, x: torch.Tensor, mass: float, threads: int) -> torch.Tensor | None:
    out = torch.empty_like(x)
    return out if lib.lmhead_typical_row(x.data_ptr(), x.shape[0], float(mass), out.data_ptr(), threads) >= 0 else None

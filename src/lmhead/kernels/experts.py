"""The binding of experts_kernel.c: one call for a mixture-of-experts MLP over the chosen experts of a layer.

    x [N,D] float32, chosen [N,k] int64, weights [N,k] float32, the layer's gate_up and down experts
    (`ExpertsMat`: each product's buffers, expert e at e strides from their bases), their biases (gpt-oss)
      ──lmhead_experts_mlp──▶ out [N,D] = Σ over each row's experts in ascending order of
                                w · (down_e(act(gate_up_e x + b_e)) + c_e)

The numbers are those of one coded-kernel call per chosen expert and product (models/moe.py's per-expert path),
bit for bit; the call only saves the Python round trips and torch work between them. `mlp` is None where the
library is not built or is older than this binding (its own ABI number and struct size are checked here).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from lmhead.kernels import native
from lmhead.kernels.abi import ACT_SWIGLU_OAI, NO_MEMORY

__all__ = ["SWIGLU_OAI", "ExpertsMat", "available", "mlp"]

SWIGLU_OAI = ACT_SWIGLU_OAI  # gpt-oss's clamped SwiGLU (body_kernels.c's lmhead_swiglu_oai)

_ABI = 2  # lmhead_experts_abi() of experts_kernel.c


class ExpertsMat(ctypes.Structure):
    """experts_kernel.c's `lmhead_experts_mat`: one product of a layer's experts."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("codes_stride", ctypes.c_int64), ("scale_stride", ctypes.c_int64),
                ("offset_stride", ctypes.c_int64), ("experts", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("group", ctypes.c_int64), ("flags", ctypes.c_int64)]


def _stride(t: Tensor | None) -> int:
    return 0 if t is None else t.stride(0) * t.element_size()


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe(codes: Tensor, scale: Tensor | None, offset: Tensor | None, k: int, group: int,
             flags: int) -> ExpertsMat:
    """The descriptor of experts `codes` [E, N, ...] with `scale`, `offset` [E, ...] (or None), each expert [N,K]
    (the tensors must outlive it)."""
    return ExpertsMat(codes.data_ptr(), _ptr(scale), _ptr(offset), _stride(codes), _stride(scale), _stride(offset),
                      codes.shape[0], codes.shape[1], k, group, flags)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library()
    if lib is None or not hasattr(lib, "lmhead_experts_abi"):
        return None
    lib.lmhead_experts_abi.restype = ctypes.c_int
    lib.lmhead_experts_mat_size.restype = ctypes.c_size_t
    if lib.lmhead_experts_abi() != _ABI or lib.lmhead_experts_mat_size() != ctypes.sizeof(ExpertsMat):
        return None
    p = ctypes.c_void_p
    lib.lmhead_experts_mlp.argtypes = [p, ctypes.c_int64, ctypes.c_int64, p, p, ctypes.POINTER(ExpertsMat),
                                       ctypes.POINTER(ExpertsMat), ctypes.c_int, ctypes.c_float, ctypes.c_float, p,
                                       p, p, ctypes.c_int]
    lib.lmhead_experts_mlp.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the one-call path is built (and matches this binding)."""
    return _library() is not None


def _bias(name: str, b: Tensor | None, shape: tuple[int, int]) -> Tensor | None:
    if b is None:
        return None
    if b.dtype != torch.float32 or tuple(b.shape) != shape:
        raise ValueError(f"{name} must be float32 {list(shape)}, got {b.dtype} {list(b.shape)}")
    return b.contiguous()


def mlp(x: Tensor, chosen: Tensor, weights: Tensor, gate_up: ExpertsMat, down: ExpertsMat, act: int,
        gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None, alpha: float = 1.702,
        limit: float = 7.0) -> Tensor:
    """x [N,D] float32, `chosen` [N,k] int64 expert ids, `weights` [N,k] float32 → out [N,D]: each
    row's chosen experts' down(act(gate)·up) (act: `lmhead_gated`'s code, 0 tanh-GELU, 1 SiLU; or `SWIGLU_OAI`,
    gpt-oss's clamped SwiGLU with `alpha` and `limit`) times its weight, summed in ascending expert order; with
    `gate_up_bias` [E,2F] and `down_bias` [E,D] each expert's products plus its row. TypeError for other dtypes,
    ValueError for other shapes or arguments the kernel refuses (an id out of range, one repeated in a row);
    RuntimeError where it is not built."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the experts kernel is not built on this machine")
    if x.dtype != torch.float32 or chosen.dtype != torch.int64 or weights.dtype != torch.float32:
        raise TypeError(f"x and weights must be float32 and chosen int64, got {x.dtype}, {weights.dtype}, "
                        f"{chosen.dtype}")
    if x.dim() != 2 or chosen.dim() != 2 or weights.shape != chosen.shape or x.shape != (chosen.shape[0], gate_up.k):
        raise ValueError(f"x must be [N, {gate_up.k}] and chosen, weights [N, k], got {tuple(x.shape)}, "
                         f"{tuple(chosen.shape)}, {tuple(weights.shape)}")
    x = x.contiguous()
    n, k = chosen.shape
    chosen, weights = chosen.contiguous(), weights.contiguous()
    gate_up_bias = _bias("gate_up_bias", gate_up_bias, (gate_up.experts, gate_up.n))
    down_bias = _bias("down_bias", down_bias, (down.experts, down.n))
    out = torch.empty((n, gate_up.k), dtype=torch.float32)
    rc = lib.lmhead_experts_mlp(x.data_ptr(), n, k, chosen.data_ptr(), weights.data_ptr(), ctypes.byref(gate_up),
                                ctypes.byref(down), act, alpha, limit, _ptr(gate_up_bias), _ptr(down_bias),
                                out.data_ptr(), torch.get_num_threads())
    if rc == NO_MEMORY:
        raise MemoryError(f"the experts kernel could not allocate its buffers for x {tuple(x.shape)}")
    if rc != 0:
        raise ValueError(f"the experts kernel refused x {tuple(x.shape)}, chosen {tuple(chosen.shape)} (ids in "
                         f"[0, {gate_up.experts}), distinct in a row) or its experts' shapes")
    return out

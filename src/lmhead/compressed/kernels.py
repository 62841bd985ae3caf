"""The matrix kernels torch ships for CPU that compute the approximate logits, and their self-test.

    int8, "onednn"    `onednn::qlinear_pointwise` (the op torch's x86 quantisation backend emits): uint8
                      activations with one scale and zero point per call, int32 accumulation (exact), fp32
                      output. Used only when `onednn_int8_usable()` passes its self-test.
    int8, "int8pack"  `aten._weight_int8pack_mm`: bf16 activations, fp32 accumulation, bf16 output.
    int4, "int4pack"  `aten._weight_int4pack_mm_for_cpu`: bf16 activations, fp32 accumulation (4-bit groups
                      with a bf16 scale and offset each).

Each `*_linear` function takes the activation as the kernel wants it and returns logits [N,V] without bias;
`onednn_linear` also returns x̂, the activation as the kernel multiplied it (what the error bound needs).
Which kernel a head uses, and the bound of each, live in `head.py` and `bound.py`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

# A kernel's index in this tuple is what a cached state's meta stores: append only.
KERNELS: tuple[str, ...] = ("int8pack", "onednn", "int4pack")


@functools.cache
def onednn_int8_usable() -> bool:
    """True when torch has oneDNN's int8 inner product and it computes exactly what the bound assumes.

    The self-test multiplies rows of +127 and −127 by uint8 activations of 255 (one 254) with zero point
    255: an int16 intermediate would saturate (older CPUs without VNNI) and a float zero-point compensation
    would round (the raw sum exceeds 2²⁴); the exact answers are ∓127.
    """
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        D = 640
        q = torch.full((2, D), 127, dtype=torch.int8)
        q[1] = -127
        x = torch.full((1, D), 255, dtype=torch.uint8)
        x[0, 0] = 254
        packed = torch.ops.onednn.qlinear_prepack(q, None)
        y = torch.ops.onednn.qlinear_pointwise(x, 1.0, 255, packed, torch.ones(2), torch.zeros(2, dtype=torch.int32),
                                               None, 1.0, 0, torch.float32, "none", [], "")
        return y.dtype == torch.float32 and y.tolist() == [[-127.0, 127.0]]
    except Exception:  # no such op, or it refuses these arguments: use int8pack
        return False


def pad_to(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-n // m) * m


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on one thread inside the block (process-wide while it lasts; restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def bf16_activation(h: torch.Tensor, padded_d: int) -> torch.Tensor:
    """h [N,D] fp32 -> a fresh, zero-padded bf16 buffer [N,padded_d]: the int8pack kernel uses aligned loads
    and has no tail loop, and zero columns add no error."""
    hb = torch.zeros(h.shape[0], padded_d, dtype=torch.bfloat16)
    hb[:, : h.shape[1]] = h
    return hb


def int8pack_linear(hb: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 hb [N,Dp] times int8 rows qweight [Vp,Dp] with bf16 row scales [Vp] -> bf16 [N,Vp]."""
    return torch.ops.aten._weight_int8pack_mm(hb, qweight, scales)


def int4pack_linear(hb: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_zeros: torch.Tensor
                    ) -> torch.Tensor:
    """bf16 hb [N,Dp] times the packed 4-bit weight (scale and offset per group: [Dp/G, Vp, 2]) -> [N,Vp]."""
    return torch._weight_int4pack_mm_for_cpu(hb, qweight, group_size, scales_zeros)


def int4pack(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [R,Dp] (int32 in [0,15], R a multiple of 64) in the int4pack kernel's layout."""
    return torch._convert_weight_to_int4pack_for_cpu(q, 1)


class OneDNNWeight:
    """The onednn kernel's prepacked int8 weight [V,D] (its own blocked layout) with fp32 row scales."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        V = scales.shape[0]
        self.packed = torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)
        self.scales = scales.float()
        self.zeros = torch.zeros(V, dtype=torch.int32)


def onednn_linear(hp: torch.Tensor, weight: OneDNNWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [N,V] fp32, x̂ [N,D] float64) for the column-scaled activation hp [N,D] fp32.

    The kernel takes one asymmetric uint8 scale per call, exactly an fp32 number so that the kernel's fp32
    scale and our float64 x̂ = (q − z)·s are the same value.
    """
    lo, hi = min(float(hp.min()), 0.0), max(float(hp.max()), 0.0)
    sx = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32)) or 1.0
    z = min(255, max(0, round(-lo / sx)))
    qx = torch.round(hp / sx).add_(z).clamp_(0, 255).to(torch.uint8)
    y = torch.ops.onednn.qlinear_pointwise(qx, sx, z, weight.packed, weight.scales, weight.zeros, None,
                                           1.0, 0, torch.float32, "none", [], "")
    return y, (qx.double() - z) * sx

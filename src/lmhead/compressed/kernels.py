"""The matrix kernels torch ships for CPU that compute the approximate logits, and their self-test.

    int8, "onednn"    `onednn::qlinear_pointwise` (the op torch's x86 quantisation backend emits): uint8
                      activations with one scale and zero point per call, int32 accumulation (exact), fp32
                      output. Used only when `onednn_int8_usable()` passes its self-test.
    int8, "int8pack"  `aten._weight_int8pack_mm`: bf16 activations, fp32 accumulation, bf16 output.
    int4, "int4pack"  `aten._weight_int4pack_mm_for_cpu`: bf16 activations, fp32 accumulation (4-bit groups
                      with a bf16 scale and offset each).
    int8, "fbgemm"    `quantized::linear_dynamic` (fbgemm, torch's x86 dynamic int8 linear): 7-bit activations
                      (reduce_range: uint8 pairs summed in int16 cannot saturate), int32 accumulation (exact),
                      fp32 output. It quantises its input itself, one scale per call; we hand it an input already
                      on a grid whose ends are present (two sentinel columns against zero weight
                      columns), so its own quantisation reproduces our x̂ exactly. Used when
                      `fbgemm_int8_usable()` passes its self-test.

Each `*_linear` function takes the activation as the kernel wants it and returns logits [N,V] without bias;
`onednn_linear` and `fbgemm_linear` also return x̂, the activation as the kernel multiplied it (what the error
bound needs).
Which kernel a head uses, and the bound of each, live in `head.py` and `bound.py`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator

import torch

# A kernel's index in this tuple is what a cached state's meta stores: append only.
KERNELS: tuple[str, ...] = ("int8pack", "onednn", "int4pack", "fbgemm")


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


FBGEMM_LEVELS = 127  # reduce_range: activations on 0..127
FBGEMM_MIN_STEP = 2.0**-13  # above torch's smallest activation scale (6.1e-5), which it would otherwise widen


class FbgemmWeight:
    """fbgemm's prepacked int8 weight: the rows qweight [V,D] with their row scales, and two zero columns for
    the activation's sentinels (`fbgemm_linear`)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor) -> None:
        V = qweight.shape[0]
        q = torch.cat([qweight.contiguous(), torch.zeros(V, 2, dtype=torch.int8)], dim=1)
        with warnings.catch_warnings():  # quantized tensors are deprecated; the kernel is what we use
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scales.double(), torch.zeros(V, dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.nbytes = q.numel() + 8 * V  # int8 rows + fp32 scales and column offsets
        self.out_features = V


def fbgemm_grid(hp: torch.Tensor) -> tuple[torch.Tensor, float, int]:
    """(x̂ [N,D] fp32, step s, zero z): rows hp [N,D] on the 7-bit grid (q − z)·s, q in 0..127, one grid for
    all rows. s is the smallest number of 8 significant bits covering the range, so each (q − z)·s (15 bits)
    and 127·s are exact fp32 numbers, and x̂/s or x̂·(1/s) is within 2⁻¹⁷ of the integer q − z."""
    lo, hi = min(float(hp.min()), 0.0), max(float(hp.max()), 0.0)
    r = (hi - lo) / FBGEMM_LEVELS
    if r > 0:
        e = math.frexp(r)[1] - 8  # r = m·2^e with m in [128, 256)
        s = max(math.ceil(r / 2.0**e) * 2.0**e, FBGEMM_MIN_STEP)
    else:
        s = 1.0
    z = min(FBGEMM_LEVELS, max(0, round(-lo / s)))
    q = torch.round(hp / s).add_(z).clamp_(0, FBGEMM_LEVELS)
    return q.sub_(z).mul_(s), s, z


def fbgemm_linear(hp: torch.Tensor, weight: FbgemmWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [N,V] fp32, x̂ [N,D] float64, magnitude [N,V] fp32) for the column-scaled activation hp [N,D].

    Two parts on one grid, in one call: x̂₁ = grid(hp), and the residual r = hp − x̂₁ (|r| ≤ s/2) magnified
    by the largest power of two f that keeps f·r inside the grid's range, x̂₂ = grid(f·r). Rows [x̂₁; x̂₂]
    go through the kernel together (it reads the weight once) and y = y₁ + y₂/f: the kernel has multiplied
    x̂ = x̂₁ + x̂₂/f, whose error δ = hp − x̂ is about f times smaller than one 7-bit grid's. fbgemm picks its
    activation scale from its input's min and max: the sentinel columns −z·s and (127 − z)·s make that
    range exactly the grid's, so its scale is s, its zero point z, and quantising gives back each q.
    `magnitude` = |y₁| + |y₂|/f: the output rounding is relative to it (8u each part, u for the sum).
    """
    if not bool(torch.isfinite(hp).all()):
        # no grid covers it and no bound holds: non-finite logits send the call to the full head
        y = hp.new_full((hp.shape[0], weight.out_features), math.nan)
        return y, hp.double(), y
    x1, s, z = fbgemm_grid(hp)
    r = hp - x1  # exact: both on fp32 numbers within a factor of two of each other or r = 0
    room_up, room_down = (FBGEMM_LEVELS - z) * s, z * s
    top, bottom = float(r.max()), float(-r.min())
    limit = min(room_up / top if top > 0 else math.inf, room_down / bottom if bottom > 0 else math.inf)
    f = 2.0 ** math.floor(math.log2(limit)) if math.isfinite(limit) and limit >= 2 else 1.0
    n = x1.shape[0]
    rows = [x1]
    if f > 1:
        q2 = torch.round(r * f / s).add_(z).clamp_(0, FBGEMM_LEVELS)  # inside the range: the clamp never acts
        rows.append(q2.sub_(z).mul_(s))
    x = torch.cat(rows, dim=0)
    ends = torch.tensor([[-z * s, (FBGEMM_LEVELS - z) * s]], dtype=torch.float32).expand(x.shape[0], 2)
    y = torch.ops.quantized.linear_dynamic(torch.cat([x, ends], dim=1), weight.packed, True)
    if f == 1:
        return y, x1.double(), y.abs()
    y1, y2 = y[:n], y[n:].div_(f)  # ÷ a power of two: exact
    xhat = x1.double() + rows[1].double() / f
    return y1 + y2, xhat, y1.abs().add_(y2.abs())


@functools.cache
def fbgemm_int8_usable() -> bool:
    """True when torch has fbgemm's dynamic int8 linear and it computes exactly what the bound assumes: the
    activation as `fbgemm_grid` puts it (its own quantisation must give back the same grid) and an exact int32
    sum (rows of ±127 against activations at the top of the grid: an int16 intermediate would saturate)."""
    try:
        if not ({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines)):
            return False
        g = torch.Generator().manual_seed(0)
        D = 640
        q = torch.randint(-127, 128, (64, D), generator=g, dtype=torch.int8)
        q[0], q[1] = 127, -127
        scales = torch.rand(64, generator=g).add_(0.5).to(torch.bfloat16)
        weight = FbgemmWeight(q, scales)
        # the second input puts every q at 127, where the int16 pair sums peak
        for hp in (torch.randn(3, D, generator=g) * 3, torch.full((1, D), 127 / 16)):
            y, xhat, _ = fbgemm_linear(hp, weight)
            exact = xhat @ (q.double() * scales.double()[:, None]).T
            if not torch.allclose(y.double(), exact, rtol=2e-6, atol=1e-30):
                return False
        return True
    except Exception:  # no such op, or it refuses these arguments
        return False

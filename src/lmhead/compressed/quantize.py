"""The compressed copy of the weight: column scales, int8 / int4 quantisation, the row norms of its error,
and the format of the state a cache stores.

    weight W [V,D] ──× diag(c) (column_scales; 1 without calibration)──▶ W' ──quantise per row / group──▶ q, scales
                   └─ RowNorms of W, of W' − ŵ' and of ŵ' (bound.py) ─────────────────────────────────────▶ norms

int8: one symmetric absmax scale per row (bf16, as the kernels take it). int4: groups of G columns with a
bf16 scale and offset each (min/max). The stored values are whatever we choose; what must be exact are the
error norms, measured against ŵ' computed as the kernel dequantises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmhead.compressed import kernels
from lmhead.compressed.bound import NORM_INFLATION, RowNorms, row_norm_table

SMOOTHING_ALPHA = 0.4  # column-scale exponent: c ∝ max|h|^α / max|W|^(1−α) (bench_head.py --alphas compares)
# Stored in a cached state's meta: a state written by other compression code (another kernel choice, other
# scales) is compressed again instead of reused. Bump it when `quantize` or the kernel choice changes.
STATE_VERSION = 3
_CHUNK = 16384  # rows per step (a multiple of 64, the int4 packing block): fast, and small temporaries


def column_scales(calibration: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """Per input dimension, a power of two c_j ≈ max|h_j|^α / max_i|W_ij|^(1−α) (SmoothQuant's balance):
    calibration [N,D] hidden states, weight [V,D] -> c [D] fp32. Dividing h by c flattens its outlier
    dimensions (one uint8 scale per call then resolves the rest); multiplying W's columns by c moves them into
    the weight, whose scales are per row. Powers of two keep both products exact."""
    a = calibration.float().abs().amax(0).clamp(min=1e-6)
    m = weight.detach().float().abs().amax(0).clamp(min=1e-6)
    e = torch.round(alpha * torch.log2(a) - (1 - alpha) * torch.log2(m)).clamp(-30, 30)
    return torch.exp2(e)


@dataclass(frozen=True)
class QuantizedWeight:
    """The compressed weight as the kernels read it, and what the bound needs of it.

    qweight: int8 [Vp,Dp] (bits=8) or the int4pack layout of 4-bit values (bits=4), zero-padded.
    scales: bf16 [Vp] row scales (bits=8), or bf16 [Dp/G, Vp, 2] (scale, offset) per group (bits=4).
    column_scale: c [D] fp32 (powers of two; ones unless calibrated for the onednn kernel).
    norms: RowNorms [V,6], inflated to upper bounds.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    column_scale: torch.Tensor
    norms: RowNorms


def _int8_rows(wc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 [R,Dp], scales bf16 [R], ŵ' fp32 [R,Dp]) for column-scaled rows wc [R,Dp]."""
    # Symmetric absmax per row. The kernel multiplies by a bf16 scale, so quantise against the rounded
    # scale; all-zero rows get scale 1 (q = 0).
    s = (wc.abs().amax(1) / 127).to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(wc / s[:, None]).clamp_(-127, 127)
    q8 = q.to(torch.int8)
    dequant = q.mul_(s[:, None])  # exact in fp32: 7-bit q times an 8-bit scale, as in the kernel
    return q8, s.to(torch.bfloat16), dequant


def _int4_rows(wc: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed 4-bit rows, (scale, offset) bf16 [R,Dp/G,2], ŵ' fp32 [R,Dp]) for column-scaled rows wc [R,Dp]."""
    R, Dp = wc.shape
    wg = wc.view(R, Dp // G, G)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s = ((hi - lo) / 15).to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    # kernel: ŵ = fma(q − 8, s, z) in fp32 with bf16 s, z; z puts q = 0 at the group minimum.
    z = (lo + 8 * s).to(torch.bfloat16).float()
    q = torch.round((wg - z[..., None]) / s[..., None] + 8).clamp_(0, 15)
    packed = kernels.int4pack(q.view(R, Dp).to(torch.int32))
    sz = torch.stack([s, z], -1).to(torch.bfloat16)
    dequant = ((q - 8) * s[..., None] + z[..., None]).view(R, Dp)
    return packed, sz, dequant


def quantize(weight: torch.Tensor, bits: int, group_size: int | None, column_scale: torch.Tensor,
             padded_d: int, padded_v: int) -> QuantizedWeight:
    """Compress weight [V,D] to `bits` (8: per row; 4: groups of `group_size`) after scaling its columns by
    column_scale [D], zero-padded to [padded_v, padded_d] for the kernels (zero rows/columns add no error)."""
    V, D = weight.shape
    colp = torch.ones(padded_d)
    colp[:D] = column_scale
    qs, ss = [], []  # per chunk: packing is local to blocks of 64 rows, so chunk by chunk equals the whole
    table = torch.empty(padded_v, 6, dtype=torch.float32)
    for a in range(0, padded_v, _CHUNK):
        w0 = torch.zeros(min(_CHUNK, padded_v - a), padded_d, dtype=torch.float32)
        rows = weight[a:min(a + _CHUNK, V)]
        w0[: rows.shape[0], :D] = rows
        wc = w0 * colp  # the quantised matrix W' = W·diag(c): exact (c is a power of two)
        q, s, dequant = _int8_rows(wc) if bits == 8 else _int4_rows(wc, group_size)
        qs.append(q)
        ss.append(s)
        table[a:a + _CHUNK] = row_norm_table(w0, wc, dequant)  # the reference's term: the unscaled W
    scales = torch.cat(ss)
    if bits == 4:
        scales = scales.transpose(0, 1).contiguous()  # kernel layout: [D/G, V, 2] (scale, offset)
    norms = RowNorms((table[:V] * NORM_INFLATION).contiguous())
    return QuantizedWeight(torch.cat(qs), scales, column_scale, norms)


# ---- the cached state ------------------------------------------------------------------------------------


def state_meta(vocab_size: int, d_model: int, bits: int, group_size: int | None, kernel: str) -> torch.Tensor:
    """[V, D, bits, group (0 for int8), kernel index, STATE_VERSION] long: what a cached state must match."""
    return torch.tensor([vocab_size, d_model, bits, group_size or 0, kernels.KERNELS.index(kernel), STATE_VERSION],
                        dtype=torch.long)


def state_kernel(state: dict[str, torch.Tensor]) -> str | None:
    """The kernel a cached state was built for (None for a state of an older layout)."""
    meta = state["meta"]
    return kernels.KERNELS[int(meta[4])] if len(meta) == 6 else None


def to_state(qw: QuantizedWeight, meta: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a cache stores (safetensors names; `consts` holds the RowNorms table)."""
    return {"qweight": qw.qweight, "scales": qw.scales, "consts": qw.norms.table, "meta": meta,
            "column_scale": qw.column_scale}


def from_state(state: dict[str, torch.Tensor], meta: torch.Tensor, weight: torch.Tensor) -> QuantizedWeight:
    """The QuantizedWeight of a cached state; ValueError when it was built for another head or weight."""
    got = [int(x) for x in state["meta"]]
    if got != meta.tolist():
        raise ValueError(f"compressed state is for [V, D, bits, group, kernel, version] = {got}, not this head's")
    norms = RowNorms(state["consts"].float().contiguous())
    # A cheap guard against a state from other weights: every sampled row's ‖w‖∞ must match this weight's.
    rows = torch.linspace(0, weight.shape[0] - 1, 257).long()
    w_inf = weight.detach()[rows].float().abs().amax(1)
    if not torch.allclose(norms.weight_inf[rows], w_inf * NORM_INFLATION, rtol=1e-6, atol=0):
        raise ValueError("compressed state does not match this weight")
    return QuantizedWeight(state["qweight"], state["scales"], state["column_scale"].float(), norms)

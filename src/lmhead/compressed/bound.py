"""The error bound of the compressed head's approximate logits: pure functions of norms and a few constants.

Notation. u = 2⁻²⁴ (fp32 unit roundoff), γ_n = n·u/(1 − n·u). W [V,D] is the full-precision weight, h [D] a
hidden state, y_i the fp32 head's logit (W h + b)_i, in whatever summation order its BLAS uses. The kernel
multiplies a quantised, column-scaled copy: with column scales c (powers of two; 1 unless the onednn or
fbgemm kernel was calibrated), w'_i = w_i·c and h' = h / c, so w_i·h = w'_i·h' exactly. ŵ'_i is the quantised
row as the kernel dequantises it, x̂ the activation as the kernel sees it (bf16(h'), the uint8 grid for onednn,
two 7-bit parts for fbgemm) and δ = h' − x̂. Then, for every row i and γ = γ_{D+2}:

    |y_i − w_i·h|        ≤ γ Σ|w_ij||h_j|            (fp32 reference, any summation order)
    |(w'_i − ŵ'_i)·h'|   ≤ min(E∞_i‖h'‖₁, E2_i‖h'‖₂) (Hölder; E = exact norms of w'_i − ŵ'_i)
    |ŵ'_i·δ|             ≤ min(Ŵ∞_i‖δ‖₁, Ŵ2_i‖δ‖₂)
    |acc_i − ŵ'_i·x̂|     ≤ γ Σ|ŵ'_ij||x̂_j|           (int8pack/int4pack: fp32 FMA accumulation; the int4
                                                     kernel's dequantising FMA adds one more u, inside
                                                     γ_{D+2}; onednn, fbgemm: 0, their int32 sums are
                                                     exact)

and each Σ|a||b| ≤ min(‖a‖∞‖b‖₁, ‖a‖₂‖b‖₂). `static_bound` takes the smaller of the all-ℓ∞/ℓ₁ and the all-ℓ₂
sums; `logit_bound` adds the rounding of the kernel's output (`output_coefficient`: bf16 for int8pack/int4pack,
a few fp32 ulps for onednn and fbgemm) and of the bias additions, and inflates by `SAFETY` for the fp32 arithmetic of
the bound itself. The row norms (`RowNorms`) are measured once at compression time and inflated by
`NORM_INFLATION` so that their fp32 rounding (≤ γ_D relative) leaves upper bounds.

Candidates (`candidate_mask`): a token whose upper bound ŷ_i + b_i is below the k-th largest lower bound
ŷ_j − b_j is provably below at least k tokens, so the true top-k lie among the others.

Near ties (`rounding_gap`): re-scored logits are computed by `F.linear` on the candidate rows; the fp32
head's BLAS call may sum in another order, so two evaluations of one logit differ by at most
ρ_i = 2·γ_{D+1}·Σ_j|w_ij||h_j| (+ the bias additions). Two re-scored values closer than ρ_a + ρ_b could be
ordered differently by the fp32 head.

Probabilities (`probability_bound`). Non-candidate logits are approximate with |ŷ_i − y_i| ≤ ε (ε = the
largest bound among them). The log-normaliser lse = log Σ exp(y) is 1-Lipschitz in the max-norm and only
the tail entries are perturbed, so |lse' − lse| ≤ Δ = log(1 + P_tail·(e^ε − 1)) ≤ ε, with P_tail the
probability mass of the non-candidates. A candidate's probability moves by at most p·(e^Δ − 1), a tail
token's by at most p·(e^{ε+Δ} − 1); P and p are bounded above by the approximate probabilities inflated
by e^{ε+Δ}. The softcap c·tanh(z/c) is 1-Lipschitz and monotone, so bounds and order survive it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest)
U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits)
SAFETY = 1.0 + 2.0**-10  # covers the fp32 rounding of the bound arithmetic itself
NORM_INFLATION = 1.0 + 2.0**-10  # fp32-computed row norms (relative error ≤ γ_D < 2⁻¹⁴) -> upper bounds


def gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u): the relative error bound of an fp32 sum of n products."""
    return n * U32 / (1 - n * U32)


# The columns of RowNorms.table, in the order the cached state stores them.
ROW_NORM_FIELDS: tuple[str, ...] = ("err_inf", "dequant_inf", "weight_inf", "err_l2", "dequant_l2", "weight_l2")


@dataclass(frozen=True)
class RowNorms:
    """Per weight row i, the norms the bound needs: of the quantisation error w'_i − ŵ'_i (`err_*`), of the
    dequantised row ŵ'_i (`dequant_*`) and of the unscaled full-precision row w_i (`weight_*`), in ℓ∞ and ℓ₂.

    Held as one table [V,6] (columns `ROW_NORM_FIELDS`) so that each half of the bound is one small matrix
    product: `inf` [V,3] and `l2` [V,3] are its two halves, each (err, dequant, weight).
    """

    table: torch.Tensor

    @property
    def inf(self) -> torch.Tensor:
        return self.table[:, :3]

    @property
    def l2(self) -> torch.Tensor:
        return self.table[:, 3:]

    @property
    def weight_inf(self) -> torch.Tensor:
        """‖w_i‖∞ [V]: also a cheap fingerprint of the weight a cached state was built from."""
        return self.table[:, ROW_NORM_FIELDS.index("weight_inf")]


def row_norm_table(weight: torch.Tensor, scaled: torch.Tensor, dequant: torch.Tensor) -> torch.Tensor:
    """The RowNorms columns [R,6] fp32 for rows of the unscaled weight, W·diag(c) and its dequantised copy ŵ'
    (each [R,D]). Not yet inflated by NORM_INFLATION."""
    err = (scaled - dequant).abs_()
    return torch.stack([err.amax(1), dequant.abs().amax(1), weight.abs().amax(1),
                        err.pow_(2).sum(1).sqrt_(), dequant.pow(2).sum(1).sqrt_(), weight.pow(2).sum(1).sqrt_()], 1)


@dataclass(frozen=True)
class ActivationNorms:
    """Per hidden row [N] (float64): ℓ₁ and ℓ₂ norms of h' = h / c, of δ = h' − x̂, of x̂ and of h."""

    scaled_l1: torch.Tensor
    delta_l1: torch.Tensor
    xhat_l1: torch.Tensor
    hidden_l1: torch.Tensor
    scaled_l2: torch.Tensor
    delta_l2: torch.Tensor
    xhat_l2: torch.Tensor
    hidden_l2: torch.Tensor


def activation_norms(h: torch.Tensor, xhat: torch.Tensor, column_scale: torch.Tensor) -> ActivationNorms:
    """ActivationNorms of rows h [N,D] whose activation the kernel saw as x̂ [N,D] (float64; h / c is exact)."""
    h64 = h.double()
    hp = h64 / column_scale.double()
    d = hp - xhat
    return ActivationNorms(hp.abs().sum(1), d.abs().sum(1), xhat.abs().sum(1), h64.abs().sum(1),
                           hp.norm(dim=1), d.norm(dim=1), xhat.norm(dim=1), h64.norm(dim=1))


def static_bound(act: ActivationNorms, rows: RowNorms, d_model: int) -> torch.Tensor:
    """The part of the bound that does not depend on ŷ (see the module docstring) -> [N,V] fp32."""
    g = gamma(d_model + 2)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)

    # ℓ∞/ℓ₁ pairing: E∞‖h'‖₁ + Ŵ∞(‖δ‖₁ + γ‖x̂‖₁) + W∞·γ‖h‖₁; ℓ₂ pairing likewise. Columns: (err, dequant, weight).
    m1 = torch.stack([f(act.scaled_l1), f(act.delta_l1) + g * f(act.xhat_l1), g * f(act.hidden_l1)], 1)
    m2 = torch.stack([f(act.scaled_l2), f(act.delta_l2) + g * f(act.xhat_l2), g * f(act.hidden_l2)], 1)
    b1 = m1 @ rows.inf.T  # [N,V], contiguous
    b2 = m2 @ rows.l2.T
    return torch.minimum(b1, b2).mul_(SAFETY)


def output_coefficient(kernel: str) -> float:
    """Relative rounding of `kernel`'s output (and the bias additions): |acc − ŷ| ≤ coefficient·|ŷ|."""
    if kernel == "fbgemm":
        # relative to the parts' magnitudes |y₁| + |y₂|/f: 8u for each part's output (as onednn's) and u for
        # their fp32 sum; 10u covers them with room
        return 10 * U32
    if kernel == "onednn":
        # fp32 output: int32 -> fp32 conversion and two scale multiplications (≤ 3u relative), the bias
        # additions; 8u covers them with room.
        return 8 * U32
    # bf16 rounding of the kernel output: u_bf16/(1 − u_bf16)·|ŷ|; plus a few fp32 ulps for adding the bias
    # and for the reference's own bias addition.
    return U_BF16 / (1 - U_BF16) + 4 * U32


def logit_bound(act: ActivationNorms, rows: RowNorms, d_model: int, y_raw: torch.Tensor, kernel: str,
                bias: torch.Tensor | None) -> torch.Tensor:
    """Per-logit bound [N,V]: |ŷ_i + b_i − y_i| ≤ bound_i for the kernel output ŷ [N,V] (pre-bias), whose
    rounding is relative to y_raw [N,V] (ŷ itself, or for fbgemm the magnitude of its two parts)."""
    b = static_bound(act, rows, d_model)
    b.add_(y_raw.abs().mul_(output_coefficient(kernel)))
    if bias is not None:
        b.add_(bias.detach().float().abs() * (4 * U32))
    return b.mul_(SAFETY)


def candidate_mask(y: torch.Tensor, bound: torch.Tensor, k: int) -> torch.Tensor:
    """[N,V] bool: the tokens whose upper bound reaches the k-th largest lower bound of their row."""
    lower_k = torch.topk(y - bound, k, dim=1).values[:, -1:]
    return (y + bound).ge_(lower_k)


def rounding_gap(h: torch.Tensor, weight_rows: torch.Tensor, bias_rows: torch.Tensor | None) -> torch.Tensor:
    """ρ [N,K]: how far two fp32 evaluations of these logits (any summation order) can differ, for rows h
    [N,D] and weight rows [K,D] (bias rows [K]): 2·γ_{D+1}·Σ_j |w_ij||h_j| + the bias additions."""
    g = gamma(h.shape[1] + 1)
    r = F.linear(h.abs(), weight_rows.abs()) * (2 * g * SAFETY)
    if bias_rows is not None:
        r = r + bias_rows.abs() * (4 * U32)
    return r


def probability_bound(p: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    """max_i |p_i − p_i(fp32)| bound for one row: p [V] the approximate probabilities (float64), exact [V] bool
    (the re-scored entries), bound [V] the logit bounds (only the non-exact entries matter)."""
    tail_ = ~exact
    eps = float(bound[tail_].max()) if tail_.any() else 0.0
    tail = float(p[tail_].sum()) * math.exp(2 * eps)
    delta = math.log1p(min(tail, 1.0) * math.expm1(eps))
    grow = math.exp(eps + delta)
    pe = float(p[exact].max()) * grow if exact.any() else 0.0
    pt = float(p[tail_].max()) * grow if tail_.any() else 0.0
    return max(min(pe, 1.0) * math.expm1(delta), min(pt, 1.0) * math.expm1(eps + delta))

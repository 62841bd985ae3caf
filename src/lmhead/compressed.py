"""A compressed LM head whose greedy token and top-k are provably those of the full-precision head.

At decode time the head is a matrix-vector product that reads the whole weight `W [V,D]` for one hidden
vector: Gemma 3 270M reads 671 MB of fp32 per generated token. `CompressedHead` keeps a compressed copy of
`W` (int8 with one scale per row, or 4-bit groups with a scale and an offset per group) and computes
approximate logits with a matrix kernel torch ships for CPU. int8 has two (`kernel=`):
  "onednn"    oneDNN's int8 inner product (`onednn::qlinear_pointwise`, the op torch's x86 quantisation
              backend emits): uint8 activations (one scale and zero point per call), int32 accumulation
              (exact), fp32 output: 7.8 vs 11.9 ms for Gemma's head with int8pack (quiet machine). The
              per-call activation scale would be set by the few outlier dimensions that real hidden states
              have, so the head first rescales the columns: W' = W·diag(c), h' = h / c with c a power of two
              per dimension (exact in fp32), chosen SmoothQuant-style from calibration hidden states
              (c ∝ max|h|^0.4 / max|W|^0.6). Used for one row per call (decoding); several rows would
              share one activation scale, so they go to int8pack on the same int8 weights. Chosen by
              `kernel=None` when the bound stays tight on the calibration rows and the op passes a
              self-test of exact int32 accumulation (no int16 saturation, exact zero-point compensation).
  "int8pack"  `aten._weight_int8pack_mm`: bf16 activations, fp32 accumulation, bf16 output.
int4 uses `aten._weight_int4pack_mm_for_cpu` (bf16 activations, fp32 accumulation).
Then, per row of hidden states, in this order:

1. approximate logits `ŷ = kernel(x̂)` [N,V] (+ bias, in fp32), x̂ the activation as the kernel sees it;
2. a rigorous per-logit error bound `|ŷ_i − y_i| ≤ b_i`, where `y_i` is what the fp32 head computes
   (see `_static_bound` for the derivation): the weight error (exact per-row norms of `w_i − ŵ_i`, measured
   at compression time) times `‖h‖`, the activation's rounding `h − x̂` (bf16, or uint8), the fp32
   accumulation error of both the kernel and the fp32 reference, and the rounding of the kernel's output;
3. candidates: every token whose upper bound `ŷ_i + b_i` reaches the k-th largest lower bound `ŷ_j − b_j`.
   Every other token is provably below at least k tokens, so the true top-k are among the candidates;
4. re-score the candidates with the full-precision rows (`F.linear(h, W[candidates])`) and write them in;
5. near-tie guard: the fp32 head's BLAS call may sum in another order (values differ by ~1e-6), so if the
   top two re-scored values are closer than the worst-case rounding of both evaluations
   (2·γ_{D+1}·Σ|w||h|), the full fp32 head serves the call (`stats["tie_fallback_rows"]`);
6. softcap (monotone, so the order is kept) last.

The returned logits therefore hold the fp32 values (to fp32 rounding) of every candidate, and every
non-candidate's approximate value lies strictly below the k-th of them: `argmax` is the fp32 head's in
every case, and `topk(≤ k)` and any cut that keeps the top tokens (top-k sampling with k ≤ exact_k) give
the fp32 head's tokens unless two of them are closer than fp32 rounding (`topk_exact(strict=True)` rules
that out too). If a row has more than `max_rescore` candidates, or the call more than `max_rows` rows, the
full fp32 head serves it (`stats["fallback_rows"]`, `stats["full_rows"]`). Penalties and negative logit
biases only lower logits, so greedy decoding with them stays exact unless all exact_k top tokens are pushed
below the approximate tail; a positive logit_bias on a tail token sees its approximate value.
This head is for inference: `forward` computes no gradients through the compressed path (`loss` uses the
full weight).

Probabilities. Non-candidate logits are approximate with `|ŷ_i − y_i| ≤ ε` (ε = the largest bound among
them). The log-normaliser `lse = log Σ exp(y)` is 1-Lipschitz in the max-norm and only the tail entries
are perturbed, so `|lse' − lse| ≤ log(1 + P_tail·(e^ε − 1)) ≤ ε`, with `P_tail` the probability mass of the
non-candidates. Hence a candidate's probability is within a factor `e^{±ε}` (in practice `1 ± P_tail·ε`) of
the fp32 value and a tail token's within `e^{±2ε}`; `probability_error_bound` returns the absolute bound.

Why this is a module apart from `head.py`: `LMHead` has one job — the plain projection (tying, bias,
softcap, `logits_to_keep`) that is the ground truth. This head has a different storage (quantised copies,
packed for the kernels, next to the full-precision weight it shares) and its own exactness machinery
(bounds, candidate selection, re-scoring, fallback statistics); mixing the two would make the reference
harder to read and to trust.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CompressedHead", "DEFAULT_HEAD_MODE", "HEAD_MODES", "column_scales", "onednn_int8_usable",
           "resolve_head_mode", "use_head"]

# Names accepted by `load_model(..., head=...)`, `use_head` and `CompressedHead.from_mode`.
#   "fp32"        the plain full-precision LMHead (reads 4 bytes per weight)
#   "exact-int8"  int8 per-row weights + exact re-scoring of the candidates (fastest exact for big heads;
#                 "auto", the default of `use_head`, picks it or "fp32" by size: see `resolve_head_mode`)
#   "int8"/"int4" the approximate logits alone (no re-scoring: not exact; int4 = 4-bit groups of 32)
# No "exact-int4": its rigorous bound is ~6x int8's, so on Gemma and SmolLM2 hidden states the candidates
# exceed any useful re-scoring budget and every step falls back to the fp32 head (measured by
# benchmarks/bench_head.py). `CompressedHead(bits=4)` still gives exact answers, just not fast ones.
HEAD_MODES: tuple[str, ...] = ("fp32", "exact-int8", "int8", "int4")

_U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest)
_U_BF16 = 2.0**-8  # unit roundoff of bf16 (8 significant bits)
_SAFETY = 1.0 + 2.0**-10  # covers the fp32 rounding of the bound arithmetic itself


_KERNELS = ("int8pack", "onednn", "int4pack")  # index stored in a cached state's meta
# Stored in a cached state's meta: a state written by other compression code (another kernel choice, other
# scales) is compressed again instead of reused. Bump it when `_compress` or the kernel choice changes.
_STATE_VERSION = 2
SMOOTHING_ALPHA = 0.4  # column-scale exponent: c ∝ max|h|^α / max|W|^(1−α) (bench_head.py --alphas: best on Gemma)


def column_scales(calibration: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """Per input dimension, a power of two c_j ≈ max|h_j|^α / max_i|W_ij|^(1−α) (SmoothQuant's balance):
    calibration [N,D] hidden states, weight [V,D] -> c [D] fp32. Dividing h by c flattens its outlier
    dimensions (one uint8 scale per call then resolves the rest); multiplying W's columns by c moves them into
    the weight, whose scales are per row. Powers of two keep both products exact."""
    a = calibration.float().abs().amax(0).clamp(min=1e-6)
    m = weight.detach().float().abs().amax(0).clamp(min=1e-6)
    e = torch.round(alpha * torch.log2(a) - (1 - alpha) * torch.log2(m)).clamp(-30, 30)
    return torch.exp2(e)


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


def _pad_to(n: int, m: int) -> int:
    return -(-n // m) * m


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch ops on one thread inside the block (process-wide while it lasts; restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class CompressedHead(nn.Module):
    """LM head with a compressed weight and exact greedy / top-k (see the module docstring).

    Args:
        weight: the full-precision head weight [V,D] (kept by reference, not copied: for a tied head it is the
            input embedding the model holds anyway). Re-scoring reads only the candidate rows of it.
        bias: optional [V]. softcap: optional float c, logits = c·tanh(z/c).
        bits: 8 (int8, one symmetric absmax scale per row) or 4 (4-bit groups, min/max scale and offset).
        group_size: for bits=4, one of 32, 64, 128, 256 (default 32). Must be None for bits=8.
        exact_k: how many top tokens `forward` makes exact (0 = approximate logits only).
        max_rescore: a row with more candidates than this falls back to the full head (default V // 8:
            re-scoring 32,768 of Gemma's rows costs ~17 ms, the full fp32 head ~54 ms).
        max_rows: calls with more rows than this (prefill over many positions, the logit lens) use the
            full-precision head, which is as fast there: the int kernels win only while the product is memory
            bound (measured: at 64 rows int8 is no faster than fp32), and the per-row selection costs grow.
        kernel: for bits=8, "onednn" or "int8pack" (see the module docstring). None: with `calibration` and
            a usable oneDNN, "onednn" if on the calibration rows it re-scores a median of at most
            max_rescore/4 tokens and at most 2% of them fall back (Gemma 3: yes; SmolLM2, whose hidden
            states have larger outliers: no), else "int8pack"; without calibration "int8pack". bits=4
            always uses int4pack.
        calibration: hidden states [N,D] like the ones the head will see (e.g. a prompt's), used by the
            onednn kernel to choose its column scales and by kernel=None to choose the kernel; the bounds
            hold for any choice, only their tightness (how many candidates get re-scored) depends on it.
        smoothing_alpha: the exponent of `column_scales` (default 0.4; `bench_head.py --alphas` compares).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        softcap: float | None = None,
        bits: int = 8,
        group_size: int | None = None,
        exact_k: int = 64,
        max_rescore: int | None = None,
        max_rows: int = 8,
        kernel: str | None = None,
        calibration: torch.Tensor | None = None,
        smoothing_alpha: float = SMOOTHING_ALPHA,
        _state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"weight must be a 2-D tensor [V, D], got {type(weight).__name__}"
                            f"{'' if not isinstance(weight, torch.Tensor) else f' of shape {tuple(weight.shape)}'}")
        if not weight.is_floating_point():
            raise TypeError(f"weight must be floating point, got {weight.dtype}")
        V, D = weight.shape
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, got {bits!r}")
        if bits == 8 and group_size is not None:
            raise ValueError("group_size applies to bits=4 only; int8 uses one scale per row (group_size=None)")
        if bits == 4:
            group_size = 32 if group_size is None else group_size
            if group_size not in (32, 64, 128, 256):
                raise ValueError(f"group_size must be one of 32, 64, 128, 256 for bits=4, got {group_size!r}")
        trial = False
        if kernel is None and _state is not None and len(_state["meta"]) == 6:
            kernel = _KERNELS[int(_state["meta"][4])]  # a cached head: the kernel it was built for
        elif kernel is None:
            trial = bits == 8 and calibration is not None and onednn_int8_usable()
            kernel = "onednn" if trial else ("int8pack" if bits == 8 else "int4pack")
        allowed = ("onednn", "int8pack") if bits == 8 else ("int4pack",)
        if kernel not in allowed:
            raise ValueError(f"kernel must be one of {', '.join(allowed)} for bits={bits}, got {kernel!r}")
        if kernel == "onednn" and not onednn_int8_usable():
            raise ValueError("kernel='onednn': this torch build has no usable oneDNN int8 inner product; "
                             "use kernel='int8pack'")
        if calibration is not None and (not isinstance(calibration, torch.Tensor) or calibration.dim() != 2
                                        or calibration.shape[1] != D):
            raise ValueError(f"calibration must be hidden states [N, D={D}], got "
                             f"{tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else calibration!r}")
        if isinstance(smoothing_alpha, bool) or not isinstance(smoothing_alpha, (int, float)) \
                or not 0.0 <= smoothing_alpha <= 1.0:
            raise ValueError(f"smoothing_alpha must be a number in [0, 1], got {smoothing_alpha!r}")
        self.smoothing_alpha = float(smoothing_alpha)
        if bias is not None and tuple(bias.shape) != (V,):
            raise ValueError(f"bias must have shape [V]=({V},), got {tuple(bias.shape)}")
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
        if not isinstance(exact_k, int) or exact_k < 0:
            raise ValueError(f"exact_k must be an int >= 0, got {exact_k!r}")
        if max_rescore is None:
            max_rescore = max(1024, V // 8)
        if not isinstance(max_rescore, int) or max_rescore < 1:
            raise ValueError(f"max_rescore must be an int >= 1, got {max_rescore!r}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")

        self.weight = weight  # shared, full precision: the ground truth and the re-scoring rows
        self.bias = bias
        self.softcap = None if softcap is None else float(softcap)
        self.bits = bits
        self.kernel = kernel
        self.group_size = group_size
        self.exact_k = exact_k
        self.max_rescore = max_rescore
        self.max_rows = max_rows
        self.vocab_size, self.d_model = V, D
        # The kernels need D a multiple of 16 (int8, no tail loop) / of the group (int4) and N a multiple
        # of 16 (int4 packing): pad with zero columns / rows, which add no error.
        self._Dp = _pad_to(D, max(64, group_size or 0))
        self._Vp = _pad_to(V, 64)
        self.stats: dict[str, int] = {}
        self.reset_stats()
        if _state is not None:
            self._load_state(_state)
        else:
            with torch.no_grad():
                self._compress(weight.detach(), calibration)
                if trial and not self._kernel_pays_off(calibration):
                    self.kernel = "int8pack"
                    self._compress(weight.detach(), None)

    # ---- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_head(cls, head: Any, bits: int = 8, group_size: int | None = None, **kw: Any) -> CompressedHead:
        """Compress an existing head (anything with `.weight` [V,D], optional `.bias`, `.softcap`)."""
        weight = getattr(head, "weight", None)
        if weight is None:
            raise TypeError(f"head must have a .weight tensor [V, D], got {type(head).__name__}")
        return cls(weight, bias=getattr(head, "bias", None), softcap=getattr(head, "softcap", None),
                   bits=bits, group_size=group_size, **kw)

    @classmethod
    def from_mode(cls, head: Any, mode: str, **kw: Any) -> Any:
        """The head for a `HEAD_MODES` name: "fp32" returns `head` itself, the others a CompressedHead."""
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode must be one of {', '.join(HEAD_MODES)}; got {mode!r}")
        if mode == "fp32":
            return head
        bits = 8 if mode.endswith("int8") else 4
        if not mode.startswith("exact-"):
            kw.setdefault("exact_k", 0)
        return cls.from_head(head, bits=bits, **kw)

    def _compress(self, w: torch.Tensor, calibration: torch.Tensor | None) -> None:
        V, D, Dp, Vp = self.vocab_size, self.d_model, self._Dp, self._Vp
        col = torch.ones(D)
        if self.kernel == "onednn" and calibration is not None:
            col = column_scales(calibration.detach(), w, self.smoothing_alpha)
        colp = torch.ones(Dp)
        colp[:D] = col
        # fp32 arithmetic in chunks of rows (a multiple of 64, the int4 packing block): fast, and small
        # temporaries. The quantised values are whatever we store; what must be exact are the error norms,
        # and their fp32 rounding (≤ γ_D relative, < 1e-4) is covered by inflating them by 2⁻¹⁰ below.
        chunk = 16384
        G = self.group_size
        if self.bits == 8:
            q8 = torch.empty(Vp, Dp, dtype=torch.int8)
            scales = torch.empty(Vp, dtype=torch.bfloat16)
        else:
            packed = []
            sz = torch.empty(Vp, Dp // G, 2, dtype=torch.bfloat16)
        consts = torch.empty(Vp, 6, dtype=torch.float32)  # E∞, Ŵ∞, W∞ | E2, Ŵ2, W2 per row
        for a in range(0, Vp, chunk):
            w0 = torch.zeros(min(chunk, Vp - a), Dp, dtype=torch.float32)
            rows = w[a:min(a + chunk, V)]
            w0[: rows.shape[0], :D] = rows
            wc = w0 * colp  # the quantised matrix W' = W·diag(c): exact (c is a power of two)
            if self.bits == 8:
                # Symmetric absmax per row. The kernel multiplies by a bf16 scale, so quantise against the
                # rounded scale; all-zero rows get scale 1 (q = 0).
                s = (wc.abs().amax(1) / 127).to(torch.bfloat16).float()
                s = torch.where(s > 0, s, torch.ones_like(s))
                q = torch.round(wc / s[:, None]).clamp_(-127, 127)
                q8[a:a + chunk] = q.to(torch.int8)
                scales[a:a + chunk] = s.to(torch.bfloat16)
                what = q.mul_(s[:, None])  # exact in fp32: 7-bit q times an 8-bit scale, as in the kernel
            else:
                wg = wc.view(wc.shape[0], Dp // G, G)
                lo, hi = wg.amin(-1), wg.amax(-1)
                s = ((hi - lo) / 15).to(torch.bfloat16).float()
                s = torch.where(s > 0, s, torch.ones_like(s))
                # kernel: ŵ = fma(q − 8, s, z) in fp32 with bf16 s, z; z puts q = 0 at the group minimum.
                z = (lo + 8 * s).to(torch.bfloat16).float()
                q = torch.round((wg - z[..., None]) / s[..., None] + 8).clamp_(0, 15)
                packed.append(torch._convert_weight_to_int4pack_for_cpu(
                    q.view(wc.shape[0], Dp).to(torch.int32), 1))
                sz[a:a + chunk, :, 0], sz[a:a + chunk, :, 1] = s.to(torch.bfloat16), z.to(torch.bfloat16)
                what = ((q - 8) * s[..., None] + z[..., None]).view(wc.shape[0], Dp)
            err = (wc - what).abs_()
            consts[a:a + chunk, 0] = err.amax(1)
            consts[a:a + chunk, 3] = err.pow_(2).sum(1).sqrt_()
            consts[a:a + chunk, 1] = what.abs().amax(1)
            consts[a:a + chunk, 4] = what.pow_(2).sum(1).sqrt_()
            consts[a:a + chunk, 2] = w0.abs().amax(1)  # the reference's term: the unscaled W
            consts[a:a + chunk, 5] = w0.pow_(2).sum(1).sqrt_()
        self.register_buffer("column_scale", col, persistent=False)
        if self.bits == 8:
            self.register_buffer("qweight", q8, persistent=False)
            self.register_buffer("scales", scales, persistent=False)
            self._pack()
        else:
            # packing is local to blocks of 64 rows, so packing chunk by chunk equals packing the whole
            self.register_buffer("qweight", torch.cat(packed), persistent=False)
            # kernel layout: [D/G, V, 2] (scale, zero)
            self.register_buffer("scales", sz.transpose(0, 1).contiguous(), persistent=False)
        # Inflate so the fp32-computed norms are upper bounds of the exact ones (errors are ≤ γ_D < 2⁻¹⁴).
        self.register_buffer("_consts", (consts[:V] * (1 + 2.0**-10)).contiguous(), persistent=False)
        self._bias_absmax = 0.0 if self.bias is None else float(self.bias.detach().abs().max())

    def _kernel_pays_off(self, calibration: torch.Tensor) -> bool:
        """Whether this (onednn) head's bound stays tight on the calibration rows, one row per call as in
        decoding: at most 2% of them over max_rescore candidates (Gemma: 0 of 188, the largest 23,149 of
        32,768) and a median of at most max_rescore/4 (Gemma: 2,380; SmolLM2: 11,120 of a budget of 6,144)."""
        k = max(1, min(self.exact_k or 64, self.vocab_size))
        counts = []
        with _one_thread():
            for n in range(calibration.shape[0]):
                h = calibration[n:n + 1].to(torch.float32)
                y_raw, xhat, used = self._approx(h)
                b = self._bounds(h, y_raw, xhat, used)
                y = y_raw + self.bias.detach().float() if self.bias is not None else y_raw
                counts.append(int(self._candidate_mask(y, b, k).sum()))
        if not counts:
            return True
        counts.sort()
        over = sum(c > self.max_rescore for c in counts)
        return over <= 0.02 * len(counts) and counts[len(counts) // 2] <= self.max_rescore / 4

    @staticmethod
    def _candidate_mask(y: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
        """[N,V] bool: the tokens whose upper bound reaches the k-th largest lower bound of their row."""
        lower_k = torch.topk(y - b, k, dim=1).values[:, -1:]
        return (y + b).ge_(lower_k)

    def compressed_state(self) -> dict[str, torch.Tensor]:
        """The compressed tensors (to cache on disk: compressing Gemma's head takes seconds, loading them not)."""
        return {"qweight": self.qweight, "scales": self.scales, "consts": self._consts, "meta": self._meta(),
                "column_scale": self.column_scale}

    def _meta(self) -> torch.Tensor:
        kernel = _KERNELS.index(self.kernel)
        return torch.tensor([self.vocab_size, self.d_model, self.bits, self.group_size or 0, kernel, _STATE_VERSION],
                            dtype=torch.long)

    def _pack(self) -> None:
        """The onednn kernel's prepacked weight [V,D] (its own blocked layout) and fp32 scales."""
        self._packed = None
        if self.kernel == "onednn":
            V, D = self.vocab_size, self.d_model
            self._packed = torch.ops.onednn.qlinear_prepack(self.qweight[:V, :D].contiguous(), None)
            self._scales32 = self.scales[:V].float()
            self._zeros32 = torch.zeros(V, dtype=torch.int32)

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        meta = [int(x) for x in state["meta"]]
        if meta != self._meta().tolist():
            raise ValueError(f"compressed state is for [V, D, bits, group, kernel, version] = {meta}, not this head's")
        consts = state["consts"].float()
        # A cheap guard against a state from other weights: every row's W∞ must match this weight's.
        rows = torch.linspace(0, self.vocab_size - 1, 257).long()
        w_inf = self.weight.detach()[rows].float().abs().amax(1)
        if not torch.allclose(consts[rows, 2], w_inf * (1 + 2.0**-10), rtol=1e-6, atol=0):
            raise ValueError("compressed state does not match this weight")
        self.register_buffer("qweight", state["qweight"], persistent=False)
        self.register_buffer("scales", state["scales"], persistent=False)
        self.register_buffer("_consts", consts.contiguous(), persistent=False)
        self.register_buffer("column_scale", state["column_scale"].float(), persistent=False)
        self._bias_absmax = 0.0 if self.bias is None else float(self.bias.detach().abs().max())
        if self.bits == 8:
            self._pack()

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor, **kw: Any) -> torch.Tensor:
        """Training / perplexity loss: `linear_cross_entropy` on the full-precision weight (exact, never [N,V])."""
        from lmhead.loss import linear_cross_entropy

        return linear_cross_entropy(hidden, self.weight, targets, bias=self.bias, softcap=self.softcap, **kw)

    # ---- memory ----------------------------------------------------------------------------------------

    @property
    def compressed_bytes(self) -> int:
        """Bytes the approximate pass reads per call: the packed weight and its scales."""
        if self.kernel == "onednn":  # the prepacked copy is what the kernel reads: [V,D] int8 + fp32 scales
            return self.vocab_size * self.d_model + self.vocab_size * 4
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2

    @property
    def extra_bytes(self) -> int:
        """Memory this head adds next to the full-precision weight (packed weight, scales, bound constants)."""
        extra = self.compressed_bytes + self._consts.numel() * 4
        if self.kernel == "onednn":  # the plain int8 copy, kept for the on-disk cache
            extra += self.qweight.numel() + self.scales.numel() * 2
        return extra

    def reset_stats(self) -> None:
        """Zero `stats`: calls, rows, candidates (re-scored tokens, summed over rows), max_candidates,
        fallback_rows (rows whose candidates exceeded max_rescore: served by the full head), tie_fallback_rows
        (rows of calls whose top ranks were closer than fp32 rounding: served by the full head), full_rows (rows
        served by the full head because the call had more than max_rows rows)."""
        self.stats = {"calls": 0, "rows": 0, "candidates": 0, "max_candidates": 0, "fallback_rows": 0,
                      "tie_fallback_rows": 0, "full_rows": 0}

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.bits == 4 else ""
        return (f"vocab_size={self.vocab_size}, d_model={self.d_model}, bits={self.bits}{g}, kernel={self.kernel}, "
                f"exact_k={self.exact_k}, softcap={self.softcap}, bias={self.bias is not None}")

    # ---- the passes ------------------------------------------------------------------------------------

    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden must be a tensor [..., D], got {type(hidden).__name__}")
        if not hidden.is_floating_point():
            raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
        if hidden.dim() < 1 or hidden.shape[-1] != self.d_model:
            raise ValueError(f"hidden must have last dimension D={self.d_model}, got shape {tuple(hidden.shape)}")
        return hidden.reshape(-1, self.d_model).to(torch.float32)

    def _approx_raw(self, h: torch.Tensor) -> torch.Tensor:
        """Kernel logits without bias: [N,D] fp32 -> [N,V] fp32."""
        return self._approx(h)[0]

    def _approx(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str]:
        """(kernel logits without bias [N,V] fp32, x̂ [N,D] float64: the activation as the kernel multiplied
        it, in the column-scaled space h' = h / c, the kernel that ran).

        The onednn kernel serves one row per call (decoding): its activation scale is per call, so on several
        rows a small row would share a large row's scale. Several rows go to int8pack on the same int8
        weights (bf16 activations: a relative rounding per element).
        """
        if self.kernel == "onednn" and h.shape[0] == 1:
            return (*self._approx_onednn(h), "onednn")
        N = h.shape[0]
        # A fresh, zero-padded bf16 buffer: the int8 kernel uses aligned loads and has no tail loop.
        hb = torch.zeros(N, self._Dp, dtype=torch.bfloat16)
        hb[:, : self.d_model] = h if self.kernel != "onednn" else h / self.column_scale
        if self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(hb, self.qweight, self.scales)
        else:
            y = torch._weight_int4pack_mm_for_cpu(hb, self.qweight, self.group_size, self.scales)
        used = "int8pack" if self.bits == 8 else "int4pack"
        return y[:, : self.vocab_size].float(), hb[:, : self.d_model].double(), used

    def _approx_onednn(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hp = h / self.column_scale  # exact: powers of two
        # One asymmetric uint8 scale for the call (the kernel takes one per call), exactly an fp32 number so
        # that the kernel's fp32 scale and our float64 x̂ are the same value.
        lo, hi = min(float(hp.min()), 0.0), max(float(hp.max()), 0.0)
        sx = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32)) or 1.0
        z = min(255, max(0, round(-lo / sx)))
        qx = torch.round(hp / sx).add_(z).clamp_(0, 255).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(qx, sx, z, self._packed, self._scales32, self._zeros32, None,
                                               1.0, 0, torch.float32, "none", [], "")
        return y, (qx.double() - z) * sx

    def _norm_features(self, h: torch.Tensor, xhat: torch.Tensor) -> torch.Tensor:
        """Per row: [‖h'‖₁, ‖δ‖₁, ‖x̂‖₁, ‖h‖₁ | the same four in ℓ₂] in float64, with h' = h / c (the column-
        scaled hidden state, exact in float64), x̂ the kernel's activation and δ = h' − x̂."""
        h64 = h.double()
        hp = h64 / self.column_scale.double()
        d = hp - xhat
        return torch.stack([hp.abs().sum(1), d.abs().sum(1), xhat.abs().sum(1), h64.abs().sum(1),
                            hp.norm(dim=1), d.norm(dim=1), xhat.norm(dim=1), h64.norm(dim=1)], 1)

    def _static_bound(self, feats: torch.Tensor, consts: torch.Tensor) -> torch.Tensor:
        """The part of the bound that does not depend on ŷ: feats [N,8] (float64), consts [V,6] -> [N,V].

        With column scales c (powers of two; 1 unless the onednn kernel was calibrated), w'_i = w_i·c and
        h' = h / c, so w_i·h = w'_i·h' exactly. For row i, with ŵ'_i the quantised row, x̂ the kernel's
        activation, δ = h' − x̂ and γ = γ_{D+2} = (D+2)u/(1 − (D+2)u), u = 2⁻²⁴:
          |y_i − w_i·h|        ≤ γ Σ|w_ij||h_j|            (fp32 reference, any summation order)
          |(w'_i − ŵ'_i)·h'|   ≤ min(E∞_i‖h'‖₁, E2_i‖h'‖₂) (Hölder; E = exact norms of w'_i − ŵ'_i)
          |ŵ'_i·δ|             ≤ min(Ŵ∞_i‖δ‖₁, Ŵ2_i‖δ‖₂)
          |acc_i − ŵ'_i·x̂|     ≤ γ Σ|ŵ'_ij||x̂_j|           (int8pack/int4: fp32 FMA accumulation; the int4
                                                           kernel's dequantising FMA adds one more u, inside
                                                           γ_{D+2}; onednn: 0, its int32 sum is exact)
        and each Σ|a||b| ≤ min(‖a‖∞‖b‖₁, ‖a‖₂‖b‖₂). We take the smaller of the all-ℓ∞/ℓ₁ and all-ℓ₂ sums.
        """
        D = self.d_model
        g = (D + 2) * _U32 / (1 - (D + 2) * _U32)
        f = feats.to(torch.float32)
        # l1 pairing: E∞·‖h‖₁ + Ŵ∞·‖δ‖₁ + γ(Ŵ∞‖ĥ‖₁ + W∞‖h‖₁); l2 pairing likewise.
        m1 = torch.stack([f[:, 0], f[:, 1] + g * f[:, 2], g * f[:, 3]], 1)  # coefficients of E∞, Ŵ∞, W∞
        m2 = torch.stack([f[:, 4], f[:, 5] + g * f[:, 6], g * f[:, 7]], 1)
        b1 = m1 @ consts[:, :3].T  # [N,V], contiguous
        b2 = m2 @ consts[:, 3:].T
        return torch.minimum(b1, b2).mul_(_SAFETY)

    @staticmethod
    def _out_coef(kernel: str) -> float:
        if kernel == "onednn":
            # fp32 output: int32 -> fp32 conversion and two scale multiplications (≤ 3u relative), the bias
            # additions; 8u covers them with room.
            return 8 * _U32
        # bf16 rounding of the kernel output: |acc − ŷ| ≤ u_bf16/(1 − u_bf16)·|ŷ|; plus a few fp32 ulps for
        # adding the bias and for the reference's own bias addition.
        return _U_BF16 / (1 - _U_BF16) + 4 * _U32

    def error_bound(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate pre-softcap logits and their rigorous error bound, both [N,V] fp32 (N = rows of hidden).

        `|approx_i − (W h + b)_i| ≤ bound_i` where `(W h + b)_i` is the fp32 head's value (its own rounding
        included). The softcap c·tanh(x/c) is 1-Lipschitz, so the same bound holds after it.
        """
        h = self._check_hidden(hidden)
        y_raw, xhat, used = self._approx(h)
        bound = self._bounds(h, y_raw, xhat, used)
        y = y_raw + self.bias.detach().float() if self.bias is not None else y_raw
        return y, bound

    def _exact_rows(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Full-precision pre-softcap logits [N, len(ids)] of the given rows, as the fp32 head computes them."""
        # index_select, not weight[ids]: 4x faster for a few thousand rows of a [262144, 640] weight (measured)
        w = torch.index_select(self.weight.detach(), 0, ids).to(torch.float32)
        b = None if self.bias is None else torch.index_select(self.bias.detach(), 0, ids).to(torch.float32)
        return F.linear(h, w, b)

    def _full(self, h: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.detach().to(torch.float32)
        return F.linear(h, self.weight.detach().to(torch.float32), b)

    def _cap(self, z: torch.Tensor) -> torch.Tensor:
        if self.softcap is None:
            return z
        return torch.tanh(z / self.softcap) * self.softcap

    def _bounds(self, h: torch.Tensor, y_raw: torch.Tensor, xhat: torch.Tensor, kernel: str) -> torch.Tensor:
        """Per-logit error bound [N,V] for the output y_raw [N,V] (pre-bias) of `kernel` on rows h [N,D] whose
        activation it saw as x̂ [N,D]."""
        b = self._static_bound(self._norm_features(h, xhat), self._consts)
        b.add_(y_raw.abs().mul_(self._out_coef(kernel)))
        if self.bias is not None:
            b.add_(self.bias.detach().float().abs() * (4 * _U32))
        return b.mul_(_SAFETY)

    def _rounding(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ρ [N,len(ids)]: how far two fp32 evaluations of these logits (ours and the head's, in any summation
        order) can differ: 2·γ_{D+1}·Σ_j |w_ij||h_j| + the bias additions."""
        D = self.d_model
        g = (D + 1) * _U32 / (1 - (D + 1) * _U32)
        w = torch.index_select(self.weight.detach(), 0, ids).to(torch.float32)
        r = F.linear(h.abs(), w.abs()) * (2 * g * _SAFETY)
        if self.bias is not None:
            r = r + self.bias.detach()[ids].float().abs() * (4 * _U32)
        return r

    def _logits(self, h: torch.Tensor, k: int, check: int) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Pre-softcap logits [N,V] with every top-k candidate re-scored, and the candidate ids per row (None
        when the full head served the call).

        check: how many of the top ranks must be unambiguous (0: none, 1: the argmax, k: the top-k set and
        order). Two re-scored values closer than their rounding ρ could be ordered differently by the fp32
        head's own summation order; then the full head serves the call, so its answer is returned verbatim.
        """
        N = h.shape[0]
        self.stats["calls"] += 1
        self.stats["rows"] += N
        if N > self.max_rows:
            self.stats["full_rows"] += N
            return self._full(h), None
        y_raw, xhat, used = self._approx(h)  # the one big memory-bound pass: torch's thread count
        # The rest is a few dozen small [N,V] passes: on 1 thread they never wait for a busy core.
        with _one_thread():
            out = self._select(h, y_raw, xhat, used, k, check)
        return out if out is not None else (self._full(h), None)

    def _select(self, h: torch.Tensor, y_raw: torch.Tensor, xhat: torch.Tensor, kernel: str, k: int,
                check: int) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Bounds, candidates, re-scoring and the near-tie check for `_logits`; None = use the full head."""
        N, V = h.shape[0], self.vocab_size
        y = y_raw + self.bias.detach().float() if self.bias is not None else y_raw.clone()
        # A bf16 overflow or NaN input: no bound holds, use the full head. One sum is 4x cheaper than
        # isfinite().all() over [N,V]; it is also non-finite when the finite values overflow it (then the
        # full head serves a call that did not need it: safe).
        if not math.isfinite(float(y.sum())):
            self.stats["fallback_rows"] += N
            return None
        if k == 0:
            return y, [y.new_empty(0, dtype=torch.long) for _ in range(N)]
        k = min(k, V)
        b = self._bounds(h, y_raw, xhat, kernel)
        mask = self._candidate_mask(y, b, k)
        counts = mask.sum(1)
        if int(counts.max()) > self.max_rescore:
            self.stats["fallback_rows"] += int((counts > self.max_rescore).sum())
            return None
        cands = [mask[n].nonzero().squeeze(1) for n in range(N)]
        union = torch.unique(torch.cat(cands))
        self.stats["candidates"] += int(counts.sum())
        self.stats["max_candidates"] = max(self.stats["max_candidates"], int(counts.max()))
        # One batched product over the union of the rows' candidates.
        exact = self._exact_rows(h, union)
        y[:, union] = exact
        if check:
            for n, c in enumerate(cands):
                m = min(check + 1, c.numel())
                if m < 2:
                    continue
                v, j = torch.topk(y[n, c], m)
                r = self._rounding(h[n:n + 1], c[j])[0]
                if bool(((v[:-1] - v[1:]) <= (r[:-1] + r[1:])).any()):
                    self.stats["tie_fallback_rows"] += N
                    return None
        return y, cands

    # ---- public API ------------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, logits_to_keep: int = 0, exact_k: int | None = None) -> torch.Tensor:
        """Logits [B,T',V] fp32 from hidden [B,T,D] (or [N,D] -> [N,V]); T' = logits_to_keep (0 = all).

        The top-`exact_k` tokens of every row (default: the head's `exact_k`; the explainer asks for as many as
        it shows) are exact (ids and values, those of the fp32 head); the other entries are approximate within
        `error_bound` and strictly below the exact_k-th value.
        """
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        k = self.exact_k if exact_k is None else exact_k
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.vocab_size:
            raise ValueError(f"exact_k must be an int in [0, {self.vocab_size}], got {exact_k!r}")
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and logits_to_keep:
            hidden = hidden[..., -logits_to_keep:, :]  # as LMHead: project only the positions kept
        h = self._check_hidden(hidden)
        z, _ = self._logits(h, k, check=1 if k else 0)
        return self._cap(z).reshape(*hidden.shape[:-1], self.vocab_size)

    def topk_exact(self, hidden: torch.Tensor, k: int, strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 head's top-k of each row: (values [N,k] fp32 after softcap, ids [N,k] long), best first.

        hidden: [..., D], flattened to N rows. The candidates are re-scored with `F.linear` on their rows; the
        full head's BLAS call may sum in another order, so values agree to fp32 rounding (≈1e-6) and two
        logits closer than that rounding could swap. `strict=True` rules that out: if any adjacent pair among
        the top k+1 is closer than the worst-case rounding of both evaluations (2·γ_D·Σ|w||h|, ~1e-3), the full
        head serves the call (counted in `stats["tie_fallback_rows"]`) and its answer is returned verbatim.
        The top-1 (`argmax_exact`, and `forward`'s argmax) is always checked this way.
        """
        if not isinstance(k, int) or not 1 <= k <= self.vocab_size:
            raise ValueError(f"k must be an int in [1, {self.vocab_size}], got {k!r}")
        h = self._check_hidden(hidden)
        z, cands = self._logits(h, k, check=k if strict else 1)
        if cands is None:
            v, i = torch.topk(z, k, dim=1)
            return self._cap(v), i
        vals, ids = [], []
        for n, c in enumerate(cands):
            v, j = torch.topk(z[n, c], k)
            vals.append(v)
            ids.append(c[j])
        return self._cap(torch.stack(vals)), torch.stack(ids)

    def argmax_exact(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 head's greedy token per row: hidden [..., D] -> ids [N] long."""
        return self.topk_exact(hidden, 1, strict=True)[1][:, 0]

    def logits_exact_for(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Full-precision logits (after softcap) of the given token ids: hidden [..., D], ids [K] -> [N,K]."""
        h = self._check_hidden(hidden)
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"ids must lie in [0, {self.vocab_size - 1}]")
        return self._cap(self._exact_rows(h, ids))

    def probability_error_bound(self, hidden: torch.Tensor) -> torch.Tensor:
        """An upper bound [N] on max_i |p_i − p_i(fp32)| for softmax(forward(hidden)) at temperature 1.

        With ε the largest error bound among the approximate (non-exact) entries and P the tail mass, the
        log-normaliser moves by at most Δ = log(1 + P·(e^ε − 1)); an exact entry's probability moves by at
        most p·(e^Δ − 1), a tail entry's by at most p·(e^{ε+Δ} − 1). P and p are bounded using the approximate
        probabilities inflated by e^{ε+Δ} (upper bounds of the true ones).
        """
        h = self._check_hidden(hidden)
        y, bound = self.error_bound(h)
        z, cands = self._logits(h, self.exact_k, check=0)
        out = []
        for n in range(h.shape[0]):
            exact = torch.zeros(self.vocab_size, dtype=torch.bool)
            if cands is not None:
                exact[cands[n]] = True
            else:
                exact[:] = True
            eps = float(bound[n][~exact].max()) if (~exact).any() else 0.0
            p = torch.softmax(self._cap(z[n]).double(), 0)
            tail = float(p[~exact].sum()) * math.exp(2 * eps)
            delta = math.log1p(min(tail, 1.0) * math.expm1(eps))
            grow = math.exp(eps + delta)
            pe = float(p[exact].max()) * grow if exact.any() else 0.0
            pt = float(p[~exact].max()) * grow if (~exact).any() else 0.0
            out.append(max(min(pe, 1.0) * math.expm1(delta), min(pt, 1.0) * math.expm1(eps + delta)))
        return torch.tensor(out)


DEFAULT_HEAD_MODE = "auto"
# "auto": the fastest exact head for the size. The int8 kernel wins where the fp32 weight is far larger than
# the caches (Gemma 3 270M's 671 MB: 15.6 vs 63.8 ms per step, measured on a quiet machine); for SmolLM2's
# 113 MB head the two are equal (14.2 vs 14.0 ms) and the fp32 head needs no extra memory.
AUTO_MIN_BYTES = 256 * 2**20


def resolve_head_mode(mode: str, weight: torch.Tensor) -> str:
    """`mode`, with "auto" replaced by "exact-int8" for heads of ≥ 256 MiB in fp32 and "fp32" below."""
    if mode == "auto":
        return "exact-int8" if weight.numel() * 4 >= AUTO_MIN_BYTES else "fp32"
    if mode not in HEAD_MODES:
        raise ValueError(f"head must be one of auto, {', '.join(HEAD_MODES)}; got {mode!r}")
    return mode


def use_head(model: Any, mode: str = DEFAULT_HEAD_MODE, cache: bool = True, **kw: Any) -> Any:
    """Give a loaded `Model` the head of `mode` (see `HEAD_MODES`, or "auto": `resolve_head_mode`) in place of
    its fp32 `LMHead`; returns the model.

    The fp32 head stays available as `model.fp32_head`. The compressed tensors are cached next to the
    converted model (`<cache>/heads/<model sha256>-<mode>.safetensors`, keyed by the manifest's checksum of
    the model file) so that a second load does not compress again; models without a manifest (HF folders)
    are compressed in memory.
    """
    base = getattr(model, "fp32_head", None) or model.head
    mode = resolve_head_mode(mode, base.weight)
    model.fp32_head = base
    if mode == "fp32":
        model.head = base
        return model
    path = _state_path(model, mode) if cache else None
    head = None
    if path is not None and path.exists():
        try:
            from safetensors.torch import load_file

            head = _from_mode(base, mode, _state=load_file(str(path)), **kw)
        except Exception:  # unreadable or stale: compress again and overwrite it
            head = None
    if head is None:
        if mode in ("exact-int8", "int8") and "calibration" not in kw:
            kw["calibration"] = _calibration_hidden(model)
        head = _from_mode(base, mode, **kw)
        if path is not None:
            _save_state(head, path)
    model.head = head
    return model


# Text whose final hidden states choose the onednn kernel's column scales: prose, dialogue, code, numbers,
# another language — the outlier dimensions of a model's hidden states show up on all of them.
CALIBRATION_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter. "
    "\"Where are you going?\" she asked. \"To the market,\" he said, \"before the rain comes.\"\n"
    "The capital of France is Paris; the mitochondria is the powerhouse of the cell. In 1969, Apollo 11 "
    "landed on the Moon. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "1, 2, 3, 5, 8, 13, 21 | x = [i ** 2 for i in range(10)] | SELECT name FROM users WHERE id = 42;\n"
    "Le chat est sur la table. Der Hund schläft. El sol brilla. 今日は天気がいいです。"
)


def _calibration_hidden(model: Any) -> torch.Tensor | None:
    """The model's final hidden states [T,D] over CALIBRATION_TEXT (None for objects without a body)."""
    if not hasattr(model, "hidden_states") or not hasattr(model, "encode"):
        return None
    ids = torch.tensor([model.encode(CALIBRATION_TEXT)])
    with torch.inference_mode():
        return model.hidden_states(ids)[0].float().clone()


def _from_mode(base: Any, mode: str, **kw: Any) -> CompressedHead:
    return CompressedHead.from_mode(base, mode, **kw)


def _state_path(model: Any, mode: str):
    import json
    from pathlib import Path

    folder = getattr(model, "path", None)
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        sha = manifest["files"]["model.safetensors"]["sha256"]
    except Exception:
        return None
    root = Path(folder).resolve().parent.parent  # <cache>/models/<name> -> <cache>
    if Path(folder).resolve().parent.name != "models":
        return None  # not a folder of lmhead's model cache: do not write next to the user's files
    return root / "heads" / f"{sha[:32]}-{mode}.safetensors"


def _save_state(head: CompressedHead, path) -> None:
    import os
    import tempfile

    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        save_file(head.compressed_state(), tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only cache only costs the compression time

"""`CompressedHead`: approximate logits from a compressed weight, then the fp32 values of every token that
could be in the top k (see the package docstring for the pipeline, `bound.py` for why it is exact)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmhead import checks
from lmhead.compressed import bound, kernels, quantize
from lmhead.compressed.quantize import SMOOTHING_ALPHA, QuantizedWeight

# Names accepted by `CompressedHead.from_mode` (and `load_model(..., head=...)`, `use_head`):
#   "fp32"        the plain full-precision LMHead (reads 4 bytes per weight)
#   "exact-int8"  int8 per-row weights + exact re-scoring of the candidates (the fastest exact head for big
#                 vocabularies; "auto", in `lmhead.models.heads`, picks it or "fp32" by size)
#   "int8"/"int4" the approximate logits alone (no re-scoring: not exact; int4 = 4-bit groups of 32)
# No "exact-int4": its rigorous bound is ~6x int8's, so on Gemma and SmolLM2 hidden states the candidates
# exceed any useful re-scoring budget and every step falls back to the fp32 head (measured by
# benchmarks/bench_head.py). `CompressedHead(bits=4)` still gives exact answers, just not fast ones.
HEAD_MODES: tuple[str, ...] = ("fp32", "exact-int8", "int8", "int4")


class Approx(NamedTuple):
    """One approximate pass: the kernel's logits y [N,V] fp32 (no bias), the activation x̂ [N,D] float64 it
    multiplied (column-scaled), the kernel that ran, and the magnitude [N,V] its output rounding is relative
    to (y itself, or for fbgemm's two-part product the sum of the parts' magnitudes)."""

    y: torch.Tensor
    xhat: torch.Tensor
    kernel: str
    magnitude: torch.Tensor


def _check_format(bits: Any, group_size: Any) -> int | None:
    """The group size for `bits` (None for int8, 32 by default for int4), or ValueError."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if bits == 8:
        if group_size is not None:
            raise ValueError("group_size applies to bits=4 only; int8 uses one scale per row (group_size=None)")
        return None
    group_size = 32 if group_size is None else group_size
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"group_size must be one of 32, 64, 128, 256 for bits=4, got {group_size!r}")
    return group_size


def _choose_kernel(bits: int, kernel: str | None, calibration: torch.Tensor | None,
                   state: dict[str, torch.Tensor] | None) -> tuple[str, list[str]]:
    """(kernel, fallbacks): the kernel to compress for, and the ones to try in turn if its bound is too loose
    on the calibration rows (kernel=None with calibration: "fbgemm", then "onednn", where their self-tests
    pass, trialled on the calibration rows; "int8pack" always works, and is the choice without calibration)."""
    fallbacks: list[str] = []
    if kernel is None and state is not None and quantize.state_kernel(state) is not None:
        kernel = quantize.state_kernel(state)  # a cached head: the kernel it was built for
    elif kernel is None and bits == 8:
        order = [k for k, usable in (("fbgemm", kernels.fbgemm_int8_usable()),
                                     ("onednn", kernels.onednn_int8_usable())) if usable]
        if calibration is None:
            order = []  # nothing to trial a coarser activation grid on: bf16 activations, the tight bound
        kernel, fallbacks = (order + ["int8pack"])[0], (order + ["int8pack"])[1:]
    elif kernel is None:
        kernel = "int4pack"
    allowed = ("fbgemm", "onednn", "int8pack") if bits == 8 else ("int4pack",)
    if kernel not in allowed:
        raise ValueError(f"kernel must be one of {', '.join(allowed)} for bits={bits}, got {kernel!r}")
    if kernel == "onednn" and not kernels.onednn_int8_usable():
        raise ValueError("kernel='onednn': this torch build has no usable oneDNN int8 inner product; "
                         "use kernel='int8pack'")
    if kernel == "fbgemm" and not kernels.fbgemm_int8_usable():
        raise ValueError("kernel='fbgemm': this torch build has no usable fbgemm dynamic int8 linear; "
                         "use kernel='int8pack'")
    return kernel, fallbacks


def _check_tensors(weight: Any, bias: Any, calibration: Any) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-D tensor [V, D], got {type(weight).__name__}"
                        f"{'' if not isinstance(weight, torch.Tensor) else f' of shape {tuple(weight.shape)}'}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    V, D = weight.shape
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape [V]=({V},), got {tuple(bias.shape)}")
    if calibration is not None and (not isinstance(calibration, torch.Tensor) or calibration.dim() != 2
                                    or calibration.shape[1] != D):
        raise ValueError(f"calibration must be hidden states [N, D={D}], got "
                         f"{tuple(calibration.shape) if isinstance(calibration, torch.Tensor) else calibration!r}")


class CompressedHead(nn.Module):
    """LM head with a compressed weight and exact greedy / top-k (see the package docstring).

    Args:
        weight: the full-precision head weight [V,D] (kept by reference, not copied: for a tied head it is the
            input embedding the model holds anyway). Re-scoring reads only the candidate rows of it.
        bias: optional [V]. softcap: optional finite float c > 0, logits = c·tanh(z/c).
        bits: 8 (int8, one symmetric absmax scale per row) or 4 (4-bit groups, min/max scale and offset).
        group_size: for bits=4, one of 32, 64, 128, 256 (default 32). Must be None for bits=8.
        exact_k: how many top tokens per row `forward` makes exact by default (0 = approximate logits only;
            at most V). Its `exact_k` argument overrides it per call.
        max_rescore: a row with more candidates than this falls back to the full head (default max(1024,
            V // 8), where re-scoring costs about a third of the full fp32 head).
        max_rows: calls with more rows than this (prefill over many positions, the logit lens) use the
            full-precision head, which is as fast there: the int kernels win only while the product is memory
            bound, and the per-row selection costs grow.
        kernel: for bits=8, "fbgemm", "onednn" or "int8pack" (see `kernels.py`). None: the first of fbgemm,
            onednn (each where its self-test passes) that on the calibration rows re-scores a median of at
            most max_rescore/4 tokens with at most 2% of them falling back, else "int8pack"; without
            calibration "int8pack". bits=4 always uses int4pack.
        calibration: hidden states [N,D] like the ones the head will see (e.g. a prompt's), used by the
            fbgemm and onednn kernels to choose their column scales and by kernel=None to choose the kernel; the bounds
            hold for any choice, only their tightness (how many candidates get re-scored) depends on it.
        smoothing_alpha: the exponent of `column_scales` (default 0.4; `bench_head.py --alphas` compares).
        state: a `compressed_state()` of a head built with the same options on this weight (e.g. read back
            from a cache): used instead of compressing again. ValueError if it was built for another head.
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
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        _check_tensors(weight, bias, calibration)
        V, D = weight.shape
        group_size = _check_format(bits, group_size)
        kernel, fallbacks = _choose_kernel(bits, kernel, calibration, state)
        if not checks.is_real(smoothing_alpha) or not 0.0 <= smoothing_alpha <= 1.0:
            raise ValueError(f"smoothing_alpha must be a number in [0, 1], got {smoothing_alpha!r}")
        self.smoothing_alpha = float(smoothing_alpha)
        self.softcap = checks.softcap(softcap)
        self.exact_k = min(checks.non_negative_int("exact_k", exact_k), V)
        self.max_rescore = checks.positive_int("max_rescore", max(1024, V // 8) if max_rescore is None
                                               else max_rescore)
        self.max_rows = checks.positive_int("max_rows", max_rows)
        self.weight = weight  # shared, full precision: the ground truth and the re-scoring rows
        self.bias = bias
        self.bits = bits
        self.kernel = kernel
        self.group_size = group_size
        self.vocab_size, self.d_model = V, D
        # The kernels need D a multiple of 16 (int8, no tail loop) / of the group (int4) and V a multiple
        # of 16 (int4 packing): pad with zero columns / rows, which add no error.
        self._Dp = kernels.pad_to(D, max(64, group_size or 0))
        self._Vp = kernels.pad_to(V, 64)
        self.stats: dict[str, int] = {}
        self.reset_stats()
        if state is not None:
            self._hold(quantize.from_state(state, self._meta(), weight))
            return
        with torch.no_grad():
            self._hold(self._quantize(calibration))
            while fallbacks and calibration is not None and not self._kernel_pays_off(calibration):
                self.kernel = fallbacks.pop(0)
                self._hold(self._quantize(calibration))

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

    def _quantize(self, calibration: torch.Tensor | None) -> QuantizedWeight:
        w = self.weight.detach()
        col = torch.ones(self.d_model)
        if self.kernel in ("onednn", "fbgemm") and calibration is not None:
            col = quantize.column_scales(calibration.detach(), w, self.smoothing_alpha)
        return quantize.quantize(w, self.bits, self.group_size, col, self._Dp, self._Vp)

    def _hold(self, qw: QuantizedWeight) -> None:
        """Keep a QuantizedWeight: buffers for the kernels, the row norms for the bound."""
        self.register_buffer("column_scale", qw.column_scale, persistent=False)
        self.register_buffer("qweight", qw.qweight, persistent=False)
        self.register_buffer("scales", qw.scales, persistent=False)
        self.norms = qw.norms
        self._onednn = self._fbgemm = None
        V, D = self.vocab_size, self.d_model
        if self.kernel == "onednn":
            self._onednn = kernels.OneDNNWeight(self.qweight[:V, :D], self.scales[:V])
        elif self.kernel == "fbgemm":
            self._fbgemm = kernels.FbgemmWeight(self.qweight[:V, :D], self.scales[:V])

    def _kernel_pays_off(self, calibration: torch.Tensor) -> bool:
        """Whether this (fbgemm or onednn) head's bound stays tight on the calibration rows, one row per call as in
        decoding: at most 2% of them over max_rescore candidates and a median of at most max_rescore/4 (on
        Gemma 3 it is; on SmolLM2, whose hidden states have larger outliers, it is not)."""
        k = max(1, min(self.exact_k or 64, self.vocab_size))
        counts = []
        with kernels.one_thread():
            for n in range(calibration.shape[0]):
                h = calibration[n:n + 1].to(torch.float32)
                a = self._approx(h)
                counts.append(int(bound.candidate_mask(self._with_bias(a.y), self._bounds(h, a), k).sum()))
        if not counts:
            return True
        counts.sort()
        over = sum(c > self.max_rescore for c in counts)
        return over <= 0.02 * len(counts) and counts[len(counts) // 2] <= self.max_rescore / 4

    def _meta(self) -> torch.Tensor:
        return quantize.state_meta(self.vocab_size, self.d_model, self.bits, self.group_size, self.kernel)

    def compressed_state(self) -> dict[str, torch.Tensor]:
        """The compressed tensors (to cache on disk: compressing a big head takes seconds, loading them not);
        give them back as `state=` to skip compressing."""
        qw = QuantizedWeight(self.qweight, self.scales, self.column_scale, self.norms)
        return quantize.to_state(qw, self._meta())

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
        if self.kernel == "fbgemm":
            return self._fbgemm.nbytes
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * 2

    @property
    def extra_bytes(self) -> int:
        """Memory this head adds next to the full-precision weight (packed weight, scales, row norms)."""
        extra = self.compressed_bytes + self.norms.table.numel() * 4
        if self.kernel in ("onednn", "fbgemm"):  # the plain int8 copy, kept for the on-disk cache
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

    # ---- the passes: 1. approximate, 2. bound, 3. candidates, 4. re-score, 5. near-tie check, 6. softcap --

    def _check_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> rows [N,D] fp32."""
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden must be a tensor [..., D], got {type(hidden).__name__}")
        if not hidden.is_floating_point():
            raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
        if hidden.dim() < 1 or hidden.shape[-1] != self.d_model:
            raise ValueError(f"hidden must have last dimension D={self.d_model}, got shape {tuple(hidden.shape)}")
        return hidden.reshape(-1, self.d_model).to(torch.float32)

    def _approx(self, h: torch.Tensor) -> Approx:
        """The kernel's logits without bias [N,V] fp32, x̂ [N,D] float64 (the activation as the kernel
        multiplied it, in the column-scaled space h' = h / c), the kernel that ran, and the magnitude its output
        rounding is relative to (`Approx`).

        The onednn kernel serves one row per call (decoding): its activation scale is per call, so on several
        rows a small row would share a large row's scale. Several rows go to int8pack on the same int8
        weights (bf16 activations: a relative rounding per element). fbgemm serves every call on one grid: the
        rows a decode step scores (a draft's k+1 positions, a batch) are final-normed hidden states of
        similar range, and int8pack is several times slower than fbgemm where fbgemm runs.
        """
        if self.kernel == "fbgemm":
            y, xhat, magnitude = kernels.fbgemm_linear(h / self.column_scale, self._fbgemm)
            return Approx(y, xhat, "fbgemm", magnitude)
        if self.kernel == "onednn" and h.shape[0] == 1:
            y, xhat = kernels.onednn_linear(h / self.column_scale, self._onednn)  # h / c: exact, powers of two
            return Approx(y, xhat, "onednn", y)
        hb = kernels.bf16_activation(h if self.kernel != "onednn" else h / self.column_scale, self._Dp)
        if self.bits == 8:
            y, used = kernels.int8pack_linear(hb, self.qweight, self.scales), "int8pack"
        else:
            y, used = kernels.int4pack_linear(hb, self.qweight, self.group_size, self.scales), "int4pack"
        y = y[:, : self.vocab_size].float()
        return Approx(y, hb[:, : self.d_model].double(), used, y)

    def _with_bias(self, y_raw: torch.Tensor) -> torch.Tensor:
        """y_raw + b in fp32 (y_raw itself when there is no bias)."""
        return y_raw + self.bias.detach().float() if self.bias is not None else y_raw

    def _bounds(self, h: torch.Tensor, a: Approx) -> torch.Tensor:
        """Per-logit error bound [N,V] for the kernel output `a` (pre-bias) on rows h [N,D]."""
        act = bound.activation_norms(h, a.xhat, self.column_scale)
        return bound.logit_bound(act, self.norms, self.d_model, a.magnitude, a.kernel, self.bias)

    def _exact_rows(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Full-precision pre-softcap logits [N, len(ids)] of the given rows, as the fp32 head computes them."""
        # index_select, not weight[ids]: several times faster for a few thousand rows of a big weight
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

    def _rounding(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """ρ [N,len(ids)] of these logits (`bound.rounding_gap`)."""
        w = torch.index_select(self.weight.detach(), 0, ids).to(torch.float32)
        b = None if self.bias is None else self.bias.detach()[ids].float()
        return bound.rounding_gap(h, w, b)

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
        if not math.isfinite(float(h.sum())):
            # a NaN or inf activation has no int8 grid (onednn's per-call scale would be NaN) and no bound:
            # the full head's answer, as `_select` gives for a non-finite approximation
            self.stats["fallback_rows"] += N
            return self._full(h), None
        a = self._approx(h)  # the one big memory-bound pass: torch's thread count
        # The rest is a few dozen small [N,V] passes: on 1 thread they never wait for a busy core.
        with kernels.one_thread():
            out = self._select(h, a, k, check)
        return out if out is not None else (self._full(h), None)

    def _select(self, h: torch.Tensor, a: Approx, k: int, check: int
                ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """Bounds, candidates, re-scoring and the near-tie check for `_logits`; None = use the full head."""
        N, V = h.shape[0], self.vocab_size
        y = self._with_bias(a.y) if self.bias is not None else a.y.clone()  # written into below
        # A bf16 overflow or NaN input: no bound holds, use the full head. One sum is cheaper than
        # isfinite().all() over [N,V]; it is also non-finite when the finite values overflow it (then the
        # full head serves a call that did not need it: safe).
        if not math.isfinite(float(y.sum())):
            self.stats["fallback_rows"] += N
            return None
        if k == 0:
            return y, [y.new_empty(0, dtype=torch.long) for _ in range(N)]
        k = min(k, V)
        mask = bound.candidate_mask(y, self._bounds(h, a), k)
        counts = mask.sum(1)
        if int(counts.max()) > self.max_rescore:
            self.stats["fallback_rows"] += int((counts > self.max_rescore).sum())
            return None
        cands = [mask[n].nonzero().squeeze(1) for n in range(N)]
        union = torch.unique(torch.cat(cands))
        self.stats["candidates"] += int(counts.sum())
        self.stats["max_candidates"] = max(self.stats["max_candidates"], int(counts.max()))
        y[:, union] = self._exact_rows(h, union)  # one batched product over the union of the rows' candidates
        if check and self._near_tie(h, y, cands, check):
            self.stats["tie_fallback_rows"] += N
            return None
        return y, cands

    def _near_tie(self, h: torch.Tensor, y: torch.Tensor, cands: list[torch.Tensor], check: int) -> bool:
        """Whether any row's top `check` + 1 re-scored values hold two closer than their rounding ρ."""
        for n, c in enumerate(cands):
            m = min(check + 1, c.numel())
            if m < 2:
                continue
            v, j = torch.topk(y[n, c], m)
            r = self._rounding(h[n:n + 1], c[j])[0]
            if bool(((v[:-1] - v[1:]) <= (r[:-1] + r[1:])).any()):
                return True
        return False

    # ---- public API ------------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, logits_to_keep: int = 0, exact_k: int | None = None) -> torch.Tensor:
        """Logits [B,T',V] fp32 from hidden [B,T,D] (or [N,D] -> [N,V]); T' = logits_to_keep (0 = all).

        The top-`exact_k` tokens of every row (None: the head's `exact_k`; the explainer asks for as many as
        it shows) are exact (ids and values, those of the fp32 head); the other entries are approximate within
        `error_bound` and strictly below the exact_k-th value.
        """
        checks.non_negative_int("logits_to_keep", logits_to_keep)
        k = checks.exact_k(exact_k, self.vocab_size)
        k = self.exact_k if k is None else k
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and logits_to_keep:
            hidden = hidden[..., -logits_to_keep:, :]  # as LMHead: project only the positions kept
        h = self._check_hidden(hidden)
        z, _ = self._logits(h, k, check=1 if k else 0)
        return self._cap(z).reshape(*hidden.shape[:-1], self.vocab_size)

    def approx_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The kernel's approximate logits alone: hidden [..., D] -> [N,V] fp32 (bias added, before softcap,
        nothing re-scored), within `error_bound` of the fp32 head's. One kernel call: the compressed pass that
        the benchmarks time and the tests hold against the kernels' error model."""
        return self._with_bias(self._approx(self._check_hidden(hidden)).y)

    def error_bound(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Approximate pre-softcap logits and their rigorous error bound, both [N,V] fp32 (N = rows of hidden).

        `|approx_i − (W h + b)_i| ≤ bound_i` where `(W h + b)_i` is the fp32 head's value (its own rounding
        included). The softcap c·tanh(x/c) is 1-Lipschitz, so the same bound holds after it.
        """
        h = self._check_hidden(hidden)
        a = self._approx(h)
        return self._with_bias(a.y), self._bounds(h, a)

    def topk_exact(self, hidden: torch.Tensor, k: int, strict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 head's top-k of each row: (values [N,k] fp32 after softcap, ids [N,k] long), best first.

        hidden: [..., D], flattened to N rows. The candidates are re-scored with `F.linear` on their rows; the
        full head's BLAS call may sum in another order, so values agree to fp32 rounding (≈1e-6) and two
        logits closer than that rounding could swap. `strict=True` rules that out: if any adjacent pair among
        the top k+1 is closer than the worst-case rounding of both evaluations (2·γ_D·Σ|w||h|, ~1e-3), the full
        head serves the call (counted in `stats["tie_fallback_rows"]`) and its answer is returned verbatim.
        The top-1 (`argmax_exact`, and `forward`'s argmax) is always checked this way.
        """
        checks.int_in_range("k", k, 1, self.vocab_size)
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
        """An upper bound [N] on max_i |p_i − p_i(fp32)| for softmax(forward(hidden)) at temperature 1
        (`bound.probability_bound`: the largest bound among the approximate entries moves the normaliser)."""
        h = self._check_hidden(hidden)
        _, b = self.error_bound(h)
        z, cands = self._logits(h, self.exact_k, check=0)
        out = []
        for n in range(h.shape[0]):
            exact = torch.zeros(self.vocab_size, dtype=torch.bool)
            if cands is not None:
                exact[cands[n]] = True
            else:
                exact[:] = True
            p = torch.softmax(self._cap(z[n]).double(), 0)
            out.append(bound.probability_bound(p, exact, b[n]))
        return torch.tensor(out)

"""Stage 4, the cut-offs: top-k, typical-p, top-p, min-p, top-nσ, XTC, epsilon and eta cut-offs (and mirostat, in
``mirostat``, in place of them). Each keeps a subset of the row (rejected tokens at -inf, at least one kept)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.steps.base import Context, Step, int_param, param_rows, real_param
from lmhead.sampling.steps.moments import keep_at_least, keep_probable, moments, probable_ids, typical
from lmhead.sampling.top_p import top_p_parts
from lmhead.sampling.vocab import NEG_INF, Vocab

SIGMA_LIMIT = 1e4

PARAMS = (
    int_param("top_k", 0, 0, None, "keeps the k largest logits (ties with the k-th kept).", "0 = off"),
    real_param("top_p", 1.0, 0.0, 1.0, "the smallest set whose mass reaches top_p (the crossing token kept).",
               "1 = off", low_open=True),
    real_param("min_p", 0.0, 0.0, 1.0, "keeps tokens with p ≥ min_p · p_max.", "0 = off"),
    real_param("typical_p", 1.0, 0.0, 1.0, "locally typical sampling (Meister et al.): the tokens whose surprise "
               "is closest to the row's entropy, until their mass reaches typical_p.", "1 = off", low_open=True),
    real_param("top_n_sigma", -1.0, 0.0, SIGMA_LIMIT, "llama.cpp top-nσ: keeps logits ≥ max − n·σ (σ the standard "
               "deviation of the finite logits).", "0 = off", also=(-1.0,)),
    real_param("xtc_probability", 0.0, 0.0, 1.0, "llama.cpp XTC: the chance that a draw excludes the top choices.",
               "0 = off"),
    real_param("xtc_threshold", 0.1, 0.0, 1.0, "llama.cpp XTC: tokens with p ≥ threshold but the least probable "
               "of them are removed.", "> 0.5 = off"),
    real_param("epsilon_cutoff", 0.0, 0.0, 1.0, "transformers: drops tokens with p < epsilon.", "0 = off",
               high_open=True),
    real_param("eta_cutoff", 0.0, 0.0, 1.0, "transformers: drops tokens with p < min(η, √η · e^−H).", "0 = off",
               high_open=True),
)


def _top_k_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    if cfg.top_k >= x.shape[-1]:
        return x
    kth = torch.topk(x, cfg.top_k, dim=-1).values[:, -1:]
    return x.masked_fill(x < kth, NEG_INF)


def _top_k_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    """Top-k on rows [n,V] with a k per row: one partial sort of the largest k, each row's k-th value its threshold
    (a row whose k ≥ V keeps everything)."""
    width = x.shape[-1]
    ks = [c.top_k if c.top_k < width else 0 for c in cfgs]
    if not any(ks):
        return x
    vals = torch.topk(x, max(ks), dim=-1).values
    kth = vals.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=x.device))
    kth = kth.masked_fill(torch.tensor([[k == 0] for k in ks], device=x.device), NEG_INF)
    return x.masked_fill(x < kth, NEG_INF)


def _top_p_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """The pipeline's top-p rule (`top_p.top_p_parts` at T = 1, its torch path: the same cut as the batch's)."""
    out = torch.full_like(x, NEG_INF)
    for rows, vals, idx in top_p_parts(x, 1.0, cfg.top_p, Vocab(x.shape[1]), native=False):
        block = vals if idx is None else torch.full_like(x[: vals.shape[0]], NEG_INF).scatter_(1, idx, vals)
        out[slice(None) if rows is None else rows] = block
    return out


def min_p_rows(x: Tensor, min_p: float | Tensor, vocab: Vocab) -> Tensor:
    """Min-p on whole rows [b,V_r], exactly HF's MinPLogitsWarper. The argmax is always kept without a
    special case: its p is the maximum itself, and min_p · p_max ≤ p_max for min_p ≤ 1."""
    probs = vocab.softmax(x)
    remove = probs < min_p * vocab.amax(probs)
    return x.masked_fill(remove, NEG_INF)


def _min_p_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return min_p_rows(x, cfg.min_p, Vocab(x.shape[1]))


def _min_p_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return min_p_rows(x, param_rows(cfgs, "min_p", x), Vocab(x.shape[1]))


def _typical_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """transformers' TypicalLogitsWarper (Meister et al., "Locally Typical Sampling"): with H the entropy of
    softmax(x), sort tokens by |−log p − H| ascending; the kept set ends at the first token whose cumulative mass
    reaches typical_p, and every token whose |−log p − H| is at most that token's is kept (ties whole). In float64
    (`moments.typical`: only the tokens near the crossing are sorted)."""
    return typical(x, cfg.typical_p)


def _top_n_sigma_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """llama.cpp's ``llama_sampler_top_n_sigma_apply``: over the finite logits, their mean and population
    standard deviation σ; tokens below max − n·σ at -inf (one candidate: unchanged). In float64."""
    mo = moments(x, sigma=True, exps=False)
    if mo is None or mo.finite <= 1:
        return x
    return keep_at_least(x, mo.max - cfg.top_n_sigma * mo.sd)


def xtc_removed(x: Tensor, threshold: float) -> Tensor:
    """llama.cpp's XTC cut (``llama_sampler_xtc_apply``) on x [1,V], the coin already thrown: the tokens with
    p ≥ threshold, all but the least probable of them (bool [1,V]; none when fewer than two reach it). Among
    tokens tied at the least probability, the one of the highest id stays. p in float64."""
    removed = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    ids = _xtc_ids(x, threshold)
    if ids is not None:
        removed[0, ids] = True
    return removed


def _xtc_ids(x: Tensor, threshold: float) -> Tensor | None:
    """`xtc_removed`'s tokens as ids (None when none is removed): p ≥ threshold ⟺ x ≥ max + log(threshold·S)."""
    # at most 1/threshold tokens have p ≥ threshold
    cap = x.shape[1] if threshold <= 0 else min(x.shape[1], int(1 / threshold) + 16)
    ids = probable_ids(x, math.log(threshold) if threshold > 0 else NEG_INF, cap)
    if ids is None or ids.numel() < 2:
        return None
    vals = x[0, ids]
    low = vals == vals.min()  # equal logits, equal probabilities: the last of them stays
    stay = int(low.nonzero()[-1, 0])
    return torch.cat([ids[:stay], ids[stay + 1 :]])


def _xtc_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """Removes the top choices when this draw's coin (Context.xtc, thrown by the pipeline with probability
    xtc_probability from the row's generator) says so."""
    if not ctx.xtc:
        return x
    ids = _xtc_ids(x, cfg.xtc_threshold)
    return x if ids is None else x.index_fill(1, ids, NEG_INF)


def _epsilon_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """transformers' EpsilonLogitsWarper (Hewitt et al., "Truncation Sampling as Language Model Desmoothing"):
    tokens with p < ε dropped, the most probable kept. p in float64."""
    return keep_probable(x, math.log(cfg.epsilon_cutoff))


def _eta_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """transformers' EtaLogitsWarper (Hewitt et al.): η' = min(η, √η · e^−H), H the entropy of softmax(x); tokens
    with p < η' dropped, the most probable kept. p and H in float64 terms: log η' = min(log η, ½ log η − H) moves by
    no more than H does, so a bounded entropy bounds the threshold (`moments.keep_probable`)."""
    log_eta = math.log(cfg.eta_cutoff)
    return keep_probable(x, log_eta, by_entropy=lambda h: min(log_eta, 0.5 * log_eta - h))


_CUTS = frozenset({"torch", "c", "sharded", "batch"})
STEPS = (
    Step("top_k", ("top_k",), 4, lambda c: c.top_k > 0, True, "outside the top k", _top_k_apply,
         "transformers TopKLogitsWarper (ties with the k-th kept)", _CUTS, aliases=("top-k", "k"), rows=_top_k_rows),
    Step("typical_p", ("typical_p",), 4, lambda c: c.typical_p < 1.0, True, "outside the typical set",
         _typical_apply, "transformers TypicalLogitsWarper; llama.cpp llama_sampler_typical",
         aliases=("typ_p", "typical", "typ", "typical-p", "typ-p", "locally_typical"),
         example=(("typical_p", 0.9),)),
    Step("top_p", ("top_p",), 4, lambda c: c.top_p < 1.0, True, "outside the top-p mass", _top_p_apply,
         "transformers TopPLogitsWarper (a tie at the cut kept whole)", _CUTS, aliases=("top-p", "nucleus")),
    Step("min_p", ("min_p",), 4, lambda c: c.min_p > 0.0, True, "below min_p · p_max", _min_p_apply,
         "transformers MinPLogitsWarper", _CUTS, aliases=("min-p",), rows=_min_p_rows),
    Step("top_n_sigma", ("top_n_sigma",), 4, lambda c: c.top_n_sigma > 0.0, True, "below max − n·σ",
         _top_n_sigma_apply, "llama.cpp llama_sampler_top_n_sigma (Tang et al., top-nσ)",
         aliases=("top-n-sigma", "top_nsigma"),
         example=(("top_n_sigma", 1.0),)),
    Step("xtc", ("xtc_probability", "xtc_threshold"), 4,
         lambda c: c.xtc_probability > 0.0 and c.xtc_threshold <= 0.5, False, "excluded as a top choice (XTC)",
         _xtc_apply, "llama.cpp llama_sampler_xtc (src/llama-sampling.cpp)",
         example=(("xtc_probability", 0.5), ("xtc_threshold", 0.1))),
    Step("epsilon", ("epsilon_cutoff",), 4, lambda c: c.epsilon_cutoff > 0.0, True, "p below epsilon_cutoff",
         _epsilon_apply, "transformers EpsilonLogitsWarper", aliases=("epsilon_cutoff",),
         example=(("epsilon_cutoff", 3e-4),)),
    Step("eta", ("eta_cutoff",), 4, lambda c: c.eta_cutoff > 0.0, True, "p below the eta cut-off", _eta_apply,
         "transformers EtaLogitsWarper", aliases=("eta_cutoff",),
         example=(("eta_cutoff", 3e-4),)),
)

"""Mirostat v1 and v2 (Basu et al., "Mirostat: a neural text decoding algorithm that directly controls perplexity"),
as llama.cpp runs them (``src/llama-sampling.cpp``: ``llama_sampler_mirostat_apply`` / ``_v2_apply``).

A stateful cut in place of the others: each row keeps μ (``RowState.mu``, 2·τ at its first token), the cut keeps
the tokens the current μ allows, the draw picks one, and μ moves by −η·(surprise − τ) with the surprise
−log2 p of the drawn token in the cut distribution. llama.cpp's rule for the rest of the chain: with mirostat on,
only the logit bias and the temperature run before it (penalties, DRY and the other cut-offs are not applied);
lmhead keeps its masks too (allowed ids, bad words, min tokens), which constrain rather than shape.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.steps.base import Context, RowState, Step, int_param, real_param
from lmhead.sampling.steps.moments import keep_at_least, keep_probable
from lmhead.sampling.vocab import Vocab

MIROSTAT_M = 100  # llama.cpp's m: the tokens v1 estimates the Zipf exponent from
TAU_LIMIT = 1e3

PARAMS = (
    int_param("mirostat", 0, 0, 2, "llama.cpp mirostat: 1 = v1, 2 = v2; replaces the cut-offs (see "
              "lmhead.sampling.steps.mirostat).", "0 = off"),
    real_param("mirostat_tau", 5.0, 0.0, TAU_LIMIT, "the target surprise τ (bits)."),
    real_param("mirostat_eta", 0.1, 0.0, 1.0, "the learning rate η of μ."),
)


def mu_of(cfg: Any, state: RowState) -> float:
    """The row's μ now: its state's, or 2·τ before its first mirostat token (llama.cpp's start)."""
    return 2.0 * cfg.mirostat_tau if state.mu is None else state.mu


def _v1_k(p_sorted: Tensor, vocab: int, mu: float) -> int:
    """llama.cpp v1's k: the Zipf exponent ŝ fitted on the top m probabilities (p_sorted: the top m + 1 or more,
    descending, float64; any positive multiple of them, the fit reads their ratios), ε̂ = ŝ − 1,
    k = (ε̂ · 2^μ / (1 − V^−ε̂))^(1/ŝ). A fit that is not finite (a flat top) keeps every token."""
    m = min(MIROSTAT_M - 1, p_sorted.numel() - 1)
    if m < 1:
        return 1
    i = torch.arange(m, dtype=torch.float64)
    t = torch.log((i + 2) / (i + 1))
    b = torch.log(p_sorted[:m] / p_sorted[1 : m + 1])
    s_hat = float((t * b).sum() / (t * t).sum())
    eps = s_hat - 1
    try:
        k = ((eps * 2.0 ** mu) / (1 - vocab ** (-eps))) ** (1 / s_hat)
    except (ZeroDivisionError, OverflowError):
        return vocab
    if isinstance(k, complex) or not math.isfinite(k):
        return vocab
    return max(int(k), 1)


def _mirostat_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """The cut for the row's current μ on x [1,V] (after the temperature). v1: the top k of `_v1_k` (ties with the
    k-th kept), from the top m + 1 probabilities; v2: the tokens whose surprise −log2 p ≤ μ (at least the most
    probable). p in float64."""
    mu = mu_of(cfg, ctx.state)
    vocab = x.shape[-1]
    if cfg.mirostat == 1:
        top = Vocab(vocab).topk(x, min(MIROSTAT_M + 1, vocab))[0][0]
        # the fit reads ratios of probabilities only: e^(v − v_0) is as good as p and needs no normaliser
        k = _v1_k(torch.exp(top.double() - float(top[0])), vocab, mu)
        if k >= vocab:
            return x
        if k <= top.numel():
            kth = top[k - 1]
        else:
            kth = Vocab(vocab).topk(x, k)[0][0, -1] if k <= vocab // 256 else torch.kthvalue(x[0], vocab - k + 1)[0]
        return keep_at_least(x, float(kth))
    return keep_probable(x, -mu * math.log(2.0))


def mirostat_update(cfg: Any, state: RowState, logprob: float) -> None:
    """After a draw with processed log-probability `logprob` (natural log, in the cut distribution): μ ← μ −
    η · (−logprob / ln 2 − τ)."""
    state.mu = mu_of(cfg, state) - cfg.mirostat_eta * (-logprob / math.log(2.0) - cfg.mirostat_tau)


def _accept(cfg: Any, state: RowState, token: int, logprob: float) -> None:
    mirostat_update(cfg, state, logprob)  # the surprise of the drawn token is all μ needs


STEPS = (
    Step("mirostat", ("mirostat", "mirostat_tau", "mirostat_eta"), 4, lambda c: c.mirostat > 0, True,
         "above mirostat's surprise bound μ", _mirostat_apply,
         "llama.cpp llama_sampler_mirostat / llama_sampler_mirostat_v2", state=True,
         example=(("mirostat", 2),), accept=_accept),
)

"""Stage 2, the penalties: repetition / presence / frequency, DRY, no repeated n-grams.

Each reads the row's history (prompt first, then the generated tokens) and lowers logits per token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.inputs import check_overflow
from lmhead.sampling.steps.base import (
    Context,
    Param,
    Step,
    ban_at,
    id_tuple,
    int_param,
    param_rows,
    real_param,
    subtract_at,
)

REPETITION_PENALTY_RANGE = (1e-4, 1e4)
PENALTY_LIMIT = 1e4  # |presence_penalty|, |frequency_penalty|
DRY_LIMIT = 1e4  # dry_multiplier, dry_base
NGRAM_LIMIT = 1 << 16
_FLOAT_MAX_LOG = 88.7228391  # log(FLT_MAX), llama.cpp's cap of the DRY exponent
_low, _high = REPETITION_PENALTY_RANGE


def _check_breakers(value: Any) -> tuple[int, ...]:
    return id_tuple("dry_sequence_breakers", value, "token ids")


PARAMS = (
    real_param("repetition_penalty", 1.0, _low, _high, "CTRL/HF: logit > 0 → logit / r, else logit · r, once per "
               "token seen in the prompt or the generated tokens.", "1 = off"),
    real_param("presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT,
               "OpenAI: minus presence once for each token generated so far.", "0 = off"),
    real_param("frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT,
               "OpenAI: minus frequency · count over the generated tokens.", "0 = off"),
    real_param("dry_multiplier", 0.0, 0.0, DRY_LIMIT, "llama.cpp DRY: a token that would extend a repeat of n ≥ "
               "dry_allowed_length tokens loses dry_multiplier · dry_base^(n − dry_allowed_length).", "0 = off"),
    real_param("dry_base", 1.75, 1.0, DRY_LIMIT, "llama.cpp DRY: the growth of the penalty per repeated token."),
    int_param("dry_allowed_length", 2, 1, NGRAM_LIMIT, "llama.cpp DRY: repeats up to this long are free."),
    int_param("dry_penalty_last_n", -1, -1, None, "llama.cpp DRY: how many of the last tokens are searched "
              "for repeats.", "-1 = the whole history, 0 = off"),
    Param("dry_sequence_breakers", (), "tuple[int, ...]", "ids", "token ids (int ≥ 0)",
          "llama.cpp DRY: tokens a repeat does not extend across (llama.cpp's breaker strings, as the tokens that "
          "hold them; generate() and the server turn strings into ids).", _check_breakers),
    int_param("no_repeat_ngram_size", 0, 0, NGRAM_LIMIT, "transformers: a token that would complete an n-gram "
              "already in the history is banned.", "0 = off"),
)


def _penalties_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    x = x.clone()
    prev = torch.tensor([ctx.history], dtype=torch.long, device=x.device).reshape(1, -1)
    full = lambda v: torch.tensor([v], dtype=torch.float32, device=x.device)
    penalize_(x, prev, torch.tensor([ctx.prompt_len], device=x.device), full(cfg.repetition_penalty),
               full(cfg.presence_penalty), full(cfg.frequency_penalty))
    return x


def _penalties_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    """The penalties on rows [n,V], each row's three settings a column: one pass over the rows' histories padded
    with -1."""
    x = x.clone()
    prev = torch.full((x.shape[0], max(len(c.history) for c in ctxs)), -1, dtype=torch.long)
    for r, c in enumerate(ctxs):
        prev[r, :len(c.history)] = torch.tensor(c.history, dtype=torch.long)
    column = lambda name: param_rows(cfgs, name, x)[:, 0]
    penalize_(x, prev.to(x.device), torch.tensor([c.prompt_len for c in ctxs], device=x.device),
              column("repetition_penalty"), column("presence_penalty"), column("frequency_penalty"))
    return x


def dry_repeat_lengths(history: list[int], breakers: tuple[int, ...], allowed_length: int,
                       last_n: int) -> dict[int, int]:
    """llama.cpp's DRY (``src/llama-sampling.cpp`` ``llama_sampler_dry_apply``, after koboldcpp's): token → the
    length n of the longest suffix of the history (within the last `last_n` tokens, -1 = all; not reaching back
    past the latest breaker) that also occurs earlier followed by that token. Only n ≥ allowed_length are kept.

    O(L) by the Z-algorithm over the reversed history, as llama.cpp: z[i] = the length of the common prefix of the
    reversed history and the reversed history from i, i.e. of the suffix ending at the last token and the one
    ending i tokens earlier; the token that followed that earlier suffix is history[-i]."""
    tail = history if last_n < 0 else history[len(history) - min(last_n, len(history)):]
    n = len(tail)
    if n < 2:
        return {}
    rev = tail[::-1]
    limit = n  # the suffix may not reach back past a breaker
    for i, t in enumerate(rev):
        if t in breakers:
            limit = i
            break
    if limit < allowed_length:
        return {}
    z = [0] * n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and rev[z[i]] == rev[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    out: dict[int, int] = {}
    for i in range(1, n):
        length = min(z[i], limit)
        if length >= allowed_length:
            token = rev[i - 1]  # what followed the earlier occurrence
            out[token] = max(out.get(token, 0), length)
    return out


def dry_penalties(cfg: Any, ctx: Context, width: int) -> tuple[list[int], list[float]]:
    """(ids, penalties): dry_multiplier · dry_base^(n − dry_allowed_length) for each token id < width with a repeat
    length n ≥ dry_allowed_length (`dry_repeat_lengths`); the exponent capped as llama.cpp caps it."""
    lengths = dry_repeat_lengths(ctx.history, cfg.dry_sequence_breakers, cfg.dry_allowed_length,
                                 cfg.dry_penalty_last_n)
    lengths = {t: n for t, n in lengths.items() if t < width}
    # llama.cpp: the exponent at most log(FLT_MAX) / log(base) (int), where base > 1.000001
    cap = int(_FLOAT_MAX_LOG / math.log(cfg.dry_base)) if cfg.dry_base > 1.000001 else math.inf
    return list(lengths), [cfg.dry_multiplier * cfg.dry_base ** min(n - cfg.dry_allowed_length, cap)
                           for n in lengths.values()]


def _dry_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """logit − the row's DRY penalty of each token (`dry_penalties`)."""
    return subtract_at(x, [dry_penalties(cfg, ctx, x.shape[-1])])


def _dry_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return subtract_at(x, [dry_penalties(c, ctx, x.shape[-1]) for c, ctx in zip(cfgs, ctxs, strict=True)])


def banned_by_ngrams(history: list[int], size: int) -> list[int]:
    """transformers' NoRepeatNGramLogitsProcessor: the tokens t such that history[-(size-1):] + [t] is an n-gram of
    the history already (over the whole sequence, prompt included, as transformers' input_ids)."""
    if size <= 0 or len(history) + 1 < size:
        return []
    head = tuple(history[len(history) - size + 1:]) if size > 1 else ()
    return [history[i + size - 1] for i in range(len(history) - size + 1)
            if tuple(history[i:i + size - 1]) == head]


def _ngram_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return ban_at(x, [banned_by_ngrams(ctx.history, cfg.no_repeat_ngram_size)])


def _ngram_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return ban_at(x, [banned_by_ngrams(ctx.history, c.no_repeat_ngram_size) for c, ctx in zip(cfgs, ctxs, strict=True)])


def _has_penalties(c: Any) -> bool:
    return c.repetition_penalty != 1.0 or c.presence_penalty != 0.0 or c.frequency_penalty != 0.0


STEPS = (
    Step("penalties", ("repetition_penalty", "presence_penalty", "frequency_penalty"), 2, _has_penalties, False,
         "", _penalties_apply, "CTRL / transformers RepetitionPenaltyLogitsProcessor; OpenAI presence / frequency",
         frozenset({"torch", "sharded", "batch"}), history=True, aliases=("repetition_penalty", "penalty"),
         rows=_penalties_rows),
    Step("dry", ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"),
         2, lambda c: c.dry_multiplier > 0 and c.dry_penalty_last_n != 0, False, "", _dry_apply,
         "llama.cpp llama_sampler_dry (src/llama-sampling.cpp)", history=True,
         example=(("dry_multiplier", 0.8),), rows=_dry_rows),
    Step("no_repeat_ngram", ("no_repeat_ngram_size",), 2, lambda c: c.no_repeat_ngram_size > 0, False,
         "would repeat an n-gram", _ngram_apply, "transformers NoRepeatNGramLogitsProcessor", history=True,
         aliases=("no_repeat_ngram_size",),
         example=(("no_repeat_ngram_size", 3),), rows=_ngram_rows),
)


def penalize_(x: Tensor, prev: Tensor, prompt_len: Tensor, rep: Tensor, pres: Tensor, freq: Tensor,
               start: int = 0) -> None:
    """In place on x [B,V_r] (global ids [start, start + V_r)) with per-row penalties [B] and prev [B,L] (global
    ids, -1 = padding)."""
    batch, vocab = x.shape
    valid = prev >= 0
    local = prev - start
    mine = valid & (local >= 0) & (local < vocab)
    # padding and other shards' tokens go to an extra column that is dropped (they still count as positions)
    safe = torch.where(mine, local, vocab)
    if bool((rep != 1.0).any()):
        # repetition (CTRL / HF): every token seen in the prompt or the generation, once
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, safe, True)
        seen = seen[:, :vocab]
        r = rep.unsqueeze(1)
        cols = safe.clamp(max=vocab - 1)
        before = x.gather(1, cols)
        x.copy_(torch.where(seen, torch.where(x < 0, x * r, x / r), x))
        # a logit beyond ~3.4e34 can leave float32's range even with a bounded penalty; presence and frequency
        # cannot (a bounded shift of a finite float32 rounds back to a finite one)
        check_overflow(x, cols, mine, before, "repetition_penalty", rep, start)
    if bool((pres != 0.0).any() or (freq != 0.0).any()):
        # presence / frequency (OpenAI): generated tokens only = valid tokens after the first prompt_len
        ordinal = valid.long().cumsum(1) - 1
        generated = valid & (ordinal >= prompt_len.unsqueeze(1))
        counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=x.device)
        counts.scatter_add_(1, torch.where(generated, safe, vocab), generated.float())
        counts = counts[:, :vocab]
        x.sub_(counts * freq.unsqueeze(1) + (counts > 0).float() * pres.unsqueeze(1))

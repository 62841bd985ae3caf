"""Stage 2, the penalties: repetition / presence / frequency, DRY, no repeated n-grams.

Each reads the row's history (prompt first, then the generated tokens) and lowers logits per token. The penalties and
DRY keep what they read of it as the row's own state (llama.cpp's samplers keep their token counts and last tokens
so): a record (`PenaltyCounts`, `DryTail`) made from the history at the first call and moved by ``accept`` one drawn
token at a time, read where it matches the history shown (``HistoryRecord.matches``), made again where it does not.
The batch path's penalties (``penalize_``) read the history itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.inputs import check_overflow
from lmhead.sampling.steps.base import (
    Context,
    HistoryRecord,
    Param,
    RowState,
    Step,
    ban_at,
    id_tuple,
    int_param,
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


@dataclass
class PenaltyCounts(HistoryRecord):
    """The penalties' record of a row (llama.cpp's penalties sampler keeps its token counts so): every token of the
    prompt and the generated ones, in the order first seen (``seen``: repetition), and each generated token's count
    (``counts``: presence and frequency)."""

    seen: dict[int, None] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, history: list[int], prompt_len: int) -> PenaltyCounts:
        record = cls(prompt_len=prompt_len)
        for token in history:
            record.take(token)
        return record

    def take(self, token: int) -> None:
        self.seen[token] = None
        if self.length >= self.prompt_len:
            self.counts[token] = self.counts.get(token, 0) + 1
        super().take(token)

    def clone(self) -> PenaltyCounts:
        return replace(self, seen=dict(self.seen), counts=dict(self.counts))


def record_of(ctx: Context, name: str, make: Callable[[list[int], int], HistoryRecord]) -> Any:
    """The step `name`'s record in the row's state where it matches the row's history, else made from the history
    (and kept there, for ``accept`` to move)."""
    record = ctx.state.history.get(name)
    if record is None or not record.matches(ctx.history, ctx.prompt_len):
        record = ctx.state.history[name] = make(ctx.history, ctx.prompt_len)
    return record


def _at(x: Tensor, rows: list[int], cols: list[int]) -> tuple[Tensor, Tensor]:
    return torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)


def _penalties_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    """The penalties on rows [n,V], each row with its own settings, from each row's record (`PenaltyCounts`)."""
    x = x.clone()
    penalize_from_records_(x, list(range(x.shape[0])), cfgs,
                           [record_of(ctx, "penalties", PenaltyCounts.of) for ctx in ctxs])
    return x


def penalize_from_records_(x: Tensor, rows_of_x: list[int], cfgs: Any, records: list[PenaltyCounts]) -> None:
    """In place on the rows `rows_of_x` of x [B,V], each with its config and record (`PenaltyCounts`): its seen
    tokens' logits · or / repetition_penalty, then its generated tokens' logits less count · frequency + presence,
    each in one indexed write for all the rows (the numbers ``penalize_`` gives)."""
    rows, cols, reps = [], [], []
    for r, cfg, record in zip(rows_of_x, cfgs, records, strict=True):
        if cfg.repetition_penalty != 1.0:
            rows += [r] * len(record.seen)
            cols += list(record.seen)
            reps += [cfg.repetition_penalty] * len(record.seen)
    if rows:
        index = _at(x, rows, cols)
        before = x[index]
        rep = torch.tensor(reps, dtype=torch.float32, device=x.device)
        after = torch.where(before < 0, before * rep, before / rep)
        x[index] = after
        bad = torch.isfinite(before) & ~torch.isfinite(after)
        if bool(bad.any()):  # as penalize_ says it
            j = int(bad.nonzero()[0, 0])
            raise ValueError(f"repetition_penalty={rep[j].item():g} takes the logit {before[j].item():g} of token "
                             f"{cols[j]} (row {rows[j]}) outside float32's range; use a repetition_penalty closer "
                             "to 1")
    rows, cols, counts, freq, pres = [], [], [], [], []
    for r, cfg, record in zip(rows_of_x, cfgs, records, strict=True):
        if cfg.presence_penalty != 0.0 or cfg.frequency_penalty != 0.0:
            rows += [r] * len(record.counts)
            cols += list(record.counts)
            counts += list(record.counts.values())
            freq += [cfg.frequency_penalty] * len(record.counts)
            pres += [cfg.presence_penalty] * len(record.counts)
    if rows:
        index = _at(x, rows, cols)
        as32 = lambda v: torch.tensor(v, dtype=torch.float32, device=x.device)
        x[index] = x[index] - (as32(counts) * as32(freq) + as32(pres))


def _penalties_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return _penalties_rows(x, [cfg], [ctx])


def _take(name: str) -> Callable[[Any, RowState, int, float], None]:
    """The ``accept`` of a step whose record is `name`: the drawn token joins it."""
    def accept(cfg: Any, state: RowState, token: int, logprob: float) -> None:
        record = state.history.get(name)
        if record is not None:
            record.take(token)

    return accept


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


@dataclass
class DryTail(HistoryRecord):
    """DRY's record of a row (llama.cpp's DRY sampler keeps its last tokens so): the last ``keep`` tokens (all of
    them for -1), the ones its search reads."""

    keep: int = -1
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def maker(cls, keep: int) -> Callable[[list[int], int], DryTail]:
        def make(history: list[int], prompt_len: int) -> DryTail:
            tail = history if keep < 0 else history[len(history) - min(keep, len(history)):]
            return cls(len(history), history[-1] if history else None, prompt_len, keep, list(tail))

        return make

    def take(self, token: int) -> None:
        self.tokens.append(token)
        if 0 <= self.keep < len(self.tokens):
            del self.tokens[0]
        super().take(token)

    def clone(self) -> DryTail:
        return replace(self, tokens=list(self.tokens))


def dry_penalties(cfg: Any, ctx: Context, width: int) -> tuple[list[int], list[float]]:
    """(ids, penalties): dry_multiplier · dry_base^(n − dry_allowed_length) for each token id < width with a repeat
    length n ≥ dry_allowed_length (`dry_repeat_lengths` over the row's record, `DryTail`); the exponent capped as
    llama.cpp caps it."""
    record = record_of(ctx, "dry", DryTail.maker(cfg.dry_penalty_last_n))
    if record.keep != cfg.dry_penalty_last_n:  # another setting on the same state: its own record
        record = ctx.state.history["dry"] = DryTail.maker(cfg.dry_penalty_last_n)(ctx.history, ctx.prompt_len)
    lengths = dry_repeat_lengths(record.tokens, cfg.dry_sequence_breakers, cfg.dry_allowed_length,
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
         rows=_penalties_rows, accept=_take("penalties")),
    Step("dry", ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers"),
         2, lambda c: c.dry_multiplier > 0 and c.dry_penalty_last_n != 0, False, "", _dry_apply,
         "llama.cpp llama_sampler_dry (src/llama-sampling.cpp)", history=True,
         example=(("dry_multiplier", 0.8),), rows=_dry_rows, accept=_take("dry")),
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

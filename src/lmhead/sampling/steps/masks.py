"""Stage 1, the masks: logit bias and bans, allowed token ids, bad words (token sequences), min tokens.

Each sets logits to -inf (or adds a bias) per token; none reads across the vocabulary, so a shard applies them to
its own columns. They run first whatever the order (``samplers`` orders stages 2-4), as llama.cpp applies its
logit bias before its chain and vLLM its allowed / bad-word masks before its sampler.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from lmhead.checks import is_int, is_real
from lmhead.sampling.inputs import once_per
from lmhead.sampling.steps.base import Context, Param, Step, ban_at, ids_param, int_param, sequences_param
from lmhead.sampling.vocab import NEG_INF

LOGIT_BIAS_LIMIT = 1e4  # |logit_bias| of a finite bias; -inf bans
MIN_TOKENS_LIMIT = 1 << 20


def _check_bias(bias: Any) -> Mapping[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping token id -> float or None, got {type(bias)}")
    clean: dict[int, float] = {}
    for tok, val in bias.items():
        if not is_int(tok) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (int ≥ 0), got {tok!r}")
        if not is_real(val) or not (abs(val) <= LOGIT_BIAS_LIMIT or val == -math.inf):
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] "
                             f"or -inf (bans), got {val!r} for token {tok}")
        clean[tok] = float(val)
    return MappingProxyType(clean) if clean else None


PARAMS = (
    Param("logit_bias", None, "Mapping[int, float] | None", "bias",
          f"a mapping token id (int ≥ 0) → float in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] or -inf (bans)",
          "added to the token's logit; -inf bans it (+inf and NaN are rejected). Stored read-only.", _check_bias),
    ids_param("banned_tokens", "token ids that can never be chosen."),
    ids_param("allowed_token_ids", "vLLM: only these tokens can be chosen (None = every token).", default=None),
    sequences_param("bad_words", "token-id sequences that are never completed: the last token of each is banned "
                    "where the history ends with the rest of it (one token: always banned). transformers' "
                    "NoBadWordsLogitsProcessor; vLLM's bad_words after tokenisation."),
    int_param("min_tokens", 0, 0, MIN_TOKENS_LIMIT, "vLLM: the stop tokens are banned until this many tokens are "
              "generated (transformers' min_new_tokens).", "0 = off"),
    ids_param("stop_token_ids", "vLLM: the tokens min_tokens withholds (generate() adds the model's end of "
              "sequence)."),
)
# how the params above reach the checks of token ids against V
ID_FIELDS = ("banned_tokens", "allowed_token_ids", "stop_token_ids")


def _bias_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    x = x.clone()
    apply_bias_(x, *bias_index(cfg, x.shape[0], x.shape[1], x.device))
    return x


def _bias_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    x = x.clone()
    apply_bias_(x, *bias_index(list(cfgs), x.shape[0], x.shape[1], x.device))
    return x


def _allowed_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    """vLLM's allowed_token_ids (``vllm/v1/sample/logits_processor``: a mask of -inf off the allowed ids)."""
    # built once per setting: turning a tuple of 37,000 ids into a tensor costs more than the step
    ids = once_per("allowed_token_ids", cfg.allowed_token_ids, lambda v: torch.tensor(v, dtype=torch.long), 64)
    ids = ids if ids.device == x.device else ids.to(x.device)
    out = torch.full_like(x, NEG_INF)
    out[0].index_copy_(0, ids, x[0].index_select(0, ids))
    return out


_Heads = dict[int, list[tuple[list[int], int]]]


def _bad_words_index(bad_words: tuple[tuple[int, ...], ...]) -> tuple[list[int], _Heads]:
    """(the one-token sequences' ids, {a longer sequence's last-but-one token: [(its other tokens, its last)]})."""
    always: list[int] = []
    by_prev: _Heads = {}
    for seq in bad_words:
        if len(seq) == 1:
            always.append(seq[0])
        else:
            by_prev.setdefault(seq[-2], []).append((list(seq[:-1]), seq[-1]))
    return always, by_prev


def banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], history: list[int]) -> list[int]:
    """The tokens bad_words bans after `history` (transformers' NoBadWordsLogitsProcessor: a sequence's last token
    is banned where the history ends with the sequence's other tokens; a one-token sequence always). Only the
    sequences whose last-but-one token ends the history are compared."""
    always, by_prev = once_per("bad_words", bad_words, _bad_words_index, 64)
    out = list(always)
    for head, last in by_prev.get(history[-1], ()) if history else ():
        if len(history) >= len(head) and history[len(history) - len(head):] == head:
            out.append(last)
    return out


def _bad_words_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return ban_at(x, [banned_by_bad_words(cfg.bad_words, ctx.history)])


def _bad_words_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return ban_at(x, [banned_by_bad_words(c.bad_words, ctx.history) for c, ctx in zip(cfgs, ctxs, strict=True)])


def _withheld(cfg: Any, ctx: Context) -> list[int]:
    """vLLM's min_tokens (transformers' MinNewTokensLengthLogitsProcessor): the stop tokens, while fewer than
    min_tokens tokens have been generated."""
    return list(cfg.stop_token_ids) if ctx.generated < cfg.min_tokens else []


def _min_tokens_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return ban_at(x, [_withheld(cfg, ctx)])


def _min_tokens_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return ban_at(x, [_withheld(c, ctx) for c, ctx in zip(cfgs, ctxs, strict=True)])


STEPS = (
    Step("logit_bias", ("logit_bias", "banned_tokens"), 1, lambda c: bool(c.logit_bias or c.banned_tokens), False,
         "banned (logit_bias -inf / banned_tokens)", _bias_apply, "OpenAI's logit_bias; llama.cpp's logit_bias sampler",
         frozenset({"torch", "sharded", "batch"}), aliases=("bias",), rows=_bias_rows),
    Step("allowed_token_ids", ("allowed_token_ids",), 1, lambda c: c.allowed_token_ids is not None, False,
         "not in allowed_token_ids", _allowed_apply, "vLLM SamplingParams.allowed_token_ids",
         example=(("allowed_token_ids", tuple(range(0, 262_144, 7))),)),
    Step("bad_words", ("bad_words",), 1, lambda c: bool(c.bad_words), False, "would complete a bad word",
         _bad_words_apply, "transformers NoBadWordsLogitsProcessor (bad_words_ids)", history=True, rows=_bad_words_rows,
         example=(("bad_words", tuple((i, i + 1) for i in range(0, 2000, 2))),)),
    Step("min_tokens", ("min_tokens", "stop_token_ids"), 1, lambda c: c.min_tokens > 0 and bool(c.stop_token_ids),
         False, "a stop token before min_tokens", _min_tokens_apply,
         "vLLM min_tokens; transformers MinNewTokensLengthLogitsProcessor", history=True, rows=_min_tokens_rows,
         example=(("min_tokens", 1000), ("stop_token_ids", (0, 1, 2)))),
)


def withhold_stops(cfg: Any, eos: Any) -> Any:
    """cfg with the model's end-of-sequence ids `eos` among the tokens min_tokens withholds (vLLM's rule: the end
    of sequence too, not only the stop_token_ids given); cfg itself without min_tokens or eos. `generate` and the
    explainer apply it, so the explainer shows the distribution the next draw follows."""
    eos = tuple(eos or ())
    if not cfg.min_tokens or not eos:
        return cfg
    return replace(cfg, stop_token_ids=tuple(dict.fromkeys(cfg.stop_token_ids + eos)))


def bias_index(configs: Any, batch: int, vocab: int, device: torch.device,
                start: int = 0, width: int | None = None):
    """(rows, cols, values) of every logit_bias entry and (rows, cols) of every banned token, in the local
    columns [start, start + width) of a vocabulary of `vocab` ids (entries outside them are another shard's)."""
    end = vocab if width is None else start + width

    def entries(c: Any):
        ids = list(c.logit_bias.keys()) if c.logit_bias else []
        vals = list(c.logit_bias.values()) if c.logit_bias else []
        banned = list(c.banned_tokens)
        for name, toks in (("logit_bias", ids), ("banned_tokens", banned)):
            if toks and max(toks) >= vocab:
                raise ValueError(f"{name}: token id {max(toks)} is outside the vocabulary [0, {vocab})")
        if (start, end) != (0, vocab):
            kept = [(i - start, v) for i, v in zip(ids, vals, strict=True) if start <= i < end]
            ids, vals = [i for i, _ in kept], [v for _, v in kept]
            banned = [i - start for i in banned if start <= i < end]
        return ids, vals, banned

    rows_b, cols_b, vals_b, rows_x, cols_x = [], [], [], [], []
    if not isinstance(configs, (list, tuple)):  # one config for the whole batch
        ids, vals, banned = entries(configs)
        return (None, torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(vals, dtype=torch.float32, device=device),
                None, torch.tensor(banned, dtype=torch.long, device=device))
    for r, c in enumerate(configs):
        ids, vals, banned = entries(c)
        rows_b += [r] * len(ids)
        cols_b += ids
        vals_b += vals
        rows_x += [r] * len(banned)
        cols_x += banned
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)
    return (as_long(rows_b), as_long(cols_b), torch.tensor(vals_b, dtype=torch.float32, device=device),
            as_long(rows_x), as_long(cols_x))


def apply_bias_(x: Tensor, rows, cols, vals, rows_x, cols_x) -> None:
    """In place on x [B,V]: add biases, then set banned ids to -inf."""
    if cols.numel():
        if rows is None:
            x[:, cols] += vals
        else:
            x[rows, cols] += vals  # (row, id) pairs are unique: a mapping per row
    if cols_x.numel():
        if rows_x is None:
            x[:, cols_x] = NEG_INF
        else:
            x[rows_x, cols_x] = NEG_INF

"""The whole pipeline: ``process_logits`` (steps 1-6), ``probabilities`` (1-7), ``sample`` (1-8),
``sample_with_logprobs`` and ``chosen_logprobs`` (the decode loop's step and score)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling import general
from lmhead.sampling.config import ConfigArg, SamplingConfig, config_arg
from lmhead.sampling.cuts import cut_parts, scatter_rows
from lmhead.sampling.draw import draw_groups
from lmhead.sampling.inputs import as_prev_tokens, as_row_ints, check_logits, once_per
from lmhead.sampling.preprocess import preprocess_rows
from lmhead.sampling.race import part_logprobs
from lmhead.sampling.steps import RowState, accept
from lmhead.sampling.steps.masks import ID_FIELDS
from lmhead.sampling.vocab import NEG_INF, Vocab


def process_logits(logits: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                   prompt_len: int | Sequence[int] = 0, *, vocab: Vocab | None = None) -> Tensor:
    """Steps 1-6: [B,V] logits → [B,V] float32 processed logits (temperature-scaled), rejected tokens -inf.

    A greedy row keeps only its argmax (at its biased / penalised logit). ``config`` is one SamplingConfig or
    a list with one per row; ``prev_tokens`` ([B,L] LongTensor, -1 = padding, or list of lists) is the
    sequence so far, its first ``prompt_len`` tokens (int or one per row) the prompt. ``vocab`` (None: the
    logits are the whole vocabulary) says which columns [start, start + V_r) of it the logits hold, and
    carries the reductions across it; the result then holds the same columns ([B,V_r])."""
    split = _split(logits, config, prev_tokens, prompt_len, vocab)
    if split is not None:
        out = split.assemble(lambda x, c, p, pl: process_logits(x, c, p, pl),
                             lambda: general.process_rows(split.general_x, split.general_cfgs, split.contexts()))
        return out[0] if split.one_row else out
    x, configs, one_row, vocab = preprocess_rows(logits, config, prev_tokens, prompt_len, vocab)
    out = torch.empty_like(x)
    for rows, vals, idx, _ in cut_parts(x, configs, vocab):
        scatter_rows(out, rows, vals, idx, NEG_INF, vocab)
    return out[0] if one_row else out


def probabilities(logits: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                  prompt_len: int | Sequence[int] = 0, *, vocab: Vocab | None = None) -> Tensor:
    """Steps 1-7: [B,V] logits → [B,V] float32 probabilities over the full vocabulary (rows sum to 1, cut
    tokens 0). Same arguments as ``process_logits``."""
    split = _split(logits, config, prev_tokens, prompt_len, vocab)
    if split is not None:
        out = split.assemble(lambda x, c, p, pl: probabilities(x, c, p, pl), lambda: torch.softmax(
            general.process_rows(split.general_x, split.general_cfgs, split.contexts()), dim=-1))
        return out[0] if split.one_row else out
    x, configs, one_row, vocab = preprocess_rows(logits, config, prev_tokens, prompt_len, vocab)
    out = torch.empty_like(x)
    for rows, vals, idx, _ in cut_parts(x, configs, vocab):
        probs = vocab.softmax(vals) if idx is None else torch.softmax(vals, dim=-1)
        scatter_rows(out, rows, probs, idx, 0.0, vocab)
    return out[0] if one_row else out


def sample(logits: Tensor, config: ConfigArg = None, generator: torch.Generator | None = None,
           prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0,
           step: int | Sequence[int] = 0, *, vocab: Vocab | None = None,
           state: Sequence[RowState] | None = None) -> Tensor:
    """Steps 1-8: [B,V] logits → [B] long token ids (a 0-d tensor for a [V] row).

    Greedy rows (temperature 0) take the argmax (the first one on ties). With top-k set only the [B,k]
    survivors are touched after ``torch.topk`` and drawn by the exponential race; unseeded rows with top-p alone
    draw by rejection from the whole row (``top_p_draw``: no top-p set is computed) — but a few whole CPU rows
    whose set one C pass finds (a language model's rows) race over that set, as seeded rows always do over
    theirs; other rows kept whole (no cut-off, min-p) draw by inverse CDF with one uniform per row.
    Rows without a seed draw from ``generator`` (or torch's default generator). A row whose config has a seed
    draws from a generator seeded with (seed, step), on its own, over its tokens in token-id order, so the id
    does not depend on the batch; ``step`` (int or one per row) is the position of the token being drawn.
    ``vocab`` as in ``process_logits`` (the ids are global). ``state``: one ``RowState`` per row that its stateful
    steps (mirostat's μ, the penalties' and DRY's records of the row's tokens) read and move (None: a fresh state per
    row, as at a first token). Rows whose steps the batch path does not run (``SamplingConfig.runs_on("batch")``
    false) are drawn by ``lmhead.sampling.general``, each step once over the rows that run it."""
    split = _split(logits, config, prev_tokens, prompt_len, vocab)
    if split is not None:
        ids = split.draw(generator, step, state, sample)[0]
        return ids[0] if split.one_row else ids
    ids, _, one_row = _sample(logits, config, generator, prev_tokens, prompt_len, step, vocab, scored=False,
                              states=state)
    return ids[0] if one_row else ids


def sample_with_logprobs(logits: Tensor, config: ConfigArg = None, generator: torch.Generator | None = None,
                         prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0,
                         step: int | Sequence[int] = 0, *,
                         state: Sequence[RowState] | None = None) -> tuple[Tensor, Tensor]:
    """``sample`` and each drawn token's processed log-probability, ``chosen_logprobs`` of the ids, taken from
    the very cut the draw was made from (no second pass over the vocabulary). [B,V] logits → (ids [B] long,
    logprobs [B] float32); a [V] row → two 0-d tensors. The decode loop's step.

    The ids are ``sample``'s for the same seeds and generator state, except on unseeded rows with top-p alone
    that ``sample`` draws by rejection without finding the top-p set (rows C does not settle): here the set is
    found for the logprob and the draw is made from it — the same distribution, other ids for the same generator
    state (and so, in the same call, on the unseeded rows drawn after such a row from the same generator).
    ``state`` as in ``sample``."""
    split = _split(logits, config, prev_tokens, prompt_len, None)
    if split is not None:
        ids, lp = split.draw(generator, step, state, sample_with_logprobs)
        return (ids[0], lp[0]) if split.one_row else (ids, lp)
    ids, lp, one_row = _sample(logits, config, generator, prev_tokens, prompt_len, step, None, scored=True,
                               states=state)
    return (ids[0], lp[0]) if one_row else (ids, lp)


def sample_plain_rows(logits: Tensor, configs: list[SamplingConfig], generator: torch.Generator | None,
                      steps: Sequence[int]) -> tuple[Tensor, Tensor]:
    """``sample_with_logprobs`` for float32 rows [B,V] whose configs run only temperature and the cut-offs (no
    bias, bans, penalties, masks of their own or state: ``SamplingConfig.runs_on("c")``), each row at its own
    step: the same ids and logprobs from the same passes (``draw_groups``), without the validation of a history
    and prompt lengths those rows never read (the decode loop's plain rounds, a call a token)."""
    x, _ = check_logits(logits)
    if len(configs) != x.shape[0] or len(steps) != x.shape[0]:
        raise ValueError(f"configs and steps: one per row of logits ({x.shape[0]}), got {len(configs)} and "
                         f"{len(steps)}")
    if not all(c.runs_on("c") for c in configs):
        raise ValueError("sample_plain_rows takes configs of temperature and cut-offs only")
    return draw_groups(x, configs, generator, list(steps), Vocab(x.shape[1]), True)


def _sample(logits: Tensor, config: ConfigArg, generator: torch.Generator | None, prev_tokens: Any,
            prompt_len: int | Sequence[int], step: int | Sequence[int], vocab: Vocab | None,
            scored: bool, states: Sequence[RowState] | None = None) -> tuple[Tensor, Tensor | None, bool]:
    """The batch path's draw; with ``states``, the penalties apply from the rows' records and the drawn tokens join
    them (``steps.accept``)."""
    x, configs, one_row, vocab = preprocess_rows(logits, config, prev_tokens, prompt_len, vocab, states)
    batch = x.shape[0]
    if states is not None and len(states) != batch:
        raise ValueError(f"state must hold one RowState per row ({batch}), got {len(states)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    cfgs = [configs] if isinstance(configs, SamplingConfig) else configs
    steps = None
    if any(c.seed is not None for c in cfgs):
        steps = as_row_ints(step, batch, "step", torch.device("cpu")).tolist()
    if batch == 0:
        return (torch.empty(0, dtype=torch.long, device=x.device),
                torch.empty(0, device=x.device) if scored else None, one_row)
    ids, lp = draw_groups(x, configs, generator, steps, vocab, scored)
    if states is not None and prev_tokens is not None:
        for r, token in enumerate(ids.tolist()):
            accept(cfgs[0] if len(cfgs) == 1 else cfgs[r], states[r], token, math.nan)  # the records move
    return ids, lp, one_row


def chosen_logprobs(logits: Tensor, token_ids: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                    prompt_len: int | Sequence[int] = 0) -> Tensor:
    """The processed log-probability of each row's token: [B,V] logits, token_ids [B] long → [B] float32,
    equal to ``logprobs(...).logprob`` (log of ``probabilities``; -inf for a token the pipeline cut) but
    normalised over the pipeline's kept candidates where the cut has them (top-k rows, greedy picks: [b,k]
    values, no [B,V] temporary); rows kept whole (top-p without top-k, min-p, no cut) take a log-softmax over
    the row. Same config / prev_tokens / prompt_len as ``process_logits``. The decode loop's per-step score."""
    split = _split(logits, config, prev_tokens, prompt_len, None)
    if split is not None:
        tok = token_ids.to(dtype=torch.long).reshape(-1)
        if tok.shape[0] != split.x.shape[0]:
            raise ValueError(f"token_ids must hold one id per row ({split.x.shape[0]}), got {tok.shape[0]}")
        return split.assemble(
            lambda x, c, p, pl: chosen_logprobs(x, tok[split.legacy], c, p, pl),
            lambda: torch.log_softmax(general.process_rows(split.general_x, split.general_cfgs, split.contexts()),
                                      dim=-1).gather(1, tok[split.general, None]).squeeze(1), width=None)
    x, configs, _, vocab = preprocess_rows(logits, config, prev_tokens, prompt_len)
    tok = token_ids.to(device=x.device, dtype=torch.long).reshape(-1)
    if tok.shape[0] != x.shape[0]:
        raise ValueError(f"token_ids must hold one id per row ({x.shape[0]}), got {tok.shape[0]}")
    return _chosen(x, tok, configs, vocab)


def _chosen(x: Tensor, tok: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab) -> Tensor:
    """`chosen_logprobs` on logits x [B,V_r] already through steps 1-2, ids tok [B]."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for rows, vals, idx, _ in cut_parts(x, configs, vocab):
        lp = part_logprobs(vals, idx, tok if rows is None else tok[rows], vocab)
        if rows is None:
            out.copy_(lp)
        else:
            out[rows] = lp
    return out


def _top_ids(cfg: SamplingConfig) -> tuple[tuple[str, int], ...]:
    """The largest token id of each token-id setting of cfg that has one (checked against V on every call)."""
    tops = [(name, max(getattr(cfg, name))) for name in ID_FIELDS if getattr(cfg, name)]
    if cfg.bad_words:
        tops.append(("bad_words", max(max(seq) for seq in cfg.bad_words)))
    return tuple(tops)


@lru_cache(maxsize=4096)
def _batch_ok_by_value(cfg: SamplingConfig) -> bool:
    return cfg.runs_on("batch")


def _batch_ok(cfg: SamplingConfig) -> bool:
    # by the config object first: hashing a config hashes its token-id tuples too
    return once_per("batch_ok", cfg, _batch_ok_by_value, 4096)


class _Split:
    """A batch whose rows are served by both paths: the batch path's rows (`legacy`) and the general path's
    (`general`, lmhead.sampling.general), with the prev tokens and prompt lengths of each."""

    def __init__(self, x: Tensor, one_row: bool, cfgs: list, prev: Tensor | None, plen: list[int]) -> None:
        self.x, self.one_row, self.cfgs, self.prev, self.plen = x, one_row, cfgs, prev, plen
        ok = [_batch_ok(c) for c in cfgs]
        self.general = [r for r in range(len(cfgs)) if not ok[r]]
        self.legacy = [r for r in range(len(cfgs)) if ok[r]]
        # the steps never write into their input: a batch that is all general rows is read where it lies
        self.general_x = x if not self.legacy else x[self.general]
        self.general_cfgs = [cfgs[r] for r in self.general]

    def contexts(self, states: Sequence[RowState] | None = None) -> list:
        hist = None if self.prev is None else [self.prev[r][self.prev[r] >= 0].tolist() for r in self.general]
        return general.contexts(self.general_cfgs, hist, [self.plen[r] for r in self.general],
                                None if states is None else [states[r] for r in self.general])

    def _legacy_args(self):
        rows = self.legacy
        prev = None if self.prev is None else self.prev[rows]
        return self.x[rows], [self.cfgs[r] for r in rows], prev, [self.plen[r] for r in rows] if prev is not None else 0

    def assemble(self, legacy_fn, general_fn, width: int | None = -1) -> Tensor:
        """legacy_fn(x, cfgs, prev, plen) on the batch path's rows and general_fn() for the others, in row order
        ([B,V] when width is -1, else [B])."""
        shape = self.x.shape if width == -1 else self.x.shape[:1]
        out = torch.empty(shape, dtype=torch.float32, device=self.x.device)
        if self.legacy:
            out[self.legacy] = legacy_fn(*self._legacy_args())
        out[self.general] = general_fn()
        return out

    def draw(self, generator, step, states, legacy_fn) -> tuple[Tensor, Tensor]:
        """(ids [B], processed logprobs [B]) over both paths; the batch path's rows drawn first."""
        batch = self.x.shape[0]
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if states is not None and len(states) != batch:
            raise ValueError(f"state must hold one RowState per row ({batch}), got {len(states)}")
        steps = as_row_ints(step, batch, "step", torch.device("cpu")).tolist()
        ids = torch.empty(batch, dtype=torch.long, device=self.x.device)
        lp = torch.zeros(batch, dtype=torch.float32, device=self.x.device)
        if self.legacy:
            x, cfgs, prev, plen = self._legacy_args()
            got = legacy_fn(x, cfgs, generator, prev, plen, [steps[r] for r in self.legacy],
                            state=None if states is None else [states[r] for r in self.legacy])
            if isinstance(got, tuple):
                ids[self.legacy], lp[self.legacy] = got
            else:
                ids[self.legacy] = got
        g_ids, g_lp = general.draw_rows(self.general_x, self.general_cfgs, self.contexts(states),
                                        [steps[r] for r in self.general], generator)
        ids[self.general], lp[self.general] = g_ids, g_lp
        return ids, lp


def _split(logits: Tensor, config: ConfigArg, prev_tokens: Any, prompt_len: Any, vocab: Vocab | None) -> _Split | None:
    """None when every row takes the batch path (today's settings in lmhead's order: the code above, unchanged);
    else the batch split by path. A sharded vocabulary runs the batch path only: a row whose steps need the
    general path is a ValueError naming them."""
    x, one_row = check_logits(logits)
    batch = x.shape[0]
    configs = config_arg(config, batch)
    if isinstance(configs, SamplingConfig):
        if _batch_ok(configs):
            return None
        configs = [configs] * batch
    elif all(_batch_ok(c) for c in configs):
        return None
    if vocab is not None and (type(vocab) is not Vocab or vocab.start or vocab.size != x.shape[1]):
        bad = sorted({s.name for c in configs for s in c.steps() if "sharded" not in s.backends})
        raise ValueError(f"{', '.join(bad) or 'samplers / mirostat'}: not run over a sharded vocabulary "
                         "(steps without the 'sharded' backend, or an order other than lmhead's)")
    prev = None if prev_tokens is None else as_prev_tokens(prev_tokens, batch, x.shape[1], x.device, one_row)
    plen = as_row_ints(prompt_len, batch, "prompt_len", torch.device("cpu")).tolist()
    for c in {id(c): c for c in configs}.values():  # rows that share a config: checked once
        for name, top in once_per("top_ids", c, _top_ids, 4096):
            if top >= x.shape[1]:
                raise ValueError(f"{name}: token id {top} is outside the vocabulary [0, {x.shape[1]})")
    return _Split(x, one_row, configs, prev, plen)

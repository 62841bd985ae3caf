"""Steps 1-2 of the pipeline: logit bias and bans, then the penalties, on [B,V_r] logits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from lmhead.sampling.config import PENALTY_LIMIT, REPETITION_PENALTY_RANGE, ConfigArg, SamplingConfig, config_arg
from lmhead.sampling.inputs import (
    as_prev_tokens,
    as_row_floats,
    as_row_ints,
    check_logits,
    check_values,
)
from lmhead.sampling.steps.base import RowState
from lmhead.sampling.steps.masks import apply_bias_, bias_index
from lmhead.sampling.steps.penalties import PenaltyCounts, penalize_, penalize_from_records_
from lmhead.sampling.vocab import Vocab


def apply_logit_bias(logits: Tensor, logit_bias: Mapping[int, float] | None = None,
                     banned_tokens: Sequence[int] = ()) -> Tensor:
    """Step 1 on [B,V] logits → new [B,V] float32: add ``logit_bias[id]`` to every row (-inf bans), then set
    ``banned_tokens`` to -inf. Ids must be in [0, V)."""
    x, one_row = check_logits(logits)
    cfg = SamplingConfig(logit_bias=logit_bias, banned_tokens=tuple(banned_tokens))
    x = x.clone()
    apply_bias_(x, *bias_index(cfg, x.shape[0], x.shape[1], x.device))
    check_values(x)
    return x[0] if one_row else x


def apply_penalties(logits: Tensor, prev_tokens: Tensor | Sequence[Sequence[int]] | None,
                    repetition_penalty: float | Sequence[float] = 1.0,
                    presence_penalty: float | Sequence[float] = 0.0,
                    frequency_penalty: float | Sequence[float] = 0.0,
                    prompt_len: int | Sequence[int] = 0) -> Tensor:
    """Step 2 on [B,V] logits → new [B,V] float32.

    ``prev_tokens`` is the sequence so far per row ([B,L] LongTensor, -1 = padding, or a list of lists),
    prompt first; the first ``prompt_len`` tokens of a row (padding not counted) are its prompt.
    Repetition (CTRL/HF): each token seen in the prompt or the generated tokens, once: logit > 0 → logit / r,
    else logit · r. Then frequency / presence (OpenAI), over the generated tokens only:
    logit − count·frequency − (count > 0)·presence. Each penalty is a number or one per row.
    """
    x, one_row = check_logits(logits)
    x = x.clone()
    batch, vocab = x.shape
    dev = x.device
    low, high = REPETITION_PENALTY_RANGE
    rep = as_row_floats(repetition_penalty, batch, "repetition_penalty", dev,
                         lambda t: (t >= low) & (t <= high), f"in [{low:g}, {high:g}]")
    pres, freq = (as_row_floats(value, batch, name, dev, lambda t: t.abs() <= PENALTY_LIMIT,
                                 f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
                  for name, value in (("presence_penalty", presence_penalty),
                                      ("frequency_penalty", frequency_penalty)))
    if prev_tokens is not None:
        prev = as_prev_tokens(prev_tokens, batch, vocab, dev, one_row)
        penalize_(x, prev, as_row_ints(prompt_len, batch, "prompt_len", dev), rep, pres, freq)
    check_values(x)
    return x[0] if one_row else x


def preprocess_rows(logits: Tensor, config: ConfigArg, prev_tokens: object, prompt_len: object,
                vocab: Vocab | None = None, states: Sequence[RowState] | None = None):
    """Validate, upcast to float32 and apply steps 1-2. Returns (x [B,V_r], configs, one_row, vocab).

    ``vocab`` says which columns of the vocabulary the logits hold (None: all of it, in this process); steps
    1-2 are per token, so a shard applies them to its own columns. x is the caller's tensor itself (not a
    copy) when nothing needs changing: callers never write into it. ``states`` (one RowState per row, the whole
    vocabulary): the penalties apply from each row's record of its tokens (``PenaltyCounts``, moved by ``accept``;
    made from prev_tokens where it does not match them), else from prev_tokens themselves (``penalize_``)."""
    x, one_row = check_logits(logits)
    batch, width = x.shape
    if vocab is None:
        vocab = Vocab(width)
    elif not 0 <= vocab.start <= vocab.start + width <= vocab.size:
        raise ValueError(f"logits hold columns [{vocab.start}, {vocab.start + width}) of a vocabulary of "
                         f"{vocab.size}")
    configs = config_arg(config, batch)
    cfgs = [configs] if isinstance(configs, SamplingConfig) else configs
    has_bias = any(c.logit_bias or c.banned_tokens for c in cfgs)
    has_pen = prev_tokens is not None and any(c.has_penalties for c in cfgs)
    if prev_tokens is not None:  # always validated, even when no penalty uses it
        prev = as_prev_tokens(prev_tokens, batch, vocab.size, x.device, one_row)
        plen = as_row_ints(prompt_len, batch, "prompt_len", x.device)
    if not (has_bias or has_pen):
        return x, configs, one_row, vocab
    x = x.clone() if x.data_ptr() == logits.data_ptr() else x
    if has_bias:
        apply_bias_(x, *bias_index(configs, batch, vocab.size, x.device, vocab.start, width))
    if has_pen and states is not None and vocab.start == 0 and width == vocab.size and type(vocab) is Vocab:
        _penalize_from_states(x, [configs] * batch if isinstance(configs, SamplingConfig) else configs, prev,
                              plen.tolist(), states)
    elif has_pen:
        if isinstance(configs, SamplingConfig):
            per_row = lambda name: torch.full((batch,), getattr(configs, name), device=x.device)
        else:
            per_row = lambda name: torch.tensor([getattr(c, name) for c in configs], device=x.device)
        penalize_(x, prev, plen, per_row("repetition_penalty"), per_row("presence_penalty"),
                   per_row("frequency_penalty"), vocab.start)
    return x, configs, one_row, vocab


def _penalize_from_states(x: Tensor, cfgs: list, prev: Tensor, plen: list[int], states: Sequence[RowState]) -> None:
    """The penalties in place on x [B,V] from each penalised row's record in its state: read where it matches the
    row's tokens in prev [B,L] (as many, the same last one, the same prompt: no pass over them), else made from them."""
    if len(states) != x.shape[0]:
        raise ValueError(f"state must hold one RowState per row ({x.shape[0]}), got {len(states)}")
    rows = [r for r, c in enumerate(cfgs) if c.has_penalties]
    valid = prev >= 0
    lengths = valid.sum(dim=1).tolist()
    if prev.shape[1]:
        at = torch.where(valid, torch.arange(prev.shape[1], device=prev.device), -1).amax(dim=1, keepdim=True)
        last = prev.gather(1, at.clamp_min(0)).squeeze(1).tolist()
    else:
        last = [None] * prev.shape[0]
    records = []
    for r in rows:
        record = states[r].history.get("penalties")
        if record is None or not record.ends(lengths[r], last[r] if lengths[r] else None, plen[r]):
            record = states[r].history["penalties"] = PenaltyCounts.of(prev[r][valid[r]].tolist(), plen[r])
        records.append(record)
    penalize_from_records_(x, rows, [cfgs[r] for r in rows], records)

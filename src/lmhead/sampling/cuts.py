"""Steps 3-6: temperature and the cut-offs (top-k, top-p, min-p), as pure functions and as the batch's parts."""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.checks import is_int, is_real
from lmhead.sampling.config import GREEDY_TEMPERATURE, TEMPERATURE_LIMIT, SamplingConfig
from lmhead.sampling.inputs import check_logits, check_top, check_values
from lmhead.sampling.rows import Part, sub_part
from lmhead.sampling.steps.cutoffs import min_p_rows
from lmhead.sampling.top_p import top_p_parts, top_p_sorted
from lmhead.sampling.vocab import NEG_INF, Vocab


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Step 3 on [B,V] logits → logits / temperature (float32). temperature must be in [1e-5, 1e4] here;
    greedy decoding (temperature 0) is a path of the pipeline, not a division."""
    x, one_row = check_logits(logits)
    if not is_real(temperature) or not GREEDY_TEMPERATURE <= temperature <= TEMPERATURE_LIMIT:
        raise ValueError(f"temperature must be in [{GREEDY_TEMPERATURE:g}, {TEMPERATURE_LIMIT:g}] here, got "
                         f"{temperature!r}")
    if x.numel():
        check_top(x.amax(dim=-1), "logits", float(temperature))
    x = x / float(temperature)
    return x[0] if one_row else x


def _min_p_sorted(vals: Tensor, min_p: float) -> Tensor:
    """Min-p on candidates sorted descending (position 0 is the most probable, always kept).
    As HF: probabilities of the (already cut) candidates, drop p < min_p · p_max."""
    probs = torch.softmax(vals, dim=-1)
    remove = probs < min_p * probs[:, :1]
    remove[:, 0] = False
    return vals.masked_fill(remove, NEG_INF)


def _top_k_parts(x: Tensor, temperature: float, top_k: int, vocab: Vocab,
                 top: tuple[Tensor, Tensor] | None = None) -> list[Part]:
    """The top k+1 once (``top``: already taken, ``vocab.topk(x, top_k + 1)``); rows whose k-th and (k+1)-th
    values tie (after the division by T, as HF compares) take every token ≥ the k-th, as HF's ``scores < kth``
    rule keeps them."""
    vals, idx = vocab.topk(x, top_k + 1) if top is None else top
    check_top(vals[:, 0], vocab.name, temperature)
    vals = vals / temperature  # x / T is monotone: topk of x is a topk of x / T
    tie = (vals[:, top_k - 1] == vals[:, top_k]) & torch.isfinite(vals[:, top_k - 1])
    if not bool(tie.any()):
        return [(None, vals[:, :top_k], idx[:, :top_k])]
    parts: list[Part] = []
    plain = (~tie).nonzero().squeeze(1)
    if plain.numel():
        parts.append((plain, vals[plain, :top_k], idx[plain, :top_k]))
    tied = tie.nonzero().squeeze(1)
    xt = x[tied]
    kth = vals[tied, top_k - 1 : top_k]
    count = vocab.sum(((xt / temperature) >= kth).sum(dim=-1, keepdim=True))
    v, i = vocab.topk(xt, int(count.max()))
    cut = torch.arange(v.shape[1], device=v.device) >= count
    parts.append((tied, (v / temperature).masked_fill(cut, NEG_INF), i))
    return parts


def apply_cut(x: Tensor, cfg: SamplingConfig, vocab: Vocab, top: tuple[Tensor, Tensor] | None = None,
         native: bool = True) -> list[Part]:
    """Steps 3-6 for rows that share one cut key (``top``: a top-k config's top k+1, already taken; ``native``:
    whether top-p may settle rows in C — not for a seeded draw, see `top_p_parts`)."""
    if cfg.is_greedy:
        v, i = vocab.argmax(x)
        check_top(v[:, 0], vocab.name)
        return [(None, v, i)]
    key = cfg.cut_key(vocab.size)
    temperature, top_k, top_p, min_p = key.temperature, key.top_k, key.top_p, key.min_p
    if top_k:
        parts = _top_k_parts(x, temperature, top_k, vocab, top)
        if top_p < 1.0:
            # topk's output is sorted, so tied values are adjacent: all top_p_sorted needs
            parts = [(r, top_p_sorted(v, top_p), i) for r, v, i in parts]
    elif top_p < 1.0:
        parts = top_p_parts(x, temperature, top_p, vocab, native)
    else:
        check_top(vocab.amax(x)[:, 0], vocab.name, temperature)
        xt = x / temperature
        return [(None, min_p_rows(xt, min_p, vocab) if min_p > 0 else xt, None)]
    if min_p > 0:
        parts = [(r, _min_p_sorted(v, min_p) if i is not None else min_p_rows(v, min_p, vocab), i)
                 for r, v, i in parts]
    return parts


def _groups(configs: list[SamplingConfig] | SamplingConfig, batch: int, vocab_size: int,
            device: torch.device) -> list[tuple[Tensor | None, SamplingConfig]]:
    """Rows sharing a cut key, as (rows or None for the whole batch, config)."""
    if isinstance(configs, SamplingConfig):
        return [(None, configs)]
    groups: dict[tuple, list[int]] = {}
    first: dict[tuple, SamplingConfig] = {}
    for r, c in enumerate(configs):
        key = c.cut_key(vocab_size)
        groups.setdefault(key, []).append(r)
        first.setdefault(key, c)
    return [(None if len(rows) == batch else torch.tensor(rows, device=device), first[key])
            for key, rows in groups.items()]


def cut_parts(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab):
    """Steps 3-6 over the whole batch → list of (rows, vals, idx, config), rows indexing the batch."""
    out = []
    if x.shape[0] == 0:
        return out
    for rows, cfg in _groups(configs, x.shape[0], vocab.size, x.device):
        xs = x if rows is None else x[rows]
        for sub, vals, idx in apply_cut(xs, cfg, vocab):
            out.append((rows if sub is None else sub_part(rows, sub), vals, idx, cfg))
    return out


def scatter_rows(out: Tensor, rows: Tensor | None, block: Tensor, idx: Tensor | None, fill: float,
                  vocab: Vocab) -> None:
    """Write candidates (or whole rows) into out [B,V_r] at `rows`."""
    if idx is not None:
        block = vocab.columns(block, idx, fill, out.shape[1])
    if rows is None:
        out.copy_(block)
    else:
        out[rows] = block


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Step 4 on [B,V] logits → new [B,V] float32 with every logit below the k-th largest at -inf (tokens tied
    with the k-th are kept, as HF's TopKLogitsWarper). top_k = 0 (or ≥ V) is off."""
    x, one_row = check_logits(logits)
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {top_k!r}")
    check_values(x)
    if 0 < top_k < x.shape[1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    else:
        x = x.clone()
    return x[0] if one_row else x


def apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Step 5 on [B,V] logits → new [B,V] float32: keep the most probable tokens until their mass reaches
    top_p (the crossing token kept, ties with it too, at least one token); the rest at -inf. top_p in (0, 1],
    1 = off. Avoids a full sort with a growing window (exact)."""
    x, one_row = check_logits(logits)
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if top_p >= 1.0:
        check_values(x)
        out = x.clone()
    else:
        out = torch.full_like(x, NEG_INF)
        vocab = Vocab(x.shape[1])
        for rows, vals, idx in top_p_parts(x, 1.0, float(top_p), vocab):  # T = 1: vals are the logits
            scatter_rows(out, rows, vals, idx, NEG_INF, vocab)
    return out[0] if one_row else out


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Step 6 on [B,V] logits → new [B,V] float32: tokens with p < min_p · p_max at -inf (HF's rule, the
    argmax always kept). min_p in [0, 1], 0 = off."""
    x, one_row = check_logits(logits)
    if not is_real(min_p) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
    check_values(x)
    x = min_p_rows(x, float(min_p), Vocab(x.shape[1])) if min_p > 0 else x.clone()
    return x[0] if one_row else x

"""Steps 3-6: temperature and the cut-offs (top-k, top-p, min-p), as pure functions and as the batch's parts.

A batch's rows are cut by kind (`cut_kind`: greedy, inside the top k, top-p without top-k, whole rows), not by their
settings: the rows of a kind take each pass over the vocabulary once, with their temperatures, k, p and min-p as
columns (vLLM's sampler takes its temperature[B], top_k[B], top_p[B] alike); a cut-off some rows of a kind leave off
runs on the others only."""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.checks import is_int, is_real
from lmhead.sampling.config import GREEDY_TEMPERATURE, TEMPERATURE_LIMIT, CutKey, SamplingConfig
from lmhead.sampling.inputs import check_logits, check_top, check_values
from lmhead.sampling.rows import Part, sub_part
from lmhead.sampling.steps.cutoffs import min_p_rows
from lmhead.sampling.top_p import Setting, rows_of, top_p_parts, top_p_sorted
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


def _min_p_sorted(vals: Tensor, min_p: Setting) -> Tensor:
    """Min-p on candidates sorted descending (position 0 is the most probable, always kept).
    As HF: probabilities of the (already cut) candidates, drop p < min_p · p_max."""
    probs = torch.softmax(vals, dim=-1)
    remove = probs < min_p * probs[:, :1]
    remove[:, 0] = False
    return vals.masked_fill(remove, NEG_INF)


def _top_k_parts(x: Tensor, rows: Tensor | None, temperature: Setting, top_k: int, vocab: Vocab,
                 top: tuple[Tensor, Tensor]) -> list[Part]:
    """Top-k for the rows `rows` of x (None: all) whose top k+1 `top` ([b,k+1] values and ids) is taken; rows whose
    k-th and (k+1)-th values tie (after the division by T, as HF compares) take every token ≥ the k-th, as HF's
    ``scores < kth`` rule keeps them. Parts' rows index `top`'s rows."""
    vals, idx = top
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
    xt = x[sub_part(rows, tied)]
    t = rows_of(temperature, tied)
    kth = vals[tied, top_k - 1 : top_k]
    count = vocab.sum(((xt / t) >= kth).sum(dim=-1, keepdim=True))
    v, i = vocab.topk(xt, int(count.max()))
    cut = torch.arange(v.shape[1], device=v.device) >= count
    parts.append((tied, (v / t).masked_fill(cut, NEG_INF), i))
    return parts


def top_k_tops(x: Tensor, ks: list[int], vocab: Vocab) -> tuple[Tensor, Tensor]:
    """Each row's k + 1 largest (its k of ``ks``) as [b, kmax+1] values and ids, a row's first k + 1 columns the ones it
    gets alone (the rest -inf): one partial sort of the largest k + 1 where the rows share k; else each row's own on
    a CPU row (`Vocab.topk`'s C threshold pass, which takes a few rows and small k: a row of 262,144 costs it a
    fraction of what torch.topk of the largest k over the batch costs)."""
    kmax = max(ks)
    if len(set(ks)) == 1 or x.device.type != "cpu":
        return vocab.topk(x, kmax + 1)
    vals = torch.full((x.shape[0], kmax + 1), NEG_INF, dtype=x.dtype, device=x.device)
    ids = torch.zeros((x.shape[0], kmax + 1), dtype=torch.long, device=x.device)
    for r, k in enumerate(ks):
        vals[r, :k + 1], ids[r, :k + 1] = vocab.topk(x[r:r + 1], k + 1)
    return vals, ids


def _column(keys: list[CutKey], name: str, rows: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cut setting of each row (of `rows`; None: all) as a column [b,1]: temperature float32 (it divides float32
    logits), top-p float64 (it meets float64 masses), min-p float32."""
    values = [getattr(k, name) for k in keys] if rows is None else [getattr(keys[r], name) for r in rows.tolist()]
    return torch.tensor(values, dtype=dtype, device=device)[:, None]


def _where_on(parts: list[Part], keys: list[CutKey], on, step) -> list[Part]:
    """`step(vals, rows, whole)` on each part's rows for which on(key) holds (whole: vals are whole rows), the other
    rows' values left as they are."""
    out = []
    for rows, vals, idx in parts:
        mine = list(range(vals.shape[0])) if rows is None else rows.tolist()
        pick = [j for j, r in enumerate(mine) if on(keys[r])]
        if len(pick) == len(mine):
            vals = step(vals, rows, idx is None)
        elif pick:
            p = torch.tensor(pick, device=vals.device)
            vals = vals.clone()
            vals[p] = step(vals[p], sub_part(rows, p), idx is None)
        out.append((rows, vals, idx))
    return out


def apply_cut(x: Tensor, cfgs: list[SamplingConfig], vocab: Vocab, top: tuple[Tensor, Tensor] | None = None,
              native: bool = True) -> list[Part]:
    """Steps 3-6 for rows x [b,V_r] whose cuts are of one kind (`cut_kind`), each row's settings its own: the passes
    over V once for them all, with the settings as columns [b,1] (``top``: the rows' top kmax+1, kmax their largest
    top-k, already taken; ``native``: whether top-p may settle rows in C — not for a seeded draw, see `top_p_parts`).
    Each row's values are the bits it gets alone: the candidates of rows with one k are cut together."""
    if cfgs[0].is_greedy:
        v, i = vocab.argmax(x)
        check_top(v[:, 0], vocab.name)
        return [(None, v, i)]
    keys = [c.cut_key(vocab.size) for c in cfgs]
    dev = x.device
    temperature = _column(keys, "temperature", None, torch.float32, dev)
    if keys[0].top_k:
        top = top_k_tops(x, [k.top_k for k in keys], vocab) if top is None else top
        by_k: dict[int, list[int]] = {}
        for r, k in enumerate(keys):
            by_k.setdefault(k.top_k, []).append(r)
        parts = []
        for k, rows in by_k.items():
            index = None if len(rows) == len(keys) else torch.tensor(rows, device=dev)
            mine = (top[0][:, :k + 1], top[1][:, :k + 1]) if index is None else (top[0][index, :k + 1],
                                                                                  top[1][index, :k + 1])
            parts += [(index if r is None else sub_part(index, r), v, i) for r, v, i in
                      _top_k_parts(x, index, rows_of(temperature, index) if index is not None else temperature, k,
                                   vocab, mine)]
        # topk's output is sorted, so tied values are adjacent: all top_p_sorted needs
        parts = _where_on(parts, keys, lambda k: k.top_p < 1.0, lambda v, rows, whole: top_p_sorted(
            v, _column(keys, "top_p", rows, torch.float64, dev)))
    elif keys[0].top_p < 1.0:
        parts = top_p_parts(x, temperature, _column(keys, "top_p", None, torch.float64, dev), vocab, native)
    else:
        check_top(vocab.amax(x)[:, 0], vocab.name, temperature)
        parts = [(None, x / temperature, None)]
    return _where_on(parts, keys, lambda k: k.min_p > 0, lambda v, rows, whole: (
        min_p_rows(v, _column(keys, "min_p", rows, torch.float32, dev), vocab) if whole
        else _min_p_sorted(v, _column(keys, "min_p", rows, torch.float32, dev))))


def cut_kind(cfg: SamplingConfig, vocab_size: int, draw: bool = False) -> str:
    """The kind of a row's cut, which rows run together: "greedy", "top_k" (the cut inside the top k, then top-p and
    min-p), "top_p" (top-p without top-k, then min-p; with ``draw``, "top_p_alone" for rows without min-p either,
    which `sample` draws by rejection without the top-p set) or "whole" (min-p alone or no cut-off)."""
    key = cfg.cut_key(vocab_size)
    if key.mode == "greedy":
        return "greedy"
    if key.top_k:
        return "top_k"
    if key.top_p < 1.0:
        return "top_p_alone" if draw and not key.min_p else "top_p"
    return "whole"


def _groups(configs: list[SamplingConfig] | SamplingConfig, batch: int, vocab_size: int,
            device: torch.device) -> list[tuple[Tensor | None, list[SamplingConfig]]]:
    """Rows whose cuts are of one kind, as (rows or None for the whole batch, their configs)."""
    if isinstance(configs, SamplingConfig):
        return [(None, [configs] * batch)]
    groups: dict[str, list[int]] = {}
    for r, c in enumerate(configs):
        groups.setdefault(cut_kind(c, vocab_size), []).append(r)
    return [(None if len(rows) == batch else torch.tensor(rows, device=device), [configs[r] for r in rows])
            for rows in groups.values()]


def cut_parts(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab):
    """Steps 3-6 over the whole batch → list of (rows, vals, idx, configs of the group), rows indexing the batch."""
    out = []
    if x.shape[0] == 0:
        return out
    for rows, cfgs in _groups(configs, x.shape[0], vocab.size, x.device):
        xs = x if rows is None else x[rows]
        for sub, vals, idx in apply_cut(xs, cfgs, vocab):
            out.append((rows if sub is None else sub_part(rows, sub), vals, idx, cfgs))
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

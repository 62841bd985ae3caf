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


def min_p_sorted(vals: Tensor, min_p: Setting) -> Tensor:
    """Min-p on candidates sorted descending (position 0 is the most probable, always kept).
    As HF: probabilities of the (already cut) candidates, drop p < min_p · p_max."""
    probs = torch.softmax(vals, dim=-1)
    remove = probs < min_p * probs[:, :1]
    remove[:, 0] = False
    return vals.masked_fill(remove, NEG_INF)


def _top_k_parts(x: Tensor, temperature: Setting, ks: list[int], vocab: Vocab,
                 top: tuple[Tensor, Tensor], pad: bool = False, at: list[int] | None = None) -> list[Part]:
    """Top-k for rows x [b,V_r], row r keeping its ks[r] largest, whose top k+1 `top` ([b, ≥ max k + 1] values and
    ids, a row's first k + 1 its own) is taken: one part per k (``pad``: one part for all, each row's candidates past
    its k at -inf — a softmax over a row padded so rounds otherwise than over the row alone, so only for unseeded
    draws, whose ids depend on the batch anyway). A row whose k-th and (k+1)-th values tie (after the division by T,
    as HF compares) takes every token ≥ the k-th, as HF's ``scores < kth`` rule keeps them: a part of its own, as
    wide as it keeps. ``at``: the rows of x the settings are (None: x's rows in order); x is read only there."""
    vals, idx = top
    check_top(vals[:, 0], vocab.name, temperature)
    vals = vals / temperature  # x / T is monotone: topk of x is a topk of x / T
    if len(set(ks)) == 1:
        edge = vals[:, ks[0] - 1 : ks[0] + 1]
    else:
        edge = vals.gather(1, torch.tensor([[k - 1, k] for k in ks], device=x.device))
    tie = (edge[:, 0] == edge[:, 1]) & torch.isfinite(edge[:, 0])
    if not bool(tie.any()) and len(set(ks)) == 1:
        return [(None, vals[:, :ks[0]], idx[:, :ks[0]])]
    tie = tie.tolist()
    by_k: dict[int, list[int]] = {}
    for r, k in enumerate(ks):
        if not tie[r]:
            by_k.setdefault(k, []).append(r)
    parts: list[Part] = []
    if pad and len(by_k) > 1:
        plain = [r for r in range(len(ks)) if not tie[r]]
        width = max(ks[r] for r in plain)
        index = None if len(plain) == len(ks) else torch.tensor(plain, device=x.device)
        past = torch.arange(width, device=x.device) >= torch.tensor([[ks[r]] for r in plain], device=x.device)
        v, i = (vals[:, :width], idx[:, :width]) if index is None else (vals[index, :width], idx[index, :width])
        parts.append((index, v.masked_fill(past, NEG_INF), i))
        by_k = {}
    for k, rows in by_k.items():
        if len(rows) == len(ks):
            parts.append((None, vals[:, :k], idx[:, :k]))
        else:
            index = torch.tensor(rows, device=x.device)
            parts.append((index, vals[index, :k], idx[index, :k]))
    for r in (r for r, t in enumerate(tie) if t):
        t = rows_of(temperature, torch.tensor([r], device=x.device))
        kth = vals[r:r + 1, ks[r] - 1 : ks[r]]
        row = x[r:r + 1] if at is None else x[at[r]:at[r] + 1]
        count = vocab.sum(((row / t) >= kth).sum(dim=-1, keepdim=True))
        v, i = vocab.topk(row, int(count.max()))
        parts.append((torch.tensor([r], device=x.device), v / t, i))
    return parts


def top_k_tops(x: Tensor, ks: list[int], vocab: Vocab, rows: list[int] | None = None) -> tuple[Tensor, Tensor]:
    """Each row's k + 1 largest (its k of ``ks``; ``rows``: those rows of x [B,V_r], read where they lie) as
    [len(ks), kmax+1] values and ids, a row's first k + 1 columns the ones it gets alone (the rest -inf): one partial
    sort of the largest k + 1 where the rows share k; else, on CPU rows, each row's own threshold pass and one sort
    of all rows' candidates (`Vocab.topk_rows`: a row of 262,144 costs its pass a fraction of what torch.topk of the
    largest k over the batch costs)."""
    if len(set(ks)) == 1 or x.device.type != "cpu":
        return vocab.topk(x if rows is None else take_rows(x, rows), max(ks) + 1)
    return vocab.topk_rows(x, [k + 1 for k in ks], rows)


def take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """x's rows `rows` (in that order) as a [len(rows), V_r] tensor: a view where they lie side by side in order,
    else a copy."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return x[rows[0]:rows[-1] + 1]
    return x.index_select(0, torch.tensor(rows, device=x.device))


def column(keys: list[CutKey], name: str, rows: Tensor | None, dtype: torch.dtype, device: torch.device) -> Setting:
    """A cut setting of each row (of `rows`; None: all) as a column [b,1]: temperature float32 (it divides float32
    logits), top-p float64 (it meets float64 masses), min-p float32; the number itself where the rows share it."""
    values = [getattr(k, name) for k in keys] if rows is None else [getattr(keys[r], name) for r in rows.tolist()]
    if values.count(values[0]) == len(values):
        return values[0]
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
              native: bool = True, pad: bool = False, at: list[int] | None = None) -> list[Part]:
    """Steps 3-6 for rows x [b,V_r] whose cuts are of one kind (`cut_kind`), each row's settings its own: the passes
    over V once for them all, with the settings as columns [b,1] (``top``: the rows' top kmax+1, kmax their largest
    top-k, already taken; ``native``: whether top-p may settle rows in C — the same kept tokens either way).
    Each row's values are the bits it gets alone: the candidates of rows with one k are cut together (a row whose
    k-th value ties, alone) — but with ``pad`` (an unseeded draw) those of every k at once, padded. ``at``: the rows
    of x [B,V_r] the settings are (None: x's rows in order): rows cut inside their top k read x only where a k-th
    value ties, the others take their rows first."""
    if at is not None and not (cfgs[0].cut_key(vocab.size).top_k and top is not None):
        x, at = take_rows(x, at), None
    if cfgs[0].is_greedy:
        v, i = vocab.argmax(x)
        check_top(v[:, 0], vocab.name)
        return [(None, v, i)]
    keys = [c.cut_key(vocab.size) for c in cfgs]
    dev = x.device
    temperature = column(keys, "temperature", None, torch.float32, dev)
    if keys[0].top_k:
        ks = [k.top_k for k in keys]
        parts = _top_k_parts(x, temperature, ks, vocab, top_k_tops(x, ks, vocab) if top is None else top, pad, at)
        # topk's output is sorted, so tied values are adjacent: all top_p_sorted needs
        parts = _where_on(parts, keys, lambda k: k.top_p < 1.0, lambda v, rows, whole: top_p_sorted(
            v, column(keys, "top_p", rows, torch.float64, dev)))
    elif keys[0].top_p < 1.0:
        parts = top_p_parts(x, temperature, column(keys, "top_p", None, torch.float64, dev), vocab, native)
    else:
        check_top(vocab.amax(x)[:, 0], vocab.name, temperature)
        parts = [(None, x / temperature, None)]
    return _where_on(parts, keys, lambda k: k.min_p > 0, lambda v, rows, whole: (
        min_p_rows(v, column(keys, "min_p", rows, torch.float32, dev), vocab) if whole
        else min_p_sorted(v, column(keys, "min_p", rows, torch.float32, dev))))


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


def _groups(configs: list[SamplingConfig] | SamplingConfig, batch: int, vocab_size: int) -> list[list[int]]:
    """The rows whose cuts are of one kind, in the order the kinds first appear."""
    if isinstance(configs, SamplingConfig):
        return [list(range(batch))]
    groups: dict[str, list[int]] = {}
    for r, c in enumerate(configs):
        groups.setdefault(cut_kind(c, vocab_size), []).append(r)
    return list(groups.values())


# rows apart in the batch are copied together (one pass for them all) where each holds at most _GATHER_WIDTH logits
# and all of them at most _GATHER_MAX (4 MiB: a screened round's candidates, rows of 49,152): there the separate
# passes' calls cost more than the copy; rows of 262,144 cost more to copy (~1 ms for four) than their separate
# passes, each bound by the row's bytes, save
_GATHER_WIDTH = 1 << 16
_GATHER_MAX = 1 << 20


def runs(rows: list[int], width: int) -> list[list[int]]:
    """The rows of a group as the pieces its passes read: all of them where they lie side by side (a view) or are
    narrow (copied together, one pass for them all); else each run of rows side by side, read in place."""
    if rows[-1] - rows[0] == len(rows) - 1 or (width <= _GATHER_WIDTH and len(rows) * width <= _GATHER_MAX):
        return [rows]
    out = [[rows[0]]]
    for r in rows[1:]:
        if r == out[-1][-1] + 1:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def cut_parts(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab):
    """Steps 3-6 over the whole batch → list of (rows, vals, idx, None), rows indexing the batch (None: all)."""
    out = []
    if x.shape[0] == 0:
        return out
    batch = x.shape[0]
    for group in _groups(configs, batch, vocab.size):
        for run in runs(group, x.shape[1]):
            whole = len(run) == batch
            rows = None if whole else torch.tensor(run, device=x.device)
            xs = x if whole else x[run[0]:run[-1] + 1] if run[-1] - run[0] == len(run) - 1 else x[rows]
            for sub, vals, idx in apply_cut(xs, [configs] * len(run) if isinstance(configs, SamplingConfig)
                                            else [configs[r] for r in run], vocab):
                out.append((rows if sub is None else sub_part(rows, sub), vals, idx, None))
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

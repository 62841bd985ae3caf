"""Step 8 over a batch: rows grouped by the kind of their cut (each row's settings its own), seeded rows drawn with
their own (seed, step) noise; and one seeded top-p or top-k row's draw without the pipeline around it
(`seeded_row`)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from lmhead.sampling.config import SamplingConfig
from lmhead.sampling.cuts import apply_cut, column, cut_kind, min_p_sorted, runs, take_rows, top_k_tops
from lmhead.sampling.race import draw_part, kept_candidates, part_logprobs, race_row_in_c, seeded_generator
from lmhead.sampling.top_p import top_p_draw_unseeded, top_p_sorted
from lmhead.sampling.vocab import Vocab


def _draw_group(x: Tensor, cfgs: list[SamplingConfig], generator: torch.Generator | None, vocab: Vocab,
                top: tuple[Tensor, Tensor] | None = None, scored: bool = False,
                at: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """Steps 3-8 for rows [b,V_r] whose cuts are of one drawing kind (`cut_kind(draw=True)`), all seeded or none →
    ([b] global ids, with ``scored`` their processed log-probabilities [b] from the same cut, else None). ``at``: the
    rows of x [B,V_r] the settings are (None: x's rows)."""
    first = cfgs[0]
    seeded = first.seed is not None and not first.is_greedy
    kind = cut_kind(first, vocab.size, draw=True)
    if at is not None and top is None:
        x, at = take_rows(x, at), None
    # unseeded top-p alone draws from the set C finds at once, or by rejection without the top-p set — unless the
    # set is wanted anyway for the logprob
    if kind == "top_p_alone" and not scored and not seeded:
        keys = [c.cut_key(vocab.size) for c in cfgs]
        temperature = column(keys, "temperature", None, torch.float32, x.device)
        top_p = column(keys, "top_p", None, torch.float64, x.device)
        return top_p_draw_unseeded(x, temperature, top_p, generator, vocab), None
    ids = torch.empty(len(cfgs), dtype=torch.long, device=x.device)
    lp = torch.empty(len(cfgs), dtype=torch.float32, device=x.device) if scored else None
    # an unseeded draw's ids depend on the batch (the generator's stream) anyway: its rows' candidates are cut at
    # once; a seeded row (drawn alone) races over its kept tokens, whichever of the cut's paths found them — a top-p
    # set kept as a whole row (the histogram's) as its tokens too, so that its id is the one C's set or a window's
    # gives
    for sub, vals, idx in apply_cut(x, cfgs, vocab, top, pad=not seeded, at=at):
        if seeded and idx is None and kind in ("top_p", "top_p_alone"):
            vals, idx = kept_candidates(vals, vocab)
        chosen = idx[:, 0] if first.is_greedy else draw_part(vals, idx, seeded, generator, vocab)
        for out, got in ((ids, chosen), (lp, part_logprobs(vals, idx, chosen, vocab) if scored else None)):
            if out is None:
                continue
            if sub is None:
                out.copy_(got)
            else:
                out[sub] = got
    return ids, lp


def _draw_seeded_top_k(x: Tensor, cfgs: list[SamplingConfig], gens: list[torch.Generator], vocab: Vocab,
                       scored: bool, top: tuple[Tensor, Tensor], at: list[int]) -> tuple[Tensor, Tensor | None]:
    """Seeded rows `at` of x [B,V_r] cut inside their top k (each its own k, their top k + 1 `top` taken), each with
    its own (seed, step) generator → ([b] ids, [b] logprobs or None): the ids `_draw_group` gives each row alone. The
    cut, the softmax and the race work row by row, and each row's noise comes from its own generator over its k
    candidates in id order, so the rows of one k draw in one pass; rows whose cut keeps more than k (a tie at the
    k-th value: a width of their own) draw alone."""
    ks = [c.cut_key(vocab.size).top_k for c in cfgs]
    ids = torch.empty(len(cfgs), dtype=torch.long, device=x.device)
    lp = torch.empty(len(cfgs), dtype=torch.float32, device=x.device) if scored else None
    for sub, vals, idx in apply_cut(x, cfgs, vocab, top, native=False, at=at):
        rows = list(range(len(cfgs))) if sub is None else sub.tolist()
        k = ks[rows[0]]
        if vals.shape[1] != k:
            for r in rows:
                one = (top[0][r:r + 1, :k + 1], top[1][r:r + 1, :k + 1])
                got = _draw_group(x, [cfgs[r]], gens[r], vocab, one, scored, at=[at[r]])
                ids[r] = got[0][0]
                if scored:
                    lp[r] = got[1][0]
            continue
        chosen = draw_part(vals, idx, True, [gens[r] for r in rows], vocab)
        index = slice(None) if sub is None else sub
        ids[index] = chosen
        if scored:
            lp[index] = part_logprobs(vals, idx, chosen, vocab)
    return ids, lp


def draw_groups(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, generator: torch.Generator | None,
                 steps: list[int] | None, vocab: Vocab, scored: bool) -> tuple[Tensor, Tensor | None]:
    """Steps 3-8 over the batch → ([B] ids, [B] processed logprobs of them or None). Rows whose cuts are of one
    kind are cut together, whatever their settings; a seeded row draws with its own (seed, step) noise — seeded rows
    cut inside their top k share one partial sort and the rows of one k draw in one pass (`_draw_seeded_top_k`:
    each row's top k+1 is the same whether sorted alone or beside others, and a seeded draw orders its candidates by
    id), so the ids do not depend on the batch."""
    batch = x.shape[0]
    cfgs = [configs] * batch if isinstance(configs, SamplingConfig) else configs
    ids = torch.empty(batch, dtype=torch.long, device=x.device)
    lp = torch.empty(batch, dtype=torch.float32, device=x.device) if scored else None
    groups: dict[tuple, list[int]] = {}
    for r, c in enumerate(cfgs):
        groups.setdefault((cut_kind(c, vocab.size, draw=True), c.seed is not None and not c.is_greedy), []).append(r)

    def put(rows: list[int], got: tuple[Tensor, Tensor | None]) -> None:
        index = (slice(None) if len(rows) == batch else slice(rows[0], rows[0] + 1) if len(rows) == 1
                 else torch.tensor(rows, device=x.device))
        ids[index] = got[0]
        if scored:
            lp[index] = got[1]

    # every row cut inside its top k (seeded or not) takes its top k + 1 in one call, its row read where it lies
    top_k_rows = [r for (kind, _), rows in groups.items() if kind == "top_k" for r in rows]
    if top_k_rows:
        tops = top_k_tops(x, [cfgs[r].cut_key(vocab.size).top_k for r in top_k_rows], vocab, top_k_rows)
        where = {r: j for j, r in enumerate(top_k_rows)}
    for (kind, seeded), rows in groups.items():
        mine = [cfgs[r] for r in rows]
        if kind == "top_k":
            sel = torch.tensor([where[r] for r in rows], device=x.device)
            top = (tops[0].index_select(0, sel), tops[1].index_select(0, sel))
            if seeded:
                gens = [seeded_generator(cfgs[r].seed, steps[r], x.device) for r in rows]
                put(rows, _draw_seeded_top_k(x, mine, gens, vocab, scored, top, rows))
            else:
                put(rows, _draw_group(x, mine, generator, vocab, top, scored, at=rows))
        elif seeded:  # top-p, min-p or no cut: each row's own draw, its row read where it lies
            for r in rows:
                put([r], _draw_group(x[r:r + 1], [cfgs[r]], seeded_generator(cfgs[r].seed, steps[r], x.device),
                                     vocab, scored=scored))
        else:
            for run in runs(rows, x.shape[1]):
                put(run, _draw_group(take_rows(x, run), [cfgs[r] for r in run], generator, vocab, scored=scored))
    return ids, lp


def seeded_top_p_row(x: Tensor, config: SamplingConfig, step: int) -> tuple[int, float] | None:
    """One seeded row of logits x [V] (float32, CPU) whose config runs top-p alone (temperature and top-p, no
    top-k, min-p, bias, penalties or masks) → (id, its processed log-probability): `sample_with_logprobs`' answer
    for that row at `step`, bit for bit, in a few calls where the pipeline's generic passes take ~40 torch
    operations. The same path as `_draw_group`'s: the top-p set C settles (`native.top_p_row`, `top_p_parts`'
    first path), its candidates raced in id order with the (seed, step) generator's noise (`draw_part`'s C race;
    every candidate is kept), the logprob from the same set (`part_logprobs`). None where C does not settle the set
    (a flat row, a value that is not finite, no library) or the config is not such a row: the pipeline then
    answers, and raises its errors."""
    from lmhead.kernels.native import top_p_row

    if (config.seed is None or not config.runs_on("c")
            or cut_kind(config, x.shape[-1], draw=True) != "top_p_alone"):
        return None
    key = config.cut_key(x.shape[-1])
    found = top_p_row(x, key.temperature, key.top_p)
    if found is None:
        return None
    vals, idx = found                                             # [1,m] x/T descending, their ids
    return _raced(vals, idx, vals.shape[1], config, step)



def seeded_top_k_row(x: Tensor, config: SamplingConfig, step: int) -> tuple[int, float] | None:
    """One seeded row of logits x [V] (float32, CPU) whose config cuts inside its top k (temperature and top-k, with
    top-p and min-p over the k or not; no bias, penalties or masks) → (id, its processed log-probability):
    `sample_with_logprobs`' answer for that row at `step`, bit for bit, from the pieces `_draw_seeded_top_k` runs on
    it — the row's top k + 1 over T (`native.top_k_row`: torch.topk's values, one C pass), `top_p_sorted` and
    `min_p_sorted` over the first k, the race in id order with the (seed, step) generator's noise, the logprob from
    the same candidates — without the batch's grouping and its checks around them. None where the k-th and
    (k+1)-th values over T tie (the cut keeps a width of its own), C does not serve the row (a NaN, a value +inf
    over T, no library) or the config is not such a row: the pipeline then answers, and raises its errors."""
    from lmhead.kernels.native import top_k_row

    if config.seed is None or not config.runs_on("c") or cut_kind(config, x.shape[-1], draw=True) != "top_k":
        return None
    key = config.cut_key(x.shape[-1])
    found = top_k_row(x, key.temperature, key.top_k + 1)
    if found is None or found[0][0, key.top_k - 1] == found[0][0, key.top_k]:
        return None
    vals, idx = found[0][:, :key.top_k], found[1][:, :key.top_k]   # [1,k] x/T descending, their ids
    if key.top_p < 1.0:
        vals = top_p_sorted(vals, key.top_p)
    if key.min_p > 0:
        vals = min_p_sorted(vals, key.min_p)
    return _raced(vals.contiguous(), idx.contiguous(), int(torch.isfinite(vals).sum()), config, step)


def _raced(vals: Tensor, idx: Tensor, kept: int, config: SamplingConfig, step: int) -> tuple[int, float]:
    """A seeded row's candidates vals [1,m] (x/T, -inf where the cut dropped one; contiguous) and ids [1,m], `kept`
    of them finite → (the id the race in id order with the (seed, step) generator's noise picks, its processed
    logprob over the same candidates: `part_logprobs`' normaliser and float32 difference)."""
    at = race_row_in_c(vals[0], idx[0], kept, seeded_generator(config.seed, step))
    lse = torch.logsumexp(vals, dim=-1)
    return int(idx[0, at]), float(np.float32(vals[0, at].item()) - np.float32(lse[0].item()))


def seeded_row(x: Tensor, config: SamplingConfig, step: int) -> tuple[int, float] | None:
    """`seeded_top_p_row` or `seeded_top_k_row`, by the row's cut: the pipeline's (id, logprob) for one seeded row
    of logits x [V], or None where neither serves it."""
    kind = cut_kind(config, x.shape[-1], draw=True)
    if kind == "top_p_alone":
        return seeded_top_p_row(x, config, step)
    return seeded_top_k_row(x, config, step) if kind == "top_k" else None

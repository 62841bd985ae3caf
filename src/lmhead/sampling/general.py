"""The declared chain over a batch, for rows the batch path does not serve: any step without the "batch" backend
(typical-p, DRY, mirostat, ...), or an order other than lmhead's.

Rows that share an order (lmhead's, a preset, a list of step names, mirostat's) run its steps in turn, each step once
over the rows that run it: its ``Step.rows`` with the rows' parameters as tensors [n,1], or its exact ``apply`` on each
of them where its backend is a pass per row (the moments' C passes). A step no row runs costs nothing; a step some
rows run leaves the others as they are. A row's values are the bits its chain gives it alone. The draw is the
whole-row inverse CDF with one uniform per row (``rows.draw_whole_rows``); each row's uniform (and XTC's coin before
it) comes from its own generator in row order before the chain runs — a seeded row's (seed, step) one — so its token
depends on nothing else in the batch, and the generator's stream is the one the rows drawn one by one would read.

XTC is a coin per draw: ``sample`` throws it (probability xtc_probability) from the row's generator before the
draw; ``process_logits`` / ``probabilities`` give the distribution the draw follows, the mixture
(1 − P)·p(without) + P·p(with). Mirostat reads and, after a draw, moves the row's μ, the penalties and DRY their
records of the row's tokens (``steps.RowState``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.inputs import check_top
from lmhead.sampling.race import seeded_generator
from lmhead.sampling.rows import draw_whole_rows
from lmhead.sampling.steps import STEPS, Context, RowState, accept, chain, order_of
from lmhead.sampling.steps.base import rows_apply
from lmhead.sampling.vocab import NEG_INF, Vocab

_XTC = STEPS["xtc"]


def _orders(cfgs: list) -> list[list[int]]:
    """The rows of each order, in the order the orders first appear."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, c in enumerate(cfgs):
        groups.setdefault(order_of(c), []).append(r)
    return list(groups.values())


# rows of one order run step by step over all of them where each holds at most _JOIN_WIDTH logits and all of them at
# most _JOIN_MAX (4 MiB: they stay in the caches from one step to the next); wider, each row runs its whole chain on
# its own, while it is in the caches (one pass of a step over 16 rows of 262,144 logits costs more than its 16 passes
# over one row each, and the passes' fewer torch calls save little on rows that wide)
_JOIN_WIDTH = 1 << 16
_JOIN_MAX = 1 << 20


def _together(rows: int, width: int) -> bool:
    return width <= _JOIN_WIDTH and rows * width <= _JOIN_MAX


class _Rows:
    """A batch's rows as the chain moves them: row i is ``base[i][at[i]]``, a row of whichever tensor the step that
    last wrote it made (the input at first), so that no step's output is copied back into one [n,V] tensor."""

    def __init__(self, x: Tensor) -> None:
        self.base, self.at = [x] * x.shape[0], list(range(x.shape[0]))

    def row(self, i: int) -> Tensor:
        return self.base[i][self.at[i]:self.at[i] + 1]

    def block(self, rows: list[int]) -> Tensor | None:
        """The rows as one tensor without a copy where they lie side by side in one, else None."""
        first, at = self.base[rows[0]], self.at[rows[0]]
        if all(self.base[i] is first and self.at[i] == at + j for j, i in enumerate(rows)):
            return first[at:at + len(rows)]
        return None

    def joined(self, rows: list[int]) -> Tensor:
        """The rows as one tensor [len(rows),V]: a view where they lie side by side, else a copy."""
        block = self.block(rows)
        return block if block is not None else torch.cat([self.row(i) for i in rows])

    def put(self, rows: list[int], out: Tensor) -> None:
        for j, i in enumerate(rows):
            self.base[i], self.at[i] = out, j

    def amax(self, rows: list[int]) -> Tensor:
        """Each row's maximum [len(rows)], without joining them."""
        block = self.block(rows)
        return block.amax(dim=-1) if block is not None else torch.cat([self.row(i).amax(dim=-1) for i in rows])


def _step_rows(s: Any, xs: _Rows, on: list[int], cfgs: list, ctxs: list[Context]) -> None:
    """Step `s` on the rows `on`: once over them (``Step.rows``), as one tensor (a view where they lie side by side,
    else a copy), else (a step without ``rows``) its ``apply`` on each row where it lies."""
    if s.rows is not None and len(on) > 1:
        block = xs.joined(on)
        xs.put(on, s.rows(block, [cfgs[i] for i in on], [ctxs[i] for i in on]))
        return
    for i in on:
        xs.put([i], rows_apply(s, xs.row(i), [cfgs[i]], [ctxs[i]]))


def _run_order(xs: _Rows, members: list[int], cfgs: list, ctxs: list[Context], name: str) -> None:
    """The rows `members` of xs, of one order, through it, each step once over the rows that run it (in xs)."""
    runs = {i: {s.name for s in chain(cfgs[i])} for i in members}  # names: a Step compares field by field
    checked = False
    for step_name in order_of(cfgs[members[0]]):
        s = STEPS[step_name]
        if s.stage > 1 and not checked:
            checked = True
            check_top(xs.amax(members), name)  # an all -inf row after the masks: no token can be chosen
        on = [i for i in members if step_name in runs[i]]
        if on:
            _step_rows(s, xs, on, cfgs, ctxs)
    if not checked:
        check_top(xs.amax(members), name)
    sampled = [i for i in members if not cfgs[i].is_greedy]
    if sampled:  # NaN or +inf a step made (a temperature near 0 on huge logits)
        check_top(xs.amax(sampled), name)
    for i in members:
        if cfgs[i].is_greedy:  # the argmax alone (the first one on ties)
            vals = xs.row(i)
            top = vals.argmax(dim=-1, keepdim=True)
            xs.put([i], torch.full_like(vals, NEG_INF).scatter_(1, top, vals.gather(1, top)))


def _chain_rows(x: Tensor, cfgs: list, ctxs: list[Context], name: str) -> _Rows:
    """Rows x [n,V] through each row's chain, as the rows the steps left (`_Rows`)."""
    xs = _Rows(x)
    for members in _orders(cfgs):
        if _together(len(members), x.shape[1]):
            _run_order(xs, members, cfgs, ctxs, name)
        else:  # wide rows: each through its chain alone, while it is in the caches
            for i in members:
                _run_order(xs, [i], cfgs, ctxs, name)
    return xs


def run_chain(x: Tensor, cfgs: list, ctxs: list[Context], name: str = "logits") -> Tensor:
    """Rows x [n,V] float32 (the raw logits) through each row's chain → processed logits [n,V] (-inf = cut); a greedy
    row keeps its argmax only. XTC reads each row's coin from its Context (set by the caller). x is not written."""
    if x.shape[0] == 0:
        return x.clone()
    return _chain_rows(x, cfgs, ctxs, name).joined(list(range(x.shape[0])))


def _has_xtc(cfg: Any) -> bool:
    return any(s is _XTC for s in chain(cfg))


def _mixes_xtc(cfg: Any) -> bool:
    return _has_xtc(cfg) and cfg.xtc_probability < 1.0


def row_logits(x: Tensor, cfg: Any, ctx: Context, name: str = "logits") -> Tensor:
    """The processed logits [1,V] of one row: the distribution its draw follows (with XTC on, the mixture of both
    outcomes of the coin, as log-probabilities)."""
    if not _has_xtc(cfg):
        return run_chain(x, [cfg], [ctx], name)
    ctx.xtc = True
    cut = run_chain(x, [cfg], [ctx], name)
    if not _mixes_xtc(cfg):
        ctx.xtc = None
        return cut
    ctx.xtc = False
    whole = run_chain(x, [cfg], [ctx], name)
    ctx.xtc = None
    p = cfg.xtc_probability
    mix = (1 - p) * torch.softmax(whole.double(), dim=-1) + p * torch.softmax(cut.double(), dim=-1)
    return torch.where(mix > 0, mix.log(), torch.full_like(mix, NEG_INF)).float()


def contexts(cfgs: list, histories: list[list[int]] | None, prompt_lens: list[int],
             states: list[RowState] | None) -> list[Context]:
    """One Context per row (no history: empty; no states: a fresh RowState each, as at a first token)."""
    return [Context(history=[] if histories is None else histories[r], prompt_len=prompt_lens[r],
                    state=RowState() if states is None else states[r]) for r in range(len(cfgs))]


def process_rows(x: Tensor, cfgs: list, ctxs: list[Context], name: str = "logits") -> Tensor:
    """Rows x [n,V] (float32, raw) → processed logits [n,V]: the chain over the batch; a row whose XTC coin mixes two
    outcomes (0 < xtc_probability < 1) runs both on its own (`row_logits`)."""
    mixed = [r for r, c in enumerate(cfgs) if _has_xtc(c)]
    if not mixed:
        return run_chain(x, cfgs, ctxs, name)
    plain = [r for r in range(len(cfgs)) if r not in mixed]
    out = torch.empty_like(x)
    for r in mixed:
        out[r:r + 1] = row_logits(x[r:r + 1], cfgs[r], ctxs[r], name)
    if plain:
        index = torch.tensor(plain, device=x.device)
        out[index] = run_chain(x[index], [cfgs[r] for r in plain], [ctxs[r] for r in plain], name)
    return out


def draw_rows(x: Tensor, cfgs: list, ctxs: list[Context], steps: list[int] | None,
              generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Rows x [n,V] → (ids [n], their processed logprobs [n]): each row's XTC coin and uniform from its generator
    (seeded rows: seeded_generator(seed, step)), in row order; the chain over the batch and the draws (wide rows: each
    row's chain and draw on its own); then the steps with state accept each chosen token (mirostat's μ, the
    penalties' and DRY's records move)."""
    n = x.shape[0]
    ids = torch.zeros(n, dtype=torch.long, device=x.device)
    lp = torch.zeros(n, dtype=torch.float32, device=x.device)
    u = torch.zeros(n, 1, dtype=torch.float64, device=x.device)
    for r, (cfg, ctx) in enumerate(zip(cfgs, ctxs, strict=True)):
        gen = seeded_generator(cfg.seed, steps[r], x.device) if cfg.seed is not None and steps else generator
        if _has_xtc(cfg):
            coin = float(torch.rand(1, dtype=torch.float64, device=x.device, generator=gen))
            ctx.xtc = coin <= cfg.xtc_probability  # llama.cpp: the cut is skipped when the chance exceeds P
        if not cfg.is_greedy:
            u[r] = torch.rand(1, 1, dtype=torch.float64, device=x.device, generator=gen)[0]
    if _together(n, x.shape[1]):  # the chain step by step over the rows, then their draws together
        xs = _chain_rows(x, cfgs, ctxs, "logits")
        _draw(xs, list(range(n)), cfgs, u, ids, lp)
    else:  # wide rows: each chained and drawn on its own, while it is in the caches
        xs = _Rows(x)
        for r in range(n):
            _run_order(xs, [r], cfgs, ctxs, "logits")
            _draw(xs, [r], cfgs, u, ids, lp)
            xs.put([r], x)  # its processed row is not kept
    for ctx in ctxs:
        ctx.xtc = None
    for r in range(n):  # the stateful steps move (mirostat's μ, the penalties' and DRY's records)
        accept(cfgs[r], ctxs[r].state, int(ids[r]), float(lp[r]))
    return ids, lp


def _draw(xs: _Rows, rows: list[int], cfgs: list, u: Tensor, ids: Tensor, lp: Tensor) -> None:
    """The rows' draws from their processed rows in xs: a greedy row's argmax, the sampled rows' inverse CDF with
    their uniforms u, together in one pass where they are one tensor, else each where it lies → ids, lp."""
    sampled = []
    for r in rows:
        if cfgs[r].is_greedy:
            ids[r] = xs.row(r).argmax(dim=-1)[0]
        else:
            sampled.append(r)
    if not sampled:
        return
    vals = xs.joined(sampled)
    if len(sampled) == 1:  # a row alone: no index tensors
        r = sampled[0]
        drawn = draw_whole_rows(vals, None, Vocab(vals.shape[1]), u[r:r + 1])
        ids[r] = drawn[0]
        lp[r] = _drawn_logprobs(vals, [int(drawn[0])])[0]
        return
    index = torch.tensor(sampled, device=u.device)
    drawn = draw_whole_rows(vals, None, Vocab(vals.shape[1]), u[index])
    ids[index] = drawn
    lp[index] = _drawn_logprobs(vals, drawn.tolist())


def _drawn_logprobs(vals: Tensor, toks: list[int]) -> Tensor:
    """The log-probability of each drawn token in processed logits [n,V]: its logit less the row's log-normaliser,
    from one C call where the library is (two passes over each row, no [n,V] temporary; each row's number the one it
    gets alone), else a log-softmax."""
    if vals.device.type == "cpu" and vals.dtype == torch.float32:
        from lmhead.kernels import native

        got = native.token_scores(vals, toks)
        if got is not None:
            return torch.tensor(got[0], dtype=torch.float32)
    index = torch.tensor(toks, device=vals.device)[:, None]
    return torch.log_softmax(vals, dim=-1).gather(1, index)[:, 0]

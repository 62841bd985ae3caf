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
(1 − P)·p(without) + P·p(with). Mirostat reads and, after a draw, moves the row's μ (``steps.RowState``).
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


def _run_order(x: Tensor, cfgs: list, ctxs: list[Context], name: str) -> Tensor:
    """Rows x [n,V] of one order through it, each step once over the rows that run it → [n,V]. x is not written."""
    chains = [chain(c) for c in cfgs]
    owned = False  # whether x is this function's own tensor (the caller's is never written)
    checked = False
    for step_name in order_of(cfgs[0]):
        s = STEPS[step_name]
        if s.stage > 1 and not checked:
            checked = True
            check_top(x.amax(dim=-1), name)  # an all -inf row after the masks: no token can be chosen
        on = [i for i, ch in enumerate(chains) if s in ch]
        if len(on) == len(cfgs):
            out = rows_apply(s, x, cfgs, ctxs)
            owned = owned or out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
            x = out
        elif on:
            index = torch.tensor(on, device=x.device)
            sub = rows_apply(s, x[index], [cfgs[i] for i in on], [ctxs[i] for i in on])
            if not owned:
                x, owned = x.clone(), True
            x[index] = sub
    if not checked:
        check_top(x.amax(dim=-1), name)
    greedy = [i for i, c in enumerate(cfgs) if c.is_greedy]
    if len(greedy) < len(cfgs):  # NaN or +inf a step made (a temperature near 0 on huge logits)
        sampled = [i for i, c in enumerate(cfgs) if not c.is_greedy]
        check_top((x if not greedy else x[torch.tensor(sampled, device=x.device)]).amax(dim=-1), name)
    if greedy:  # the argmax alone (the first one on ties)
        index = torch.tensor(greedy, device=x.device)
        vals = x[index]
        top = vals.argmax(dim=-1, keepdim=True)
        one = torch.full_like(vals, NEG_INF).scatter_(1, top, vals.gather(1, top))
        if len(greedy) == len(cfgs):
            return one
        if not owned:
            x = x.clone()
        x[index] = one
    return x


def run_chain(x: Tensor, cfgs: list, ctxs: list[Context], name: str = "logits") -> Tensor:
    """Rows x [n,V] float32 (the raw logits) through each row's chain → processed logits [n,V] (-inf = cut); a greedy
    row keeps its argmax only. XTC reads each row's coin from its Context (set by the caller)."""
    if x.shape[0] == 0:
        return x.clone()
    groups = _orders(cfgs)
    if len(groups) == 1:
        return _run_order(x, cfgs, ctxs, name)
    out = torch.empty_like(x)
    for rows in groups:
        index = torch.tensor(rows, device=x.device)
        out[index] = _run_order(x[index], [cfgs[r] for r in rows], [ctxs[r] for r in rows], name)
    return out


def _mixes_xtc(cfg: Any) -> bool:
    return _XTC in chain(cfg) and cfg.xtc_probability < 1.0


def row_logits(x: Tensor, cfg: Any, ctx: Context, name: str = "logits") -> Tensor:
    """The processed logits [1,V] of one row: the distribution its draw follows (with XTC on, the mixture of both
    outcomes of the coin, as log-probabilities)."""
    if _XTC not in chain(cfg):
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
    mixed = [r for r, c in enumerate(cfgs) if _XTC in chain(c)]
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
    (seeded rows: seeded_generator(seed, step)), in row order; the chain over the batch; the draws; then the
    stateful steps accept each drawn token (mirostat's μ moves)."""
    n = x.shape[0]
    ids = torch.zeros(n, dtype=torch.long, device=x.device)
    lp = torch.zeros(n, dtype=torch.float32, device=x.device)
    u = torch.zeros(n, 1, dtype=torch.float64, device=x.device)
    for r, (cfg, ctx) in enumerate(zip(cfgs, ctxs, strict=True)):
        gen = seeded_generator(cfg.seed, steps[r], x.device) if cfg.seed is not None and steps else generator
        if _XTC in chain(cfg):
            coin = float(torch.rand(1, dtype=torch.float64, device=x.device, generator=gen))
            ctx.xtc = coin <= cfg.xtc_probability  # llama.cpp: the cut is skipped when the chance exceeds P
        if not cfg.is_greedy:
            u[r] = torch.rand(1, 1, dtype=torch.float64, device=x.device, generator=gen)[0]
    vals = run_chain(x, cfgs, ctxs)
    for ctx in ctxs:
        ctx.xtc = None
    greedy = [r for r, c in enumerate(cfgs) if c.is_greedy]
    sampled = [r for r, c in enumerate(cfgs) if not c.is_greedy]
    if greedy:
        index = torch.tensor(greedy, device=x.device)
        ids[index] = vals[index].argmax(dim=-1)
    if sampled:
        index = torch.tensor(sampled, device=x.device)
        rows = vals if len(sampled) == n else vals[index]
        drawn = draw_whole_rows(rows, None, Vocab(x.shape[1]), u[index])
        ids[index] = drawn
        lp[index] = _drawn_logprobs(rows, drawn.tolist())
    for r in sampled:
        accept(cfgs[r], ctxs[r].state, int(ids[r]), float(lp[r]))  # the stateful steps move (mirostat's μ)
    return ids, lp


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

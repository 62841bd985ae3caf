"""The torch path for rows the batch path does not serve: any step without the "batch" backend (typical-p, DRY,
mirostat, ...), or an order other than lmhead's. Each row runs alone through its declared chain
(``lmhead.sampling.steps.chain``), every step's exact torch implementation on the whole row [1,V]; the draw is the
whole-row inverse CDF with one uniform (``rows.draw_whole_rows``) from the row's generator — a seeded row's (seed, step)
one, so its token depends on nothing else in the batch.

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
from lmhead.sampling.steps import STEPS, Context, RowState, accept, chain
from lmhead.sampling.vocab import NEG_INF, Vocab

_XTC = STEPS["xtc"]


def _run(x: Tensor, cfg: Any, ctx: Context, name: str) -> Tensor:
    """x [1,V] float32 (the raw logits) through cfg's chain → processed logits [1,V] (-inf = cut); a greedy row
    keeps its argmax only (the first one on ties)."""
    masked = False
    for s in chain(cfg):
        if s.stage > 1 and not masked:
            masked = True
            check_top(x.amax(dim=-1), name)  # an all -inf row after the masks: no token can be chosen
        x = s.apply(x, cfg, ctx)
    if not masked:
        check_top(x.amax(dim=-1), name)
    if cfg.is_greedy:
        i = int(x.argmax(dim=-1))
        out = torch.full_like(x, NEG_INF)
        out[0, i] = x[0, i]
        return out
    check_top(x.amax(dim=-1), name)  # NaN or +inf a step made (a temperature near 0 on huge logits)
    return x


def _mixes_xtc(cfg: Any) -> bool:
    return _XTC in chain(cfg) and cfg.xtc_probability < 1.0


def row_logits(x: Tensor, cfg: Any, ctx: Context, name: str = "logits") -> Tensor:
    """The processed logits [1,V] of one row: the distribution its draw follows (with XTC on, the mixture of both
    outcomes of the coin, as log-probabilities)."""
    if _XTC not in chain(cfg):
        return _run(x, cfg, ctx, name)
    ctx.xtc = True
    cut = _run(x, cfg, ctx, name)
    if not _mixes_xtc(cfg):
        return cut
    ctx.xtc = False
    whole = _run(x, cfg, ctx, name)
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
    """Rows x [n,V] (float32, raw) → processed logits [n,V], each row alone."""
    return torch.cat([row_logits(x[r:r + 1], cfgs[r], ctxs[r], name) for r in range(x.shape[0])]) if x.shape[0] \
        else x.clone()


def draw_rows(x: Tensor, cfgs: list, ctxs: list[Context], steps: list[int] | None,
              generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Rows x [n,V] → (ids [n], their processed logprobs [n]), each row alone: its XTC coin, its chain, its draw
    (seeded rows from seeded_generator(seed, step)); the stateful steps accept the drawn token (mirostat's μ moves)."""
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    lp = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for r, (cfg, ctx) in enumerate(zip(cfgs, ctxs, strict=True)):
        gen = seeded_generator(cfg.seed, steps[r], x.device) if cfg.seed is not None and steps else generator
        if _XTC in chain(cfg):
            u = float(torch.rand(1, dtype=torch.float64, device=x.device, generator=gen))
            ctx.xtc = u <= cfg.xtc_probability  # llama.cpp: the cut is skipped when the chance exceeds P
        vals = _run(x[r:r + 1], cfg, ctx, "logits")
        ctx.xtc = None
        if cfg.is_greedy:
            ids[r], lp[r] = int(vals.argmax(dim=-1)), 0.0
            continue
        tok = int(draw_whole_rows(vals, gen, Vocab(x.shape[1]))[0])
        ids[r] = tok
        lp[r] = _drawn_logprob(vals, tok)
        accept(cfg, ctx.state, tok, float(lp[r]))  # the stateful steps move (mirostat's μ)
    return ids, lp


def _drawn_logprob(vals: Tensor, tok: int) -> float:
    """The log-probability of the drawn `tok` in processed logits [1,V]: its logit less the row's log-normaliser,
    from one C call where the library is (two passes over the row, no [1,V] temporary), else a log-softmax."""
    if vals.device.type == "cpu" and vals.dtype == torch.float32:
        from lmhead.kernels import native

        got = native.token_scores(vals, [tok])
        if got is not None:
            return got[0][0]
    return float(torch.log_softmax(vals, dim=-1)[0, tok])

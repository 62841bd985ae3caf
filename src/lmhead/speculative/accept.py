"""The exact acceptance rules (pure): which drafted tokens a row keeps, and the token it emits after them.

    accept_greedy    greedy and seeded rows: the longest prefix of drafts equal to the target's own choice
    accept_sampled   other sampled rows: accept d with probability min(1, p(d)/q(d)); at the first rejection a
                     draw from `residual(p, q)`; after k acceptances a draw from p_k
    judge            both over a round of a model draft (`drafts.Draft.accept`): the pipeline at every position
                     (`choices`), then each row's rule
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.decode.choice import is_deterministic
from lmhead.sampling import seeded_generator

# separate the streams of acceptance uniforms and replacement draws of one token (seeded `accept_sampled`)
_ACCEPT_TAG, _RESIDUAL_TAG = 0x5A, 0xA5


def accept_greedy(draft: Tensor, target: Tensor) -> Tensor:
    """draft [B,k] proposed ids, target [B,k+1] the target's own choice at each position → [B] accepted
    counts n: the longest prefix with draft[:, i] == target[:, i]. The row then emits draft[:, :n] and
    target[:, n]."""
    k = draft.shape[1]
    agree = (draft == target[:, :k]).int()
    return agree.cumprod(dim=1).sum(dim=1)


def residual(p: Tensor, q: Tensor) -> Tensor:
    """normalise(max(0, p − q)) over the last dim [..., V]: where the draft under-proposed. Where p ≤ q
    everywhere (then p = q: a rejection has probability 0) it returns p, so it is always a distribution."""
    r = (p - q).clamp_min_(0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def token_generator(seed: int | None, step: int, tag: int, shared: torch.Generator | None) -> torch.Generator | None:
    """The generator for one random choice about the token at `step`: keyed on (seed, step, tag) for a seeded
    row, so the run reproduces whatever else is in the batch; `shared` otherwise."""
    return shared if seed is None else seeded_generator(seed ^ tag, step)


def _uniform(gen: torch.Generator | None) -> float:
    return float(torch.rand((), generator=gen))


def draw(probs: Tensor, gen: torch.Generator | None) -> int:
    """One id from probs [V] by inverse CDF with one uniform (float64 cumsum: no mass lost at V = 262,144)."""
    cdf = probs.double().cumsum(0)
    u = _uniform(gen) * float(cdf[-1])
    return int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).clamp_max_(len(cdf) - 1))


def accept_sampled(draft: Tensor, q: Tensor, p: Tensor, seeds: list[int | None], steps: list[int],
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """The speculative-sampling rule for B rows.

    draft [B,k] ids drawn from q [B,k,V]; p [B,k+1,V] the target's processed distributions; seeds [B] (None =
    use `generator`), steps [B] the step of each row's first drafted token. → (n [B] accepted counts,
    last [B] the token emitted after them: a residual draw at the first rejection, else a draw from p_k).
    """
    b, k = draft.shape
    n = torch.zeros(b, dtype=torch.long)
    last = torch.zeros(b, dtype=torch.long)
    for r in range(b):
        accepted = 0
        for i in range(k):
            d = int(draft[r, i])
            pd, qd = float(p[r, i, d]), float(q[r, i, d])
            u = _uniform(token_generator(seeds[r], steps[r] + i, _ACCEPT_TAG, generator))
            if not (qd > 0 and u * qd < pd):  # accept when u < p/q (written without dividing)
                break
            accepted += 1
        dist = p[r, k] if accepted == k else residual(p[r, accepted], q[r, accepted])
        gen = token_generator(seeds[r], steps[r] + accepted, _RESIDUAL_TAG, generator)
        n[r], last[r] = accepted, draw(dist, gen)
    return n, last


def choices(x: Tensor, configs: list, prev, plen, steps: list[int]) -> tuple[Tensor | None, Tensor | None]:
    """For rows x [N,V]: the plain sampler's choice for greedy and seeded rows (ids [N], other rows 0; a
    seeded row draws with its (seed, step) noise, exactly as the plain loop) and the processed distributions
    for the other sampled rows (probs [N,V]). None where no row needs it."""
    from lmhead.sampling import probabilities, sample

    def pick(rows: list[int]):
        sub_prev = None if prev is None else [prev[r] for r in rows]
        return [configs[r] for r in rows], sub_prev, [plen[r] for r in rows] if prev is not None else 0

    fixed = [r for r, c in enumerate(configs) if is_deterministic(c)]
    free = [r for r, c in enumerate(configs) if not is_deterministic(c)]
    ids = probs = None
    if fixed:
        cfg, sub_prev, sub_plen = pick(fixed)
        ids = torch.zeros(len(configs), dtype=torch.long)
        ids[fixed] = sample(x[fixed], cfg, prev_tokens=sub_prev, prompt_len=sub_plen,
                            step=[steps[r] for r in fixed])
    if free:
        cfg, sub_prev, sub_plen = pick(free)
        probs = torch.zeros_like(x)
        probs[free] = probabilities(x[free], cfg, prev_tokens=sub_prev, prompt_len=sub_plen)
    return ids, probs


def judge(logits: Tensor, drafts: Tensor, q: Tensor | None, ks: list[int], configs: list, history, prompt_len,
          steps: list[int], generator: torch.Generator | None) -> tuple[list[list[int]], Tensor]:
    """A model draft's proposals drafts [B,k] (q [B,k,V] the sampled rows' distributions) judged by the target's
    logits [B,k+1,V] → per row the emitted tokens and the count n [B] of accepted drafts; row r judges its first ks[r]
    drafts only (what it would have drafted alone). Greedy and seeded rows: the plain sampler's choice at
    each position, accepted while it equals the draft; other rows the min(1, p/q) rule against q."""
    b, width, vocab = logits.shape
    rows = drafts.tolist()
    # the pipeline at every position: position i follows the row's history and d_1..d_i
    flat_cfg = [c for c in configs for _ in range(width)]
    prev = None if history is None else [history[r] + rows[r][:i] for r in range(b) for i in range(width)]
    plen = [pl for pl in prompt_len for _ in range(width)]
    flat_steps = [s + i for s in steps for i in range(width)]
    choice, p = choices(logits.reshape(b * width, vocab), flat_cfg, prev, plen, flat_steps)
    tokens, n = [], torch.zeros(b, dtype=torch.long)
    for r in range(b):
        kr, base = ks[r], r * width
        if is_deterministic(configs[r]):
            target = choice[base:base + kr + 1]
            nr = int(accept_greedy(drafts[r:r + 1, :kr], target[None])[0])
            last = int(target[nr])
        else:
            got = accept_sampled(drafts[r:r + 1, :kr], q[r:r + 1, :kr], p[None, base:base + kr + 1],
                                 [None], [steps[r]], generator)
            nr, last = int(got[0][0]), int(got[1][0])
        n[r] = nr
        tokens.append(rows[r][:nr] + [last])
    return tokens, n

"""Speculative decoding that never changes a token — nor, when sampling, the distribution of one.

    draft (the same model: int8 weights, a head over a frequent-token subset) proposes k tokens per row,
        d_1..d_k, each drawn from its own processed distribution q_i (greedy rows: its argmax)
    target (the full-precision body and the model's head) scores the k+1 positions in one forward: p_0..p_k,
        each the *processed* distribution of the whole pipeline (bias, penalties, temperature, top-k, top-p,
        min-p) given the tokens before it
    greedy rows   accept the longest prefix with d_{i+1} = argmax p_i; then the target's own token — the output
                  is token for token the full-precision greedy output
    sampled rows  accept d_{i+1} with probability min(1, p_i(d)/q_i(d)); at the first rejection draw from
                  normalise(max(0, p_i − q_i)); when all k are accepted draw one more token from p_k
                  (Leviathan et al. 2023; Chen et al. 2023) — every emitted token is distributed exactly as
                  the plain sampler's

Why it is exact for sampling: for one position, P(emit x) = q(x)·min(1, p(x)/q(x)) + P(reject)·r(x) with
r = max(0, p−q)/Σmax(0, p−q) and P(reject) = 1 − Σ min(p, q) = Σ max(0, p−q); so P(x) = min(p, q)(x) +
max(0, p−q)(x) = p(x). The test suite checks this in closed form and by a goodness-of-fit test over draws.

Randomness: a seeded row draws its acceptance uniforms and its replacement tokens from generators keyed on
(seed, the step of the token, a purpose tag), so a seed reproduces a run; other rows share one generator.
The pure rules (`accept_greedy`, `accept_sampled`, `residual`) are apart from the draft model (`Draft`) and
from the loop (`lmhead.generate`), which feeds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lmhead import checks
from lmhead.models.fast_linear import Int8Linear, int8_linear_available
from lmhead.models.lean import LeanBody, StaticCache
from lmhead.sampling import seeded_generator

__all__ = ["AdaptiveK", "Draft", "SpeculativeStats", "accept_greedy", "accept_sampled", "residual",
           "token_generator", "frequent_tokens", "DRAFT_MODES", "MAX_DRAFT_TOKENS", "check_draft_tokens"]

DRAFT_MODES: tuple[str, ...] = ("auto", "int8", "none")
MAX_DRAFT_TOKENS = 16
# separate streams for the draft's draws, the acceptance uniforms and the replacement draws of one token
DRAFT_TAG, _ACCEPT_TAG, _RESIDUAL_TAG = 0x3C, 0x5A, 0xA5


def check_draft_tokens(value: object) -> int:
    """k, the tokens drafted per verification: an int in [1, MAX_DRAFT_TOKENS]."""
    if not checks.is_int(value) or not 1 <= value <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got {value!r}")
    return int(value)


# --- the acceptance rules (pure) -------------------------------------------------------------------------


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


def _draw(probs: Tensor, gen: torch.Generator | None) -> int:
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
        n[r], last[r] = accepted, _draw(dist, gen)
    return n, last


# --- statistics ------------------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """Counts over a run: verifications, tokens drafted, drafted tokens accepted, tokens emitted."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "emitted": self.emitted, "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.tokens_per_round}


class AdaptiveK:
    """k follows the acceptance rate: it grows while whole drafts are accepted and shrinks when the first
    drafted tokens are rejected (the expected tokens per round, (1 − a^{k+1})/(1 − a), saturates for a < 1)."""

    def __init__(self, k: int, adaptive: bool = True) -> None:
        self.k = check_draft_tokens(k)
        self.adaptive = adaptive
        self.low, self.high = 1, MAX_DRAFT_TOKENS if adaptive else k

    def update(self, accepted: list[int], k: int) -> None:
        if not self.adaptive or not accepted:
            return
        if min(accepted) >= k:
            self.k = min(self.high, self.k + 1)
        elif max(accepted) < k // 2:
            self.k = max(self.low, self.k - 1)


# --- the draft -------------------------------------------------------------------------------------------


def frequent_tokens(tokenizer, vocab_size: int, count: int) -> Tensor | None:
    """Up to `count` ids a BPE tokenizer built first (its merge order: early merges are frequent pairs), plus
    every single-character and special token; None when the tokenizer has no merges to rank by. The draft's
    head scores only these: a target token outside them is a rejection, never a wrong output."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = json.loads(backend.to_str()).get("model", {})
    vocab, merges = model.get("vocab") or {}, model.get("merges") or []
    if not merges or not vocab:
        return None
    rank = torch.full((vocab_size,), len(merges) + 1, dtype=torch.long)
    for i, merge in enumerate(merges):
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        j = vocab.get(a + b)
        if j is not None and j < vocab_size and rank[j] > i:
            rank[j] = i
    for token, j in vocab.items():
        if len(token) == 1 and j < vocab_size:
            rank[j] = -1
    for j in list(getattr(tokenizer, "all_special_ids", []) or []):
        if 0 <= j < vocab_size:
            rank[j] = -2
    chosen = torch.argsort(rank, stable=True)[:count]
    return chosen.sort().values


class Draft:
    """The draft model: the same body with int8 weights (`LeanBody(int8=True)`) and an int8 head over a
    subset of the vocabulary (all of it when V ≤ `max_vocab`, else the tokenizer's `max_vocab` most frequent
    ids). `logits(ids, positions, cache)` → [B,T,V] float32 with -inf outside the subset.

    Memory: int8 copies of the body's matrices and of the subset's head rows (a quarter of their fp32 bytes).
    """

    def __init__(self, hf_model, tokenizer=None, head_weight: Tensor | None = None, softcap: float | None = None,
                 max_vocab: int = 32768) -> None:
        if not int8_linear_available():
            raise ValueError("draft='int8' needs oneDNN's int8 inner product, which this torch build lacks; "
                             "use draft='none'")
        self.body = LeanBody(hf_model, int8=True)
        weight = hf_model.get_output_embeddings().weight if head_weight is None else head_weight
        self.vocab_size = int(weight.shape[0])
        subset = None
        if self.vocab_size > max_vocab and tokenizer is not None:
            subset = frequent_tokens(tokenizer, self.vocab_size, max_vocab)
        self.subset = subset
        rows = weight.detach() if subset is None else weight.detach().index_select(0, subset)
        self.head = Int8Linear(rows)
        self.softcap = softcap

    @property
    def nbytes(self) -> int:
        return self.body.nbytes + self.head.nbytes

    def new_cache(self, batch: int, capacity: int) -> StaticCache:
        return self.body.new_cache(batch, capacity)

    def logits(self, ids: Tensor, positions: Tensor, cache: StaticCache, valid: Tensor | None = None) -> Tensor:
        hidden = self.body(ids, positions, cache, valid)
        y = self.head(hidden)
        if self.softcap is not None:
            y = torch.tanh(y / self.softcap) * self.softcap
        if self.subset is None:
            return y
        out = y.new_full((*y.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.subset] = y
        return out

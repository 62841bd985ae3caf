"""Speculative decoding that never changes a token — nor, when sampling, the distribution of one.

    draft (the same model: int8 weights, a head over a frequent-token subset) proposes k tokens per row,
        d_1..d_k, each drawn from its own processed distribution q_i (greedy rows: its argmax)
    target (the full-precision body and the model's head) scores the k+1 positions in one forward: p_0..p_k,
        each the *processed* distribution of the whole pipeline (bias, penalties, temperature, top-k, top-p,
        min-p) given the tokens before it
    greedy rows and seeded rows
                  the target's own choice at each position — its argmax, or for a seeded row the plain
                  sampler's draw with that position's (seed, step) noise — and accept the longest prefix of
                  drafts equal to it, then the target's own token; the draft proposes with the same noise,
                  so it agrees often. The output is token for token what the plain loop gives: the
                  full-precision greedy output, and for a seed the same tokens as without a draft wherever
                  the head's logits of the kept tokens do not depend on how many positions it scores at once
                  (the fp32 head; the compressed head within its exact top-k — beyond it, its approximate
                  tail is computed per call, so a whole-row seeded draw keeps the distribution, not the draw)
    other sampled rows
                  accept d_{i+1} with probability min(1, p_i(d)/q_i(d)); at the first rejection draw from
                  normalise(max(0, p_i − q_i)); when all k are accepted draw one more token from p_k
                  (Leviathan et al. 2023; Chen et al. 2023) — every emitted token is distributed exactly as
                  the plain sampler's. For a point-mass draft (n-gram) this rule is a plain draw t ~ p_i
                  compared with d: such rows are judged as greedy ones are (`NgramDraft`)

Why it is exact for sampling: for one position, P(emit x) = q(x)·min(1, p(x)/q(x)) + P(reject)·r(x) with
r = max(0, p−q)/Σmax(0, p−q) and P(reject) = 1 − Σ min(p, q) = Σ max(0, p−q); so P(x) = min(p, q)(x) +
max(0, p−q)(x) = p(x). The test suite checks this in closed form and by a goodness-of-fit test over draws.

Randomness: rows without a seed share one generator; `accept_sampled` can also key its uniforms and draws on
(seed, step, a purpose tag) for callers that want that.
The pure rules (`accept_greedy`, `accept_sampled`, `residual`) are apart from the draft model (`Draft`) and
from the loop (`lmhead.generate`), which feeds them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from lmhead import checks
from lmhead.kernels.native import greedy_rows, sample_row
from lmhead.models.fast_linear import Int8Linear, int8_linear_available
from lmhead.models.lean import SUPPORTED_MODEL_TYPES, LeanBody, StaticCache, gather_row
from lmhead.sampling import seeded_generator

__all__ = ["AdaptiveK", "Decoder", "Draft", "NgramDraft", "Round", "SpeculativeStats", "accept_greedy",
           "accept_sampled", "check_draft_mode", "check_draft_tokens", "decode_logits", "frequent_tokens",
           "apply_masks", "merge_caches", "plain_choice", "residual", "screen_k", "settle_round", "take_drafts",
           "token_generator",
           "DRAFT_MODES", "MAX_DRAFT_TOKENS", "SCREEN_MAX_K", "SCREEN_MIN_ROWS"]

DRAFT_MODES: tuple[str, ...] = ("auto", "ngram", "int8", "none")
MAX_DRAFT_TOKENS = 16
PREFILL_PIECE = 512  # prompt columns per prefill forward (`Decoder.prefill_piece`)
NGRAM_MAX_POSITIONS = 8  # positions one n-gram verification may score (all rows): measured, docs/decode.md
# `decode_logits`' screened head: from 4 positions (Gemma 3's head, interleaved: 1.3-1.4x the exact product at 4,
# 1.2-1.3x at 5, 1.15-1.25x at 8; ~1.0x at 2-3, where one pass over the codes is memory's time either way)
SCREEN_MIN_ROWS = 4
SCREEN_MAX_K = 64  # the widest top-k a screened row may have (its candidates stay a few dozen more than k)
# separate the streams of acceptance uniforms and replacement draws of one token (seeded `accept_sampled`)
_ACCEPT_TAG, _RESIDUAL_TAG = 0x5A, 0xA5


def check_draft_mode(model, mode: object) -> str:
    """`mode` in DRAFT_MODES, and one the model can have (a draft needs the lean body and oneDNN's int8
    kernel)."""
    if mode not in DRAFT_MODES:
        raise ValueError(f"draft must be one of {', '.join(DRAFT_MODES)}; got {mode!r}")
    if mode in ("int8", "ngram") and getattr(model, "lean", None) is None:
        raise ValueError(f"draft={mode!r} needs the lean body (model types "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}, body='auto' or 'lean'); use draft='none'")
    if mode == "int8" and not int8_linear_available():
        raise ValueError("draft='int8' needs oneDNN's int8 inner product, which this torch build lacks; "
                         "use draft='none'")
    return mode


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
        if not self.adaptive or not accepted or k == 0:  # k = 0: nothing was drafted, nothing learnt
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


class NgramDraft:
    """Drafts from the row's own text (prompt lookup): the tokens that followed the most recent earlier
    occurrence of the row's last n tokens (n from `max_n` down to `min_n`, the longest that occurs wins).

    No model, no memory, no time: a draft is a few list comparisons. Text repeats — names, code, lists, the
    loops small models fall into, a chat answer quoting its prompt — and where it does, the full-precision
    model accepts several tokens per verification; where nothing matches the round is a plain step. The draft
    is a point mass (q = 1 on the proposed token), so the speculative-sampling rule accepts a drafted token
    with probability p(d) and on rejection draws from p without d — which is what drawing t from p and
    comparing it with d does: t = d accepts d, t ≠ d is the replacement (t given t ≠ d is p without d,
    renormalised). So every row, seeded or not, is judged as a greedy row is (`Decoder._draws`): the plain
    sampler's draw at each position, the longest prefix of drafts equal to it — no p(d), no [B,k,V] q, and
    no draw at the positions after the first mismatch.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.nbytes = 0

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k ids to follow `tokens` (a row's prompt and generated ids, newest last); [] when no suffix of
        length ≥ min_n occurred before."""
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            tail = tokens[size - n:]
            first = tail[0]
            # the most recent earlier start s (s + n < size) with tokens[s:s+n] == tail
            for s in range(size - n - 1, -1, -1):
                if tokens[s] == first and tokens[s:s + n] == tail:
                    return tokens[s + n:s + n + k]
        return []


# --- the rounds ------------------------------------------------------------------------------------------


@dataclass
class Round:
    """What one round gives the live rows: per row the emitted tokens, the target's logits [n_r, V] each
    was chosen from (for logprobs and ranks) and the hidden states [n_r, D] they came from (for exact
    logprobs: the fp32 head on them); and, where the tokens came from the plain sampler's draws (no draft,
    n-gram drafts, greedy and seeded rows), each token's processed logprob, taken from the cut it was drawn
    from (`sampling.sample_with_logprobs`)."""

    tokens: list[list[int]]
    logits: list[Tensor]
    hidden: list[Tensor] | None = None
    logprobs: list[list[float]] | None = None  # per row each emitted token's processed logprob, from its draw
    raw: list[list[float]] | None = None  # plain greedy rows: each token's raw logprob, found with it (rank 1)


class Decoder:
    """Decoding rounds over the lean body for B rows; `lmhead.generate` drives it.

        start(prompt)  the target takes every prompt token but the last, which becomes each row's `last`
        round(last)    the draft feeds its pending columns and `last`, then proposes d_1..d_k (k forwards;
                       no draft: k = 0); the target feeds [last, d_1..d_k] in one forward (k+1 columns)
                       → head → logits [B,k+1,V] → the pipeline's choice (greedy rows) or distribution
                       (sampled rows) at each position → the exact acceptance rules → each row emits
                       d_1..d_n and one token more
        select(rows)   drop finished rows

    The target's cache keeps, per row, the columns of the tokens that row emitted; a row that accepted fewer
    drafts than another leaves its extra columns invalid (`StaticCache.invalidate`) and `compact` gives the
    holes back when the cache fills. The draft's cache mirrors the target's columns: the columns the target
    took that the draft has not seen (its pending columns: the prompt, a fully accepted draft's last token)
    go first into the draft's next forward. Without a draft a round is exactly the plain sampler's step.
    """

    def __init__(self, lean: LeanBody, head, draft: Draft | NgramDraft | None = None, k: int = 4,
                 adaptive: bool = True, stats: SpeculativeStats | None = None,
                 profile: dict[str, float] | None = None, greedy_only: bool = False) -> None:
        self.lean, self.head, self.draft = lean, head, draft
        self.greedy_only = greedy_only  # only greedy rows draft (the others verify nothing: plain steps)
        self._none_accepted: dict[int, Tensor] = {}  # `_plain`'s counts of accepted drafts (none), per batch size
        self.k0, self.adaptive = k, adaptive
        self.k: list[AdaptiveK] = []  # one per row: a row's k follows its own acceptance only
        self.stats = stats if stats is not None else SpeculativeStats()
        self.profile = profile
        self._t = time.perf_counter()
        self._prefill: tuple | None = None  # prompt columns not yet fed: (ids, positions, valid, next column)
        self._merged: tuple[StaticCache, int] | None = None  # `begin_join`'s merged cache and its first new row

    def _lap(self, phase: str) -> None:
        """Add the time since the last lap to `profile[phase]` (nothing when there is no profile)."""
        if self.profile is not None:
            now = time.perf_counter()
            self.profile[phase] = self.profile.get(phase, 0.0) + now - self._t
            self._t = now

    @torch.inference_mode()
    def start(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int,
              prefix: tuple[int, Tensor, Tensor] | None = None) -> Tensor:
        """ids, positions [B,W] (left-padded; valid [B,W] marks real tokens) → last [B] (the prompts' last
        tokens). The caches hold the prompt, the new tokens and one full draft. The prompt is prefilled in
        pieces of PREFILL_PIECE columns (`begin`, then `prefill_piece` until none is left)."""
        last = self.begin(ids, positions, valid, max_new_tokens, prefix)
        while self.prefill_piece():
            pass
        return last

    def begin(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int,
              prefix: tuple[int, Tensor, Tensor] | None = None, *, cache: StaticCache | None = None,
              offset: int = 0) -> Tensor:
        """`start` without its prefill: the caches made, the prompt columns (all but `last`) left to
        `prefill_piece`. prefix (one row, no padding): (m, keys, values [layers, H_kv, ≥m, hd]) — the keys and
        values of the prompt's first m tokens (`prefix_cache.PrefixCache.match`), copied in instead of fed.
        cache: the target's cache, B rows of capacity ≥ offset + W + max_new_tokens + MAX_DRAFT_TOKENS + 2
        (`begin_join`: rows of the merged cache), its prompt columns from column `offset` on (the ones before
        it left empty); None: a new one, from column 0."""
        b, w = ids.shape
        self.capacity = offset + w + max_new_tokens + MAX_DRAFT_TOKENS + 2
        if cache is None:
            self.target = self.lean.new_cache(b, self.capacity)
        elif cache.batch != b or cache.capacity < self.capacity or cache.length > offset:
            raise ValueError(f"cache: {b} rows of at least {self.capacity} columns, none used before column {offset}; "
                             f"got {cache.batch} rows of {cache.capacity}, {cache.length} used")
        else:
            self.target, self.capacity = cache, cache.capacity
            cache.length = offset
        self.draft_cache = self.draft.new_cache(b, self.capacity) if isinstance(self.draft, Draft) else None
        self.next_pos = positions[:, -1].clone()  # the position of `last`
        self.k = [AdaptiveK(self.k0, self.adaptive) for _ in range(b)] if self.draft is not None else []
        self._prefill = (ids[:, :-1], positions[:, :-1], None if valid is None else valid[:, :-1], 0) \
            if w > 1 else None
        if prefix is not None and w > 1:
            m = min(prefix[0], w - 1)  # `last` is always fed by the first round
            if b != 1 or valid is not None:
                raise ValueError("prefix: only for one row without padding")
            cols = slice(offset, offset + m)
            self.target.keys[:, 0, :, cols] = prefix[1][:, :, :m]
            self.target.values[:, 0, :, cols] = prefix[2][:, :, :m]
            self.target.valid[0, cols] = True
            self.target.positions[0, cols] = positions[0, :m]
            self.target.tokens[0, cols] = ids[0, :m]
            self.target.length = offset + m
            self._prefill = (ids[:, :-1], positions[:, :-1], None, m) if m < w - 1 else None
        return ids[:, -1].clone()

    @property
    def prefilling(self) -> bool:
        """Whether prompt columns are left for `prefill_piece`."""
        return self._prefill is not None

    @torch.inference_mode()
    def prefill_piece(self, size: int | None = None) -> bool:
        """Feed the next `size` (default PREFILL_PIECE) prompt columns to the target; True while columns are
        left. Attention's scores for a piece are [B, heads, size, columns so far], so a long prompt never needs
        [heads, W, W] at once, and the scheduler can run decode rounds between the pieces of a joining prompt."""
        if self._prefill is None:
            return False
        ids, positions, valid, at = self._prefill
        end = min(at + (size or PREFILL_PIECE), ids.shape[1])
        self.lean(ids[:, at:end], positions[:, at:end], self.target, None if valid is None else valid[:, at:end])
        self._prefill = None if end == ids.shape[1] else (ids, positions, valid, end)
        return self._prefill is not None

    def select(self, rows: Tensor) -> None:
        self.target.select(rows)
        if self.draft_cache is not None:
            self.draft_cache.select(rows)
        self.next_pos = self.next_pos.index_select(0, rows)
        self.k = [self.k[i] for i in rows.tolist()] if self.k else []

    @torch.inference_mode()
    def round(self, last: Tensor, configs: list, history: list[list[int]] | None, prompt_len: list[int],
              steps: list[int], generator: torch.Generator | None, scored: list[bool] | None = None,
              states: list | None = None, matchers: list | None = None) -> Round:
        """One round. `last` [B] each row's newest token (not yet in the caches); `history` each row's tokens
        so far, `last` included (None when no row uses penalties); `prompt_len` [B]; `steps` [B] each row's
        count of generated tokens (the step of its next token); `scored` [B] whether a row's scores will be
        read from the round's logits (None: all; rows without may get screened logits, `decode_logits`); `states`
        each row's `sampling.RowState` (None: no row keeps state). A round with a stateful row (`_stateful`) drafts
        nothing: every row takes one plain step, and the row's state moves once, as in the plain loop.

        `matchers` [B] (`constrain.Matcher` or None): a constrained row's mask is applied to its logits at every
        position it judges, before the pipeline (`apply_masks`). Its n-gram drafts are taken by its matcher
        while allowed (a forbidden draft ends the row's draft: the target could never choose it), so each
        position's mask is the one the plain loop would compute there and the tokens are the plain loop's; the
        rejected drafts are rolled back (`settle_round`). The int8 draft proposes from unmasked logits, so a
        constrained row judges none of its drafts (its round is a plain step)."""
        ks = [a.k for a in self.k]
        if self.greedy_only and ks:
            ks = [kr if c.is_greedy else 0 for kr, c in zip(ks, configs, strict=True)]
        if states is not None and any(_stateful(c) for c in configs):
            ks = [0] * len(ks)
        if matchers is not None and ks and isinstance(self.draft, Draft):
            ks = [0 if m is not None else kr for kr, m in zip(ks, matchers, strict=True)]
        k = max(ks, default=0)  # the round drafts for the most hopeful row; each row verifies its own k
        self._t = time.perf_counter()
        self._room(k + 1)
        drafts, q, taken = None, None, None
        if k and isinstance(self.draft, NgramDraft):
            # the coded products cost ~linearly in rows beyond ~8 (compute, not memory): a verification of
            # B·(k+1) > 8 positions costs more than the drafts save, so a wide batch drafts less, or not at all
            cap = NGRAM_MAX_POSITIONS // len(ks) - 1
            ks = [min(kr, max(cap, 0)) for kr in ks]
            forced = None if matchers is None else [None if m is None else m.forced() for m in matchers]
            drafts, ks = self._lookup(last, ks, forced)
            taken = take_drafts(matchers, drafts, ks)  # constrained rows: ks cut where a draft is forbidden
            if drafts is not None and max(ks) == 0:
                drafts = None
            k = 0 if drafts is None else drafts.shape[1]
            self._lap("draft")
        elif k:
            drafts, q = self._propose(last, k, configs, history, prompt_len, steps, generator)
            self._lap("draft")
        ids = last[:, None] if drafts is None else torch.cat([last[:, None], drafts], dim=1)     # [B,k+1]
        start = self.target.length
        positions = self.next_pos[:, None] if k == 0 else self.next_pos[:, None] + torch.arange(k + 1)   # [B,k+1]
        hidden = self.lean(ids, positions, self.target)
        self._lap("body")
        logits, cands = decode_head(self.head, hidden, configs, scored)                      # [B,k+1,V]
        self._lap("head")
        if matchers is not None:
            if taken is None:  # no n-gram lookup this round: each constrained row judges position 0 only
                taken = take_drafts(matchers, None, ks)
            apply_masks(logits, taken)
        chosen = raw = None
        if k == 0 and cands is not None:  # screened: every row's choice reads its candidates only
            tokens, n = self._candidates(cands[0][:, 0], cands[1][:, 0], configs, prompt_len, steps, generator)
        elif k == 0:
            tokens, n, chosen, raw = self._plain_or_forced(logits[:, 0], configs, history, prompt_len, steps,
                                                           generator, taken, states)
        elif q is None:  # point-mass drafts, or greedy and seeded rows only
            tokens, n, chosen, raw = self._draws(logits, drafts, ks, configs, history, prompt_len, steps,
                                                 generator, cands)
            self._count(n, ks)
        else:
            tokens, n = self._accept(logits, drafts, q, ks, configs, history, prompt_len, steps, generator)
            self._count(n, ks)
        accepted = n.tolist()
        self._keep(start, accepted)
        self.next_pos += n + 1 if any(accepted) else 1
        self._lap("sampling")
        keep = [a + 1 for a in accepted]
        rnd = Round(tokens, [logits[r, :m] for r, m in enumerate(keep)], [hidden[r, :m] for r, m in enumerate(keep)],
                    chosen, raw)
        return rnd if matchers is None else settle_round(rnd, matchers, taken)

    @torch.inference_mode()
    def join(self, ids: Tensor, positions: Tensor, valid: Tensor | None, max_new_tokens: int) -> Tensor:
        """Add rows to the running batch (continuous batching): ids, positions [B',W] as for `start` → their
        `last` [B']; the new rows come after the running ones. max_new_tokens: the most tokens any row, old or
        new, still generates (the merged caches hold every row's columns, that many more and one full draft).
        The new rows' prompts are prefilled apart, then every row's columns are merged right-aligned
        (`merge_caches`): masks use validity, order and positions only, so no row's attention changes."""
        other, last = self.begin_join(ids, positions, valid, max_new_tokens)
        self.finish_join(other, max_new_tokens)
        return last

    def begin_join(self, ids: Tensor, positions: Tensor, valid: Tensor | None,
                   max_new_tokens: int, prefix: tuple[int, Tensor, Tensor] | None = None) -> tuple[Decoder, Tensor]:
        """`join` in steps (chunked prefill): a Decoder for the new rows, its prompt not yet fed (→ it and the
        rows' `last` [B']); `other.prefill_piece()` feeds it a piece at a time, between this decoder's rounds;
        `finish_join(other, ...)` feeds what is left and merges it.

        The merged cache is made here, B + B' rows, and the new rows prefill straight into its last B'
        (`StaticCache.view`), their columns ending where the running rows' do now: the merge then copies only the
        running rows' columns, never the prompt's (a long prompt's cache is its size; a copy of it, and of the
        whole merged cache's zeros, had been most of a merge). Its columns past what the rows write are
        `lean.cache_zeros`' untouched pages: they cost no time and no memory."""
        other = Decoder(self.lean, self.head, self.draft, self.k0, self.adaptive, self.stats, self.profile,
                        self.greedy_only)
        live, (b_new, w) = self.target, ids.shape
        held = int(live.valid[:, :live.length].sum(dim=1).max()) if live.batch else 0
        offset = max(0, held - (w - 1))
        # the running rows' new columns while the prompt is prefilled: a round adds 1 to MAX_DRAFT_TOKENS + 1, a
        # piece feeds at least a few prompt columns (more would still merge, by a copy of both: `finish_join`)
        slack = 2 * w + MAX_DRAFT_TOKENS + 2
        merged = self.lean.new_cache(live.batch + b_new, offset + w + slack + max_new_tokens + MAX_DRAFT_TOKENS + 2)
        last = other.begin(ids, positions, valid, max_new_tokens, prefix,
                           cache=merged.view(live.batch, live.batch + b_new), offset=offset)
        other._merged = (merged, live.batch)
        return other, last

    @torch.inference_mode()
    def finish_join(self, other: Decoder, max_new_tokens: int) -> None:
        """Merge `other` (from `begin_join`, its prefill finished here if it is not) after the running rows: each
        running row's valid columns are copied, right-aligned, into the rows before `other`'s in the cache
        `begin_join` made (`merge_caches`' layout: holes dropped); `other`'s stay where they were written."""
        while other.prefill_piece():
            pass
        room = max_new_tokens + MAX_DRAFT_TOKENS + 2
        live, new = self.target, other.target
        counts = live.valid[:, :live.length].sum(dim=1)
        m = max(new.length, int(counts.max()) if counts.numel() else 0)
        merged, first_new = other._merged if other._merged is not None else (None, 0)
        if (merged is not None and live.batch <= first_new and m + room <= merged.capacity
                and new.keys.data_ptr() == merged.keys[:, first_new].data_ptr()):
            top = first_new - live.batch  # fewer running rows than at `begin_join`: some left meanwhile
            for r in range(live.batch):
                gather_row(merged, top + r, live, r, m)
            self.target = merged.view(top, first_new + new.batch)
            self.target.length = m
        else:  # the running rows outgrew the room `begin_join` left: both copied into a new cache
            self.target = merge_caches([live, new], room)
        other._merged = None
        self.capacity = self.target.capacity
        if self.draft_cache is not None:  # empty: the draft re-reads every column in its next forward
            self.draft_cache = self.draft.new_cache(self.target.batch, self.capacity)
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.k = self.k + other.k

    def _room(self, t: int) -> None:
        """Compact the target's cache when the next `t` columns would not fit; the draft then re-reads every
        column in its next forward (compaction is rare: one row per batch never leaves holes)."""
        if self.target.length + t <= self.capacity:
            return
        self.target.compact()
        if self.draft_cache is not None:
            self.draft_cache.truncate(0)

    def _propose(self, last: Tensor, k: int, configs: list, history, prompt_len, steps,
                 generator) -> tuple[Tensor, Tensor | None]:
        """The draft's k tokens [B,k] and, when a row samples, the processed distributions q [B,k,V]."""
        cache, target = self.draft_cache, self.target
        pending = slice(cache.length, target.length)
        ids = torch.cat([target.tokens[:, pending], last[:, None]], dim=1)
        positions = torch.cat([target.positions[:, pending], self.next_pos[:, None]], dim=1)
        valid = torch.cat([target.valid[:, pending], torch.ones_like(last, dtype=torch.bool)[:, None]], dim=1)
        x = self.draft.logits(ids, positions, cache, valid)[:, -1]                          # [B,V]
        drafted: list[list[int]] = [[] for _ in configs]
        dists = []
        for i in range(k):
            prev = None if history is None else [h + d for h, d in zip(history, drafted, strict=True)]
            d, p = _choose(x, configs, prev, prompt_len, [s + i for s in steps], generator)
            if p is not None:
                dists.append(p)
            for row, t in zip(drafted, d.tolist(), strict=True):
                row.append(t)
            if i + 1 < k:
                x = self.draft.logits(d[:, None], self.next_pos[:, None] + 1 + i, cache)[:, -1]
        q = torch.stack(dists, dim=1) if dists else None
        return torch.tensor(drafted, dtype=torch.long), q

    def _lookup(self, last: Tensor, ks: list[int], forced: list | None = None) -> tuple[Tensor | None, list[int]]:
        """The n-gram draft per row from the row's tokens in the target's cache and `last`: drafts [B,w]
        (rows with fewer proposals padded with their last token, never judged) and each row's count of
        proposals (its k this round). (None, zeros) when no row has a proposal: the round is a plain step.
        forced [B]: a constrained row's forced continuation (`Matcher.forced`: the tokens its grammar allows as
        the only way on) drafts in place of the n-grams — jump-forward through the verification's one forward:
        the target's choice under a one-token mask is that token, so they are accepted, and judged as any draft."""
        length = self.target.length
        tokens, valid = self.target.tokens[:, :length], self.target.valid[:, :length]
        rows = [forced[r][:kr] if forced is not None and forced[r] else
                self.draft.propose(tokens[r][valid[r]].tolist() + [int(last[r])], kr) for r, kr in enumerate(ks)]
        counts = [len(p) for p in rows]
        width = max(counts, default=0)
        if width == 0:
            return None, counts
        drafts = torch.tensor([p + [int(last[r])] * (width - len(p)) for r, p in enumerate(rows)], dtype=torch.long)
        return drafts, counts

    def _plain(self, logits: Tensor, configs, history, prompt_len, steps, generator, states=None,
               unmasked: bool = True):
        """No draft: one token per row from the plain sampler's distribution (`plain_choice`, scored: seeded and
        greedy rows exactly `sampling.sample`'s ids), its processed logprob and — plain greedy rows, whose
        argmax and normaliser one C pass finds (`native.greedy_rows`) — its raw logprob (else None). Plain
        unseeded sampled rows are drawn by `native.sample_row`, one C call each: the same distribution, other ids
        for the same generator state than `plain_choice`'s — but not in a round with a constrained row (`unmasked`
        False): its inverse CDF may stop on a token of zero mass (u = 0 before the first allowed token), so such
        rounds draw in the pipeline. The greedy C pass takes masked rows (the argmax of the allowed tokens). Rows
        with a step C does not run (`_plain` false) make the round take the pipeline, whose time the profile then
        books under "sampling, torch path (<steps>)"."""
        n = self._none_accepted.get(len(configs))
        if n is None:  # read only: one per batch size, not a new tensor every round
            n = self._none_accepted[len(configs)] = torch.zeros(len(configs), dtype=torch.long)
        if all(_plain_greedy(c) for c in configs):
            # the argmax of the unprocessed row is `sample`'s choice; one call instead of the pipeline's ~30 torch
            # ops, which after a step that streamed the weights through the caches cost ~1 ms per token
            found = greedy_rows(logits)
            if found is not None:
                ids, raw = found
                return [[t] for t in ids], n, [[0.0] for _ in configs], [[v] for v in raw]
        if unmasked and all(_plain_unseeded(c) for c in configs):
            # the same distribution from one C call per row (`native.sample_row`: the top-k / top-p cut or the whole
            # row, drawn by inverse CDF with one uniform): the pipeline's ~20 torch ops around its cut cost ~1 ms
            # per token after a step that streamed the weights through the caches
            u = torch.rand(len(configs), dtype=torch.float64, generator=generator).tolist()
            width = logits.shape[1]
            picked = [sample_row(logits[r], c.temperature, c.cut_key(width).top_k, c.top_p, c.min_p, u[r])
                      for r, c in enumerate(configs)]
            if all(p is not None for p in picked):
                return [[t] for t, _ in picked], n, [[lp] for _, lp in picked], None
        ids, chosen = plain_choice(logits, configs, history, prompt_len, steps, generator, scored=True, states=states)
        slow = _torch_steps(configs)
        if slow:
            self._lap(f"sampling, torch path ({slow})")
        return [[int(t)] for t in ids.tolist()], n, [[v] for v in chosen.tolist()], None

    def _plain_or_forced(self, logits: Tensor, configs, history, prompt_len, steps, generator, taken, states=None):
        """`_plain`, but a constrained row whose mask allows one token only (a forced token: a schema's fixed keys)
        takes it without a draw — no pipeline, no random number from the shared generator — scored as what it is,
        probability 1 (processed and raw logprob 0, rank 1 under the masked logits)."""
        from lmhead.constrain import forced_token

        forced = [None] * len(configs) if taken is None else [
            None if got is None else forced_token(got[0][0]) for got in taken]
        if all(f is None for f in forced):
            return self._plain(logits, configs, history, prompt_len, steps, generator, states, taken is None)
        free = [r for r, f in enumerate(forced) if f is None]
        tokens = [[f] for f in forced]
        chosen, raw = [[0.0] for _ in forced], [[0.0] for _ in forced]
        if free:
            pick = (lambda xs: [xs[r] for r in free])
            sub_tokens, _, sub_chosen, sub_raw = self._plain(
                logits[torch.tensor(free)], pick(configs), None if history is None else pick(history),
                pick(prompt_len), pick(steps), generator, None if states is None else pick(states), False)
            for j, r in enumerate(free):
                tokens[r], chosen[r] = sub_tokens[j], sub_chosen[j]
                if sub_raw is not None:
                    raw[r] = sub_raw[j]
            if sub_raw is None:
                raw = None  # the free rows' raw logprobs come from the logits (`generate._flat_scores`)
        return tokens, torch.zeros(len(configs), dtype=torch.long), chosen, raw

    def _candidates(self, vals: Tensor, ids: Tensor, configs, prompt_len, steps, generator):
        """No draft, a screened round (scoreless rows without bias, bans or penalties): one token per row, the plain
        sampler's choice from the row's candidates vals, ids [B,c] (`decode_head`) — every token its greedy or
        top-k choice can read, so the same token as from the whole row (seeded draws race in id order) at the
        cost of c columns instead of V."""
        local = plain_choice(vals, configs, None, prompt_len, steps, generator)
        return [[t] for t in ids.gather(1, local[:, None]).squeeze(1).tolist()], torch.zeros(len(configs),
                                                                                             dtype=torch.long)

    def _accept(self, logits: Tensor, drafts: Tensor, q: Tensor | None, ks: list[int], configs, history,
                prompt_len, steps, generator) -> tuple[list[list[int]], Tensor]:
        """Per row the emitted tokens and the count n [B] of accepted drafts; row r judges its first ks[r]
        drafts only (what it would have drafted alone). Greedy and seeded rows: the plain sampler's choice at
        each position, accepted while it equals the draft; other rows the min(1, p/q) rule against q."""
        b, width, vocab = logits.shape
        rows = drafts.tolist()
        # the pipeline at every position: position i follows the row's history and d_1..d_i
        flat_cfg = [c for c in configs for _ in range(width)]
        prev = None if history is None else [history[r] + rows[r][:i] for r in range(b) for i in range(width)]
        plen = [pl for pl in prompt_len for _ in range(width)]
        flat_steps = [s + i for s in steps for i in range(width)]
        choice, p = _pipeline(logits.reshape(b * width, vocab), flat_cfg, prev, plen, flat_steps)
        tokens, n = [], torch.zeros(b, dtype=torch.long)
        for r in range(b):
            kr, base = ks[r], r * width
            if _deterministic(configs[r]):
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

    def _draws(self, logits: Tensor, drafts: Tensor, ks: list[int], configs, history, prompt_len, steps,
               generator, cands: tuple[Tensor, Tensor] | None = None
               ) -> tuple[list[list[int]], Tensor, list[list[float]], list[list[float]] | None]:
        """Drafts judged by the plain sampler's draws (every row of a point-mass draft, or rows that are all
        greedy or seeded): position by position, each row still accepting draws its token there
        (`plain_choice`, scored) and goes on while it equals its next draft, up to its ks[r]. → (per row the
        emitted tokens, the count n [B] of accepted drafts, per row each emitted token's processed logprob,
        and — plain greedy rows, chosen at every position in one C pass — their raw logprobs, else None).
        Only the positions a row reaches are drawn: a rejection at the first draft costs one draw. A screened
        round (`cands`: each position's candidates, `decode_head`) draws from them: the same tokens and processed
        logprobs, c columns instead of V."""
        b = logits.shape[0]
        rows = drafts.tolist()
        tokens: list[list[int]] = [[] for _ in range(b)]
        scores: list[list[float]] = [[] for _ in range(b)]
        if all(_plain_greedy(c) for c in configs):
            found = greedy_rows(logits.reshape(-1, logits.shape[-1]))  # every position's argmax: one call
            if found is not None:
                width = logits.shape[1]
                ids = [found[0][r * width:(r + 1) * width] for r in range(b)]
                raw = [found[1][r * width:(r + 1) * width] for r in range(b)]
                for r in range(b):
                    m = 0  # accepted drafts: the argmax equals the draft, up to the row's own k
                    while m < ks[r] and ids[r][m] == rows[r][m]:
                        m += 1
                    tokens[r], scores[r] = ids[r][:m + 1], [0.0] * (m + 1)
                    raw[r] = raw[r][:m + 1]
                return tokens, torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long), scores, raw
        live, i = list(range(b)), 0
        source = logits if cands is None else cands[0]
        while live:
            pick = slice(None) if len(live) == b else torch.tensor(live)
            x = source[pick, i]                                                         # [b',V] or [b',c]
            prev = None if history is None else [history[r] + rows[r][:i] for r in live]
            ids, lp = plain_choice(x, [configs[r] for r in live], prev, [prompt_len[r] for r in live],
                                   [steps[r] + i for r in live], generator, scored=True)
            if cands is not None:
                ids = cands[1][pick, i].gather(1, ids[:, None]).squeeze(1)
            going = []
            for r, t, v in zip(live, ids.tolist(), lp.tolist(), strict=True):
                tokens[r].append(t)
                scores[r].append(v)
                if i < ks[r] and t == rows[r][i]:
                    going.append(r)
            live, i = going, i + 1
        return tokens, torch.tensor([len(t) - 1 for t in tokens], dtype=torch.long), scores, None

    def _count(self, n: Tensor, ks: list[int]) -> None:
        self.stats.rounds += 1
        self.stats.drafted += sum(ks)
        self.stats.accepted += int(n.sum())
        self.stats.emitted += int(n.sum()) + len(n)
        for adaptive, nr, kr in zip(self.k, n.tolist(), ks, strict=True):
            adaptive.update([nr], kr)

    def _keep(self, start: int, n: list[int]) -> None:
        """After a round wrote columns start..: row r keeps start..start+n[r]; the draft's cache follows."""
        keep = max(n) + 1
        self.target.truncate(start + keep)
        for r, nr in enumerate(n):
            if nr + 1 < keep:
                self.target.invalidate(r, start + nr + 1)
        cache = self.draft_cache
        if cache is None:
            return
        if cache.length > self.target.length:
            cache.truncate(self.target.length)
        for r, nr in enumerate(n):
            if start + nr + 1 < cache.length:
                cache.invalidate(r, start + nr + 1)


def merge_caches(caches: list[StaticCache], room: int) -> StaticCache:
    """The rows of `caches`, in order, in one new cache: each row's valid columns (keys, values, positions,
    tokens) moved, in order, to the right end of the first m columns (m = the most any row holds; `length`
    = m) and `room` free columns after them. Holes (padding, rejected drafts, columns of rows that finished
    earlier) are dropped, as `StaticCache.compact` drops them."""
    first = caches[0]
    counts = torch.cat([c.valid[:, :c.length].sum(dim=1) for c in caches])
    m = int(counts.max()) if counts.numel() else 0
    layers, _, kv_heads, _, head_dim = first.keys.shape
    out = StaticCache(layers, len(counts), kv_heads, head_dim, m + room, first.keys.dtype, first.keys.device)
    row = 0
    for cache in caches:
        for r in range(cache.batch):
            gather_row(out, row, cache, r, m)
            row += 1
    out.length = m
    return out


def decode_logits(head, hidden: Tensor, configs: list, scored: list[bool] | None = None) -> Tensor:
    """The decode head's float32 logits [B,T,V] for hidden [B,T,D] (row b under configs[b]), each row as it
    would be alone wherever its tokens depend on it.

    A head with an approximate tail (a `CompressedHead`: which kernel runs, which tokens are re-scored and
    when the full head takes over depend on the other rows of the call) is exact on its top `exact_k`
    tokens only. A greedy or seeded row whose choice may read the tail — a draw from beyond the exact top-k,
    a logit bias or a penalty that can move a tail token up — gets a head call of its own, so that its
    tokens do not depend on the batch it decodes in. Other rows (and every row of the fp32 head, all of
    whose logits are exact) share one call.

    `scored` [B]: whether each row's scores (its normaliser: every logit) will be read; None = all. When no row
    is, every row's choice reads only its top k (`screen_k`) and the call has at least SCREEN_MIN_ROWS
    positions, a head that can screen (`LMHead.screen`: Q8_0 codes, both packaged models' heads) gives each row's top
    k exactly — the one-row product's values — and the rest below them, at ~0.6 of the exact product's
    arithmetic; the tokens are the same.
    """
    return decode_head(head, hidden, configs, scored)[0]


def decode_head(head, hidden: Tensor, configs: list, scored: list[bool] | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """`decode_logits`' logits [B,T,V] and, where the call was screened, the candidates each position's choice
    reads: values [B,T,c] and ids [B,T,c] (`CodedLinear.screen_candidates`; -inf past a position's own count)
    — a choice over them is the choice over the whole row; None otherwise."""
    from lmhead.compressed import CompressedHead

    if not isinstance(head, CompressedHead):
        screened = None if scored is None else _screened(head, hidden, configs, scored)
        if screened is not None:
            return screened
        logits = head(hidden)
        return (logits if logits.dtype == torch.float32 else logits.float()), None
    alone = [r for r, c in enumerate(configs) if _reads_tail(c, head.exact_k)] if hidden.shape[0] > 1 else []
    if not alone:
        return head(hidden).float(), None
    shared = [r for r in range(len(configs)) if r not in alone]
    out = hidden.new_empty((*hidden.shape[:-1], head.vocab_size), dtype=torch.float32)
    if shared:
        out[shared] = head(hidden[shared]).float()
    for r in alone:
        out[r:r + 1] = head(hidden[r:r + 1]).float()
    return out, None


def screen_k(config, scored: bool) -> int:
    """How many of a row's top logits its choice reads when that is all it reads: a row without scores, without
    bias, bans or penalties, greedy (its argmax) or with a top-k of at most SCREEN_MAX_K (top-p and min-p then act
    inside it) → that k + 1 (the one after the k-th is exact too, whatever a tie test reads); else 0."""
    if scored or not _plain(config):
        return 0
    if config.is_greedy:
        return 2
    return config.top_k + 1 if 1 <= config.top_k <= SCREEN_MAX_K else 0


def _screened(head, hidden: Tensor, configs: list, scored: list[bool]
              ) -> tuple[Tensor, tuple[Tensor, Tensor] | None] | None:
    """`decode_head`'s screened call, or None where it does not apply (a row that needs more than its top k, too
    few positions, a head without a screen)."""
    screen = getattr(head, "screen_candidates", None)
    b, t, d = hidden.shape
    if screen is None or b * t < SCREEN_MIN_ROWS:
        return None
    ks = [screen_k(c, s) for c, s in zip(configs, scored, strict=True)]
    if not all(ks):  # a scored or wide row needs its whole row: one exact call for all, as before
        return None
    got = screen(hidden.reshape(b * t, d), [k for k in ks for _ in range(t)])
    if got is None:
        return None
    logits, cands = got
    if cands is not None:
        cands = (cands[0].view(b, t, -1), cands[1].view(b, t, -1))
    return logits.view(b, t, -1), cands


def _plain(config) -> bool:
    """Every step the row runs declares the C backend (``SamplingConfig.runs_on("c")``: temperature, top-k, top-p,
    min-p, in lmhead's order; no masks, penalties or other steps): the row's logits reach its cut-offs as the head
    gave them, and its choice reads only what those cut-offs read."""
    return config.runs_on("c")


def _stateful(config) -> bool:
    """A row with a step that keeps state between tokens (mirostat's μ): it takes plain steps only, one token a
    round, so that its state moves once per token as in the plain loop."""
    return any(s.state for s in config.steps())


def _torch_steps(configs) -> str:
    """The names of the steps that keep rows off the C path (for the profile's phase), "" when none."""
    names = sorted({s.name for c in configs if not c.runs_on("c") for s in c.steps() if "c" not in s.backends})
    return ", ".join(names)


def _reads_tail(config, exact_k: int) -> bool:
    """Whether a reproducible (greedy or seeded) row's choice can depend on logits outside the head's exact
    top `exact_k`."""
    if not _deterministic(config):
        return False  # an unseeded draw is not reproducible anyway: its distribution is what counts
    return not (_plain(config) and (config.is_greedy or 1 <= config.top_k <= exact_k))


def plain_choice(logits: Tensor, configs: list, history, prompt_len, steps: list[int], generator,
                 scored: bool = False, states: list | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """The plain loop's next token per row of logits [B,V] → ids [B]: `sampling.sample` with each row's
    history (penalties), its prompt length and the step of its token (rows that joined the batch at other times
    are at other steps). One config for all rows when they share one object, so the pipeline takes its
    whole-batch path. scored: (ids, each id's processed logprob [B]) from `sampling.sample_with_logprobs`
    (`sample`'s ids, but for unseeded top-p-alone rows, drawn from the same distribution another way). states: one
    `sampling.RowState` per row, moved by its stateful steps (None where no row has one)."""
    from lmhead.sampling import sample, sample_with_logprobs

    cfg = configs[0] if len({id(c) for c in configs}) == 1 else configs
    draw = sample_with_logprobs if scored else sample
    return draw(logits, cfg, generator=generator, prev_tokens=history,
                prompt_len=prompt_len if history is not None else 0,
                step=steps[0] if len(set(steps)) == 1 else list(steps), state=states)


def _plain_greedy(config) -> bool:
    """A greedy row without bias, bans or penalties: its token is the argmax of the raw logits."""
    return config.is_greedy and _plain(config)


def _plain_unseeded(config) -> bool:
    """A sampled row without a seed, bias, bans or penalties: `native.sample_row` draws it."""
    return not config.is_greedy and config.seed is None and _plain(config)


def _deterministic(config) -> bool:
    """Greedy and seeded rows: the plain sampler's choice is a function of the logits and (seed, step)."""
    return config.is_greedy or config.seed is not None


def _pipeline(x: Tensor, configs: list, prev, plen, steps: list[int]) -> tuple[Tensor | None, Tensor | None]:
    """For rows x [N,V]: the plain sampler's choice for greedy and seeded rows (ids [N], other rows 0; a
    seeded row draws with its (seed, step) noise, exactly as the plain loop) and the processed distributions
    for the other sampled rows (probs [N,V]). None where no row needs it."""
    from lmhead.sampling import probabilities, sample

    def pick(rows: list[int]):
        sub_prev = None if prev is None else [prev[r] for r in rows]
        return [configs[r] for r in rows], sub_prev, [plen[r] for r in rows] if prev is not None else 0

    fixed = [r for r, c in enumerate(configs) if _deterministic(c)]
    free = [r for r, c in enumerate(configs) if not _deterministic(c)]
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


def _choose(x: Tensor, configs: list, prev, plen, steps: list[int], generator) -> tuple[Tensor, Tensor | None]:
    """The draft's token per row of x [B,V]: what the plain sampler would choose from the draft's logits
    (greedy and seeded rows: the same (seed, step) noise as the target's check) or, for other sampled rows, a
    draw from the processed distribution, returned as q [B,V] for the acceptance rule."""
    ids, probs = _pipeline(x, configs, prev, plen, steps)
    if ids is None:
        ids = torch.zeros(len(configs), dtype=torch.long)
    for r, c in enumerate(configs):
        if not _deterministic(c):
            ids[r] = _draw(probs[r], generator)
    return ids, probs


# --- structured output: the constraint's masks in a round ------------------------------------------------


def take_drafts(matchers: list | None, drafts: Tensor | None, ks: list[int]) -> list | None:
    """Each constrained row's masks for the positions it will judge: its matcher takes the row's first ks[r]
    drafts while each is allowed (`Matcher.draft`), and ks[r] becomes the count taken (a forbidden draft could
    never be the target's choice: judging it would only reject it). → per row (bits [m+1, W], m) or None (a
    free row); None when no row is constrained. ks is changed in place."""
    if matchers is None:
        return None
    rows = None if drafts is None else drafts.tolist()
    taken: list = []
    for r, m in enumerate(matchers):
        if m is None:
            taken.append(None)
            continue
        bits, n = m.draft([] if rows is None or r >= len(ks) else rows[r][:ks[r]])
        if r < len(ks):
            ks[r] = n
        taken.append((bits, n))
    return taken


def apply_masks(logits: Tensor, taken: list | None) -> None:
    """logits [B,T,V]: a constrained row's positions 0..m get its masks (-inf where forbidden), in place, before
    any step of the pipeline; its later positions are never judged."""
    if taken is None:
        return
    from lmhead.constrain import apply_bitmask_

    for r, got in enumerate(taken):
        if got is not None:
            apply_bitmask_(logits[r, :got[0].shape[0]], got[0])


def settle_round(rnd: Round, matchers: list | None, taken: list | None) -> Round:
    """The round's tokens given to the constrained rows' matchers (rejected drafts rolled back, the new token
    consumed, `Matcher.settle`); a row whose grammar completed before its last token keeps the tokens up to there
    (its Round entries cut to them)."""
    if matchers is None or taken is None:
        return rnd
    for r, got in enumerate(taken):
        if got is None:
            continue
        keep = matchers[r].settle(rnd.tokens[r], got[1])
        if keep < len(rnd.tokens[r]):
            rnd.tokens[r] = rnd.tokens[r][:keep]
            rnd.logits[r] = rnd.logits[r][:keep]
            if rnd.hidden is not None:
                rnd.hidden[r] = rnd.hidden[r][:keep]
            for part in (rnd.logprobs, rnd.raw):
                if part is not None:
                    part[r] = part[r][:keep]
    return rnd

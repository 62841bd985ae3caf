"""What a round drafts, as the engine (`engine.Decoder`) sees it: k per row, the counts, and the two kinds of draft.

    LookupDraft   a point mass proposed from the row's own tokens (`speculative.NgramDraft`): judged by the plain
                  sampler's draws at each position, so it needs no acceptance rule of its own
    ModelDraft    a draft with its own forward and cache (`speculative.Draft`, int8): proposes tokens and, for
                  sampled rows, their distributions q, and judges them by its own exact acceptance rule

The engine asks a draft only what these protocols declare; the drafts and their rules live in
`lmhead.speculative`, above this package, and are handed to a `Decoder` as objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lmhead import checks
from lmhead.models.lean import StaticCache

MAX_DRAFT_TOKENS = 16


def check_draft_tokens(value: object) -> int:
    """k, the tokens drafted per verification: an int in [1, MAX_DRAFT_TOKENS]."""
    if not checks.is_int(value) or not 1 <= value <= MAX_DRAFT_TOKENS:
        raise ValueError(f"draft_tokens must be an int in [1, {MAX_DRAFT_TOKENS}], got {value!r}")
    return int(value)


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
    drafted tokens are rejected (the expected tokens per round, (1 − a^{k+1})/(1 − a), saturates for a < 1).

    And a row whose drafts keep missing rests: after a round that drafted and had none accepted it takes plain
    steps for 1, 2, 4, … (at most MAX_REST) rounds before it drafts again, the pause doubling with each miss in a
    row and gone with the first accepted token. A verification of k + 1 positions costs more than a step (the
    several-row products rebuild each weight), so drafts that miss — prose, where a lookup often finds a short
    match that the model does not follow — cost more than they save, while text that repeats keeps drafting
    (docs/decode.md)."""

    MAX_REST = 32

    def __init__(self, k: int, adaptive: bool = True) -> None:
        self.k = check_draft_tokens(k)
        self.adaptive = adaptive
        self.low, self.high = 1, MAX_DRAFT_TOKENS if adaptive else k
        self.misses = 0  # rounds in a row that drafted and had nothing accepted
        self.rest = 0    # plain rounds left before this row drafts again

    def next_k(self) -> int:
        """The k this row drafts in the round about to run: 0 while it rests (one round of rest taken)."""
        if self.rest:
            self.rest -= 1
            return 0
        return self.k

    def update(self, accepted: list[int], k: int) -> None:
        if not self.adaptive or not accepted or k == 0:  # k = 0: nothing was drafted, nothing learnt
            return
        if max(accepted) == 0:
            self.misses += 1
            self.rest = min(self.MAX_REST, 1 << (self.misses - 1))
            self.k = self.low  # and it comes back with the cheapest verification, two positions
            return
        self.misses = 0
        if min(accepted) >= k:
            self.k = min(self.high, self.k + 1)
        elif max(accepted) < k // 2:
            self.k = max(self.low, self.k - 1)


class LookupDraft(Protocol):
    """A point-mass draft from the row's own tokens (q = 1 on the proposed token). Its rows are judged as greedy
    ones are: the plain sampler's draw at each position, the longest prefix of drafts equal to it
    (`Decoder._draws`). A constrained row's matcher takes its drafts while they are allowed (`rounds.take_drafts`).

    point_mass: True. max_positions: the most positions (rows × (k + 1)) one verification may score; a wider
    batch drafts less per row, or nothing. propose(tokens, k): up to k ids to follow a row's tokens (its prompt
    and generated ids, newest last)."""

    point_mass: bool

    @property
    def max_positions(self) -> int: ...

    def propose(self, tokens: list[int], k: int) -> list[int]: ...


class ModelDraft(Protocol):
    """A draft with its own forward over a cache that mirrors the target's columns, and its acceptance rule.

    point_mass: False. new_cache(batch, capacity): its empty cache. propose_batch(ids, positions, valid, cache,
    next_pos, k, configs, history, prompt_len, steps, generator): it feeds ids, positions, valid [B,T] (its pending
    columns and each row's `last`; next_pos [B] the position of `last`) and proposes k tokens → (drafts [B,k],
    q [B,k,V] the processed distributions of the rows that sample, None when every row is greedy or seeded).
    accept(logits, drafts, q, ks, configs, history, prompt_len, steps, generator): the target's logits [B,k+1,V]
    judge row r's first ks[r] drafts → (per row the emitted tokens, the count n [B] of accepted drafts); called
    only when q is not None (rows that are all greedy or seeded are judged by the plain sampler's draws). Its
    proposals do not follow a constraint's masks: a constrained row drafts nothing."""

    point_mass: bool

    def new_cache(self, batch: int, capacity: int) -> StaticCache: ...

    def propose_batch(self, ids: Tensor, positions: Tensor, valid: Tensor, cache: StaticCache, next_pos: Tensor,
                      k: int, configs: list, history: list[list[int]] | None, prompt_len: list[int],
                      steps: list[int], generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]: ...

    def accept(self, logits: Tensor, drafts: Tensor, q: Tensor, ks: list[int], configs: list,
               history: list[list[int]] | None, prompt_len: list[int], steps: list[int],
               generator: torch.Generator | None) -> tuple[list[list[int]], Tensor]: ...

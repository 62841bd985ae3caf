"""What one round gives the rows (`Round`), and a constrained row's masks over the positions a round judges.

    take_drafts    each constrained row's matcher takes the drafts it allows → the masks of the positions it judges
    apply_masks    those masks on the round's logits [B,T,V], before any step of the pipeline
    settle_round   the round's tokens given back to the matchers (rejected drafts rolled back)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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

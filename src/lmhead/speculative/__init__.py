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
The pure rules (`accept.py`: `accept_greedy`, `accept_sampled`, `residual`) are apart from the drafts
(`drafts.py`: `Draft`, `NgramDraft`, `draft_for`) and from the engine that runs the rounds
(`lmhead.decode.engine.Decoder`), which takes a draft as an object (`lmhead.decode.drafting`'s protocols) and
never imports this package.
"""

from lmhead.decode.drafting import MAX_DRAFT_TOKENS, AdaptiveK, SpeculativeStats, check_draft_tokens
from lmhead.speculative.accept import accept_greedy, accept_sampled, residual, token_generator
from lmhead.speculative.drafts import (
    DRAFT_MODES,
    NGRAM_MAX_POSITIONS,
    Draft,
    NgramDraft,
    check_draft_mode,
    draft_for,
    frequent_tokens,
)

__all__ = ["DRAFT_MODES", "MAX_DRAFT_TOKENS", "NGRAM_MAX_POSITIONS", "AdaptiveK", "Draft", "NgramDraft",
           "SpeculativeStats", "accept_greedy", "accept_sampled", "check_draft_mode", "check_draft_tokens",
           "draft_for", "frequent_tokens", "residual", "token_generator"]

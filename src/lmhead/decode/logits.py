"""The decode head: a round's float32 logits [B,T,V], each row as it would be alone wherever its tokens depend on it.

    hidden [B,T,D] ──head──▶ logits [B,T,V]   one call for every row (the fp32 head, all of whose logits are exact)
                            a call of its own for a reproducible row whose choice may read a compressed head's tail
                            a screened call (each row's top k exact, the rest below them) when no row's scores are read
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.decode.choice import is_deterministic, is_plain

# `decode_logits`' screened head: from 4 positions (Gemma 3's head, interleaved: 1.3-1.4x the exact product at 4,
# 1.2-1.3x at 5, 1.15-1.25x at 8; ~1.0x at 2-3, where one pass over the codes is memory's time either way)
SCREEN_MIN_ROWS = 4
SCREEN_MAX_K = 64  # the widest top-k a screened row may have (its candidates stay a few dozen more than k)


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
    if scored or not is_plain(config):
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


def _reads_tail(config, exact_k: int) -> bool:
    """Whether a reproducible (greedy or seeded) row's choice can depend on logits outside the head's exact
    top `exact_k`."""
    if not is_deterministic(config):
        return False  # an unseeded draw is not reproducible anyway: its distribution is what counts
    return not (is_plain(config) and (config.is_greedy or 1 <= config.top_k <= exact_k))

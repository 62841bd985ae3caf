"""The decode head: a round's float32 logits [B,T,V], each row as it would be alone wherever its tokens depend on it.

    hidden [B,T,D] ──head──▶ logits [B,T,V]   one call for every row (the fp32 head, all of whose logits are exact)
                            a call of its own for a reproducible row whose choice may read a compressed head's tail
                            a screened call (each row's top k exact, the rest below them) when no row's scores are read
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.decode.choice import is_deterministic, is_plain
from lmhead.kernels import native

# `decode_logits`' screened head: from 2 positions at least (one position is one pass over the codes either way),
# and from as many as the library's screen pays at (`native.screen_min_rows`: benchmarks/bench_kernels.py's screen
# table, Gemma 3's head shape)
SCREEN_MIN_ROWS = 2
SCREEN_MAX_K = 64  # the widest top-k a screened row may have (its candidates stay a few dozen more than k)
# a constrained position whose mask allows at most V / this many tokens gets their exact logits alone (the
# head's rows read at random, one thread) instead of the whole head streamed
FEW_ALLOWED_SHARE = 16


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


def decode_head(head, hidden: Tensor, configs: list, scored: list[bool] | None = None, masks: list | None = None
                ) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """`decode_logits`' logits [B,T,V] and, where the call was screened, the candidates each position's choice
    reads: values [B,T,c] and ids [B,T,c] (`CodedLinear.screen_candidates`; -inf past a position's own count)
    — a choice over them is the choice over the whole row; None otherwise.

    masks [B] (`rounds.take_drafts`' (bits [m+1, W], m) per constrained row, None for a free row; None: no row
    constrained): a call whose every position is a constrained row's, each allowing few tokens, computes those
    tokens' logits alone (`_allowed_only`); a screened call forbids a constrained row's tokens at each position it
    judges before its candidates are chosen, so they are its choice's among the allowed tokens. The caller still
    applies the masks where the call was not screened (`rounds.apply_masks`)."""
    from lmhead.compressed import CompressedHead

    if not isinstance(head, CompressedHead):
        b, t, _ = hidden.shape
        allowed = None if masks is None else _allowed_positions(masks, b, t, head.vocab_size)  # unpacked once
        few = None if allowed is None else _allowed_only(head, hidden, allowed)
        if few is not None:
            return few, None
        screened = None if scored is None else _screened(head, hidden, configs, scored, allowed)
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


def _screened(head, hidden: Tensor, configs: list, scored: list[bool], allowed: list | None = None
              ) -> tuple[Tensor, tuple[Tensor, Tensor] | None] | None:
    """`decode_head`'s screened call, or None where it does not apply (a row that needs more than its top k, too
    few positions, a head without a screen). allowed: `_allowed_positions`' tokens per position (None: free)."""
    screen = getattr(head, "screen_candidates", None)
    b, t, d = hidden.shape
    if screen is None or b * t < max(SCREEN_MIN_ROWS, native.screen_min_rows()):
        return None
    ks = [screen_k(c, s) for c, s in zip(configs, scored, strict=True)]
    if not all(ks):  # a scored or wide row needs its whole row: one exact call for all, as before
        return None
    got = screen(hidden.reshape(b * t, d), [k for k in ks for _ in range(t)], allowed)
    if got is None:
        return None
    logits, cands = got
    if cands is not None:
        cands = (cands[0].view(b, t, -1), cands[1].view(b, t, -1))
    return logits.view(b, t, -1), cands


def _allowed_only(head, hidden: Tensor, allowed: list[Tensor | None]) -> Tensor | None:
    """The logits [B,T,V] of a call whose every position is a constrained row's judged position allowing at most
    V / FEW_ALLOWED_SHARE tokens (`allowed`: `_allowed_positions`' bool [V] per position): those tokens' exact
    values (`LMHead.values_at`: the one-row product's numbers for them) and -inf elsewhere — the masked row
    itself, scores included, at the cost of the allowed rows of the head; None otherwise (a free row, an unjudged
    position, a wide mask, a head without the kernel)."""
    values_at = getattr(head, "values_at", None)
    if values_at is None or any(a is None for a in allowed):
        return None
    most = head.vocab_size // FEW_ALLOWED_SHARE
    ids: list[Tensor] = []
    for a in allowed:
        if not 1 <= int(a.sum()) <= most:  # none allowed: the whole row, whose mask then names the failure
            return None
        ids.append(a.nonzero().flatten())
    b, t, d = hidden.shape
    y = values_at(hidden.reshape(b * t, d), ids)
    return None if y is None else y.view(b, t, -1)


def _allowed_positions(masks: list, b: int, t: int, vocab: int) -> list[Tensor | None] | None:
    """Per position of a [B,T] call (rows × positions, flattened): the bool [V] tokens a constrained row's mask
    allows at a position it judges, None elsewhere (a free row, or a position after the drafts its matcher
    took: never judged); None when no row is constrained."""
    from lmhead.constrain import allowed

    out: list[Tensor | None] = [None] * (b * t)
    for r, got in enumerate(masks):
        if got is not None:
            keep = allowed(got[0], vocab)                                                     # [m+1,V]
            for j in range(min(keep.shape[0], t)):
                out[r * t + j] = keep[j]
    return out if any(a is not None for a in out) else None


def _reads_tail(config, exact_k: int) -> bool:
    """Whether a reproducible (greedy or seeded) row's choice can depend on logits outside the head's exact
    top `exact_k`."""
    if not is_deterministic(config):
        return False  # an unseeded draw is not reproducible anyway: its distribution is what counts
    return not (is_plain(config) and (config.is_greedy or 1 <= config.top_k <= exact_k))

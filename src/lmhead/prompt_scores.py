"""Every prompt token's log-probability under the model, from the fp32 head's raw logits.

    ids [T] ──body (in pieces of PIECE tokens on the lean body)──▶ hidden [T,D]
        ──exact_head, CHUNK positions at a time──▶ logits [c,V] ──log_softmax──▶ logprob of ids[t+1], rank, top n

What the server's `echo` + `logprobs` and vLLM's `prompt_logprobs` report, and what lm-evaluation-harness sums:
the model's own numbers (temperature 1, nothing cut), the same as `Model.evaluate(text, tokens=True)` gives for
the same ids (both take the body's hidden states and the full-precision head). The first token has no score
(nothing precedes it): its entry is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PIECE = 1024  # prompt tokens per body forward (attention's scores are [heads, piece, tokens so far])
CHUNK = 256  # positions per head product ([CHUNK, V] logits at a time, never [T, V])


@dataclass
class TokenScore:
    """One prompt token after the first: its log-probability given the tokens before it, its rank (1 = the
    model's most likely token there) and the `top` most likely tokens there as (id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@torch.inference_mode()
def hidden_of(model, ids: Sequence[int]) -> torch.Tensor:
    """The body's final hidden states [T,D] of one prompt: as `Model.hidden_states` (what `evaluate` reads) for up
    to PIECE tokens; longer prompts on the lean body in pieces of PIECE through one cache."""
    x = torch.tensor([list(ids)], device=model.device)
    if model.lean is None or x.shape[1] <= PIECE:
        return model.hidden_states(x)[0]
    t = x.shape[1]
    cache = model.lean.new_cache(1, t)
    positions = torch.arange(t, device=x.device)[None]
    parts = [model.lean(x[:, a:a + PIECE], positions[:, a:a + PIECE], cache) for a in range(0, t, PIECE)]
    return torch.cat(parts, dim=1)[0]


@torch.inference_mode()
def prompt_scores(model, ids: Sequence[int], top: int = 0) -> list[TokenScore | None]:
    """Per prompt token: None for the first, then its `TokenScore` (see the module docstring). top: how many
    alternatives each lists (0..20)."""
    ids = list(ids)
    if not ids:
        raise ValueError("ids: the prompt is empty")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise ValueError(f"top: must be an integer in 0..20, got {top!r}")
    out: list[TokenScore | None] = [None]
    if len(ids) == 1:
        return out
    hidden = hidden_of(model, ids[:-1])                                   # [T-1,D]: position t predicts t+1
    targets = torch.tensor(ids[1:], device=hidden.device)
    for a in range(0, len(targets), CHUNK):
        logits = model.exact_head(hidden[a:a + CHUNK]).float()            # [c,V]
        lp = torch.log_softmax(logits, dim=-1)
        tgt = targets[a:a + CHUNK]
        chosen = lp.gather(1, tgt[:, None]).squeeze(1)                    # [c]
        above = (logits > logits.gather(1, tgt[:, None])).sum(dim=1)      # [c]
        tops = lp.topk(top, dim=-1) if top else None
        for j, (t, v, r) in enumerate(zip(tgt.tolist(), chosen.tolist(), above.tolist(), strict=True)):
            alts = list(zip(tops.indices[j].tolist(), tops.values[j].tolist(), strict=True)) if tops else []
            out.append(TokenScore(t, v, 1 + r, alts))
    return out

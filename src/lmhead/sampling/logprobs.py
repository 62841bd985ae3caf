"""Raw and processed log-probabilities with their alternatives (``LogProbs``, ``logprobs``) and ``entropy``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lmhead.checks import is_int
from lmhead.sampling.config import ConfigArg
from lmhead.sampling.inputs import check_logits, check_values
from lmhead.sampling.pipeline import process_logits


@dataclass(frozen=True)
class LogProbs:
    """Log-probabilities of the chosen tokens, per row, raw and processed.

    raw = log_softmax of the logits as given; processed = log of ``probabilities`` (after bias, penalties,
    temperature and the cut-offs; -inf for a token the pipeline cut, and a greedy row is one-hot).

    token_ids          [B] long   the chosen tokens
    logprob            [B]        processed log-probability of the chosen token
    raw_logprob        [B]        raw log-probability of the chosen token
    rank               [B] long   raw rank: 1 + the number of tokens with a strictly greater raw logit
                                  (tied tokens share the best rank, e.g. 1, 2, 2, 4)
    top_ids            [B,n] long the n most likely tokens of the processed distribution (cut tokens, if
                                  n exceeds the kept set, follow by raw logit)
    top_logprobs       [B,n]      their processed log-probabilities (-inf for cut tokens)
    top_raw_logprobs   [B,n]      their raw log-probabilities
    raw_top_ids        [B,n] long the n most likely tokens of the raw distribution
    raw_top_logprobs   [B,n]      their raw log-probabilities
    """

    token_ids: Tensor
    logprob: Tensor
    raw_logprob: Tensor
    rank: Tensor
    top_ids: Tensor
    top_logprobs: Tensor
    top_raw_logprobs: Tensor
    raw_top_ids: Tensor
    raw_top_logprobs: Tensor

    def to_list(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per row (plain ints and floats); -inf log-probabilities become None."""
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        rows = []
        for b in range(self.token_ids.shape[0]):
            top = zip(self.top_ids[b].tolist(), self.top_logprobs[b].tolist(), self.top_raw_logprobs[b].tolist(),
                      strict=True)
            raw_top = zip(self.raw_top_ids[b].tolist(), self.raw_top_logprobs[b].tolist(), strict=True)
            rows.append({
                "token_id": int(self.token_ids[b]),
                "logprob": num(float(self.logprob[b])),
                "raw_logprob": num(float(self.raw_logprob[b])),
                "rank": int(self.rank[b]),
                "top": [{"token_id": i, "logprob": num(v), "raw_logprob": num(r)} for i, v, r in top],
                "raw_top": [{"token_id": i, "logprob": num(v)} for i, v in raw_top],
            })
        return rows


def logprobs(logits: Tensor, token_ids: Tensor | Sequence[int] | int, config: ConfigArg = None,
             top_n: int = 0, prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0) -> LogProbs:
    """Raw and processed log-probabilities of ``token_ids`` [B] under [B,V] logits, with the top-n
    alternatives of each (top_n clamped to V). A [V] row is a batch of one (the fields keep the batch
    dimension). Same config / prev_tokens / prompt_len as ``process_logits``."""
    x, one_row = check_logits(logits)
    batch, vocab = x.shape
    if not is_int(top_n) or top_n < 0:
        raise ValueError(f"top_n must be an int ≥ 0, got {top_n!r}")
    if isinstance(token_ids, Tensor):
        if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be integer ids, got {token_ids.dtype}")
        tok = token_ids.to(device=x.device, dtype=torch.long).reshape(-1)
    elif is_int(token_ids):
        tok = torch.tensor([token_ids], dtype=torch.long, device=x.device)
    elif isinstance(token_ids, Sequence) and all(is_int(t) for t in token_ids):
        tok = torch.tensor(list(token_ids), dtype=torch.long, device=x.device)
    else:
        raise TypeError(f"token_ids must be a LongTensor [B] or a list of ints, got {token_ids!r}")
    if tok.numel() != batch:
        raise ValueError(f"token_ids must hold one id per row ({batch}), got {tok.numel()}")
    if tok.numel() and (bool((tok < 0).any()) or bool((tok >= vocab).any())):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {tok.tolist()}")
    check_values(x)
    raw = torch.log_softmax(x, dim=-1)
    processed = process_logits(logits, config, prev_tokens, prompt_len)  # the caller's shape: [V] or [B,V]
    processed = torch.log_softmax(processed.unsqueeze(0) if one_row else processed, dim=-1)
    col = tok.unsqueeze(1)
    n = min(top_n, vocab)
    # kept tokens by processed logprob, then cut ones by raw logprob (float64 keeps both orders exact)
    key = torch.where(torch.isfinite(processed), processed.double(), raw.double() - 1e6)
    top_ids = torch.topk(key, n, dim=-1).indices
    raw_top = torch.topk(raw, n, dim=-1)
    return LogProbs(
        token_ids=tok,
        logprob=processed.gather(1, col).squeeze(1),
        raw_logprob=raw.gather(1, col).squeeze(1),
        rank=1 + (x > x.gather(1, col)).sum(dim=-1),
        top_ids=top_ids,
        top_logprobs=processed.gather(1, top_ids),
        top_raw_logprobs=raw.gather(1, top_ids),
        raw_top_ids=raw_top.indices,
        raw_top_logprobs=raw_top.values,
    )


def entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of softmax(logits) over the last dimension: [...,V] → [...] float32.
    -inf logits are tokens of probability 0 and contribute nothing (0 · log 0 = 0)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor [..., V], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V ≥ 1, got {tuple(logits.shape)}")
    x = logits.float()
    check_values(x.reshape(-1, x.shape[-1]))
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)

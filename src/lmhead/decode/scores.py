"""The scores of the tokens a round emitted: processed and raw logprobs, ranks and the alternatives.

    score_logits   the logits each token is scored under: the ones it was chosen from, or the fp32 head's
    flat_scores    every token of a round (rows × their tokens, flattened, in order) scored under them
    Clock          wall time per phase into a `profile` dict (nothing, and no syncs, without one)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from lmhead.decode.rows import Row
from lmhead.kernels.native import row_scores, token_scores
from lmhead.sampling import chosen_logprobs, logprobs


class Clock:
    """Adds wall time per phase to `profile` (no-op and no syncs when profile is None)."""

    def __init__(self, profile: dict[str, float] | None) -> None:
        self.profile = profile
        self.t = time.perf_counter() if profile is not None else 0.0

    def lap(self, phase: str) -> None:
        if self.profile is not None:
            now = time.perf_counter()
            self.profile[phase] = self.profile.get(phase, 0.0) + now - self.t
            self.t = now


def _count_greater(x: torch.Tensor, values: torch.Tensor) -> list[int]:
    """Per row b: how many entries of x[b] are > values[b]."""
    if x.device.type == "cpu":
        # numpy compares on one thread. A torch elementwise op over a [V] row runs as a parallel region, and on
        # a machine whose cores are busy each region waits a scheduler tick for its second thread: far longer
        # than the count itself.
        rows = x.numpy()
        return [int(np.count_nonzero(rows[b] > v)) for b, v in enumerate(values.tolist())]
    return (x > values[:, None]).sum(dim=-1).tolist()


def _scores(logits: torch.Tensor, ids: torch.Tensor | list[int], cfg, prev, plen, top_n: int, greedy: bool,
            chosen: list[float] | None = None):
    """Per row: processed logprob, raw logprob and raw rank of `ids` ([N] or a list), and (top_n > 0) the
    alternatives.

    Equal to `sampling.logprobs` (which is used when alternatives are asked for; the raw logprobs, the token's and
    its alternatives', are the normaliser's below whether or not they are asked for). Without them the work is
    the normaliser and the count (`kernels.native.row_scores`; without the library a log_softmax, a row-wise
    kernel, and numpy's count), and for
    sampled rows `chosen_logprobs` (over a top-k row's k candidates, not a [B,V] processed row) — or nothing
    when the draw already gave them (`chosen`, from `sampling.sample_with_logprobs` on these logits).
    """
    if top_n:
        if isinstance(ids, list):
            ids = torch.tensor(ids, device=logits.device)
        lp = logprobs(logits, ids, cfg, top_n=top_n, prev_tokens=prev, prompt_len=plen)
        raw, top_raw = lp.raw_logprob, lp.top_raw_logprobs
        x = logits if logits.dtype == torch.float32 else logits.float()
        native = row_scores(x, ids) if x.dim() == 2 else None
        if native is not None:  # the raw logprobs a row gets without alternatives: x − lse in double
            lse = native[0][:, None]
            raw = (x.gather(1, ids[:, None]).double() - lse).squeeze(1)
            top_raw = x.gather(1, lp.top_ids).double() - lse
        alts = [list(zip(*row, strict=True)) for row in zip(lp.top_ids.tolist(), lp.top_logprobs.tolist(),
                                                            top_raw.tolist(), strict=True)]
        return lp.logprob.tolist(), raw.tolist(), lp.rank.tolist(), alts
    x = logits if logits.dtype == torch.float32 else logits.float()
    if isinstance(ids, list):  # the decode loop's tokens: the C passes answer with Python numbers
        found = token_scores(x, ids)
        if found is not None:
            raw, ranks = found
            if greedy:
                return [0.0] * len(raw), raw, ranks, None
            if chosen is None:
                chosen = chosen_logprobs(x, torch.tensor(ids, device=x.device), cfg, prev_tokens=prev,
                                         prompt_len=plen).tolist()
            return chosen, raw, ranks, None
        ids = torch.tensor(ids, device=x.device)
    col = ids[:, None]
    native = row_scores(x, ids)  # two passes over each row in C: the normaliser and the count
    if native is not None:
        lse, greater = native
        raw = (x.gather(1, col).squeeze(1).double() - lse).tolist()
        ranks = [1 + c for c in greater.tolist()]
    else:
        raw = torch.log_softmax(x, dim=-1).gather(1, col).squeeze(1).tolist()
        ranks = [1 + c for c in _count_greater(x, x.gather(1, col).squeeze(1))]
    if greedy:  # a greedy row keeps only its argmax: probability 1
        return [0.0] * len(raw), raw, ranks, None
    if chosen is None:
        chosen = chosen_logprobs(x, ids, cfg, prev_tokens=prev, prompt_len=plen).tolist()
    return chosen, raw, ranks, None


def score_logits(model, rnd, rows: list[Row]) -> torch.Tensor:
    """The logits every token of a round is scored under, rows × their tokens flattened in order [N,V]: the
    ones it was chosen from, or the fp32 head's for rows that asked for exact logprobs."""
    parts = list(rnd.logits)
    if model.head is not model.exact_head:
        for b, row in enumerate(rows):
            if row.exact_logprobs:
                parts[b] = model.exact_head(rnd.hidden[b]).float()  # [n_b,D] -> [n_b,V]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def flat_scores(logits: torch.Tensor, tokens: list[list[int]], history, prompt_len, rows: list[Row],
                 chosen: list[float] | None = None):
    """Scores of every token a round emitted (rows × their tokens, flattened, in order; logits [N,V]): each
    token's logprobs, rank and alternatives (the most any row asks for; each row keeps its own count), the
    earlier tokens of the round counted as generated. chosen: the processed logprobs the draw gave, when
    `logits` are the ones it drew from."""
    flat_cfg, prev, plen = [], [] if history is not None else None, []
    for b, row_tokens in enumerate(tokens):
        for j in range(len(row_tokens)):
            flat_cfg.append(rows[b].config)
            plen.append(prompt_len[b])
            if prev is not None:
                prev.append(history[b] + row_tokens[:j])
    ids = [t for row_tokens in tokens for t in row_tokens]
    cfg = flat_cfg[0] if len({id(c) for c in flat_cfg}) == 1 else flat_cfg
    return _scores(logits, ids, cfg, prev, plen if prev is not None else 0, max(r.top_n for r in rows),
                   greedy=all(c.is_greedy for c in flat_cfg), chosen=chosen)

"""The vocabulary-parallel sampler: lmhead.sampling's own pipeline on every rank, handed a `ShardedVocab`."""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lmhead import sampling
from lmhead.distributed.protocol import agree, check_group, shard_layout, targets_checksum

# lmhead.sampling's pipeline itself, run on every rank over its columns: `ShardedVocab` is the vocabulary axis
# of sampling.Vocab split over the ranks. Steps 1-2 are per token (each rank its own columns); every reduction
# across the vocabulary that steps 3-8 make (row max / min, top-k candidates with their ids, sums of masses and
# counts, the few tokens of a histogram bin) is a collective on small tensors, whose result is the same on
# every rank, so every rank takes the same branches and draws the same token. Nothing of size V is sent.


class ShardedVocab(sampling.Vocab):
    """sampling.Vocab for logits split by vocabulary over `group`: this rank holds columns [start, start + V_r)
    of V. Every method is a collective (all ranks call it in the same order, as the pipeline does)."""

    def __init__(self, size: int, start: int, group: Any = None, name: str = "local_logits") -> None:
        super().__init__(size, start, name)
        self.group = group
        self.world = check_group(group)[1]

    def _gather(self, t: Tensor) -> Tensor:
        """all_gather of equal-shaped tensors → [W, *t.shape], in rank (= id) order."""
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def amax(self, x: Tensor) -> Tensor:
        return self._gather(x.amax(dim=-1, keepdim=True)).amax(dim=0)  # max over gathered maxima keeps NaN

    def amin(self, x: Tensor) -> Tensor:
        return self._gather(x.amin(dim=-1, keepdim=True)).amin(dim=0)

    def argmax(self, x: Tensor) -> tuple[Tensor, Tensor]:
        v, i = x.max(dim=-1, keepdim=True)
        got = self._gather(torch.cat([v.double(), (i + self.start).double()], dim=1))  # [W,b,2], exact
        best, rank = got[:, :, 0].max(dim=0)  # the first rank holding the maximum: the lowest id on ties
        ids = got[:, :, 1].gather(0, rank[None]).squeeze(0)
        return best.to(x.dtype)[:, None], ids.long()[:, None]

    def topk(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        b, width = x.shape
        v, i = torch.topk(x, min(k, width), dim=-1)
        mine = torch.full((b, 2, k), -math.inf, dtype=torch.float64, device=x.device)
        mine[:, 0, : v.shape[1]] = v.double()
        mine[:, 1] = self.size  # padding ids: past the vocabulary, so no rank owns them
        mine[:, 1, : v.shape[1]] = (i + self.start).double()
        got = self._gather(mine).permute(1, 2, 0, 3)  # [b, 2, W, k]
        vals, pos = torch.topk(got[:, 0].reshape(b, -1), k, dim=-1)
        return vals.to(x.dtype), got[:, 1].reshape(b, -1).gather(1, pos).long()

    def sum(self, partial: Tensor) -> Tensor:
        total = partial.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.group)
        return total

    def cat(self, *parts: Tensor) -> tuple[Tensor, ...]:
        n = parts[0].shape[0]
        lengths = self._gather(torch.tensor([n], device=parts[0].device))[:, 0].tolist()
        packed = torch.zeros(len(parts), max(lengths), dtype=torch.float64, device=parts[0].device)
        for row, t in zip(packed, parts, strict=True):
            row[:n] = t.double()  # ids and float32 values are exact in float64
        got = self._gather(packed)
        return tuple(torch.cat([got[r, j, :w] for r, w in enumerate(lengths)]).to(t.dtype)
                     for j, t in enumerate(parts))

    def softmax(self, x: Tensor) -> Tensor:
        e = torch.exp(x - self.amax(x))
        return e / self.sum(e.sum(dim=-1, keepdim=True))

    def columns(self, vals: Tensor, ids: Tensor, fill: float, width: int) -> Tensor:
        local = ids - self.start
        local = torch.where((local >= 0) & (local < width), local, width)  # others' ids: a dropped column
        out = torch.full((vals.shape[0], width + 1), fill, dtype=vals.dtype, device=vals.device)
        return out.scatter_(1, local, vals)[:, :width]


def _generator_fingerprint(generator: torch.Generator | None) -> int:
    state = (generator if generator is not None else torch.default_generator).get_state()
    return zlib.crc32(state.cpu().numpy().tobytes())


def _sharded_vocab(op: str, local_logits: Tensor, config: Any, generator: torch.Generator | None,
                   prev_tokens: Any, prompt_len: Any, step: Any, vocab_size: int | None,
                   group: Any) -> ShardedVocab:
    """Check the arguments on every rank (one metadata all_gather: batch, configs, prev_tokens, prompt_len,
    step and the generator's state must agree) and return this rank's ShardedVocab."""
    rank, _ = check_group(group)
    error = None
    batch, cfgs, prev, plen, steps = 0, [], None, None, [0]
    try:
        if not isinstance(local_logits, Tensor) or not local_logits.is_floating_point():
            raise TypeError("local_logits must be a floating tensor [B, V_local] or [V_local]")
        if local_logits.dim() not in (1, 2) or local_logits.shape[-1] == 0:
            raise ValueError(f"local_logits must have shape [B, V_local] or [V_local] with V_local ≥ 1, got "
                             f"{tuple(local_logits.shape)}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        one_row = local_logits.dim() == 1
        batch = 1 if one_row else local_logits.shape[0]
        cfgs = sampling.as_configs(config, batch)
        if prev_tokens is not None:  # ids are checked against V by the pipeline, the same on every rank
            prev = sampling.as_prev_tokens(prev_tokens, batch, None, local_logits.device, one_row)
        plen = sampling.as_row_ints(prompt_len, batch, "prompt_len", local_logits.device)
        if any(c.seed is not None for c in cfgs):
            steps = sampling.as_row_ints(step, batch, "step", torch.device("cpu")).tolist()
    except (TypeError, ValueError) as exc:
        if not isinstance(local_logits, Tensor):
            raise
        error = str(exc)
    unseeded = any(c.seed is None and not c.is_greedy for c in cfgs)
    shared = {"batch": batch, "config": repr(cfgs), "prompt_len": repr(plen.tolist() if plen is not None else 0),
              "prev": targets_checksum(prev) if prev is not None else -1, "step": repr(steps),
              "generator": _generator_fingerprint(generator) if unseeded and error is None else 0}
    widths = agree(group, op, shared, local_logits.shape[-1], error, local_logits.device)
    start, _, vocab = shard_layout(op, widths, vocab_size, rank)
    return ShardedVocab(vocab, start, group)


def vocab_parallel_sample(local_logits: Tensor, config: Any = None, generator: torch.Generator | None = None,
                          prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0,
                          step: int | Sequence[int] = 0, *, vocab_size: int | None = None,
                          group: Any = None) -> Tensor:
    """`lmhead.sample` on logits split by vocabulary: [B,V_r] (this rank's columns) → [B] global ids, the same
    on every rank and the same ids as `sample` on the full [B,V] logits (it is `sample`, run with a
    `ShardedVocab`).

    Arguments as `sample` (config: one SamplingConfig or one per row; prev_tokens / prompt_len / step in
    global ids and positions, identical on every rank). Communication per call: one metadata all_gather, then
    the pipeline's reductions on small tensors, per group of rows that share their settings: greedy one
    all_gather of [B,2]; top-k one all_gather of each rank's top k+1 ([B, 2(k+1)] numbers); top-p without
    top-k the row max, the normaliser and the 256-token window (then 1024, then a histogram of ≤ 4096 bins and
    the few tokens of one bin); rows drawn whole the row max, the block masses [B, V/1024] and the chosen
    block's [B, 1024] values. Greedy = the global argmax (ties → the lowest global id, as torch.argmax on the
    full row). Unseeded sampled rows draw from `generator` (or torch's default generator), which must be in
    the same state on every rank — checked."""
    vocab = _sharded_vocab("vocab_parallel_sample", local_logits, config, generator, prev_tokens, prompt_len,
                           step, vocab_size, group)
    return sampling.sample(local_logits, config, generator, prev_tokens, prompt_len, step, vocab=vocab)


def vocab_parallel_probabilities(local_logits: Tensor, config: Any = None, prev_tokens: Any = None,
                                 prompt_len: int | Sequence[int] = 0, *, vocab_size: int | None = None,
                                 group: Any = None) -> Tensor:
    """`lmhead.probabilities` on logits split by vocabulary: [B,V_r] → this rank's columns [B,V_r] of the
    full-vocabulary distribution after the pipeline (concatenated over the ranks, rows sum to 1). It is
    `probabilities` run with a `ShardedVocab`: the same collectives as `vocab_parallel_sample`, with a sum of
    the softmax's normaliser instead of the draw."""
    vocab = _sharded_vocab("vocab_parallel_probabilities", local_logits, config, None, prev_tokens, prompt_len,
                           0, vocab_size, group)
    return sampling.probabilities(local_logits, config, prev_tokens, prompt_len, vocab=vocab)

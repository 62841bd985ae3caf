"""The vocabulary axis (``Vocab``): every reduction over V goes through it; the chunked passes' sizes."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# Passes over whole rows run in chunks of about this many elements (reused buffers: no page faults), and
# whole-row draws pick a block of BLOCK tokens first.
_CHUNK_ELEMENTS = 1 << 20
BLOCK = 1024


# In the passes that sum masses, a token more than 64 below the row's max (x/T) counts 0: e^-64 ≈ 1.6e-28 of the
# max is far below what a float64 uniform can pick (2^-53), and exp of -inf, or of anything below -87 (float32
# subnormal results), runs 6 to 100 times slower than exp of a normal value.
_TAIL = -64.0
_TAIL_EXP = torch.tensor(_TAIL).exp().item()
NEG_INF = float("-inf")


def tail_exp_(d: Tensor) -> Tensor:
    """In place on d = x/T − max (≤ 0, -inf allowed): exp(d), with d < −64 counted 0 (see _TAIL)."""
    return torch.threshold_(d.clamp_min_(_TAIL).exp_(), _TAIL_EXP, 0.0)


def chunk_columns(batch: int, vocab: int, multiple: int = 1) -> int:
    cols = max(multiple, _CHUNK_ELEMENTS // max(batch, 1) // multiple * multiple)
    return min(cols, -(-vocab // multiple) * multiple)


class Vocab:
    """The vocabulary axis of the logits a pipeline call runs on, and the reductions over it.

    The pipeline reads across the vocabulary only through these methods; everything else it does is per token
    (steps 1-2, the final masks) or on a few candidates [b,m] that every caller holds alike. This class is the
    whole vocabulary in one process (the default of ``process_logits`` / ``probabilities`` / ``sample``).
    ``lmhead.distributed.ShardedVocab`` is the same axis split over ranks: each rank passes its columns
    [start, start + V_r) of the [B,V] logits, the methods combine the ranks' small partial results (maxima,
    top-k candidates, sums), and the very same pipeline code runs on every rank.

    size   V, the whole vocabulary            start  the global id of the first local column (0 here)
    name   what the logits are called in error messages
    Shapes: x [b,V_r] are the local columns (V_r = V here); ids are global token ids.
    """

    def __init__(self, size: int, start: int = 0, name: str = "logits") -> None:
        self.size, self.start, self.name = size, start, name

    def amax(self, x: Tensor) -> Tensor:
        """[b,V_r] → [b,1] the row maximum over V (NaN and +inf propagate)."""
        return x.amax(dim=-1, keepdim=True)

    def amin(self, x: Tensor) -> Tensor:
        """[b,V_r] → [b,1] the row minimum over V."""
        return x.amin(dim=-1, keepdim=True)

    def argmax(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[b,V_r] → (max [b,1], its id [b,1] long): the lowest id among ties, as torch.max on the full row."""
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] and not x.requires_grad:
            # numpy's argmax follows the same rule (first maximum; a NaN counts as the maximum) and on this
            # kind of machine takes 1/20 of torch's CPU max-with-index (31 µs against 680 µs over 262,144 logits:
            # a greedy decode step paid it twice)
            idx = torch.from_numpy(np.ascontiguousarray(x.numpy()).argmax(axis=-1).astype(np.int64)).unsqueeze(-1)
            return x.gather(-1, idx), idx
        return x.max(dim=-1, keepdim=True)

    def topk(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """[b,V_r] → the k largest over V (k ≤ V): values [b,k] descending, ids [b,k] long (tied values in any
        order)."""
        if x.device.type == "cpu":  # a wide CPU row: a threshold pass in C, then a sort of the few above it
            from lmhead.kernels import native

            got = native.topk(x, k)
            if got is not None:
                return got
        return torch.topk(x, k, dim=-1)

    def topk_rows(self, x: Tensor, ks: list[int], rows: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """[b,V_r] (``rows``: those rows of it, read where they lie) → each row's own ks[r] largest over V: values
        [len(ks), max k] descending, ids [len(ks), max k] long, row r's first ks[r] columns the ones `topk` gives it
        alone (tied values' ids in any order), the rest -inf."""
        # the rows' threshold passes and one sort of their candidates (not for a subclass with a `topk` of its
        # own: a sharded vocabulary's rows are only its columns)
        if x.device.type == "cpu" and type(self).topk is Vocab.topk:
            from lmhead.kernels import native

            got = native.topk_rows(x, ks, rows)
            if got is not None:
                return got
        at = range(x.shape[0]) if rows is None else rows
        vals = torch.full((len(ks), max(ks)), NEG_INF, dtype=x.dtype, device=x.device)
        ids = torch.zeros((len(ks), max(ks)), dtype=torch.long, device=x.device)
        for j, (r, k) in enumerate(zip(at, ks, strict=True)):
            vals[j, :k], ids[j, :k] = self.topk(x[r:r + 1], k)
        return vals, ids

    def sum(self, partial: Tensor) -> Tensor:
        """Per-row partial results over the local columns ([b,...] masses, counts) → summed over all of V."""
        return partial

    def cat(self, *parts: Tensor) -> tuple[Tensor, ...]:
        """1-D tensors of any length, one set per shard → each concatenated over the shards (rank order)."""
        return parts

    def softmax(self, x: Tensor) -> Tensor:
        """[b,V_r] → the local columns of softmax over V."""
        return torch.softmax(x, dim=-1)

    def columns(self, vals: Tensor, ids: Tensor, fill: float, width: int) -> Tensor:
        """Candidates (vals, global ids) [b,m] → [b,V_r] local columns, `fill` where no candidate is."""
        out = torch.full((vals.shape[0], width), fill, dtype=vals.dtype, device=vals.device)
        return out.scatter_(1, ids, vals)

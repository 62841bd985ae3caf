"""Vocabulary-parallel LM head, loss and sampling on torch.distributed (Megatron-style).

The head's weight [V,D] is split by rows over the ranks of a process group: rank r holds the rows
[start_r, end_r) and computes only its slice of the logits [.., V_r]. Nothing of size V ever crosses the
network:

    hidden [N,D] (replicated) ──local matmul──▶ local logits [N,V_r]
    loss:     lmhead.loss's per-chunk core on every rank's columns, handed a `ShardedLossVocab` that combines
              the row statistics over the ranks:
              all-reduce MAX of the shards' row lse [N]          ─┐ two small collectives per call,
              all-reduce SUM of [target logit ‖ sum-exp ‖ Σz]   ─┘ O(N) numbers each; backward is local,
              dHidden needs one all-reduce SUM (hidden is replicated: the column-parallel input gradient)
    sampling: lmhead.sampling's own pipeline on every rank, handed a `ShardedVocab` (its reductions across
              the vocabulary — row max, top-k candidates with global ids, sums of masses — as collectives on
              small tensors) → the same branches and the same draw on every rank → the same token

Layout: the rows are split as `torch.tensor_split(weight, world_size)` splits them — the first V mod W ranks
hold one row more (`vocab_range`). V need not be divisible by the world size; no padding rows.

Safety: every public function starts with one small all_gather of metadata (operation, V, D, N, options, a
checksum of the targets, this rank's row count, and whether this rank's own input checks failed). Ranks that
disagree — on V, on D, on the shard they hold, on the options, on the targets — raise a ValueError on *every*
rank, before the first real collective, instead of one rank raising and the others waiting forever.
A rank that does not call at all cannot be detected this way: the process group's `timeout` bounds that wait
(`init_distributed(timeout=...)` or `torch.distributed.init_process_group(..., timeout=timedelta(...))`).

Backends: gloo on CPU, NCCL on GPUs (tensors on `cuda:local_rank`, `torch.cuda.set_device(local_rank)` first).

Layout of this package, each module importing only the ones before it: ``protocol`` (the group's check, the
metadata agreement, ``vocab_range`` and the layout of the shards) → ``ops`` (Megatron's f and g operators) →
``loss`` (``ShardedLossVocab``, ``vocab_parallel_cross_entropy``, ``vocab_parallel_linear_cross_entropy``) →
``sampling`` (``ShardedVocab``, ``vocab_parallel_sample``, ``vocab_parallel_probabilities``) → ``modules``
(``VocabParallelEmbedding``, ``VocabParallelLMHead``, ``gather_vocab_parallel_logits``).
"""

from __future__ import annotations

from lmhead.distributed.loss import ShardedLossVocab, vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from lmhead.distributed.modules import VocabParallelEmbedding, VocabParallelLMHead, gather_vocab_parallel_logits
from lmhead.distributed.protocol import init_distributed, vocab_range
from lmhead.distributed.sampling import ShardedVocab, vocab_parallel_probabilities, vocab_parallel_sample

__all__ = [
    "ShardedLossVocab",
    "ShardedVocab",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "gather_vocab_parallel_logits",
    "init_distributed",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_probabilities",
    "vocab_parallel_sample",
    "vocab_range",
]

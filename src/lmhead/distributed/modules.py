"""The vocabulary-parallel modules (`VocabParallelEmbedding`, `VocabParallelLMHead`) and the all-gather of the
shards' logits for checks and display."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmhead import checks
from lmhead.distributed.loss import softcapped, vocab_parallel_linear_cross_entropy
from lmhead.distributed.ops import CopyToVocabParallel, ReduceFromVocabParallel
from lmhead.distributed.protocol import agree, check_group, comm_device, vocab_range
from lmhead.distributed.sampling import vocab_parallel_sample


class VocabParallelEmbedding(nn.Module):
    """Token embedding with its [V,D] table split by rows like the head (Megatron's VocabParallelEmbedding).

    Each rank looks up the ids in its range [start, end), writes zeros for the others, and one all-reduce SUM
    gives every rank the full embeddings [B,T,D] (backward: identity — each rank's rows get their gradient).
    Tie a `VocabParallelLMHead` to it with `tie_to=` (the same Parameter, the same rows).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        rank, world = check_group(group)
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be an int >= 1, got {embedding_dim!r}")
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, world)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               dtype=dtype, device=device))
        nn.init.normal_(self.weight)
        agree(group, "VocabParallelEmbedding", {"vocab_size": num_embeddings, "d_model": embedding_dim},
               self.weight.shape[0], None, comm_device(group, self.weight.device))

    @classmethod
    def from_weight(cls, weight: Tensor, group: Any = None) -> VocabParallelEmbedding:
        """Build from the full [V,D] table (same on every rank): each rank keeps a copy of its own rows."""
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError("weight must be the full [V,D] embedding table")
        emb = cls(weight.shape[0], weight.shape[1], group=group, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            emb.weight.copy_(weight[emb.vocab_start:emb.vocab_end])
        return emb

    def forward(self, ids: Tensor) -> Tensor:
        """ids [...] global token ids -> embeddings [..., D] (identical on every rank)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids must be int64/int32 token ids, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"ids must be in [0, {self.num_embeddings}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
        out = nn.functional.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return ReduceFromVocabParallel.apply(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end})")


def _head_error(d_model: Any, vocab_size: Any, world: int, softcap: Any, tie_to: Any) -> str | None:
    """This rank's complaint about VocabParallelLMHead's arguments, or None (raised by `agree` on every rank)."""
    if not isinstance(d_model, int) or d_model < 1:
        return f"d_model must be an int >= 1, got {d_model!r}"
    if not isinstance(vocab_size, int) or vocab_size < world:
        return f"vocab_size must be an int >= world_size ({world}), got {vocab_size!r}"
    try:
        checks.softcap(softcap)
    except ValueError as exc:
        return str(exc)
    if tie_to is not None and (not isinstance(tie_to, VocabParallelEmbedding)
                               or (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, d_model)):
        return f"tie_to must be a VocabParallelEmbedding of [{vocab_size}, {d_model}], got {tie_to!r}"
    return None


class VocabParallelLMHead(nn.Module):
    """The LM head with its [V,D] weight split by vocabulary rows over the ranks of `group`.

    `.weight` [V_r,D] holds rows [vocab_start, vocab_end) (see `vocab_range`), `.bias` [V_r] or None.
    forward(hidden [B,T,D]) -> this rank's logits [B,T',V_r] in float32 (T' = logits_to_keep or T); their
    backward all-reduces dHidden. `.loss()` is the fused vocab-parallel loss, `.sample()` picks the next token
    (the same on every rank), `gather_vocab_parallel_logits` assembles [.., V] when you really need it.
    Construction is collective: ranks disagreeing on V, D, bias or softcap raise on every rank.
    """

    def __init__(self, d_model: int, vocab_size: int, bias: bool = False,
                 tie_to: VocabParallelEmbedding | None = None, softcap: float | None = None,
                 group: Any = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        rank, world = check_group(group)
        error = _head_error(d_model, vocab_size, world, softcap, tie_to)
        softcap = softcap if error is not None else checks.softcap(softcap)
        self.group = group
        self.d_model, self.vocab_size, self.softcap = d_model, vocab_size, softcap
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, rank, world) if error is None else (0, 0)
        width = self.vocab_end - self.vocab_start
        if tie_to is not None and error is None:
            self.weight = tie_to.weight  # the same Parameter: gradients of head and embedding add up
            if tie_to.group is not group:
                error = "tie_to: the embedding must be split over the same process group"
        elif error is None:
            self.weight = nn.Parameter(torch.empty(width, d_model, dtype=dtype, device=device))
            nn.init.normal_(self.weight, std=d_model ** -0.5)
        self.bias = nn.Parameter(torch.zeros(width, dtype=dtype, device=device)) if bias and error is None \
            else None
        fallback = self.weight.device if error is None else torch.device(device or "cpu")
        agree(group, "VocabParallelLMHead", {"vocab_size": vocab_size, "d_model": d_model, "bias": bool(bias),
                                              "softcap": softcap, "tied": tie_to is not None},
               width, error, comm_device(group, fallback))

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None, softcap: float | None = None,
                    group: Any = None) -> VocabParallelLMHead:
        """Build from the full [V,D] weight (and [V] bias), the same on every rank: each rank keeps a copy of
        its rows [start, end) so the full tensor can be freed. For tests and for loading a checkpoint."""
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            raise ValueError("weight must be the full [V,D] head weight")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
        head = cls(weight.shape[1], weight.shape[0], bias=bias is not None, softcap=softcap, group=group,
                   dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            head.weight.copy_(weight[head.vocab_start:head.vocab_end])
            if bias is not None:
                head.bias.copy_(bias[head.vocab_start:head.vocab_end])
        return head

    def forward(self, hidden: Tensor, logits_to_keep: int = 0) -> Tensor:
        """hidden [B,T,D] (or [N,D]) -> this rank's logits [B,T',V_r] float32 (softcap applied)."""
        if not isinstance(hidden, Tensor) or hidden.shape[-1] != self.d_model:
            raise ValueError(f"hidden must be [..., {self.d_model}], got "
                             f"{tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}")
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
        if logits_to_keep and hidden.dim() == 3:
            hidden = hidden[:, -logits_to_keep:]
        hidden = CopyToVocabParallel.apply(hidden, self.group)
        logits = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        return softcapped(logits, self.softcap)

    def loss(self, hidden: Tensor, targets: Tensor, **kwargs: Any) -> Tensor:
        """`vocab_parallel_linear_cross_entropy` with this head's weight shard, bias and softcap."""
        return vocab_parallel_linear_cross_entropy(hidden, self.weight, targets, self.bias,
                                                   softcap=self.softcap, vocab_size=self.vocab_size,
                                                   group=self.group, **kwargs)

    def sample(self, hidden: Tensor, config: Any = None, **kwargs: Any) -> Tensor:
        """Next token ids [B] from hidden [B,D] or [B,T,D] (last position): `vocab_parallel_sample` on this
        rank's logits. Every rank returns the same ids."""
        if hidden.dim() == 3:
            hidden = hidden[:, -1]
        with torch.no_grad():
            local = self.forward(hidden)
        return vocab_parallel_sample(local, config, vocab_size=self.vocab_size, group=self.group, **kwargs)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, vocab_size={self.vocab_size}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), bias={self.bias is not None}, softcap={self.softcap}")


def gather_vocab_parallel_logits(local_logits: Tensor, group: Any = None) -> Tensor:
    """All-gather the shards [..., V_r] into the full logits [..., V] on every rank (O(V) traffic: for
    checks and display, not for the loss or sampling). Not differentiable."""
    rank, world = check_group(group)
    width = local_logits.shape[-1]
    widths = agree(group, "gather_vocab_parallel_logits", {"shape": str(tuple(local_logits.shape[:-1])),
                                                            "dtype": str(local_logits.dtype)},
                    width, None, local_logits.device)
    biggest = max(widths)
    padded = local_logits.new_zeros(*local_logits.shape[:-1], biggest)
    padded[..., :width] = local_logits.detach()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)

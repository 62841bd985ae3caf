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
"""

from __future__ import annotations

import datetime
import math
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lmhead import checks, sampling
from lmhead.loss import (
    ChunkScratch,
    LossVocab,
    RowStats,
    accumulate_grads,
    apply_softcap_,
    compute_dtype,
    default_chunk_size,
    grad_logits_,
    row_losses,
    row_stats_,
)

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

# --- process group and layout ------------------------------------------------------------------------------


def init_distributed(backend: str | None = None, timeout: float = 60.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return (rank, world_size).

    backend None picks "nccl" when CUDA is available (and calls `torch.cuda.set_device(LOCAL_RANK)`), else
    "gloo". `timeout` (seconds) bounds every collective: a rank that never arrives makes the others raise
    after this long instead of hanging. Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by torchrun).
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def _check_group(group: Any) -> tuple[int, int]:
    """(rank in group, group size); a clear error when torch.distributed is not set up."""
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call lmhead.init_distributed() or "
            "torch.distributed.init_process_group('gloo' (CPU) or 'nccl' (GPU), timeout=timedelta(seconds=60)) "
            "on every rank first (torchrun sets the environment)"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return rank, dist.get_world_size(group)


def vocab_range(vocab_size: int, rank: int | None = None, world_size: int | None = None,
                group: Any = None) -> tuple[int, int]:
    """The rows [start, end) of the [V,D] head weight that `rank` holds out of `world_size` ranks.

    Split as `torch.tensor_split(torch.arange(V), world_size)`: the first V mod W ranks hold one row more, so
    no shard is empty (V ≥ W required) and none differs from another by more than one row. rank and
    world_size default to this process's place in `group` (the default group when None).
    """
    if rank is None or world_size is None:
        g_rank, g_world = _check_group(group)
        rank = g_rank if rank is None else rank
        world_size = g_world if world_size is None else world_size
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if vocab_size < world_size:
        raise ValueError(f"vocab_size must be >= world_size ({world_size}) so that no shard is empty, "
                         f"got {vocab_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _comm_device(group: Any, fallback: torch.device) -> torch.device:
    """NCCL moves CUDA tensors only; gloo takes the inputs' device (CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def _encode(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return zlib.crc32(repr(value).encode())


def _targets_checksum(targets: Tensor) -> int:
    """Cheap fingerprint of replicated targets: ranks fed different batches disagree here."""
    t = targets.reshape(-1).to(torch.int64)
    if t.numel() == 0:
        return 0
    weights = torch.arange(1, t.numel() + 1, device=t.device, dtype=torch.int64) % 1_000_003
    return int(((t % 1_000_003) * weights).sum().item() % (2**61 - 1))


def _agree(group: Any, op: str, shared: dict[str, Any], width: int, error: str | None,
           device: torch.device) -> list[int]:
    """One small all_gather of metadata before any real collective; return every rank's local row count.

    `shared` values must be equal on all ranks (V, D, N, options, targets checksum); `width` is this rank's
    number of vocabulary rows; `error` is this rank's own input error, if any. Every rank sees the same
    gathered table, so every rank raises (the same kind of error) or none does — never a hang.
    """
    rank, world = _check_group(group)
    keys = sorted(shared)
    row = [zlib.crc32(op.encode()), 0 if error is None else 1, width] + [_encode(shared[k]) for k in keys]
    row = row + [0] * (32 - len(row))
    if len(row) > 32:
        raise AssertionError("too many metadata fields")
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    rows = [t.tolist() for t in table]
    if error is not None:
        raise ValueError(error)
    bad = [r for r in range(world) if rows[r][1]]
    if bad:
        raise ValueError(f"{op}: rank(s) {bad} rejected their input (see the error on those ranks)")
    if any(r[0] != rows[0][0] for r in rows):
        raise ValueError(f"{op}: the ranks called different operations at the same time (rank {rank} called {op})")
    for i, key in enumerate(keys):
        values = [r[3 + i] for r in rows]
        if len(set(values)) > 1:
            mine_v = shared[key]
            shown = values if isinstance(mine_v, int) and not isinstance(mine_v, bool) else "differ"
            raise ValueError(f"{op}: ranks disagree on {key} (rank {rank} has {mine_v!r}; all ranks: {shown}); "
                             "every rank must pass the same value")
    return [r[2] for r in rows]


def _layout(op: str, widths: list[int], vocab_size: int | None, rank: int) -> tuple[int, int, int]:
    """(start, end, V) for this rank from the gathered widths; checks them against `vocab_range`."""
    total = sum(widths)
    if vocab_size is not None:
        world = len(widths)
        expected = [(lambda s: s[1] - s[0])(vocab_range(vocab_size, r, world)) for r in range(world)] \
            if vocab_size >= world else None
        if expected != widths:
            raise ValueError(
                f"{op}: mismatched shards: the ranks hold {widths} vocabulary rows (total {total}) but "
                f"vocab_size={vocab_size} over {world} ranks needs {expected} (see lmhead.vocab_range)")
    start = sum(widths[:rank])
    return start, start + widths[rank], total


# --- autograd helpers (Megatron's f and g operators) -------------------------------------------------------


class _CopyToVocabParallel(torch.autograd.Function):
    """Identity forward; all-reduce SUM of the gradient in backward (hidden is replicated, each rank's
    slice of the logits contributes its part of dHidden)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _ReduceFromVocabParallel(torch.autograd.Function):
    """All-reduce SUM forward (each rank looked up only its own rows); identity backward, because everything
    after it is replicated and every rank back-propagates the same gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


# --- loss ---------------------------------------------------------------------------------------------------
#
# lmhead.loss's per-chunk core (logits with bias and softcap, row statistics, the loss from them, the gradient of
# the logits, the gradient matmuls) run over this rank's columns; `ShardedLossVocab` is the vocabulary axis of
# loss.LossVocab split over the ranks, its `lse` the two all-reduces. Only the loops differ from loss.py's: the
# global lse is known after every chunk's statistics, so the backward recomputes each chunk.


def _check_targets(targets: Tensor, n: int, vocab_size: int | None, ignore_index: int) -> None:
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError("targets must be an int64 (or int32) tensor of token ids")
    if targets.numel() != n:
        raise ValueError(f"targets must have one id per row: expected {n} ids, got shape {tuple(targets.shape)}")
    if vocab_size is not None and n:
        valid = targets[targets != ignore_index]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= vocab_size):
            raise ValueError(f"targets must be in [0, {vocab_size}) or ignore_index={ignore_index}, "
                             f"got values in [{int(valid.min())}, {int(valid.max())}]")


def _softcapped(x: Tensor, softcap: float | None) -> Tensor:
    return x if softcap is None else torch.tanh(x / softcap) * softcap


class ShardedLossVocab(LossVocab):
    """lmhead.loss.LossVocab for one vocabulary shard: this rank scores columns [start, start + width) of V, and
    `lse` combines every rank's row statistics with two all-reduces (a collective: every rank calls it)."""

    def __init__(self, size: int, start: int, width: int, group: Any = None) -> None:
        super().__init__(size, start, width)
        self.group = group

    def lse(self, stats: RowStats) -> RowStats:
        """All-reduce MAX of the shards' row lse m, then one SUM of [target logit ‖ exp(lse_r − m) ‖ Σz]: O(n)
        numbers; lse = m + log Σ."""
        m = stats.lse.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)
        parts = [stats.target, torch.exp(stats.lse - m)]
        packed = torch.stack(parts if stats.total is None else parts + [stats.total])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=self.group)
        return RowStats(m + torch.log(packed[1]), packed[0], None if stats.total is None else packed[2])


def _reduce(per_row: Tensor, valid: Tensor | None, n_total: int, reduction: str) -> Tensor:
    """per_row [n_valid] -> mean / sum / none [n_total] (ignored rows 0). mean over zero rows is 0."""
    if reduction == "none":
        if valid is None:
            return per_row
        out = per_row.new_zeros(n_total)
        return out.index_put((valid,), per_row)
    total = per_row.sum()
    if reduction == "mean":
        return total / max(per_row.numel(), 1)
    return total


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy on local logits [n,V_r] (valid rows only, global target ids [n]); returns per-row losses
    [n]. lmhead.loss's core on the whole block: one chunk of n rows."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, columns: ShardedLossVocab, label_smoothing: float,
                z_loss: float, softcap: float | None) -> Tensor:
        cdt = compute_dtype(logits.dtype)
        t, has_t = columns.local_targets(targets, cdt)
        z = apply_softcap_(logits.to(cdt, copy=True), softcap)  # a scratch copy: the statistics overwrite it
        lse, z_t, total = columns.lse(row_stats_(z, t, has_t, bool(label_smoothing)))
        del z
        ctx.save_for_backward(logits, targets, lse)
        ctx.opts = (columns, label_smoothing, z_loss, softcap)
        return row_losses(lse, z_t, total, columns.size, label_smoothing, z_loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        logits, targets, lse = ctx.saved_tensors
        columns, label_smoothing, z_loss, softcap = ctx.opts
        cdt = lse.dtype
        t, has_t = columns.local_targets(targets, cdt)
        z = logits.to(cdt, copy=True)
        dcap = torch.empty_like(z) if softcap is not None else None
        p = apply_softcap_(z, softcap, dcap).sub_(lse[:, None]).exp_()  # the softmax over all V, my columns
        grad_logits_(p, t, grad.to(cdt), lse, columns.size, label_smoothing, z_loss, has_t=has_t, dcap=dcap)
        return p.to(logits.dtype), None, None, None, None, None


def _prepare_targets(targets: Tensor, ignore_index: int) -> tuple[Tensor | None, Tensor]:
    """(indices of the non-ignored rows, None when all are kept; their global target ids)."""
    flat = targets.reshape(-1).to(torch.int64)
    keep = flat != ignore_index
    valid = None if bool(keep.all()) else keep.nonzero().squeeze(1)
    return valid, flat if valid is None else flat[valid]


def vocab_parallel_cross_entropy(
    local_logits: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    vocab_size: int | None = None,
    group: Any = None,
) -> Tensor:
    """Cross-entropy of logits split by vocabulary over the ranks of `group`; equals
    `F.cross_entropy(full_logits, targets, ...)` (+ z_loss·lse²) on the gathered logits.

    local_logits [N,V_r] or [B,T,V_r]: this rank's columns [start, end) of the logits (any float dtype;
    computed in float32, float64 stays float64); targets [N] / [B,T] global ids (replicated on every rank).
    Pipeline: softcap c·tanh(x/c) → all-reduce MAX of the shards' row lse → all-reduce SUM of [target logit ‖
    sum-exp ‖ Σz] → loss = lse - (1-ε)·z_t - ε·Σz/V + z_loss·lse². Label smoothing uses the global V and the
    global mean of the logits. Rows with target == ignore_index count for nothing; `mean` divides by the
    number of other rows and is 0 (with zero gradients) when every row is ignored. Backward is local.
    vocab_size, if given, must equal the sum of the shards and match `vocab_range`. Collective: every rank
    of the group must call it with the same targets and options.
    """
    rank, _ = _check_group(group)
    error = None
    try:
        if not isinstance(local_logits, Tensor) or not local_logits.is_floating_point():
            raise TypeError("local_logits must be a floating-point tensor [N,V_local] or [B,T,V_local]")
        if local_logits.dim() not in (2, 3):
            raise ValueError(f"local_logits must be [N,V_local] or [B,T,V_local], got shape "
                             f"{tuple(local_logits.shape)}")
        ignore_index, reduction, label_smoothing, z_loss, softcap = checks.loss_options(
            ignore_index, reduction, label_smoothing, z_loss, softcap)
        n = local_logits.numel() // max(local_logits.shape[-1], 1)
        _check_targets(targets, n, vocab_size, ignore_index)
    except (TypeError, ValueError) as exc:
        if not isinstance(local_logits, Tensor):
            raise
        error = str(exc)
    width = local_logits.shape[-1] if isinstance(local_logits, Tensor) else 0
    shared = {"rows": local_logits.numel() // max(width, 1), "ignore_index": ignore_index,
              "reduction": reduction, "label_smoothing": float(label_smoothing), "z_loss": float(z_loss),
              "softcap": softcap, "targets": _targets_checksum(targets) if error is None else 0,
              "dtype": str(local_logits.dtype)}
    widths = _agree(group, "vocab_parallel_cross_entropy", shared, width, error, local_logits.device)
    start, end, vocab = _layout("vocab_parallel_cross_entropy", widths, vocab_size, rank)
    if vocab_size is None:
        _check_targets(targets, shared["rows"], vocab, ignore_index)  # same result on every rank

    logits2d = local_logits.reshape(-1, width)
    valid, kept = _prepare_targets(targets, ignore_index)
    rows = logits2d if valid is None else logits2d.index_select(0, valid)
    if rows.shape[0] == 0:
        per_row = rows.sum(dim=-1).to(compute_dtype(rows.dtype))  # empty, still attached to the graph
    else:
        columns = ShardedLossVocab(vocab, start, end - start, group)
        per_row = _VocabParallelCE.apply(rows, kept, columns, float(label_smoothing), float(z_loss), softcap)
    out = _reduce(per_row, valid, logits2d.shape[0], reduction)
    if reduction == "none":
        out = out.reshape(local_logits.shape[:-1])
    return out


def _chunk_rows(n: int, width: int, chunk_size: int | None) -> int:
    """Rows per chunk: `chunk_size`, or loss.py's `default_chunk_size` for this rank's V_r (a float32 [c,V_r]
    block ≤ min(256 MiB, 1/16 of [n,V_r]), c a multiple of 32) — the single-process loss's rule per shard."""
    if chunk_size is not None:
        return max(1, min(chunk_size, max(n, 1)))
    return default_chunk_size(max(n, 1), width)


class _VocabParallelLinearCE(torch.autograd.Function):
    """Fused projection + cross-entropy on one vocabulary shard, chunked over rows: never [n,V_r] at once.

    lmhead.loss's core per chunk. Forward keeps per row only (this shard's lse, target logit, Σz), then the
    two collectives (`ShardedLossVocab.lse`); backward recomputes each chunk's logits, forms G from
    p = exp(z − lse), and accumulates dW_r / db_r locally (fp32 for 16-bit inputs); dHidden is all-reduced
    (summed over the shards) because hidden is replicated.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                columns: ShardedLossVocab, label_smoothing: float, z_loss: float, softcap: float | None,
                chunk: int) -> Tensor:
        dt = weight.dtype
        cdt = compute_dtype(dt)
        n = hidden.shape[0]
        t, has_t = columns.local_targets(targets, cdt)
        b = None if bias is None else bias.to(dt)
        smoothing = bool(label_smoothing)
        stats = RowStats(torch.empty(n, dtype=cdt, device=hidden.device),
                         torch.empty(n, dtype=cdt, device=hidden.device),
                         torch.empty(n, dtype=cdt, device=hidden.device) if smoothing else None)
        scratch = ChunkScratch(min(chunk, n), weight.shape[0], dt, hidden.device)
        w_t = weight.t()
        for a in range(0, n, chunk):
            e = min(n, a + chunk)
            z, _ = scratch.logits(hidden[a:e].to(dt), w_t, b, softcap)
            chunk_stats = row_stats_(z, t[a:e], None if has_t is None else has_t[a:e], smoothing)
            for dst, src in zip(stats, chunk_stats, strict=True):
                if dst is not None:
                    dst[a:e] = src
        del scratch
        lse, z_t, total = columns.lse(stats)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.opts = (columns, label_smoothing, z_loss, softcap, chunk)
        return row_losses(lse, z_t, total, columns.size, label_smoothing, z_loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        columns, label_smoothing, z_loss, softcap, chunk = ctx.opts
        dt, cdt = weight.dtype, lse.dtype
        n, dev = hidden.shape[0], hidden.device
        t, has_t = columns.local_targets(targets, cdt)
        b = None if bias is None else bias.to(dt)
        grad = grad.to(cdt)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # dHidden in the compute dtype: the ranks' parts are summed before it is rounded to the input dtype
        d_hidden = torch.empty(n, hidden.shape[1], dtype=cdt, device=dev) if need_h else None
        d_weight = torch.empty(weight.shape, dtype=cdt, device=dev) if need_w else None  # chunk 0 writes it
        d_bias = torch.zeros(weight.shape[0], dtype=cdt, device=dev) if need_b and bias is not None else None
        scratch = ChunkScratch(min(chunk, n), weight.shape[0], dt, dev, softcap_grad=softcap is not None)
        w_t = weight.t()
        for a in range(0, n, chunk):
            e = min(n, a + chunk)
            x = hidden[a:e].to(dt)
            z, dcap = scratch.logits(x, w_t, b, softcap)
            p = z.sub_(lse[a:e, None]).exp_()  # the softmax over all V, this rank's columns
            alpha = grad_logits_(p, t[a:e], grad[a:e], lse[a:e], columns.size, label_smoothing, z_loss,
                                 has_t=None if has_t is None else has_t[a:e], dcap=dcap)
            accumulate_grads(scratch, p, x, weight, None, a, e, alpha, d_hidden, d_weight, d_bias)
        del scratch
        if d_hidden is not None:
            dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=columns.group)
            d_hidden = d_hidden.to(hidden.dtype)
        if d_weight is not None:
            d_weight = d_weight.to(weight.dtype)
        if d_bias is not None:
            d_bias = d_bias.to(bias.dtype)
        return (d_hidden, d_weight, d_bias) + (None,) * 6


def _check_fused_shapes(hidden: Any, local_weight: Any, local_bias: Any, shift: bool) -> None:
    """The tensors of `vocab_parallel_linear_cross_entropy`: types, shapes, one device."""
    if not isinstance(hidden, Tensor) or not hidden.is_floating_point():
        raise TypeError("hidden must be a floating-point tensor [N,D] or [B,T,D]")
    if not isinstance(local_weight, Tensor) or local_weight.dim() != 2:
        raise ValueError("local_weight must be a 2-D tensor [V_local, D]")
    if hidden.dim() not in (2, 3) or hidden.shape[-1] != local_weight.shape[1]:
        raise ValueError(f"hidden must be [N,D] or [B,T,D] with D = local_weight.shape[1] = "
                         f"{local_weight.shape[1]}, got shape {tuple(hidden.shape)}")
    if local_bias is not None and tuple(local_bias.shape) != (local_weight.shape[0],):
        raise ValueError(f"local_bias must be [V_local] = [{local_weight.shape[0]}], got "
                         f"{tuple(local_bias.shape)}")
    if shift and hidden.dim() != 3:
        raise ValueError("shift=True needs hidden [B,T,D] and targets [B,T]")
    if hidden.device != local_weight.device:
        raise ValueError(f"hidden ({hidden.device}) and local_weight ({local_weight.device}) must be on the "
                         "same device")


def vocab_parallel_linear_cross_entropy(
    hidden: Tensor,
    local_weight: Tensor,
    targets: Tensor,
    local_bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
    group: Any = None,
) -> Tensor:
    """Fused, chunked `linear_cross_entropy` with the head's weight split by vocabulary rows over `group`.

    hidden [N,D] or [B,T,D] (replicated on every rank), local_weight [V_r,D] = rows [start,end) of W,
    local_bias [V_r] or None, targets [N] / [B,T] global ids (replicated). Equals
    `linear_cross_entropy(hidden, W, targets, ...)` on the full weight. Ignored rows are dropped before the
    projection; the rest go through the shard in chunks of `chunk_size` rows (None: loss.py's
    `default_chunk_size` for [n, V_r]: a float32 chunk ≤ min(256 MiB, 1/16 of [n,V_r])), so [N,V_r] never
    exists at once. Collectives: one
    metadata all_gather, one MAX and one SUM all-reduce of O(N) numbers in forward; one SUM all-reduce of
    dHidden [N,D] in backward (every rank's shard contributes to the replicated hidden's gradient — Megatron's
    column-parallel input gradient). dW and db stay local. bf16/fp16: matmuls in the weight's dtype,
    statistics, dW and the loss in float32. shift=True predicts token t+1 from position t ([B,T] inputs).
    """
    rank, _ = _check_group(group)
    error = None
    try:
        _check_fused_shapes(hidden, local_weight, local_bias, shift)
        chunk_size = checks.optional_positive_int("chunk_size", chunk_size)
        ignore_index, reduction, label_smoothing, z_loss, softcap = checks.loss_options(
            ignore_index, reduction, label_smoothing, z_loss, softcap)
        if shift:
            if tuple(targets.shape) != tuple(hidden.shape[:2]):
                raise ValueError(f"targets must be [B,T] = {tuple(hidden.shape[:2])} with shift=True, got "
                                 f"{tuple(targets.shape)}")
            hidden, targets = hidden[:, :-1], targets[:, 1:]
        n = hidden.numel() // hidden.shape[-1]
        _check_targets(targets, n, vocab_size, ignore_index)
    except (TypeError, ValueError) as exc:
        if not isinstance(local_weight, Tensor) or not isinstance(hidden, Tensor):
            raise
        error = str(exc)
    width = local_weight.shape[0] if local_weight.dim() == 2 else 0
    d_model = local_weight.shape[-1] if local_weight.dim() else 0
    n = hidden.numel() // max(hidden.shape[-1], 1) if hidden.dim() else 0
    shared = {"rows": n, "d_model": d_model, "ignore_index": ignore_index, "reduction": reduction,
              "label_smoothing": float(label_smoothing), "z_loss": float(z_loss), "softcap": softcap,
              "bias": local_bias is not None, "shift": bool(shift), "dtype": str(local_weight.dtype),
              "targets": _targets_checksum(targets) if error is None else 0}
    op = "vocab_parallel_linear_cross_entropy"
    widths = _agree(group, op, shared, width, error, hidden.device)
    start, end, vocab = _layout(op, widths, vocab_size, rank)
    if vocab_size is None:
        _check_targets(targets, n, vocab, ignore_index)

    h2d = hidden.reshape(n, d_model)  # a copy only when shift made it non-contiguous
    valid, kept = _prepare_targets(targets, ignore_index)
    rows = h2d if valid is None else h2d.index_select(0, valid)
    cdt = compute_dtype(local_weight.dtype)
    if rows.shape[0] == 0:
        # every target ignored: loss 0, and zero (not missing) gradients for hidden, weight and bias
        anchor = local_weight.sum() * 0 + (local_bias.sum() * 0 if local_bias is not None else 0)
        per_row = (rows.sum(dim=-1) + anchor).to(cdt)
    else:
        chunk = _chunk_rows(rows.shape[0], width, chunk_size)
        columns = ShardedLossVocab(vocab, start, end - start, group)
        per_row = _VocabParallelLinearCE.apply(rows, local_weight, local_bias, kept, columns,
                                               float(label_smoothing), float(z_loss), softcap, chunk)
    out = _reduce(per_row, valid, n, reduction)
    if reduction == "none":
        out = out.reshape(targets.shape)
    return out


# --- modules ------------------------------------------------------------------------------------------------


class VocabParallelEmbedding(nn.Module):
    """Token embedding with its [V,D] table split by rows like the head (Megatron's VocabParallelEmbedding).

    Each rank looks up the ids in its range [start, end), writes zeros for the others, and one all-reduce SUM
    gives every rank the full embeddings [B,T,D] (backward: identity — each rank's rows get their gradient).
    Tie a `VocabParallelLMHead` to it with `tie_to=` (the same Parameter, the same rows).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        rank, world = _check_group(group)
        if not isinstance(embedding_dim, int) or embedding_dim < 1:
            raise ValueError(f"embedding_dim must be an int >= 1, got {embedding_dim!r}")
        self.group = group
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, world)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim,
                                               dtype=dtype, device=device))
        nn.init.normal_(self.weight)
        _agree(group, "VocabParallelEmbedding", {"vocab_size": num_embeddings, "d_model": embedding_dim},
               self.weight.shape[0], None, _comm_device(group, self.weight.device))

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
        return _ReduceFromVocabParallel.apply(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end})")


def _head_error(d_model: Any, vocab_size: Any, world: int, softcap: Any, tie_to: Any) -> str | None:
    """This rank's complaint about VocabParallelLMHead's arguments, or None (raised by `_agree` on every rank)."""
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
        rank, world = _check_group(group)
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
        _agree(group, "VocabParallelLMHead", {"vocab_size": vocab_size, "d_model": d_model, "bias": bool(bias),
                                              "softcap": softcap, "tied": tie_to is not None},
               width, error, _comm_device(group, fallback))

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
        hidden = _CopyToVocabParallel.apply(hidden, self.group)
        logits = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        return _softcapped(logits, self.softcap)

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
    rank, world = _check_group(group)
    width = local_logits.shape[-1]
    widths = _agree(group, "gather_vocab_parallel_logits", {"shape": str(tuple(local_logits.shape[:-1])),
                                                            "dtype": str(local_logits.dtype)},
                    width, None, local_logits.device)
    biggest = max(widths)
    padded = local_logits.new_zeros(*local_logits.shape[:-1], biggest)
    padded[..., :width] = local_logits.detach()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


# --- sampling -----------------------------------------------------------------------------------------------
#
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
        self.world = _check_group(group)[1]

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
    rank, _ = _check_group(group)
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
              "prev": _targets_checksum(prev) if prev is not None else -1, "step": repr(steps),
              "generator": _generator_fingerprint(generator) if unseeded and error is None else 0}
    widths = _agree(group, op, shared, local_logits.shape[-1], error, local_logits.device)
    start, _, vocab = _layout(op, widths, vocab_size, rank)
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

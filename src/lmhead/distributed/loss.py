"""The vocabulary-parallel cross-entropy (on logits, and fused with the head's matmul): lmhead.loss's per-chunk
core over this rank's columns, with `ShardedLossVocab` combining the row statistics over the ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lmhead import checks
from lmhead.distributed.protocol import agree, check_group, shard_layout, targets_checksum
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


def softcapped(x: Tensor, softcap: float | None) -> Tensor:
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
    rank, _ = check_group(group)
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
              "softcap": softcap, "targets": targets_checksum(targets) if error is None else 0,
              "dtype": str(local_logits.dtype)}
    widths = agree(group, "vocab_parallel_cross_entropy", shared, width, error, local_logits.device)
    start, end, vocab = shard_layout("vocab_parallel_cross_entropy", widths, vocab_size, rank)
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
    rank, _ = check_group(group)
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
              "targets": targets_checksum(targets) if error is None else 0}
    op = "vocab_parallel_linear_cross_entropy"
    widths = agree(group, op, shared, width, error, hidden.device)
    start, end, vocab = shard_layout(op, widths, vocab_size, rank)
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

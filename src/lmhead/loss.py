"""Fused linear cross-entropy: the training loss of an LM head without its [N,V] logits.

    hidden [N,D] ─┐ drop ignored rows (and, with shift=True, pair position t with token t+1) ─▶ rows [n]
    weight [V,D] ─┤ for each chunk of c rows:
    targets [N]  ─┘   z = x·Wᵀ (+ b) [c,V] ─softcap─▶ z_t, Σz; log_softmax in place ─▶ lse = z_t − log p_t
                      ─▶ loss = lse − (1−ε)·z_t − ε·Σz/V + z_loss·lse², lse [c]
                      z ─exp_ in place─▶ p ─▶ G = ∂loss/∂z = g·[p·(1+2·z_loss·lse) − (1−ε)·onehot − ε/V]·cap'
                      dHidden[rows] = G·W,   dW += Gᵀ·x (one fp32 buffer),   db += Σ_rows G

The per-chunk steps are one core (`ChunkScratch.logits`, `row_stats_`, `LossVocab.lse`, `row_losses`,
`grad_logits_`, `accumulate_grads`) that lmhead.distributed runs over a vocabulary shard, with the row
statistics combined by all-reduces instead of in-process.

Only one chunk of logits (`[c,V]`, reused for every chunk) exists at a time; the per-token statistics are
O(n). Definitions are those of `F.cross_entropy` on the full logits (tests/reference.py), per token:

    loss_i = (1−ε)·(lse_i − z_i,t) + ε·(lse_i − mean_v z_i,v) + z_loss·lse_i²,   z = softcap·tanh(z/softcap)

Gradient strategy: the gradients for `reduction="mean"`/`"sum"` are computed in the forward pass while the
chunk's logits are still in memory (Liger Kernel's approach: three matmuls per chunk, no recomputation) and
handed to autograd in the backward, scaled by the incoming gradient. CCE's alternative — keep only lse,
recompute the logits in backward — costs a fourth matmul per chunk (benchmarks/bench_loss.py and docs/loss.md
compare them). The recomputing backward is still used where the forward cannot know the
per-token weights: `reduction="none"`, a gradient flowing into the returned `lse`, and any second backward
through a retained graph (the precomputed buffers are released to autograd by the first one).

Chunk size: `chunk_size=None` takes the largest multiple of 32 rows whose float32 logits chunk fits in
min(256 MiB, 1/16 of the full [n,V] float32 logits) — so the loss's working memory stays a few percent of the
plain computation's, and never above ~256 MiB plus the gradients — with at least 32 rows per chunk (below that
the matmuls lose most of their speed); problems whose full logits fit in 8 MiB run as one chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from lmhead import checks

# linear_cross_entropy is the API (re-exported by lmhead); the rest is the per-chunk core that
# lmhead.distributed shares (see "the per-chunk core" below), public to lmhead's modules but not re-exported.
__all__ = [
    "ChunkScratch",
    "LossVocab",
    "RowStats",
    "accumulate_grads",
    "apply_softcap_",
    "compute_dtype",
    "default_chunk_size",
    "grad_logits_",
    "linear_cross_entropy",
    "row_losses",
    "row_stats_",
]

_BUDGET_BYTES = 256 * 2**20  # absolute cap on one chunk's float32 logits
_BUDGET_FRACTION = 16  # ... and at most 1/16 of the full [n,V] float32 logits
_BUDGET_FLOOR = 8 * 2**20  # ... but small problems (full logits <= 8 MiB) take one chunk: nothing to save
_ROW_MULTIPLE = 32  # chunk rows are a multiple of this (matmul blocking) and at least this
_DW_BLOCK = 8192  # vocabulary rows per bf16/fp16 dW block (its fp32 accumulation)

@dataclass(frozen=True)
class _Options:
    """Validated loss options shared by forward and backward."""

    label_smoothing: float
    z_loss: float
    softcap: float | None
    reduction: str
    chunk: int


@dataclass(frozen=True)
class _Rows:
    """Which rows of hidden [N,D] are scored and against which token.

    rows: indices into hidden.reshape(-1, D) (None = all rows 0..n-1 in order, no gather needed);
    targets [n]; positions: indices into the flat per-token output (None = same as rows)."""

    rows: Tensor | None
    targets: Tensor
    positions: Tensor | None
    out_shape: tuple[int, ...]
    n_total: int  # rows of hidden.reshape(-1, D)


def default_chunk_size(n: int, vocab_size: int) -> int:
    """Rows per chunk for chunk_size=None: a float32 [c,V] chunk ≤ min(256 MiB, max(n·V·4/16, 8 MiB)), c a
    multiple of 32 and at least 32 (or n)."""
    budget = min(_BUDGET_BYTES, max(n * vocab_size * 4 // _BUDGET_FRACTION, _BUDGET_FLOOR))
    c = budget // (vocab_size * 4) // _ROW_MULTIPLE * _ROW_MULTIPLE
    return max(1, min(n, max(_ROW_MULTIPLE, c)))


# --- validation -------------------------------------------------------------------------------------------


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, shift: bool) -> None:
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V,D], got shape {tuple(weight.shape)}")
    vocab, d_model = weight.shape
    if hidden.dim() not in (2, 3) or hidden.shape[-1] != d_model:
        raise ValueError(f"hidden must be [N,D] or [B,T,D] with D = weight.shape[1] = {d_model}, got shape "
                         f"{tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}; they must match")
    if bias is not None:
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"bias must be [V] = [{vocab}], got shape {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match weight dtype {weight.dtype}")
        if bias.device != weight.device:
            raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}; they must match")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor of token ids, got dtype {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}; they must match")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden's without D), got "
                         f"{tuple(targets.shape)}")
    if shift and hidden.shape[-2] < 1:
        raise ValueError("shift=True needs at least one position")


def _select_rows(targets: Tensor, ignore_index: int, vocab: int, shift: bool) -> _Rows:
    """Pair each scored position with its token; drop ignored ones. No copy of hidden is made here."""
    if targets.dim() == 1:
        targets = targets[None]  # one sequence [1,N]
        squeeze = True
    else:
        squeeze = False
    batch, time = targets.shape
    n_total = batch * time
    tgt = targets[:, 1:] if shift else targets  # [B,T'] token predicted by each scored position
    out_shape = tuple(tgt.shape[1:]) if squeeze else tuple(tgt.shape)
    flat = tgt.reshape(-1).long()
    keep = flat != ignore_index
    bad = keep & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        value = int(flat[bad][0])
        raise ValueError(f"targets must be token ids in [0, {vocab}) or ignore_index={ignore_index}, found "
                         f"{value}")
    if bool(keep.all()) and not shift:
        return _Rows(None, flat, None, out_shape, n_total)
    positions = keep.nonzero().squeeze(1)  # into the flat [B,T'] output
    rows = positions
    if shift and positions.numel():
        rows = positions + positions // tgt.shape[1]  # [B,T-1] position -> row b·T + t of hidden [B·T,D]
    return _Rows(rows, flat.index_select(0, positions), positions, out_shape, n_total)


# --- the per-chunk core (lmhead.distributed runs it over a vocabulary shard) --------------------------------
#
# Public names, not re-exported by lmhead: the building blocks this module and lmhead.distributed share. One
# chunk of rows x [c,D] against the columns [start, start + V_r) of the vocabulary this process holds (all of
# it here, one shard there):
#     ChunkScratch.logits   z = softcap(x·Wᵀ + b) [c,V_r] in the compute dtype (and softcap's derivative)
#     row_stats_            z ← log p over these columns in place; per row: lse, target logit, Σz (RowStats)
#     LossVocab.lse         the statistics over the whole vocabulary: these already, in-process; all-reduced
#                           by lmhead.distributed.ShardedLossVocab                    → lse, z_t, Σz
#     row_losses            loss = lse − (1−ε)·z_t − ε·Σz/V + z_loss·lse²
#     grad_logits_          p [c,V_r] ← G = ∂out/∂z = g·[p·(1+2·z_loss·lse) − (1−ε)·onehot − ε/V]·cap'
#     accumulate_grads      dHidden = G·W, dW (+)= Gᵀ·x, db += Σ_rows G
# The single-process loop holds a chunk's log-softmax right after its statistics (p = exp(log p), as torch's
# cross_entropy backward forms it) and forms the gradients in the same pass; the sharded one knows lse only
# after its all-reduces and recomputes the chunk in the backward (p = exp(z − lse)).


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics, dW accumulation and the loss: float32 for 16-bit inputs, else the input dtype."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class RowStats(NamedTuple):
    """Per-row statistics [c] of a block of logits z [c,V_r] over the columns this process holds."""

    lse: Tensor  # log Σ_v exp z_v
    target: Tensor  # z_t (0 where the target is another shard's column)
    total: Tensor | None  # Σ_v z_v (label smoothing), None without it


class LossVocab:
    """The vocabulary axis of the fused loss, as sampling.Vocab is the sampling pipeline's: the columns
    [start, start + width) of V that this process scores, and how their row statistics combine into the whole
    vocabulary's. This class is the whole vocabulary in one process; `lmhead.distributed.ShardedLossVocab` is
    one shard of it, combining the ranks' statistics with two all-reduces."""

    def __init__(self, size: int, start: int = 0, width: int | None = None) -> None:
        self.size, self.start = size, start
        self.width = size - start if width is None else width

    def local_targets(self, targets: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """Global ids [n] → (their column in the local block [n,1] (0 where another process holds it), 1.0
        where this process holds it [n] in `dtype` — None when every column is here)."""
        if self.start == 0 and self.width == self.size:
            return targets[:, None], None
        mine = (targets >= self.start) & (targets < self.start + self.width)
        local = torch.where(mine, targets - self.start, torch.zeros_like(targets))
        return local[:, None], mine.to(dtype)

    def lse(self, stats: RowStats) -> RowStats:
        """This process's row statistics [n] → the whole vocabulary's (here: the same)."""
        return stats


def apply_softcap_(z: Tensor, softcap: float | None, dcap: Tensor | None = None) -> Tensor:
    """z ← softcap·tanh(z/softcap) in place; dcap [same shape] ← its derivative 1 − tanh² when given."""
    if softcap is None:
        return z
    z.div_(softcap).tanh_()
    if dcap is not None:
        torch.addcmul(torch.ones((), dtype=z.dtype, device=z.device), z, z, value=-1.0, out=dcap)
    return z.mul_(softcap)


class ChunkScratch:
    """The [c,V_r] buffers a chunked pass reuses for every chunk: the logits in the compute dtype (→ p → G),
    the 16-bit matmul's output for 16-bit inputs, softcap's derivative (softcap_grad) and, allocated when dW
    is first accumulated, the 16-bit dW block."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device,
                 softcap_grad: bool = False) -> None:
        self.dtype, self.cdt = dtype, compute_dtype(dtype)
        self.z = torch.empty(rows, width, dtype=self.cdt, device=device)
        self.low = torch.empty(rows, width, dtype=dtype, device=device) if self.cdt != dtype else None
        self.dcap = torch.empty(rows, width, dtype=self.cdt, device=device) if softcap_grad else None
        self.dw_block: Tensor | None = None

    def logits(self, x: Tensor, w_t: Tensor, bias: Tensor | None,
               softcap: float | None) -> tuple[Tensor, Tensor | None]:
        """x [c,D] (the weight's dtype), w_t = Wᵀ [D,V_r] → (z [c,V_r] = softcap(x·Wᵀ + b) in the compute dtype,
        softcap's derivative [c,V_r] or None). The matmul runs in the input dtype (as HF's 16-bit logits)."""
        c = x.shape[0]
        z = self.z[:c]
        mm_out = self.low[:c] if self.low is not None else z
        if bias is None:
            torch.mm(x, w_t, out=mm_out)
        else:
            torch.addmm(bias, x, w_t, out=mm_out)
        if self.low is not None:
            z.copy_(mm_out)  # HF: logits computed in 16 bits, upcast to float32
        dcap = self.dcap[:c] if self.dcap is not None else None
        return apply_softcap_(z, softcap, dcap), dcap

    def for_matmul(self, g: Tensor) -> Tensor:
        """G [c,V_r] in the input dtype, for the gradient matmuls (a copy for 16-bit inputs)."""
        if self.low is None:
            return g
        return self.low[: g.shape[0]].copy_(g)


def row_stats_(z: Tensor, t: Tensor, has_t: Tensor | None, smoothing: bool) -> RowStats:
    """Per row of z [c,V_r]: lse over these columns, the target logit z_t (t [c,1] its local column; × has_t [c],
    1.0 where the target is one of these columns, None: always) and Σz when smoothing.

    z ← log_softmax over these columns, in place (one fused pass, no [c,V_r] temporary); lse is read back from
    it at a column whose logit is known: z_t − log p_t, or the row max − log p_max where the target may be
    another process's."""
    z_t = z.gather(1, t).squeeze(1)
    m, at_max = z.max(dim=1, keepdim=True) if has_t is not None else (None, None)
    total = z.sum(dim=1) if smoothing else None
    torch.ops.aten._log_softmax.out(z, 1, False, out=z)  # in place, row-wise: z ← log p
    if has_t is None:
        lse = z_t - z.gather(1, t).squeeze(1)
    else:
        lse = (m - z.gather(1, at_max)).squeeze(1)
        z_t = z_t * has_t
    return RowStats(lse, z_t, total)


def row_losses(lse: Tensor, target: Tensor, total: Tensor | None, vocab_size: int, label_smoothing: float,
               z_loss: float) -> Tensor:
    """Per-row loss [n] = lse − (1−ε)·z_t − ε·Σz/V + z_loss·lse², with the whole vocabulary's V and Σz
    (torch's smoothing: ε·mean over V of −log p; Megatron#737 uses a shard's, which changes with the ranks)."""
    loss = lse - (1.0 - label_smoothing) * target
    if label_smoothing:
        loss = loss - (label_smoothing / vocab_size) * total
    if z_loss:
        loss = loss + z_loss * lse * lse
    return loss


def grad_logits_(p: Tensor, t: Tensor, grad_rows: Tensor | float, lse: Tensor, vocab_size: int,
                 label_smoothing: float, z_loss: float, has_t: Tensor | None = None,
                 grad_lse: Tensor | None = None, dcap: Tensor | None = None) -> float:
    """p [c,V_r] (the softmax over V of the chunk's columns) → G/alpha in place, G = ∂out/∂(raw logits);
    returns alpha, the gradient matmuls' scale.

    grad_rows: ∂out/∂loss_i (a float for every row, or [c]); grad_lse [c]: ∂out/∂lse_i; lse [c]; t [c,1] the
    target's local column, has_t [c] 1.0 where it is this process's; dcap: softcap's derivative [c,V_r]."""
    c = p.shape[0]
    eps, zl = label_smoothing, z_loss
    # One coefficient for every row (mean/sum without z-loss or an lse gradient): G = r·(P − (c1/r)·onehot
    # − c2/r): only the target column changes and r rides on the matmuls' alpha — no extra pass over [c,V].
    if isinstance(grad_rows, float) and grad_rows != 0.0 and not zl and grad_lse is None:
        alpha = grad_rows
        hit = p.new_full((c, 1), -(1.0 - eps)) if has_t is None else (-(1.0 - eps) * has_t)[:, None]
        p.scatter_add_(1, t, hit)
        if eps:
            p.sub_(eps / vocab_size)
    else:
        g = torch.as_tensor(grad_rows, dtype=p.dtype, device=p.device).expand(c)
        r = g * (1.0 + 2.0 * zl * lse) if zl else g  # coefficient of p
        if grad_lse is not None:
            r = r + grad_lse
        alpha = 1.0
        p.mul_(r[:, None])
        hit = -(1.0 - eps) * g if has_t is None else -(1.0 - eps) * g * has_t
        p.scatter_add_(1, t, hit[:, None])
        if eps:
            p.sub_((g * (eps / vocab_size))[:, None])
    if dcap is not None:
        p.mul_(dcap)
    return alpha


def accumulate_grads(scratch: ChunkScratch, g: Tensor, x: Tensor, weight: Tensor, rows: Tensor | None, s: int,
                     e: int, alpha: float, dh: Tensor | None, dw: Tensor | None, db: Tensor | None) -> None:
    """Chunk [s,e)'s share of the gradients: dHidden rows = alpha·G·W, dW (+)= alpha·Gᵀ·x, db += alpha·Σ_rows G.

    g: G [c,V_r] in the compute dtype; x [c,D]; rows: the chunk's rows are dh[rows[s:e]] (None: dh[s:e]).
    dh may be in the compute dtype (summed over ranks before it is rounded) or the input dtype; dW and db are
    in the compute dtype: for 16-bit inputs dW is accumulated in float32 per vocabulary block of 16-bit
    matmuls. The chunk at s = 0 writes dW (beta=0): no zero-fill pass over [V_r,D]."""
    gz = scratch.for_matmul(g)
    first = s == 0
    if dh is not None:
        if rows is None and dh.dtype == gz.dtype:
            dst = dh[s:e]
            torch.addmm(dst, gz, weight, beta=0, alpha=alpha, out=dst)  # beta=0: dst is not read
        elif rows is None:
            dh[s:e] = torch.mm(gz, weight) if alpha == 1.0 else torch.mm(gz, weight).mul_(alpha)
        else:
            dh.index_copy_(0, rows[s:e], torch.addmm(x, gz, weight, beta=0, alpha=alpha).to(dh.dtype))
    if dw is not None:
        if scratch.low is None:
            torch.addmm(dw, gz.t(), x, beta=0 if first else 1, alpha=alpha, out=dw)
        else:  # 16-bit matmul per vocabulary block, accumulated in float32 across chunks
            vocab = dw.shape[0]
            if scratch.dw_block is None:
                scratch.dw_block = torch.empty(min(_DW_BLOCK, vocab), x.shape[1], dtype=x.dtype, device=x.device)
            for v0 in range(0, vocab, _DW_BLOCK):
                v1 = min(v0 + _DW_BLOCK, vocab)
                tmp = scratch.dw_block[: v1 - v0]
                torch.mm(gz[:, v0:v1].t(), x, out=tmp)
                if first:
                    torch.mul(tmp, alpha, out=dw[v0:v1])
                else:
                    dw[v0:v1].add_(tmp, alpha=alpha)
    if db is not None:
        db.add_(g.sum(0), alpha=alpha)


# --- the single-process loop ------------------------------------------------------------------------------


def _chunked(h2: Tensor, weight: Tensor, bias: Tensor | None, sel: _Rows, opt: _Options,
             grad_rows: Tensor | float | None, grad_lse: Tensor | None,
             need: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-row losses and lse [n] (compute dtype) and, when grad_rows is given, the gradients.

    grad_rows: ∂out/∂loss_i (a float for all rows, or [n]); grad_lse: ∂out/∂lse_i [n] or None.
    need: which of (dHidden, dW, db) to compute. Returns (loss[n], lse[n], dh2 [N_total,D], dW [V,D], db [V])
    with the gradients in the inputs' dtypes (None where not needed). Per chunk, the core above: logits →
    statistics → loss and lse → (p → G → dHidden, dW, db)."""
    n = sel.targets.numel()
    vocab_size, d_model = weight.shape
    dt = weight.dtype
    cdt = compute_dtype(dt)
    grads = grad_rows is not None and any(need)
    c_max = min(opt.chunk, n)
    dev = h2.device
    eps, zl = opt.label_smoothing, opt.z_loss
    vocab = LossVocab(vocab_size)

    loss = torch.empty(n, dtype=cdt, device=dev)
    lse = torch.empty(n, dtype=cdt, device=dev)
    scratch = ChunkScratch(c_max, vocab_size, dt, dev, softcap_grad=grads and opt.softcap is not None)
    # Gradient buffers: the first chunk writes dW (beta=0), so no zero-fill pass over [V,D]; dHidden needs
    # zeros only where rows are skipped (ignored targets, the last position with shift).
    all_rows = sel.rows is None and n == sel.n_total
    dh2 = None
    if grads and need[0]:
        dh2 = (torch.empty if all_rows else torch.zeros)(sel.n_total, d_model, dtype=dt, device=dev)
    dw = torch.empty(vocab_size, d_model, dtype=cdt, device=dev) if grads and need[1] else None
    db = torch.zeros(vocab_size, dtype=cdt, device=dev) if grads and need[2] and bias is not None else None
    w_t = weight.t()

    for s in range(0, n, c_max):
        e = min(s + c_max, n)
        x = h2[s:e] if sel.rows is None else h2.index_select(0, sel.rows[s:e])  # [c,D]
        t, _ = vocab.local_targets(sel.targets[s:e], cdt)  # [c,1]
        z, dcap = scratch.logits(x, w_t, bias, opt.softcap)  # [c,V]
        lse_c, z_t, total = vocab.lse(row_stats_(z, t, None, bool(eps)))  # z ← log p
        loss[s:e] = row_losses(lse_c, z_t, total, vocab_size, eps, zl)
        lse[s:e] = lse_c
        if not grads:
            continue
        p = z.exp_()  # the softmax: the whole vocabulary is in this chunk
        g_rows = grad_rows if isinstance(grad_rows, float) else grad_rows[s:e]
        alpha = grad_logits_(p, t, g_rows, lse_c, vocab_size, eps, zl,
                             grad_lse=None if grad_lse is None else grad_lse[s:e], dcap=dcap)
        accumulate_grads(scratch, p, x, weight, sel.rows, s, e, alpha, dh2, dw, db)

    del scratch
    if dw is not None and cdt != dt:
        dw = dw.to(dt)
    if db is not None and cdt != dt:
        db = db.to(dt)
    return loss, lse, dh2, dw, db


def _scatter_rows(values: Tensor, sel: _Rows) -> Tensor:
    """Per-row values [n] -> the per-token output shape, 0 at ignored positions."""
    if sel.positions is None:
        return values.reshape(sel.out_shape)
    out = values.new_zeros(math.prod(sel.out_shape))
    out.index_copy_(0, sel.positions, values)
    return out.reshape(sel.out_shape)


class _LinearCrossEntropy(torch.autograd.Function):
    """(loss, lse) from (hidden, weight, bias); targets and options ride along as non-tensors."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, sel: _Rows, opt: _Options,
                precompute: bool) -> tuple[Tensor, Tensor]:
        d_model = weight.shape[1]
        h2 = hidden.reshape(-1, d_model)  # a view for contiguous hidden
        n = sel.targets.numel()
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_rows = None
        if precompute and any(need) and opt.reduction != "none":
            grad_rows = 1.0 / n if opt.reduction == "mean" else 1.0
        loss_rows, lse_rows, dh2, dw, db = _chunked(h2, weight, bias, sel, opt, grad_rows, None, need)

        ctx.save_for_backward(hidden, weight, bias)
        ctx.sel, ctx.opt, ctx.need = sel, opt, need
        ctx.pre = (dh2, dw, db) if grad_rows is not None else None
        ctx.set_materialize_grads(False)
        if opt.reduction == "none":
            loss = _scatter_rows(loss_rows, sel)
        else:
            loss = loss_rows.sum()
            if opt.reduction == "mean":
                loss = loss / n
        return loss, _scatter_rows(lse_rows, sel)

    @staticmethod
    def backward(ctx, grad_loss: Tensor | None, grad_lse: Tensor | None):
        hidden, weight, bias = ctx.saved_tensors
        sel, opt, need = ctx.sel, ctx.opt, ctx.need
        pre, ctx.pre = ctx.pre, None  # hand the buffers to autograd; a retained graph's 2nd pass recomputes
        if grad_loss is None and grad_lse is None:
            return None, None, None, None, None, None
        n = sel.targets.numel()
        h2 = hidden.reshape(-1, weight.shape[1])
        if grad_lse is None and opt.reduction != "none":
            # the forward's precomputed gradients for a unit grad_output, or — second backward through a
            # retained graph — the same computation again (bit-identical), then scaled
            if pre is None:
                pre = _chunked(h2, weight, bias, sel, opt, 1.0 / n if opt.reduction == "mean" else 1.0, None,
                               need)[2:]
            dh2, dw, db = pre
            scale = grad_loss.item()
            if scale != 1.0:
                for buf in pre:
                    if buf is not None:
                        buf.mul_(scale)
        else:
            cdt = compute_dtype(weight.dtype)
            if grad_loss is None:
                g: Tensor | float = torch.zeros(n, dtype=cdt, device=hidden.device)
            elif opt.reduction == "none":
                flat = grad_loss.reshape(-1).to(cdt)
                g = flat if sel.positions is None else flat.index_select(0, sel.positions)
            else:
                g = (grad_loss.to(cdt) / (n if opt.reduction == "mean" else 1)).expand(n).contiguous()
            gl = None
            if grad_lse is not None:
                flat = grad_lse.reshape(-1).to(cdt)
                gl = flat if sel.positions is None else flat.index_select(0, sel.positions)
            _, _, dh2, dw, db = _chunked(h2, weight, bias, sel, opt, g, gl, need)
        dh = dh2.view(hidden.shape) if dh2 is not None else None
        return dh, dw, db, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    chunk_size: int | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of `hidden @ weight.T (+ bias)` against `targets`, without materialising the logits.

    Equals `F.cross_entropy(softcap(F.linear(hidden, weight, bias)).float(), targets, ignore_index=...,
    reduction=..., label_smoothing=...)` + z_loss·lse² per token, forward and gradients, while holding only
    one [chunk_size, V] block of logits at a time.

    Args:
        hidden: [N,D] or [B,T,D] final hidden states (float32, bfloat16, float16 or float64).
        weight: [V,D] head weight, same dtype and device as hidden.
        targets: [N] or [B,T] token ids in [0, V), or `ignore_index`.
        bias: optional [V].
        ignore_index: targets equal to it are dropped before the projection (no work, no gradient).
        reduction: "mean" (over non-ignored tokens), "sum", or "none" (per-token losses shaped like targets,
            0 at ignored positions; gradients follow the per-token grad_output).
        label_smoothing: ε in [0, 1): (1−ε)·nll + ε·mean over V of −log p (torch's definition).
        z_loss: coefficient of lse² added per token (PaLM's auxiliary loss), ≥ 0.
        softcap: c > 0 applies c·tanh(logits/c) before the softmax (Gemma 2), gradient included.
        shift: position t predicts targets[..., t+1] (the training setup): the last position and the first
            target are unused, outputs for reduction="none"/lse are [B,T-1] ([N-1]). Nothing is copied.
        chunk_size: rows per chunk; None picks the largest multiple of 32 whose float32 [c,V] logits take
            ≤ min(256 MiB, 1/16 of the full [n,V] float32 logits), at least 32 (n = non-ignored rows);
            when the full logits fit in 8 MiB, one chunk.
        return_lse: also return the per-token log-sum-exp (float32, 0 at ignored positions), differentiable.

    Returns:
        The loss (float32 for 16-bit inputs, else the input dtype), or (loss, lse) with return_lse=True.

    Semantics worth knowing: when every target is ignored, the loss is 0 and every gradient is zero
    (F.cross_entropy gives NaN for "mean"). 16-bit inputs: the matmuls run in the input dtype (as HF's
    bf16 logits), softmax statistics, the target term and dW are accumulated in float32. Gradients for
    mean/sum are computed during the forward pass (when grad is enabled) and returned by the backward;
    reduction="none", a gradient into lse, or a second backward (retain_graph) recompute them chunk by chunk.
    """
    _check_inputs(hidden, weight, targets, bias, shift)
    ignore_index, reduction, label_smoothing, z_loss, softcap = checks.loss_options(
        ignore_index, reduction, label_smoothing, z_loss, softcap)
    chunk_size = checks.optional_positive_int("chunk_size", chunk_size)
    shift, return_lse = checks.flag("shift", shift), checks.flag("return_lse", return_lse)
    vocab = weight.shape[0]
    sel = _select_rows(targets, ignore_index, vocab, shift)
    n = sel.targets.numel()
    cdt = compute_dtype(weight.dtype)

    if n == 0:  # every target ignored: 0, with zero (not missing) gradients, where torch's mean gives NaN
        anchor = hidden.sum() * 0 + weight.sum() * 0 + (bias.sum() * 0 if bias is not None else 0)
        anchor = anchor.to(cdt)
        zeros = torch.zeros(sel.out_shape, dtype=cdt, device=hidden.device) + anchor
        loss = zeros if reduction == "none" else anchor
        return (loss, zeros) if return_lse else loss

    chunk = chunk_size if chunk_size is not None else default_chunk_size(n, vocab)
    opt = _Options(label_smoothing, z_loss, softcap, reduction, chunk)
    precompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    loss, lse = _LinearCrossEntropy.apply(hidden, weight, bias, sel, opt, precompute)
    return (loss, lse) if return_lse else loss

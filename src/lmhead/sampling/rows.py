"""Passes over whole rows [b,V_r]: block masses in cache-sized chunks and the two-level inverse-CDF draw."""

from __future__ import annotations

import torch
from torch import Tensor

from lmhead.sampling.vocab import BLOCK, NEG_INF, Vocab, chunk_columns, tail_exp_

_FLOOR_ROWS = 64


# A part of a batch after the cut: (rows, vals, idx). rows: indices into the batch (None = all rows);
# vals: temperature-scaled logits, -inf = cut; idx: the token id of each column of vals, or None when vals
# are whole rows [b,V]. Candidates [b,m] are sorted by value, descending.
Part = tuple[Tensor | None, Tensor, Tensor | None]


def sub_part(rows: Tensor | None, pick: Tensor) -> Tensor:
    return pick if rows is None else rows[pick]


def block_sums(x: Tensor, top: Tensor, temperature: float | Tensor, block: int = BLOCK, start: int = 0,
                floor: Tensor | None = None) -> Tensor:
    """Σ exp(x/T − top) over each block of `block` columns → [b, n] float32, the n blocks that x's columns
    touch on a grid of blocks that starts at id 0 (x [b,V_r] holds ids [start, start + V_r); the first block
    is start // block, its columns before `start` count 0). With `floor` [b,1], only the tokens with
    x/T > floor count (the mass strictly above a value). temperature: a number, or a column [b,1] of one per row.

    Runs over cache-sized chunks with one reused buffer: no [B,V] temporary (whose page faults alone cost
    about as much as the arithmetic)."""
    batch, width = x.shape
    if floor is not None and batch > _FLOOR_ROWS:  # rows in groups: chunks stay long, threshold_ calls few
        return torch.cat([block_sums(x[r : r + _FLOOR_ROWS], top[r : r + _FLOOR_ROWS],
                                      temperature[r : r + _FLOOR_ROWS] if isinstance(temperature, Tensor)
                                      else temperature, block, start, floor[r : r + _FLOOR_ROWS])
                          for r in range(0, batch, _FLOOR_ROWS)])
    offset = start % block  # grid positions before the first column
    span = offset + width
    chunk = chunk_columns(batch, span, block)
    out = torch.empty(batch, -(-span // block), dtype=torch.float32, device=x.device)
    buf = torch.empty(batch, chunk, dtype=torch.float32, device=x.device)
    floors = [] if floor is None else floor[:, 0].tolist()  # float32 values: exact as Python floats
    for pos in range(0, span, chunk):  # grid positions [pos, pos + chunk)
        head = max(offset - pos, 0)
        part = x[:, max(pos - offset, 0) : pos + chunk - offset]
        end = head + part.shape[1]
        padded = -(-end // block) * block
        if head:
            buf[:, :head] = 0.0
        b = buf[:, head:end]
        torch.div(part, temperature, out=b)
        for row, value in enumerate(floors):  # threshold_ per row: a broadcast bool mask costs as much as the exp
            torch.threshold_(b[row], value, NEG_INF)
        tail_exp_(b.sub_(top))
        if padded > end:
            buf[:, end:padded] = 0.0
        out[:, pos // block : pos // block + padded // block] = buf[:, :padded].view(batch, -1, block).sum(-1)
    return out


def grid_sums(x: Tensor, top: Tensor, temperature: float | Tensor, floor: Tensor | None, vocab: Vocab) -> Tensor:
    """Σ exp(x/T − top) per block of 1024 ids over the whole vocabulary (only x/T > floor when a floor [b,1] is
    given) → [b, ⌈V/1024⌉] float32. x [b,V_r] are local columns; over shards each rank's blocks are put in
    place on the whole grid and summed (each column belongs to one shard)."""
    block = min(BLOCK, vocab.size)
    sums = block_sums(x, top, temperature, block, vocab.start, floor)
    n_blocks = -(-vocab.size // block)
    if sums.shape[1] != n_blocks:  # a shard: its blocks in place on the whole grid
        first = vocab.start // block
        grid = torch.zeros(x.shape[0], n_blocks, dtype=sums.dtype, device=sums.device)
        grid[:, first : first + sums.shape[1]] = sums
        sums = grid
    return vocab.sum(sums)


def draw_in_blocks(x: Tensor, temperature: float | Tensor, top: Tensor, floor: Tensor | None, sums: Tensor, u: Tensor,
                    vocab: Vocab) -> tuple[Tensor, Tensor]:
    """Inverse CDF with one uniform u [b,1] (float64, in [0, 1)) per row, in two levels: the block by its mass in
    `sums` (from `grid_sums` with the same floor), then the token inside it → (ids [b] global, their x/T
    [b,1]). Zero-mass tokens are never picked: rounding that leaves u at or past a total takes the last block
    or token with mass. Over shards the chosen block's 1024 values are summed (each column is one shard's)."""
    width = x.shape[1]
    block = min(BLOCK, vocab.size)
    positions = torch.arange(max(block, sums.shape[1]), device=x.device)
    cdf = sums.cumsum(dim=-1, dtype=torch.float64)
    u = u * cdf[:, -1:]
    last_blk = torch.where(sums > 0, positions[: sums.shape[1]], -1).amax(dim=-1, keepdim=True)
    blk = torch.minimum(torch.searchsorted(cdf, u, right=True), last_blk)
    rest = u - torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp_min(0)), torch.zeros_like(u))
    cols = blk * block + positions[:block]  # global ids; the last block may run past V
    local = cols - vocab.start
    mine = (local >= 0) & (local < width)
    xt = vocab.sum(torch.where(mine, x.gather(1, local.clamp(0, width - 1)) / temperature, 0.0))
    live = cols < vocab.size
    if floor is not None:
        live &= xt > floor
    e = tail_exp_(torch.where(live, xt - top, NEG_INF))  # as the block sums count them
    within = e.cumsum(dim=-1, dtype=torch.float64)
    last = torch.where(e > 0, positions[:block], -1).amax(dim=-1, keepdim=True)
    pick = torch.minimum(torch.searchsorted(within, rest, right=True), last)
    return cols.gather(1, pick).squeeze(1), xt.gather(1, pick)


def draw_whole_rows(vals: Tensor, generator: torch.Generator | None, vocab: Vocab, u: Tensor | None = None) -> Tensor:
    """Draw from whole rows of scaled logits [b,V_r] (-inf = cut) → [b] ids, by inverse CDF with one uniform
    per row (`draw_in_blocks`): two light passes over V and no [B,V] temporary (V exponentials or a full
    cumsum cost several times more). ``u``: the rows' uniforms [b,1] (float64, in [0, 1)) already drawn (rows whose
    generators differ), else drawn here from ``generator``."""
    top = vocab.amax(vals)
    sums = grid_sums(vals, top, 1.0, None, vocab)
    if u is None:
        u = torch.rand(vals.shape[0], 1, dtype=torch.float64, device=vals.device, generator=generator)
    return draw_in_blocks(vals, 1.0, top, None, sums, u, vocab)[0]

"""The lean body's KV cache: keys and values preallocated for every layer, filled left to right.

    StaticCache(layers, B, H_kv, head_dim, capacity) ──forward writes T columns──▶ keys/values
        [layers, B, H_kv, capacity, hd], valid [B, capacity], positions [B, capacity], tokens [B, capacity]

Rows are aligned by left padding (`valid` marks each row's real columns); speculative decoding rolls back with
`truncate` / `invalidate`, finished rows leave with `select`, a joining prompt is prefilled into a `view`.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

__all__ = ["LAZY_BYTES", "StaticCache", "cache_zeros", "gather_row"]

LAZY_BYTES = 1 << 20  # cache tensors from this size on are anonymous mappings (`cache_zeros`)


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A zeroed tensor of `shape` for a cache. On the CPU, from LAZY_BYTES on, an anonymous memory mapping: the
    kernel gives each page, zeroed, when it is first touched, so the columns a row never writes cost neither the
    time to clear them nor memory. A short row merged beside a long one holds mostly such columns (left of its
    own): attention's spans skip them (body_kernels.c) and the torch path reads them as zeros."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class StaticCache:
    """A preallocated KV cache: keys and values [layers, B, H_kv, capacity, head_dim], filled left to right.

    Every row writes the same columns (left padding keeps rows aligned); `valid` [B, capacity] marks the
    columns holding a real token of that row and `positions` [B, capacity] its rope position (the sliding
    window is measured in positions, so a column left invalid in one row — a draft token that row rejected
    while another row accepted its own — does not narrow that row's window). `length` is the number of filled
    columns: speculative decoding rolls back by lowering it (`truncate`) or by `invalidate`-ing one row's
    columns; finished rows are dropped with `select`.

    A cache may be rows [a, b) of a larger one (`view`): its tensors share that one's memory, each layer's keys
    (values) one contiguous block `layer_stride` numbers from the next. A prompt joining a running batch is
    prefilled so, straight into the rows it will have in the merged cache (`decode.engine.Decoder.begin_join`).
    What a column holds where its row's `valid` is False is never read as a token's: masks drop it.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.keys = cache_zeros(shape, dtype, device)
        self.values = cache_zeros(shape, dtype, device)
        self.valid = cache_zeros((batch, capacity), torch.bool, device)
        self.positions = cache_zeros((batch, capacity), torch.long, device)
        self.tokens = cache_zeros((batch, capacity), torch.long, device)
        self.length = 0
        # the LeanBody step descriptors whose weights were found unchanged when this cache first used them
        self.checked: object | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def layer_stride(self) -> int:
        """Numbers between one layer's keys (values) and the next's."""
        return self.keys.stride(0)

    def in_blocks(self) -> bool:
        """Whether each layer's keys and values are one contiguous block, both at `layer_stride` (what the C step
        reads: a whole cache, or a `view`'s rows)."""
        k, v = self.keys, self.values
        return k.stride(0) == v.stride(0) and k[0].is_contiguous() and v[0].is_contiguous()

    def get_seq_length(self) -> int:
        return self.length

    def view(self, start: int, stop: int) -> StaticCache:
        """Rows [start, stop) of this cache as a cache of their own, sharing its memory (and, for now, its
        length): what one writes, the other reads."""
        if not 0 <= start <= stop <= self.batch:
            raise ValueError(f"rows must be within [0, {self.batch}], got [{start}, {stop})")
        out = StaticCache.__new__(StaticCache)
        out.keys, out.values = self.keys[:, start:stop], self.values[:, start:stop]
        out.valid, out.positions, out.tokens = (t[start:stop] for t in (self.valid, self.positions, self.tokens))
        out.length, out.checked = self.length, None
        return out

    def first_columns(self) -> Tensor:
        """[B] each row's first valid column (`length` for a row without any): its columns are within
        [first, length)."""
        valid = self.valid[:, :self.length]
        if self.length == 0:
            return torch.zeros(self.batch, dtype=torch.long, device=valid.device)
        first = valid.to(torch.uint8).argmax(dim=1)
        return torch.where(valid.any(dim=1), first, self.length)

    def truncate(self, length: int) -> None:
        """Forget every column from `length` on (their contents are overwritten by the next writes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], got {length}")
        if length < self.length:
            self.valid[:, length:self.length] = False
        self.length = length

    def invalidate(self, row: int, start: int) -> None:
        """Row `row` forgets its columns from `start` to `length` (another row still uses them)."""
        self.valid[row, start:self.length] = False

    def compact(self) -> None:
        """Move each row's valid columns to the right end of the first `m` columns (m = the most any row
        holds), in order, and set `length = m`: the holes that rejected drafts leave are given back. Masks
        use validity, order and positions only, so attention is unchanged."""
        counts = self.valid[:, :self.length].sum(dim=1)
        m = int(counts.max()) if counts.numel() else 0
        layers, batch, kv_heads, capacity, head_dim = self.keys.shape
        out = StaticCache(layers, batch, kv_heads, head_dim, capacity, self.keys.dtype, self.keys.device)
        for r in range(batch):
            gather_row(out, r, self, r, m)
        self.keys, self.values, self.valid, self.positions, self.tokens = (
            out.keys, out.values, out.valid, out.positions, out.tokens)
        self.length = m

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows `rows` [B'] (e.g. drop finished rows). Rows kept in order stay in this
        cache's memory: a run of rows is a narrower view of it, and otherwise the rows on the side that holds
        fewer columns move next to the others (each its columns [first, length) only), so a row leaving costs
        at most what the rows on one side of it hold — not a copy of every row's whole capacity."""
        keep = [int(r) for r in rows.tolist()]
        n = len(keep)
        if n and any(b <= a for a, b in zip(keep, keep[1:], strict=False)):  # reordered: a copy of each row
            for name in ("keys", "values"):
                setattr(self, name, getattr(self, name).index_select(1, rows))
            for name in ("valid", "positions", "tokens"):
                setattr(self, name, getattr(self, name).index_select(0, rows))
            return
        if not n:
            self._narrow(0, 0)
            return
        first = self.first_columns().tolist()
        left = [(k, keep[0] + i) for i, k in enumerate(keep)]                  # (from, to), first row stays
        right = [(k, keep[-1] - (n - 1 - i)) for i, k in enumerate(keep)]     # last row stays
        cost = lambda moves: sum(self.length - first[a] for a, b in moves if a != b)  # noqa: E731
        moves, start = (left, keep[0]) if cost(left) <= cost(right) else (right[::-1], keep[-1] - n + 1)
        for a, b in moves:  # left: upwards in order, right: downwards from the last (never onto an unmoved row)
            if a != b:
                self._move_row(a, b, first[a])
        self._narrow(start, start + n)

    def _move_row(self, src: int, dst: int, first: int) -> None:
        """Row `src`'s columns [first, length) and its whole validity, positions and ids into row `dst`."""
        for t in (self.keys, self.values):
            t[:, dst, :, first:self.length] = t[:, src, :, first:self.length]
        for t in (self.valid, self.positions, self.tokens):
            t[dst] = t[src]

    def _narrow(self, start: int, stop: int) -> None:
        self.keys, self.values = self.keys[:, start:stop], self.values[:, start:stop]
        self.valid, self.positions, self.tokens = (t[start:stop] for t in (self.valid, self.positions, self.tokens))


def gather_row(dst: StaticCache, i: int, src: StaticCache, r: int, end: int) -> int:
    """Row r of `src`'s valid columns, in order, into row i of `dst` at its columns [end − n, end) → n (dst's row i
    must hold nothing: zeros and not valid, as a new cache's rows). One slice where the columns are one run (a
    prompt and the tokens after it), else a gather (holes of rejected drafts)."""
    cols = src.valid[r, :src.length].nonzero().squeeze(1)
    n = cols.numel()
    if n == 0:
        return 0
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    pick = slice(lo, hi) if hi - lo == n else cols
    dst.keys[:, i, :, end - n:end] = src.keys[:, r, :, pick]
    dst.values[:, i, :, end - n:end] = src.values[:, r, :, pick]
    dst.positions[i, end - n:end] = src.positions[r, pick]
    dst.tokens[i, end - n:end] = src.tokens[r, pick]
    dst.valid[i, end - n:end] = True
    return n

"""The lean body's KV cache: keys and values preallocated for every layer, filled left to right.

    StaticCache(layers, B, H_kv, head_dim, capacity) ──forward writes T columns──▶ keys/values
        [layers, B, H_kv, capacity, hd], valid [B, capacity], positions [B, capacity], tokens [B, capacity]

Rows are aligned by left padding (`valid` marks each row's real columns); speculative decoding rolls back with
`truncate` / `invalidate`, finished rows leave with `select`, a joining prompt is prefilled into a `view`.

A row's prompt beginning found in the prefix cache is not copied into its columns: `shared` (`SharedColumns`)
names the stored blocks its columns start[r] .. start[r] + len[r] are read from — the same blocks for every row
whose prompt begins with them, read once for all their queries by the C attention (kernels/body_kernels.c), as
vLLM's paged blocks are shared by the sequences that begin with them. Everything that moves a row's columns
carries its shared run along (`select`, `gather_row`, `compact`); what reads keys and values in torch calls
`materialise` first.
"""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

__all__ = ["LAZY_BYTES", "SharedColumns", "StaticCache", "cache_zeros", "gather_row"]

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


class SharedColumns:
    """Per row of a cache: None, or (start, keys, values) — its columns start .. start + n − 1 are, in order,
    those of the blocks keys / values (lists of [layers, H_kv, block, hd], contiguous, never written: a prefix
    cache's stored blocks), n ≤ block · len(keys) given by `lens`. Immutable: a change makes another one (the C
    side's tables, `models.lean_native`, are made once per object)."""

    def __init__(self, rows: list[tuple[int, int, list[Tensor], list[Tensor]] | None]) -> None:
        self.rows = rows  # per row None or (start, n, key blocks, value blocks)
        self.native = None  # the C side's tables, made on first use (`NativeStep._shared_args`)

    @staticmethod
    def of(rows: list[tuple[int, int, list[Tensor], list[Tensor]] | None]) -> SharedColumns | None:
        """The rows' shared runs, or None where no row has one."""
        return SharedColumns(rows) if any(r is not None for r in rows) else None

    def take(self, rows: list[int]) -> SharedColumns | None:
        return SharedColumns.of([self.rows[r] for r in rows])

    def span(self, row: int) -> tuple[int, int]:
        """Row `row`'s shared columns [start, stop) ((0, 0): none)."""
        entry = self.rows[row]
        return (0, 0) if entry is None else (entry[0], entry[0] + entry[1])


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
        self.shared: SharedColumns | None = None  # rows' columns read from shared blocks (the module docstring)
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
        out.shared = None if self.shared is None else self.shared.take(list(range(start, stop)))
        return out

    def share(self, row: int, entry: tuple[int, int, list[Tensor], list[Tensor]] | None) -> None:
        """Row `row`'s shared run: None, or (start, n, key blocks, value blocks) (`SharedColumns`)."""
        rows = [None] * self.batch if self.shared is None else list(self.shared.rows)
        rows[row] = entry
        self.shared = SharedColumns.of(rows)

    def materialise(self, rows: list[int] | None = None) -> None:
        """Copy the shared runs of `rows` (None: every row) into their own columns, which then hold them: for
        what reads keys and values in torch."""
        if self.shared is None:
            return
        rows = range(self.batch) if rows is None else rows
        for r in rows:
            entry = self.shared.rows[r]
            if entry is None:
                continue
            at, n, ks, vs = entry
            for name, blocks in (("keys", ks), ("values", vs)):
                dst, col = getattr(self, name), at
                for blk in blocks:
                    w = min(blk.shape[2], at + n - col)
                    dst[:, r, :, col:col + w] = blk[:, :, :w]
                    col += w
            self.share(r, None)

    def read_columns(self, row: int, cols: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values [layers, H_kv, len(cols), hd] of `row`'s columns `cols` (ascending), its shared
        ones included: a view where they are its own and one run (a lone row's prompt), else a copy."""
        a, b = (0, 0) if self.shared is None or not len(cols) else self.shared.span(row)
        if not (a < b and int(cols[0]) < b and int(cols[-1]) >= a):
            if len(cols) and int(cols[-1]) - int(cols[0]) + 1 == len(cols):
                run = slice(int(cols[0]), int(cols[-1]) + 1)
                return self.keys[:, row, :, run], self.values[:, row, :, run]
            return self.keys[:, row].index_select(2, cols), self.values[:, row].index_select(2, cols)
        keys, values = self.keys[:, row].index_select(2, cols), self.values[:, row].index_select(2, cols)
        inside = ((cols >= a) & (cols < b)).nonzero().squeeze(1)
        _, _, ks, vs = self.shared.rows[row]
        block = ks[0].shape[2]
        at = cols[inside] - a
        used = sorted(set((at // block).tolist()))  # only the blocks the columns are in
        local = torch.tensor([used.index(int(c) // block) * block + int(c) % block for c in at])
        keys[:, :, inside] = torch.cat([ks[i] for i in used], 2).index_select(2, local)
        values[:, :, inside] = torch.cat([vs[i] for i in used], 2).index_select(2, local)
        return keys, values

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
        self.length, self.shared = m, out.shared

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows `rows` [B'] (e.g. drop finished rows). Rows kept in order stay in this
        cache's memory: a run of rows is a narrower view of it, and otherwise the rows on the side that holds
        fewer columns move next to the others (each its columns [first, length) only), so a row leaving costs
        at most what the rows on one side of it hold — not a copy of every row's whole capacity."""
        keep = [int(r) for r in rows.tolist()]
        n = len(keep)
        shared = None if self.shared is None else self.shared.take(keep)
        if n and any(b <= a for a, b in zip(keep, keep[1:], strict=False)):  # reordered: a copy of each row
            for name in ("keys", "values"):
                setattr(self, name, getattr(self, name).index_select(1, rows))
            for name in ("valid", "positions", "tokens"):
                setattr(self, name, getattr(self, name).index_select(0, rows))
            self.shared = shared
            return
        if not n:
            self._narrow(0, 0)
            self.shared = None
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
        self.shared = shared

    def _move_row(self, src: int, dst: int, first: int) -> None:
        """Row `src`'s columns [first, length) (but its shared ones, read from their blocks) and its whole
        validity, positions and ids into row `dst`."""
        a, b = (0, 0) if self.shared is None else self.shared.span(src)
        runs = [(first, self.length)] if a >= b else [(first, max(first, a)), (max(first, b), self.length)]
        for t in (self.keys, self.values):
            for lo, hi in runs:
                if lo < hi:
                    t[:, dst, :, lo:hi] = t[:, src, :, lo:hi]
        for t in (self.valid, self.positions, self.tokens):
            t[dst] = t[src]

    def _narrow(self, start: int, stop: int) -> None:
        self.keys, self.values = self.keys[:, start:stop], self.values[:, start:stop]
        self.valid, self.positions, self.tokens = (t[start:stop] for t in (self.valid, self.positions, self.tokens))


def gather_row(dst: StaticCache, i: int, src: StaticCache, r: int, end: int) -> int:
    """Row r of `src`'s valid columns, in order, into row i of `dst` at its columns [end − n, end) → n (dst's row i
    must hold nothing: zeros and not valid, as a new cache's rows). One slice where the columns are one run (a
    prompt and the tokens after it), else a gather (holes of rejected drafts). A shared run (every column of it
    valid) is not copied: dst's row i reads the same blocks at its new columns."""
    cols = src.valid[r, :src.length].nonzero().squeeze(1)
    n = cols.numel()
    if n == 0:
        return 0
    a, b = (0, 0) if src.shared is None else src.shared.span(r)
    parts = [(cols, end - n)]
    if a < b:  # the columns before the run and after it; the run itself moves as a reference
        before = int((cols < a).sum())
        parts = [(cols[:before], end - n), (cols[before + b - a:], end - n + before + b - a)]
        _, m, ks, vs = src.shared.rows[r]
        dst.share(i, (end - n + before, m, ks, vs))
    for part, at in parts:
        if part.numel():
            lo, hi = int(part[0]), int(part[-1]) + 1
            pick = slice(lo, hi) if hi - lo == part.numel() else part
            dst.keys[:, i, :, at:at + part.numel()] = src.keys[:, r, :, pick]
            dst.values[:, i, :, at:at + part.numel()] = src.values[:, r, :, pick]
    pick = slice(int(cols[0]), int(cols[-1]) + 1) if int(cols[-1]) - int(cols[0]) + 1 == n else cols
    dst.positions[i, end - n:end] = src.positions[r, pick]
    dst.tokens[i, end - n:end] = src.tokens[r, pick]
    dst.valid[i, end - n:end] = True
    return n

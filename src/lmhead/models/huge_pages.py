"""A loaded file's dense matrices on 2 MiB pages (transparent huge pages, `madvise(MADV_HUGEPAGE)`): the layout
cache's files of at least MAP_MIN bytes (`models/layout_cache.py`) mapped and advised, so that the page cache's own
2 MiB folios back them with no copy; the smaller ones, a float file's F16 / BF16 / F32 matrices, and the embedding
and the head where they are small, laid end to end in one arena of anonymous memory advised for huge pages.

A decode step streams every matrix from memory. On 4 KiB pages the stream crosses a page every 64 lines — a TLB
miss, and a stop for the CPU's prefetchers, which do not cross pages — and the many small matrices of a small model
each start on pages of their own; on 2 MiB pages a stream crosses a page 512 times less often. One arena a load
rather than a region a matrix, because most matrices of a small model are under 2 MiB (SmolLM2's gate and up are
1.77 MB at F16) and a region under 2 MiB gets no huge page; a large file mapped rather than copied, because copying
gigabytes out of the page cache into fresh memory costs the start (and, on a VM whose host backs memory as it is
first touched, much of it).

Not placed here: a mixture's experts (mapped from the layout cache: a step reads a few of them, and the kernel may
drop their pages under memory pressure), the norms and biases (a few KiB), the KV cache. Anonymous memory is not
the page cache's: the layout cache's pages read into the arena stay in the page cache only as long as the system
has no other use for them, and the arena is freed with the last matrix of the model holding it.

Linux with transparent huge pages in `always` or `madvise` mode only; elsewhere and with `LMHEAD_HUGE_PAGES=0` the
matrices are mapped or allocated as before. Where the kernel finds no free 2 MiB page it backs the arena with 4 KiB
pages: the numbers are the same bits either way (tests/test_huge_pages.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["Arena", "advise", "arena_for_load", "available", "current", "describe", "refold"]

PAGE = 2 << 20         # a huge page
CHUNK = 256 << 20      # an arena's regions: a matrix larger than this gets one of its own
MAP_MIN = 8 << 20      # a layout cache's file this large is mapped on huge pages rather than read into the arena
_ALIGN = 64            # each buffer starts on a cache line (the kernels' loads)
_READ = 1 << 30        # the most one read() call is asked for (Linux caps a read near 2 GiB)
NO_FOLIOS = ".no-huge-folios"  # in a layouts folder: its files read again came back in small folios (not retried)
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux ≥ 5.14 (EINVAL before: nothing done)
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_lock = threading.Lock()
_current: list[Arena] = []  # the arena of the load in progress (loads nested or in other threads share it)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """This process's C library on Linux, its madvise and mincore typed (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def _madvise():
    lib = libc()
    return None if lib is None else lib.madvise


def available() -> bool:
    """Whether a load places its matrices on huge pages here: Linux, transparent huge pages not `never`, and
    `LMHEAD_HUGE_PAGES` not "0"."""
    if os.environ.get("LMHEAD_HUGE_PAGES", "1") == "0" or _madvise() is None:
        return False
    try:
        return "[never]" not in _THP.read_text()
    except OSError:
        return False


def describe() -> str:
    """Where a load puts its matrices here, in one line (`lmhead info`)."""
    if os.environ.get("LMHEAD_HUGE_PAGES", "1") == "0":
        return "on 4 KiB pages (LMHEAD_HUGE_PAGES=0)"
    if _madvise() is None:
        return "on the system's pages (no transparent huge pages off Linux)"
    try:
        mode = _THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "on 4 KiB pages (the kernel has no transparent huge pages)"
    if mode == "never":
        return "on 4 KiB pages (transparent huge pages: never)"
    return f"on 2 MiB pages: large layout files mapped, the rest in one arena (transparent huge pages: {mode})"


def _region(nbytes: int) -> np.ndarray:
    """`nbytes` (a multiple of PAGE) of zeroed anonymous memory starting on a 2 MiB boundary, advised for huge pages
    (uint8; the map lives as long as a view of it)."""
    region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(raw.ctypes.data + start, nbytes, _MADV_HUGEPAGE)  # refused (EINVAL): 4 KiB pages, the same bits
    return raw[start:start + nbytes]


def advise(raw: np.ndarray, path: Path | None = None) -> None:
    """Ask for the 2 MiB extents of `raw` (a whole map of a file: `np.memmap`) to be backed by huge pages: they are
    where the page cache holds the file in 2 MiB folios (a file written in large pieces, or read ahead for a map so
    advised), mapped as they are — no copy. Refused (no THP): nothing changes. With `path` (the file) and a load in
    progress, the map is one `refold` checks at the load's end."""
    start = -raw.ctypes.data % mmap.PAGESIZE  # from its first whole page (a map starts on one) to its last page
    size = -(-(raw.nbytes - start) // mmap.PAGESIZE) * mmap.PAGESIZE
    madvise = _madvise()
    if raw.nbytes <= start or madvise is None or madvise(raw.ctypes.data + start, size, _MADV_HUGEPAGE) != 0:
        return
    arena = current()
    if path is not None and arena is not None:
        arena.note_advised(raw.ctypes.data + start, size, path)


def _maps_pmd() -> dict[int, tuple[int, int]]:
    """Each map of this process by its start address: (bytes resident, bytes mapped by 2 MiB folios of a file)."""
    out: dict[int, tuple[int, int]] = {}
    start = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)
        if not head:
            continue
        if not head[0].endswith(":"):
            start = int(head[0].split("-")[0], 16)
            out[start] = (0, 0)
        elif start is not None and head[0] in ("Rss:", "FilePmdMapped:"):
            rss, pmd = out[start]
            kb = int(head[1].split()[0]) * 1024
            out[start] = (rss + kb, pmd) if head[0] == "Rss:" else (rss, pmd + kb)
    return out


def refold(arena: Arena) -> int:
    """The load's advised maps (`advise`) that came resident on 4 KiB pages — the page cache held their files in
    small folios (read by read(), or by a map not so advised) — dropped and read again: their page tables cleared
    (`MADV_DONTNEED`: the maps are private and never written, so nothing of theirs is lost), the files' pages dropped
    from the page cache (`POSIX_FADV_DONTNEED`; pages another process maps stay), and the maps filled again
    (`MADV_POPULATE_READ`), which reads them ahead in 2 MiB folios; later loads then map those at once. Returns the
    bytes read again (said on stderr)."""
    if not arena.advised or not Path("/proc/self/smaps").exists():
        return 0
    small = _on_small_pages(arena.advised, _maps_pmd())
    small = [(addr, size, path) for addr, size, path in small if not (path.parent / NO_FOLIOS).exists()]
    total = sum(size for _, size, _ in small)
    if not small:
        return 0
    print(f"lmhead: reading {total / 2**20:.0f} MiB of laid-out matrices again in 2 MiB pages (the page cache held "
          "them in small pieces; once)", file=sys.stderr, flush=True)
    madvise = _madvise()
    for addr, size, path in small:
        madvise(addr, size, _MADV_DONTNEED)
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # a page still to be written back is not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        madvise(addr, size, MADV_POPULATE_READ)
    for folder in {path.parent for _, _, path in _on_small_pages(small, _maps_pmd())}:
        with contextlib.suppress(OSError):  # read again and still small: this system's page cache gives none
            (folder / NO_FOLIOS).touch()
    return total


def _on_small_pages(advised: list[tuple[int, int, Path]], maps: dict[int, tuple[int, int]]) -> list:
    """The maps of `advised` resident (90%) with under half their 2 MiB extents on 2 MiB pages."""
    out = []
    for addr, size, path in advised:
        rss, pmd = maps.get(addr, (0, 0))
        extents = (addr + size) // PAGE * PAGE - -(-addr // PAGE) * PAGE
        if extents >= PAGE and rss >= 0.9 * size and pmd < extents // 2:
            out.append((addr, size, path))
    return out


class Arena:
    """Buffers handed out end to end (each on a 64-byte boundary) from regions of CHUNK bytes advised for huge
    pages; a buffer larger than CHUNK gets a region of its own. Thread-safe: a load lays out two matrices at a time."""

    def __init__(self) -> None:
        self._region: np.ndarray | None = None
        self.advised: list[tuple[int, int, Path]] = []  # the load's maps advised for huge pages: (start, bytes, file)
        self._at = 0
        self._lock = threading.Lock()
        self.nbytes = 0  # the bytes handed out

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the arena (uint8, zeroed)."""
        with self._lock:
            self.nbytes += nbytes
            if nbytes > CHUNK:
                return _region(-(-nbytes // PAGE) * PAGE)[:nbytes]
            at = -(-self._at // _ALIGN) * _ALIGN
            if self._region is None or at + nbytes > self._region.nbytes:
                self._region, at = _region(CHUNK), 0
            self._at = at + nbytes
            return self._region[at:at + nbytes]

    def note_advised(self, start: int, nbytes: int, path: Path) -> None:
        """Record a map of the file `path` advised for huge pages during the load (`refold` checks them at its end)."""
        with self._lock:
            self.advised.append((start, nbytes, path))

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """A tensor of `shape` and `dtype` in the arena (zeroed: the region is fresh anonymous memory)."""
        count = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
        return torch.from_numpy(self.take(count * dtype.itemsize)).view(dtype).view(tuple(shape))

    def copy(self, t: Tensor) -> Tensor:
        """A copy of the CPU tensor `t` in the arena (contiguous, its dtype and shape)."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def cat(self, parts: Sequence[Tensor]) -> Tensor:
        """`torch.cat(parts)` (along the first dimension) written into the arena."""
        rows = sum(p.shape[0] for p in parts)
        out = self.empty((rows, *parts[0].shape[1:]), parts[0].dtype)
        return torch.cat(list(parts), out=out)

    def read(self, path: Path, nbytes: int) -> np.ndarray:
        """The first `nbytes` of the file `path`, read into the arena (uint8). OSError where the file is shorter."""
        out = self.take(nbytes)
        view = memoryview(out)
        done = 0
        with open(path, "rb", buffering=0) as f:
            while done < nbytes:
                got = f.readinto(view[done:done + min(nbytes - done, _READ)])
                if not got:
                    raise OSError(f"{path}: {done} bytes where {nbytes} were expected")
                done += got
        return out


def current() -> Arena | None:
    """The arena of the load in progress, or None (no load, or not `available()`)."""
    return _current[-1] if _current else None


@contextlib.contextmanager
def arena_for_load() -> Iterator[Arena | None]:
    """Inside, `current()` is this load's arena (None where not `available()`); a load inside another's, or beside
    it in another thread, shares the first one's. The arena's memory is freed with the last tensor over it."""
    if not available():
        yield None
        return
    with _lock:
        arena = _current[0] if _current else Arena()
        _current.append(arena)
    try:
        yield arena
    finally:
        with _lock:
            _current.remove(arena)

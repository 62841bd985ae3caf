"""The C heap while a model loads: its free pages handed back to the system (glibc's `malloc_trim`), and the
load's worker threads allocating from the main heap (glibc's `mallopt(M_ARENA_MAX)`); no-ops elsewhere.

Reading a large tokenizer.json, and repacking a file's blocks into the kernels' layout, leave most of their
transient memory free but resident: glibc raises its mmap threshold after the first large free, so later
arrays of up to 32 MiB come from the heap, whose freed middle is kept. The weights read next would come on top
of it, and the load's peak memory with them.

The load repacks several matrices at once in worker threads, to which glibc would give arenas of their own;
decoding over codes laid out there measured a few percent slower than over the same codes from the main heap
(the Llama 3.2 1B shape at Q4_K_M, interleaved runs; the cause not found), so while the workers run no new
arena is made.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator

__all__ = ["one_arena", "trim_heap"]

_M_ARENA_MAX = -8  # glibc's mallopt parameter


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)


def trim_heap() -> None:
    """Return the heap's free pages to the system now (nothing where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def one_arena() -> Iterator[None]:
    """Threads started inside allocate from the main heap (glibc: at most one arena meanwhile; afterwards the
    limit of MALLOC_ARENA_MAX, or glibc's default, again)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None or not mallopt(_M_ARENA_MAX, 1):
        yield
        return
    try:
        yield
    finally:
        try:
            before = int(os.environ.get("MALLOC_ARENA_MAX", "0"))
        except ValueError:
            before = 0
        mallopt(_M_ARENA_MAX, max(before, 0))

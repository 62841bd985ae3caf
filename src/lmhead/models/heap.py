"""The C heap's free pages handed back to the system while a model loads (glibc's `malloc_trim`; a no-op
elsewhere).

Reading a large tokenizer.json, and repacking a file's blocks into the kernels' layout, leave most of their
transient memory free but resident: glibc raises its mmap threshold after the first large free, so later
arrays of up to 32 MiB come from the heap, whose freed middle is kept. The weights read next would come on top
of it, and the load's peak memory with them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["trim_heap"]


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None) if libc is not None else None


def trim_heap() -> None:
    """Return the heap's free pages to the system now (nothing where the C library has no malloc_trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)

"""Where lmhead keeps what it builds once per machine: one root folder for the model cache (models/cache.py, its
only writer) and the compiled kernels (kernels/builder.py, `<root>/kernels/`). It imports nothing of ours, so the
ground floor can ask it without importing the floors above.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "writer_alive"]


def cache_root() -> Path:
    """The cache folder: $LMHEAD_CACHE, else $XDG_CACHE_HOME/lmhead, else ~/.cache/lmhead."""
    env = os.environ.get("LMHEAD_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lmhead"


def writer_alive(pid: int) -> bool:
    """Whether the process `pid` that named a temporary file or folder in the cache after itself still runs (what
    a dead one left half-written may be removed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

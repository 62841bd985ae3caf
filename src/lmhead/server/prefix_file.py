"""`lmhead serve --prefix-cache-file PATH`: the prefix cache kept across restarts (a long system prompt's blocks
are there for the first request after a restart), as llama-server saves a slot's prompt to disk.

    why = keep_prefix_cache(app, path)   # blocks read now (None, or why the file was refused: the store stays
                                         # empty and is written anew), written when the server shuts down

The file names what its blocks belong to (`identity`): lmhead's version, the model and its file (name, size,
modification time), the keys' and values' shapes and type. A file of another model or version, or a damaged one,
is refused with one line and never used (`prefix_cache.PrefixCache.load`); it is written to a temporary file
beside it and renamed, so a server killed while writing leaves the old file whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

__all__ = ["identity", "keep_prefix_cache"]


def identity(model: Any) -> dict[str, Any]:
    """What a saved prefix cache belongs to: a block is reused only by the same model, file and code."""
    from lmhead import __version__

    lean = model.lean
    gguf = getattr(model, "gguf_path", None) or getattr(model, "path", None)
    stat = Path(gguf).stat() if gguf is not None and Path(gguf).is_file() else None
    return {"lmhead": __version__, "model": getattr(model, "name", None),
            "file": None if gguf is None else Path(gguf).name,
            "file_size": None if stat is None else stat.st_size,
            "file_mtime_ns": None if stat is None else stat.st_mtime_ns,
            "layers": len(lean.layers), "kv_heads": lean.kv_heads, "head_dim": lean.head_dim,
            "dtype": str(lean.dtype)}


def keep_prefix_cache(app: FastAPI, path: str | Path) -> str | None:
    """Read the app's prefix cache from `path` (if there) and write it there when the app shuts down. → None, or
    the one line that says why the file was refused (the store starts empty)."""
    runner, model = app.state.runner, app.state.model
    if getattr(model, "lean", None) is None:
        return "the prefix cache holds the lean body's keys and values; this model runs transformers' modules"
    ident = identity(model)
    why = runner.prefix_cache.load(path, ident)

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(scope_app: Any) -> AsyncIterator[Any]:
        async with inner(scope_app) as state:
            yield state
        # at shutdown, on the model's thread: no round adds a block while the store is written
        await runner.call(runner.prefix_cache.save, path, ident)

    app.router.lifespan_context = lifespan
    return why

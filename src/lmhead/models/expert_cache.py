"""A mixture's laid-out experts kept on disk and mapped: a later load of the same file maps them instead of laying
them out again, and the pages they take are the file's (the kernel drops and rereads them under memory pressure)
rather than anonymous memory.

    <cache>/experts/<key>/blk.<i>.<product>.bin    one `ExpertMatrices`' buffers back to back (codes, scale,
                                                   offset; each at a multiple of 64 bytes)
                          blk.<i>.<product>.json   their dtypes, shapes and layout, the .bin's size and xxh3_64
                                                   (written after the .bin: a .bin without it is not read)
    key: sha256 of the GGUF file's resolved path, size and modification time, and FORMAT

A load reads a layer's experts from here where its .json is there and the .bin has its size and checksum (a
damaged or partial file is laid out again and rewritten: it costs time, never a wrong number); else it lays them
out (`expert_layout.build_experts`), writes them here where the disk has room for them and a margin, and maps
what it wrote. `LMHEAD_EXPERT_CACHE=0` keeps the experts in memory only and writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmhead.cache_folder import cache_root
from lmhead.models.cache import fast_checksum_file
from lmhead.models.expert_layout import ExpertMatrices

__all__ = ["FORMAT", "MARGIN", "cached", "folder_for"]

FORMAT = 1        # bump when ExpertMatrices' layout changes: older folders are not read
MARGIN = 4 << 30  # free disk left after a layer's experts are written (else they stay in memory only)
_ALIGN = 64
_said: set[Path] = set()
_lock = threading.Lock()
# numpy's dtype for each torch dtype the buffers hold (bfloat16 as its bits)
_NUMPY = {torch.int8: np.int8, torch.uint8: np.uint8, torch.float16: np.float16, torch.float32: np.float32,
          torch.bfloat16: np.int16}
_TORCH = {str(t).removeprefix("torch."): t for t in _NUMPY}


def folder_for(gguf: Path) -> Path | None:
    """`<cache>/experts/<key>` for the GGUF file `gguf`; None where the cache is turned off
    (`LMHEAD_EXPERT_CACHE=0`) or the file cannot be read."""
    if os.environ.get("LMHEAD_EXPERT_CACHE", "1") == "0":
        return None
    try:
        path = Path(gguf).resolve()
        st = path.stat()
    except OSError:
        return None
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{FORMAT}".encode()).hexdigest()[:32]
    return cache_root() / "experts" / key


def cached(folder: Path | None, name: str, build: Callable[[], Any]) -> Any:
    """The experts `name` (blk.<i>.<product>) mapped from `folder`, else `build()` — written to `folder` and
    mapped back where it is an `ExpertMatrices` and the disk has room."""
    if folder is None:
        return build()
    mapped = _read(folder, name)
    if mapped is not None:
        return mapped
    built = build()
    if not isinstance(built, ExpertMatrices):
        return built
    return _write(folder, name, built) or built


def _parts(ex: ExpertMatrices) -> dict[str, torch.Tensor]:
    return {k: t for k, t in (("codes", ex.codes), ("scale", ex.scale), ("offset", ex.offset)) if t is not None}


def _write(folder: Path, name: str, ex: ExpertMatrices) -> ExpertMatrices | None:
    """`ex` written as `name` into `folder` and mapped back; None where it could not be written (no room, a
    read-only folder: the experts then stay in memory)."""
    import xxhash

    stale: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder).free < ex.nbytes + MARGIN:
            return None
        with _lock:
            if folder not in _said:
                _said.add(folder)
                print(f"lmhead: laying out the experts once in {folder} (mapped by later loads; "
                      "LMHEAD_EXPERT_CACHE=0 keeps them in memory only)", file=sys.stderr, flush=True)
        digest, at, parts = xxhash.xxh3_64(), 0, {}
        tmp = folder / f".{name}.bin.{os.getpid()}.{threading.get_ident()}"
        stale.append(tmp)
        with open(tmp, "wb") as out:
            for key, t in _parts(ex).items():
                pad = -at % _ALIGN
                for chunk in (bytes(pad), t.contiguous().view(-1).view(torch.uint8).numpy()):
                    out.write(chunk)
                    digest.update(chunk)
                at += pad
                parts[key] = {"at": at, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                at += t.nbytes
        tmp.replace(folder / f"{name}.bin")
        meta = {"parts": parts, "size": at, "xxh3_64": digest.hexdigest(), "k": ex.in_features,
                "group": ex.group, "four_bit": ex.four_bit, "rows4": ex.rows4, "sub": ex.sub}
        tmp = folder / f".{name}.json.{os.getpid()}.{threading.get_ident()}"
        stale.append(tmp)
        tmp.write_text(json.dumps(meta))
        tmp.replace(folder / f"{name}.json")
    except OSError:
        return None
    finally:
        for path in stale:  # a write that failed (a full disk) leaves no partial file behind
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    return _map(folder / f"{name}.bin", meta)


def _read(folder: Path, name: str) -> ExpertMatrices | None:
    """`name` mapped from `folder` where its .json is there and its .bin has the recorded size and checksum."""
    try:
        meta = json.loads((folder / f"{name}.json").read_text())
        path = folder / f"{name}.bin"
        if path.stat().st_size != meta["size"] or fast_checksum_file(path) != meta["xxh3_64"]:
            return None
        return _map(path, meta)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _map(path: Path, meta: dict) -> ExpertMatrices:
    """The buffers of `meta` over a private (copy-on-write) map of `path`: read pages are the file's."""
    raw = np.memmap(path, dtype=np.uint8, mode="c")
    parts = {}
    for key, p in meta["parts"].items():
        dtype = _TORCH[p["dtype"]]
        count = int(np.prod(p["shape"])) * dtype.itemsize
        view = raw[p["at"]:p["at"] + count].view(_NUMPY[dtype])
        parts[key] = torch.from_numpy(view).view(dtype).view(p["shape"])
    ex = ExpertMatrices(parts["codes"], parts.get("scale"), parts.get("offset"), meta["k"], meta["group"],
                        meta["four_bit"], meta["rows4"], meta["sub"])
    ex.source = path
    return ex

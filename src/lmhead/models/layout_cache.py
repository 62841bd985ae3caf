"""A GGUF file's matrices as the kernels lay them out, kept on disk and mapped: a later load of the same file maps
them instead of laying them out again (a mixture's experts, and every other matrix of codes), and the pages they
take are a file's (the kernel drops and rereads them under memory pressure) rather than anonymous memory.

    <cache>/layouts/<key>/<name>.bin    one `ExpertMatrices`' buffers back to back (codes, scale, offset; each at a
                                        multiple of 64 bytes); a matrix that is no mixture's as one of one
                          <name>.json   their dtypes, shapes and layout, the .bin's size, xxh3_64, stamp (size,
                                        modification time in ns, inode) and the xxh3_64 of 16 windows of 64 KiB
                                        spread over it (written after the .bin: a .bin without it is not read)
                          source.json   the GGUF file's path, size and modification time (written first)
    name: blk.<i>.<product> for a layer's experts, the matrix's tensor names joined by "+" for the others
    key: sha256 of the GGUF file's resolved path, size and modification time, and FORMAT

A key no load can meet again (its file gone, or changed: another size or modification time makes another key) is
removed when a new one is first laid out (`prune`), so the cache holds about one copy of the codes of each file
that is still there.

A load reads a matrix from here where its .json is there and the .bin is as written: its stamp and sampled windows
as recorded — or, where the stamp differs (a copied or touched folder), its whole checksum, the stamp then recorded
anew. Reading every byte on every load would cost a large model's warm start seconds (Qwen3-30B-A3B's experts are
~18 GB), where the stamp changes with any write to the file; a damaged or partial file is laid out again and
rewritten (it costs time, never a wrong number). Else the load lays it out (`expert_layout.build_experts`,
`GGUFFile.coded_rows`), writes it here where the disk has room for it and a margin, and maps what it wrote.
`LMHEAD_LAYOUT_CACHE=0` (or its earlier name `LMHEAD_EXPERT_CACHE=0`) keeps them in memory only and writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
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
from lmhead.models import huge_pages
from lmhead.models.cache import fast_checksum_file
from lmhead.models.coded_linear import CodedLinear
from lmhead.models.expert_layout import ExpertMatrices
from lmhead.models.huge_pages import Arena

__all__ = ["FORMAT", "MARGIN", "cached", "cached_linear", "folder_for"]

FORMAT = 11       # bump when ExpertMatrices' or CodedLinear's layout changes: older folders are not read, and
                  # `prune` removes them (3: a fused product of mixed types as row blocks, dense K-quants' scales
                  # as their blocks hold them; 4: MXFP4 experts' exponents as their blocks' bytes; 5: the integer
                  # path by groups' layout, whose choice is part of the key; 6: K-quants and int8 codes with offsets
                  # by groups; 7: level tables by groups, their nibbles the indices XOR 8; 8: a mixture's experts by
                  # groups, MXFP4's scales by groups as exponent bytes; 9: the embedding and the head by groups;
                  # 10: 5- and 6-bit codes by groups with their top bits in a plane; 11: a mixture's experts too)
MARGIN = 4 << 30  # free disk left after a matrix is written (else it stays in memory only)
_ALIGN = 64
_SOURCE = "source.json"  # a layouts folder's GGUF file: its path, size and modification time (for `prune`)
_sources: dict[Path, dict[str, Any]] = {}  # each folder `folder_for` named, its source.json's contents
_WINDOWS, _WINDOW = 16, 1 << 16  # the sampled checksum: 16 windows of 64 KiB, the first and last bytes among them
_said: set[Path] = set()
_full: set[Path] = set()  # folders whose disk had no room for a matrix (said once: `_no_room`)
_lock = threading.Lock()
# numpy's dtype for each torch dtype the buffers hold (bfloat16 as its bits)
_NUMPY = {torch.int8: np.int8, torch.uint8: np.uint8, torch.float16: np.float16, torch.float32: np.float32,
          torch.bfloat16: np.int16}
_TORCH = {str(t).removeprefix("torch."): t for t in _NUMPY}


def folder_for(gguf: Path) -> Path | None:
    """`<cache>/layouts/<key>` for the GGUF file `gguf`; None where the cache is turned off
    (`LMHEAD_LAYOUT_CACHE=0` or `LMHEAD_EXPERT_CACHE=0`) or the file cannot be read. A key not laid out yet first
    removes the layouts no load can map again (`prune`)."""
    if "0" in (os.environ.get("LMHEAD_LAYOUT_CACHE", "1"), os.environ.get("LMHEAD_EXPERT_CACHE", "1")):
        return None
    try:
        path = Path(gguf).resolve()
        st = path.stat()
    except OSError:
        return None
    from lmhead.models import groups16

    by_groups = f"{int(groups16.chosen('packed'))}{int(groups16.chosen('int8'))}"  # the layouts a load makes differ
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{FORMAT}\0{by_groups}".encode()).hexdigest()[:32]
    folder = cache_root() / "layouts" / key
    with _lock:
        _sources[folder] = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": FORMAT}
    if not folder.exists():
        prune(cache_root())
    return folder


def prune(root: Path) -> list[Path]:
    """Remove from the cache `root` the layouts no load can map again — a folder whose GGUF file is gone or has
    another size or modification time than its key was made of (its `source.json` says which), a folder of another
    `FORMAT` (its key is never made again), and the earliest format's `experts/` — said in one line on stderr;
    returns the folders removed. A folder without its source.json yet (being written) is left alone."""
    stale = [root / "experts"] if (root / "experts").is_dir() else []
    layouts = root / "layouts"
    for folder in sorted(layouts.iterdir()) if layouts.is_dir() else ():
        try:
            src = json.loads((folder / _SOURCE).read_text())
        except (OSError, ValueError):
            continue
        try:
            st = Path(src["path"]).stat()
            if (st.st_size, st.st_mtime_ns) == (src["size"], src["mtime_ns"]) and src.get("format", 2) == FORMAT:
                continue
        except OSError:
            pass  # the file is gone
        except (KeyError, TypeError):
            continue
        stale.append(folder)
    if stale:
        freed = sum(f.stat().st_size for d in stale for f in d.rglob("*") if f.is_file())
        for folder in stale:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"lmhead: removed {len(stale)} laid-out {'model' if len(stale) == 1 else 'models'} whose GGUF file is "
              f"gone or changed, or laid out in an earlier format ({freed / 2**30:.2f} GiB) from {root}",
              file=sys.stderr, flush=True)
    return stale


def cached(folder: Path | None, name: str, build: Callable[[], Any], say: bool = False,
           arena: Arena | None = None) -> Any:
    """The matrices `name` mapped from `folder`, else `build()` — written to `folder` and mapped back where it is
    an `ExpertMatrices` and the disk has room. `say`: tell stderr once per folder that they are laid out (a
    mixture's experts, whose first load lays out gigabytes). `arena`: an `ExpertMatrices` goes on huge pages
    (`_map`; copied into the arena where it is not written: `models/huge_pages.py`)."""
    if folder is None:
        return _placed(build(), arena)
    mapped = _read(folder, name, arena)
    if mapped is not None:
        return mapped
    built = build()
    if not isinstance(built, ExpertMatrices):
        return built
    return _write(folder, name, built, say, arena) or _placed(built, arena)


def cached_linear(folder: Path | None, name: str, build: Callable[[], Any]) -> Any:
    """`cached` for one matrix `name` (its tensor names joined by "+"): a `CodedLinear` of codes is kept as the
    experts of one and handed back as that one, on huge pages where the load has an arena
    (`huge_pages.current()`: a large file mapped and advised, a small one read into the arena); a file's own
    float16, bfloat16 or float32 weights (`CodedLinear.dense16`) and a float32 matrix are returned as built."""
    def laid_out() -> Any:
        built = build()
        return _one(built) if isinstance(built, CodedLinear) and not built.dense else built

    got = cached(folder, name, laid_out, arena=huge_pages.current())
    return got[0] if isinstance(got, ExpertMatrices) else got


def _one(m: CodedLinear) -> ExpertMatrices:
    """A matrix of codes as the experts of one (its buffers viewed with a leading dimension, not copied)."""
    def lead(t: Any) -> torch.Tensor | None:
        return None if t is None else t.unsqueeze(0)

    return ExpertMatrices(lead(m.codes), lead(m.scale), lead(m.offset), m.in_features, m.group, m.four_bit, m.rows4,
                          m.sub, m.by_groups, m.plane)


def _parts(ex: ExpertMatrices) -> dict[str, torch.Tensor]:
    return {k: t for k, t in (("codes", ex.codes), ("scale", ex.scale), ("offset", ex.offset)) if t is not None}


def _placed(built: Any, arena: Arena | None) -> Any:
    """`built`'s buffers copied into `arena` where it is an `ExpertMatrices` and there is an arena, else `built`."""
    if arena is None or not isinstance(built, ExpertMatrices):
        return built
    parts = {k: arena.copy(t) for k, t in _parts(built).items()}
    return ExpertMatrices(parts["codes"], parts.get("scale"), parts.get("offset"), built.in_features, built.group,
                          built.four_bit, built.rows4, built.sub, built.by_groups, built.plane)


def _write(folder: Path, name: str, ex: ExpertMatrices, say: bool, arena: Arena | None) -> ExpertMatrices | None:
    """`ex` written as `name` into `folder` and mapped back (`_map`, with `arena`); None where it could not
    be written (no room, a read-only folder: the matrices then stay in memory). `say` as `cached`'s."""
    import xxhash

    stale: list[Path] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(folder).free
        if free < ex.nbytes + MARGIN:
            _no_room(folder, free)
            return None
        if not (folder / _SOURCE).exists() and folder in _sources:  # before any .bin: `prune` reads it
            tmp = folder / f".{_SOURCE}.{os.getpid()}.{threading.get_ident()}"
            stale.append(tmp)
            tmp.write_text(json.dumps(_sources[folder]))
            tmp.replace(folder / _SOURCE)
        with _lock:
            if say and folder not in _said:
                _said.add(folder)
                print(f"lmhead: laying out the experts once in {folder} (mapped by later loads; "
                      "LMHEAD_LAYOUT_CACHE=0 keeps them in memory only)", file=sys.stderr, flush=True)
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
                "group": ex.group, "four_bit": ex.four_bit, "rows4": ex.rows4, "sub": ex.sub,
                "by_groups": ex.by_groups, "plane": ex.plane,
                **_fingerprint(folder / f"{name}.bin")}
        _write_meta(folder, name, meta, stale)
    except OSError:
        return None
    finally:
        for path in stale:  # a write that failed (a full disk) leaves no partial file behind
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    return _map(folder / f"{name}.bin", meta, arena)


def _no_room(folder: Path, free: int) -> None:
    """Tell stderr once per folder that its disk has no room for the layouts left: those stay in memory and are laid
    out again at every load (a warm start then takes their time)."""
    with _lock:
        if folder in _full:
            return
        _full.add(folder)
    print(f"lmhead: {free / 2**30:.1f} GiB free under {folder}: the layouts left are kept in memory, not cached "
          f"(laid out again at each load; the cache leaves {MARGIN / 2**30:.0f} GiB free)", file=sys.stderr,
          flush=True)


def _write_meta(folder: Path, name: str, meta: dict, stale: list[Path]) -> None:
    tmp = folder / f".{name}.json.{os.getpid()}.{threading.get_ident()}"
    stale.append(tmp)
    tmp.write_text(json.dumps(meta))
    tmp.replace(folder / f"{name}.json")


def _window_starts(size: int) -> list[int]:
    return [max(size - _WINDOW, 0) * i // (_WINDOWS - 1) for i in range(_WINDOWS)]


def _sampled(path: Path, size: int) -> str:
    """xxh3_64 (hex) of _WINDOWS windows of _WINDOW bytes spread evenly over the file of `size` bytes."""
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb", buffering=0) as f:
        for at in _window_starts(size):
            f.seek(at)
            digest.update(f.read(_WINDOW))
    return digest.hexdigest()


def _sampled_in(raw: np.ndarray) -> str:
    """`_sampled` of the bytes `raw` (uint8) holds: read through a map, its windows fault in as the map is advised
    (on huge pages, 2 MiB folios read ahead) rather than as a read() would leave them in the page cache."""
    import xxhash

    digest = xxhash.xxh3_64()
    for at in _window_starts(raw.nbytes):
        digest.update(raw[at:at + _WINDOW])
    return digest.hexdigest()


def _fingerprint(path: Path) -> dict[str, Any]:
    """The .bin's stamp (size, modification time in ns, inode) and sampled checksum, as its .json records them."""
    st = path.stat()
    return {"stamp": [st.st_size, st.st_mtime_ns, st.st_ino], "sampled": _sampled(path, st.st_size)}


def _read(folder: Path, name: str, arena: Arena | None) -> ExpertMatrices | None:
    """`name` mapped from `folder` (`_map`, with `arena`) where its .json is there and its .bin is as
    written: the recorded stamp and sampled windows, or (a stamp of another file: copied, touched) the recorded
    whole checksum."""
    stale: list[Path] = []
    try:
        meta = json.loads((folder / f"{name}.json").read_text())
        path = folder / f"{name}.bin"
        st = path.stat()
        if st.st_size != meta["size"]:
            return None
        if meta.get("stamp") == [st.st_size, st.st_mtime_ns, st.st_ino]:
            return _map(path, meta, arena, sampled=meta.get("sampled"))
        if fast_checksum_file(path) != meta["xxh3_64"]:
            return None
        with contextlib.suppress(OSError):  # intact: later loads check the new stamp instead of every byte
            _write_meta(folder, name, {**meta, **_fingerprint(path)}, stale)
        return _map(path, meta, arena)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError):  # RuntimeError: parts the .bin cannot hold
        return None
    finally:
        for tmp in stale:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


_RESIDENT = 0.9            # the share of a map's pages in the page cache above which its page tables are filled


def _fill_page_tables(raw: np.memmap) -> None:
    """Map every page of `raw` now where the page cache holds nearly all of them (a warm load): a decode step that
    first touches an expert would otherwise take a page fault per 16 pages of it, in the timed tokens rather than
    in the load (one madvise: the kernel fills the tables from the cached pages, reading nothing; a map mostly on
    disk is left to fault in as it is read)."""
    libc = huge_pages.libc()
    if libc is None or raw.nbytes == 0:
        return
    addr, pages = raw.ctypes.data, -(-raw.nbytes // mmap.PAGESIZE)
    if addr % mmap.PAGESIZE:
        return
    resident = np.empty(pages, dtype=np.uint8)
    if libc.mincore(addr, raw.nbytes, resident.ctypes.data) != 0:
        return
    if np.count_nonzero(resident & 1) >= _RESIDENT * pages:
        libc.madvise(addr, pages * mmap.PAGESIZE, huge_pages.MADV_POPULATE_READ)


def _map(path: Path, meta: dict, arena: Arena | None = None, sampled: str | None = None) -> ExpertMatrices | None:
    """The buffers of `meta` over a private (copy-on-write) map of `path`: read pages are the file's (their page
    tables filled at once where the page cache holds them). Where `arena` is given, a file of `huge_pages.MAP_MIN`
    bytes or more is mapped so and advised for huge pages, a smaller one read into the arena. `sampled`: the
    recorded `_sampled` checksum its bytes must have (else None)."""
    if arena is not None and meta["size"] < huge_pages.MAP_MIN:
        raw = arena.read(path, meta["size"])
    else:
        raw = np.memmap(path, dtype=np.uint8, mode="c")
        if arena is not None:
            huge_pages.advise(raw, path)  # before any page is read: the page cache then reads it in 2 MiB folios
    # an advised map's windows read through it; an expert's by read(), its map left to fault in as the steps read it
    if sampled is not None and (_sampled_in(raw) if arena is not None else _sampled(path, raw.nbytes)) != sampled:
        return None
    if isinstance(raw, np.memmap):
        _fill_page_tables(raw)
    parts = {}
    for key, p in meta["parts"].items():
        dtype = _TORCH[p["dtype"]]
        count = int(np.prod(p["shape"])) * dtype.itemsize
        view = raw[p["at"]:p["at"] + count].view(_NUMPY[dtype])
        parts[key] = torch.from_numpy(view).view(dtype).view(p["shape"])
    ex = ExpertMatrices(parts["codes"], parts.get("scale"), parts.get("offset"), meta["k"], meta["group"],
                        meta["four_bit"], meta["rows4"], meta["sub"], meta.get("by_groups", False),
                        meta.get("plane"))
    ex.source = path if isinstance(raw, np.memmap) else None
    return ex

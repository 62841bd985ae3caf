"""The conversion cache: where converted models live and how a cached folder is trusted.

Layout (one folder per model, published by an atomic rename)::

    $LMHEAD_CACHE (or $XDG_CACHE_HOME/lmhead, or ~/.cache/lmhead)
      models/<key>/              config.json, generation_config.json, model.safetensors, tokenizer files,
                                 manifest.json (written last, inside the temporary folder)
      models/.<key>.lock         flock: one process converts, the others wait and then read its result
      models/.tmp-<key>-<pid>-*  a conversion in progress (renamed into place when complete)

`manifest.json` records the source (GGUF sha256 and size, or the package version), the size, sha256 and
xxh3_64 checksum of every cached file, and the lmhead / transformers / torch versions that wrote it. Every
load checks each file's size and xxh3_64 (`verify`: ~0.4 s for Gemma's 1.07 GB, where sha256 takes ~2 s), so
weights damaged in place (same size, other bytes) are caught and rebuilt, not loaded;
`verify(..., checksums=True)` re-hashes with sha256. A manifest written before the fast checksum existed is
checked with sha256 once and then given the fast checksums (`add_fast_checksums`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmhead.cache_folder import cache_root, writer_alive

MANIFEST = "manifest.json"
FAST_CHECKSUM = "xxh3_64"  # the manifest's key for each file's fast checksum (xxhash.xxh3_64, hex)
FORMAT = 2  # bump when the layout of a cached folder changes; older folders are rebuilt


def _folder(name: str) -> Path:
    """`<cache>/<name>`, made if missing; ModelError naming it where it cannot be."""
    path = cache_root() / name
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from lmhead.models.errors import ModelError

        raise ModelError(f"cannot create the model cache folder {path}: {exc.strerror}; "
                         "set LMHEAD_CACHE to a writable folder") from exc
    return path


def no_space(exc: BaseException) -> int:
    """The errno of a write that failed for want of space (ENOSPC, EDQUOT) — an OSError's, or the one another
    library's error names in its text (safetensors': "(os error 28)") —, else 0."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        if (exc.errno == code) if isinstance(exc, OSError) else f"(os error {code})" in str(exc):
            return code
    return 0


def disk_error(exc: OSError, folder: Path, need: int):
    """The ModelError for a cache write that failed (a full disk, a quota, a read-only folder): one line naming
    `folder` and about how many bytes it needs (`need`), to be raised instead of the OSError."""
    from lmhead.models.errors import ModelError

    return ModelError(f"cannot write the model cache in {folder}: {exc.strerror or exc}; it needs about "
                      f"{need / 1e6:.0f} MB there: free some space or set LMHEAD_CACHE to another folder")


def models_dir() -> Path:
    return _folder("models")


def meta_dir() -> Path:
    """`<cache>/meta`: per GGUF source, what transformers derives from the file once (config, tokenizer) —
    the weights stay the file's (`models/file_model.py`)."""
    return _folder("meta")


def sha256_file(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def fast_checksum_file(path: Path, block: int = 1 << 24) -> str:
    """The file's xxh3_64 (hex): a non-cryptographic checksum that reads at memory speed, cheap enough to run on
    every load. It guards against damage (a disk, a copy, a stray write), not against a deliberate forgery:
    the sha256 in the manifest (`verify(checksums=True)`) is for that. Read through one reused buffer (a map
    of the whole file would count it in the process's peak memory)."""
    import xxhash

    digest = xxhash.xxh3_64()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def describe_files(folder: Path) -> dict[str, dict[str, Any]]:
    """{file name: {size, sha256, xxh3_64}} for every regular file in `folder` except the manifest."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p), FAST_CHECKSUM: fast_checksum_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def verify(folder: Path, checksums: bool = False) -> str | None:
    """Why `folder` cannot be used (a short reason), or None when it matches its manifest.

    Every file's size and fast checksum (xxh3_64) are checked; `checksums=True` re-hashes every file with
    sha256 instead, as does a file whose manifest entry has no fast checksum (an older manifest).
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return "no readable manifest.json"
    if manifest.get("format") != FORMAT:
        return f"cache format {manifest.get('format')} != {FORMAT}"
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return "manifest lists no files"
    for name, info in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != info.get("size"):
            return f"{name} has {size} bytes, the manifest says {info.get('size')}"
        if checksums or FAST_CHECKSUM not in info:
            if sha256_file(path) != info.get("sha256"):
                return f"{name} does not match its sha256 (the file is damaged)"
        elif fast_checksum_file(path) != info[FAST_CHECKSUM]:
            return f"{name} does not match its checksum (the file is damaged)"
    return None


def add_fast_checksums(folder: Path) -> bool:
    """Give a verified folder's manifest the fast checksum of each file that lacks one (an older manifest), so
    that later loads need not re-hash with sha256. Call it holding `lock(key)`, right after `verify` passed.
    False when nothing was missing or the manifest cannot be rewritten (a read-only cache: later loads keep
    checking with sha256)."""
    manifest = read_manifest(folder)
    files = (manifest or {}).get("files")
    if not isinstance(files, dict) or all(FAST_CHECKSUM in info for info in files.values()):
        return False
    try:
        for name, info in files.items():
            info.setdefault(FAST_CHECKSUM, fast_checksum_file(folder / name))
        tmp = folder / (MANIFEST + ".part")
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / MANIFEST)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def lock(key: str) -> Iterator[None]:
    """An exclusive lock per cache key, so that concurrent processes convert a model only once."""
    path = models_dir() / f".{key}.lock"
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def new_tmp_dir(key: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".tmp-{key}-{os.getpid()}-", dir=models_dir()))


def write_manifest(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    manifest = {"format": FORMAT, **info, "files": describe_files(folder)}
    tmp = folder / (MANIFEST + ".part")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def publish(tmp: Path, final: Path) -> Path:
    """Move a complete temporary folder into place atomically (call it holding `lock(key)`).

    A folder already at `final` is stale (the caller checked it under the lock): it is moved aside and removed.
    Should another writer still create `final` between the two renames (a process that does not take the
    lock), its folder is kept if it verifies and ours is discarded: a lost race, not an error.
    """
    for path in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors create private files; the cache is shared
        path.chmod(0o755 if path.is_dir() else 0o644)
    if final.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".trash-{final.name}-", dir=final.parent))
        with contextlib.suppress(OSError):
            os.rename(final, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if verify(final) is not None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def remove_stale_tmp(key: str) -> None:
    """Remove temporary folders of `key` left by processes that died mid-conversion."""
    for path in models_dir().glob(f".tmp-{key}-*"):
        try:
            pid = int(path.name[len(f".tmp-{key}-"):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not writer_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


# --- derived tensor files (compressed heads, GGUF codes): one safetensors file with its own checksum ----------


def derived_path(folder: Any, kind: str, suffix: str) -> Path | None:
    """`<cache>/<kind>/<model sha256[:32]>-<suffix>.safetensors` for a model folder of this cache, keyed by its
    manifest's checksum of the weights; None for any other folder (do not write next to the user's files)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        # a converted folder: its float32 weights' checksum; a model read from its GGUF file: the file's
        sha = manifest.get("weights_sha256") or manifest["files"]["model.safetensors"]["sha256"]
    except Exception:
        return None
    if Path(folder).resolve().parent.name not in ("models", "meta"):
        return None
    return Path(folder).resolve().parent.parent / kind / f"{sha[:32]}-{suffix}.safetensors"

TENSORS_CHECKSUM = "lmhead.xxh3_64"  # the safetensors metadata entry holding the tensors' checksum


def tensors_checksum(state: dict[str, Any]) -> str:
    """xxh3_64 over the tensors' names, dtypes, shapes and bytes (sorted by name): a damaged file (same size,
    other bytes) does not match the checksum written beside it."""
    import torch
    import xxhash

    digest = xxhash.xxh3_64()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def read_tensors(path: Path) -> tuple[dict[str, Any], dict[str, str]] | None:
    """(tensors, metadata) of the file at `path`, or None: missing, unreadable, or not matching its checksum
    (damaged, or written before the checksum existed) — the caller builds it again and overwrites it."""
    if not path.exists():
        return None
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
        state = load_file(str(path))
    except Exception:
        return None
    expected = meta.get(TENSORS_CHECKSUM)
    return (state, meta) if expected is not None and tensors_checksum(state) == expected else None


def write_tensors(path: Path, state: dict[str, Any], metadata: dict[str, str] | None = None) -> bool:
    """Write `state` to `path` with its checksum: a temporary file renamed into place (a concurrent reader sees
    the old file or the whole new one). False when the cache is not writable (it only costs the rebuild)."""
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(state, tmp, metadata={**(metadata or {}), TENSORS_CHECKSUM: tensors_checksum(state)})
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError:
        return False

"""Choosing a model's LM head: the head modes, "auto", and the disk cache of compressed heads.

    mode ("auto" | HEAD_MODES) ──resolve_head_mode(size)──▶ "fp32": the model's fp32 LMHead itself
                                                        └─▶ "exact-int8" | "int8" | "int4": a CompressedHead
        on the same weight, read from <cache>/heads/ when a previous load wrote it (and its checksum
        matches), else compressed (with calibration hidden states: models/calibration.py) and written there

`Model.__init__` calls `build_head` once; `use_head` swaps the head of a loaded model. This module is the only
code that writes compressed heads to the cache; `lmhead.compressed` itself knows nothing of models.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from lmhead.compressed import HEAD_MODES, CompressedHead
from lmhead.models.calibration import calibration_hidden

__all__ = ["AUTO_MIN_BYTES", "DEFAULT_HEAD_MODE", "HEAD_MODES", "build_head", "check_head_mode", "mode_of",
           "resolve_head_mode", "use_head"]

DEFAULT_HEAD_MODE = "auto"
# "auto": the fastest exact head for the size. The int8 kernel wins where the fp32 weight is far larger than
# the caches (Gemma 3 270M's 671 MB head); for SmolLM2's 113 MB head the two are equal and the fp32 head
# needs no extra memory (benchmarks/bench_head.py measures both).
AUTO_MIN_BYTES = 256 * 2**20


def check_head_mode(mode: Any) -> str:
    """`mode` if it is "auto" or one of HEAD_MODES, else ValueError listing them."""
    if mode != "auto" and mode not in HEAD_MODES:
        raise ValueError(f"head must be one of auto, {', '.join(HEAD_MODES)}; got {mode!r}")
    return mode


def resolve_head_mode(mode: str, weight: torch.Tensor) -> str:
    """`mode`, with "auto" replaced by "exact-int8" for heads of ≥ 256 MiB in fp32 and "fp32" below."""
    if check_head_mode(mode) == "auto":
        return "exact-int8" if weight.numel() * 4 >= AUTO_MIN_BYTES else "fp32"
    return mode


def mode_of(head: Any) -> str:
    """The `HEAD_MODES` name of a built head: "fp32" for an LMHead, else "int8"/"int4" with "exact-" when the
    compressed head re-scores its top `exact_k` tokens with the full-precision weight."""
    if not isinstance(head, CompressedHead):
        return "fp32"
    return f"{'exact-' if head.exact_k else ''}int{head.bits}"


def build_head(model: Any, mode: str = DEFAULT_HEAD_MODE, cache: bool = True, **kw: Any) -> Any:
    """The head of `mode` (see `HEAD_MODES`, or "auto": `resolve_head_mode`) for a model whose fp32 LMHead is
    `model.exact_head`: that head itself for "fp32", else a CompressedHead on its weight (`kw` go to it).

    The compressed tensors are cached next to the converted model (`<cache>/heads/<model sha256>-<mode>
    .safetensors`, keyed by the manifest's checksum of the model file) so that a second load does not
    compress again; models without a manifest in lmhead's cache (HF folders) are compressed in memory.
    """
    base = model.exact_head
    mode = resolve_head_mode(mode, base.weight)
    if mode == "fp32":
        return base
    path = _state_path(model, mode) if cache else None
    state = _read_state(path) if path is not None else None
    if state is not None:
        try:
            return CompressedHead.from_mode(base, mode, state=state, **kw)
        except Exception:  # stale (another weight, other compression code): compress again and overwrite it
            pass
    if mode in ("exact-int8", "int8") and "calibration" not in kw:
        kw["calibration"] = calibration_hidden(model)
    head = CompressedHead.from_mode(base, mode, **kw)
    if path is not None:
        _write_state(head, path)
    return head


def use_head(model: Any, mode: str = DEFAULT_HEAD_MODE, cache: bool = True, **kw: Any) -> Any:
    """Give a loaded `Model` the head of `mode` (`build_head`) as `model.head`; returns the model. The fp32
    head stays `model.exact_head`."""
    model.head = build_head(model, mode, cache=cache, **kw)
    return model


def _state_path(model: Any, mode: str) -> Path | None:
    """Where the compressed head of `mode` for this model is cached, or None (not a model of the cache)."""
    folder = getattr(model, "path", None)
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
        sha = manifest["files"]["model.safetensors"]["sha256"]
    except Exception:
        return None
    if Path(folder).resolve().parent.name != "models":
        return None  # not a folder of lmhead's model cache: do not write next to the user's files
    root = Path(folder).resolve().parent.parent  # <cache>/models/<name> -> <cache>
    return root / "heads" / f"{sha[:32]}-{mode}.safetensors"


_CHECKSUM_KEY = "lmhead.xxh3_64"  # the safetensors metadata entry holding the state's checksum


def _state_checksum(state: dict[str, torch.Tensor]) -> str:
    """xxh3_64 over the tensors' names, dtypes, shapes and bytes (sorted by name): a damaged file (same size,
    other bytes) does not match the checksum written beside it."""
    import xxhash

    digest = xxhash.xxh3_64()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _read_state(path: Path) -> dict[str, torch.Tensor] | None:
    """The cached state at `path`, or None: missing, unreadable, or not matching its checksum (damaged, or
    written before the checksum existed) — the caller compresses again and overwrites it."""
    if not path.exists():
        return None
    try:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), "pt") as f:
            expected = (f.metadata() or {}).get(_CHECKSUM_KEY)
        state = load_file(str(path))
    except Exception:
        return None
    return state if expected is not None and _state_checksum(state) == expected else None


def _write_state(head: CompressedHead, path: Path) -> None:
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        state = head.compressed_state()
        save_file(state, tmp, metadata={_CHECKSUM_KEY: _state_checksum(state)})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # a read-only cache only costs the compression time

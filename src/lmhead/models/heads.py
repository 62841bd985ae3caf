"""Choosing a model's LM head: the head modes, "auto", and the disk cache of compressed heads.

    mode ("auto" | HEAD_MODES) ──resolve_head_mode(size)──▶ "fp32": the model's fp32 LMHead itself
                                                        └─▶ "exact-int8" | "int8" | "int4": a CompressedHead
        on the same weight, read from <cache>/heads/ when a previous load wrote it (and its checksum
        matches), else compressed (with calibration hidden states: models/calibration.py) and written there

`Model.__init__` calls `build_head` once; `use_head` swaps the head of a loaded model. This module is the only
code that writes compressed heads to the cache; `lmhead.compressed` itself knows nothing of models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmhead.compressed import HEAD_MODES, CompressedHead
from lmhead.models import cache
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


def resolve_head_mode(mode: str, weight: torch.Tensor | None, coded: bool = False) -> str:
    """`mode`, with "auto" replaced by "fp32" where the fp32 head reads the GGUF file's codes (`coded`: exact
    and the fastest, benchmarks/bench_head.py), else "exact-int8" for heads of ≥ 256 MiB in fp32 and "fp32"
    below."""
    if check_head_mode(mode) == "auto":
        return "exact-int8" if not coded and weight.numel() * 4 >= AUTO_MIN_BYTES else "fp32"  # codes: no weight read
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
    coded = getattr(base, "product", None) is not None
    mode = resolve_head_mode(mode, None if coded else base.weight, coded=coded)
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
    return cache.derived_path(getattr(model, "path", None), "heads", mode)


def _read_state(path: Path) -> dict[str, torch.Tensor] | None:
    stored = cache.read_tensors(path)
    return None if stored is None else stored[0]


def _write_state(head: CompressedHead, path: Path) -> None:
    cache.write_tensors(path, head.compressed_state())

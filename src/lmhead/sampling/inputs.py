"""Checks of the pipeline's inputs: logits [B,V], the row maxima, prev_tokens [B,L], per-row ints and floats."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lmhead.checks import is_int

_ONCE: dict[str, dict[int, tuple[Any, Any]]] = {}
_ONCE_LOCK = threading.Lock()


def once_per(kind: str, value: Any, build: Callable[[Any], Any], size: int = 256) -> Any:
    """build(value), computed once per object (of up to `size` objects of this kind, the oldest forgotten first):
    keyed by the object's identity and holding it, so that the key cannot name another object while the entry
    lives. For what a frozen config or its token-id tuples become, where hashing them or walking them each call
    costs more than the work they serve."""
    seen = _ONCE.get(kind)
    hit = None if seen is None else seen.get(id(value))
    if hit is not None and hit[0] is value:
        return hit[1]
    out = build(value)
    with _ONCE_LOCK:
        seen = _ONCE.setdefault(kind, {})
        while len(seen) >= size:
            seen.pop(next(iter(seen)))
        seen[id(value)] = (value, out)
    return out


def check_logits(logits: object, name: str = "logits") -> tuple[Tensor, bool]:
    """[B,V] or [V] floating tensor → ([B,V] float32, was_1d). Values are checked later (see check_top)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, V], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (float32/bfloat16/float16/float64), got {logits.dtype}")
    if logits.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape [B, V] or [V], got {tuple(logits.shape)}")
    one_row = logits.dim() == 1
    x = logits.unsqueeze(0) if one_row else logits
    if x.shape[-1] == 0:
        raise ValueError(f"{name} must have a vocabulary dimension V ≥ 1, got shape {tuple(logits.shape)}")
    return x.float(), one_row


def check_top(top: Tensor, name: str = "logits", temperature: float | Tensor = 1.0) -> None:
    """`top` is each row's largest value (max propagates NaN and +inf): one check covers NaN, +inf and rows
    that are all -inf, at no extra pass over the vocabulary. With a temperature (a number, or a column [b,1] of
    one per row), also that top / temperature (the largest scaled logit) is a finite float32: otherwise the row
    would turn into NaN."""
    if top.numel() == 0:
        return
    if not bool(torch.isfinite(top).all()):
        bad = (~torch.isfinite(top)).nonzero()[0, 0].item()
        value = top.reshape(-1)[bad].item()
        if math.isnan(value):
            raise ValueError(f"{name} must not contain NaN (row {bad})")
        if value > 0:
            raise ValueError(f"{name} must not contain +inf (row {bad})")
        raise ValueError(f"{name}: row {bad} is all -inf (after logit_bias / banned_tokens): no token can be "
                         "chosen")
    if isinstance(temperature, Tensor):
        scaled = top.reshape(-1) / temperature.reshape(-1)
    elif temperature != 1.0:
        scaled = top.reshape(-1) / temperature
    else:
        return
    if not bool(torch.isfinite(scaled).all()):
        bad = (~torch.isfinite(scaled)).nonzero()[0, 0].item()
        t = float(temperature.reshape(-1)[bad]) if isinstance(temperature, Tensor) else temperature
        raise ValueError(f"temperature={t:g} takes the largest {name} value of row {bad} "
                         f"({top.reshape(-1)[bad].item():g}) outside float32's range; use a larger temperature")


def check_overflow(x: Tensor, cols: Tensor, mine: Tensor, before: Tensor, name: str, setting: Tensor,
                    start: int) -> None:
    """The logits at cols [B,L] (where `mine`) were `before` a step that used the per-row `setting` [B]: one
    that was finite and is not any more is a ValueError naming the setting (not the logits, which were fine)."""
    bad = mine & torch.isfinite(before) & ~torch.isfinite(x.gather(1, cols))
    if bool(bad.any()):
        row, j = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}={setting[row].item():g} takes the logit {before[row, j].item():g} of token "
                         f"{cols[row, j].item() + start} (row {row}) outside float32's range; use a {name} "
                         "closer to 1")


def check_values(x: Tensor, name: str = "logits") -> None:
    if x.numel():
        check_top(x.amax(dim=-1), name)


def as_row_ints(value: object, batch: int, name: str, device: torch.device) -> Tensor:
    """An int ≥ 0 or one per row (prompt_len, step) → LongTensor [B]; ValueError naming ``name`` otherwise."""
    if isinstance(value, Tensor):
        t = value.to(device=device, dtype=torch.long).reshape(-1)
    elif is_int(value):
        t = torch.full((batch,), int(value), dtype=torch.long, device=device)
    elif isinstance(value, Sequence) and all(is_int(v) for v in value):
        t = torch.tensor(list(value), dtype=torch.long, device=device)
    else:
        raise ValueError(f"{name} must be an int ≥ 0 or one int ≥ 0 per row, got {value!r}")
    if t.numel() != batch or bool((t < 0).any()):
        raise ValueError(f"{name} must be an int ≥ 0 or one int ≥ 0 per row ({batch}), got {value!r}")
    return t


def as_prev_tokens(prev: object, batch: int, vocab: int | None, device: torch.device,
                   one_row: bool = False) -> Tensor:
    """prev_tokens ([B,L] integer tensor or a list of lists; one list for a [V] row when ``one_row``) →
    LongTensor [B,L], -1 = padding; ids checked to be in [0, vocab) (only ≥ 0 when vocab is None)."""
    if isinstance(prev, Tensor):
        if prev.is_floating_point() or prev.is_complex() or prev.dtype == torch.bool:
            raise TypeError(f"prev_tokens must be an integer tensor [B, L], got {prev.dtype}")
        t = prev.to(device=device, dtype=torch.long)
        if one_row and t.dim() == 1:
            t = t.unsqueeze(0)
    elif isinstance(prev, Sequence):
        rows = [prev] if one_row and all(is_int(v) for v in prev) else list(prev)
        if len(rows) != batch:
            raise ValueError(f"prev_tokens needs one list of token ids per row ({batch}), got {len(rows)}")
        width = max((len(r) for r in rows), default=0)
        t = torch.full((batch, width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            if len(r):
                try:
                    t[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
                except (TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(f"prev_tokens row {i} must be a list of token ids, got {r!r}") from e
        t = t.to(device)
    else:
        raise TypeError(f"prev_tokens must be a LongTensor [B, L] (-1 = padding) or a list of lists, got {prev!r}")
    if t.dim() != 2 or t.shape[0] != batch:
        raise ValueError(f"prev_tokens must have shape [B={batch}, L], got {tuple(t.shape)}")
    if t.numel() and (bool((t < -1).any()) or (vocab is not None and bool((t >= vocab).any()))):
        raise ValueError(f"prev_tokens must hold token ids in [0, {vocab or 'V'}) or -1 (padding)")
    return t


def as_row_floats(value: float | Sequence[float] | Tensor, batch: int, name: str, device: torch.device,
                   ok: Any, allowed: str) -> Tensor:
    """A setting given as one number or one per row → float32 [B]; checked in float64, before a value beyond
    float32's range could become ±inf."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is not None and t.numel() == 1:
        t = t.expand(batch)
    if t is None or t.numel() != batch or not bool(ok(t).all()):
        raise ValueError(f"{name} must be {allowed} (one number or one per row), got {value!r}")
    return t.float()

"""Option checks shared by every entry point: the same input gets the same answer everywhere.

Each function validates one option, names it and its allowed range in the error, and returns the value
normalised (an int stays an int, a real becomes a float). The API raises `ValueError` / `TypeError`; the CLI
and the server turn those into exit code 2 / HTTP 4xx. Callers check once, at their boundary (a constructor,
a public function), and never re-check inside. (An entry point's fields become a `SamplingConfig` in
`sampling.fields.sampling_config_from`, above this module.)
"""

from __future__ import annotations

import math
from typing import Any

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")


def is_int(x: object) -> bool:
    """A Python int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: object) -> bool:
    """A Python int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def positive_int(name: str, value: Any) -> int:
    """An int > 0 (sizes: d_model, vocab_size, ...)."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be an int > 0, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: Any) -> int | None:
    """None or an int > 0 (e.g. chunk_size)."""
    if value is None:
        return None
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be None or an int > 0, got {value!r}")
    return int(value)


def softcap(value: Any, name: str = "softcap") -> float | None:
    """None or a finite number > 0: logits = c·tanh(z/c)."""
    if value is None:
        return None
    if not is_real(value) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
    return float(value)


def reduction(value: Any) -> str:
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {value!r}")
    return value


def ignore_index(value: Any) -> int:
    if not is_int(value):
        raise TypeError(f"ignore_index must be an int, got {value!r}")
    return int(value)


def label_smoothing(value: Any) -> float:
    """In [0, 1): at 1 the target's own term vanishes and the loss no longer depends on the labels."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1), got {value!r}")
    return float(value)


def z_loss(value: Any) -> float:
    if not is_real(value) or not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"z_loss must be a finite number >= 0, got {value!r}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def loss_options(ignore_index_: Any, reduction_: Any, label_smoothing_: Any, z_loss_: Any,
                 softcap_: Any) -> tuple[int, str, float, float, float | None]:
    """The options every fused cross-entropy (single-process and vocab-parallel) shares, checked alike."""
    return (ignore_index(ignore_index_), reduction(reduction_), label_smoothing(label_smoothing_),
            z_loss(z_loss_), softcap(softcap_))


def non_negative_int(name: str, value: Any) -> int:
    """An int >= 0 (counts that may be zero: logits_to_keep, exact_k, ...)."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def int_in_range(name: str, value: Any, lo: int, hi: int) -> int:
    """An int in [lo, hi] (both included)."""
    if not is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in [{lo}, {hi}], got {value!r}")
    return int(value)


def exact_k(value: Any, vocab_size: int) -> int | None:
    """None (the head's own default) or an int in [0, vocab_size]: how many top tokens per row a head's call
    makes exact."""
    return None if value is None else int_in_range("exact_k", value, 0, vocab_size)


class OptionError(ValueError):
    """A ValueError that names the option it is about (`option`), for entry points that report it apart
    (the server's `param`)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def seed_for_step(seed: int | None, step: int) -> int | None:
    """The seed of call `step` of a seeded run made one call at a time (the explainer's clicks): seed + step,
    wrapped into [0, 2**63). Calls differ from each other and a rerun with the same seed repeats them;
    None stays None (unseeded)."""
    return None if seed is None else (seed + step) % 2**63

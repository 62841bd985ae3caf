"""``SamplingConfig`` (one row's settings, validated on construction) and its coercion (``as_configs``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import Tensor

from lmhead.checks import is_int, is_real

# Temperatures below this are greedy (vLLM's rule): dividing by ~0 would overflow to ±inf.
GREEDY_TEMPERATURE = 1e-5


# The largest magnitudes the settings may take. Within them a logit of any realistic size (|x| ≲ 1e20) stays a
# finite float32 through every step: (x + bias) · penalty / T ≤ 1e20 · 1e4 / 1e-5 — and a setting above float32's
# range (1e308) would become ±inf in a float32 tensor and turn rows into NaN. An overflow that still happens
# (logits near float32's limit) is an error naming the setting.
TEMPERATURE_LIMIT = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
PENALTY_LIMIT = 1e4  # |presence_penalty|, |frequency_penalty|
LOGIT_BIAS_LIMIT = 1e4  # |logit_bias| of a finite bias; -inf bans


@dataclass(frozen=True)
class SamplingConfig:
    """Settings of the logits pipeline for one row (or a whole batch). Validates itself.

    temperature         in [0, 1e4]. 0 (or anything < 1e-5, as vLLM) is greedy: argmax after bias and
                        penalties; top-k / top-p / min-p are then ignored.
    top_k               int ≥ 0; 0 = off. Keeps the k largest logits (ties with the k-th kept).
    top_p               in (0, 1]; 1 = off. Smallest set whose mass reaches top_p (crossing token kept).
    min_p               in [0, 1]; 0 = off. Keeps tokens with p ≥ min_p · p_max.
    repetition_penalty  in [1e-4, 1e4]; 1 = off. CTRL/HF: logit > 0 → logit / r, else logit · r, once per
                        token seen in the prompt or the generated tokens.
    presence_penalty    in [-1e4, 1e4]; 0 = off. OpenAI: minus presence once for each token generated so far.
    frequency_penalty   in [-1e4, 1e4]; 0 = off. OpenAI: minus frequency · count over the generated tokens.
    logit_bias          mapping token id (int ≥ 0) → float in [-1e4, 1e4] added to the logit, or -inf, which
                        bans the token (+inf and NaN are rejected). Stored as a read-only mapping.
    The bounds (TEMPERATURE_LIMIT, REPETITION_PENALTY_RANGE, PENALTY_LIMIT, LOGIT_BIAS_LIMIT) keep the float32
    arithmetic of every step finite; a value outside them is a ValueError naming the setting and its range.
    banned_tokens       token ids (int ≥ 0) that can never be chosen.
    seed                int or None. With a seed, a row's draw depends only on (seed, step).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    banned_tokens: tuple[int, ...] = ()
    seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        def real(name: str, allowed: str, ok: Any) -> float:
            value = getattr(self, name)
            if not is_real(value) or math.isnan(value) or not ok(float(value)):
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
            return float(value)

        set_ = lambda name, v: object.__setattr__(self, name, v)  # frozen: __post_init__ normalises
        set_("temperature", real("temperature", f"in [0, {TEMPERATURE_LIMIT:g}] (0 = greedy)",
                                 lambda v: 0 <= v <= TEMPERATURE_LIMIT))
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {self.top_k!r}")
        set_("top_p", real("top_p", "in (0, 1] (1 = off)", lambda v: 0 < v <= 1))
        set_("min_p", real("min_p", "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1))
        low, high = REPETITION_PENALTY_RANGE
        set_("repetition_penalty", real("repetition_penalty", f"in [{low:g}, {high:g}] (1 = off)",
                                        lambda v: low <= v <= high))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, real(name, f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off)",
                            lambda v: abs(v) <= PENALTY_LIMIT))

        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise ValueError(f"logit_bias must be a mapping token id -> float or None, got {type(bias)}")
            clean: dict[int, float] = {}
            for tok, val in bias.items():
                if not is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (int ≥ 0), got {tok!r}")
                if not is_real(val) or not (abs(val) <= LOGIT_BIAS_LIMIT or val == -math.inf):
                    raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] "
                                     f"or -inf (bans), got {val!r} for token {tok}")
                clean[tok] = float(val)
            set_("logit_bias", MappingProxyType(clean) if clean else None)

        banned = self.banned_tokens
        if isinstance(banned, (str, bytes)) or not isinstance(banned, (Sequence, set, frozenset, Tensor)):
            raise ValueError(f"banned_tokens must be a sequence of token ids (int ≥ 0), got {banned!r}")
        banned = tuple(int(t) if isinstance(t, Tensor) else t for t in banned)
        for tok in banned:
            if not is_int(tok) or tok < 0:
                raise ValueError(f"banned_tokens must hold token ids (int ≥ 0), got {tok!r}")
        set_("banned_tokens", banned)

        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def __hash__(self) -> int:  # logit_bias is a mapping: hash its items
        bias = tuple(sorted(self.logit_bias.items())) if self.logit_bias else None
        return hash((self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                     self.presence_penalty, self.frequency_penalty, bias, self.banned_tokens, self.seed))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5): the argmax after bias and penalties."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def _cut_key(self, vocab_size: int) -> tuple:
        """Rows with equal keys are cut together (steps 3–6). Disabled settings are normalised away."""
        if self.is_greedy:
            return ("greedy",)
        top_k = self.top_k if 0 < self.top_k < vocab_size else 0  # k ≥ V keeps everything
        return ("sample", self.temperature, top_k, self.top_p, self.min_p)


ConfigArg = SamplingConfig | Sequence[SamplingConfig] | None


def as_configs(config: ConfigArg | Mapping[str, Any], batch: int) -> list[SamplingConfig]:
    """A config argument → one SamplingConfig per row (a list of ``batch``).

    None is the default config; one SamplingConfig (or a mapping of its fields) serves every row; a list or
    tuple must hold exactly one SamplingConfig per row. Raises TypeError / ValueError naming ``config``."""
    if config is None:
        return [SamplingConfig()] * batch
    if isinstance(config, SamplingConfig):
        return [config] * batch
    if isinstance(config, Mapping):
        return [SamplingConfig(**config)] * batch  # SamplingConfig validates the values
    if isinstance(config, (list, tuple)):
        if len(config) != batch:
            raise ValueError(f"config: a list needs one SamplingConfig per row ({batch}), got {len(config)}")
        for c in config:
            if not isinstance(c, SamplingConfig):
                raise TypeError(f"config must hold SamplingConfig objects, got {type(c).__name__}")
        return list(config)
    raise TypeError(f"config must be a SamplingConfig or a list of them, got {type(config).__name__}")


def _config_arg(config: ConfigArg, batch: int) -> list[SamplingConfig] | SamplingConfig:
    """as_configs, but one config for the whole batch stays one (its rows then run as one group, no indexing)."""
    if isinstance(config, (list, tuple)):
        return as_configs(config, batch)
    return as_configs(config, 1)[0]

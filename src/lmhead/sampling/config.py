"""``SamplingConfig`` (one row's settings, validated on construction) and its coercion (``as_configs``).

The fields, their defaults, checks and documentation are the steps' declarations (``lmhead.sampling.steps``): a
step's module adds its parameters here without this module naming them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import field, make_dataclass
from typing import Any, NamedTuple

from lmhead.sampling.steps import FIELD_ORDER, PARAMS, chain, runs_on
from lmhead.sampling.steps.masks import LOGIT_BIAS_LIMIT
from lmhead.sampling.steps.penalties import PENALTY_LIMIT, REPETITION_PENALTY_RANGE
from lmhead.sampling.steps.temperature import GREEDY_TEMPERATURE, TEMPERATURE_LIMIT

__all__ = ["GREEDY_TEMPERATURE", "LOGIT_BIAS_LIMIT", "PENALTY_LIMIT", "REPETITION_PENALTY_RANGE",
           "TEMPERATURE_LIMIT", "CutKey", "SamplingConfig", "as_configs"]


class CutKey(NamedTuple):
    """What the batch path's cut of a row depends on: rows with equal keys are cut together (steps 3-6).
    mode "greedy" or "sample"; top_k 0 where it keeps everything (0 or ≥ V)."""

    mode: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def _post_init(self) -> None:
    for name in FIELD_ORDER:  # each declared check: a ValueError naming the field and its range
        object.__setattr__(self, name, PARAMS[name].check(getattr(self, name)))  # frozen: normalised once


def _hashable(value: Any) -> Any:
    return tuple(sorted(value.items())) if isinstance(value, Mapping) else value


def _hash(self) -> int:  # logit_bias is a mapping: hash its items
    return hash(tuple(_hashable(getattr(self, name)) for name in FIELD_ORDER))


def _is_greedy(self) -> bool:
    """Temperature 0 (or below 1e-5): the argmax after the masks and penalties."""
    return self.temperature < GREEDY_TEMPERATURE


def _has_penalties(self) -> bool:
    return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _cut_key(self, vocab_size: int) -> CutKey:
    """The batch path's cut key (named fields). Disabled settings are normalised away."""
    if self.is_greedy:
        return CutKey("greedy")
    top_k = self.top_k if 0 < self.top_k < vocab_size else 0  # k ≥ V keeps everything
    return CutKey("sample", self.temperature, top_k, self.top_p, self.min_p)


def _steps(self) -> list:
    """The declared steps this config runs, in order (``lmhead.sampling.steps.chain``)."""
    return chain(self)


def _runs_on(self, backend: str) -> bool:
    """Whether every step this config runs declares `backend` ("batch", "c", "sharded"; steps.runs_on)."""
    return runs_on(self, backend)


def _doc() -> str:
    lines = ["Settings of the logits pipeline for one row (or a whole batch). Frozen, hashable; validates itself:",
             "a value outside its range is a ValueError naming the field and the range.", ""]
    for name in FIELD_ORDER:
        p = PARAMS[name]
        lines.append(f"{name:<22}{p.allowed}. {p.doc}")
    return "\n".join(lines)


SamplingConfig = make_dataclass(
    "SamplingConfig",
    [(n, PARAMS[n].annotation, field(default=PARAMS[n].default)) for n in FIELD_ORDER],
    frozen=True,
    namespace={"__post_init__": _post_init, "__hash__": _hash, "is_greedy": property(_is_greedy),
               "has_penalties": property(_has_penalties), "cut_key": _cut_key,
               "steps": _steps, "runs_on": _runs_on, "__doc__": _doc(), "__module__": __name__},
)
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


def config_arg(config: ConfigArg, batch: int) -> list[SamplingConfig] | SamplingConfig:
    """as_configs, but one config for the whole batch stays one (its rows then run as one group, no indexing)."""
    if isinstance(config, (list, tuple)):
        return as_configs(config, batch)
    return as_configs(config, 1)[0]

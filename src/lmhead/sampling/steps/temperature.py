"""Stage 3, temperature: logits / T, or llama.cpp's dynamic temperature (T scaled by the row's entropy)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lmhead.sampling.steps.base import Context, Step, param_rows, real_param
from lmhead.sampling.steps.moments import moments
from lmhead.sampling.vocab import NEG_INF

# Temperatures below this are greedy (vLLM's rule): dividing by ~0 would overflow to ±inf.
GREEDY_TEMPERATURE = 1e-5
# The largest magnitudes the settings may take. Within them a logit of any realistic size (|x| ≲ 1e20) stays a
# finite float32 through every step: (x + bias) · penalty / T ≤ 1e20 · 1e4 / 1e-5 — and a setting above float32's
# range (1e308) would become ±inf in a float32 tensor and turn rows into NaN. An overflow that still happens
# (logits near float32's limit) is an error naming the setting.
TEMPERATURE_LIMIT = 1e4

PARAMS = (
    real_param("temperature", 1.0, 0.0, TEMPERATURE_LIMIT, "logits / T. 0 (or anything < 1e-5, as vLLM) is greedy: "
               "the argmax after the masks and penalties; the cut-offs are then skipped.", "0 = greedy"),
    real_param("dynatemp_range", 0.0, 0.0, TEMPERATURE_LIMIT, "llama.cpp dynamic temperature: T runs over "
               "[max(0, T − range), T + range] with the row's normalised entropy.", "0 = off"),
    real_param("dynatemp_exponent", 1.0, 0.0, 1e3, "llama.cpp dynamic temperature: the power of the normalised "
               "entropy."),
)


def dynamic_temperature(x: Tensor, temperature: float, spread: float, exponent: float) -> float:
    """llama.cpp's ``llama_sampler_temp_ext_apply``: over the row's candidates (finite logits, n > 1), H = the
    entropy of softmax(x), T' = max(0, T − spread) + 2·spread·(H / ln n)^exponent (min + (max − min)·h^e); one
    candidate keeps T. Computed in float64 (`moments`)."""
    mo = moments(x)
    if mo is None or mo.finite <= 1:
        return temperature
    low, high = max(0.0, temperature - spread), temperature + spread
    return low + (high - low) * (mo.entropy / math.log(mo.finite)) ** exponent


def _temperature_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return x / cfg.temperature


def _temperature_rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return x / param_rows(cfgs, "temperature", x)


def _dynatemp_apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    t = dynamic_temperature(x, cfg.temperature, cfg.dynatemp_range, cfg.dynatemp_exponent)
    if t < GREEDY_TEMPERATURE:  # a dynamic temperature of ~0: the argmax alone, as a division by ~0 would give
        top = x.amax(dim=-1, keepdim=True)
        return torch.where(x == top, torch.zeros_like(x), torch.full_like(x, NEG_INF))
    return x / t


# one of the two runs where an order says "temperature": dynamic temperature takes the place of the division
STEPS = (
    Step("temperature", ("temperature",), 3, lambda c: c.temperature != 1.0 and c.dynatemp_range == 0, True, "",
         _temperature_apply, "logits / T (transformers TemperatureLogitsWarper)",
         frozenset({"torch", "c", "sharded", "batch"}), aliases=("temp",), rows=_temperature_rows),
    Step("dynatemp", ("temperature", "dynatemp_range", "dynatemp_exponent"), 3, lambda c: c.dynatemp_range > 0,
         True, "", _dynatemp_apply, "llama.cpp llama_sampler_temp_ext (src/llama-sampling.cpp)",
         example=(("dynatemp_range", 0.5),)),
)

"""lmhead's logits pipeline inside transformers' `generate()`, as a logits processor.

    from lmhead import SamplingConfig
    from lmhead.integrations.generation import generate_kwargs
    cfg = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=7)
    out = hf_model.generate(input_ids, max_new_tokens=20, **generate_kwargs(cfg))

At each step `generate` hands the processor the sequence so far `input_ids` [B,L] and the next-token scores
[B,V]; the processor runs lmhead.sampling's pipeline on them — 1. logit bias / banned tokens 2. repetition,
presence, frequency penalties 3. temperature 4. top-k 5. top-p 6. min-p (7. softmax 8. draw with draw=True),
and every other declared step in the config's order (``lmhead.sampling.steps``; mirostat's μ kept per row for
the call) — with the prompt = the first call's L tokens (penalties: repetition over prompt + generated tokens,
presence / frequency over the generated ones).

Two modes:
- draw=True (default): `lmhead.sample` picks the token (steps 1-8) and the processor returns scores that are
  0 at it and -inf elsewhere, so generate's own argmax (do_sample=False) or multinomial takes exactly it.
  Seeds: a row whose SamplingConfig has `seed` draws from a generator seeded with (seed, step), step = tokens
  generated so far in this generate call, so the same seed gives the same tokens whatever the batch size, the
  row's position in it, or torch's global RNG; rows without a seed draw from `generator` (or torch's default
  generator), which is not the stream transformers' multinomial would use.
- draw=False: the processor returns the processed logits (steps 1-6, rejected tokens -inf) and generate draws
  (do_sample=True, its own warpers off). With the same torch seed (`torch.manual_seed`) the tokens are the
  ones transformers' RepetitionPenalty / Temperature / TopK / TopP / MinP processors give for the same
  settings (the probabilities agree to float32 rounding). `SamplingConfig.seed` is refused here: the draw is
  transformers'.

One processor follows one generate call at a time: it sees a new call when the sequence does not grow by
exactly one token (or the batch size changes); `reset()` forces it. Greedy and sampling decoding only (no
beam search: its rows are reordered between steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from lmhead.checks import flag
from lmhead.sampling import RowState, SamplingConfig, as_configs, process_logits, sample

__all__ = ["SamplingLogitsProcessor", "config_from_generation_config", "generate_kwargs"]

ConfigArg = SamplingConfig | Sequence[SamplingConfig] | Mapping[str, Any] | None


class SamplingLogitsProcessor(LogitsProcessor):
    """lmhead's logits pipeline as a transformers LogitsProcessor: (input_ids [B,L], scores [B,V]) → [B,V].

    config: one SamplingConfig (or a mapping of its fields) for every row, or a list with one per row.
    draw: True = lmhead draws (returns 0 at the drawn token, -inf elsewhere); False = returns the processed
    logits for generate to draw from. generator: the torch.Generator of unseeded rows when draw=True."""

    def __init__(self, config: ConfigArg = None, *, draw: bool = True,
                 generator: torch.Generator | None = None) -> None:
        if isinstance(config, Mapping):
            config = SamplingConfig(**config)
        if config is not None and not isinstance(config, (SamplingConfig, list, tuple)):
            raise TypeError(f"config must be a SamplingConfig, a mapping of its fields or a list of "
                            f"SamplingConfig, got {type(config).__name__}")
        if isinstance(config, (list, tuple)):
            as_configs(config, len(config))  # each entry a SamplingConfig
            config = list(config)
        self.draw = flag("draw", draw)
        configs = config if isinstance(config, list) else [config or SamplingConfig()]
        if not self.draw and any(c.seed is not None for c in configs):
            raise ValueError("SamplingConfig.seed needs draw=True: with draw=False transformers draws the token")
        if not self.draw and any(c.mirostat for c in configs):
            raise ValueError("mirostat needs draw=True: its μ moves with the drawn token, which transformers draws "
                             "with draw=False")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.config = config
        self.generator = generator
        self.reset()

    def reset(self) -> None:
        """Forget the current generate call: the next call's sequence is a new prompt."""
        self._prompt_len: int | None = None
        self._last: tuple[int, int] | None = None  # (batch, length) at the previous call
        self._states: list[RowState] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if not isinstance(scores, Tensor) or scores.dim() != 2:
            raise ValueError(f"scores must be a [B,V] tensor, got {getattr(scores, 'shape', type(scores))}")
        batch, length = input_ids.shape
        if self._last != (batch, length - 1) or self._prompt_len is None:  # a new generate call
            self._prompt_len = length
        self._last = (batch, length)
        step = length - self._prompt_len
        configs = as_configs(self.config, batch)
        # the sequence so far, where a step reads it (penalties, DRY, n-grams, bad words, min tokens)
        prev = input_ids if any(s.history for c in configs for s in c.steps()) else None
        if step == 0 or len(self._states) != batch:
            self._states = [RowState() for _ in range(batch)]  # mirostat's μ, per row of this generate call
        if not self.draw:
            return process_logits(scores, self.config, prev_tokens=prev, prompt_len=self._prompt_len)
        ids = sample(scores, self.config, self.generator, prev_tokens=prev, prompt_len=self._prompt_len, step=step,
                     state=self._states)
        out = torch.full_like(scores, -math.inf)
        return out.scatter_(1, ids.unsqueeze(1), 0.0)


def generate_kwargs(config: ConfigArg = None, *, draw: bool = True,
                    generator: torch.Generator | None = None) -> dict[str, Any]:
    """Keyword arguments for `hf_model.generate(...)` that make lmhead's processor the whole pipeline:
    the processor, and transformers' own sampling settings neutral (so the model's generation_config cannot
    add a second temperature / top-k / top-p / repetition penalty). draw=True → do_sample=False (generate
    takes the token lmhead drew); draw=False → do_sample=True (generate draws from lmhead's processed logits)."""
    processor = SamplingLogitsProcessor(config, draw=draw, generator=generator)
    return dict(logits_processor=LogitsProcessorList([processor]), do_sample=not processor.draw,
                temperature=1.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0, typical_p=1.0,
                epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0)


# GenerationConfig fields that change the next-token distribution and have no lmhead equivalent
_UNSUPPORTED = {"top_h": None, "encoder_repetition_penalty": 1.0, "sequence_bias": None, "num_beams": 1,
                "penalty_alpha": None, "diversity_penalty": 0.0}
# GenerationConfig fields lmhead's steps take under the same name (None or this value = off)
_SAME = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0}


def config_from_generation_config(generation_config: GenerationConfig | Mapping[str, Any]) -> SamplingConfig:
    """The SamplingConfig with the same settings as a transformers GenerationConfig (or a mapping of its
    fields): do_sample=False → temperature 0; temperature, top_k, top_p, min_p, repetition_penalty, typical_p,
    epsilon_cutoff, eta_cutoff, no_repeat_ngram_size as is (None = off); single-token `bad_words_ids` →
    banned_tokens, longer ones → bad_words; min_new_tokens → min_tokens withholding its eos_token_id. A step
    beyond temperature / top-k / top-p / min-p runs in transformers' order (samplers="transformers"; for those
    four both orders agree). ValueError for a setting lmhead does not have (beams, sequence_bias, top_h, ...)."""
    gc = (GenerationConfig(**generation_config) if isinstance(generation_config, Mapping)
          else generation_config)
    if not isinstance(gc, GenerationConfig):
        raise TypeError(f"generation_config must be a GenerationConfig or a mapping, got {type(gc).__name__}")
    bad = [name for name, off in _UNSUPPORTED.items() if getattr(gc, name, off) not in (off, None)]
    if bad:
        raise ValueError(f"generation_config sets {', '.join(bad)}, which lmhead's pipeline does not have")
    words = gc.bad_words_ids or []
    pick = lambda name, off: off if getattr(gc, name, None) is None else getattr(gc, name)
    same = {name: pick(name, off) for name, off in _SAME.items() if pick(name, off) != off}
    eos = gc.eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    extra: dict[str, Any] = {}
    if gc.min_new_tokens:
        extra = dict(min_tokens=gc.min_new_tokens, stop_token_ids=eos)
    if same and gc.do_sample:
        extra["samplers"] = "transformers"
    return SamplingConfig(
        temperature=pick("temperature", 1.0) if gc.do_sample else 0.0,
        top_k=pick("top_k", 0), top_p=pick("top_p", 1.0), min_p=pick("min_p", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        banned_tokens=tuple(w[0] for w in words if len(w) == 1),
        bad_words=tuple(tuple(w) for w in words if len(w) > 1), **same, **extra)

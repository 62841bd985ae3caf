"""Where the parts of a transformers causal LM are: this module asks the model, every other module asks it.

    hf_model (*ForCausalLM) ──body()──▶ the decoder: embedding + blocks + final norm, hidden [B,T,D]
    body ──final_norm()──▶ the norm applied after the last block (the logit lens applies it to every layer)
    hf_model.config ──text_config()──▶ the language model's config ──context_length()──▶ tokens it can see

Architectures name these parts differently (Llama/Gemma/Qwen: `.model` and `.norm`, GPT-2: `.transformer`
and `.ln_f`, GPT-NeoX: `.gpt_neox` and `.final_layer_norm`, ...); the lookups below try transformers' own
accessors first and the known names after, and raise a TypeError naming what they expected.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["body", "context_length", "final_norm", "text_config"]

_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")
_CONTEXT_NAMES = ("max_position_embeddings", "n_positions", "max_sequence_length")


def body(hf_model: nn.Module) -> nn.Module:
    """The transformer body (embeddings + blocks + final norm) of a *ForCausalLM model: its decoder
    (`get_decoder()`), else its base model (`.model`, `.transformer`, `.gpt_neox`, ... by the model's prefix)."""
    get = getattr(hf_model, "get_decoder", None)
    found = get() if callable(get) else None
    if found is None or found is hf_model:
        found = getattr(hf_model, "base_model", None)
    if found is None or found is hf_model:
        raise TypeError(f"hf_model: cannot find the body of {type(hf_model).__name__} (expected .model)")
    return found


def final_norm(body: nn.Module) -> nn.Module:
    """The norm the body applies after its last block (`.norm`, `.ln_f`, `.final_layernorm`, ...)."""
    for name in _NORM_NAMES:
        norm = getattr(body, name, None)
        if norm is not None:
            return norm
    raise TypeError(f"hf_model: cannot find the final norm of {type(body).__name__} (expected .norm)")


def text_config(config: Any) -> Any:
    """The language model's config: the text part of a multimodal config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def context_length(config: Any) -> int | None:
    """How many positions the model was built for (`max_position_embeddings`, `n_positions` or
    `max_sequence_length` of its text config); None when the config names none."""
    cfg = text_config(config)
    for name in _CONTEXT_NAMES:
        n = getattr(cfg, name, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None

"""The explainer's inputs: the older call form (hf_model, tokenizer, head, ...), the model's name and device, a
text's ids, a config as JSON, and which head's logits are shown (`explain_head`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch


def accepts_parts(fn):
    """Also accept the older call form fn(hf_model, tokenizer, head, text, ...): the three are wrapped in a
    `Model` that runs transformers' own modules with that head (`Model.from_parts`), as that form did."""

    @functools.wraps(fn)
    def call(model, *args, **kwargs):
        from lmhead.models.model import Model

        if not isinstance(model, Model) and len(args) >= 2 and hasattr(model, "config"):
            model, args = Model.from_parts(model, args[0], args[1]), args[2:]
        return fn(model, *args, **kwargs)

    return call


def model_name_of(model, name: str | None) -> str:
    return name or model.name


def model_device(model) -> torch.device:
    return model.device


def encode_prompt(tokenizer, text: str, what: str) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a string, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{what}: must be a non-empty string")
    ids = tokenizer.encode(text)  # transformers' tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"{what}: encodes to no tokens")
    return [int(i) for i in ids]


def config_dict(config) -> dict[str, Any]:
    """The config as JSON-ready data (logit_bias keys as strings, -inf bans as None via to_dict)."""
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {str(k): float(v) for k, v in dict(d["logit_bias"]).items()}
    if d.get("banned_tokens") is not None:
        d["banned_tokens"] = [int(t) for t in d["banned_tokens"]]
    return d


EXPLAIN_HEADS: tuple[str, ...] = ("exact", "decode")


def explain_head(model, head: str = "exact"):
    """(head module, its mode name) whose logits the explainer shows: "exact" (the default) is the model's
    full-precision head `Model.exact_head` ("fp32"); "decode" is `Model.head`, the head `generate` decodes
    with (e.g. "exact-int8": its top `exact_k` logits are exact, the rest approximate)."""
    from lmhead.models.heads import mode_of

    if head == "exact":
        return model.exact_head, "fp32"
    if head == "decode":
        return model.head, mode_of(model.head)
    raise ValueError(f"head: must be one of {', '.join(EXPLAIN_HEADS)}; got {head!r}")

"""Rotary position tables for a body that is not a transformers model (a GGUF file read in place).

    positions [B,T] ──freqs = position · inv_freq (float32)──▶ emb = [freqs, freqs] ──▶ cos, sin [B,T,hd]
        (times the rope type's attention scaling)

The same float32 operations as transformers' rotary modules (`LlamaRotaryEmbedding`, `Gemma3RotaryEmbedding`),
so the lean body's rope rows are theirs bit for bit: inv_freq = 1 / base^(arange(0, hd, 2) / hd) for the
"default" type; other types (linear, llama3, yarn, …) take their inverse frequencies from transformers'
`ROPE_INIT_FUNCTIONS`, imported only for them. Gemma 3 keeps one set per layer type.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Rotary"]


def _default_inv_freq(base: float, dim: int) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class Rotary:
    """`rotary(x, positions[, layer_type])` → (cos, sin) [B,T,hd] in x's dtype; `rope_type` as transformers'
    modules have it (a str, or {layer type: str} for Gemma 3)."""

    def __init__(self, cfg: Any) -> None:
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {"rope_type": "default",
                                                           "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
        self.per_type = "rope_type" not in params  # {layer type: parameters} (Gemma 3)
        self.tables: dict[str | None, tuple[Tensor, float]] = {}
        if self.per_type:
            self.rope_type = {kind: p["rope_type"] for kind, p in params.items() if p is not None}
            for kind, p in params.items():
                if p is not None:
                    self.tables[kind] = self._inv_freq(cfg, p, kind)
        else:
            self.rope_type = params["rope_type"]
            self.tables[None] = self._inv_freq(cfg, params, None)

    def _inv_freq(self, cfg: Any, params: dict[str, Any], kind: str | None) -> tuple[Tensor, float]:
        if params["rope_type"] == "default":
            return _default_inv_freq(float(params["rope_theta"]), self.dim), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
        inv_freq, scaling = fn(cfg, None, layer_type=kind) if kind is not None else fn(cfg, None)
        return inv_freq.float(), float(scaling)

    def __call__(self, x: Tensor, positions: Tensor, layer_type: str | None = None) -> tuple[Tensor, Tensor]:
        inv_freq, scaling = self.tables[layer_type if self.per_type else None]
        freqs = positions[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * scaling
        sin = emb.sin() * scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

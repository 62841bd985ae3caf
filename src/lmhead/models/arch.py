"""The architectures the lean body runs, as one table: what differs between them, in one row each.

    config.model_type ──ARCHS──▶ ArchSpec: norms, embedding scale, attention scaling and softcap, sliding layers,
        rotary per layer type, which linears are fused, the GGUF file's names for them

The lean body (`lean.py`) reads its step from the row, the GGUF reader (`file_model.py`) its tensors, and the
numbers come from the model's config (transformers' field names and values): the row says which fields apply.
A model type without a row, or a config whose rope the lean body does not compute (`refusal`), runs through
transformers' body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHS", "ArchSpec", "FILE_ARCHITECTURES", "arch_of", "refusal"]

# rope types whose frequencies do not depend on the sequence (`Rotary` computes them; the others change with
# the longest position of a call, as transformers' `dynamic_rope_update` does)
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "proportional"})


@dataclass(frozen=True)
class ArchSpec:
    """One architecture of the lean body. Defaults are Llama's."""

    model_type: str
    gguf: str | None = None           # llama.cpp's general.architecture for it (None: not read from a file)
    unit_offset_norm: bool = False    # RMSNorm scales by (1 + w) (Gemma; its GGUF files store 1 + w)
    sandwich_norms: bool = False      # a norm after attention and after the MLP too (Gemma 2, 3)
    scaled_embedding: bool = False    # the embedding times √D (Gemma)
    query_pre_attn_scalar: bool = False  # scores scaled by query_pre_attn_scalar^-½, not head_dim^-½
    attn_softcap: bool = False        # attn_logit_softcapping applies: tanh(s / c) · c before the mask
    rope_per_layer_type: bool = False  # one set of rope frequencies per layer type (Gemma 3)
    slide_every_layer: bool = False   # sliding_window, when set, narrows every layer (Mistral, Phi-3), not only
                                      # the layer_types' "sliding_attention" ones
    permute_qk: bool = False          # the GGUF's q/k rows in llama.cpp's rope order (transformers un-permutes)
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")   # transformers' attention linears, fused in this order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")     # and the MLP's (gate rows first)
    gguf_qkv: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")  # the same matrices in a GGUF file
    gguf_gate_up: tuple[str, ...] = ("ffn_gate", "ffn_up")
    act: str = "act_fn"               # the MLP module's activation attribute

    def sliding(self, kind: str, window: int | None) -> bool:
        """Whether a layer of type `kind` attends within the sliding window."""
        return window is not None and (self.slide_every_layer or kind == "sliding_attention")

    def scaling(self, cfg: Any, head_dim: int) -> float:
        return (cfg.query_pre_attn_scalar if self.query_pre_attn_scalar else head_dim) ** -0.5

    def softcap(self, cfg: Any) -> float | None:
        return (getattr(cfg, "attn_logit_softcapping", None) or None) if self.attn_softcap else None


_GEMMA = dict(unit_offset_norm=True, sandwich_norms=True, scaled_embedding=True, query_pre_attn_scalar=True,
              attn_softcap=True)

ARCHS: dict[str, ArchSpec] = {spec.model_type: spec for spec in (
    ArchSpec("llama", gguf="llama", permute_qk=True),
    # transformers' GGUF reader names a llama file whose general.name is "mistral" a Mistral model
    ArchSpec("mistral", permute_qk=True, slide_every_layer=True),
    ArchSpec("qwen2", gguf="qwen2"),
    ArchSpec("qwen3", gguf="qwen3"),
    # Phi-3: q/k/v one linear (attn_qkv in the file), gate/up one (ffn_up in the file, gate rows first); a Phi-3
    # file's long-context rope factors and sliding window are not read by transformers' loader
    ArchSpec("phi3", gguf="phi3", slide_every_layer=True, qkv=("qkv_proj",), gate_up=("gate_up_proj",),
             gguf_qkv=("attn_qkv",), gguf_gate_up=("ffn_up",), act="activation_fn"),
    # Gemma 2: Gemma 3 without q/k norms and with one rope; its softcaps and query scalar are the config's (a
    # GGUF's own softcap keys are not read by transformers' loader: its Gemma2Config defaults, 50 and 30, apply)
    ArchSpec("gemma2", gguf="gemma2", **_GEMMA),
    ArchSpec("gemma3_text", gguf="gemma3", rope_per_layer_type=True, **_GEMMA),
)}

# GGUF architectures whose body lmhead runs from the file → transformers' model type
FILE_ARCHITECTURES: dict[str, str] = {s.gguf: s.model_type for s in ARCHS.values() if s.gguf is not None}


def arch_of(cfg: Any) -> ArchSpec | None:
    """The row of a (text) config's model type, or None."""
    return ARCHS.get(getattr(cfg, "model_type", None))


def _rope_params(cfg: Any) -> list[dict]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [p for p in params.values() if isinstance(p, dict)] if "rope_type" not in params else []
    return nested or [params]


def refusal(cfg: Any, own_rotary: bool = False) -> str | None:
    """Why the lean body cannot compute this config's model as transformers does, or None where it can.
    `own_rotary`: the rope rows come from transformers' own rotary module (a transformers model), which follows
    a rope that changes with the sequence itself; `Rotary` (a model read from its file) computes static ones."""
    spec = arch_of(cfg)
    if spec is None:
        return f"the model type {getattr(cfg, 'model_type', None)!r}"
    params = _rope_params(cfg)
    fraction = getattr(cfg, "partial_rotary_factor", None)
    for p in params:
        fraction = p.get("partial_rotary_factor", fraction)
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in STATIC_ROPE and not own_rotary:
            return f"the {rope_type!r} rope (frequencies that change with the sequence)"
    if fraction not in (None, 1, 1.0):
        return f"a rope over part of each head (partial_rotary_factor {fraction})"
    return None

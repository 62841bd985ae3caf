"""The architectures the lean body runs, as one table: what differs between them, in one row each.

    config.model_type ──ARCHS──▶ ArchSpec: norms, embedding scale, attention scaling and softcap, rotary per
        layer type, and the layer as blocks — `Attention` (q/k/v fused, biases, q/k norms, sinks, sliding window)
        then an MLP: `DenseMLP` (gate/up fused, down) or `MoEMLP` (router, top-k, routing rule, shared expert),
        each block with the GGUF file's names for its tensors

The lean body (`lean.py`) reads its step from the row, the GGUF reader (`file_model.py`) its tensors, and the
numbers come from the model's config (transformers' field names and values): the row says which fields apply.
A model type without a row, or a config whose rope the lean body does not compute (`refusal`), runs through
transformers' body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHS", "ArchSpec", "Attention", "DenseMLP", "FILE_ARCHITECTURES", "MoEMLP", "arch_of", "refusal"]

# rope types whose frequencies do not depend on the sequence (`Rotary` computes them; the others change with
# the longest position of a call, as transformers' `dynamic_rope_update` does)
STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn", "proportional"})


@dataclass(frozen=True)
class Attention:
    """A layer's attention block: norm → q, k, v (one fused product) → q/k norms → rope → attention → o."""

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")   # transformers' attention linears, fused in this order
    gguf_qkv: tuple[str, ...] = ("attn_q", "attn_k", "attn_v")  # the same matrices in a GGUF file
    bias: bool = False                # q/k/v biases (Qwen2): read where the file has them
    o_bias: bool = False              # a bias on o (gpt-oss)
    qk_norm: bool = False             # an RMSNorm on each q and k head (Qwen3, Gemma 3)
    sinks: bool = False               # a learned logit per head in the softmax's denominator (gpt-oss: attn_sinks;
                                      # its layers' attention runs in the torch path, `LeanBody._attend`)
    slide_every_layer: bool = False   # sliding_window, when set, narrows every layer (Mistral, Phi-3), not only
                                      # the layer_types' "sliding_attention" ones
    permute_qk: bool = False          # the GGUF's q/k rows in llama.cpp's rope order (transformers un-permutes)


@dataclass(frozen=True)
class DenseMLP:
    """A layer's dense MLP: gate, up (one fused product, gate rows first) → act(gate)·up → down."""

    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")     # transformers' MLP linears (gate rows first)
    gguf_gate_up: tuple[str, ...] = ("ffn_gate", "ffn_up")
    act: str = "act_fn"               # the MLP module's activation attribute


@dataclass(frozen=True)
class MoEMLP:
    """A layer's mixture of experts: router logits x·Rᵀ [E] → softmax (float32) → the top k experts → their
    weights (renormalised to sum to 1, or not) → Σ weight · down(act(gate(x))·up(x)) over the chosen experts,
    plus, where the row has one, a shared expert scaled by sigmoid(x·g). A layer of such a model whose file
    holds no router is a dense MLP (`DenseMLP`, Qwen's `mlp_only_layers`)."""

    renormalise: bool = True          # the top k's weights divided by their sum (llama.cpp's rule for the family)
    renormalise_key: str | None = None  # the config field that decides it instead, where the config sets it
    shared_expert: bool = False       # Qwen2-MoE: one more MLP on every token, gated by sigmoid(x·g)
    experts_key: str = "num_experts"  # the config's expert count (Mixtral: num_local_experts)
    router: str = "ffn_gate_inp"      # the GGUF's names: router [E, D]; experts' gate, up [E, F, D], down [E, D, F]
    gguf_experts: tuple[str, str, str] = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    gguf_gate_up_experts: str = "ffn_gate_up_exps"  # gate and up in one [E, 2F, D] (--fuse-gate-up-exps)
    gguf_shared: tuple[str, str, str] = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    shared_gate: str = "ffn_gate_inp_shexp"  # [D]: the shared expert's gate
    softmax_after_topk: bool = False  # gpt-oss: the top k of the router's logits, then a softmax over those k
    biases: bool = False              # gpt-oss: the router and every expert's gate, up and down have biases
    act: str | None = None            # the experts' own gated activation ("swiglu_oai": gpt-oss's clamped SwiGLU,
                                      # gate and up clamped, (up + 1)·gate·σ(α·gate)); None: the body's act(gate)·up

    def renormalises(self, cfg: Any) -> bool:
        """Whether the top k weights are renormalised for this config."""
        value = getattr(cfg, self.renormalise_key, None) if self.renormalise_key else None
        return self.renormalise if value is None else bool(value)


@dataclass(frozen=True)
class ArchSpec:
    """One architecture of the lean body: its model-wide options and its layer's blocks. Defaults are Llama's."""

    model_type: str
    gguf: str | None = None           # llama.cpp's general.architecture for it (None: not read from a file)
    unit_offset_norm: bool = False    # RMSNorm scales by (1 + w) (Gemma; its GGUF files store 1 + w)
    sandwich_norms: bool = False      # a norm after attention and after the MLP too (Gemma 2, 3)
    scaled_embedding: bool = False    # the embedding times √D (Gemma)
    query_pre_attn_scalar: bool = False  # scores scaled by query_pre_attn_scalar^-½, not head_dim^-½
    attn_softcap: bool = False        # attn_logit_softcapping applies: tanh(s / c) · c before the mask
    rope_per_layer_type: bool = False  # one set of rope frequencies per layer type (Gemma 3)
    gguf_pre_mlp_norm: str = "ffn_norm"  # the GGUF's name of the norm before the MLP (gpt-oss: post_attention_norm)
    attention: Attention = Attention()
    mlp: DenseMLP | MoEMLP = DenseMLP()
    dense: DenseMLP = DenseMLP()      # the MLP of a layer without experts (the MoE rows' dense layers)

    # the blocks' fields the step and the reader ask for by name
    @property
    def qkv(self) -> tuple[str, ...]:
        return self.attention.qkv

    @property
    def gguf_qkv(self) -> tuple[str, ...]:
        return self.attention.gguf_qkv

    @property
    def permute_qk(self) -> bool:
        return self.attention.permute_qk

    @property
    def slide_every_layer(self) -> bool:
        return self.attention.slide_every_layer

    @property
    def gate_up(self) -> tuple[str, ...]:
        return self.dense.gate_up

    @property
    def gguf_gate_up(self) -> tuple[str, ...]:
        return self.dense.gguf_gate_up

    @property
    def act(self) -> str:
        return self.dense.act

    @property
    def moe(self) -> MoEMLP | None:
        """The row's mixture of experts, or None for a dense model."""
        return self.mlp if isinstance(self.mlp, MoEMLP) else None

    def sliding(self, kind: str, window: int | None) -> bool:
        """Whether a layer of type `kind` attends within the sliding window."""
        return window is not None and (self.slide_every_layer or kind == "sliding_attention")

    def scaling(self, cfg: Any, head_dim: int) -> float:
        return (cfg.query_pre_attn_scalar if self.query_pre_attn_scalar else head_dim) ** -0.5

    def softcap(self, cfg: Any) -> float | None:
        return (getattr(cfg, "attn_logit_softcapping", None) or None) if self.attn_softcap else None


_GEMMA = dict(unit_offset_norm=True, sandwich_norms=True, scaled_embedding=True, query_pre_attn_scalar=True,
              attn_softcap=True)
_LLAMA_ATTENTION = Attention(permute_qk=True)
_QWEN2_ATTENTION = Attention(bias=True)
_QWEN3_ATTENTION = Attention(qk_norm=True)

ARCHS: dict[str, ArchSpec] = {spec.model_type: spec for spec in (
    ArchSpec("llama", gguf="llama", attention=_LLAMA_ATTENTION),
    # transformers' GGUF reader names a llama file whose general.name is "mistral" a Mistral model
    ArchSpec("mistral", attention=Attention(permute_qk=True, slide_every_layer=True)),
    ArchSpec("qwen2", gguf="qwen2", attention=_QWEN2_ATTENTION),
    ArchSpec("qwen3", gguf="qwen3", attention=_QWEN3_ATTENTION),
    # Phi-3: q/k/v one linear (attn_qkv in the file), gate/up one (ffn_up in the file, gate rows first); a Phi-3
    # file's long-context rope factors and sliding window are not read by transformers' loader
    ArchSpec("phi3", gguf="phi3",
             attention=Attention(qkv=("qkv_proj",), gguf_qkv=("attn_qkv",), slide_every_layer=True),
             dense=DenseMLP(gate_up=("gate_up_proj",), gguf_gate_up=("ffn_up",), act="activation_fn")),
    # Gemma 2: Gemma 3 without q/k norms and with one rope; its softcaps and query scalar are the config's (a
    # GGUF's own softcap keys are not read by transformers' loader: its Gemma2Config defaults, 50 and 30, apply)
    ArchSpec("gemma2", gguf="gemma2", **_GEMMA),
    ArchSpec("gemma3_text", gguf="gemma3", rope_per_layer_type=True, attention=Attention(qk_norm=True), **_GEMMA),
    # mixtures of experts. Qwen3-MoE: Qwen3's attention, softmax → top k → renormalised (llama.cpp's rule;
    # transformers' norm_topk_prob, which its GGUF reader sets so)
    ArchSpec("qwen3_moe", gguf="qwen3moe", attention=_QWEN3_ATTENTION,
             mlp=MoEMLP(renormalise=True, renormalise_key="norm_topk_prob")),
    # Qwen2-MoE: Qwen2's attention, the top k of the softmax as they are, and a shared expert with a sigmoid gate
    ArchSpec("qwen2_moe", gguf="qwen2moe", attention=_QWEN2_ATTENTION,
             mlp=MoEMLP(renormalise=False, renormalise_key="norm_topk_prob", shared_expert=True)),
    # Mixtral: Llama's attention (and sliding window where the config sets one), the top k renormalised; its GGUF
    # files say general.architecture "llama" and hold ffn_*_exps tensors (`file_model.moe_config`)
    ArchSpec("mixtral", attention=Attention(permute_qk=True, slide_every_layer=True),
             mlp=MoEMLP(renormalise=True, experts_key="num_local_experts")),
    # gpt-oss: q/k/v/o biases, a sink logit per head, sliding and full layers alternating (layer_types), YaRN
    # rope; the router with a bias, top k of its logits then a softmax over them, experts with biases and the
    # clamped SwiGLU (the file's gate and up are split from transformers' interleaved gate_up_proj)
    ArchSpec("gpt_oss", gguf="gpt-oss", gguf_pre_mlp_norm="post_attention_norm",
             attention=Attention(bias=True, o_bias=True, sinks=True),
             mlp=MoEMLP(renormalise=False, softmax_after_topk=True, biases=True, act="swiglu_oai",
                        experts_key="num_local_experts")),
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

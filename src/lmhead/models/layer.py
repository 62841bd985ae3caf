"""One block of the lean body as the tensors its step reads: attention's, then its MLP's (dense or experts).

    Layer: norms, qkv [(H + 2·H_kv)·hd, D] (+ bias), o [D, H·hd] (+ bias), q/k norms, sinks [H] — the attention
           block;
           gate_up [2·F, D] and down [D, F] — a dense MLP; or `moe` (`models/moe.py`) — a mixture of experts

Which blocks a layer has and their options are the architecture's row (`models/arch.py`); the tensors are the
model's own (transformers' weights, shared) or a GGUF file's codes (`coded`, `moe`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from lmhead.models.coded_linear import CodedLinear
from lmhead.models.fast_linear import Int8Linear

if TYPE_CHECKING:
    from lmhead.models.moe import MoE

__all__ = ["Layer"]


@dataclass
class Layer:
    """One block's tensors (the model's own; norms' weights as the model stores them)."""

    qkv: Tensor | Int8Linear      # [(H + 2·H_kv)·hd, D]: q, k and v rows of one buffer
    qkv_bias: Tensor | None
    o: Tensor | Int8Linear        # [D, H·hd]
    gate_up: Tensor | Int8Linear | None  # [2·F, D] (None: the layer's MLP is `moe`)
    down: Tensor | Int8Linear | None     # [D, F]
    input_norm: Tensor
    post_attn_norm: Tensor | None   # sandwich norms (Gemma): after attention; else None
    pre_mlp_norm: Tensor            # Gemma: pre_feedforward_layernorm; Llama: post_attention_layernorm
    post_mlp_norm: Tensor | None    # sandwich norms only
    q_norm: Tensor | None
    k_norm: Tensor | None
    kind: str              # the layer type its rope frequencies are kept under ("full_attention", ...)
    sliding: bool
    qk_norm: Tensor | None = None   # q_norm and k_norm as one table (`LeanBody._qk_norm`), and the weights'
    qk_norm_version: tuple[int, int] | None = None  # versions it was made from
    coded: dict[str, CodedLinear] | None = None  # "qkv", "o", ... -> the same matrix as GGUF codes (`use_codes`)
    moe: MoE | None = None         # a mixture-of-experts MLP in place of gate_up and down
    o_bias: Tensor | None = None   # [D]: o's bias (gpt-oss)
    sinks: Tensor | None = None    # [H]: one logit per query head in the softmax's denominator (gpt-oss)

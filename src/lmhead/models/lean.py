"""The lean body: the transformer's forward written out over transformers' own (shared) weights, with a static
KV cache — what a decode step needs and nothing else. This module's torch forward is the specification of the step;
the C paths (`lean_native.py`) compute the same numbers in fewer calls and are tested against it.

    ids [B,T], positions [B,T] ──embedding──▶ x [B,T,D]
        ──per layer: the attention block: norm → q,k,v (one fused product) → q/k norm → rope → write k,v at the
          cache's columns → attention over the filled columns (causal, padding, sliding window) → o → (norm)
          → + residual
          → the MLP block: norm → gate,up (one fused product) → act(gate)·up → down, or a mixture of experts
          (`moe.py`: router → top k → each chosen expert over the rows that chose it) → (norm) → + residual──▶
        ──final norm──▶ hidden [B,T,D]

Why: transformers' forward spends most of a one-token step in per-module Python (hooks, its cache classes,
mask builders) rather than in the products. This module makes one pass over plain tensors: a preallocated
cache (`kv_cache.StaticCache`), masks built once per step and shared by every layer of a kind, and q/k/v and
gate/up each fused into one matrix-vector product. The fused matrices are the model's own weights: q, k and v (and
gate, up) are re-pointed to row slices of one buffer (`Parameter.data`), so `hf_model`, `Model.body` and this module
read the same memory and nothing is copied. Products run through a file's codes (`use_codes`) or, for float32
weights without them, the kernel's float32 product over the same tensors (`use_dense`, which `Model` calls: each
row summed in one order whatever the rows beside it); else oneDNN's inner product when torch has it
(`fast_linear`), else `F.linear`.

Supported: the architectures of `models/arch.py`'s table (Llama-style models — Llama, SmolLM2, Mistral, Qwen2 with
q/k/v bias, Qwen3 with q/k norms —, Phi-3, Gemma 2 and Gemma 3 text, and the mixtures of experts Qwen3-MoE,
Qwen2-MoE, Mixtral and gpt-oss); what differs between them is the table's row (`self.arch`: its attention and
MLP blocks), not a check here. A layer's tensors are a `layer.Layer`. `LeanBody.supports(hf_model)` says whether
a model is one of them; tests compare the hidden states with transformers' forward on tiny models of each family,
and greedy tokens on the packaged models. Layers with experts are blocks of the one-call C step too (their router
called back: lean_native.py); where the step does not serve, this forward runs them — attention in C
(`lmhead_attend`, gpt-oss's sinks and sliding window included), the experts in one C call (models/moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmhead.kernels import native
from lmhead.kernels.abi import ACTIVATIONS
from lmhead.models.arch import ARCHS, STATIC_ROPE, arch_of, refusal
from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.models.fast_linear import Int8Linear, onednn_available
from lmhead.models.kv_cache import LAZY_BYTES, StaticCache, cache_zeros, gather_row
from lmhead.models.layer import Layer
from lmhead.models.lean_native import NativeStep
from lmhead.models.moe import MoE

__all__ = ["LeanBody", "Layer", "StaticCache", "SUPPORTED_MODEL_TYPES", "LAZY_BYTES", "cache_zeros", "gather_row"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(ARCHS))



def _fuse(linears: list[nn.Linear]) -> tuple[Tensor, Tensor | None]:
    """One [sum(out), in] buffer holding the linears' weights; each linear's weight (and bias) is re-pointed to
    its row slice, so the model keeps working on the same numbers and no second copy exists."""
    weights = [lin.weight for lin in linears]
    if len({w.data_ptr() for w in weights}) < len(weights):
        raise ValueError("cannot fuse linears that share a weight")
    # already fused by an earlier LeanBody on this model: the slices are adjacent rows of one buffer
    first = weights[0]
    rows = sum(w.shape[0] for w in weights)
    if all(w.is_contiguous() for w in weights) and all(
            w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for w in weights):
        offsets = [w.storage_offset() for w in weights]
        expect = [offsets[0] + sum(v.numel() for v in weights[:i]) for i in range(len(weights))]
        if offsets == expect:
            fused = first.new_empty(0).set_(first.untyped_storage(), offsets[0], (rows, first.shape[1]))
            return fused, _fuse_bias(linears)
    fused = torch.cat([w.detach() for w in weights], dim=0)
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = fused[start:start + n]
        start += n
    return fused, _fuse_bias(linears)


def _activation(mlp: nn.Module, name: str):
    """The MLP's activation: its own attribute, or a mixture of experts' (its experts' or shared expert's)."""
    for owner in (mlp, getattr(mlp, "experts", None), getattr(mlp, "shared_expert", None)):
        act = getattr(owner, name, None) if owner is not None else None
        if act is not None:
            return act
    raise TypeError(f"cannot find the activation of {type(mlp).__name__} (expected .{name})")


def _hf_moe(mlp: nn.Module, arch, cfg) -> MoE | None:
    """A transformers MoE block's weights as `MoE` (the experts' [E,2F,D] and [E,D,F] tensors sliced per expert,
    shared), or None for a dense MLP."""
    spec = arch.moe
    if spec is None or not hasattr(mlp, "experts"):
        return None
    if spec.biases:
        return _hf_gpt_oss_moe(mlp, spec, cfg)
    experts, router = mlp.experts, mlp.gate
    shared = getattr(mlp, "shared_expert", None) if spec.shared_expert else None
    shared_gate_up = None if shared is None else _fuse([getattr(shared, n) for n in arch.gate_up])[0]
    return MoE(router=router.weight.detach(), gate_up=[w for w in experts.gate_up_proj.detach()],
               down=[w for w in experts.down_proj.detach()], top_k=router.top_k, renormalise=spec.renormalises(cfg),
               shared_gate_up=shared_gate_up, shared_down=None if shared is None else shared.down_proj.weight.detach(),
               shared_gate=None if shared is None else mlp.shared_expert_gate.weight.detach())


def _hf_gpt_oss_moe(mlp: nn.Module, spec, cfg) -> MoE:
    """transformers' GptOss experts as `MoE`: its gate_up_proj [E, D, 2F] holds gate and up interleaved (columns
    0, 2, … gate), so each expert's [2F, D] gate rows then up rows is a copy (as are their biases), made once;
    down_proj [E, F, D] is read transposed in place. A change of the model's expert weights after this is not
    seen by the body."""
    from lmhead.models.moe import SwigluOAI

    experts, router = mlp.experts, mlp.router
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)                     # [E, 2F, D]
    bias = experts.gate_up_proj_bias.detach()                                  # [E, 2F]
    return MoE(router=router.weight.detach(), router_bias=router.bias.detach(),
               gate_up=[torch.cat([w[0::2], w[1::2]]) for w in gate_up],
               gate_up_bias=torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1),
               down=[w.t() for w in experts.down_proj.detach()], down_bias=experts.down_proj_bias.detach(),
               top_k=router.top_k, renormalise=False, softmax_after_topk=spec.softmax_after_topk,
               act=SwigluOAI(alpha=float(cfg.swiglu_alpha), limit=float(cfg.swiglu_limit)))


def _fuse_bias(linears: list[nn.Linear]) -> Tensor | None:
    # biases are small ([out] vectors): a concatenated copy costs nothing worth sharing
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                      for lin in linears])


class LeanBody(NativeStep):
    """The body's forward over a `StaticCache`: ids [B,T] → hidden [B,T,D] after the final norm.

    Build it from a transformers causal LM (`LeanBody(hf_model)`); `new_cache(batch, capacity)` makes a
    cache; `forward(ids, positions, cache, valid)` appends T columns to the cache and returns their hidden
    states. Positions are the rope positions of each row (left-padded rows count their real tokens); `valid`
    [B,T] marks real tokens (False = padding). Same numbers as transformers' forward up to fp32 summation order.
    """

    @staticmethod
    def supports(hf_model) -> bool:
        cfg = getattr(hf_model, "config", None)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        return cfg is not None and refusal(cfg, own_rotary=True) is None

    def __init__(self, hf_model, onednn: bool | None = None, int8: bool = False) -> None:
        """`int8=True`: the four matrices of each block become int8 copies (`Int8Linear`, activations quantised
        per call) — an approximate body for the speculative draft; the embedding and norms stay shared."""
        if not self.supports(hf_model):
            model_type = getattr(getattr(hf_model, "config", None), "model_type", type(hf_model).__name__)
            why = refusal(hf_model.config.get_text_config(), own_rotary=True) \
                if hasattr(getattr(hf_model, "config", None), "get_text_config") else None
            raise ValueError(f"the lean body supports {', '.join(SUPPORTED_MODEL_TYPES)}; got {model_type!r}"
                             + (f" ({why})" if why and model_type in ARCHS else ""))
        cfg = hf_model.config.get_text_config()
        base = hf_model.base_model
        self._configure(cfg, onednn)
        self.embed = base.embed_tokens.weight
        self.embed_codes = None
        self.embed_scale = (base.embed_tokens.embed_scale.to(base.embed_tokens.weight.dtype)
                            if self.arch.scaled_embedding else None)
        self.rotary = base.rotary_emb
        if self.arch.moe is not None and self.arch.moe.biases:
            # gpt-oss's rotary module gives rows half a head wide (its rope rotates halves): the same
            # frequencies as whole rows, as the other families' modules give them
            from lmhead.models.rope import Rotary

            self.rotary = Rotary(cfg)
        self.final_norm = base.norm.weight
        # gpt-oss's experts have their own activation (`MoE.act`); the body's is the config's for the torch path
        self.act = F.silu if self.arch.moe is not None and self.arch.moe.act else \
            _activation(base.layers[0].mlp, self.arch.act)
        self.hf_blocks = list(base.layers)
        self.layers = [self._layer(block, t) for block, t in zip(base.layers, self._types, strict=True)]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        if int8:
            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    if getattr(layer, name) is not None:  # a mixture of experts keeps its experts' weights
                        setattr(layer, name, Int8Linear(getattr(layer, name)))

    def _configure(self, cfg, onednn: bool | None) -> None:
        """What the step reads from the model's config (a transformers config or `models.config.ModelConfig`)."""
        self.model_type = cfg.model_type
        self.arch = arch_of(cfg)
        if self.arch is None:
            raise ValueError(f"the lean body supports {', '.join(SUPPORTED_MODEL_TYPES)}; got {cfg.model_type!r}")
        self.config = cfg
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.arch.scaling(cfg, self.head_dim)
        self.attn_softcap = self.arch.softcap(cfg)
        self.window = getattr(cfg, "sliding_window", None)
        self._types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        self.layer_types = sorted(set(self._types))
        # the activations body_kernels.c computes (by the config's name; others run the model's own act_fn)
        act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        self.act_code = ACTIVATIONS.get(act_name)
        self.native = native.library()
        self.onednn = onednn_available() if onednn is None else onednn

    @classmethod
    def from_parts(cls, cfg, embed: Tensor | CodedLinear, layers: list[Layer], final_norm: Tensor, rotary,
                   act, embed_scale: Tensor | None = None, onednn: bool | None = None) -> LeanBody:
        """A body over tensors that are no transformers model's (`models/file_body.py`: a GGUF file's codes):
        `embed` the [V,D] embedding (float32, or a `CodedLinear` whose rows are read at each step), `layers` with
        their coded matrices (`Layer.coded`; the float32 matrices may be None: long products then dequantize
        the codes), `rotary(x, positions[, kind])` → cos, sin as transformers' rotary module, `act` the MLP's
        activation for the torch path."""
        self = cls.__new__(cls)
        self._configure(cfg, onednn)
        if isinstance(embed, CodedLinear):
            self.embed, self.embed_codes = None, embed
        else:
            self.embed, self.embed_codes = embed, None
        self.embed_scale = embed_scale
        self.rotary, self.act, self.final_norm = rotary, act, final_norm
        self.hf_blocks = None
        self.layers = layers
        self.dtype, self.device = final_norm.dtype, final_norm.device
        return self

    @property
    def width(self) -> int:
        """D, the width of the residual stream."""
        return int(self.final_norm.shape[-1])

    def embedding(self, ids: Tensor) -> Tensor:
        """ids [B,T] → the embedding rows [B,T,D] float32 (before Gemma's scale)."""
        if self.embed_codes is not None:
            return self.embed_codes.rows(ids)
        return F.embedding(ids, self.embed)

    @property
    def nbytes(self) -> int:
        """Bytes of the matrices this body owns (int8 copies, GGUF codes); 0 when it only shares the model's
        weights."""
        owned = sum(w.nbytes for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
                    if isinstance(w, Int8Linear))
        experts = sum(layer.moe.nbytes for layer in self.layers if layer.moe is not None and self.hf_blocks is None)
        return owned + experts + sum(c.nbytes for layer in self.layers for c in (layer.coded or {}).values()
                                     if not (getattr(c, "dense", False) and self.hf_blocks is not None))  # shared

    def use_codes(self, codes: dict) -> int:
        """Run the block matrices that have GGUF codes (`lmhead.models.gguf_codes`: the float32 weights exactly,
        as integer codes and group scales) through the coded kernel for decode-sized calls. Returns how many
        of the body's matrices run coded; 0 when the kernel is unavailable (no C compiler) or nothing matches."""
        from lmhead.models.gguf_codes import fuse_codes, module_codes

        if not coded_available() or not codes or self.hf_blocks is None:
            return 0
        self._descs = self._versioned = None  # the step's descriptors and version list follow the new matrices
        count = 0
        for i, (layer, block) in enumerate(zip(self.layers, self.hf_blocks, strict=True)):
            attn, mlp = block.self_attn, block.mlp
            groups = {"qkv": [(f"self_attn.{n}", getattr(attn, n)) for n in self.arch.qkv],
                      "o": [("self_attn.o_proj", attn.o_proj)]}
            if layer.moe is None:  # a mixture of experts keeps its experts' float32 weights
                groups.update({"down": [("mlp.down_proj", mlp.down_proj)],
                               "gate_up": [(f"mlp.{n}", getattr(mlp, n)) for n in self.arch.gate_up]})
            layer.coded = {}
            for name, parts in groups.items():
                found = [module_codes(codes, f"layers.{i}.{path}", lin.weight) for path, lin in parts]
                if any(c is None for c in found):
                    continue
                fused = fuse_codes(found)
                layer.coded[name] = CodedLinear(fused.codes, fused.scale, fused.offset, getattr(layer, name),
                                                sources=tuple(lin.weight for _, lin in parts))
                count += len(parts)
        return count

    def use_dense(self) -> int:
        """Run the block matrices of a float32 model without file codes through the kernel's float32 product
        (`CodedLinear.dense16` over the model's own weights: shared, not copied), every call of them, long ones
        included — so a row's product is the same bits whatever rows a call multiplies beside it (a server round,
        a prefill chunk, a draft's verification), as a file's codes are, where oneDNN's GEMM sums a row in an order
        that depends on the number of rows. Returns how many of the body's matrices run so; 0 where the kernel is
        not built."""
        if not coded_available() or self.hf_blocks is None:
            return 0
        self._descs = self._versioned = None  # the step's descriptors and version list follow the new matrices
        count = 0
        for layer in self.layers:
            if layer.coded:  # a file's codes, or this call's before
                count += len(layer.coded) if all(getattr(c, "dense", False) for c in layer.coded.values()) else 0
                continue
            weights = {name: getattr(layer, name) for name in ("qkv", "o", "gate_up", "down")}
            if any(not isinstance(w, Tensor) or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2
                   for name, w in weights.items() if w is not None or name in ("qkv", "o")):
                continue
            layer.coded = {name: CodedLinear.dense16(w.detach()) for name, w in weights.items() if w is not None}
            count += len(layer.coded)
        return count

    def _layer(self, block, kind: str) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        arch = self.arch
        qkv, qkv_bias = _fuse([getattr(attn, n) for n in arch.qkv])
        moe = _hf_moe(mlp, arch, self.config)
        gate_up, down = (None, None) if moe is not None else (_fuse([getattr(mlp, n) for n in arch.gate_up])[0],
                                                              mlp.down_proj.weight)
        sandwich = arch.sandwich_norms
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3, Gemma 3
        return Layer(
            qkv=qkv, qkv_bias=qkv_bias, o=attn.o_proj.weight, gate_up=gate_up, down=down, moe=moe,
            input_norm=block.input_layernorm.weight,
            post_attn_norm=block.post_attention_layernorm.weight if sandwich else None,
            pre_mlp_norm=(block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm).weight,
            post_mlp_norm=block.post_feedforward_layernorm.weight if sandwich else None,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            kind=kind, sliding=arch.sliding(kind, self.window),
            o_bias=attn.o_proj.bias if arch.attention.o_bias else None,
            sinks=getattr(attn, "sinks", None) if arch.attention.sinks else None)

    # --- pieces ---------------------------------------------------------------------------------------------

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        """The model's RMSNorm with weight `w` [D] (or one row per head, [heads, D]) on x [..., D]."""
        lib = self._native(x, w)
        if lib is not None:
            x = x.contiguous()
            y = torch.empty_like(x)
            lib.lmhead_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                                w.numel() // w.shape[-1], self.eps, int(self.arch.unit_offset_norm))
            return y
        # Gemma scales by (1 + w) after normalising in fp32 — y + y·w, one op; Llama multiplies w by the
        # normalised x. A decode step is dominated by per-op dispatch, so every op saved counts.
        y = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), None, self.eps)
        if self.arch.unit_offset_norm:
            y = torch.addcmul(y, y, w)
            return y if y.dtype == x.dtype else y.type_as(x)
        return w * (y if y.dtype == x.dtype else y.type_as(x))

    def _add_norm(self, x: Tensor, a: Tensor, w_post: Tensor | None, w_pre: Tensor) -> tuple[Tensor, Tensor]:
        """The residual step around a block's branch: x' = x + norm(a, w_post) (x + a without a post-norm), and
        the next norm h = norm(x', w_pre) → (x', h), both [B,T,D]."""
        lib = self._native(x, a, w_pre, *(() if w_post is None else (w_post,)))
        if lib is None:
            x = x + (a if w_post is None else self.norm(a, w_post))
            return x, self.norm(x, w_pre)
        x, a = x.contiguous(), a.contiguous()
        out, h = torch.empty_like(x), torch.empty_like(x)
        lib.lmhead_add_norm(x.data_ptr(), a.data_ptr(), None if w_post is None else w_post.data_ptr(),
                            w_pre.data_ptr(), out.data_ptr(), h.data_ptr(), x.numel() // x.shape[-1],
                            x.shape[-1], self.eps, int(self.arch.unit_offset_norm))
        return out, h

    def _gated(self, gate_up: Tensor) -> Tensor:
        """act(gate)·up for gate_up [B,T,2F] = [gate | up] → [B,T,F]."""
        lib = self._native(gate_up) if self.act_code is not None else None
        if lib is None:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act(gate) * up
        gate_up = gate_up.contiguous()
        f = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], f))
        lib.lmhead_gated(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], f, self.act_code)
        return out

    def _qk_norm(self, layer: Layer) -> Tensor:
        """The q and k norms' weights as one [H+H_kv, hd] table for `norm` on the side-by-side heads. Derived
        from the model's weights, so it is rebuilt when either changes in place (an optimizer step)."""
        version = (layer.q_norm._version, layer.k_norm._version)
        if layer.qk_norm is None or layer.qk_norm_version != version:
            layer.qk_norm = torch.cat([layer.q_norm.detach().expand(self.heads, -1),
                                       layer.k_norm.detach().expand(self.kv_heads, -1)])
            layer.qk_norm_version = version
        return layer.qk_norm

    # decode-sized calls (rows ≤ this: a step of up to 48 rows, a short prompt) take the coded kernel; a long
    # prompt's prefill runs oneDNN's float32 GEMM over the float32 weights where the model keeps them. Measured on
    # Gemma 3 (2 cores): a step of 32 rows 157 ms with oneDNN, 105 ms with the codes; a prefill of 32 tokens 125 /
    # 98 ms, of 64 185 / 198 ms
    CODED_MAX_ROWS = 48
    # a model read from its file keeps no float32 weights: every product reads the codes, a long one in pieces of
    # this many rows (the kernel's per-row buffers stay small; a row's value does not depend on its piece), so that
    # a position is the same bits prefilled or decoded, alone or in a batch — rebuilding the float32 matrix for
    # each long product cost more than the kernel's product itself
    CODED_PIECE_ROWS = 256

    def _product(self, x: Tensor, layer: Layer, name: str, b: Tensor | None = None) -> Tensor:
        """x [B,T,in] through the layer's matrix `name` ("qkv", "o", "gate_up", "down")."""
        coded = layer.coded.get(name) if layer.coded else None
        weight = getattr(layer, name)
        rows = x.shape[:-1].numel()
        dense = getattr(coded, "dense", False)  # `use_dense`: the kernel over the model's own float32 weights
        if dense and weight is not None and torch.is_grad_enabled() and weight.requires_grad:
            coded = None  # autograd may want the weight's gradient: the kernel has no backward
        # a dense matrix over the model's own float32 weights (`use_dense`) takes every call, long ones too
        if coded is not None and (rows <= self.CODED_MAX_ROWS or weight is None or dense):
            if rows > self.CODED_PIECE_ROWS:
                flat = x.reshape(rows, x.shape[-1])
                y = torch.cat([coded(flat[i:i + self.CODED_PIECE_ROWS])
                               for i in range(0, rows, self.CODED_PIECE_ROWS)]).view(*x.shape[:-1], -1)
            else:
                y = coded(x)
            return y if b is None else y + b
        return self._linear(x, weight, b)

    def _mlp(self, h: Tensor, layer: Layer) -> Tensor:
        """The layer's MLP on h [B,T,D]: down(act(gate)·up), or its mixture of experts (`models/moe.py`)."""
        if layer.moe is not None:
            # where `_gated` is the C lmhead_gated, the chosen experts' products, activation and sum are one C call
            return layer.moe(h, self._gated, self.act_code if self._native(h) is not None else None)
        return self._product(self._gated(self._product(h, layer, "gate_up")), layer, "down")

    def _linear(self, x: Tensor, w: Tensor | Int8Linear, b: Tensor | None = None) -> Tensor:
        if isinstance(w, Int8Linear):
            y = w(x)
            return y if b is None else y + b
        if self.onednn and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return F.linear(x, w, b)

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        """x·cos + rotate_half(x)·sin on x [..., hd], with rotate_half(x) = (−x₂, x₁) written as the swapped
        halves (x₂, x₁) times signed_sin = (−sin₁, sin₂), made once per step (`_rotary`)."""
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, signed_sin)

    def _masks(self, cache: StaticCache, start: int, t: int) -> dict[bool, Tensor | None]:
        """Additive masks [B,1,1,T,L] (0 keep, the dtype's minimum drop — finite, as transformers', so that a
        padding query with nothing to attend to gives numbers, not NaN) over the L = start+T filled columns, one
        per kind of layer (sliding or not); None where nothing is dropped."""
        length = start + t
        if t == 1:  # decode: every filled column is at or before the query's, so only validity and the window
            return self._step_masks(cache, start)
        q = torch.arange(start, length, device=cache.valid.device)[:, None]   # [T,1] query columns
        kv = torch.arange(length, device=cache.valid.device)[None, :]         # [1,L] key columns
        causal = (kv <= q)[None, None, None]                                  # [1,1,1,T,L]
        allowed = cache.valid[:, None, None, None, :length] & causal          # [B,1,1,T,L]
        out: dict[bool, Tensor | None] = {}
        for sliding in {layer.sliding for layer in self.layers}:
            keep = allowed
            if sliding:  # positions, not columns: q_pos − kv_pos < window (transformers' rule per row)
                pos = cache.positions[:, :length]
                near = (pos[:, start:, None] - pos[:, None, :]) < self.window        # [B,T,L]
                keep = keep & near[:, None, None]
            if bool(keep.all()):
                out[sliding] = None
                continue
            mask = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
            out[sliding] = mask.masked_fill_(~keep, torch.finfo(torch.float32).min)
        return out

    def _step_masks(self, cache: StaticCache, start: int) -> dict[bool, Tensor | None]:
        """`_masks` for one new column (T = 1): the same masks from fewer operations."""
        length = start + 1
        allowed = cache.valid[:, :length]                                     # [B,L]
        out: dict[bool, Tensor | None] = {}
        for sliding in {layer.sliding for layer in self.layers}:
            keep = allowed
            if sliding:
                pos = cache.positions[:, :length]
                keep = keep & ((pos[:, start:] - pos) < self.window)
            if bool(keep.all()):
                out[sliding] = None
                continue
            mask = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
            out[sliding] = mask.masked_fill_(~keep, torch.finfo(torch.float32).min)[:, None, None, None]
        return out

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                sinks: Tensor | None = None) -> Tensor:
        """q [B,H,T,hd] against keys/values [B,H_kv,L,hd] → [B,T,H·hd]; the H/H_kv query heads that share a
        key head are one batched product (no repeat of the cache). `sinks` [H] (gpt-oss): one more logit per head
        in the softmax, dropped after it (its probability goes to no value), as transformers' GptOss computes it
        (the row's maximum subtracted first)."""
        b, h, t, hd = q.shape
        g = h // self.kv_heads
        qg = q.reshape(b, self.kv_heads, g * t, hd)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scaling     # [B,H_kv,g·T,L]
        if self.attn_softcap is not None:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        if mask is not None:
            scores = (scores.view(b, self.kv_heads, g, t, -1) + mask).view(b, self.kv_heads, g * t, -1)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            sink = sinks.to(scores.dtype).view(1, self.kv_heads, g, 1, 1).expand(b, -1, -1, t, 1)
            combined = torch.cat([scores, sink.reshape(b, self.kv_heads, g * t, 1)], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(q.dtype)
        out = torch.matmul(probs, values)                                    # [B,H_kv,g·T,hd]
        return out.view(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)

    # --- the step -------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, capacity: int) -> StaticCache:
        return StaticCache(len(self.layers), batch, self.kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @torch.no_grad()  # not inference_mode: callers may feed the result to autograd code
    def forward(self, ids: Tensor, positions: Tensor, cache: StaticCache, valid: Tensor | None = None,
                layers: list[Tensor] | None = None) -> Tensor:
        """Append T columns for `ids` [B,T] at rope `positions` [B,T] to `cache`; → hidden [B,T,D].

        `layers`: a list that receives the residual stream [B,T,D] as transformers' `output_hidden_states`
        gives it — the embedding output, then the output of every block but the last (the logit lens)."""
        b, t = ids.shape
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(f"the cache holds {cache.capacity} columns; {start} used, {t} more asked")
        if layers is None:
            h = self._decode_native(ids, positions, cache, valid)
            if h is not None:
                return h
        cache.valid[:, start:start + t] = True if valid is None else valid
        cache.positions[:, start:start + t] = positions
        cache.tokens[:, start:start + t] = ids
        cache.length = start + t
        try:
            return self._columns(ids, positions, cache, start, layers)
        except BaseException:
            cache.length = start  # a step that failed (a router's error, no memory) leaves the cache as it was
            raise

    def _columns(self, ids: Tensor, positions: Tensor, cache: StaticCache, start: int,
                 layers: list[Tensor] | None) -> Tensor:
        """`forward`'s blocks for the columns its bookkeeping has just added to `cache` → hidden [B,T,D]."""
        b, t = ids.shape
        masks = self._masks(cache, start, t)
        x = self.embedding(ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {kind: self._rotary(x, positions, kind) for kind in self.layer_types}
        if layers is None:
            h = self._step_native(x, rope, masks, cache, start)
            if h is not None:
                return h
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.norm(x, self.layers[0].input_norm)
        for i, layer in enumerate(self.layers):
            if layers is not None:
                layers.append(x)
            cos, sin = rope[layer.kind]
            qkv = self._product(h, layer, "qkv", layer.qkv_bias)
            # q and k heads side by side [B,T,H+H_kv,hd]: their norms and rope are one op each
            qk = qkv[..., :nq + nkv].unflatten(-1, (self.heads + self.kv_heads, self.head_dim))
            if layer.q_norm is not None:
                qk = self.norm(qk, self._qk_norm(layer))
            a = self._attention_native(qk, qkv, cos, sin, cache, i, start, masks[layer.sliding], layer.sinks)
            if a is None:
                cache.materialise()  # torch reads each row's own columns (shared runs copied in: StaticCache)
                qk = self._rope(qk, cos, sin).transpose(1, 2)
                q, k = qk[:, :self.heads], qk[:, self.heads:]
                v = qkv[..., nq + nkv:].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                cache.keys[i, :, :, start:start + t] = k
                cache.values[i, :, :, start:start + t] = v
                a = self._attend(q, cache.keys[i, :, :, :start + t], cache.values[i, :, :, :start + t],
                                 masks[layer.sliding], layer.sinks)
            a = self._product(a, layer, "o", layer.o_bias)
            x, h = self._add_norm(x, a, layer.post_attn_norm, layer.pre_mlp_norm)
            m = self._mlp(h, layer)
            # the next block's input norm (the final norm after the last block) in the same pass
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x, h = self._add_norm(x, m, layer.post_mlp_norm, following)
        return h

    __call__ = forward

    def _rotary(self, x: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """cos and the signed sin of `_rope`, [B,T,1,hd] (broadcast over heads), from the model's own rotary
        module (its frequencies and scaling). Where those do not change with the sequence, rows of a table the
        module made once for positions 0..P-1 (each entry is the same element-wise product and cos/sin as a
        per-step call: decode no longer calls the module every step)."""
        types = getattr(self.rotary, "rope_type", "default")
        # rope types outside STATIC_ROPE change with the sequence: the module is called at every step
        static = all(t in STATIC_ROPE for t in (types.values() if isinstance(types, dict) else [types]))
        if not static or positions.numel() == 0 or int(positions.min()) < 0:
            return self._rotary_rows(x, positions, kind)
        tables = self.__dict__.setdefault("_rope_tables", {})
        key = (kind, x.dtype, x.device)
        need = int(positions.max()) + 1
        if key not in tables or tables[key][0].shape[0] < need:
            size = max(need, 2 * tables[key][0].shape[0] if key in tables else 512)
            cos, signed = self._rotary_rows(x, torch.arange(size, device=positions.device)[None], kind)
            tables[key] = (cos[0, :, 0], signed[0, :, 0])                    # [P,hd]
        cos, signed = tables[key]
        return cos[positions].unsqueeze(2), signed[positions].unsqueeze(2)

    def _rotary_rows(self, x: Tensor, positions: Tensor, kind: str) -> tuple[Tensor, Tensor]:
        """`_rotary` from one call of the model's rotary module for `positions` [B,T]."""
        if self.arch.rope_per_layer_type:
            cos, sin = self.rotary(x, positions, kind)
        else:
            cos, sin = self.rotary(x, positions)
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.unsqueeze(2), signed.unsqueeze(2)

"""The lean body: the transformer's forward written out over transformers' own (shared) weights, with a static
KV cache — what a decode step needs and nothing else.

    ids [B,T], positions [B,T] ──embedding──▶ x [B,T,D]
        ──per layer: norm → q,k,v (one fused product) → q/k norm → rope → write k,v at the cache's columns
          → attention over the filled columns (causal, padding, sliding window) → o → (norm) → + residual
          → norm → gate,up (one fused product) → act(gate)·up → down → (norm) → + residual──▶
        ──final norm──▶ hidden [B,T,D]

Why: transformers' forward spends most of a one-token step in per-module Python (hooks, its cache classes,
mask builders) rather than in the products. This module makes one pass over plain tensors: a preallocated
cache (`StaticCache`), masks built once per step and shared by every layer of a kind, and q/k/v and gate/up
each fused into one matrix-vector product. The fused matrices are the model's own weights: q, k and v (and gate,
up) are re-pointed to row slices of one buffer (`Parameter.data`), so `hf_model`, `Model.body` and this module
read the same memory and nothing is copied. Products run through oneDNN's inner product when torch has it
(`fast_linear`), else `F.linear`.

Supported: the architectures of `models/arch.py`'s table (Llama-style models — Llama, SmolLM2, Mistral, Qwen2 with
q/k/v bias, Qwen3 with q/k norms —, Phi-3, Gemma 2 and Gemma 3 text); what differs between them is the table's row
(`self.arch`), not a check here. `LeanBody.supports(hf_model)` says whether a model is one of them; tests compare
the hidden states with transformers' forward on tiny models of each family, and greedy tokens on the packaged
models.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmhead.kernels import native
from lmhead.models.arch import ARCHS, STATIC_ROPE, arch_of, refusal
from lmhead.models.coded_linear import CodedLinear, coded_available
from lmhead.models.fast_linear import Int8Linear, onednn_available

__all__ = ["LeanBody", "StaticCache", "SUPPORTED_MODEL_TYPES", "LAZY_BYTES", "cache_zeros", "gather_row"]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(ARCHS))


LAZY_BYTES = 1 << 20  # cache tensors from this size on are anonymous mappings (`cache_zeros`)


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> Tensor:
    """A zeroed tensor of `shape` for a cache. On the CPU, from LAZY_BYTES on, an anonymous memory mapping: the
    kernel gives each page, zeroed, when it is first touched, so the columns a row never writes cost neither the
    time to clear them nor memory. A short row merged beside a long one holds mostly such columns (left of its
    own): attention's spans skip them (body_kernels.c) and the torch path reads them as zeros."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class StaticCache:
    """A preallocated KV cache: keys and values [layers, B, H_kv, capacity, head_dim], filled left to right.

    Every row writes the same columns (left padding keeps rows aligned); `valid` [B, capacity] marks the
    columns holding a real token of that row and `positions` [B, capacity] its rope position (the sliding
    window is measured in positions, so a column left invalid in one row — a draft token that row rejected
    while another row accepted its own — does not narrow that row's window). `length` is the number of filled
    columns: speculative decoding rolls back by lowering it (`truncate`) or by `invalidate`-ing one row's
    columns; finished rows are dropped with `select`.

    A cache may be rows [a, b) of a larger one (`view`): its tensors share that one's memory, each layer's keys
    (values) one contiguous block `layer_stride` numbers from the next. A prompt joining a running batch is
    prefilled so, straight into the rows it will have in the merged cache (`decode.engine.Decoder.begin_join`).
    What a column holds where its row's `valid` is False is never read as a token's: masks drop it.
    """

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.keys = cache_zeros(shape, dtype, device)
        self.values = cache_zeros(shape, dtype, device)
        self.valid = cache_zeros((batch, capacity), torch.bool, device)
        self.positions = cache_zeros((batch, capacity), torch.long, device)
        self.tokens = cache_zeros((batch, capacity), torch.long, device)
        self.length = 0
        # the LeanBody step descriptors whose weights were found unchanged when this cache first used them
        self.checked: object | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]

    @property
    def layer_stride(self) -> int:
        """Numbers between one layer's keys (values) and the next's."""
        return self.keys.stride(0)

    def in_blocks(self) -> bool:
        """Whether each layer's keys and values are one contiguous block, both at `layer_stride` (what the C step
        reads: a whole cache, or a `view`'s rows)."""
        k, v = self.keys, self.values
        return k.stride(0) == v.stride(0) and k[0].is_contiguous() and v[0].is_contiguous()

    def get_seq_length(self) -> int:
        return self.length

    def view(self, start: int, stop: int) -> StaticCache:
        """Rows [start, stop) of this cache as a cache of their own, sharing its memory (and, for now, its
        length): what one writes, the other reads."""
        if not 0 <= start <= stop <= self.batch:
            raise ValueError(f"rows must be within [0, {self.batch}], got [{start}, {stop})")
        out = StaticCache.__new__(StaticCache)
        out.keys, out.values = self.keys[:, start:stop], self.values[:, start:stop]
        out.valid, out.positions, out.tokens = (t[start:stop] for t in (self.valid, self.positions, self.tokens))
        out.length, out.checked = self.length, None
        return out

    def first_columns(self) -> Tensor:
        """[B] each row's first valid column (`length` for a row without any): its columns are within
        [first, length)."""
        valid = self.valid[:, :self.length]
        if self.length == 0:
            return torch.zeros(self.batch, dtype=torch.long, device=valid.device)
        first = valid.to(torch.uint8).argmax(dim=1)
        return torch.where(valid.any(dim=1), first, self.length)

    def truncate(self, length: int) -> None:
        """Forget every column from `length` on (their contents are overwritten by the next writes)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be in [0, {self.length}], got {length}")
        if length < self.length:
            self.valid[:, length:self.length] = False
        self.length = length

    def invalidate(self, row: int, start: int) -> None:
        """Row `row` forgets its columns from `start` to `length` (another row still uses them)."""
        self.valid[row, start:self.length] = False

    def compact(self) -> None:
        """Move each row's valid columns to the right end of the first `m` columns (m = the most any row
        holds), in order, and set `length = m`: the holes that rejected drafts leave are given back. Masks
        use validity, order and positions only, so attention is unchanged."""
        counts = self.valid[:, :self.length].sum(dim=1)
        m = int(counts.max()) if counts.numel() else 0
        layers, batch, kv_heads, capacity, head_dim = self.keys.shape
        out = StaticCache(layers, batch, kv_heads, head_dim, capacity, self.keys.dtype, self.keys.device)
        for r in range(batch):
            gather_row(out, r, self, r, m)
        self.keys, self.values, self.valid, self.positions, self.tokens = (
            out.keys, out.values, out.valid, out.positions, out.tokens)
        self.length = m

    def select(self, rows: Tensor) -> None:
        """Keep only the batch rows `rows` [B'] (e.g. drop finished rows). Rows kept in order stay in this
        cache's memory: a run of rows is a narrower view of it, and otherwise the rows on the side that holds
        fewer columns move next to the others (each its columns [first, length) only), so a row leaving costs
        at most what the rows on one side of it hold — not a copy of every row's whole capacity."""
        keep = [int(r) for r in rows.tolist()]
        n = len(keep)
        if n and any(b <= a for a, b in zip(keep, keep[1:], strict=False)):  # reordered: a copy of each row
            for name in ("keys", "values"):
                setattr(self, name, getattr(self, name).index_select(1, rows))
            for name in ("valid", "positions", "tokens"):
                setattr(self, name, getattr(self, name).index_select(0, rows))
            return
        if not n:
            self._narrow(0, 0)
            return
        first = self.first_columns().tolist()
        left = [(k, keep[0] + i) for i, k in enumerate(keep)]                  # (from, to), first row stays
        right = [(k, keep[-1] - (n - 1 - i)) for i, k in enumerate(keep)]     # last row stays
        cost = lambda moves: sum(self.length - first[a] for a, b in moves if a != b)  # noqa: E731
        moves, start = (left, keep[0]) if cost(left) <= cost(right) else (right[::-1], keep[-1] - n + 1)
        for a, b in moves:  # left: upwards in order, right: downwards from the last (never onto an unmoved row)
            if a != b:
                self._move_row(a, b, first[a])
        self._narrow(start, start + n)

    def _move_row(self, src: int, dst: int, first: int) -> None:
        """Row `src`'s columns [first, length) and its whole validity, positions and ids into row `dst`."""
        for t in (self.keys, self.values):
            t[:, dst, :, first:self.length] = t[:, src, :, first:self.length]
        for t in (self.valid, self.positions, self.tokens):
            t[dst] = t[src]

    def _narrow(self, start: int, stop: int) -> None:
        self.keys, self.values = self.keys[:, start:stop], self.values[:, start:stop]
        self.valid, self.positions, self.tokens = (t[start:stop] for t in (self.valid, self.positions, self.tokens))


def gather_row(dst: StaticCache, i: int, src: StaticCache, r: int, end: int) -> int:
    """Row r of `src`'s valid columns, in order, into row i of `dst` at its columns [end − n, end) → n (dst's row i
    must hold nothing: zeros and not valid, as a new cache's rows). One slice where the columns are one run (a
    prompt and the tokens after it), else a gather (holes of rejected drafts)."""
    cols = src.valid[r, :src.length].nonzero().squeeze(1)
    n = cols.numel()
    if n == 0:
        return 0
    lo, hi = int(cols[0]), int(cols[-1]) + 1
    pick = slice(lo, hi) if hi - lo == n else cols
    dst.keys[:, i, :, end - n:end] = src.keys[:, r, :, pick]
    dst.values[:, i, :, end - n:end] = src.values[:, r, :, pick]
    dst.positions[i, end - n:end] = src.positions[r, pick]
    dst.tokens[i, end - n:end] = src.tokens[r, pick]
    dst.valid[i, end - n:end] = True
    return n


@dataclass
class Layer:
    """One block's tensors (the model's own; norms' weights as the model stores them)."""

    qkv: Tensor | Int8Linear      # [(H + 2·H_kv)·hd, D]: q, k and v rows of one buffer
    qkv_bias: Tensor | None
    o: Tensor | Int8Linear        # [D, H·hd]
    gate_up: Tensor | Int8Linear  # [2·F, D]
    down: Tensor | Int8Linear     # [D, F]
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


def _fuse_bias(linears: list[nn.Linear]) -> Tensor | None:
    # biases are small ([out] vectors): a concatenated copy costs nothing worth sharing
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0])
                      for lin in linears])


class LeanBody:
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
        self.final_norm = base.norm.weight
        self.act = getattr(base.layers[0].mlp, self.arch.act)
        self.hf_blocks = list(base.layers)
        self.layers = [self._layer(block, t) for block, t in zip(base.layers, self._types, strict=True)]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        if int8:
            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
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
        self.act_code = {"gelu_pytorch_tanh": 0, "silu": 1}.get(act_name)
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
        return owned + sum(c.nbytes for layer in self.layers for c in (layer.coded or {}).values())

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
                      "o": [("self_attn.o_proj", attn.o_proj)], "down": [("mlp.down_proj", mlp.down_proj)],
                      "gate_up": [(f"mlp.{n}", getattr(mlp, n)) for n in self.arch.gate_up]}
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

    def _layer(self, block, kind: str) -> Layer:
        attn, mlp = block.self_attn, block.mlp
        arch = self.arch
        qkv, qkv_bias = _fuse([getattr(attn, n) for n in arch.qkv])
        gate_up, _ = _fuse([getattr(mlp, n) for n in arch.gate_up])
        sandwich = arch.sandwich_norms
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3, Gemma 3
        return Layer(
            qkv=qkv, qkv_bias=qkv_bias, o=attn.o_proj.weight, gate_up=gate_up, down=mlp.down_proj.weight,
            input_norm=block.input_layernorm.weight,
            post_attn_norm=block.post_attention_layernorm.weight if sandwich else None,
            pre_mlp_norm=(block.pre_feedforward_layernorm if sandwich else block.post_attention_layernorm).weight,
            post_mlp_norm=block.post_feedforward_layernorm.weight if sandwich else None,
            q_norm=None if q_norm is None else q_norm.weight, k_norm=None if k_norm is None else k_norm.weight,
            kind=kind, sliding=arch.sliding(kind, self.window))

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

    def _native(self, *tensors: Tensor):
        """The C library for the element-wise work (`kernels/native.py`), or None: not built, autograd recording
        (callers may differentiate through the result), or tensors that are not float32 on the CPU."""
        if self.native is None or torch.is_grad_enabled():
            return None
        for t in tensors:
            if t.dtype != torch.float32 or t.device.type != "cpu":
                return None
        return self.native

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

    def _step_descs(self):
        """The layers as `native.LayerDesc`s for `lmhead_step` (built once; None when a block matrix has no
        codes), and the tensors they point into (kept alive with them)."""
        if getattr(self, "_descs", None) is None:
            if not all(layer.coded and len(layer.coded) == 4 for layer in self.layers):
                return None
            keep: list[Tensor] = []

            def ptr(t: Tensor | None) -> int | None:
                if t is None:
                    return None
                t = t.detach().contiguous()
                keep.append(t)
                return t.data_ptr()

            def mat(c: CodedLinear) -> native.MatDesc:
                return native.MatDesc(ptr(c.codes), ptr(c.scale), ptr(c.offset), c.group, c.out_features,
                                      c.in_features, c.flags)

            descs = (native.LayerDesc * len(self.layers))()
            for d, layer in zip(descs, self.layers, strict=True):
                d.qkv, d.o = mat(layer.coded["qkv"]), mat(layer.coded["o"])
                d.gate_up, d.down = mat(layer.coded["gate_up"]), mat(layer.coded["down"])
                d.qkv_bias, d.input_norm = ptr(layer.qkv_bias), ptr(layer.input_norm)
                d.post_attn_norm, d.pre_mlp_norm = ptr(layer.post_attn_norm), ptr(layer.pre_mlp_norm)
                d.post_mlp_norm = ptr(layer.post_mlp_norm)
                d.qk_norm = ptr(self._qk_norm(layer)) if layer.q_norm is not None else None
                d.rope, d.sliding = self.layer_types.index(layer.kind), int(layer.sliding)
            keep.append(self.final_norm.detach())
            self._descs = (descs, keep, self._weight_versions())
        return self._descs

    def _weight_versions(self) -> tuple[int, ...]:
        """The versions of every tensor `lmhead_step` reads (norms and codes' sources): a change in place
        rebuilds its descriptors, or — for the coded matrices — sends the step down the torch path."""
        tensors = self.__dict__.get("_versioned")
        if tensors is None:  # the list is fixed once the layers are built; their versions are read every step
            tensors = [self.final_norm]
            for layer in self.layers:
                tensors += [t for t in (layer.input_norm, layer.post_attn_norm, layer.pre_mlp_norm,
                                        layer.post_mlp_norm, layer.q_norm, layer.k_norm, layer.qkv_bias)
                            if t is not None]
                for c in (layer.coded or {}).values():
                    tensors += list(c.sources)
            self._versioned = tensors
        return tuple([t._version for t in tensors])

    def _checked_descs(self, cache: StaticCache, rows: int):
        """`_step_descs()` for a step of `rows` new tokens on `cache`, or None where the coded step must not run (an
        activation it does not compute, more rows than it takes, a cache not in one piece, a matrix without codes,
        or codes that no longer give their weights back)."""
        if (self.act_code is None or rows > self.CODED_MAX_ROWS
                or not cache.in_blocks()):
            return None
        descs = self._step_descs()
        # the weights' versions are read once per cache (a generation), not every step: reading ~270 tensors'
        # versions after a step has streamed the weights through the caches cost ~0.3 ms per token; a weight
        # changed in place during a generation is seen by the next one
        if descs is not None and cache.checked is not descs:
            if descs[2] != self._weight_versions():
                self._descs = None  # norms changed in place: rebuild
                descs = self._step_descs()
            # codes that no longer give their weights back: the torch path, at every step of this cache (the
            # rebuilt descriptors record the new versions, so their check alone would pass from the next step)
            if descs is not None and not all(c.current() for layer in self.layers for c in layer.coded.values()):
                return None
            cache.checked = descs
        return descs

    def _step_scratch(self, rows: int) -> int:
        """Floats of `lmhead_step`'s scratch for `rows` new tokens."""
        hd, heads, kv = self.head_dim, self.heads, self.kv_heads
        f, d = self.layers[0].coded["down"].in_features, self.width
        return rows * ((heads + 2 * kv) * hd + (heads + kv) * hd + heads * hd + 2 * d + 3 * f)

    def _step_args(self, descs, cache: StaticCache, start: int, b: int, t: int, x: Tensor, h: Tensor,
                   scratch: Tensor) -> native.StepArgs:
        """`lmhead_step`'s arguments for b·t new tokens at column `start` of `cache` (x, h [b·t, D] and scratch
        float32, contiguous), less its cos, sin and masks."""
        return native.StepArgs(
            layers=ctypes.addressof(descs[0]), final_norm=self.final_norm.data_ptr(), x=x.data_ptr(), h=h.data_ptr(),
            keys=cache.keys.data_ptr(), values=cache.values.data_ptr(), scratch=scratch.data_ptr(),
            n_layers=len(self.layers), layer_stride=cache.layer_stride, B=b, T=t, D=self.width, H=self.heads,
            Hkv=self.kv_heads, hd=self.head_dim, F=self.layers[0].coded["down"].in_features, cap=cache.capacity,
            start=start, eps=self.eps, scaling=self.scaling, softcap=self.attn_softcap or 0.0,
            plus_one=int(self.arch.unit_offset_norm), act=self.act_code, threads=torch.get_num_threads())

    def _step_native(self, x: Tensor, rope: dict, masks: dict, cache: StaticCache, start: int) -> Tensor | None:
        """Every block in one C call (`lmhead_step`) when all matrices read codes → hidden [B,T,D], else None."""
        lib = self._native(x)
        b, t = x.shape[:2]
        descs = None if lib is None else self._checked_descs(cache, b * t)
        if descs is None:
            return None
        kinds = [rope[kind] for kind in self.layer_types]
        cos = [c.contiguous() for c, _ in kinds]
        sin = [s.contiguous() for _, s in kinds]
        mask_list = [None if masks.get(flag) is None else masks[flag].contiguous() for flag in (False, True)]
        arr = lambda ts: (ctypes.c_void_p * len(ts))(*[None if v is None else v.data_ptr() for v in ts])  # noqa: E731
        cos_ptrs, sin_ptrs, mask_ptrs = arr(cos), arr(sin), arr(mask_list)  # held: the call reads them
        scratch = x.new_empty(self._step_scratch(b * t))
        x = x.contiguous().clone()
        h = torch.empty_like(x)
        args = self._step_args(descs, cache, start, b, t, x, h, scratch)
        args.cos, args.sin = ctypes.addressof(cos_ptrs), ctypes.addressof(sin_ptrs)
        args.masks = ctypes.addressof(mask_ptrs)
        rc = lib.lmhead_step(args)
        if rc != 0:
            raise MemoryError("lmhead_step could not allocate its buffers")
        return h

    def _decode_native(self, ids: Tensor, positions: Tensor, cache: StaticCache, valid: Tensor | None
                       ) -> Tensor | None:
        """`forward`'s whole call in C (`lmhead_decode`: the cache's bookkeeping, the embedding, the rope rows
        and the masks, then `lmhead_step`) → hidden [B,T,D]; None where it does not serve (then nothing has been
        written and the general path runs): the step's own conditions, rope tables not made yet or too short
        for a position, an id outside the vocabulary, tensors of another dtype or layout. Why: after a step
        has streamed the weights through the caches, each torch operation around it costs 50–300 µs
        (decode_kernels.c), ~1 ms of a 10 ms step."""
        lib = self._native(self.final_norm)
        b, t = ids.shape
        if lib is None or (self.embed is not None and not self.embed.is_contiguous()):
            return None
        tables = self.__dict__.get("_rope_tables", {})
        rows_tables = [tables.get((kind, self.dtype, self.device)) for kind in self.layer_types]
        if any(tb is None for tb in rows_tables):
            return None  # made by the general path's first call (`_rotary`), which checks the rope type
        table_rows = min(tb[0].shape[0] for tb in rows_tables)
        for tensor, dtype in ((ids, torch.long), (positions, torch.long), (cache.valid, torch.bool),
                              (cache.positions, torch.long), (cache.tokens, torch.long)):
            if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
                return None
        if valid is not None and (valid.dtype != torch.bool or valid.shape != ids.shape or not valid.is_contiguous()):
            return None
        if positions.shape != ids.shape:
            return None
        descs = self._checked_descs(cache, b * t)
        if descs is None:
            return None
        start, cap, d, rows = cache.length, cache.capacity, self.width, b * t
        hd = self.head_dim
        key = (rows, cap, threading.get_ident())  # per thread: two generations at once must not share them
        buffers = self.__dict__.setdefault("_decode_buffers", {})
        if key not in buffers:  # reused: the residual stream, the step's scratch and the prelude's rows/masks
            if len(buffers) > 16:
                buffers.clear()
            work = rows * (2 * len(self.layer_types) * hd + 2 * cap)
            new = self.final_norm.new_empty
            buffers[key] = (new(rows * d), new(self._step_scratch(rows)), new(work))
        x, scratch, work = buffers[key]
        made = self.__dict__.get("_table_ptrs")
        if made is None or any(a is not b for a, b in zip(made[0], rows_tables, strict=True)):
            if not all(c.is_contiguous() and sn.is_contiguous() for c, sn in rows_tables):
                return None
            ptrs = lambda ts: (ctypes.c_void_p * len(ts))(*[tb.data_ptr() for tb in ts])  # noqa: E731
            scale = self.embed_scale  # a constant of the model (Gemma: √D); read once, not at every step
            made = (rows_tables, ptrs([c for c, _ in rows_tables]), ptrs([sn for _, sn in rows_tables]),
                    sum({1 << int(layer.sliding) for layer in self.layers}), 0.0 if scale is None else float(scale))
            self._table_ptrs = made
        h = self.final_norm.new_empty((b, t, d))
        coded = self.embed_codes
        embed_desc = None if coded is None else self.__dict__.get("_embed_desc")
        if coded is not None and embed_desc is None:
            embed_desc = self._embed_desc = coded.desc()  # held here: the calls read it
        rc = lib.lmhead_decode(native.DecodeArgs(
            step=self._step_args(descs, cache, start, b, t, x, h, scratch),
            embed=None if coded is not None else self.embed.data_ptr(),
            embed_codes=None if embed_desc is None else ctypes.addressof(embed_desc),
            ids=ids.data_ptr(), positions=positions.data_ptr(), new_valid=None if valid is None else valid.data_ptr(),
            cache_valid=cache.valid.data_ptr(), cache_pos=cache.positions.data_ptr(),
            cache_tokens=cache.tokens.data_ptr(), cos_tables=ctypes.addressof(made[1]),
            sin_tables=ctypes.addressof(made[2]), work=work.data_ptr(),
            vocab=coded.out_features if coded is not None else self.embed.shape[0], n_kinds=len(self.layer_types),
            table_rows=table_rows, window=self.window or 0, embed_scale=made[4],
            has_scale=int(self.embed_scale is not None), sliding_kinds=made[3]))
        if rc == -2:
            return None
        if rc != 0:
            raise MemoryError("lmhead_step could not allocate its buffers")
        cache.length = start + t
        return h

    def _attention_native(self, qk: Tensor, qkv: Tensor, cos: Tensor, sin: Tensor, cache: StaticCache, i: int,
                          start: int, mask: Tensor | None) -> Tensor | None:
        """Rope, the cache write and attention of layer i in one C call (`lmhead_attend`) → [B,T,H·hd], or None
        where the torch path must run (no library, a layout it does not take)."""
        keys, values = cache.keys[i], cache.values[i]
        lib = self._native(qk, qkv, cos, sin, keys)
        if lib is None or not (qkv.is_contiguous() and keys.is_contiguous() and values.is_contiguous()):
            return None
        b, t = qkv.shape[:2]
        width = qkv.shape[-1]
        if qk.data_ptr() == qkv.data_ptr():  # no q/k norm: the heads are read in place from qkv
            qk_ptr, qk_stride = qkv.data_ptr(), width
        else:
            qk = qk.contiguous()
            qk_ptr, qk_stride = qk.data_ptr(), qk.shape[-1] * qk.shape[-2]
        cos, sin = cos.contiguous(), sin.contiguous()
        mask = None if mask is None else mask.contiguous()
        out = qkv.new_empty((b, t, self.heads * self.head_dim))
        v_offset = (self.heads + self.kv_heads) * self.head_dim * qkv.element_size()
        rc = lib.lmhead_attend(native.AttendArgs(
            qk=qk_ptr, v=qkv.data_ptr() + v_offset, cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
            values=values.data_ptr(), mask=None if mask is None else mask.data_ptr(), out=out.data_ptr(),
            qk_stride=qk_stride, v_stride=width, B=b, T=t, H=self.heads, Hkv=self.kv_heads, hd=self.head_dim,
            cap=cache.capacity, start=start, scaling=self.scaling, softcap=self.attn_softcap or 0.0,
            threads=torch.get_num_threads()))
        if rc != 0:
            raise MemoryError("lmhead_attend could not allocate its buffers")
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
    # prompt's prefill runs oneDNN's float32 GEMM over the same numbers. Measured on Gemma 3 (2 cores): a step of
    # 32 rows 157 ms with oneDNN, 105 ms with the codes; a prefill of 32 tokens 125 / 98 ms, of 64 185 / 198 ms
    CODED_MAX_ROWS = 48

    def _product(self, x: Tensor, layer: Layer, name: str, b: Tensor | None = None) -> Tensor:
        """x [B,T,in] through the layer's matrix `name` ("qkv", "o", "gate_up", "down")."""
        coded = layer.coded.get(name) if layer.coded else None
        weight = getattr(layer, name)
        if coded is not None and (x.shape[:-1].numel() <= self.CODED_MAX_ROWS or weight is None):
            if weight is None and x.shape[:-1].numel() > self.CODED_MAX_ROWS:
                # no float32 copy kept (a model read from its file): the matrix for this long product only
                return self._linear(x, coded.dequantize(), b)
            y = coded(x)
            return y if b is None else y + b
        return self._linear(x, weight, b)

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

    def _attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """q [B,H,T,hd] against keys/values [B,H_kv,L,hd] → [B,T,H·hd]; the H/H_kv query heads that share a
        key head are one batched product (no repeat of the cache)."""
        b, h, t, hd = q.shape
        g = h // self.kv_heads
        qg = q.reshape(b, self.kv_heads, g * t, hd)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scaling     # [B,H_kv,g·T,L]
        if self.attn_softcap is not None:
            scores = torch.tanh(scores / self.attn_softcap) * self.attn_softcap
        if mask is not None:
            scores = (scores.view(b, self.kv_heads, g, t, -1) + mask).view(b, self.kv_heads, g * t, -1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
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
            a = self._attention_native(qk, qkv, cos, sin, cache, i, start, masks[layer.sliding])
            if a is None:
                qk = self._rope(qk, cos, sin).transpose(1, 2)
                q, k = qk[:, :self.heads], qk[:, self.heads:]
                v = qkv[..., nq + nkv:].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
                cache.keys[i, :, :, start:start + t] = k
                cache.values[i, :, :, start:start + t] = v
                a = self._attend(q, cache.keys[i, :, :, :start + t], cache.values[i, :, :, :start + t],
                                 masks[layer.sliding])
            a = self._product(a, layer, "o")
            x, h = self._add_norm(x, a, layer.post_attn_norm, layer.pre_mlp_norm)
            m = self._product(self._gated(self._product(h, layer, "gate_up")), layer, "down")
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

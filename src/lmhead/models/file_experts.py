"""A GGUF file's mixture-of-experts layers read from its own codes: the header's expert counts checked against the
tensors, a layer's experts laid out together from the file's 3-D tensors.

    header: <arch>.expert_count E, .expert_used_count k (.expert_feed_forward_length F)
    blk.i.ffn_gate_inp.weight [E, D] (the router, float32 in llama.cpp's files)
    blk.i.ffn_gate_exps / ffn_up_exps [E, F, D], ffn_down_exps [E, D, F] ──all experts at once, a chunk at a
        time──▶ `ExpertMatrices` gate_up [E, 2F, D] (each expert's gate rows first), down [E, D, F]: the kernel's
        layout in one buffer per part, scales as the blocks hold them (models/expert_layout.py)
    blk.i.ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp [1, D] (Qwen2-MoE's shared expert and its gate)
    blk.i.ffn_gate_inp.bias [E], ffn_{gate,up}_exps.bias [E, F], ffn_down_exps.bias [E, D] (gpt-oss's biases)

`moe_config` completes the config transformers read from the file with what its GGUF reader leaves out (the
experts' width, Qwen2-MoE's shared expert's; a llama file with experts is Mixtral) and refuses a file whose
header and tensors disagree, naming the tensor. `read_moe` builds one layer's `MoE` (`models/moe.py`); nothing
is converted to float32 but the router and the types without a code kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmhead.models import layout_cache
from lmhead.models.arch import ArchSpec, arch_of
from lmhead.models.errors import ModelError
from lmhead.models.expert_layout import ExpertMatrices, build_experts
from lmhead.models.gguf_codes import BLOCKS
from lmhead.models.gguf_file import CODE_TYPES, DENSE_TYPES, GGUFFile, Header
from lmhead.models.heap import trim_heap
from lmhead.models.moe import MoE, SwigluOAI

__all__ = ["moe_config", "read_moe"]


def _layers_with_experts(f: GGUFFile, names: tuple[str, ...]) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in f.tensors
                   if n.startswith("blk.") and any(n.endswith(f".{part}.weight") for part in names)})


def moe_config(f: GGUFFile, cfg: Any) -> ArchSpec | None:
    """Complete `cfg` (a ModelConfig, changed in place) with the file's experts and check them; → the row of its
    architecture where it is a mixture of experts, else None. ModelError naming the tensor or header key that
    contradicts the others."""
    spec = arch_of(cfg)
    probe = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")
    layers = _layers_with_experts(f, probe)
    if not layers:
        if spec is not None and spec.moe is not None:
            raise ModelError(f"{f.path}: a {f.architecture} model needs its experts' tensors (blk.N.ffn_gate_inp, "
                             "ffn_gate_exps, ffn_up_exps, ffn_down_exps); the file has none")
        return None
    if spec is not None and spec.model_type == "llama":  # Mixtral's files say "llama" and hold experts
        cfg.model_type = "mixtral"
        spec = arch_of(cfg)
    if spec is None or spec.moe is None:
        return None  # refused by the caller for its model type
    moe = spec.moe
    fields = Header(f.path).fields
    key = f"{f.architecture}.expert_count"
    used_key = f"{f.architecture}.expert_used_count"
    experts, used = fields.get(key), fields.get(used_key)
    if not isinstance(experts, int) or experts < 1:
        raise ModelError(f"{f.path}: the header's {key} is {experts!r}; a mixture of experts needs a count ≥ 1")
    if not isinstance(used, int) or not 1 <= used <= experts:
        raise ModelError(f"{f.path}: the header's {used_key} is {used!r}; it must be in [1, {experts}] "
                         f"({key} {experts})")
    d = cfg.hidden_size
    width = None
    for i in layers:
        p = f"blk.{i}."
        gate_up, down = _expert_names(f, i, spec)
        for name in (p + moe.router + ".weight", *gate_up, down):
            if name not in f.tensors:
                raise ModelError(f"{f.path}: layer {i} has experts but no tensor {name}")
        router = f.shape(p + moe.router + ".weight")
        if router != (experts, d):
            raise ModelError(f"{f.path}: tensor {p}{moe.router}.weight is {_dims(router)}; the header's {key} "
                             f"({experts}) and the width ({d}) say {experts}x{d}")
        down_shape = f.shape(down)
        ffn = down_shape[2] if len(down_shape) == 3 else None
        want = {down: (experts, d, ffn), **{name: (experts, ffn * (2 // len(gate_up)) if ffn else None, d)
                                            for name in gate_up}}
        for name, shape in want.items():
            if f.shape(name) != shape or ffn is None:
                raise ModelError(f"{f.path}: tensor {name} is {_dims(f.shape(name))}; the experts' tensors "
                                 f"[{key} {experts}, F, {d}] (gate and up, or [{experts}, 2F, {d}] fused) and "
                                 f"[{experts}, {d}, F] (down) expected")
        if width is not None and ffn != width:
            raise ModelError(f"{f.path}: tensor {down} has experts {ffn} wide; layer {layers[0]}'s are {width}")
        width = ffn
    header_ffn = fields.get(f"{f.architecture}.expert_feed_forward_length")
    if isinstance(header_ffn, int) and header_ffn != width:
        raise ModelError(f"{f.path}: the header's {f.architecture}.expert_feed_forward_length is {header_ffn}; "
                         f"tensor {_expert_names(f, layers[0], spec)[1]} holds experts {width} wide")
    said = getattr(cfg, moe.experts_key, None)
    if isinstance(said, int) and said != experts and spec.model_type != "mixtral":
        raise ModelError(f"{f.path}: the config read from the file says {moe.experts_key} {said}; the header's "
                         f"{key} and tensor blk.{layers[0]}.{moe.router}.weight say {experts}")
    setattr(cfg, moe.experts_key, experts)
    cfg.num_experts_per_tok = used
    if moe.experts_key == "num_local_experts":  # Mixtral's and gpt-oss's configs: the experts' width
        cfg.intermediate_size = width
    else:
        cfg.moe_intermediate_size = width
    if moe.shared_expert:
        shared = p + moe.gguf_shared[0] + ".weight"
        if shared in f.tensors:
            cfg.shared_expert_intermediate_size = f.shape(shared)[0]
    return spec


def _expert_names(f: GGUFFile, layer: int, spec: ArchSpec) -> tuple[list[str], str]:
    """(the experts' gate and up tensors — or the one llama.cpp's converter writes with --fuse-gate-up-exps,
    [E, 2F, D] gate rows first —, the down tensor) of `layer`."""
    moe, p = spec.moe, f"blk.{layer}."
    fused = p + moe.gguf_gate_up_experts + ".weight"
    gate_up = [fused] if fused in f.tensors else [p + part + ".weight" for part in moe.gguf_experts[:2]]
    return gate_up, p + moe.gguf_experts[2] + ".weight"


def _dims(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape)


class _Experts:
    """One 3-D tensor [E, N, K] of the file."""

    def __init__(self, f: GGUFFile, name: str) -> None:
        self.f, self.name = f, name
        self.kind = f.type_of(name)
        self.experts, self.n, self.k = f.shape(name)
        self._dense: torch.Tensor | None = None

    def rows(self) -> np.ndarray:
        """The tensor's bytes [E·N, bytes a row] (a view of the map); ModelError where they are not whole rows of
        whole blocks."""
        data = np.asarray(self.f.tensors[self.name].data)
        per_block, nbytes = (1, DENSE_TYPES[self.kind].itemsize) if self.kind in DENSE_TYPES else BLOCKS[self.kind][:2]
        if self.k % per_block or data.nbytes != self.experts * self.n * (self.k // per_block) * nbytes:
            raise ModelError(f"{self.f.path}: tensor {self.name} ({self.kind}, {self.experts}x{self.n}x{self.k}) "
                             "does not hold whole blocks")
        return data.reshape(self.experts * self.n, -1).view(np.uint8)

    def dequantized(self, e: int) -> torch.Tensor:
        """Expert e as float32 [N, K] (gguf-py's dequantisation of the whole tensor, made once)."""
        if self._dense is None:
            self._dense = self.f.dequantize(self.name)
        return self._dense[e]


def _experts(parts: list[_Experts]) -> ExpertMatrices | list[torch.Tensor]:
    """Every expert of `parts` (gate and up, or down alone) as one matrix each, rows concatenated: one
    `ExpertMatrices` over the file's codes (or float weights) where the parts are of one type the kernel reads,
    else a float32 matrix per expert (a type without a code kernel, or gate and up of two types)."""
    kinds = {p.kind for p in parts}
    f = parts[0].f
    if len(kinds) == 1 and kinds <= (CODE_TYPES | DENSE_TYPES.keys()):
        return build_experts(parts[0].kind, [p.rows() for p in parts], [p.n for p in parts], parts[0].experts,
                             parts[0].k, done=lambda i: f.release(parts[i].name))
    return [torch.cat([p.dequantized(e) for p in parts]) for e in range(parts[0].experts)]


def read_moe(f: GGUFFile, layer: int, spec: ArchSpec, cfg: Any, vector, shared_linear,
             layouts: Path | None) -> MoE | None:
    """Layer `layer`'s mixture of experts (None where the file holds no router for it: a dense layer).
    `vector(name)` reads a float32 tensor, `shared_linear(names)` a 2-D matrix (the shared expert's) as the body's
    other matrices are read; `layouts`: the file's folder of the layout cache (`layout_cache.folder_for`; None:
    laid out in memory only)."""
    moe = spec.moe
    p = f"blk.{layer}."
    if moe is None or p + moe.router + ".weight" not in f.tensors:
        return None
    router = vector(p + moe.router + ".weight")
    names, down_name = _expert_names(f, layer, spec)
    parts, down = [_Experts(f, name) for name in names], _Experts(f, down_name)
    # laid out once and mapped by later loads of the file (models/layout_cache.py)
    gate_up = layout_cache.cached(layouts, f"blk.{layer}.gate_up", lambda: _experts(parts), say=True)
    downs = layout_cache.cached(layouts, f"blk.{layer}.down", lambda: _experts([down]), say=True)
    for part in (*parts, down):
        f.release(part.name)
    trim_heap()  # the experts' transient arrays, before the next layer's
    gate_up_bias = down_bias = router_bias = act = None
    if moe.biases:  # gpt-oss: [E, F] per gate and up (gate first, as the weights' rows), [E, D] for down
        router_bias = vector(p + moe.router + ".bias")
        gb, ub, db = (vector(n.replace(".weight", ".bias")) for n in (*_split_names(p, moe), down_name))
        for name, b, n in ((moe.gguf_experts[0], gb, parts[0].n if len(parts) == 2 else parts[0].n // 2),
                           (moe.gguf_experts[1], ub, parts[0].n if len(parts) == 2 else parts[0].n // 2),
                           (moe.gguf_experts[2], db, down.n)):
            if router_bias is None or b is None or tuple(b.shape) != (down.experts, n):
                raise ModelError(f"{f.path}: layer {layer}'s experts need the biases {p}{moe.router}.bias "
                                 f"[{down.experts}] and {p}{name}.bias [{down.experts}, {n}]")
        gate_up_bias = torch.cat([gb, ub], dim=1)
        down_bias = db.contiguous()
    if moe.act == "swiglu_oai":
        act = SwigluOAI(alpha=float(cfg.swiglu_alpha or 1.702), limit=float(cfg.swiglu_limit or 7.0))
    shared_gate_up = shared_down = shared_gate = None
    if moe.shared_expert and p + moe.gguf_shared[0] + ".weight" in f.tensors:
        shared_gate_up = shared_linear([p + moe.gguf_shared[0] + ".weight", p + moe.gguf_shared[1] + ".weight"])
        shared_down = shared_linear([p + moe.gguf_shared[2] + ".weight"])
        shared_gate = vector(p + moe.shared_gate + ".weight").reshape(1, -1)
    return MoE(router=router, gate_up=gate_up, down=downs, top_k=cfg.num_experts_per_tok,
               renormalise=moe.renormalises(cfg), shared_gate_up=shared_gate_up, shared_down=shared_down,
               shared_gate=shared_gate, router_bias=router_bias, gate_up_bias=gate_up_bias, down_bias=down_bias,
               softmax_after_topk=moe.softmax_after_topk, act=act)


def _split_names(p: str, moe) -> tuple[str, str]:
    """The experts' gate and up weights' names (their biases are two tensors even where the weights are one)."""
    return p + moe.gguf_experts[0] + ".weight", p + moe.gguf_experts[1] + ".weight"

"""A mixture-of-experts MLP as the lean body runs it: the router, the top k, and each chosen expert's product run
once over all the rows that picked it.

    h [B,T,D] ──as rows x [N,D]──▶ router logits x·Rᵀ [N,E] (float32, F.linear: transformers' own op)
        ──softmax (float32)──▶ top k experts per row, weights w [N,k] (÷ their sum where the rule renormalises)
        ──per chosen expert e, ascending: rows r that picked it──▶ down_e(act(gate_e·x_r)·(up_e·x_r)) · w
          ──added into out [N,D]──▶ (+ sigmoid(x·g) · shared(x), the shared expert) ──▶ [B,T,D]

The rows are grouped by expert as llama.cpp's `mul_mat_id` groups them: a chosen expert's gate/up and down are one
product each over every row that chose it (a decode batch, a prefill chunk), never one row at a time. Experts are
added into each row in ascending expert order, transformers' order, so the sums are its sums. An expert's
matrices are `CodedLinear`s over the GGUF file's own codes (gate and up fused, gate rows first), or float32
tensors (a transformers model's experts, shared, or a type without a code kernel dequantized).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmhead.models.coded_linear import CodedLinear

__all__ = ["MoE", "Routing", "route"]

Matrix = CodedLinear | Tensor


@dataclass(frozen=True)
class Routing:
    """The router's decision for rows x [N,D]: `logits` [N,E] float32, `experts` [N,k] int64 (by descending
    probability) and their `weights` [N,k] float32."""

    logits: Tensor
    experts: Tensor
    weights: Tensor


def route(x: Tensor, router: Tensor, top_k: int, renormalise: bool) -> Routing:
    """The router on rows x [N,D] with weight `router` [E,D], as transformers' Qwen2/Qwen3-MoE and Mixtral routers
    compute it: logits by F.linear, softmax in float32, torch.topk (ties to the lower index), and, where the
    rule renormalises, the k probabilities divided by their sum."""
    logits = F.linear(x, router)                                        # [N,E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)                 # [N,k]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, experts, weights.to(logits.dtype))


def _product(x: Tensor, w: Matrix) -> Tensor:
    return w(x) if isinstance(w, CodedLinear) else F.linear(x, w)


@dataclass
class MoE:
    """One layer's experts: `router` [E,D] float32, per expert `gate_up` [2F,D] (gate rows first) and `down`
    [D,F]; `top_k`, `renormalise` (the routing rule); optionally the shared expert (`shared_gate_up`,
    `shared_down`) and its gate `shared_gate` [1,D]."""

    router: Tensor
    gate_up: list[Matrix]
    down: list[Matrix]
    top_k: int
    renormalise: bool
    shared_gate_up: Matrix | None = None
    shared_down: Matrix | None = None
    shared_gate: Tensor | None = None

    def __post_init__(self) -> None:
        experts = self.router.shape[0]
        if len(self.gate_up) != experts or len(self.down) != experts:
            raise ValueError(f"the router has {experts} experts; gate_up has {len(self.gate_up)}, down "
                             f"{len(self.down)}")
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {self.top_k}")

    @property
    def experts(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the experts' codes (and float32 matrices) and the router."""
        mats = [*self.gate_up, *self.down, self.shared_gate_up, self.shared_down, self.shared_gate, self.router]
        return sum(m.nbytes for m in mats if m is not None)

    def route(self, h: Tensor) -> Routing:
        """The router's decision for h [..., D] (its rows flattened to [N,D])."""
        return route(h.reshape(-1, h.shape[-1]), self.router, self.top_k, self.renormalise)

    def __call__(self, h: Tensor, gated: Callable[[Tensor], Tensor]) -> Tensor:
        """h [B,T,D] → [B,T,D]; `gated` computes act(gate)·up of [.., 2F] = [gate | up] (the body's)."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])                                        # [N,D]
        r = self.route(x)
        out = torch.zeros_like(x)
        flat = r.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)       # the (row, slot) pairs grouped by expert, ascending
        chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for e, n in zip(chosen.tolist(), counts.tolist(), strict=True):
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k
            y = _product(gated(_product(x[rows], self.gate_up[e])), self.down[e])     # [n,D]
            # a row is in an expert's group once: out[rows] + y is index_add's sum without its per-call cost
            out[rows] += y * r.weights.reshape(-1)[pairs, None]
        if self.shared_gate_up is not None:
            shared = _product(gated(_product(x, self.shared_gate_up)), self.shared_down)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out.view(shape)

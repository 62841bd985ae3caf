"""A mixture-of-experts MLP as the lean body runs it: the router, the top k, and each chosen expert's product run
once over all the rows that picked it.

    h [B,T,D] ──as rows x [N,D]──▶ router logits x·Rᵀ [N,E] (float32; each row summed in one order whatever the batch)
        ──softmax (float32)──▶ top k experts per row, weights w [N,k] (÷ their sum where the rule renormalises;
          gpt-oss: + the router's bias, the top k of the logits, then a softmax over those k)
        ──per chosen expert e, ascending: rows r that picked it──▶ down_e(act(gate_e·x_r)·(up_e·x_r)) · w
          ──added into out [N,D]──▶ (+ sigmoid(x·g) · shared(x), the shared expert) ──▶ [B,T,D]

The rows are grouped by expert as llama.cpp's `mul_mat_id` groups them: a chosen expert's gate/up and down are one
product each over every row that chose it (a decode batch, a prefill chunk), never one row at a time. Experts are
added into each row in ascending expert order, transformers' order, so the sums are its sums. Where the body's
activation is the C one, the whole chain — every chosen expert's gate/up, activation and down, and the weighted
sum — is one C call (kernels/experts.py, `MoE.one_call`), the same bits as the per-expert calls. A file's experts
are one `ExpertMatrices` per product (models/expert_layout.py: every expert's codes in one buffer, gate and up
fused, gate rows first; expert e's product the kernel on its slice), a transformers model's a list of float32
tensors (shared; or a type without a code kernel dequantized).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lmhead.kernels import experts as experts_kernel
from lmhead.models.coded_linear import CodedLinear
from lmhead.models.expert_layout import ExpertMatrices
from lmhead.models.row_blocks import RowBlocks

__all__ = ["MoE", "Routing", "SwigluOAI", "route", "router_logits", "shared_gates", "swiglu_oai"]

Matrix = CodedLinear | RowBlocks | Tensor
Experts = ExpertMatrices | list[Matrix]  # a layer's experts of one product: one object, or one matrix each


@dataclass(frozen=True)
class Routing:
    """The router's decision for rows x [N,D]: `logits` [N,E] float32, `experts` [N,k] int64 (by descending
    probability) and their `weights` [N,k] float32."""

    logits: Tensor
    experts: Tensor
    weights: Tensor


def router_logits(x: Tensor, router: Tensor | CodedLinear, bias: Tensor | None = None) -> Tensor:
    """x [N,D] · routerᵀ (+ bias) → [N,E] float32, each row's logits the same bits whatever else is in the batch:
    the router's top k is a discrete choice, so a near-tie must not pick other experts for a request alone and in
    a server round. A matrix product over several rows sums each row in another order than the one-row product
    does (torch's F.linear: every row's logits changed in their last bits with the batch, measured at D 64, 2048,
    2880).

    `router`: the kernel's product over the weights [E,D] (`CodedLinear.dense16`, as `MoE.route` passes it) —
    one call whose every row is summed in one fixed order, whatever the rows and threads (the body's float32
    products') — or the weights themselves, each row then by its own F.linear (transformers' op on that row
    alone; so too where the kernel does not serve x). The bias is added after the product."""
    if isinstance(router, CodedLinear):
        if router.serves(x):
            y = router(x)
            return y if bias is None else y + bias
        router = router.codes
    if x.shape[0] <= 1 or torch.is_grad_enabled() and (x.requires_grad or router.requires_grad):
        return F.linear(x, router, bias)
    out = x.new_empty((x.shape[0], router.shape[0]))
    for i in range(x.shape[0]):
        out[i:i + 1] = F.linear(x[i:i + 1], router, bias)
    return out


def shared_gates(x: Tensor, gate: Tensor | CodedLinear) -> Tensor:
    """x [N,D] and a shared expert's gate [1,D] (or the kernel's product over it, as `router_logits`) → σ(x·gᵀ)
    [N,1], each row's product as `router_logits` makes it and its own sigmoid:
    torch's sigmoid over a column computes most elements in vector lanes and the last few one by one, whose last
    bits differ for some numbers, so a row's gate changed with its place in the batch; alone, every row's is the
    one-element sigmoid a decode step alone takes."""
    z = router_logits(x, gate)
    if z.shape[0] <= 1 or torch.is_grad_enabled() and z.requires_grad:
        return torch.sigmoid(z)
    spread = z.new_empty(z.shape[0], 2)  # a strided column: torch takes no vector lanes over it, every element
    spread[:, :1] = z                    # the one-element code a row alone takes, in one call
    return torch.sigmoid(spread[:, :1])


def _fixed_order(weights: Tensor) -> CodedLinear | Tensor:
    """`router_logits`' kernel product over weights [E,D] (the tensor itself, not a copy), or the tensor where the
    kernel takes no such matrix."""
    if weights.dim() == 2 and weights.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and weights.device.type == "cpu" and weights.is_contiguous() and not weights.requires_grad:
        return CodedLinear.dense16(weights)
    return weights


def route(x: Tensor, router: Tensor | CodedLinear, top_k: int, renormalise: bool, bias: Tensor | None = None,
          softmax_after_topk: bool = False) -> Routing:
    """The router on rows x [N,D] with weight `router` [E,D] (or the kernel's product over it: `router_logits`;
    and `bias` [E]), as transformers' Qwen2/Qwen3-MoE and Mixtral routers compute it: logits x·Rᵀ, softmax in
    float32, torch.topk (ties to the lower index), and, where the rule renormalises, the k probabilities divided
    by their sum; `softmax_after_topk` (gpt-oss's router): torch.topk of the logits, then the softmax over those
    k."""
    logits = router_logits(x, router, bias)                             # [N,E]
    if softmax_after_topk:
        top, experts = torch.topk(logits, top_k, dim=-1)                # [N,k]
        return Routing(logits, experts, torch.softmax(top, dim=1, dtype=top.dtype))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)                 # [N,k]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, experts, weights.to(logits.dtype))


def _product(x: Tensor, w: Matrix, b: Tensor | None = None) -> Tensor:
    if isinstance(w, (CodedLinear, RowBlocks)):
        y = w(x)
        return y if b is None else y + b
    return F.linear(x, w, b)


def _expert(mats: Experts, e: int, x: Tensor, b: Tensor | None = None) -> Tensor:
    """x [n,K] through expert e of `mats` (+ b)."""
    if isinstance(mats, ExpertMatrices):
        y = mats.product(e, x)
        return y if b is None else y + b
    return _product(x, mats[e], b)


def swiglu_oai(gate_up: Tensor, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """gpt-oss's clamped SwiGLU on gate_up [.., 2F] = [gate | up] → [.., F], as transformers' GptOssExperts:
    gate clamped above at `limit`, up to [−limit, limit], (up + 1) · gate · σ(α · gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's experts' activation (`swiglu_oai` with its `alpha` and `limit`); the C tier's is
    body_kernels.c's lmhead_swiglu_oai (`native`), the one the experts kernel runs."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate_up: Tensor) -> Tensor:
        return swiglu_oai(gate_up, self.alpha, self.limit)

    def native(self, gate_up: Tensor) -> Tensor:
        """The same on float32 gate_up [.., 2F] by the C kernel (its exp within 2 ulp of torch's)."""
        from lmhead.kernels import native

        gate_up = gate_up.contiguous()
        f = gate_up.shape[-1] // 2
        out = gate_up.new_empty((*gate_up.shape[:-1], f))
        native.library().lmhead_swiglu_oai(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * f), f,
                                           self.alpha, self.limit)
        return out


@dataclass
class MoE:
    """One layer's experts: `router` [E,D] float32, per expert `gate_up` [2F,D] (gate rows first) and `down`
    [D,F]; `top_k`, `renormalise` (the routing rule); optionally the shared expert (`shared_gate_up`,
    `shared_down`) and its gate `shared_gate` [1,D]. gpt-oss: `router_bias` [E], the experts' `gate_up_bias`
    [E,2F] and `down_bias` [E,D] (row e expert e's), `softmax_after_topk`, and `act` — the experts' own gated
    activation (`SwigluOAI`) in place of the body's."""

    router: Tensor
    gate_up: Experts
    down: Experts
    top_k: int
    renormalise: bool
    shared_gate_up: Matrix | None = None
    shared_down: Matrix | None = None
    shared_gate: Tensor | None = None
    router_bias: Tensor | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    softmax_after_topk: bool = False
    act: SwigluOAI | None = None

    def __post_init__(self) -> None:
        experts = self.router.shape[0]
        if len(self.gate_up) != experts or len(self.down) != experts:
            raise ValueError(f"the router has {experts} experts; gate_up has {len(self.gate_up)}, down "
                             f"{len(self.down)}")
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"top_k must be in [1, {experts}], got {self.top_k}")
        for name, b in (("gate_up_bias", self.gate_up_bias), ("down_bias", self.down_bias)):
            if b is not None and (b.dim() != 2 or b.shape[0] != experts):
                raise ValueError(f"{name} must be [{experts}, width], got {list(b.shape)}")

    @property
    def experts(self) -> int:
        return self.router.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the experts' codes (and float32 matrices) and the router."""
        experts = [m for mats in (self.gate_up, self.down)
                   for m in ([mats] if isinstance(mats, ExpertMatrices) else mats)]
        mats = [*experts, self.shared_gate_up, self.shared_down, self.shared_gate, self.router,
                self.router_bias, self.gate_up_bias, self.down_bias]
        return sum(m.nbytes for m in mats if m is not None)

    @functools.cached_property
    def _router_product(self) -> CodedLinear | Tensor:
        """The kernel's product over the router's weights (`router_logits`: every row summed in one order, one
        call for a prefill's rows), over the tensor itself (no copy: a weight changed in place is read as it
        is)."""
        return _fixed_order(self.router)

    @functools.cached_property
    def _shared_gate_product(self) -> CodedLinear | Tensor | None:
        return None if self.shared_gate is None else _fixed_order(self.shared_gate)

    def route(self, h: Tensor) -> Routing:
        """The router's decision for h [..., D] (its rows flattened to [N,D]); a row's the same bits alone and in
        any batch (`router_logits`)."""
        return route(h.reshape(-1, h.shape[-1]), self._router_product, self.top_k, self.renormalise,
                     self.router_bias, self.softmax_after_topk)

    def shared_weight(self, x: Tensor) -> Tensor:
        """The shared expert's gate for rows x [N,D]: σ(x·g) [N,1] (Qwen2-MoE's; a row's the same bits alone and
        in any batch: `shared_gates`)."""
        return shared_gates(x, self._shared_gate_product)

    def kernel_act(self, act_code: int) -> tuple[int, float, float]:
        """The experts kernel's activation (code, alpha, limit): the experts' own (`SwigluOAI`), else the body's
        `lmhead_gated` code `act_code`."""
        if self.act is None:
            return act_code, 0.0, 0.0
        return experts_kernel.SWIGLU_OAI, self.act.alpha, self.act.limit

    def one_call(self, x: Tensor, act_code: int | None) -> bool:
        """Whether rows x [N,D] take experts_kernel.c's one call for the chosen experts (`_experts`' numbers, bit
        for bit): experts from a file's codes (with float32 biases or none), the body on its C tier (`act_code`:
        its `gated` is `lmhead_gated` with this code; the experts' own activation is then the C one too), float32
        rows on the CPU outside autograd, the kernel built."""
        return (act_code is not None and isinstance(self.gate_up, ExpertMatrices)
                and isinstance(self.down, ExpertMatrices)
                and all(b is None or b.dtype == torch.float32 for b in (self.gate_up_bias, self.down_bias))
                and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
                and experts_kernel.available())

    def __call__(self, h: Tensor, gated: Callable[[Tensor], Tensor], act_code: int | None = None) -> Tensor:
        """h [B,T,D] → [B,T,D]; `gated` computes act(gate)·up of [.., 2F] = [gate | up] (the body's; the experts'
        own `act` where they have one); `act_code`: where `gated` is `lmhead_gated` with this code (the body's
        native tier), the chosen experts run in one C call (`one_call`)."""
        shape = h.shape
        x = h.reshape(-1, shape[-1])                                        # [N,D]
        r = self.route(x)
        if self.one_call(x, act_code):
            act, alpha, limit = self.kernel_act(act_code)
            out = experts_kernel.mlp(x.contiguous(), r.experts, r.weights, self.gate_up.desc, self.down.desc, act,
                                     self.gate_up_bias, self.down_bias, alpha, limit)
        else:
            # the experts' own activation on the body's tier: the C one beside the C `gated` (the one call's bits),
            # torch's beside torch's
            own = self.act
            if own is not None and act_code is not None and x.dtype == torch.float32 and x.device.type == "cpu":
                own = own.native
            out = self._experts(x, r, own or gated)
        if self.shared_gate_up is not None:
            shared = _product(gated(_product(x, self.shared_gate_up)), self.shared_down)
            out = out + self.shared_weight(x) * shared
        return out.view(shape)

    def _experts(self, x: Tensor, r: Routing, experts_gated: Callable[[Tensor], Tensor]) -> Tensor:
        """The chosen experts' weighted sum for rows x [N,D] → [N,D]: one product per chosen expert and matrix
        over the rows that chose it, added into each row in ascending expert order."""
        out = torch.zeros_like(x)
        flat = r.experts.reshape(-1)
        order = torch.argsort(flat, stable=True)       # the (row, slot) pairs grouped by expert, ascending
        chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
        start = 0
        for e, n in zip(chosen.tolist(), counts.tolist(), strict=True):
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k
            if self.gate_up_bias is None:
                y = _expert(self.down, e, experts_gated(_expert(self.gate_up, e, x[rows])))      # [n,D]
            else:  # gpt-oss: each product plus the expert's bias
                gate_up = _expert(self.gate_up, e, x[rows], self.gate_up_bias[e])
                y = _expert(self.down, e, experts_gated(gate_up), self.down_bias[e])
            # a row is in an expert's group once: out[rows] + y is index_add's sum without its per-call cost
            out[rows] += y * r.weights.reshape(-1)[pairs, None]
        return out

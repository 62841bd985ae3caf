"""The body's linear layers through oneDNN's inner-product kernel: same weights, same math, less time.

    body (transformers) ──copy of the module tree, every parameter and buffer shared──▶ body'
    in body', each nn.Linear ──▶ OneDNNLinear: torch.ops.mkldnn._linear_pointwise(x, W, b)

Why: at decode time (one new token per row) every linear of the body is a matrix-vector product. torch's
`F.linear` sends it to MKL's sgemv, which on this machine (2-core AMD EPYC, AVX-512) runs on one thread:
the body's 126 products per Gemma 3 270M token take 31.6 ms with torch's 2 threads and 31.8 ms with one
(12.7 GB/s); oneDNN's inner product — the op torch.compile's CPU backend emits for linears — uses every
thread: 21.0 ms (19.1 GB/s), and a whole body decode step goes from 40.7 to 31.0 ms
(benchmarks/bench_body.py; end to end: benchmarks/bench_decode.py).

The results equal F.linear's up to fp32 summation order (relative differences ~1e-6): the weights are the
same tensors, only the kernel differs. The copy leaves `hf_model` untouched, so transformers' own
`generate()` on the same model stays the plain baseline. Gradients: when autograd is recording and the
weight requires grad, `F.linear` runs instead (the oneDNN op has no backward).
"""

from __future__ import annotations

import copy
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["OneDNNLinear", "onednn_available", "with_onednn_linears"]


@functools.cache
def onednn_available() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its `_linear_pointwise` op takes the arguments we
    pass and agrees with F.linear on a small product (the op is internal to torch: checked, not assumed)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(3, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
        with torch.no_grad():
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except Exception:  # no such op, or another signature in this torch version
        return False


class OneDNNLinear(nn.Module):
    """A thin wrapper over an `nn.Linear`'s weight and bias (shared, not copied) that runs oneDNN's kernel.

    x [..., in] -> [..., out]. Falls back to `F.linear` for anything but float32 CPU tensors, and whenever
    autograd records (the oneDNN op has no backward).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu"
                or w.device.type != "cpu" or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def with_onednn_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers run oneDNN's kernel; every parameter and buffer is shared.

    Returns `module` itself when oneDNN is not available. The copy holds no weight memory of its own: the
    deep copy is told (through its memo) to reuse every tensor of the original.
    """
    if not onednn_available():
        return module
    memo: dict[int, object] = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    clone = copy.deepcopy(module, memo)
    for parent in list(clone.modules()):
        for attr, sub in list(parent.named_children()):
            if type(sub) is nn.Linear:  # exact type: subclasses may carry behaviour of their own
                setattr(parent, attr, OneDNNLinear(sub))
    return clone


@functools.cache
def int8_linear_available() -> bool:
    """True when torch has a dynamic int8 linear (fbgemm's `quantized::linear_dynamic`, or oneDNN's int8 inner
    product) and it computes a small product as expected (internal ops: checked, not assumed)."""
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(40, 24, generator=g), torch.randn(3, 24, generator=g)
        return bool(torch.allclose(Int8Linear(w)(x), x @ w.T, rtol=0.05, atol=0.1 * float((x @ w.T).abs().max())))
    except Exception:  # no such op, or another signature in this torch version
        return False


@functools.cache
def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines


class Int8Linear:
    """y = x·Wᵀ with W [N,K] stored as int8 (one scale per output row) and x quantised per call: a quarter of
    fp32's bytes to read. Approximate by design — it serves the speculative draft, whose tokens the
    full-precision model verifies. x [..., K] float32 -> [..., N] float32.

    Kernel: torch's dynamic int8 linear (fbgemm, `quantized::linear_dynamic`; 7-bit activations, one scale per
    call) where torch has it — measured about twice fp32's speed at Gemma's shapes on an AVX2 machine —, else
    oneDNN's int8 inner product with 7-bit activations (without VNNI its uint8·int8 pairs add in int16, which
    saturates at 128; the same reason as fbgemm's `reduce_range`).
    """

    STEP, ZERO = 2.0 / 126.0, 63  # oneDNN path: each row scaled to [-1, 1], then this fixed grid

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        self.nbytes = q.numel() + 4 * self.out_features
        self.fbgemm = _fbgemm_available()
        if self.fbgemm:
            with warnings.catch_warnings():  # quantized tensors are deprecated; the kernel is what we use
                warnings.simplefilter("ignore")
                qw = torch._make_per_channel_quantized_tensor(q, scale.double(),
                                                              torch.zeros(self.out_features, dtype=torch.long), 0)
                self.packed = torch.ops.quantized.linear_prepack(qw, None)
        else:
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)
            self.scales = scale
            self.zeros = torch.zeros(self.out_features, dtype=torch.int32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.fbgemm:
            y = torch.ops.quantized.linear_dynamic(x2.contiguous(), self.packed, True)
            return y.view(*shape[:-1], self.out_features)
        row_max = x2.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)   # [M,1]
        qx = torch.round(x2 / (row_max * self.STEP)).add_(self.ZERO).clamp_(0, 126).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(qx, self.STEP, self.ZERO, self.packed, self.scales, self.zeros,
                                               None, 1.0, 0, torch.float32, "none", [], "")
        return (y * row_max).view(*shape[:-1], self.out_features)

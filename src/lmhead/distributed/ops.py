"""Megatron's f and g operators as autograd functions: the copy into the vocabulary-parallel region (identity
forward, all-reduce of the gradient) and the reduction out of it (all-reduce forward, identity backward)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class CopyToVocabParallel(torch.autograd.Function):
    """Identity forward; all-reduce SUM of the gradient in backward (hidden is replicated, each rank's
    slice of the logits contributes its part of dHidden)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class ReduceFromVocabParallel(torch.autograd.Function):
    """All-reduce SUM forward (each rank looked up only its own rows); identity backward, because everything
    after it is replicated and every rank back-propagates the same gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None

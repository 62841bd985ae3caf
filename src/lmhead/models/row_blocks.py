"""A fused matrix whose parts keep their own layouts: row blocks, each a `CodedLinear`.

    W [N,K] = [W₁; W₂; …] (row blocks, e.g. q and k from Q4_K codes, v from Q6_K codes)
    x [..., K] ──each block's coded product──▶ [..., N₁], [..., N₂], … ──side by side──▶ [..., N]

A GGUF file may give the matrices of one fused product different types (llama.cpp's Q4_K_M keeps attn_v and
ffn_down in Q6_K where q, k, gate and up are Q4_K). One layout for the whole fused matrix would have to hold the
widest codes for every row — int8 codes where two thirds of the rows are 4-bit, about twice the bytes a decode step
reads for them. Each block here keeps the layout of its own type; a product is one kernel call per block (each
output column is its block's row of W times x, the same numbers as that block alone), and the C decode step walks
the same blocks (`lmhead_mat.more`, decode_kernels.h).
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from lmhead.kernels import native
from lmhead.models.coded_linear import CodedLinear

__all__ = ["RowBlocks"]


class RowBlocks:
    """Row blocks [N_i, K] of one matrix [ΣN_i, K], each a `CodedLinear` of its own layout, used where a
    `CodedLinear` is: `__call__` (x [..., K] → [..., N]), `desc()`, `nbytes`, `current()`, `dequantize()`."""

    def __init__(self, blocks: list[CodedLinear]) -> None:
        if len(blocks) < 2:
            raise ValueError(f"RowBlocks needs at least two blocks, got {len(blocks)}")
        k = blocks[0].in_features
        if any(b.in_features != k for b in blocks):
            raise ValueError(f"the blocks must share K, got {[b.in_features for b in blocks]}")
        self.blocks = blocks
        self.in_features, self.out_features = k, sum(b.out_features for b in blocks)

    @property
    def sources(self) -> tuple[Tensor, ...]:
        return tuple(t for b in self.blocks for t in b.sources)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def current(self) -> bool:
        return all(b.current() for b in self.blocks)

    def dequantize(self) -> Tensor:
        """The float32 matrix [N,K] the blocks encode."""
        return torch.cat([b.dequantize() for b in self.blocks])

    def desc(self) -> tuple[native.MatDesc, list[native.MatDesc]]:
        """The first block's `lmhead_mat`, its `more` pointing at the next block's and so on, and the descriptors
        it points into (keep them, and this object, alive while the kernels read them)."""
        descs = [b.desc() for b in self.blocks]
        for d, after in zip(reversed(descs[:-1]), reversed(descs[1:]), strict=True):
            d.more = ctypes.addressof(after)
        return descs[0], descs

    def __call__(self, x: Tensor) -> Tensor:
        return torch.cat([b(x) for b in self.blocks], dim=-1)

    def __repr__(self) -> str:
        return f"RowBlocks({self.out_features}×{self.in_features}: {', '.join(map(repr, self.blocks))})"

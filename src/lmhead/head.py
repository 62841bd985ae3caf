"""LMHead: the output projection of a language model, hidden states to logits.

    hidden [B,T,D] ──keep the last k positions──▶ [B,T',D] ──x·Wᵀ (+ b), in W's dtype──▶ upcast to float32
        ──softcap c·tanh(logits/c) (Gemma 2)──▶ logits [B,T',V]

The weight is [V,D], as `nn.Linear` stores it, and may be the token embedding's own Parameter (`tie_to=`).
Logits come out in float32 whatever the weight's dtype (a bf16 head multiplies in bf16 and upcasts the result,
as transformers does); float64 weights give float64 logits. For training, `.loss()` computes the
cross-entropy from the hidden states without materialising the logits (`lmhead.loss.linear_cross_entropy`).

Every head is called alike, `head(hidden, logits_to_keep=0, exact_k=None)`: a head that approximates the
logits (`lmhead.compressed`) makes its top `exact_k` per row exact; this one's are all exact (`exact_k` = V).
Option checks come from `lmhead.checks`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmhead import checks
from lmhead.loss import linear_cross_entropy

__all__ = ["LMHead"]


class LMHead(nn.Module):
    """Hidden states [B,T,D] (or [N,D]) → float32 logits [B,T',V] (or [N',V]).

    Args:
        d_model: D, the width of the hidden states.
        vocab_size: V.
        bias: add a learned [V] bias (zeros at init).
        tie_to: an `nn.Embedding(V, D)` whose weight Parameter the head shares (`head.weight is emb.weight`).
        softcap: c > 0 applies c·tanh(logits/c) to the logits (Gemma 2's final logit soft-capping).
        dtype, device: of a new weight (ignored for a tied weight, which keeps its own; a conflicting value
            raises).

    `forward(hidden, logits_to_keep=0, exact_k=None)`: 3-D hidden [B,T,D] gives [B,T',V]; 2-D hidden [N,D] is read as N
    positions (a flattened batch, or the last position of each sequence) and gives [N',V]. logits_to_keep=k
    projects only the last k positions (dim -2), as at inference (k=1: the next token); 0 keeps all.
    """

    def __init__(self, d_model: int, vocab_size: int, bias: bool = False, tie_to: nn.Embedding | None = None,
                 softcap: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        d_model = checks.positive_int("d_model", d_model)
        vocab_size = checks.positive_int("vocab_size", vocab_size)
        self.softcap = checks.softcap(softcap)
        if tie_to is not None:
            if not isinstance(tie_to, nn.Embedding):
                raise TypeError(f"tie_to must be an nn.Embedding, got {type(tie_to).__name__}")
            shape = tuple(tie_to.weight.shape)
            if shape != (vocab_size, d_model):
                raise ValueError(f"tie_to's weight must be [vocab_size, d_model] = [{vocab_size}, {d_model}], "
                                 f"got {list(shape)}")
            if dtype is not None and dtype != tie_to.weight.dtype:
                raise TypeError(f"dtype={dtype} conflicts with the tied embedding's dtype {tie_to.weight.dtype}")
            if device is not None and torch.device(device) != tie_to.weight.device:
                raise ValueError(f"device={device} conflicts with the tied embedding's device "
                                 f"{tie_to.weight.device}")
            self.weight = tie_to.weight  # the same Parameter: one tensor, one gradient
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model, dtype=dtype, device=device))
            bound = 1.0 / math.sqrt(d_model)  # nn.Linear's default initialisation
            nn.init.uniform_(self.weight, -bound, bound)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {bias!r} (use LMHead.from_weight to pass a tensor)")
        if bias:
            self.bias = nn.Parameter(torch.zeros(vocab_size, dtype=self.weight.dtype, device=self.weight.device))
        else:
            self.register_parameter("bias", None)
        self.tied = tie_to is not None

    @classmethod
    def from_weight(cls, weight: Tensor, bias: Tensor | None = None, softcap: float | None = None) -> LMHead:
        """A head on an existing [V,D] weight (and optional [V] bias), shared, never copied.

        An `nn.Parameter` is used as is (`head.weight is weight`); a plain tensor is wrapped in a Parameter
        over the same storage (keeping its requires_grad)."""
        if not isinstance(weight, Tensor):
            raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight must be a 2-D floating-point tensor [V,D], got shape {list(weight.shape)} "
                             f"dtype {weight.dtype}")
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {list(bias.shape)}")
            if bias.dtype != weight.dtype or bias.device != weight.device:
                raise TypeError(f"bias ({bias.dtype}, {bias.device}) must match weight ({weight.dtype}, "
                                f"{weight.device})")
        head = cls.__new__(cls)
        nn.Module.__init__(head)
        head.softcap = checks.softcap(softcap)
        head.weight = _as_parameter(weight)
        head.bias = None if bias is None else _as_parameter(bias)
        head.tied = False
        return head

    # `product`: None, or a callable [..., D] -> [..., V] float32 equal to x·Wᵀ for *this* weight up to the order
    # of float32 additions — a faster kernel over the same numbers (`lmhead.models` sets the GGUF codes'
    # `CodedLinear`, which falls back to the weight itself once it changes). Used at inference for calls of at
    # most PRODUCT_MAX_ROWS positions (decode steps, a server's batched rounds); training and long calls use
    # F.linear. Measured on Gemma 3's head (2 cores): the codes 159 / 675 ms at 32 / 128 rows, F.linear 426 /
    # 996 ms; at 512 rows F.linear 2.6 s, the codes 4.5 s.
    product = None
    PRODUCT_MAX_ROWS = 128

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def exact_k(self) -> int:
        """How many top tokens per row `forward` returns exactly: all V (the heads that approximate the rest,
        e.g. `lmhead.compressed`, have a smaller one)."""
        return self.vocab_size

    def _weight_trains(self) -> bool:
        """Whether autograd may want the weight's gradient (then the product is F.linear, never the codes')."""
        return self.weight.requires_grad

    def forward(self, hidden: Tensor, logits_to_keep: int = 0, exact_k: int | None = None) -> Tensor:
        """[B,T,D] → [B,T',V] (or [N,D] → [N',V]) float32 logits of the last `logits_to_keep` positions.

        exact_k: how many top tokens per row must be exact (None: the head's own `exact_k`). Every logit of
        this head is exact, so it is checked (an int in [0, V]) and changes nothing; the argument makes every
        head callable alike."""
        self._check_hidden(hidden)
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0 = all positions), got {logits_to_keep!r}")
        if exact_k is not None and (not checks.is_int(exact_k) or not 0 <= exact_k <= self.vocab_size):
            raise ValueError(f"exact_k must be an int in [0, {self.vocab_size}], got {exact_k!r}")
        if logits_to_keep:
            hidden = hidden[..., -logits_to_keep:, :]  # (B, k, D): project only what is needed (nanoGPT)
        product = getattr(self, "product", None)
        if (product is not None and hidden.shape[:-1].numel() <= self.PRODUCT_MAX_ROWS
                and not (torch.is_grad_enabled() and (hidden.requires_grad or self._weight_trains()))):
            logits = product(hidden)  # the same weight's numbers, read from a smaller copy (decode)
            if self.bias is not None:
                logits = logits + self.bias
        else:
            logits = F.linear(hidden, self.weight, self.bias)  # (B, T', V) in the weight's dtype
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        if self.softcap is not None:
            c = self.softcap
            if torch.is_grad_enabled() and logits.requires_grad:
                logits = c * torch.tanh(logits / c)
            else:  # inference: in place on the fresh float32 logits, no [B,T',V] temporaries
                logits.div_(c).tanh_().mul_(c)
        return logits

    def screen(self, hidden: Tensor, ks: list[int]) -> Tensor | None:
        """hidden [N,D] → float32 logits [N,V] whose top ks[n] per row are exact (ids and values: the product's
        own for one row) and whose other values are below them — all a greedy or top-k choice reads — or None
        where this head has no screened product (no GGUF codes that screen, a bias, a softcap, autograd; the
        caller then takes `forward`). See `CodedLinear.screen`."""
        got = self.screen_candidates(hidden, ks)
        return None if got is None else got[0]

    def screen_candidates(self, hidden: Tensor, ks: list[int], allowed: list[Tensor | None] | None = None
                          ) -> tuple[Tensor, tuple[Tensor, Tensor] | None] | None:
        """`screen`'s logits and the candidates they were made exact on (`CodedLinear.screen_candidates`: values
        [N,c], ids [N,c]; None where a row was computed whole), or None as `screen`. allowed [N] (bool [V] per
        row or None): a constrained row's tokens; the others are -inf and never candidates."""
        product = self._screening_product(hidden)
        return None if product is None else product.screen_candidates(hidden, ks, allowed=allowed)

    def values_at(self, hidden: Tensor, ids: list[Tensor]) -> Tensor | None:
        """hidden [N,D] → float32 logits [N,V]: each row's ids (int64, ascending) exact — the values `forward`
        gives them — and -inf elsewhere (`CodedLinear.values_at`), or None where this head has no such product
        (as `screen`)."""
        product = self._screening_product(hidden)
        return None if product is None else product.values_at(hidden, ids)

    def _screening_product(self, hidden: Tensor):
        """The coded product `screen_candidates` and `values_at` run on, or None where they do not serve: no GGUF
        codes that screen, a bias, a softcap, hidden not [N,D] float32, autograd."""
        product = getattr(self, "product", None)
        if (product is None or not getattr(product, "screens", False) or self.bias is not None
                or self.softcap is not None or hidden.dim() != 2 or hidden.dtype != torch.float32
                or torch.is_grad_enabled() and (hidden.requires_grad or self._weight_trains())):
            return None
        return product

    def loss(self, hidden: Tensor, targets: Tensor, **kwargs: Any) -> Tensor | tuple[Tensor, Tensor]:
        """`linear_cross_entropy(hidden, self.weight, targets, bias=self.bias, softcap=self.softcap, **kwargs)`:
        the fused, chunked cross-entropy (kwargs: ignore_index, reduction, label_smoothing, z_loss, shift,
        chunk_size, return_lse)."""
        for own in ("weight", "bias", "softcap"):
            if own in kwargs:
                raise TypeError(f"LMHead.loss() uses the head's own {own}; do not pass {own}=")
        return linear_cross_entropy(hidden, self.weight, targets, bias=self.bias, softcap=self.softcap, **kwargs)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"tied={self.tied}, softcap={self.softcap}, dtype={self.weight.dtype}")

    def _check_hidden(self, hidden: Tensor) -> None:
        if not isinstance(hidden, Tensor):
            raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if hidden.dim() not in (2, 3) or hidden.shape[-1] != self.d_model:
            raise ValueError(f"hidden must be [B,T,D] or [N,D] with D = d_model = {self.d_model}, got shape "
                             f"{list(hidden.shape)}")
        dtype, device = self._weight_dtype_device()
        if hidden.dtype != dtype:
            raise TypeError(f"hidden dtype {hidden.dtype} must match the head's weight dtype {dtype} "
                            f"(cast one of them with .to())")
        if hidden.device != device:
            raise ValueError(f"hidden is on {hidden.device} but the head's weight is on {device}")

    def _weight_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        return self.weight.dtype, self.weight.device


def _as_parameter(t: Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=t.requires_grad)

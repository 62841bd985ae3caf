"""The exact LM head of a model read straight from its GGUF file: the head's codes, no float32 copy kept.

    hidden [B,T,D] ──CodedLinear (the file's codes, exact)──▶ logits [B,T',V] float32 ──softcap?──▶

`CodedHead` is an `LMHead` whose `product` is the codes' kernel for every call; the [V,D] float32 weight —
what training, long calls and the explainer's geometry read — is made from the codes on first access
(`weight`) and kept, and from then on the codes answer only while it is unchanged (`CodedLinear.current`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmhead import checks
from lmhead.head import LMHead
from lmhead.models.coded_linear import CodedLinear

__all__ = ["CodedHead"]


class CodedHead(LMHead):
    """`LMHead` over `codes` [V,D] (and an optional float32 bias [V]); `softcap` as LMHead's."""

    def __init__(self, codes: CodedLinear, bias: Tensor | None = None, softcap: float | None = None,
                 tied: bool = False) -> None:
        nn.Module.__init__(self)
        self.softcap = checks.softcap(softcap)
        self.product = codes
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tied = tied
        self.__dict__["_weight"] = None
        self.__dict__["PRODUCT_MAX_ROWS"] = 1 << 62  # every call reads the codes until a float32 weight exists

    @property
    def weight(self) -> nn.Parameter:  # type: ignore[override]
        """The float32 [V,D] weight the codes encode, made on first access and shared from then on."""
        w = self.__dict__["_weight"]
        if w is None:
            # a normal tensor even when first read under inference_mode: one made there has no version counter,
            # and training reads this same weight later
            with torch.inference_mode(False):
                w = nn.Parameter(self.product.dequantize(), requires_grad=False)
            self.__dict__["_weight"] = w
            # the codes answer for this tensor's numbers only while it is unchanged (an optimizer step: F.linear)
            self.product.weight, self.product.sources, self.product.versions = w, (w,), (w._version,)
            self.__dict__["PRODUCT_MAX_ROWS"] = LMHead.PRODUCT_MAX_ROWS
        return w

    def share(self, weight: Tensor) -> bool:
        """Take `weight` (transformers' [V,D] head parameter of the same file, built later) as this head's float32
        weight, shared, where it is the codes' numbers exactly (checked; one made before is dropped unless it
        was changed in place). Returns whether it was taken."""
        if tuple(weight.shape) != (self.vocab_size, self.d_model):
            return False
        own = self.__dict__["_weight"]
        if own is not None and own._version != self.product.versions[0]:
            return False  # changed in place since it was made: keep it
        if not torch.equal(weight.detach(), own.detach() if own is not None else self.product.dequantize()):
            return False
        w = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.__dict__["_weight"] = w
        self.product.weight, self.product.sources, self.product.versions = w, (w,), (w._version,)
        self.__dict__["PRODUCT_MAX_ROWS"] = LMHead.PRODUCT_MAX_ROWS
        return True

    @property
    def materialized(self) -> bool:
        """Whether the float32 weight has been made (`weight`)."""
        return self.__dict__["_weight"] is not None

    @property
    def d_model(self) -> int:
        return self.product.in_features

    @property
    def vocab_size(self) -> int:
        return self.product.out_features

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _weight_trains(self) -> bool:
        return self.materialized and self.weight.requires_grad

    def _weight_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        return torch.float32, torch.device("cpu")  # the codes' products: float32 on the CPU, no weight read

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"tied={self.tied}, softcap={self.softcap}, codes={self.product.codes.dtype}")

"""transformers' causal LMs trained with lmhead's fused loss: one call, no [B,T,V] logits.

    model = AutoModelForCausalLM.from_pretrained(...)      # or lmhead.load_model("smollm2-135m").hf_model
    apply_fused_loss(model)                                 # patches this instance's forward (undo_fused_loss)
    out = model(input_ids, attention_mask=mask, labels=labels)   # out.loss from linear_cross_entropy, logits None

What is patched: the instance's `forward` (not the class: other instances are untouched). With `labels` the
patched forward runs the model's own body, takes the final hidden states [B,T,D] and returns

    loss = linear_cross_entropy(hidden, head.weight, labels, bias=head.bias, shift=True, ignore_index=-100,
                                softcap=config.final_logit_softcapping)       # chunked, never [B,T,V]

with `logits=None` (as Liger Kernel does). It follows transformers' `ForCausalLMLoss`: position t predicts
labels[t+1]; labels equal to `ignore_index` (-100, or the `ignore_index` keyword) are skipped; `shift_labels`
(already shifted [B,T]) is taken as is; with `num_items_in_batch` (the Trainer's gradient-accumulation fix) the
loss is the sum over this micro-batch divided by the tokens of the whole accumulated batch, else the mean over
the non-ignored tokens. The head weight is the model's own (`get_output_embeddings().weight`), tied or not, so
gradients reach the embedding when they are tied. Without `labels` the original forward runs unchanged
(inference, `logits_to_keep`, `generate`).

Differences from the unpatched forward: `logits` is None when labels are given; when every label is ignored
the loss is 0 with zero gradients (transformers' mean gives NaN); `logits_to_keep` together with labels is
rejected (the loss needs every position). Loss and gradients equal the unpatched model's to float32 rounding
(tests/test_integrations_transformers.py: rtol 1e-5, atol 1e-6 in float32).

Supported classes (`SUPPORTED_MODELS`): Gemma3ForCausalLM (final softcap honoured), LlamaForCausalLM (SmolLM2),
Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel. Anything else raises a TypeError naming them: another
architecture may do something after the head (a softcap, a scale) that a generic patch would silently miss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lmhead import checks
from lmhead.loss import linear_cross_entropy

__all__ = ["SUPPORTED_MODELS", "apply_fused_loss", "fused_loss", "has_fused_loss", "load_fused",
           "undo_fused_loss"]

# class name -> (attribute holding the body, config attribute of a final logit softcap or None). Each of these
# classes' forward is `body(...) -> last_hidden_state -> lm_head (-> softcap) -> ForCausalLMLoss`.
_ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "Gemma3ForCausalLM": ("model", "final_logit_softcapping"),
    "LlamaForCausalLM": ("model", None),
    "Qwen2ForCausalLM": ("model", None),
    "Qwen3ForCausalLM": ("model", None),
    "GPT2LMHeadModel": ("transformer", None),
}
SUPPORTED_MODELS: tuple[str, ...] = tuple(_ARCHITECTURES)

_STATE = "_lmhead_fused_loss"
# forward arguments the loss reads: they are not passed on to the body
_HEAD_ONLY = ("labels", "logits_to_keep")
_LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


@dataclass(frozen=True)
class _Patch:
    """What apply_fused_loss recorded on the instance: enough to run the loss path and to undo."""

    previous: Any  # the instance's own `forward` attribute before patching (None: the class's)
    signature: inspect.Signature  # of the class's forward, without self
    body: str
    softcap_attr: str | None
    chunk_size: int | None


def _resolve(model: Any) -> nn.Module:
    """The transformers model to patch: `model` itself, or the `.hf_model` of an lmhead Model."""
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "hf_model", None), nn.Module):
        model = model.hf_model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (nn.Module) or an lmhead Model, got "
                        f"{type(model).__name__}")
    return model


def _head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [V,D], bias [V] or None) of the model's output embedding; ValueError when it has no weight."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__}: the output embedding (lm_head) has no [V,D] weight "
                         f"(get_output_embeddings() returned {type(head).__name__})")
    if weight.is_meta:
        raise ValueError(f"{type(model).__name__}: the lm_head weight is on the meta device (not loaded)")
    bias = getattr(head, "bias", None)
    return weight, bias if isinstance(bias, Tensor) else None


def _check_supported(model: nn.Module) -> tuple[str, str | None]:
    """(body attribute, softcap attribute) of a supported class; TypeError naming the supported ones."""
    cls = type(model)
    spec = _ARCHITECTURES.get(cls.__name__)
    if spec is None or not cls.__module__.startswith("transformers."):
        raise TypeError(f"apply_fused_loss: {cls.__module__}.{cls.__name__} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODELS)} (transformers' own classes)")
    body = getattr(model, spec[0], None)
    if not isinstance(body, nn.Module):
        raise TypeError(f"{cls.__name__}: no body at .{spec[0]}")
    # The loss path passes the forward's arguments (all but labels / logits_to_keep) to the body, as the
    # original forward does; a transformers version whose forward takes other arguments is refused here.
    fwd = inspect.signature(cls.forward).parameters
    body_params = inspect.signature(body.forward).parameters
    body_any = any(p.kind == p.VAR_KEYWORD for p in body_params.values())
    extra = [n for n, p in fwd.items() if n != "self" and n not in _HEAD_ONLY
             and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n not in body_params and not body_any]
    if extra or not all(n in fwd for n in _HEAD_ONLY):
        raise TypeError(f"{cls.__name__}.forward in this transformers version does not have the layout lmhead "
                        f"patches (labels, logits_to_keep, and body arguments; unexpected: {extra})")
    return spec


def apply_fused_loss(model: Any, *, chunk_size: int | None = None) -> nn.Module:
    """Patch `model`'s forward so that with `labels` the loss is lmhead's fused `linear_cross_entropy` on the
    final hidden states [B,T,D] and the model's own head weight [V,D], and `logits` is None. Returns the
    patched transformers model (for an lmhead Model: its `.hf_model`). Patching twice is a no-op.

    chunk_size: rows per logits chunk of the loss (None: linear_cross_entropy's default).
    Raises TypeError for an unsupported class (the message lists `SUPPORTED_MODELS`), ValueError for a head
    without a weight."""
    model = _resolve(model)
    chunk_size = checks.optional_positive_int("chunk_size", chunk_size)
    if has_fused_loss(model):
        return model
    body, softcap_attr = _check_supported(model)
    _head(model)
    cls_forward = type(model).forward
    patch = _Patch(previous=model.__dict__.get("forward"),
                   signature=inspect.signature(cls_forward.__get__(model)),
                   body=body, softcap_attr=softcap_attr, chunk_size=chunk_size)

    # wraps(): inspect.signature() of the patched forward is the original's, which Trainer reads to keep the
    # dataset's columns and to see that the model accepts loss kwargs (num_items_in_batch).
    @functools.wraps(cls_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _forward(self, *args, **kwargs)

    object.__setattr__(model, _STATE, patch)
    object.__setattr__(model, "forward", types.MethodType(forward, model))
    return model


def undo_fused_loss(model: Any) -> nn.Module:
    """Restore the forward `apply_fused_loss` replaced. Returns the transformers model; a no-op if unpatched."""
    model = _resolve(model)
    patch = model.__dict__.pop(_STATE, None)
    if patch is not None:
        if patch.previous is None:
            model.__dict__.pop("forward", None)
        else:
            object.__setattr__(model, "forward", patch.previous)
    return model


def has_fused_loss(model: Any) -> bool:
    """Whether `apply_fused_loss` patched this model (and it was not undone)."""
    return _STATE in _resolve(model).__dict__


@contextlib.contextmanager
def fused_loss(model: Any, *, chunk_size: int | None = None) -> Iterator[nn.Module]:
    """`with fused_loss(model) as m:` — patched inside the block, restored after (if this call patched it)."""
    hf = _resolve(model)
    already = has_fused_loss(hf)
    apply_fused_loss(hf, chunk_size=chunk_size)
    try:
        yield hf
    finally:
        if not already:
            undo_fused_loss(hf)


def load_fused(name_or_path: str, *, chunk_size: int | None = None, **kwargs: Any) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)`, patched with `apply_fused_loss`."""
    from transformers import AutoModelForCausalLM

    return apply_fused_loss(AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs), chunk_size=chunk_size)


def _targets(labels: Any, name: str, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(labels, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids [B,T], got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of token ids (-100 = ignored), got {labels.dtype}")
    if tuple(labels.shape) != shape:
        raise ValueError(f"{name} must have shape [B,T] = {list(shape)} (the input's), got {list(labels.shape)}")
    return labels


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The patched forward: the original without labels; with them, body → hidden [B,T,D] → fused loss."""
    patch: _Patch = self.__dict__[_STATE]
    bound = patch.signature.bind(*args, **kwargs)
    if bound.arguments.get("labels") is None:
        if patch.previous is not None:
            return patch.previous(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    var_kw = next((n for n, p in patch.signature.parameters.items() if p.kind == p.VAR_KEYWORD), None)
    extra = dict(arguments.pop(var_kw, {})) if var_kw else {}
    labels = arguments.pop("labels")
    keep = arguments.pop("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ValueError("logits_to_keep must be 0 when labels are given: the loss covers every position")
    loss_kw = {k: extra.pop(k) for k in _LOSS_KWARGS if k in extra}
    config = getattr(self, "config", None)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)

    outputs = getattr(self, patch.body)(**arguments, **extra)
    hidden = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state  # [B,T,D]
    loss = _loss(self, patch, hidden, labels, loss_kw)
    out = _output(type(self), loss, outputs)
    return out if return_dict else out.to_tuple()


def _loss(model: nn.Module, patch: _Patch, hidden: Tensor, labels: Tensor, loss_kw: dict[str, Any]) -> Tensor:
    """transformers' ForCausalLMLoss (shift, ignore_index, num_items_in_batch) by linear_cross_entropy."""
    weight, bias = _head(model)
    shape = tuple(hidden.shape[:2])
    shift_labels = loss_kw.get("shift_labels")
    if shift_labels is not None:  # already shifted: position t is scored against shift_labels[t]
        targets, shift = _targets(shift_labels, "shift_labels", shape), False
    else:
        targets, shift = _targets(labels, "labels", shape), True
    softcap = getattr(model.config, patch.softcap_attr, None) if patch.softcap_attr else None
    items = loss_kw.get("num_items_in_batch")
    loss = linear_cross_entropy(hidden, weight, targets.to(hidden.device), bias=bias,
                                ignore_index=loss_kw.get("ignore_index", -100),
                                reduction="mean" if items is None else "sum",
                                softcap=softcap or None, shift=shift, chunk_size=patch.chunk_size)
    if items is not None:  # the sum over this micro-batch / the tokens of the whole accumulated batch
        loss = loss / (items.to(loss.device) if isinstance(items, Tensor) else items)
    return loss


def _output(cls: type, loss: Tensor, outputs: Any) -> Any:
    """The output the class's forward returns (CausalLMOutputWithPast, ...WithCrossAttentions for GPT-2), with
    the body's cache / hidden states / attentions, the loss, and logits None."""
    from transformers import modeling_outputs

    out_cls = (modeling_outputs.CausalLMOutputWithCrossAttentions if cls.__name__ == "GPT2LMHeadModel"
               else modeling_outputs.CausalLMOutputWithPast)
    names = {f.name for f in dataclasses.fields(out_cls)} - {"loss", "logits"}
    items = outputs.items() if hasattr(outputs, "items") else ()
    return out_cls(loss=loss, logits=None, **{k: v for k, v in items if k in names})

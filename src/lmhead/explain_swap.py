"""The head swap, shown: one final hidden state into the LM head and into a classification head.

    text ──template──▶ ids ──the body──▶ hidden [T,D] ──pooling (the head's: last by default)──▶ h [D]
        ├─▶ LM head W [V,D] (softcap)  ──softmax over V──▶ the next-token candidates (every token of the vocabulary)
        └─▶ swapped head C [K,D] + c   ──softmax over K──▶ the classes

Both heads read the same vector h; each is shown with its rows, its parameter count and its share of the model
(the body and the LM head as the model's file holds them: a tied head's rows are the embedding's, counted once
in the model, and shown as the head's). The swapped head of a Gemma 3 270M is 4 × 640 against 262,144 × 640.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lmhead.explain import JSONReady, token_texts
from lmhead.heads.classifier import ClassificationHead
from lmhead.heads.pooling import pooled_states, token_ids

__all__ = ["HeadRow", "HeadView", "Swap", "model_parameters", "render_swap", "swap"]


@dataclass
class HeadRow(JSONReady):
    label: str          # the token (whitespace visible) or the class name
    index: int          # the token id or the class index
    logit: float
    probability: float  # softmax over all of this head's rows


@dataclass
class HeadView(JSONReady):
    name: str           # "LM head" or "classification head"
    rows: int           # V or K
    width: int          # D
    parameters: int     # rows × width (+ bias)
    share: float        # parameters / the model's (body + LM head)
    tied: bool          # the LM head's rows are the embedding's
    top: list[HeadRow]  # the best rows, most probable first (all K for a classification head)


@dataclass
class Swap(JSONReady):
    model: str
    text: str
    prompt: str              # the text in the head's template
    pooling: str
    hidden_norm: float       # |h|
    model_parameters: int
    lm: HeadView
    swapped: HeadView


def model_parameters(model: Any) -> tuple[int, bool]:
    """(the model's parameters — body and LM head, a tied head counted once —, whether the head is tied): from
    its GGUF file's tensor table where it has one (nothing converted), else from transformers' modules."""
    path = getattr(model, "gguf_path", None)
    if path is not None:
        from lmhead.models.gguf_file import read_header

        _, tensors, _ = read_header(path)
        names = {t.name for t in tensors}
        total = sum(math.prod(int(d) for d in t.shape) for t in tensors if not t.name.startswith("cls."))
        return total, "output.weight" not in names
    hf = model.hf_model
    seen, total = set(), 0
    for p in hf.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel()
    out, inp = hf.get_output_embeddings(), hf.get_input_embeddings()
    return total, out is not None and inp is not None and out.weight is inp.weight


def _rows(logits: torch.Tensor, labels: list[str], ids: list[int], top: int) -> list[HeadRow]:
    probs = torch.softmax(logits.double(), dim=-1)
    order = torch.argsort(probs, descending=True)[:top].tolist()
    return [HeadRow(labels[i], ids[i], float(logits[i]), float(probs[i])) for i in order]


@torch.no_grad()
def swap(model: Any, text: str, head: ClassificationHead, top: int = 10) -> Swap:
    """The hidden state of `text` (in `head.template`, pooled by `head.pooling`) through the model's fp32 LM
    head (its `top` candidates of all V tokens) and through `head` (all K classes)."""
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1; got {top!r}")
    head.check_model(model)
    prompt = head.template.format(text=text)
    h = pooled_states(model, token_ids(model, [prompt]), head.pooling)         # [1,D]
    lm_logits = model.exact_head(h[:, None, :], logits_to_keep=1)[0, -1]      # [V], softcap included
    cls_logits = head(h)[0]                                                    # [K]
    total, tied = model_parameters(model)
    lm = model.exact_head
    lm_params = lm.vocab_size * lm.d_model + (0 if lm.bias is None else lm.vocab_size)
    probs = torch.softmax(lm_logits.double(), dim=-1)                         # over the full vocabulary
    best = torch.topk(lm_logits, min(top, lm_logits.numel())).indices.tolist()
    rows = [HeadRow(shown, i, float(lm_logits[i]), float(probs[i]))
            for i, (shown, _) in zip(best, token_texts(model.tokenizer, best), strict=True)]
    return Swap(
        model=getattr(model, "name", "model"), text=text, prompt=prompt, pooling=head.pooling,
        hidden_norm=float(h.norm()), model_parameters=total,
        lm=HeadView("LM head", lm.vocab_size, lm.d_model, lm_params, lm_params / total, tied, rows),
        swapped=HeadView("classification head", len(head.labels), head.width, head.num_parameters,
                         head.num_parameters / total, False,
                         _rows(cls_logits, head.labels, list(range(len(head.labels))), len(head.labels))))


def render_swap(s: Swap) -> str:
    """The terminal view of a `Swap`: the two heads side by side in turn, each with its size and share."""
    lines = [f"{s.model}: {s.prompt!r}  (pooling {s.pooling}, |h| = {s.hidden_norm:.3g}, "
             f"model {s.model_parameters:,} parameters)"]
    for view in (s.lm, s.swapped):
        tied = ", tied to the embedding" if view.tied else ""
        lines.append(f"  {view.name}: {view.rows:,} × {view.width} = {view.parameters:,} parameters "
                     f"({100 * view.share:.3g}% of the model{tied})")
        for r in view.top:
            lines.append(f"    {r.probability:8.2%}  {r.logit:9.3f}  {r.label}")
    return "\n".join(lines)

"""A classification head on the body: features [B,D] ──W [K,D] (+ b [K])──▶ logits [B,K] ──softmax──▶ classes.

    text ──template──▶ the body ──pooling (default "last")──▶ features [B,D] ──head──▶ K class probabilities

Where the head comes from:
  - `verbaliser(model, labels)`: the LM head's own rows of the label words (" sports", " science", ...) — the
    zero-shot classifier: the next-token logits of those K words after the template, and nothing else;
  - `from_file(model)`: a classification head stored in the model's GGUF file (`cls.output.*`, as llama.cpp's
    converter writes a reranker's or a classifier's; labels from `{arch}.classifier.output_labels`);
  - `train.train_head`: fitted on the frozen body's features with the fused loss;
  - `ClassificationHead.load(path)`: a saved head (safetensors: `weight`, `bias`, and its labels, pooling and
    template in the file's metadata).

Features are the final hidden state after the final norm, pooled, not normalised: the LM head reads that same
vector, so a verbaliser's rows and a trained head live in one space (`predict` takes `model.embed(...,
normalize=False)` or `features(...)`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lmhead.heads.pooling import POOLINGS, check_pooling, embed

__all__ = ["DEFAULT_TEMPLATE", "ClassificationHead", "classify", "features", "from_file", "head_rows", "label_token",
           "verbaliser"]

# what a classification prompt looks like when the caller gives none: the label word is the next token
DEFAULT_TEMPLATE = "Text: {text}\nTopic:"


class ClassificationHead(nn.Module):
    """`weight` [K,D] and `bias` [K] (or None) over pooled final hidden states; `labels` names the K rows.
    `pooling` and `template` say how texts become features (`features`)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, labels: Sequence[str], pooling: str = "last",
                 template: str = DEFAULT_TEMPLATE) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"weight must be [K, D]; got shape {tuple(weight.shape)}")
        if len(labels) != weight.shape[0]:
            raise ValueError(f"labels: {len(labels)} names for {weight.shape[0]} rows of weight")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be [{weight.shape[0]}]; got shape {tuple(bias.shape)}")
        check_pooling(pooling, POOLINGS[:3])
        if "{text}" not in template:
            raise ValueError(f"template must contain {{text}}; got {template!r}")
        self.weight = nn.Parameter(weight.detach().float().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())
        self.labels, self.pooling, self.template = [str(x) for x in labels], pooling, template

    @property
    def width(self) -> int:
        return int(self.weight.shape[1])

    @property
    def num_parameters(self) -> int:
        return self.weight.numel() + (0 if self.bias is None else self.bias.numel())

    def forward(self, features: Tensor) -> Tensor:
        """features [B,D] → logits [B,K]."""
        if features.shape[-1] != self.width:
            raise ValueError(f"features are {features.shape[-1]} wide; this head reads {self.width}")
        return nn.functional.linear(features.float(), self.weight, self.bias)

    @torch.no_grad()
    def predict(self, features: Tensor) -> Tensor:
        """features [B,D] → class probabilities [B,K] (rows sum to 1)."""
        return torch.softmax(self(features), dim=-1)

    def check_model(self, model: Any) -> None:
        """ValueError where the model's hidden state is not this head's width."""
        width = int(model.exact_head.d_model)
        if width != self.width:
            raise ValueError(f"the head is {self.width} wide but the model's hidden state is {width}")

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the head as safetensors (tensors `weight`, `bias`; metadata: labels, pooling, template),
        atomically; returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors = {"weight": self.weight.detach().contiguous()}
        if self.bias is not None:
            tensors["bias"] = self.bias.detach().contiguous()
        meta = {"labels": json.dumps(self.labels), "pooling": self.pooling, "template": self.template,
                "format": "lmhead-classification-head"}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClassificationHead:
        """A head written by `save` (ValueError naming the file where it is not one)."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"{path} is not a safetensors file: {e}") from None
        if "weight" not in tensors or "labels" not in meta:
            raise ValueError(f"{path} is not a classification head (no `weight` tensor or `labels` metadata)")
        return cls(tensors["weight"], tensors.get("bias"), json.loads(meta["labels"]),
                   pooling=meta.get("pooling", "last"), template=meta.get("template", DEFAULT_TEMPLATE))

    def extra_repr(self) -> str:
        return f"classes={len(self.labels)}, width={self.width}, bias={self.bias is not None}, pooling={self.pooling}"


def features(model: Any, texts: Sequence[str], pooling: str = "last", template: str = DEFAULT_TEMPLATE) -> Tensor:
    """The features a classification head reads: each text put into `template`, the body's final hidden state
    pooled by `pooling`, not normalised → [B,D] float32."""
    if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
        raise ValueError("texts must be a non-empty list of strings")
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise ValueError(f"texts[{i}] must be a non-empty string")
    return embed(model, [template.format(text=t) for t in texts], pooling=pooling, normalize=False)


def classify(model: Any, texts: Sequence[str], head: ClassificationHead | str | os.PathLike[str]) -> Tensor:
    """Class probabilities [B,K] of `texts` under `head` (a ClassificationHead or the path of a saved one),
    the features made as the head was trained (its template and pooling); ValueError where its width is not the
    model's."""
    if not isinstance(head, ClassificationHead):
        head = ClassificationHead.load(head)
    head.check_model(model)
    return head.predict(features(model, texts, pooling=head.pooling, template=head.template))


def label_token(model: Any, label: str) -> int:
    """The token the model would write first for the word `label` after a colon or a space: the first id of
    " " + label (the tokenizer's special tokens left out)."""
    ids = model.tokenizer.encode(" " + label.strip(), add_special_tokens=False)
    if not ids:
        raise ValueError(f"label {label!r} encodes to no tokens")
    return int(ids[0])


def head_rows(model: Any, ids: Sequence[int]) -> tuple[Tensor, Tensor | None]:
    """The LM head's rows `ids` → (weight [K,D], bias [K] or None), read from the file's codes where the head
    has them (no [V,D] float32 weight made)."""
    head = model.exact_head
    index = torch.tensor(list(ids), dtype=torch.long)
    product = getattr(head, "product", None)
    rows = product.rows(index) if product is not None and hasattr(product, "rows") else \
        head.weight.detach()[index].float()
    bias = None if head.bias is None else head.bias.detach()[index].float()
    return rows.clone(), bias


def verbaliser(model: Any, labels: Sequence[str], words: Sequence[str] | None = None, pooling: str = "last",
               template: str = DEFAULT_TEMPLATE) -> ClassificationHead:
    """The zero-shot classifier: a head whose rows are the LM head's rows of each label's word (`words`, default
    the labels themselves), so that its logits are the LM's next-token logits of those words after `template`
    (before the LM head's softcap, which does not change their order)."""
    words = list(labels if words is None else words)
    if len(words) != len(labels):
        raise ValueError(f"words: {len(words)} words for {len(labels)} labels")
    ids = [label_token(model, w) for w in words]
    if len(set(ids)) != len(ids):
        raise ValueError(f"two label words start with the same token ({ids}): the verbaliser needs distinct first "
                         "tokens; give other `words`, or start the head at random (start='random', --start random)")
    weight, bias = head_rows(model, ids)
    return ClassificationHead(weight, bias, labels, pooling=pooling, template=template)


def from_file(model: Any) -> ClassificationHead | None:
    """The classification head stored in the model's GGUF file (`cls.output.weight` [K,D], `cls.output.bias`;
    labels from `{arch}.classifier.output_labels`, else "0".."K-1"), or None where the file has none."""
    path = getattr(model, "gguf_path", None)
    if path is None:
        return None
    from lmhead.models.gguf_file import GGUFFile
    from lmhead.models.gguf_meta import read_metadata

    file = GGUFFile(Path(path))
    if "cls.output.weight" not in file.tensors:
        return None
    weight = file.dequantize("cls.output.weight")
    bias = file.dequantize("cls.output.bias") if "cls.output.bias" in file.tensors else None
    key = f"{file.architecture}.classifier.output_labels"
    labels = read_metadata(path, string_arrays={key})[0].get(key)
    if not isinstance(labels, list) or len(labels) != weight.shape[0]:
        labels = [str(i) for i in range(weight.shape[0])]
    return ClassificationHead(weight, bias, labels, pooling="last", template="{text}")

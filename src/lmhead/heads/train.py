"""Fit a classification head on the frozen body with the fused loss.

    texts ──template──▶ features [N,D] (the body once; cached on disk, keyed by the model, template, pooling and
        texts) ──split (seeded): train / held-out──▶ start W [K,D], b [K] (random, or the verbaliser: the LM
        head's rows of the label words = the zero-shot classifier)
        ──full-batch Adam on linear_cross_entropy(features, W, labels, b, label_smoothing) weighted per class
          + l2·|W|²/2 ──▶ after each step the held-out loss; the best step's head kept; stop after `patience`
          steps without improvement

The loss is lmhead's fused `linear_cross_entropy` (with K rows it is one chunk; the same code trains LM heads).
Class weights scale each example's loss by its class's weight and divide by the weights' sum (torch's
`cross_entropy(weight=...)` rule where label_smoothing is 0).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmhead.heads.classifier import DEFAULT_TEMPLATE, ClassificationHead, features, verbaliser
from lmhead.loss import linear_cross_entropy
from lmhead.models import cache

__all__ = ["TrainReport", "baselines", "cached_features", "head_loss", "read_labelled", "split", "train_head"]


@dataclass
class TrainReport:
    """What a fit did: steps run, the best step, the held-out loss and accuracy of the kept head and of its
    start, and each step's (train loss, held-out loss)."""

    steps: int
    best_step: int
    val_loss: float
    val_accuracy: float
    start_accuracy: float
    train_size: int
    val_size: int
    history: list[tuple[float, float]] = field(default_factory=list)


def head_loss(x: Tensor, weight: Tensor, bias: Tensor | None, y: Tensor, class_weights: Tensor | None = None,
              label_smoothing: float = 0.0, l2: float = 0.0) -> Tensor:
    """The objective: the fused cross-entropy of x [N,D] @ weight [K,D].T + bias against y [N], weighted per
    class (each example by class_weights[y], over their sum), plus l2·|weight|²/2."""
    if class_weights is None:
        loss = linear_cross_entropy(x, weight, y, bias=bias, label_smoothing=label_smoothing)
    else:
        per = linear_cross_entropy(x, weight, y, bias=bias, label_smoothing=label_smoothing, reduction="none")
        w = class_weights[y]
        loss = (per * w).sum() / w.sum()
    return loss + 0.5 * l2 * weight.pow(2).sum() if l2 else loss


def split(n: int, val_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(train indices, held-out indices): a seeded permutation, the last ⌈n·val_fraction⌉ held out."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = max(1, math.ceil(n * val_fraction)) if val_fraction > 0 else 0
    return perm[:n - k], perm[n - k:]


def cached_features(model: Any, texts: Sequence[str], pooling: str, template: str, use_cache: bool = True) -> Tensor:
    """`classifier.features(...)`, read from `<cache>/features/` when this model, template, pooling and texts
    were computed before (written atomically there; models outside lmhead's cache compute every time)."""
    key = hashlib.sha256(json.dumps([pooling, template, list(texts)]).encode()).hexdigest()[:32]
    path = cache.derived_path(getattr(model, "path", None), "features", key) if use_cache else None
    if path is not None:
        stored = cache.read_tensors(path)
        if stored is not None and "features" in stored[0]:
            return stored[0]["features"]
    x = features(model, texts, pooling=pooling, template=template)
    if path is not None:
        cache.write_tensors(path, {"features": x.contiguous()})
    return x


def _check_labels(texts: Sequence[str], labels: Sequence[Any], label_names: Sequence[str] | None
                  ) -> tuple[list[str], Tensor]:
    if isinstance(texts, str) or not isinstance(texts, Sequence) or len(texts) < 2:
        raise ValueError("texts must be a list of at least 2 strings")
    if len(labels) != len(texts):
        raise ValueError(f"labels: {len(labels)} labels for {len(texts)} texts")
    names = list(label_names) if label_names is not None else sorted({str(x) for x in labels})
    if len(names) < 2:
        raise ValueError(f"labels must hold at least 2 classes; got {names}")
    index = {n: i for i, n in enumerate(names)}
    ys = []
    for i, x in enumerate(labels):
        if isinstance(x, int) and not isinstance(x, bool) and label_names is not None and 0 <= x < len(names):
            ys.append(x)
        elif str(x) in index:
            ys.append(index[str(x)])
        else:
            raise ValueError(f"labels[{i}] = {x!r} is not one of {names}")
    return names, torch.tensor(ys, dtype=torch.long)


def _class_weights(spec: Any, y: Tensor, k: int) -> Tensor | None:
    if spec is None:
        return None
    if spec == "balanced":  # scikit-learn's rule: n / (K · count)
        counts = torch.bincount(y, minlength=k).float()
        return torch.where(counts > 0, len(y) / (k * counts.clamp(min=1)), torch.zeros_like(counts))
    w = torch.as_tensor(spec, dtype=torch.float32)
    if w.shape != (k,) or bool((w < 0).any()) or not bool((w > 0).any()):
        raise ValueError(f"class_weights must be 'balanced' or {k} weights >= 0, not all 0")
    return w


def _accuracy(head_w: Tensor, head_b: Tensor | None, x: Tensor, y: Tensor) -> float:
    logits = x @ head_w.T + (0 if head_b is None else head_b)
    return float((logits.argmax(-1) == y).float().mean()) if len(y) else float("nan")


def train_head(model: Any, texts: Sequence[str], labels: Sequence[Any], label_names: Sequence[str] | None = None,
               start: str = "verbaliser", words: Sequence[str] | None = None, template: str = DEFAULT_TEMPLATE,
               pooling: str = "last", label_smoothing: float = 0.0, class_weights: Any = None,
               l2: float = 1e-3, lr: float = 1e-3, max_steps: int = 500, patience: int = 50,
               val_fraction: float = 0.2, seed: int = 0, progress: bool = True, use_cache: bool = True,
               x: Tensor | None = None) -> ClassificationHead:
    """A classification head [K,D] + bias fitted on the frozen body's pooled features of `texts` (see the
    module's docstring). `labels`: one per text (names, or indices into `label_names`); `label_names`: the
    classes in order (default: the labels' names sorted). `start`: "verbaliser" (the LM head's rows of
    `words`, default the label names) or "random" (seeded). `x`: features already computed (else
    `cached_features`). The returned head's `report` is a `TrainReport`."""
    names, y = _check_labels(texts, labels, label_names)
    k = len(names)
    if start not in ("verbaliser", "random"):
        raise ValueError(f"start must be one of verbaliser, random; got {start!r}")
    if not 0 <= label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")
    for name, value in (("max_steps", max_steps), ("patience", patience)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    if not (lr > 0 and l2 >= 0):
        raise ValueError(f"lr must be > 0 and l2 >= 0; got lr={lr}, l2={l2}")
    x = cached_features(model, texts, pooling, template, use_cache) if x is None else x.float()
    cw = _class_weights(class_weights, y, k)
    tr, va = split(len(y), val_fraction, seed)
    if start == "verbaliser":
        first = verbaliser(model, names, words=words, pooling=pooling, template=template)
        w0 = first.weight.detach()
        b0 = torch.zeros(k) if first.bias is None else first.bias.detach()
    else:
        g = torch.Generator().manual_seed(seed)
        w0 = torch.randn(k, x.shape[1], generator=g) * (1.0 / math.sqrt(x.shape[1])) / x.norm(dim=1).mean()
        b0 = torch.zeros(k)
    weight = w0.clone().requires_grad_(True)
    bias = b0.clone().requires_grad_(True)
    # Adam's steps are in the weights' units: scale the rate to the start's rows (the LM head's are ~0.05)
    step = lr * float(w0.abs().mean()) / 1e-2 if start == "verbaliser" else lr
    opt = torch.optim.Adam([weight, bias], lr=step)
    xt, yt, xv, yv = x[tr], y[tr], x[va], y[va]
    held = len(va) > 0
    start_acc = _accuracy(w0, b0, xv if held else xt, yv if held else yt)
    best = (float("inf"), 0, w0.clone(), b0.clone())
    history: list[tuple[float, float]] = []
    bar = _bar(max_steps, progress)
    for s in range(1, max_steps + 1):
        opt.zero_grad()
        loss = head_loss(xt, weight, bias, yt, cw, label_smoothing, l2)
        loss.backward()
        opt.step()
        with torch.no_grad():
            val = float(head_loss(xv, weight, bias, yv, cw, label_smoothing)) if held else float(loss)
        history.append((loss.item(), val))
        if val < best[0]:
            best = (val, s, weight.detach().clone(), bias.detach().clone())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}", held_out=f"{val:.4f}")
        if s - best[1] >= patience:
            break
    if bar is not None:
        bar.close()
    head = ClassificationHead(best[2], best[3], names, pooling=pooling, template=template)
    head.report = TrainReport(steps=len(history), best_step=best[1], val_loss=best[0],
                              val_accuracy=_accuracy(best[2], best[3], xv if held else xt, yv if held else yt),
                              start_accuracy=start_acc, train_size=len(tr), val_size=len(va), history=history)
    return head


def _bar(total: int, progress: bool):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="training the head", unit="step", leave=False)


def read_labelled(path: str | Path) -> tuple[list[str], list[str]]:
    """(texts, labels) of a JSONL file, one {"text": ..., "label": ...} a line (blank lines skipped); ValueError
    naming the file and line where a line is not JSON, or lacks a non-empty text or a label."""
    texts, labels = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text (a JSONL file of {{\"text\", \"label\"}} lines)") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {n}: not JSON ({exc.msg}); each line must be "
                             f"{{\"text\": ..., \"label\": ...}}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n}: a JSON object {{\"text\": ..., \"label\": ...}} is needed")
        if not isinstance(row.get("text"), str) or not row["text"]:
            raise ValueError(f"{path} line {n}: \"text\" is missing or not a non-empty string")
        if row.get("label") is None or isinstance(row["label"], (dict, list)):
            raise ValueError(f"{path} line {n}: \"label\" is missing (a string or a number)")
        texts.append(row["text"])
        labels.append(str(row["label"]))
    if len(set(labels)) < 2:
        raise ValueError(f"{path}: {len(texts)} labelled lines of {len(set(labels))} class(es); at least 2 "
                         "classes are needed")
    return texts, labels


def baselines(model: Any, head: ClassificationHead, x: Tensor, labels: Sequence[Any], val_fraction: float = 0.2,
              seed: int = 0, words: Sequence[str] | None = None) -> dict[str, float | None]:
    """Held-out accuracies on the split `train_head` made (same `val_fraction`, `seed`): the trained head's,
    the zero-shot verbaliser's (the LM head's rows of the label words), and scikit-learn's LogisticRegression
    fitted on the same training features (None where scikit-learn is not installed)."""
    names, y = _check_labels([""] * len(labels), labels, head.labels)
    tr, va = split(len(y), val_fraction, seed)
    idx = va if len(va) else tr
    zero = verbaliser(model, names, words=words, pooling=head.pooling, template=head.template)
    out: dict[str, float | None] = {
        "head": _accuracy(head.weight.detach(), None if head.bias is None else head.bias.detach(), x[idx], y[idx]),
        "zero_shot": _accuracy(zero.weight.detach(), None if zero.bias is None else zero.bias.detach(), x[idx],
                               y[idx]),
        "logistic_regression": None}
    try:
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        return out
    fit = LogisticRegression(max_iter=2000).fit(x[tr].numpy(), y[tr].numpy())
    out["logistic_regression"] = float(fit.score(x[idx].numpy(), y[idx].numpy()))
    return out

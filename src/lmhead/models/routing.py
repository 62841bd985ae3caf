"""The router's choice for the last token of a text, layer by layer: which experts, with what weights — the
explainer's view of a mixture of experts.

    ids [T] ──the lean body's torch forward (a cache of its own)──▶ each MoE layer's routing of the last position
        ──▶ [ExpertChoice(layer, experts [k], weights [k], probabilities [E])]

The routing is the one the step itself computes (`MoE.route`, read while the forward runs), not a second
computation beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ExpertChoice", "router_choices"]


@dataclass(frozen=True)
class ExpertChoice:
    """One layer's routing of a token: the chosen `experts` (by descending probability), the `weights` their
    outputs are scaled by (renormalised or not, by the family's rule), and the softmax `probabilities` over all
    of the layer's experts."""

    layer: int
    experts: list[int]
    weights: list[float]
    probabilities: list[float]


def router_choices(lean: Any, ids: Tensor | list[int]) -> list[ExpertChoice]:
    """The router's choice for the last of `ids` ([T] or [1, T] token ids) in every mixture-of-experts layer of
    `lean` (a `LeanBody`; `Model.lean`), in layer order; [] for a model without experts."""
    ids = torch.as_tensor(ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be a non-empty [T] or [1, T] tensor of token ids, got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    layers = [(i, layer.moe) for i, layer in enumerate(lean.layers) if layer.moe is not None]
    if not layers:
        return []
    seen: dict[int, Any] = {}
    for i, moe in layers:  # the method read at each call: an instance attribute answers first
        moe.route = (lambda h, i=i, route=moe.route: seen.setdefault(i, route(h)))
    try:
        t = ids.numel()
        lean(ids[None].long(), torch.arange(t)[None], lean.new_cache(1, t), layers=[])  # the torch forward
    finally:
        for _, moe in layers:
            del moe.route
    out = []
    for i, _ in layers:
        r = seen[i]
        out.append(ExpertChoice(layer=i, experts=r.experts[-1].tolist(), weights=r.weights[-1].tolist(),
                                probabilities=torch.softmax(r.logits[-1], dim=-1, dtype=torch.float32).tolist()))
    return out

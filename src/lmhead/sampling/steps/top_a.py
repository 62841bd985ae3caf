"""Top-a, a cut-off of stage 4 (after min-p in lmhead's order): tokens with p < top_a · p_max² are dropped.

Where min-p's threshold is linear in the top probability, top-a's is quadratic: a confident row (p_max near 1)
is cut almost as hard as min-p at the same value, a flat row (small p_max) hardly at all. As
text-generation-webui's ``TopALogitsWarper`` (modules/sampler_hijack.py) and koboldcpp's top-a sampler define
it: p = softmax(x) of the row as it reaches the step, the most probable token always kept (p_max ≥ a·p_max² for
a ≤ 1, so without a special case).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lmhead.sampling.steps.base import Context, Step, param_rows, real_param
from lmhead.sampling.vocab import NEG_INF, Vocab

PARAMS = (
    real_param("top_a", 0.0, 0.0, 1.0, "text-generation-webui / koboldcpp top-a: keeps tokens with "
               "p ≥ top_a · p_max².", "0 = off"),
)


def top_a_rows(x: Tensor, top_a: float | Tensor, vocab: Vocab) -> Tensor:
    """Top-a on whole rows [b,V_r]: p = softmax(x) (float32, as min-p's), tokens below top_a · p_max² at -inf."""
    probs = vocab.softmax(x)
    top = vocab.amax(probs)
    return x.masked_fill(probs < top_a * top * top, NEG_INF)


def _apply(x: Tensor, cfg: Any, ctx: Context) -> Tensor:
    return top_a_rows(x, cfg.top_a, Vocab(x.shape[1]))


def _rows(x: Tensor, cfgs: Any, ctxs: Any) -> Tensor:
    return top_a_rows(x, param_rows(cfgs, "top_a", x), Vocab(x.shape[1]))


STEPS = (
    Step("top_a", ("top_a",), 4, lambda c: c.top_a > 0.0, True, "below top_a · p_max²", _apply,
         "text-generation-webui TopALogitsWarper; koboldcpp top-a", aliases=("top-a",), after="min_p",
         example=(("top_a", 0.2),), rows=_rows),
)

"""What the explainer shows: plain data for the CLI and the server.

    prompt ──tokenizer──▶ ids [1,T] ──Model.body──▶ hidden [1,T,D] ──(last position) Model.head──▶ logits [V]
        ──sampling pipeline (bias/penalties → temperature → top-k → top-p → min-p → softmax)──▶ probabilities [V]

Every function takes an `lmhead.Model` and runs its `body`, the same body `generate` runs (oneDNN linears by
default, see `lmhead.models.fast_linear`); the model's parts (final norm, context length) come from
`lmhead.models` (`parts.py`), never looked up here.

`predict` returns the next-token candidates with both distributions (raw: softmax at temperature 1 of the
model's logits; processed: after the whole pipeline), which cut removed which token, the entropies and the
number of tokens kept. Everything is computed over the full vocabulary with `lmhead.sampling`; only the
display is truncated to the top N. The logits are the full-precision head's (`Model.exact_head`, fp32), so
every number shown is the model's own, whatever head `generate` decodes with (a compressed head's
normaliser includes its approximate tail); `head="decode"` shows what that decode head computes instead.

`predict(..., layers=True)` adds the logit lens: the final norm and the head applied to the residual stream
after every layer (at the last position) — what the model would say if it stopped there.

`perplexity` / `evaluate` / `score_tokens` score a text with the model's full-precision head
(`Model.exact_head`): exp of the mean next-token loss, computed with
`linear_cross_entropy` on the body's hidden states (never the full [T,V] logits), in sliding windows for long
texts; and per token its log-probability and rank (the GLTR view).

All results are dataclasses with `.to_dict()` giving JSON-ready values (no NaN/inf: -inf becomes None).

Layout of this package, each module importing only the ones before it: ``tokens`` (showing tokens) → ``records``
(the result dataclasses, ``JSONReady``) → ``inputs`` (the model's name, device, a text's ids, ``explain_head``) →
``lens`` (the logit lens, ``lens_logits``) → ``predict`` (``predict``, ``pipeline_stages``, ``step_rows``) →
``perplexity`` (``evaluate``, ``perplexity``, ``score_tokens``, ``windows``, ``text_segments``).
"""

from __future__ import annotations

from lmhead.explain.inputs import EXPLAIN_HEADS, explain_head
from lmhead.explain.lens import lens_logits
from lmhead.explain.perplexity import DEFAULT_WINDOW, evaluate, perplexity, score_tokens, text_segments, windows
from lmhead.explain.predict import pipeline_stages, predict, step_rows
from lmhead.explain.records import (
    Candidate,
    Evaluation,
    JSONReady,
    LensCandidate,
    LensLayer,
    Prediction,
    PromptToken,
    TokenScore,
    json_ready,
)
from lmhead.explain.tokens import token_texts, visible

__all__ = [
    "DEFAULT_WINDOW", "EXPLAIN_HEADS", "Candidate", "Evaluation", "JSONReady", "LensCandidate", "LensLayer",
    "Prediction", "PromptToken", "TokenScore", "evaluate", "explain_head", "json_ready", "lens_logits", "perplexity",
    "pipeline_stages", "predict", "score_tokens", "step_rows", "text_segments", "token_texts", "visible", "windows",
]

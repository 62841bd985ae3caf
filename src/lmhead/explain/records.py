"""The explainer's results as dataclasses, each JSON-ready by `to_dict()` (-inf/inf/NaN as None)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


def _num(x: float | None) -> float | None:
    """JSON-safe float: None for -inf/inf/NaN."""
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def json_ready(obj: Any) -> Any:
    """obj as JSON-ready data: dataclasses as dicts (nested too), tuples as lists, -inf/inf/NaN as None."""
    if dataclasses.is_dataclass(obj):
        return {f.name: json_ready(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


class JSONReady:
    """Mixin for result dataclasses: `to_dict()` gives `json_ready(self)`."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (nested dataclasses as dicts; -inf/inf/NaN as None)."""
        return json_ready(self)


@dataclass
class PromptToken(JSONReady):
    token_id: int
    text: str  # whitespace made visible, specials by name
    decoded: str  # the token decoded on its own, as is


@dataclass
class Candidate(JSONReady):
    """One next-token candidate. Probabilities are over the full vocabulary."""

    rank: int  # 1 = best, by the pipeline's order (logit after bias/penalties)
    token_id: int
    text: str
    decoded: str
    logit: float  # the model's logit (after softcap if any), before any processing
    scaled_logit: float  # after bias/penalties, divided by the temperature (T=0: not divided; greedy is argmax)
    raw_probability: float  # softmax(logit), temperature 1, nothing cut
    scaled_probability: float  # softmax(scaled_logit): the distribution top-p and min-p look at
    probability: float  # after the whole pipeline; 0 for cut tokens
    kept: bool
    kept_bias: bool  # survived logit bias / banned tokens (False: banned, logit -inf)
    kept_top_k: bool  # still in after top-k (pipeline order, so False also when an earlier step cut it)
    kept_top_p: bool
    kept_min_p: bool
    cut_by: str | None  # first step that removed it: "constraint", "bias", "greedy", "top_k", "top_p", "min_p";
    # None if kept
    cumulative: float  # running sum of `probability` down the list (processed mass up to this row)
    raw_cumulative: float  # running sum of `raw_probability`
    scaled_cumulative: float  # running sum of `scaled_probability` (what top-p compares with p)


@dataclass
class LensCandidate(JSONReady):
    token_id: int
    text: str
    logit: float
    probability: float  # softmax at temperature 1 over the full vocabulary


@dataclass
class LensLayer(JSONReady):
    """The logit lens at one depth: final norm + head on the residual stream after `layer` blocks."""

    layer: int  # 0 = embeddings, L = output of the last block (= the model's own logits)
    candidates: list[LensCandidate]
    entropy: float  # nats, full vocabulary
    kl_to_final: float  # KL(final || this layer), nats
    final_token_probability: float  # probability of the final layer's top-1 token at this layer
    final_token_rank: int  # its rank here (1 = top)


@dataclass
class Prediction(JSONReady):
    """Everything `predict` computed. `to_dict()` is the JSON the CLI and server print."""

    model: str
    prompt: str
    prompt_tokens: list[PromptToken]
    candidates: list[Candidate]
    entropy: dict[str, float]  # raw (T=1, nothing cut), scaled (after temperature, before cuts), processed
    kept_count: int  # tokens with probability > 0 after the pipeline, full vocabulary
    vocab_size: int
    logsumexp: float  # log-sum-exp of the raw logits over the full vocabulary: raw p = exp(logit - logsumexp)
    scaled_logsumexp: float  # log-sum-exp of the scaled logits (scaled p = exp(scaled_logit - this))
    config: dict[str, Any]
    layers: list[LensLayer] | None = None
    head: str = "fp32"  # the head whose logits these are: "fp32" (the model's own), else the decode head's mode
    # every step the config runs, in order, from its declaration (lmhead.sampling.steps): name, its parameters'
    # values, how many tokens it cut (of those still in), why it cuts (the explainer's reason) and its origin
    steps: list[dict[str, Any]] = field(default_factory=list)
    constraint: str | None = None  # the structured-output constraint applied first (its description), if any


@dataclass
class TokenScore(JSONReady):
    position: int
    token_id: int
    text: str
    decoded: str
    segment: str  # the part of the input text this token covers; joined over all tokens: the text itself
    logprob: float | None  # log p(token | tokens before it); None for the first token (nothing predicts it)
    rank: int | None  # 1 + number of tokens with a larger logit; None for the first token


@dataclass
class Evaluation(JSONReady):
    model: str
    perplexity: float
    loss: float  # mean next-token negative log-likelihood, nats
    token_count: int  # tokens in the text (with BOS if the tokenizer adds it)
    scored_count: int  # tokens that were predicted (token_count - 1 unless stride == window)
    window: int
    stride: int
    windows: int
    tokens: list[TokenScore] | None = None

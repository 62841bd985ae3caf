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
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmhead import checks


def _accepts_parts(fn):
    """Also accept the older call form fn(hf_model, tokenizer, head, text, ...): the three are wrapped in a
    `Model` that runs transformers' own modules with that head (`Model.from_parts`), as that form did."""

    @functools.wraps(fn)
    def call(model, *args, **kwargs):
        from lmhead.models.model import Model

        if not isinstance(model, Model) and len(args) >= 2 and hasattr(model, "config"):
            model, args = Model.from_parts(model, args[0], args[1]), args[2:]
        return fn(model, *args, **kwargs)

    return call

# ---------------------------------------------------------------------------------------------------------
# Showing tokens

_VISIBLE = {" ": "·", "\n": "↵", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """`text` with whitespace made visible: space "·", newline "↵", tab "⇥", CR "␍", other controls "\\xNN"."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (bytes_to_unicode), inverted: vocabulary character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _hex_bytes(err: UnicodeDecodeError) -> tuple[str, int]:
    return "".join(f"<0x{b:02X}>" for b in err.object[err.start:err.end]), err.end


codecs.register_error("lmhead_hex", _hex_bytes)


def _piece_text(piece: str, decoded: str) -> str:
    """A token that is only part of a UTF-8 character: its bytes, valid UTF-8 as text, the rest "<0xNN>"."""
    table = _byte_decoder()
    if piece and all(ch in table for ch in piece):  # byte-level BPE (GPT-2, Llama 3, SmolLM): piece = bytes
        return visible(bytes(table[ch] for ch in piece).decode("utf-8", errors="lmhead_hex"))
    return piece or visible(decoded)  # e.g. SentencePiece byte fallback: the piece is already "<0xE2>"


def _special_ids(tokenizer) -> set[int]:
    return {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])}


def token_texts(tokenizer, token_ids: Sequence[int]) -> list[tuple[str, str]]:
    """(visible, decoded) text of each token on its own.

    decoded: the token decoded alone (`tokenizer.decode([id])`, specials kept). visible: special tokens as
    their name (e.g. "<bos>"), whitespace made visible (`visible`), and tokens that are only part of a
    UTF-8 character (they decode to "�") as their bytes, e.g. "<0xE2><0x80>" (or the vocabulary piece).
    """
    specials = _special_ids(tokenizer)
    out = []
    for tid in token_ids:
        tid = int(tid)
        decoded = tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tid in specials:
            shown = tokenizer.convert_ids_to_tokens(tid) or decoded
        elif "\ufffd" in decoded:
            shown = _piece_text(tokenizer.convert_ids_to_tokens(tid) or "", decoded)
        else:
            shown = visible(decoded)
        out.append((shown, decoded))
    return out


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


# ---------------------------------------------------------------------------------------------------------
# Results


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


# ---------------------------------------------------------------------------------------------------------
# Inputs


def _model_name(model, name: str | None) -> str:
    return name or model.name


def _device(model) -> torch.device:
    return model.device


def _encode(tokenizer, text: str, what: str) -> list[int]:
    if not isinstance(text, str):
        raise TypeError(f"{what}: expected a string, got {type(text).__name__}")
    if not text:
        raise ValueError(f"{what}: must be a non-empty string")
    ids = tokenizer.encode(text)  # transformers' tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"{what}: encodes to no tokens")
    return [int(i) for i in ids]


def _config_dict(config) -> dict[str, Any]:
    """The config as JSON-ready data (logit_bias keys as strings, -inf bans as None via to_dict)."""
    d = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if d.get("logit_bias") is not None:
        d["logit_bias"] = {str(k): float(v) for k, v in dict(d["logit_bias"]).items()}
    if d.get("banned_tokens") is not None:
        d["banned_tokens"] = [int(t) for t in d["banned_tokens"]]
    return d


# ---------------------------------------------------------------------------------------------------------
# predict


EXPLAIN_HEADS: tuple[str, ...] = ("exact", "decode")


def explain_head(model, head: str = "exact"):
    """(head module, its mode name) whose logits the explainer shows: "exact" (the default) is the model's
    full-precision head `Model.exact_head` ("fp32"); "decode" is `Model.head`, the head `generate` decodes
    with (e.g. "exact-int8": its top `exact_k` logits are exact, the rest approximate)."""
    from lmhead.models.heads import mode_of

    if head == "exact":
        return model.exact_head, "fp32"
    if head == "decode":
        return model.head, mode_of(model.head)
    raise ValueError(f"head: must be one of {', '.join(EXPLAIN_HEADS)}; got {head!r}")


@torch.inference_mode()
@_accepts_parts
def predict(model, prompt: str, top: int = 10, config=None, layers: bool = False, layer_top: int = 5,
            model_name: str | None = None, head: str = "exact", constraint=None,
            constraint_from: int | None = None) -> Prediction:
    """The next-token candidates for `prompt`, with both distributions and what each cut did.

    model: an `lmhead.Model`; its `body` runs the prompt (the body `generate` runs) and its full-precision
    head `exact_head` gives the last position's logits [1,V] (head="decode": the model's decode head
    `Model.head` instead, asked for `top` exact tokens — what a compressed head computes; see `explain_head`).
    Pipeline (lmhead.sampling, full vocabulary [V]): 1 logit bias / banned → 2 penalties (the prompt counts
    as the sequence so far: repetition penalty applies to it, presence/frequency count generated tokens only,
    so they do nothing here) → 3 temperature → 4 top-k → 5 top-p → 6 min-p → 7 softmax.
    `probability` equals `sampling.probabilities(logits, config, prev_tokens=prompt, prompt_len=len(prompt))`
    to float32 rounding: the probabilities and entropies shown (raw, scaled, processed, the lens') are
    computed from the float32 logits in float64, because torch's float32 softmax on CPU is off by up to ~2e-5 relative
    (measured on SmolLM2's logits), more than the 1e-5 the explainer promises against transformers.

    Temperature 0 (greedy): `scaled_logit` is the logit after bias/penalties, not divided (the argmax does
    not depend on the scale); `scaled_probability` is then softmax at temperature 1; the argmax gets
    probability 1 and every other token is cut by "greedy". Candidates are sorted by the pipeline's logit
    (after bias/penalties; ties by raw logit, then token id), so the kept tokens are a prefix of the list.

    top: candidates shown (1..V). layers: add the logit lens (`layer_top` candidates per layer), with the
    same head. constraint: a structured-output constraint (`lmhead.constrain`) for the answer that starts after
    the prompt: its mask is step 0, before bias — tokens it forbids are cut by "constraint" (their raw
    probability stays the model's own) and every later step sees the constrained logits, as `generate` does.
    constraint_from: where that answer starts, in characters of the prompt (default: after it), as `generate`'s:
    the answer so far is tokenized on its own and the mask is its next token's.
    """
    from lmhead.sampling import SamplingConfig, process_logits
    from lmhead.sampling.steps.masks import withhold_stops

    if config is None:
        config = SamplingConfig()
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config: expected a SamplingConfig, got {type(config).__name__}")
    config = withhold_stops(config, getattr(model, "eos_token_ids", ()))  # what the next draw follows (generate)
    head, head_name = explain_head(model, head)
    vocab = model.vocab_size
    top = min(checks.positive_int("top", top), vocab)
    checks.positive_int("layer_top", layer_top)

    ids = _encode(model.tokenizer, prompt, "prompt")
    start = None
    if constraint is not None and constraint_from is not None:
        from lmhead.constrain import split_answer

        ids, start = split_answer(model.tokenizer, prompt, constraint_from)
    ctx = model.context_length
    if ctx is not None and len(ids) > ctx:
        raise ValueError(f"prompt: {len(ids)} tokens is longer than the model's context of {ctx} tokens")
    input_ids = torch.tensor([ids], device=_device(model))
    if layers:
        states, last = model.layer_states(input_ids)
    else:
        states, last = None, model.hidden_states(input_ids)
    # a head that approximates all but its top `exact_k` (lmhead.compressed) is asked for every candidate shown
    exact_k = top if top > head.exact_k else None
    logits = head(last[:, -1:], exact_k=exact_k).reshape(1, vocab).float()  # [1,V]

    prev = input_ids.to(logits.device)
    masked = _constrained(model, logits, constraint, ids, start)  # step 0: the constraint's mask (or the logits)
    stages = pipeline_stages(masked, config, prev, len(ids))
    stages["after_constraint"] = masked
    processed = process_logits(masked, config, prev_tokens=prev, prompt_len=len(ids))  # [1,V]
    probs = torch.softmax(processed[0].double(), dim=-1)  # [V]: step 7 of the pipeline, in float64 (see above)
    cuts = _cut_names(config) if constraint is None else ("constraint", *_cut_names(config))
    candidates = _candidates(model.tokenizer, logits[0], stages, processed[0], probs, top, cuts)
    scaled = stages["scaled"][0]
    ent = _entropies(torch.stack([logits[0], scaled, processed[0]]))
    prompt_tokens = [PromptToken(token_id=i, text=s, decoded=d)
                     for i, (s, d) in zip(ids, token_texts(model.tokenizer, ids), strict=True)]
    lens = None
    if layers:
        rows = _lens_rows(model.final_norm, head, states, last)
        lens = _logit_lens(rows, model.tokenizer, layer_top)
    return Prediction(
        model=_model_name(model, model_name), prompt=prompt, prompt_tokens=prompt_tokens,
        candidates=candidates,
        entropy={"raw": float(ent[0]), "scaled": float(ent[1]), "processed": float(ent[2])},
        kept_count=int(torch.isfinite(processed[0]).sum()), vocab_size=vocab,
        logsumexp=float(torch.logsumexp(logits[0], dim=-1)), scaled_logsumexp=float(torch.logsumexp(scaled, dim=-1)),
        config=_config_dict(config), layers=lens, head=head_name, steps=step_rows(config, stages),
        constraint=None if constraint is None else constraint.describe(),
    )


def _constrained(model, logits: torch.Tensor, constraint, ids: list[int], start: int | None) -> torch.Tensor:
    """logits [1,V] with -inf where `constraint` forbids the answer's next token (a copy; the answer so far is
    ids[start:]); `logits` when None."""
    if constraint is None:
        return logits
    from lmhead.constrain import apply_bitmask_, for_rows

    matcher = for_rows(model, constraint, 1)[0]
    if start is not None:
        matcher.advance(ids[start:])
    bits = matcher.bits()
    return apply_bitmask_(logits.clone(), bits[None])


_CUTS = ("bias", "greedy", "top_k", "top_p", "min_p")  # the batch path's cuts, in its order


def _stage_name(step) -> str:
    return "bias" if step.name == "logit_bias" else step.name


def _cut_names(config) -> tuple[str, ...]:
    """The names `cut_by` can take for this config, in pipeline order: the batch path's, or every declared step
    the config runs (``SamplingConfig.steps()``; its masks' first as "bias"), then "greedy"."""
    if config.runs_on("batch"):
        return _CUTS
    names = [_stage_name(s) for s in config.steps()]
    return (*names, "greedy") if config.is_greedy else tuple(names)


def step_rows(config, stages: dict[str, torch.Tensor], left: bool = False) -> list[dict[str, Any]]:
    """One entry per step the config runs: its declared name, parameters, reason and origin, and the tokens it
    cut (finite before it, -inf after it; 0 for a step that reshapes rather than cuts). `stages`: from
    `pipeline_stages`. left: also the tokens still in after each step ("left")."""
    rows, before = [], torch.isfinite(stages["raw"][0]) if "raw" in stages else None
    for s in config.steps():
        after = stages.get(f"after_{_stage_name(s)}")
        cut = 0
        if after is not None and before is not None:
            now = torch.isfinite(after[0])
            cut, before = int((before & ~now).sum()), now
        rows.append({"name": s.name, "params": {n: _json_value(getattr(config, n)) for n in s.params},
                     "cut": cut, "reason": s.explain, "origin": s.origin, "stage": s.stage})
        if left:
            rows[-1]["left"] = None if before is None else int(before.sum())
    return rows


def _json_value(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    if hasattr(v, "items"):
        return {str(k): float(x) for k, x in v.items()}
    return v


def _candidates(tokenizer, logits: torch.Tensor, stages: dict[str, torch.Tensor], processed: torch.Tensor,
                probs: torch.Tensor, top: int, cuts: tuple[str, ...] = _CUTS) -> list[Candidate]:
    """The `top` best candidates of one row: `logits` [V] (raw), `stages` from `pipeline_stages`, `processed` [V]
    and `probs` [V] (the pipeline's logits and probabilities).

    Best first by the pipeline's logit (so kept tokens form a prefix), then raw logit, then token id.
    """
    raw_logp = torch.log_softmax(logits.double(), dim=-1)  # float64: see `predict`
    scaled = stages["scaled"][0]
    scaled_logp = torch.log_softmax(scaled.double(), dim=-1)
    order = _sort_desc(stages["adjusted"][0], logits)[:top]
    masks = {k: torch.isfinite(v[0]) for k, v in stages.items() if k.startswith("after_")}
    kept_mask = torch.isfinite(processed)
    candidates: list[Candidate] = []
    cum = raw_cum = scaled_cum = 0.0
    texts = token_texts(tokenizer, order.tolist())
    for rank, (tid, (shown, decoded)) in enumerate(zip(order.tolist(), texts, strict=True), start=1):
        p, rp, sp = float(probs[tid]), float(raw_logp[tid].exp()), float(scaled_logp[tid].exp())
        cum, raw_cum, scaled_cum = cum + p, raw_cum + rp, scaled_cum + sp
        flags = {k: bool(m[tid]) for k, m in masks.items()}
        kept = bool(kept_mask[tid])
        cut_by = None if kept else next((c for c in cuts if not flags.get(f"after_{c}", True)), None)
        candidates.append(Candidate(
            rank=rank, token_id=tid, text=shown, decoded=decoded, logit=float(logits[tid]),
            scaled_logit=float(scaled[tid]), raw_probability=rp, scaled_probability=sp, probability=p,
            kept=kept, kept_bias=flags["after_bias"], kept_top_k=flags["after_top_k"],
            kept_top_p=flags["after_top_p"], kept_min_p=flags["after_min_p"], cut_by=cut_by,
            cumulative=min(cum, 1.0), raw_cumulative=min(raw_cum, 1.0), scaled_cumulative=min(scaled_cum, 1.0),
        ))
    return candidates


def _sort_desc(primary: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Indices sorting by `primary` descending, ties by `secondary` descending, then by index ascending."""
    idx = torch.argsort(secondary, descending=True, stable=True)
    return idx[torch.argsort(primary[idx], descending=True, stable=True)]


def pipeline_stages(logits: torch.Tensor, config, prev: torch.Tensor, prompt_len: int) -> dict[str, torch.Tensor]:
    """The pipeline's intermediate [1,V] logits, from sampling's own per-step functions; `prev` [1,L] the sequence
    so far, its first `prompt_len` tokens the prompt.

    adjusted: after bias/penalties (steps 1-2); scaled: after temperature (T=0: = adjusted);
    after_<step>: -inf where the step (or an earlier one) removed the token.
    """
    from lmhead.sampling import apply_min_p, apply_temperature, apply_top_k, apply_top_p, process_logits

    if not config.runs_on("batch"):
        return _declared_stages(logits, config, prev, prompt_len)
    plain = dataclasses.replace(config, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    adjusted = process_logits(logits, plain, prev_tokens=prev, prompt_len=prompt_len)
    stages = {"raw": logits, "adjusted": adjusted, "after_bias": adjusted}
    if config.is_greedy:  # the argmax of the adjusted logits, nothing else (the pipeline's own greedy path)
        keep = process_logits(logits, config, prev_tokens=prev, prompt_len=prompt_len)
        stages.update(scaled=adjusted, after_greedy=keep, after_top_k=keep, after_top_p=keep, after_min_p=keep)
        return stages
    scaled = apply_temperature(adjusted, config.temperature)
    k = apply_top_k(scaled, config.top_k)
    p = apply_top_p(k, config.top_p)
    m = apply_min_p(p, config.min_p)
    stages.update(scaled=scaled, after_greedy=scaled, after_top_k=k, after_top_p=p, after_min_p=m)
    return stages


def _declared_stages(logits: torch.Tensor, config, prev: torch.Tensor, prompt_len: int) -> dict[str, torch.Tensor]:
    """`pipeline_stages` for a config the batch path does not run: each declared step's exact torch implementation
    in the config's order (``SamplingConfig.steps()``), after_<step> the row after it; XTC shown with its coin on (its
    cut visible; the processed distribution is the mixture). The batch path's keys (after_bias, after_top_k, ...)
    a step does not produce hold the row as the chain left it."""
    from lmhead.sampling import process_logits
    from lmhead.sampling.steps import Context

    ctx = Context(history=[t for t in prev[0].tolist() if t >= 0], prompt_len=prompt_len, xtc=True)
    x = logits.float()
    stages: dict[str, torch.Tensor] = {"raw": x}
    adjusted = scaled = x
    for s in config.steps():
        x = s.apply(x, config, ctx)
        stages[f"after_{_stage_name(s)}"] = x
        if s.stage <= 2:
            adjusted = scaled = x
        elif s.stage == 3:
            scaled = x
    stages.update(adjusted=adjusted, scaled=scaled)
    if config.is_greedy:
        stages["after_greedy"] = process_logits(logits, config, prev_tokens=prev, prompt_len=prompt_len)
        x = stages["after_greedy"]
    for key in ("after_bias", "after_greedy", "after_top_k", "after_top_p", "after_min_p"):
        stages.setdefault(key, x)
    return stages


def _entropies(logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of the softmax of each row of `logits` [..., V] -> [...], in float64 (see `predict`);
    -inf logits are tokens of probability 0 and add nothing."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


def _logit_lens(logits: torch.Tensor, tokenizer, top: int) -> list[LensLayer]:
    """One `LensLayer` per row of the lens logits [L+1, V] (from `_lens_rows`), `top` candidates each."""
    rows = range(logits.shape[0])
    logp = torch.log_softmax(logits.double(), dim=-1)  # float64: see `predict`
    p = logp.exp()
    ent = _entropies(logits)
    final_logp = logp[-1]
    kl = (final_logp.exp() * (final_logp - logp).nan_to_num(nan=0.0, neginf=0.0, posinf=0.0)).sum(-1)
    final_tok = int(logits[-1].argmax())
    out = []
    for i in range(len(rows)):
        vals, idx = torch.topk(logits[i], top)
        texts = token_texts(tokenizer, idx.tolist())
        cands = [LensCandidate(token_id=int(t), text=s, logit=float(v), probability=float(p[i, t]))
                 for t, v, (s, _) in zip(idx.tolist(), vals.tolist(), texts, strict=True)]
        rank = int((logits[i] > logits[i, final_tok]).sum()) + 1
        out.append(LensLayer(layer=i, candidates=cands, entropy=float(ent[i]), kl_to_final=float(kl[i]),
                             final_token_probability=float(p[i, final_tok]), final_token_rank=rank))
    return out


def _lens_rows(norm, head, hidden_states, last_hidden) -> torch.Tensor:
    """[L+1, V] logits: final norm (where not applied yet) + head on each entry of hidden_states, last position.

    transformers' `hidden_states` holds L+1 entries: the embeddings, the residual stream after blocks
    1..L-1, and — for most decoder models (Llama, Gemma, Qwen, ...) — the *normed* output as the last entry
    (the same tensor as `last_hidden_state`). Entries that are raw residuals get the final norm; an entry
    that already is the normed output (checked by identity/equality with `last_hidden_state`, not assumed
    per architecture) is used as is, so nothing is normalised twice. The norm runs on each layer's own
    vector, so no statistics are shared between layers.
    """
    final_last = last_hidden[:, -1:]
    rows = []
    for i, h in enumerate(hidden_states):
        h = h[:, -1:]
        already_normed = i == len(hidden_states) - 1 and (h is final_last or torch.equal(h, final_last))
        rows.append(h if already_normed else norm(h))
    return head(torch.cat(rows, dim=1)).reshape(len(rows), -1).float()


@torch.inference_mode()
def lens_logits(model, input_ids: torch.Tensor, head: str = "exact") -> torch.Tensor:
    """Logit-lens logits [L+1, V] at the last position of `input_ids` [1,T]: row 0 from the embeddings,
    row i from the residual stream after block i; row L equals the model's own logits.

    model: an `lmhead.Model`: every layer's hidden state (`Model.layer_states`), its final norm, and the head
    `explain_head(model, head)` (default: the full-precision `exact_head`).
    """
    states, last = model.layer_states(input_ids)
    return _lens_rows(model.final_norm, explain_head(model, head)[0], states, last)


# ---------------------------------------------------------------------------------------------------------
# perplexity and per-token scores

DEFAULT_WINDOW = 1024  # tokens per window at most (capped by the model's context length)


def windows(n: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first_scored) for each window over n tokens — HF's perplexity recipe.

    Windows start at 0, stride, 2·stride, ... and end at min(begin + window, n); the last one reaches n.
    Each window scores only the tokens not scored before (positions ≥ the previous window's end, and never
    its own first position, which nothing in the window predicts); the rest of the window is context.
    With stride < window every token but the first is scored exactly once.
    """
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        yield begin, end, max(prev_end, begin + 1)
        prev_end = end
        if end == n:
            break


def _window_defaults(model, window: int | None, stride: int | None) -> tuple[int, int]:
    ctx = model.context_length
    if window is None:
        window = min(DEFAULT_WINDOW, ctx) if ctx else DEFAULT_WINDOW
    if not checks.is_int(window) or window < 2:
        raise ValueError(f"window: must be an integer >= 2, got {window!r}")
    if ctx is not None and window > ctx:
        raise ValueError(f"window: must be <= the model's context length {ctx}, got {window}")
    if stride is None:
        stride = max(1, window // 2)
    if not checks.is_int(stride) or not 1 <= stride <= window:
        raise ValueError(f"stride: must be an integer in [1, window={window}], got {stride!r}")
    return window, stride


def _progress(total: int, enabled: bool, description: str):
    if not enabled or total <= 1:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    progress.start()
    progress.add_task(description, total=total)
    return progress


@torch.inference_mode()
@_accepts_parts
def evaluate(model, text: str, window: int | None = None, stride: int | None = None, tokens: bool = False,
             progress: bool = False, model_name: str | None = None, chunk: int = 256) -> Evaluation:
    """Perplexity of `text` (and, with tokens=True, each token's log-probability and rank).

    model: an `lmhead.Model`; its `body` gives the hidden states [1,t,D] of each window and its
    `exact_head` (the full-precision head, whatever head `generate` uses) scores them.
    The text is tokenized with the tokenizer's defaults (BOS included if the tokenizer adds it), as
    transformers' `model(ids, labels=ids).loss` does; perplexity = exp(mean over predicted tokens of
    -log p(token | tokens before it)). The loss is `head.loss` (= linear_cross_entropy, chunked, never the
    [T,V] logits) on the body's hidden states, summed in float64 across windows.

    Long texts: sliding windows of `window` tokens (default min(1024, context length)) moved by `stride`
    (default window // 2); each window scores only its new tokens, the rest is context (see `windows`).
    tokens=True also computes, per predicted token, log p and rank = 1 + #tokens with a larger logit,
    from the head's logits in chunks of `chunk` positions.
    """
    tokenizer, head = model.tokenizer, model.exact_head
    ids = _encode(tokenizer, text, "text")
    window, stride = _window_defaults(model, window, stride)
    if len(ids) < 2:
        raise ValueError("text: needs at least 2 tokens to predict one (got 1)")
    all_ids = torch.tensor([ids], device=_device(model))
    spans = list(windows(len(ids), window, stride))
    logprob: list[float | None] = [None] * len(ids)
    rank: list[int | None] = [None] * len(ids)
    nll = 0.0
    count = 0
    bar = _progress(len(spans), progress, "perplexity")
    try:
        for begin, end, first in spans:
            chunk_ids = all_ids[:, begin:end]
            hidden = model.hidden_states(chunk_ids)  # [1,t,D], after the final norm
            targets = chunk_ids.clone()
            targets[:, : first - begin] = -100  # context only: not scored here
            n = int((targets[:, 1:] != -100).sum())
            if n:
                loss = head.loss(hidden, targets, shift=True, reduction="sum")
                nll += float(loss.double())
                count += n
                if tokens:
                    _score_window(head, hidden[0], chunk_ids[0], first - begin, begin, logprob, rank, chunk)
            if bar is not None:
                bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    if count == 0:
        raise ValueError("text: no token could be scored")
    mean = nll / count
    scores = None
    if tokens:
        texts = token_texts(tokenizer, ids)
        segments = text_segments(tokenizer, text, ids)
        scores = [TokenScore(position=i, token_id=t, text=s, decoded=d, segment=g, logprob=logprob[i], rank=rank[i])
                  for i, (t, (s, d), g) in enumerate(zip(ids, texts, segments, strict=True))]
    return Evaluation(model=_model_name(model, model_name), perplexity=math.exp(mean), loss=mean,
                      token_count=len(ids), scored_count=count, window=window, stride=stride,
                      windows=len(spans), tokens=scores)


def text_segments(tokenizer, text: str, ids: Sequence[int]) -> list[str]:
    """Split `text` into one (possibly empty) piece per token of `ids`, so that "".join(pieces) == text.

    From the fast tokenizer's character offsets: each token takes the characters from where the previous
    token ended up to its own end (a character split over several byte tokens goes to the first of them;
    special tokens such as <bos> take none; characters the tokenizer dropped go to the next token, the tail
    to the last). Without offsets: the text each token adds when decoded after the ones before it.
    """
    offsets = None
    try:
        enc = tokenizer(text, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            offsets = enc["offset_mapping"]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        offsets = None
    pieces: list[str] = []
    if offsets is not None:
        cursor = 0
        for start, end in offsets:
            if end > cursor and end > start:
                pieces.append(text[cursor:end])
                cursor = end
            else:
                pieces.append("")
        if pieces:
            pieces[-1] += text[cursor:]
        return pieces
    specials = _special_ids(tokenizer)
    kept = [t for t in ids if t not in specials]
    prev = ""
    for i in range(len(ids)):  # quadratic, but only for tokenizers without offsets
        now = tokenizer.decode(kept[: sum(1 for t in ids[: i + 1] if t not in specials)],
                               clean_up_tokenization_spaces=False)
        if now.startswith(prev) and not now.endswith("\ufffd"):  # a partial character waits for the next token
            pieces.append(now[len(prev):])
            prev = now
        else:
            pieces.append("")
    return pieces


def _score_window(head, hidden: torch.Tensor, ids: torch.Tensor, first: int, offset: int,
                  logprob: list, rank: list, chunk: int) -> None:
    """Fill logprob/rank for window positions first..t-1 (predicted from the position before each)."""
    t = ids.shape[0]
    for s in range(first, t, chunk):
        e = min(s + chunk, t)
        logits = head(hidden[None, s - 1 : e - 1]).reshape(e - s, -1).float()  # [c,V]
        target = ids[s:e]
        tl = logits.gather(-1, target[:, None])  # [c,1]
        lp = tl[:, 0] - torch.logsumexp(logits, dim=-1)
        rk = (logits > tl).sum(-1) + 1
        for j in range(e - s):
            logprob[offset + s + j] = float(lp[j])
            rank[offset + s + j] = int(rk[j])


@_accepts_parts
def perplexity(model, text: str, window: int | None = None, stride: int | None = None,
               progress: bool = False) -> float:
    """exp(mean next-token loss) of `text` under `model` (an `lmhead.Model`); see `evaluate` for
    tokenization, windows and the loss."""
    return evaluate(model, text, window=window, stride=stride, progress=progress).perplexity


@_accepts_parts
def score_tokens(model, text: str, window: int | None = None, stride: int | None = None,
                 progress: bool = False) -> list[TokenScore]:
    """Per token {position, token_id, text, logprob, rank} (the GLTR view); the first token has None."""
    ev = evaluate(model, text, window=window, stride=stride, tokens=True, progress=progress)
    assert ev.tokens is not None
    return ev.tokens


__all__ = [
    "EXPLAIN_HEADS", "Candidate", "Evaluation", "LensCandidate", "LensLayer", "Prediction", "PromptToken",
    "TokenScore", "evaluate", "explain_head", "lens_logits", "perplexity", "pipeline_stages", "predict",
    "score_tokens", "step_rows", "text_segments", "token_texts", "visible", "windows",
]

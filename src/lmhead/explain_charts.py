"""The explainer's pictures: plain data for the page's charts, computed exactly from the full-precision head.

    prompt ──Model.body──▶ h = hidden [D] at the last position (after the final norm)
        ──Model.exact_head: logit_i = softcap(h · W[i] + b_i)──▶ logits [V]
        ──sampling pipeline (temperature → top-k → top-p → min-p → softmax)──▶ probabilities [V] ──sample──▶ id

Four pictures, each a function returning a dataclass with `.to_dict()` (JSON-ready: -inf/inf/NaN as None):

* `head_geometry`: the head as a projection onto word directions. For the top candidates, each logit as
  ‖h‖ · ‖W[i]‖ · cos θ (+ bias, then the softcap), with the row norm's and the cosine's rank over the whole
  vocabulary (does a token win by direction or by length?), and a 2-D view: the plane spanned by h and the top
  principal direction of the candidates' rows orthogonal to h. In that plane each row's x-coordinate is its
  exact projection onto h (x · ‖h‖ = h · W[i]); what the plane loses is reported (`plane_share`).
* `rank_curve`: probability against rank over the full vocabulary — the r-th largest probability before the
  pipeline (T = 1), after temperature and after the whole pipeline — at log-spaced ranks (exact values at
  those ranks, computed over all V tokens), and where each cut-off falls.
* `draw_tokens`: N seeded draws with lmhead's own `sample`, from exactly the pipeline's distribution.
* `step_profile`: for generated tokens, each one's probability (after the pipeline it was drawn under), rank and
  the entropy of its step — the GLTR view of a generation.

`last_position(model, prompt)` runs the body once; every function also accepts its result, so a caller (the
server) can draw several pictures from one forward pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmhead import checks
from lmhead.explain import JSONReady

__all__ = [
    "DrawCount", "Draws", "GeometryCandidate", "HeadGeometry", "LastPosition", "RankCurve", "StepProfile",
    "check_draws", "draw_tokens", "head_geometry", "last_position", "prompt_ids", "rank_curve", "rank_points",
    "step_profile",
]

MAX_DRAWS = 10_000
DRAW_WORK = 1 << 26  # draws × kept tokens per call at most: sample() reads every kept logit for every draw


# ---------------------------------------------------------------------------------------------------------
# The last position


@dataclass
class LastPosition:
    """One forward pass: the prompt's ids, the final hidden state h [D] at the last position (after the final
    norm) and the full-precision head's logits [V] there (float32)."""

    ids: list[int]
    hidden: torch.Tensor  # [D]
    logits: torch.Tensor  # [V]


@torch.inference_mode()
def last_position(model, prompt: str) -> LastPosition:
    """Run `model`'s body (an `lmhead.Model`) on `prompt` and its `exact_head` on the last position."""
    ids = prompt_ids(model, prompt)
    x = torch.tensor([ids], device=model.device)
    h = model.hidden_states(x)[0, -1].float()  # [D]
    logits = model.exact_head(h[None, None]).reshape(-1).float()  # [V]
    return LastPosition(ids=ids, hidden=h, logits=logits)


def prompt_ids(model, prompt: str, extra: int = 0) -> list[int]:
    """`model.encode(prompt)`; a ValueError if it is empty or, with `extra` tokens after it, longer than the
    model's context."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt: expected a string, got {type(prompt).__name__}")
    ids = [int(i) for i in model.encode(prompt)] if prompt else []
    if not ids:
        raise ValueError("prompt: must be a non-empty string that encodes to at least one token")
    ctx = model.context_length
    if ctx is not None and len(ids) + extra > ctx:
        raise ValueError(f"prompt: {len(ids)} tokens (+ {extra}) is longer than the model's context of {ctx}")
    return ids


def _last(model, prompt: str | LastPosition) -> LastPosition:
    return prompt if isinstance(prompt, LastPosition) else last_position(model, prompt)


def _config(config, model):
    """The config checked, with the model's end of sequence among what min_tokens withholds, as `generate` runs it."""
    from lmhead.sampling import SamplingConfig
    from lmhead.sampling.steps.masks import withhold_stops

    if config is None:
        return SamplingConfig()
    if not isinstance(config, SamplingConfig):
        raise TypeError(f"config: expected a SamplingConfig, got {type(config).__name__}")
    return withhold_stops(config, getattr(model, "eos_token_ids", ()))


# ---------------------------------------------------------------------------------------------------------
# 1. The head as a projection onto word directions


@dataclass
class GeometryCandidate(JSONReady):
    """One top candidate: logit = softcap(‖h‖ · ‖W[i]‖ · cos θ + bias)."""

    rank: int  # by logit, 1 = top
    token_id: int
    text: str
    logit: float  # the head's logit (after bias and softcap)
    dot: float  # h · W[i] = ‖h‖ · ‖W[i]‖ · cos θ
    row_norm: float  # ‖W[i]‖
    cos: float  # cos θ between h and W[i]
    bias: float  # the head's bias for this token (0 without one)
    norm_rank: int  # 1 + rows of the whole vocabulary with a larger norm
    cos_rank: int  # 1 + rows of the whole vocabulary with a larger cosine to h
    x: float  # coordinate along h: W[i] · h / ‖h‖ (exact: x · ‖h‖ = dot)
    y: float  # coordinate along the plane's second direction
    plane_share: float  # (x² + y²) / ‖W[i]‖²: how much of this row the plane shows


@dataclass
class HeadGeometry(JSONReady):
    """`head_geometry`'s result: h, the top candidates' rows, and the 2-D plane they are drawn in."""

    width: int  # D
    vocab_size: int
    hidden_norm: float  # ‖h‖
    softcap: float | None  # logit = c · tanh((dot + bias) / c) when set
    has_bias: bool
    row_norm_median: float  # over the whole vocabulary
    row_norm_max: float
    plane_share: float  # Σ (x² + y²) / Σ ‖W[i]‖² over the candidates shown
    candidates: list[GeometryCandidate]


def _second_direction(rows: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    """A unit vector ⟂ u1: the top principal direction of `rows` [n,D] with their component along u1 removed
    (centred over the rows; uncentred if they coincide; a coordinate axis if nothing is left)."""
    resid = rows - (rows @ u1)[:, None] * u1[None]
    for m in (resid - resid.mean(0, keepdim=True), resid):
        if float(m.abs().max()) > 1e-6 * max(1.0, float(rows.abs().max())):
            u2 = torch.linalg.svd(m.double(), full_matrices=False).Vh[0].float()
            u2 = u2 - (u2 @ u1) * u1  # exactly ⟂ u1 despite rounding
            return u2 / u2.norm()
    axis = torch.zeros_like(u1)
    axis[int(u1.abs().argmin())] = 1.0
    axis = axis - (axis @ u1) * u1
    return axis / axis.norm()


@torch.inference_mode()
def head_geometry(model, prompt: str | LastPosition, top: int = 10) -> HeadGeometry:
    """The `top` candidates' logits as ‖h‖ · ‖W[i]‖ · cos θ, and the 2-D view (see the module docstring).

    model: an `lmhead.Model` (its `exact_head`: weight W [V,D], bias b [V] or None, softcap c or None);
    logit_i = c · tanh((h · W[i] + b_i) / c), or h · W[i] + b_i without a softcap. The plane: u1 = h / ‖h‖,
    u2 = the top principal direction of the candidates' rows with their u1 component removed (sign: the top
    candidate's y ≥ 0). Ranks of norm and cosine are over all V rows. top: 1..V (≤ 200).
    """
    head = model.exact_head
    w = head.weight.float()  # [V,D]
    vocab, width = w.shape
    top = checks.int_in_range("top", top, 1, min(200, vocab))
    last = _last(model, prompt)
    h = last.hidden
    h_norm = float(h.norm())
    row_norms = w.norm(dim=1)  # [V]
    dots = w @ h  # [V]
    cos = dots / (row_norms * h_norm).clamp_min(torch.finfo(torch.float32).tiny)
    ids = torch.topk(last.logits, top).indices
    u1 = h / max(h_norm, torch.finfo(torch.float32).tiny)
    rows = w[ids]
    u2 = _second_direction(rows, u1)
    xs, ys = rows @ u1, rows @ u2
    if float(ys[0]) < 0:
        u2, ys = -u2, -ys
    bias = head.bias.float() if head.bias is not None else None
    from lmhead.explain import token_texts

    texts = token_texts(model.tokenizer, ids.tolist())
    cands = []
    for r, (i, (shown, _)) in enumerate(zip(ids.tolist(), texts, strict=True), start=1):
        n2 = float(row_norms[i]) ** 2
        cands.append(GeometryCandidate(
            rank=r, token_id=i, text=shown, logit=float(last.logits[i]), dot=float(dots[i]),
            row_norm=float(row_norms[i]), cos=float(cos[i]), bias=float(bias[i]) if bias is not None else 0.0,
            norm_rank=int((row_norms > row_norms[i]).sum()) + 1, cos_rank=int((cos > cos[i]).sum()) + 1,
            x=float(xs[r - 1]), y=float(ys[r - 1]),
            plane_share=(float(xs[r - 1]) ** 2 + float(ys[r - 1]) ** 2) / n2 if n2 > 0 else 1.0))
    total = float((rows * rows).sum())
    return HeadGeometry(
        width=width, vocab_size=vocab, hidden_norm=h_norm, softcap=head.softcap, has_bias=bias is not None,
        row_norm_median=float(row_norms.median()), row_norm_max=float(row_norms.max()),
        plane_share=float((xs * xs + ys * ys).sum()) / total if total > 0 else 1.0, candidates=cands)


# ---------------------------------------------------------------------------------------------------------
# 2. The shape of the whole distribution


@dataclass
class RankCurve(JSONReady):
    """Probability against rank: at each rank r in `ranks`, the r-th largest probability of each distribution.

    raw: softmax of the logits (T = 1, nothing cut); scaled: after bias/penalties and temperature, before the
    cuts (T = 0: at T = 1, as `predict`); processed: after the whole pipeline (0 beyond the kept tokens).
    cutoffs: for each enabled cut (in pipeline order), the number of tokens still in after it — the rank where
    it falls. `scaled_cumulative[j]`: the scaled mass of the top `ranks[j]` tokens (what top-p compares with p).
    """

    vocab_size: int
    ranks: list[int]
    raw: list[float]
    scaled: list[float]
    processed: list[float]
    scaled_cumulative: list[float]
    cutoffs: list[dict[str, Any]]  # {"step": "top_k"|"top_p"|"min_p"|"greedy"|another step's name, "setting": value,
    #                                "rank": n}
    kept_count: int
    entropy: dict[str, float]  # raw, scaled, processed (nats, full vocabulary)
    config: dict[str, Any]


def rank_points(vocab: int, points: int = 160, extra: Sequence[int] = ()) -> list[int]:
    """Ranks 1..vocab to evaluate a log-log curve at: every rank up to 10, then about `points` log-spaced
    ranks, the last rank, and the ranks in `extra` (and the one after each), ascending and unique."""
    checks.positive_int("vocab", vocab)
    checks.int_in_range("points", points, 2, 4096)
    grid = torch.logspace(0, math.log10(vocab), points, dtype=torch.float64).round().long().tolist()
    ranks = set(range(1, min(vocab, 10) + 1)) | set(grid) | {vocab}
    for r in extra:
        ranks |= {int(r), int(r) + 1}
    return sorted(r for r in ranks if 1 <= r <= vocab)


def _cut_counts(adjusted: torch.Tensor, config) -> list[dict[str, Any]]:
    """Tokens left after each enabled cut, in pipeline order, from sampling's own step functions."""
    from lmhead.sampling import apply_min_p, apply_temperature, apply_top_k, apply_top_p

    if config.is_greedy:
        return [{"step": "greedy", "setting": 0.0, "rank": 1}]
    x = apply_temperature(adjusted, config.temperature)
    out = []
    for step, setting, fn, on in (("top_k", config.top_k, apply_top_k, config.top_k > 0),
                                  ("top_p", config.top_p, apply_top_p, config.top_p < 1),
                                  ("min_p", config.min_p, apply_min_p, config.min_p > 0)):
        if on:
            x = fn(x, setting)
            out.append({"step": step, "setting": setting, "rank": int(torch.isfinite(x).sum())})
    return out


def _declared_cuts(logits: torch.Tensor, config, prev: torch.Tensor, prompt_len: int):
    """For a config the batch path does not run (`explain.pipeline_stages`: its declared steps in its order): the
    logits after temperature (after the masks and penalties when greedy), and a cut-off entry for every step of
    stage 4 and every other step that cut a token (its first parameter as the setting), as `_cut_counts` gives."""
    from lmhead.explain import pipeline_stages, step_rows

    stages = pipeline_stages(logits, config, prev, prompt_len)
    rows = step_rows(config, stages, left=True)
    cutoffs = [{"step": r["name"], "setting": next(iter(r["params"].values())), "rank": r["left"]}
               for r in rows if r["stage"] == 4 or r["cut"]]
    if config.is_greedy:
        cutoffs.append({"step": "greedy", "setting": 0.0, "rank": 1})
    return stages["scaled"], cutoffs


@torch.inference_mode()
def rank_curve(model, prompt: str | LastPosition, config=None, points: int = 160) -> RankCurve:
    """Probability against rank over the full vocabulary [V], before and after the pipeline (`RankCurve`).

    The prompt is the sequence so far (the repetition penalty applies to it, as in `predict`). Values are
    exact at the returned ranks (about `points` log-spaced ones, every rank ≤ 10, the cut-offs and the rank
    after each): the r-th largest of `probabilities`' [V] output, and of the softmaxes before it.
    """
    from lmhead.sampling import entropy, probabilities, process_logits

    config = _config(config, model)
    last = _last(model, prompt)
    logits = last.logits[None]  # [1,V]
    prev = torch.tensor([last.ids], device=logits.device)
    kw = dict(prev_tokens=prev, prompt_len=len(last.ids))
    processed = process_logits(logits, config, **kw)
    probs = probabilities(logits, config, **kw)[0]
    if config.runs_on("batch"):
        plain = dataclasses.replace(config, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        adjusted = process_logits(logits, plain, **kw)  # steps 1-2
        scaled = adjusted if config.is_greedy else adjusted / config.temperature
        cutoffs = _cut_counts(adjusted, config)
    else:
        scaled, cutoffs = _declared_cuts(logits, config, prev, len(last.ids))
    vocab = logits.shape[1]
    ranks = rank_points(vocab, points, [c["rank"] for c in cutoffs])
    at = torch.tensor(ranks) - 1
    sorted_scaled = torch.softmax(scaled[0], -1).sort(descending=True).values
    ent = entropy(torch.cat([logits, scaled, processed]))
    return RankCurve(
        vocab_size=vocab, ranks=ranks,
        raw=torch.softmax(logits[0], -1).sort(descending=True).values[at].tolist(),
        scaled=sorted_scaled[at].tolist(), processed=probs.sort(descending=True).values[at].tolist(),
        scaled_cumulative=sorted_scaled.double().cumsum(0).clamp(max=1.0)[at].tolist(),
        cutoffs=cutoffs, kept_count=int((probs > 0).sum()),
        entropy={"raw": float(ent[0]), "scaled": float(ent[1]), "processed": float(ent[2])},
        config={k: getattr(config, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")})


# ---------------------------------------------------------------------------------------------------------
# 3. Sampling you can watch


@dataclass
class DrawCount(JSONReady):
    token_id: int
    text: str
    count: int  # times drawn among the n draws
    probability: float  # its probability after the pipeline


@dataclass
class Draws(JSONReady):
    """`draw_tokens`' result: the n draws in order (a prefix of them is a smaller run of the same seed) and,
    per token drawn or among the `top` most probable, its count and its probability after the pipeline."""

    n: int
    seed: int
    token_ids: list[int]  # the draws, in order
    tokens: list[DrawCount]  # by probability, descending (ties by id)
    kept_count: int


def check_draws(n: int, kept: int) -> int:
    """n draws over `kept` tokens: 1..MAX_DRAWS, and n · kept ≤ DRAW_WORK (sample reads every kept logit per
    draw). Returns n; a ValueError names the largest n allowed."""
    most = max(1, min(MAX_DRAWS, DRAW_WORK // max(1, kept)))
    if not checks.is_int(n) or not 1 <= n <= most:
        raise ValueError(f"n: must be an integer in [1, {most}] with {kept:,} tokens kept "
                         f"(n × kept tokens ≤ {DRAW_WORK:,}), got {n!r}")
    return int(n)


@torch.inference_mode()
def draw_tokens(model, prompt: str | LastPosition, n: int, seed: int = 0, config=None, top: int = 20,
                chunk_elements: int = 1 << 22) -> Draws:
    """Draw the next token `n` times with `lmhead.sample` from exactly the pipeline's distribution.

    Pipeline steps 1-6 run once (`process_logits`, the prompt as the sequence so far); its kept tokens K (in id
    order) with their processed logits [K] are then drawn from by `sample(vals.expand(rows, K),
    SamplingConfig(), generator)` — softmax of the processed logits is the pipeline's distribution (step 7),
    and sample is step 8 — with one `torch.Generator().manual_seed(seed)` for all draws, `rows` per call
    (rows · K ≤ chunk_elements). The config's own seed is not used (each draw would repeat it).
    n: 1..MAX_DRAWS with n · K ≤ DRAW_WORK (`check_draws`); seed: int ≥ 0; top: most probable tokens listed
    even if never drawn (0..200).
    """
    from lmhead.explain import token_texts
    from lmhead.sampling import SamplingConfig, process_logits, sample

    config = _config(config, model)
    if not checks.is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: must be an integer in [0, 2**63), got {seed!r}")
    top = checks.int_in_range("top", top, 0, 200)
    chunk_elements = checks.positive_int("chunk_elements", chunk_elements)
    last = _last(model, prompt)
    prev = torch.tensor([last.ids], device=last.logits.device)
    processed = process_logits(last.logits[None], config, prev_tokens=prev, prompt_len=len(last.ids))[0]
    kept = torch.isfinite(processed).nonzero().reshape(-1)  # [K], ascending ids
    n = check_draws(n, kept.numel())
    vals = processed[kept]
    gen = torch.Generator(device=vals.device).manual_seed(int(seed))
    rows = max(1, chunk_elements // kept.numel())
    drawn = [sample(vals.expand(min(rows, n - s), -1), SamplingConfig(), generator=gen) for s in range(0, n, rows)]
    token_ids = kept[torch.cat(drawn)]
    probs = torch.softmax(vals, -1)
    counts = torch.bincount(token_ids, minlength=last.logits.shape[0])
    order = torch.argsort(probs, descending=True, stable=True)
    listed = kept[order[: min(top, kept.numel())]].tolist()
    listed += sorted(set(token_ids.tolist()) - set(listed), key=lambda t: (-float(probs[kept == t]), t))
    prob_of = dict(zip(kept.tolist(), probs.tolist(), strict=True))
    texts = token_texts(model.tokenizer, listed)
    tokens = [DrawCount(token_id=t, text=s, count=int(counts[t]), probability=prob_of[t])
              for t, (s, _) in zip(listed, texts, strict=True)]
    return Draws(n=n, seed=int(seed), token_ids=token_ids.tolist(), tokens=tokens, kept_count=int(kept.numel()))


# ---------------------------------------------------------------------------------------------------------
# 3b. A generation, token by token


@dataclass
class StepProfile(JSONReady):
    """One generated token: its probability under the pipeline of its step, its rank, the step's entropy."""

    index: int  # 0 = the first generated token
    token_id: int
    text: str
    probability: float  # after the pipeline (the distribution it was drawn from)
    raw_probability: float  # softmax at T = 1, nothing cut
    rank: int  # 1 + tokens with a larger logit (GLTR's rank, as the score tab)
    entropy: float  # nats, of the step's processed distribution
    raw_entropy: float  # nats, at T = 1, nothing cut
    kept_count: int


@torch.inference_mode()
def step_profile(model, prompt: str, token_ids: Sequence[int], configs=None) -> list[StepProfile]:
    """For tokens generated after `prompt`: each one's probability, rank and its step's entropy.

    One forward pass over prompt + tokens ([1, P+n]); the full-precision head's logits [n,V] at the positions
    that predicted them; step j's pipeline runs with `configs[j]` (one SamplingConfig for all, or a list of n)
    and the sequence before it (prompt + tokens[:j], the prompt's P tokens counted as the prompt), as
    `generate` runs it. `probabilities` gives the processed distribution, `entropy` the entropies.
    """
    from lmhead.explain import token_texts
    from lmhead.sampling import entropy, probabilities, process_logits

    vocab = model.vocab_size
    new = [checks.int_in_range("token_ids", t, 0, vocab - 1) for t in token_ids]
    if not new:
        raise ValueError("token_ids: must hold at least one token id")
    ids = prompt_ids(model, prompt, extra=len(new))
    n, p = len(new), len(ids)
    cfgs = ([_config(configs, model)] * n if not isinstance(configs, (list, tuple))
            else [_config(c, model) for c in configs])
    if len(cfgs) != n:
        raise ValueError(f"configs: expected one SamplingConfig or a list of {n}, got a list of {len(cfgs)}")
    seq = torch.tensor([ids + new], device=model.device)
    hidden = model.hidden_states(seq[:, :-1])[0, p - 1 :]  # [n,D]: the positions that predicted each token
    logits = model.exact_head(hidden[None]).reshape(n, vocab).float()  # [n,V]
    prev = seq[0, :-1].expand(n, -1).clone()  # row j: the sequence before token j, padded with -1
    prev[torch.arange(p + n - 1)[None] >= (p + torch.arange(n))[:, None]] = -1
    kw = dict(prev_tokens=prev, prompt_len=p)
    probs = probabilities(logits, cfgs, **kw)
    processed = process_logits(logits, cfgs, **kw)
    ent, raw_ent = entropy(processed), entropy(logits)
    target = torch.tensor(new)[:, None]
    raw = torch.softmax(logits, -1).gather(1, target)[:, 0]
    rank = (logits > logits.gather(1, target)).sum(-1) + 1
    texts = token_texts(model.tokenizer, new)
    return [StepProfile(index=j, token_id=new[j], text=texts[j][0], probability=float(probs[j, new[j]]),
                        raw_probability=float(raw[j]), rank=int(rank[j]), entropy=float(ent[j]),
                        raw_entropy=float(raw_ent[j]), kept_count=int((probs[j] > 0).sum()))
            for j in range(n)]

"""`predict`: the next-token candidates with the raw and the processed distributions, which step cut which
token (`pipeline_stages`, `step_rows`), the entropies and the logit lens."""

from __future__ import annotations

from typing import Any

import torch

from lmhead import checks
from lmhead.explain.inputs import accepts_parts, config_dict, encode_prompt, explain_head, model_device, model_name_of
from lmhead.explain.lens import entropies, lens_rows, logit_lens
from lmhead.explain.records import Candidate, Prediction, PromptToken
from lmhead.explain.tokens import token_texts


@torch.inference_mode()
@accepts_parts
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

    ids, start = _prompt_ids(model, prompt, constraint, constraint_from)
    input_ids = torch.tensor([ids], device=model_device(model))
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
    ent = entropies(torch.stack([logits[0], scaled, processed[0]]))
    prompt_tokens = [PromptToken(token_id=i, text=s, decoded=d)
                     for i, (s, d) in zip(ids, token_texts(model.tokenizer, ids), strict=True)]
    lens = None
    if layers:
        rows = lens_rows(model.final_norm, head, states, last)
        lens = logit_lens(rows, model.tokenizer, layer_top)
    return Prediction(
        model=model_name_of(model, model_name), prompt=prompt, prompt_tokens=prompt_tokens,
        candidates=candidates,
        entropy={"raw": float(ent[0]), "scaled": float(ent[1]), "processed": float(ent[2])},
        kept_count=int(torch.isfinite(processed[0]).sum()), vocab_size=vocab,
        logsumexp=float(torch.logsumexp(logits[0], dim=-1)), scaled_logsumexp=float(torch.logsumexp(scaled, dim=-1)),
        config=config_dict(config), layers=lens, head=head_name, steps=step_rows(config, stages),
        constraint=None if constraint is None else constraint.describe(),
    )


def _prompt_ids(model, prompt: str, constraint, constraint_from: int | None) -> tuple[list[int], int | None]:
    """The prompt's ids and, with a constraint that starts inside the prompt, where its answer starts
    (`lmhead.constrain.split_answer`); a prompt longer than the model's context is a ValueError."""
    ids = encode_prompt(model.tokenizer, prompt, "prompt")
    start = None
    if constraint is not None and constraint_from is not None:
        from lmhead.constrain import split_answer

        ids, start = split_answer(model.tokenizer, prompt, constraint_from)
    ctx = model.context_length
    if ctx is not None and len(ids) > ctx:
        raise ValueError(f"prompt: {len(ids)} tokens is longer than the model's context of {ctx} tokens")
    return ids, start


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


def _stage_name(step) -> str:
    return "bias" if step.name == "logit_bias" else step.name


def _cut_names(config) -> tuple[str, ...]:
    """The names `cut_by` can take for this config, in pipeline order: every declared step the config runs
    (``SamplingConfig.steps()``; its masks' first as "bias"), then "greedy" for a greedy config."""
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
                probs: torch.Tensor, top: int, cuts: tuple[str, ...]) -> list[Candidate]:
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
    """The pipeline's intermediate [1,V] logits: each declared step's own implementation in the config's order
    (``SamplingConfig.steps()``); `prev` [1,L] the sequence so far, its first `prompt_len` tokens the prompt.

    adjusted: after the masks and penalties (stages 1-2); scaled: after the temperature (T=0: = adjusted);
    after_<step>: the row after that step, -inf where it (or an earlier one) removed the token; after_greedy: a
    greedy config's argmax (a sampled config's: the scaled row). XTC is shown with its coin on (its cut visible; the
    processed distribution is the mixture). The keys the candidates report (after_bias, after_top_k, after_top_p,
    after_min_p) that no step produced hold the row as the steps before that place in the order left it.
    """
    from lmhead.sampling import process_logits
    from lmhead.sampling.steps import ORDER, STEPS, Context

    ctx = Context(history=[t for t in prev[0].tolist() if t >= 0], prompt_len=prompt_len, xtc=True)
    x = logits.float()
    stages: dict[str, torch.Tensor] = {"raw": x, "after_bias": x}  # the bias is the first mask
    adjusted = scaled = x
    ran = []  # (step name, the row after it)
    for s in config.steps():
        x = s.apply(x, config, ctx)
        stages[f"after_{_stage_name(s)}"] = x
        ran.append((s.name, x))
        if s.stage <= 2:
            adjusted = scaled = x
        elif s.stage == 3:
            scaled = x
    stages.update(adjusted=adjusted, scaled=scaled)
    if config.is_greedy:  # the argmax of the adjusted row; no cut-off runs, each keeps the argmax alone
        stages["after_greedy"] = process_logits(logits, config, prev_tokens=prev, prompt_len=prompt_len)
        for key in ("after_top_k", "after_top_p", "after_min_p"):
            stages[key] = stages["after_greedy"]
        return stages
    stages["after_greedy"] = scaled  # a sampled config: the argmax is no cut
    order = list(config.samplers or ORDER)
    for name in ("top_k", "top_p", "min_p"):  # a cut-off that did not run: the row as the steps before it left it
        if f"after_{name}" not in stages:
            place = order.index(name) if name in order else len(order)
            before = [row for n, row in ran if n in order[:place] or STEPS[n].stage <= 1]
            stages[f"after_{name}"] = before[-1] if before else stages["raw"]
    return stages

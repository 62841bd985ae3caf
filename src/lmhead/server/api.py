"""/api/*: the explainer page's own JSON API (one router; `create_app` includes it).

    GET  /api/model       the loaded model: name, vocabulary, width, layers, context, limits
    GET  /api/params      its parameter breakdown by component (module counts) and GPT-2 small's
    GET  /api/samplers    the declared steps of the pipeline, their parameters (those the page's requests take),
                          lmhead's order, the presets (the page builds its controls and its pipeline from them)
    POST /api/predict     next-token candidates: logits, raw and processed probabilities, entropy, lse
    POST /api/step        choose one token with the current settings, append it; its probability, rank
    POST /api/generate    several steps as server-sent events
    POST /api/layers      the logit lens at the last position
    POST /api/score       every token of a text with its probability and rank; the perplexity

Each route checks the request (served.py), makes one call to the library (`explain.predict`, `generate.generate`,
`explain.evaluate`, `params.module_parameters`) through the runner, and shapes the answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from lmhead import explain
from lmhead.checks import seed_for_step
from lmhead.generate import generate
from lmhead.sampling.steps import describe
from lmhead.server import schemas as S
from lmhead.server.served import Served, encode_checked, get_served, max_prompt_tokens, sampling_config
from lmhead.server.sse import DONE, sse

router = APIRouter(prefix="/api", tags=["explainer"])


@router.get("/model", summary="The loaded model and the server's limits")
async def api_model(served: Served = Depends(get_served)) -> dict[str, Any]:
    info = model_info(served.model)
    if served.limits is not None:  # what /v1 lets a request use (lmhead serve -c / -n / -np, --kv-memory)
        info["limits"]["v1"] = served.limits.as_dict()
    return info


@router.get("/params", summary="Parameter breakdown by component, and GPT-2 small's")
async def api_params(served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(params_body, served.model)


@router.get("/samplers", summary="The declared steps of the logits pipeline and their parameters")
async def api_samplers() -> dict[str, Any]:
    return page_declarations()


def page_declarations() -> dict[str, Any]:
    """The declarations (`lmhead.sampling.steps.describe`) of the parameters the page's requests take, each numeric
    range as the page's requests bound it (schemas.PAGE_OVERRIDES: the temperature slider stops at 2), its words
    (`allowed`) said again for that range: the page builds its controls and their help from this alone."""
    out = describe(list(S.SamplingFields.model_fields))
    for name, override in S.PAGE_OVERRIDES.items():
        p = out["params"].get(name)
        bounds = {k: v for k, v in override.items() if k in ("low", "high", "low_open", "high_open")}
        if p is None or not bounds or p["kind"] not in ("float", "int"):
            continue
        p.update(bounds)
        low, high = p["low"], p["high"]
        if p["kind"] == "float":
            words = f"in {'(' if p['low_open'] else '['}{low:g}, {high:g}{')' if p['high_open'] else ']'}"
            p["allowed"] = re.sub(r"^in [\[(][^\])]*[\])]", words, p["allowed"])
        else:
            words = f"an int ≥ {low}" if high is None else f"an int in [{low}, {high}]"
            p["allowed"] = re.sub(r"^an int (≥ \S+|in \[[^\]]*\])", words, p["allowed"])
    return out


@router.post("/predict", summary="Next-token candidates, raw and processed")
async def api_predict(req: S.PredictRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_predict, served.model, req)


@router.post("/step", summary="Choose the next token and append it", response_model=S.StepResponse)
async def api_step(req: S.StepRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    step = await served.call(_step, served.model, req)
    return {"token_id": step.token_id, "text": step.text, "prompt": req.prompt + step.text,
            "probability": math.exp(step.logprob), "raw_probability": math.exp(step.raw_logprob),
            "rank": step.rank, "finish_reason": step.finish_reason, "seed": req.seed, "step": req.step}


@router.post("/generate", summary="Several steps, streamed as server-sent events")
async def api_generate(req: S.GenerateRequest, served: Served = Depends(get_served)) -> StreamingResponse:
    await served.call(encode_checked, served.model, req.prompt)
    # the answer so far is checked here, so that one the constraint does not accept is a 400, not a stream's error
    constraint = await served.call(_answer_checked, served.model, req)
    cfg = sampling_config(req, seed_for_step(req.seed, req.step))
    steps = served.generate(req.prompt, req.max_tokens, config=cfg, exact_logprobs=True,  # the page's numbers
                            constraint=constraint, constraint_from=req.answer_from if constraint else None)
    return StreamingResponse(_step_events(steps), media_type="text/event-stream")


@router.post("/layers", summary="The logit lens at the last position")
async def api_layers(req: S.LayersRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_layers, served.model, req)


@router.post("/score", summary="Per-token probability and rank of a text; perplexity")
async def api_score(req: S.ScoreRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_score, served.model, req, served.name)


# --- the calls (blocking: they run in the runner's worker thread) ---------------------------------------------


def _answer_checked(model: Any, req: S.PredictRequest | S.StepRequest) -> Any:
    """The page's constraint (None: none), with the answer so far (the prompt's text from `answer_from`)
    checked against it: a 400 naming `constraint` where it does not match, `answer_from` where it is past the
    prompt. The page asks one step per request, so each request starts the matcher again from the answer."""
    from lmhead.constrain import for_rows, split_answer
    from lmhead.server.errors import APIError
    from lmhead.server.structured import page_constraint

    constraint = page_constraint(req.constraint)
    if constraint is None or req.answer_from is None:
        return constraint
    if req.answer_from > len(req.prompt):
        raise APIError(400, f"answer_from: {req.answer_from} is past the prompt's {len(req.prompt)} characters",
                       "answer_from")
    ids, start = split_answer(model.tokenizer, req.prompt, req.answer_from)
    try:
        for_rows(model, constraint, 1)[0].advance(ids[start:])
    except ValueError as exc:
        raise APIError(400, str(exc), "constraint") from exc
    return constraint


def _predict(model: Any, req: S.PredictRequest) -> dict[str, Any]:
    encode_checked(model, req.prompt)
    constraint = _answer_checked(model, req)
    return explain.predict(model, req.prompt, top=req.top, config=sampling_config(req), constraint=constraint,
                           constraint_from=req.answer_from if constraint else None).to_dict()


def _step(model: Any, req: S.StepRequest) -> Any:
    encode_checked(model, req.prompt)
    constraint = _answer_checked(model, req)
    # A seeded run keys each click's draw on (seed + step): clicks differ, a rerun repeats them.
    cfg = sampling_config(req, seed_for_step(req.seed, req.step))
    # the page shows the model's own numbers: probability, raw probability and rank from the fp32 head
    return next(iter(generate(model, req.prompt, 1, config=cfg, exact_logprobs=True, constraint=constraint,
                              constraint_from=req.answer_from if constraint else None)))


def _layers(model: Any, req: S.LayersRequest) -> dict[str, Any]:
    encode_checked(model, req.prompt)
    pred = explain.predict(model, req.prompt, top=1, layers=True, layer_top=req.top).to_dict()
    return {"prompt_tokens": pred.get("prompt_tokens"), "layers": pred.get("layers")}


def _score(model: Any, req: S.ScoreRequest, name: str) -> dict[str, Any]:
    encode_checked(model, req.text, "text")
    return explain.evaluate(model, req.text, tokens=True, model_name=name).to_dict()


def params_body(model: Any) -> dict[str, Any]:
    """GET /api/params: the loaded model's parameters by component, beside GPT-2 small's."""
    from lmhead.params import count_parameters, module_parameters

    return {"model": module_parameters(model.hf_model, model.name),
            "gpt2_small": {"name": "GPT-2 small", **count_parameters().to_dict()}}


def model_info(model: Any) -> dict[str, Any]:
    """GET /api/model: what the page shows about the model, and the server's limits."""
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    weight = model.head.weight
    return {
        "name": model.name,
        "vocab_size": int(weight.shape[0]),
        "width": int(weight.shape[1]),
        "layers": int(getattr(text_cfg, "num_hidden_layers", 0) or 0),
        "context_length": getattr(model, "context_length", None),
        "architecture": getattr(text_cfg, "model_type", None),
        "tied_head": bool(getattr(text_cfg, "tie_word_embeddings", False)),
        "softcap": getattr(model.head, "softcap", None),
        "eos_token_ids": list(getattr(model, "eos_token_ids", [])),
        "chat_template": bool(getattr(model.tokenizer, "chat_template", None)),
        "limits": {
            "max_prompt_tokens": max_prompt_tokens(model),
            "max_prompt_chars": S.MAX_PROMPT_CHARS,
            "max_tokens": S.MAX_NEW_TOKENS,
            "max_candidates": S.MAX_CANDIDATES,
            "max_top_logprobs": S.MAX_TOP_LOGPROBS,
        },
    }


# --- the stream -----------------------------------------------------------------------------------------------


async def _step_events(steps: AsyncIterator[Any]) -> AsyncIterator[str]:
    """/api/generate's events: one per step (an error mid-stream becomes an {"error"} event), then [DONE]."""
    try:
        async for step in steps:
            yield sse(step_event(step))
    except (ValueError, TypeError) as exc:
        yield sse({"error": str(exc)})
    yield DONE


def step_event(step: Any) -> dict[str, Any]:
    """One /api/generate event: the Step's fields and its processed / raw probability."""
    d = step.to_dict()
    d["probability"] = math.exp(step.logprob)
    d["raw_probability"] = math.exp(step.raw_logprob)
    return d

"""/api/* routes for the page's pictures (`lmhead.explain_charts`) and its model selector.

    GET  /api/models        the models the page can choose: the startup one and the packaged ones, loaded or not
    POST /api/geometry      the head as a projection onto word directions, for the top candidates
    POST /api/distribution  probability against rank over the full vocabulary, before and after the pipeline
    POST /api/draws         N seeded draws with lmhead's sampler, and each token's count and probability
    POST /api/steps         generated tokens: probability, rank and entropy of each step
    POST /api/logits        the full-precision head's logits at the last position, all V of them (float32, little-endian
                            bytes): the page runs the declared steps over the whole row itself

Every /api route takes `?model=NAME` (served.get_served asks the registry: loaded on first use). The last few
prompts' forward passes are kept per model (`LastPosition`: ids, h, logits), so moving a slider recomputes a
chart over the full vocabulary without running the body again.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from lmhead import explain_charts as charts
from lmhead.server.schemas import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, SamplingFields
from lmhead.server.served import Served, encode_checked, get_served, sampling_config

router = APIRouter(prefix="/api", tags=["explainer pictures"])

CACHED_PROMPTS = 4  # per model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GeometryRequest(_Strict):
    """POST /api/geometry: the top candidates' rows and h, for the 2-D view."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    top: int = Field(8, ge=2, le=50, description="candidates drawn (by logit)")


class DistributionRequest(SamplingFields):
    """POST /api/distribution: the rank curve at the given settings."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    points: int = Field(160, ge=20, le=1000, description="about how many log-spaced ranks to evaluate")


class DrawsRequest(SamplingFields):
    """POST /api/draws: draw the next token n times with a seeded generator."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    n: int = Field(1000, ge=1, le=charts.MAX_DRAWS, description=f"draws; n × kept tokens ≤ {charts.DRAW_WORK:,}")
    seed: int = Field(0, ge=0, le=2**63 - 1)
    top: int = Field(12, ge=0, le=50, description="most probable tokens listed even if never drawn")


class LogitsRequest(_Strict):
    """POST /api/logits: the last position's logits over the whole vocabulary."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)


class StepToken(SamplingFields):
    """One generated token and the settings it was drawn with."""

    token_id: int = Field(..., ge=0)


class StepsRequest(_Strict):
    """POST /api/steps: the tokens generated after `prompt`, in order."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    tokens: list[StepToken] = Field(..., min_length=1, max_length=MAX_NEW_TOKENS)


@router.get("/models", summary="The models the page can choose from")
async def api_models(request: Request) -> dict[str, Any]:
    return request.app.state.registry.describe()


@router.post("/geometry", summary="The head as a projection onto word directions")
async def api_geometry(req: GeometryRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_geometry, served.model, req)


@router.post("/distribution", summary="Probability against rank over the full vocabulary")
async def api_distribution(req: DistributionRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_distribution, served.model, req)


@router.post("/draws", summary="Draw the next token n times (seeded)")
async def api_draws(req: DrawsRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_draws, served.model, req)


@router.post("/logits", summary="The last position's logits, all V (float32 little-endian bytes)",
             response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
async def api_logits(req: LogitsRequest, served: Served = Depends(get_served)) -> Response:
    body = await served.call(_logits, served.model, req)
    return Response(body, media_type="application/octet-stream", headers={"Cache-Control": "no-store"})


@router.post("/steps", summary="Probability, rank and entropy of generated tokens")
async def api_steps(req: StepsRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    return await served.call(_steps, served.model, req)


# --- the calls (blocking: they run in the model's runner thread, one at a time) -----------------------------

_LAST: weakref.WeakKeyDictionary[Any, OrderedDict[str, charts.LastPosition]] = weakref.WeakKeyDictionary()
_LAST_LOCK = threading.Lock()  # each model's runner has its own thread: two models may touch the cache at once


def last_position(model: Any, prompt: str) -> charts.LastPosition:
    """`explain_charts.last_position`, remembered for the model's last CACHED_PROMPTS prompts."""
    encode_checked(model, prompt)
    with _LAST_LOCK:
        cache = _LAST.setdefault(model, OrderedDict())
        if prompt in cache:
            cache.move_to_end(prompt)
            return cache[prompt]
    last = charts.last_position(model, prompt)  # outside the lock: one model's forward never waits for another's
    with _LAST_LOCK:
        cache[prompt] = last
        while len(cache) > CACHED_PROMPTS:
            cache.popitem(last=False)
    return last


def _geometry(model: Any, req: GeometryRequest) -> dict[str, Any]:
    return charts.head_geometry(model, last_position(model, req.prompt), top=req.top).to_dict()


def _distribution(model: Any, req: DistributionRequest) -> dict[str, Any]:
    cfg = sampling_config(req)
    return charts.rank_curve(model, last_position(model, req.prompt), cfg, points=req.points).to_dict()


def _draws(model: Any, req: DrawsRequest) -> dict[str, Any]:
    cfg = sampling_config(req)
    return charts.draw_tokens(model, last_position(model, req.prompt), req.n, seed=req.seed, config=cfg,
                              top=req.top).to_dict()


def _logits(model: Any, req: LogitsRequest) -> bytes:
    return last_position(model, req.prompt).logits.detach().cpu().numpy().astype("<f4").tobytes()


def _steps(model: Any, req: StepsRequest) -> dict[str, Any]:
    encode_checked(model, req.prompt)
    cfgs = [sampling_config(t) for t in req.tokens]
    steps = charts.step_profile(model, req.prompt, [t.token_id for t in req.tokens], cfgs)
    return {"steps": [s.to_dict() for s in steps]}

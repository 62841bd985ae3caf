"""The explainer's web app: one page and a JSON API over one loaded model (FastAPI).

    app = create_app(model)          # model: lmhead.models.Model (load_model(...) or Model(hf_model, tokenizer))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes
    GET  /                       the page (static/index.html, app.js, style.css — served locally, no CDN)
    /api/*                       the page's own API: model, params, predict, step, generate, layers, score (api.py)
                                 and its pictures and model list (charts.py; ?model=NAME: registry.py)
    /v1/*                        OpenAI-compatible: models, completions, chat/completions (v1.py); embeddings,
                                 rerank, classify, score (pooling.py: the body alone and the heads on it)
    /tokenize, /detokenize, /tokenizer_info   vLLM's tokenizer routes (tokens.py)
    /health, /metrics            200 / 503 for a load balancer (health.py); Prometheus' text format (metrics.py)

The package, one job per module:
    app.py       create_app: wires the routers, the error handlers, the guard and the static files
    guard.py     what every request passes first: Host, body size and time, strict JSON (400/413/408/422)
    docs.py      /docs from local assets (no CDN)
    protocol.py  uvicorn's HTTP/1.1 protocol with a deadline for headers (`lmhead serve` runs it; 408)
    api.py       the /api router          v1.py      the /v1 router (and OpenAI's answer shapes)
    served.py    what each route needs: the model and its runner (a FastAPI dependency), the prompt-length
                 and sampling checks that turn a request into library arguments (400 on bad input)
    runner.py    one model call at a time, in a worker thread        sse.py     server-sent events
    limits.py    what a request may use: context, max_tokens, parallel rows, KV memory, the queue
    tokens.py    /tokenize, /detokenize, /tokenizer_info
    errors.py    APIError and the error bodies (OpenAI's shape under /v1)
    schemas.py   the request and response bodies (pydantic; 422 on invalid JSON or an unknown field)

The routes hold no logic of their own: they call the `Model` (predict, generate, evaluate), `params.py`,
`models/chat.py` and `sampling.fields.sampling_config_from` (which the CLI calls too), and shape the answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from lmhead.models.start_tokenizer import transformers_tokenizer
from lmhead.server import api, charts, health, metrics, pooling, tokens, v1
from lmhead.server.docs import add_docs
from lmhead.server.errors import APIError, add_error_handlers
from lmhead.server.guard import BODY_TIMEOUT, Limits, RequestGuard
from lmhead.server.limits import ServeLimits, serve_limits
from lmhead.server.registry import ModelRegistry
from lmhead.server.runner import ModelRunner
from lmhead.server.served import Served

__all__ = ["STATIC", "APIError", "create_app"]

STATIC = Path(__file__).parent / "static"


def create_app(model: Any, *, allowed_hosts: Iterable[str] = (), max_body_bytes: int | None = None,
               body_timeout: float = BODY_TIMEOUT, serve: ServeLimits | None = None,
               prefix_cache_bytes: int | None = None, classifier: Any = None) -> FastAPI:
    """A FastAPI app serving `model` (an `lmhead.models.Model`): the explainer page and the JSON API.

    Every request passes guard.RequestGuard first: a Host of this server (loopback names, `allowed_hosts`, "*"
    for any), a body of at most `max_body_bytes` (default `serve.body_bytes`: 1 MiB, more for a long context)
    that arrives within `body_timeout` seconds, strict JSON. serve: what a request may use
    (`limits.serve_limits(model)` by default: the model's whole context). prefix_cache_bytes: the prefix cache's
    bound (`--prefix-cache-memory`; 0: none kept; default `runner.PREFIX_CACHE_BYTES`, at most a quarter of the
    KV memory). classifier: the `heads.ClassificationHead` /v1/classify answers with (default: the model
    file's own, if any).
    """
    serve = serve if serve is not None else serve_limits(model)
    transformers_tokenizer(getattr(model, "tokenizer", None))  # built now, not in the first chat request
    body = serve.body_bytes if max_body_bytes is None else max_body_bytes
    limits = Limits(allowed_hosts, body, body_timeout)  # a bad setting fails here, not later
    runner = ModelRunner(model, limits=serve, prefix_cache_bytes=prefix_cache_bytes)
    app = FastAPI(
        title="lmhead explainer",
        version="0.1.0",
        description="How a language model chooses its next token — and an OpenAI-compatible API.",
        docs_url=None, redoc_url=None,  # docs.py serves /docs from local files (FastAPI's pages load a CDN)
    )
    app.add_middleware(RequestGuard, limits=limits)
    app.state.runner = runner
    app.state.metrics = metrics.ServerMetrics(runner, getattr(model, "name", "model"))
    app.state.model = model
    app.state.served = Served(model, runner, getattr(model, "name", "model"), serve)
    app.state.limits = serve
    app.state.classifier = classifier
    app.state.registry = ModelRegistry(app.state.served)  # ?model=NAME: the page's model selector
    add_error_handlers(app)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    add_docs(app)
    app.add_api_route("/", _index, methods=["GET"], include_in_schema=False)
    app.include_router(api.router)
    app.include_router(charts.router)
    app.include_router(v1.router)
    app.include_router(pooling.router)
    app.include_router(tokens.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    return app


async def _index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

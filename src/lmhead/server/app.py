"""The explainer's web app: one page and a JSON API over one loaded model (FastAPI).

    app = create_app(model)          # model: lmhead.models.Model (load_model(...) or Model(hf_model, tokenizer))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes
    GET  /                       the page (static/index.html, app.js, style.css — served locally, no CDN)
    GET  /api/model              the loaded model: name, vocabulary, width, layers, context, limits
    GET  /api/params             its parameter breakdown by component (module counts) and GPT-2 small's
    POST /api/predict            next-token candidates: logits, raw and processed probabilities, entropy, lse
    POST /api/step               choose one token with the current settings, append it; its probability, rank
    POST /api/generate           several steps as server-sent events
    POST /api/layers             the logit lens at the last position
    POST /api/score              every token of a text with its probability and rank; the perplexity
    GET  /v1/models              OpenAI-compatible model list
    POST /v1/completions         OpenAI-compatible completions (stream, logprobs, seed, stop; top_k, min_p)
    POST /v1/chat/completions    OpenAI-compatible chat (the tokenizer's chat template)

The app holds no logic of its own: it validates requests (schemas.py), calls explain.py / generate.py / the
Model / params.py through a `ModelRunner` (one model call at a time, in a worker thread), and shapes the
answers. Errors: bad input → 400 (a bound that needs the tokenizer, or a ValueError/TypeError from the
library); invalid JSON or an unknown field → 422. Under /v1 every error body has OpenAI's shape
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmhead.server import schemas as S
from lmhead.server.runner import ModelRunner

STATIC = Path(__file__).parent / "static"


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart", "StreamOptions"}


class APIError(Exception):
    """A request the server refuses: status code, message, and the offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


# --- what the routes call (blocking; run through the ModelRunner) -------------------------------------------


def _sampling_config(req: Any, seed: int | None = None):
    from lmhead.sampling import SamplingConfig

    kwargs: dict[str, Any] = dict(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                  seed=seed)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if hasattr(req, name):
            kwargs[name] = getattr(req, name)
    if getattr(req, "logit_bias", None):
        try:
            kwargs["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise APIError(400, "logit_bias keys must be token ids", "logit_bias") from exc
    try:
        return SamplingConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc


def _max_prompt_tokens(model: Any) -> int:
    context = getattr(model, "context_length", None) or S.MAX_PROMPT_TOKENS + 1
    return max(1, min(S.MAX_PROMPT_TOKENS, context - 1))


def _encode_checked(model: Any, prompt: str, param: str = "prompt") -> list[int]:
    """The prompt's ids; 400 if it is empty or longer than the bound (in tokens)."""
    if not prompt:
        raise APIError(400, f"{param} must not be empty", param)
    ids = model.encode(prompt)
    limit = _max_prompt_tokens(model)
    if len(ids) > limit:
        raise APIError(400, f"{param} is {len(ids)} tokens; the limit is {limit}", param, "context_length_exceeded")
    return ids


def _chat_prompt(model: Any, messages: list[S.ChatMessage]) -> str:
    """The prompt text for a chat: the tokenizer's chat template, or a plain "role: text" transcript."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # No template (a base model): a transcript the model can continue.
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def _model_info(model: Any) -> dict[str, Any]:
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
            "max_prompt_tokens": _max_prompt_tokens(model),
            "max_prompt_chars": S.MAX_PROMPT_CHARS,
            "max_tokens": S.MAX_NEW_TOKENS,
            "max_candidates": S.MAX_CANDIDATES,
            "max_top_logprobs": S.MAX_TOP_LOGPROBS,
        },
    }


_COMPONENT_RULES = (  # (component, substrings of a parameter's name), first match wins
    ("norms", ("norm", "ln_")),
    ("token_embedding", ("embed_tokens", "wte", "word_embeddings")),
    ("positions", ("embed_positions", "wpe", "position_embeddings")),
    ("lm_head", ("lm_head",)),
    ("attention", ("attn", "attention")),
    ("mlp", ("mlp", "feed_forward")),
)


def _module_parameters(hf_model: Any, name: str) -> dict[str, Any]:
    """The loaded model's actual parameter counts by component (from its modules), in params.py's shape.

    A tied head shares the embedding's Parameter (named_parameters lists it once), so `lm_head` is 0 and the
    head's share is the embedding's — the matrix it multiplies by at every step.
    """
    from lmhead.params import COMPONENTS

    counts = dict.fromkeys((*COMPONENTS, "other"), 0)
    for pname, param in hf_model.named_parameters():
        for component, keys in _COMPONENT_RULES:
            if any(k in pname for k in keys):
                counts[component] += param.numel()
                break
        else:
            counts["other"] += param.numel()
    total = sum(counts.values())
    out_emb, in_emb = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    used = counts["token_embedding"] if tied else counts["lm_head"]
    return {"name": name, "arch": getattr(hf_model.config, "model_type", None), **counts, "tied": tied,
            "total": total, "shares": {k: v / total for k, v in counts.items()}, "head_share": used / total}


def _params(model: Any) -> dict[str, Any]:
    from lmhead.params import count_parameters

    return {"model": _module_parameters(model.hf_model, model.name),
            "gpt2_small": {"name": "GPT-2 small", **count_parameters().to_dict()}}


# --- the app ------------------------------------------------------------------------------------------------


def create_app(model: Any) -> FastAPI:
    """A FastAPI app serving `model` (an `lmhead.models.Model`): the explainer page and the JSON API."""
    runner = ModelRunner(model)
    app = FastAPI(
        title="lmhead explainer",
        version="0.1.0",
        description="How a language model chooses its next token — and an OpenAI-compatible API.",
    )
    app.state.runner = runner
    app.state.model = model
    served_name = getattr(model, "name", "model")

    # --- errors ---------------------------------------------------------------------------------------------

    def _is_v1(request: Request) -> bool:
        return request.url.path.startswith("/v1/")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        if _is_v1(request):
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return JSONResponse(S.openai_error(exc.message, kind, exc.param, exc.code), status_code=exc.status)
        return JSONResponse({"detail": exc.message, "param": exc.param}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if _is_v1(request):
            def where(e: dict) -> str:  # "messages.0.role"; pydantic's union tags ("str", "list[str]") dropped
                return ".".join(str(p) for p in e.get("loc", ())
                                if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p)))

            message = "; ".join(f"{where(e)}: {e.get('msg')}" for e in errors) or "invalid request"
            param = where(errors[0]) if errors else None
            return JSONResponse(S.openai_error(message, "invalid_request_error", param or None), status_code=422)
        return JSONResponse({"detail": json.loads(json.dumps(errors, default=str))}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if _is_v1(request):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(S.openai_error(str(exc.detail), kind), status_code=exc.status_code)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error: {type(exc).__name__}: {exc}"
        if _is_v1(request):
            return JSONResponse(S.openai_error(message, "server_error"), status_code=500)
        return JSONResponse({"detail": message}, status_code=500)

    async def run(fn, *args):
        """A model call through the runner; the library's ValueError/TypeError become a 400."""
        try:
            return await runner.call(fn, *args)
        except APIError:
            raise
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc)) from exc

    # --- the page -------------------------------------------------------------------------------------------

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    # --- /api -----------------------------------------------------------------------------------------------

    @app.get("/api/model", tags=["explainer"], summary="The loaded model and the server's limits")
    async def api_model() -> dict[str, Any]:
        return _model_info(model)

    @app.get("/api/params", tags=["explainer"], summary="Parameter breakdown by component, and GPT-2 small's")
    async def api_params() -> dict[str, Any]:
        return await run(_params, model)

    @app.post("/api/predict", tags=["explainer"], summary="Next-token candidates, raw and processed")
    async def api_predict(req: S.PredictRequest) -> dict[str, Any]:
        def work():
            _encode_checked(model, req.prompt)
            cfg = _sampling_config(req)
            return model.predict(req.prompt, top=req.top, config=cfg).to_dict()

        return await run(work)

    @app.post("/api/step", tags=["explainer"], summary="Choose the next token and append it",
              response_model=S.StepResponse)
    async def api_step(req: S.StepRequest) -> dict[str, Any]:
        def work():
            _encode_checked(model, req.prompt)
            # A seeded run keys each click's draw on (seed + step): clicks differ, a rerun repeats them.
            seed = None if req.seed is None else (req.seed + req.step) % 2**63
            step = next(iter(model.generate(req.prompt, 1, config=_sampling_config(req, seed=seed))))
            return step

        step = await run(work)
        return {"token_id": step.token_id, "text": step.text, "prompt": req.prompt + step.text,
                "probability": math.exp(step.logprob), "raw_probability": math.exp(step.raw_logprob),
                "rank": step.rank, "finish_reason": step.finish_reason, "seed": req.seed, "step": req.step}

    @app.post("/api/generate", tags=["explainer"], summary="Several steps, streamed as server-sent events")
    async def api_generate(req: S.GenerateRequest) -> StreamingResponse:
        await run(_encode_checked, model, req.prompt)
        cfg = await run(_sampling_config, req, None if req.seed is None else (req.seed + req.step) % 2**63)

        def make():
            return model.generate(req.prompt, req.max_tokens, config=cfg)

        async def events() -> AsyncIterator[str]:
            try:
                async for step in runner.stream(make):
                    yield _sse(_step_event(step))
            except (ValueError, TypeError) as exc:
                yield _sse({"error": str(exc)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/api/layers", tags=["explainer"], summary="The logit lens at the last position")
    async def api_layers(req: S.LayersRequest) -> dict[str, Any]:
        def work():
            _encode_checked(model, req.prompt)
            pred = model.predict(req.prompt, top=1, layers=True, layer_top=req.top).to_dict()
            return {"prompt_tokens": pred.get("prompt_tokens"), "layers": pred.get("layers")}

        return await run(work)

    @app.post("/api/score", tags=["explainer"], summary="Per-token probability and rank of a text; perplexity")
    async def api_score(req: S.ScoreRequest) -> dict[str, Any]:
        def work():
            from lmhead.explain import evaluate

            _encode_checked(model, req.text, "text")
            return evaluate(model, req.text, tokens=True, model_name=served_name).to_dict()

        return await run(work)

    # --- /v1 (OpenAI-compatible) ----------------------------------------------------------------------------

    @app.get("/v1/models", tags=["openai"], summary="The served model")
    async def v1_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": 0,
                                            "owned_by": "lmhead"}]}

    def check_model(name: str | None) -> None:
        if name not in (None, served_name):
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{served_name}'",
                           "model", "model_not_found")

    @app.post("/v1/completions", tags=["openai"], summary="OpenAI-compatible completions")
    async def v1_completions(req: S.CompletionRequest):
        check_model(req.model)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "prompt must be one string (or a list of one)", "prompt")
        prompt = prompts[0]
        ids = await run(_encode_checked, model, prompt)
        cfg = await run(_sampling_config, req, req.seed)
        top_n = req.logprobs or 0
        max_tokens = req.max_tokens or 16
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def make():
            return model.generate(prompt, max_tokens, config=cfg, stop=req.stops() or None, top_logprobs=top_n)

        def chunk(text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": served_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        if req.stream:
            async def events() -> AsyncIterator[str]:
                n = 0
                offset = len(prompt)
                async for step in runner.stream(make):
                    n += 1
                    lp = _completion_logprobs([step], tok_text, offset) if req.logprobs is not None else None
                    offset += len(step.text)
                    yield _sse(chunk(step.text, lp, step.finish_reason))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({**chunk("", None, None), "choices": [], "usage": _usage(len(ids), n)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(await _primed(events()), media_type="text/event-stream")

        steps = await run(lambda: list(make()))
        text = "".join(s.text for s in steps)
        lp = _completion_logprobs(steps, tok_text, len(prompt)) if req.logprobs is not None else None
        body = chunk(text, lp, steps[-1].finish_reason if steps else "length")
        body["usage"] = _usage(len(ids), len(steps))
        return body

    def tok_text(step: Any) -> str:
        """The token's own text (not the streamed text delta) for logprobs."""
        return model.tokenizer.decode([step.token_id])

    @app.post("/v1/chat/completions", tags=["openai"], summary="OpenAI-compatible chat completions")
    async def v1_chat(req: S.ChatRequest):
        check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        prompt = await run(_chat_prompt, model, req.messages)
        ids = await run(_encode_checked, model, prompt, "messages")
        cfg = await run(_sampling_config, req, req.seed)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        max_tokens = req.max_completion_tokens or req.max_tokens or S.MAX_NEW_TOKENS
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def make():
            return model.generate(prompt, max_tokens, config=cfg, stop=req.stops() or None, top_logprobs=top_n)

        def logprobs_of(steps: Iterable[Any]) -> dict[str, Any] | None:
            if not req.logprobs:
                return None
            return {"content": [_chat_logprob(tok_text(s), s) for s in steps],
                    "refusal": None}

        if req.stream:
            def chunk(delta: dict[str, Any], lp: Any, finish: str | None) -> dict[str, Any]:
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_name,
                        "system_fingerprint": None,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

            async def events() -> AsyncIterator[str]:
                n = 0
                yield _sse(chunk({"role": "assistant", "content": ""}, None, None))
                async for step in runner.stream(make):
                    n += 1
                    yield _sse(chunk({"content": step.text}, logprobs_of([step]), step.finish_reason))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({**chunk({}, None, None), "choices": [], "usage": _usage(len(ids), n)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(await _primed(events(), first_step=2), media_type="text/event-stream")

        steps = await run(lambda: list(make()))
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": served_name,
            "system_fingerprint": None,
            "choices": [{"index": 0,
                         "message": {"role": "assistant", "content": "".join(s.text for s in steps),
                                     "refusal": None},
                         "logprobs": logprobs_of(steps),
                         "finish_reason": steps[-1].finish_reason if steps else "length"}],
            "usage": _usage(len(ids), len(steps)),
        }

    return app


# --- shaping answers ----------------------------------------------------------------------------------------


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _primed(events: AsyncIterator[str], first_step: int = 1) -> AsyncIterator[str]:
    """Start a stream before answering, so that an error in its first step is a JSON error, not a broken stream.

    Runs the generator up to its `first_step`-th event: the first model step (a chat stream opens with a
    role-only chunk, so its first step is its second event).
    """
    first: list[str] = []
    try:
        async for event in events:
            first.append(event)
            if len(first) == first_step or event == "data: [DONE]\n\n":
                break
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc

    async def rest() -> AsyncIterator[str]:
        for event in first:
            yield event
        if first and first[-1] != "data: [DONE]\n\n":
            async for event in events:
                yield event

    return rest()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _top_pairs(step: Any) -> list[tuple[str, float]]:
    """A step's alternatives as [(token text, raw logprob)], best first.

    /v1 reports the model's own log-probabilities (raw: temperature 1, nothing cut), as OpenAI and vLLM do by
    default: with temperature 0 the processed ones would all be 0.0. The page shows both.
    """
    return [(alt.text, _finite(alt.raw_logprob)) for alt in getattr(step, "top_logprobs", None) or []]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # OpenAI's convention for "impossible" in logprobs


def _completion_logprobs(steps: list[Any], tok_text, offset: int) -> dict[str, Any]:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for step in steps:
        tokens.append(tok_text(step))
        token_logprobs.append(_finite(step.raw_logprob))
        top: dict[str, float] = {}
        for text, lp in _top_pairs(step):
            top.setdefault(text, lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(step.text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprob(text: str, step: Any) -> dict[str, Any]:
    def entry(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {**entry(text, _finite(step.raw_logprob)),
            "top_logprobs": [entry(t, lp) for t, lp in _top_pairs(step)]}


def _step_event(step: Any) -> dict[str, Any]:
    """One /api/generate event: the Step's fields and its processed / raw probability."""
    d = step.to_dict()
    d["probability"] = math.exp(step.logprob)
    d["raw_probability"] = math.exp(step.raw_logprob)
    return d

"""/v1/*: the OpenAI-compatible API (one router; `create_app` includes it).

    GET  /v1/models              the served model
    POST /v1/completions         completions (stream, logprobs, seed, stop; top_k, min_p, repetition_penalty)
    POST /v1/chat/completions    chat: the prompt from `models.chat.chat_prompt`, then the same generation

A request is checked (the model's name, prompt length, the sampling config via `checks.sampling_config_from`),
generated in the runner's shared batch (`ModelRunner.generate`: continuous batching), and shaped as OpenAI's
objects: `_Completion` and `_Chat` build the ids, chunks and bodies. Log-probabilities are the model's own
(raw: temperature 1, nothing cut), as OpenAI and vLLM report them, from the decode head (`exact_logprobs: true`,
an lmhead extension: from the fp32 head) — a request without `logprobs` gets none computed (`scores=False`);
errors have OpenAI's shape (errors.py).

Structured output (`response_format`, `structured_outputs`, `json_schema`, `grammar`; `tools` on chat): one
constraint (server/structured.py), compiled before the answer starts (a 400 where it cannot be), decoded in the
shared batch with the other requests; under it the logprobs are the constrained distribution's. A chat answer
that is a call has `tool_calls`, no content and finish_reason "tool_calls".
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.served import Served, chat_ids, encode_checked, get_served, sampling_config
from lmhead.server.sse import DONE, primed, sse
from lmhead.server.structured import ToolCalls, chat_turns, compile_for, constraint_for, tool_prompt

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models", summary="The served model")
async def v1_models(served: Served = Depends(get_served)) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                        "owned_by": "lmhead"}]}


@router.post("/completions", summary="OpenAI-compatible completions")
async def v1_completions(req: S.CompletionRequest, request: Request, served: Served = Depends(get_served)):
    _check_model(served, req.model)
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]  # a list of one (schemas checks)
    ids = await served.call(encode_checked, served.model, prompt)
    cfg = sampling_config(req, req.seed)  # pure and bounded: no trip to the model's thread
    constraint, _ = await _structured(served, req)
    steps = partial(served.generate, prompt, req.max_tokens or 16, config=cfg, stop=req.stops() or None,
                    top_logprobs=req.logprobs or 0, exact_logprobs=req.exact_logprobs,
                    scores=req.logprobs is not None, constraint=constraint)
    answer = _Completion(served, req, prompt, len(ids))
    if req.stream:
        return StreamingResponse(await primed(answer.events(steps())), media_type="text/event-stream")
    return answer.body(await served.collect(steps(), request))


@router.post("/chat/completions", summary="OpenAI-compatible chat completions")
async def v1_chat(req: S.ChatRequest, request: Request, served: Served = Depends(get_served)):
    _check_model(served, req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    messages = chat_turns(req.messages)  # tool calls and results as text any template reads
    constraint, tools = await _structured(served, req)
    if tools is not None:
        prompt, ids = await served.call(tool_prompt, served.model, messages, _called(req, tools))
    else:
        prompt, ids = await served.call(chat_ids, served.model, messages)
    cfg = sampling_config(req, req.seed)
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    max_tokens = req.max_completion_tokens or req.max_tokens or S.MAX_NEW_TOKENS
    steps = partial(served.generate, prompt, max_tokens, config=cfg, stop=req.stops() or None, top_logprobs=top_n,
                    exact_logprobs=req.exact_logprobs, scores=bool(req.logprobs), constraint=constraint)
    answer = _Chat(served, req, len(ids), tools)
    if req.stream and tools is not None:  # a call is known once it is whole: the answer comes as one chunk
        events = answer.events_whole(await served.collect(steps(), request))
        return StreamingResponse(events, media_type="text/event-stream")
    if req.stream:
        events = answer.events(steps())
        return StreamingResponse(await primed(events, first_step=2), media_type="text/event-stream")
    return answer.body(await served.collect(steps(), request))


async def _structured(served: Served, req: Any):
    """The request's constraint and tool reader (`structured.constraint_for`), compiled off the event loop; what
    cannot be compiled or is not supported is a 400 naming it."""
    try:
        constraint, tools = constraint_for(req)
        await asyncio.to_thread(compile_for, served.model, constraint)
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        param = next((f for f in ("response_format", "structured_outputs", "json_schema", "grammar", "tools")
                      if getattr(req, f, None) is not None), None)
        raise APIError(400, str(exc), param) from exc
    return constraint, tools


def _called(req: S.ChatRequest, tools: ToolCalls) -> list[S.Tool]:
    return [t for t in req.tools or [] if t.function.name in tools.names]


def _check_model(served: Served, name: str | None) -> None:
    if name not in (None, served.name):
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{served.name}'",
                       "model", "model_not_found")


# --- shaping answers --------------------------------------------------------------------------------------------


class _Answer:
    """What a completion and a chat answer share: the id, the creation time, the usage and the token texts."""

    prefix = ""

    def __init__(self, served: Served, req: Any, prompt_tokens: int) -> None:
        self.served, self.req, self.prompt_tokens = served, req, prompt_tokens
        self.id, self.created = f"{self.prefix}-{uuid.uuid4().hex}", int(time.time())

    def tok_text(self, step: Any) -> str:
        """The token's own text (not the streamed text delta) for logprobs."""
        return self.served.model.tokenizer.decode([step.token_id])

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}


class _Completion(_Answer):
    """A /v1/completions answer: `text_completion` chunks (streamed) or one body."""

    prefix = "cmpl"

    def __init__(self, served: Served, req: S.CompletionRequest, prompt: str, prompt_tokens: int) -> None:
        super().__init__(served, req, prompt_tokens)
        self.prompt = prompt

    def chunk(self, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    def logprobs(self, steps: list[Any], offset: int) -> dict[str, Any] | None:
        return completion_logprobs(steps, self.tok_text, offset) if self.req.logprobs is not None else None

    async def events(self, steps: AsyncIterator[Any]) -> AsyncIterator[str]:
        n, offset = 0, len(self.prompt)
        async for step in steps:
            n += 1
            lp = self.logprobs([step], offset)
            offset += len(step.text)
            yield sse(self.chunk(step.text, lp, step.finish_reason))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk("", None, None), "choices": [], "usage": self.usage(n)})
        yield DONE

    def body(self, steps: list[Any]) -> dict[str, Any]:
        text = "".join(s.text for s in steps)
        out = self.chunk(text, self.logprobs(steps, len(self.prompt)), steps[-1].finish_reason if steps else "length")
        out["usage"] = self.usage(len(steps))
        return out


class _Chat(_Answer):
    """A /v1/chat/completions answer: `chat.completion.chunk`s (streamed) or one `chat.completion`."""

    prefix = "chatcmpl"

    def __init__(self, served: Served, req: S.ChatRequest, prompt_tokens: int, tools: ToolCalls | None = None) -> None:
        super().__init__(served, req, prompt_tokens)
        self.tools = tools

    def message(self, steps: list[Any]) -> tuple[dict[str, Any], str]:
        """The answer's message and finish reason: a tool call where the text is a whole call."""
        text = "".join(s.text for s in steps)
        finish = steps[-1].finish_reason if steps else "length"
        calls = self.tools.read(text) if self.tools is not None and finish == "stop" else None
        if calls:
            return {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": text, "refusal": None}, finish

    async def events_whole(self, steps: list[Any]) -> AsyncIterator[str]:
        """A finished answer as a stream: the role, the content or the tool calls (with their index), the finish."""
        message, finish = self.message(steps)
        yield sse(self.chunk({"role": "assistant", "content": ""}, None, None))
        if "tool_calls" in message:
            calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
            yield sse(self.chunk({"tool_calls": calls}, None, None))
        else:
            yield sse(self.chunk({"content": message["content"]}, self.logprobs(steps), None))
        yield sse(self.chunk({}, None, finish))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk({}, None, None), "choices": [], "usage": self.usage(len(steps))})
        yield DONE

    def logprobs(self, steps: Iterable[Any]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {"content": [chat_logprob(self.tok_text(s), s) for s in steps], "refusal": None}

    def chunk(self, delta: dict[str, Any], lp: Any, finish: str | None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.served.name, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    async def events(self, steps: AsyncIterator[Any]) -> AsyncIterator[str]:
        n = 0
        yield sse(self.chunk({"role": "assistant", "content": ""}, None, None))
        async for step in steps:
            n += 1
            yield sse(self.chunk({"content": step.text}, self.logprobs([step]), step.finish_reason))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk({}, None, None), "choices": [], "usage": self.usage(n)})
        yield DONE

    def body(self, steps: list[Any]) -> dict[str, Any]:
        message, finish = self.message(steps)
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.served.name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": self.logprobs(steps), "finish_reason": finish}],
            "usage": self.usage(len(steps)),
        }


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # OpenAI's convention for "impossible" in logprobs


def _top_pairs(step: Any) -> list[tuple[str, float]]:
    """A step's alternatives as [(token text, raw logprob)], best first.

    /v1 reports the model's own log-probabilities (raw: temperature 1, nothing cut), as OpenAI and vLLM do by
    default: with temperature 0 the processed ones would all be 0.0. The page shows both.
    """
    return [(alt.text, _finite(alt.raw_logprob)) for alt in getattr(step, "top_logprobs", None) or []]


def completion_logprobs(steps: list[Any], tok_text: Callable[[Any], str], offset: int) -> dict[str, Any]:
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


def chat_logprob(text: str, step: Any) -> dict[str, Any]:
    """One chat `logprobs.content` entry: the token, its raw logprob, its bytes and its alternatives."""
    def entry(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {**entry(text, _finite(step.raw_logprob)),
            "top_logprobs": [entry(t, lp) for t, lp in _top_pairs(step)]}

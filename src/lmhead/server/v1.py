"""/v1/*: the OpenAI-compatible API (one router; `create_app` includes it).

    GET  /v1/models              the served model
    POST /v1/completions         completions: prompts as text, lists, token ids (a choice each, × n), echo and
                                 prompt logprobs (`lmhead.prompt_scores`: the fp32 head's), stream, logprobs,
                                 seed, stop; top_k, min_p, repetition_penalty; vLLM's stop_token_ids, min_tokens,
                                 ignore_eos, include_stop_str_in_output, prompt_logprobs
    POST /v1/chat/completions    chat: the prompt from `models.chat.chat_prompt`, then the same generation

A request is checked (the model's name, characters and tokens against the served limits — prompt + max_tokens ≤
the context, rows ≤ --parallel and within the KV memory: served.py —, the sampling config via
`sampling.fields.sampling_config_from`),
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
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from functools import partial
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from lmhead.decode.rows import prepare_ids
from lmhead.prompt_scores import prompt_scores
from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.served import (
    Served,
    chat_ids,
    check_chars,
    check_fit,
    check_rows,
    context_of,
    get_served,
    prompt_ids,
    sampling_config,
)
from lmhead.server.sse import DONE, primed, sse
from lmhead.server.structured import ToolCalls, chat_turns, compile_for, constraint_for, tool_prompt
from lmhead.server.words import with_word_ids

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models", summary="The served model")
async def v1_models(served: Served = Depends(get_served)) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                        "owned_by": "lmhead"}]}


@router.post("/completions", summary="OpenAI-compatible completions")
async def v1_completions(req: S.CompletionRequest, request: Request, served: Served = Depends(get_served)):
    _check_model(served, req.model)
    prompts = req.prompts()
    texts = [p for p in prompts if isinstance(p, str)]
    check_chars(served.limits, texts, "prompt")
    if req.min_tokens and req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({req.max_tokens})",
                       "min_tokens")
    ids = await served.call(prompt_ids, served.model, prompts)
    lengths = [len(x) for x in ids]
    context = context_of(served)
    if "max_tokens" in req.model_fields_set and req.max_tokens is not None:
        max_tokens = req.max_tokens
    else:  # OpenAI's default of 16, or the rest of the context (None)
        # at least 1: a prompt that fills the context is a 400 below, not an empty answer
        max_tokens = max(1, min(16 if req.max_tokens is not None else context, context - max(lengths)))
    check_fit(served, lengths, max_tokens)
    rows = len(ids) * req.n
    check_rows(served, rows, max(lengths) + max_tokens)
    constraint, _ = await _structured(served, req)  # a 400 before any work where it does not compile
    top_prompt = _prompt_top(req)
    scored = (await served.call(_all_prompt_scores, served.model, ids, top_prompt)
              if top_prompt is not None else None)
    answer = _Completion(served, req, prompts, ids, scored)
    if max_tokens == 0:
        if req.stream:
            return StreamingResponse(answer.events(None), media_type="text/event-stream")
        return answer.body([])
    # pure and bounded: no trip to the model's thread (but to tokenise bad_words given as words)
    cfg = sampling_config(await with_word_ids(served, req), req.seed)
    configs = [cfg if req.seed is None or j == 0 else dataclasses.replace(cfg, seed=(req.seed + j) % 2**63)
               for _ in ids for j in range(req.n)]
    flat = [x for x in ids for _ in range(req.n)]
    steps = partial(served.generate, flat, max_tokens, prepare_rows=prepare_ids, config=configs,
                    stop=req.stops() or None, top_logprobs=req.logprobs or 0, exact_logprobs=req.exact_logprobs,
                    scores=req.logprobs is not None, stop_token_ids=req.stop_token_ids,
                    ignore_eos=req.ignore_eos, include_stop=req.include_stop_str_in_output,
                    size=(rows, max(lengths) + max_tokens), constraint=constraint)
    if req.stream:
        return StreamingResponse(await primed(answer.events(steps())), media_type="text/event-stream")
    return answer.body(await served.collect(steps(), request))


async def _nothing() -> AsyncIterator[Any]:
    return
    yield


def _prompt_top(req: S.CompletionRequest) -> int | None:
    """How many alternatives the prompt tokens' scores list (None: no prompt scores): vLLM's prompt_logprobs,
    or echo with logprobs (OpenAI's legacy shape)."""
    wanted = [n for n in (req.prompt_logprobs, req.logprobs if req.echo else None) if n is not None]
    return max(wanted) if wanted else None


def _all_prompt_scores(model: Any, ids: list[list[int]], top: int) -> list[list[Any]]:
    return [prompt_scores(model, x, top) for x in ids]


@router.post("/chat/completions", summary="OpenAI-compatible chat completions")
async def v1_chat(req: S.ChatRequest, request: Request, served: Served = Depends(get_served)):
    _check_model(served, req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
    messages = chat_turns(req.messages)  # tool calls and results as text any template reads
    check_chars(served.limits, ["".join(m.get("content") or "" for m in messages)], "messages")
    constraint, tools = await _structured(served, req)
    if tools is not None:
        _, ids = await served.call(tool_prompt, served.model, messages, _called(req, tools))
    else:
        _, ids = await served.call(chat_ids, served.model, messages)
    context = context_of(served)
    asked = req.max_completion_tokens or req.max_tokens
    max_tokens = asked if asked is not None else context - len(ids)  # default: the rest of the context
    if served.limits is not None and asked is None:
        max_tokens = min(max_tokens, served.limits.max_tokens)
    check_fit(served, [len(ids)], max(max_tokens, 1), "messages")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")
    check_rows(served, req.n, len(ids) + max_tokens)
    cfg = sampling_config(await with_word_ids(served, req), req.seed)
    configs = [cfg if req.seed is None or j == 0 else dataclasses.replace(cfg, seed=(req.seed + j) % 2**63)
               for j in range(req.n)]
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    steps = partial(served.generate, [ids] * req.n, max_tokens, prepare_rows=prepare_ids, config=configs,
                    stop=req.stops() or None, top_logprobs=top_n, exact_logprobs=req.exact_logprobs,
                    scores=bool(req.logprobs), stop_token_ids=req.stop_token_ids,
                    ignore_eos=req.ignore_eos, include_stop=req.include_stop_str_in_output,
                    size=(req.n, len(ids) + max_tokens), constraint=constraint)
    answer = _Chat(served, req, len(ids), tools)
    if req.stream and tools is not None:  # a call is known once it is whole: each choice comes as one chunk
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
    """A /v1/completions answer: `text_completion` chunks (streamed) or one body; one choice per prompt and n
    (`index` = prompt × n + j), each with the prompt (echo) and its tokens' scores (echo + logprobs: OpenAI's
    legacy shape, the first token's null; prompt_logprobs: vLLM's)."""

    prefix = "cmpl"

    def __init__(self, served: Served, req: S.CompletionRequest, prompts: list[Any], ids: list[list[int]],
                 scored: list[list[Any]] | None) -> None:
        super().__init__(served, req, sum(len(x) for x in ids))
        self.prompts, self.ids, self.scored, self.n = prompts, ids, scored, req.n

    def prompt_text(self, p: int) -> str:
        prompt = self.prompts[p]
        return prompt if isinstance(prompt, str) else self.served.model.tokenizer.decode(self.ids[p])

    def choice(self, index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.req.prompt_logprobs is not None and self.scored is not None:
            out["prompt_logprobs"] = self.vllm_prompt_logprobs(index // self.n)
        return out

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": choices}

    def logprobs(self, steps: list[Any], offset: int) -> dict[str, Any] | None:
        return completion_logprobs(steps, self.tok_text, offset) if self.req.logprobs is not None else None

    def echo_logprobs(self, p: int) -> dict[str, Any]:
        """The prompt's tokens in the legacy logprobs shape: their texts, logprobs (the first None), each one's
        top `logprobs` alternatives (None for the first) and text offsets."""
        tok = self.served.model.tokenizer
        top_n = self.req.logprobs or 0
        tokens, token_logprobs, tops, offsets, offset = [], [], [], [], 0
        for t, score in zip(self.ids[p], self.scored[p], strict=True):
            text = tok.decode([t])
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if score is None:
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(_finite(score.logprob))
            top: dict[str, float] = {}
            for alt, lp in score.top[:top_n]:
                top.setdefault(tok.decode([alt]), _finite(lp))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def vllm_prompt_logprobs(self, p: int) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank, decoded_token}} for
        the token and its top alternatives."""
        tok = self.served.model.tokenizer
        out: list[dict[str, dict[str, Any]] | None] = []
        for score in self.scored[p]:
            if score is None:
                out.append(None)
                continue
            entry = {str(score.token_id): {"logprob": _finite(score.logprob), "rank": score.rank,
                                           "decoded_token": tok.decode([score.token_id])}}
            for rank, (alt, lp) in enumerate(score.top[:self.req.prompt_logprobs], start=1):
                entry.setdefault(str(alt), {"logprob": _finite(lp), "rank": rank, "decoded_token": tok.decode([alt])})
            out.append(entry)
        return out

    async def events(self, steps: AsyncIterator[Any] | None) -> AsyncIterator[str]:
        count: dict[int, int] = {}
        offsets = {i: len(self.prompt_text(i // self.n)) for i in range(len(self.ids) * self.n)}
        if self.req.echo:  # each choice's first chunk: its prompt (and its tokens' logprobs), as vLLM streams it
            for i in offsets:
                lp = self.echo_logprobs(i // self.n) if self.req.logprobs is not None else None
                yield sse(self.chunk([self.choice(i, self.prompt_text(i // self.n), lp,
                                                  None if steps is not None else "length")]))
        async for step in steps if steps is not None else _nothing():
            count[step.index] = count.get(step.index, 0) + 1
            lp = self.logprobs([step], offsets[step.index])
            offsets[step.index] += len(step.text)
            yield sse(self.chunk([self.choice(step.index, step.text, lp, step.finish_reason)]))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk([]), "usage": self.usage(sum(count.values()))})
        yield DONE

    def body(self, steps: list[Any]) -> dict[str, Any]:
        per: dict[int, list[Any]] = {i: [] for i in range(len(self.ids) * self.n)}
        for step in steps:
            per[step.index].append(step)
        choices = []
        for i, own in per.items():
            p = i // self.n
            prompt = self.prompt_text(p) if self.req.echo else ""
            text = prompt + "".join(s.text for s in own)
            lp = self.logprobs(own, len(self.prompt_text(p)))  # offsets count the prompt, echoed or not
            if lp is not None and self.req.echo and self.scored is not None:
                head = self.echo_logprobs(p)
                lp = {key: head[key] + lp[key] for key in lp}
            choices.append(self.choice(i, text, lp, own[-1].finish_reason if own else "length"))
        out = self.chunk(choices)
        out["usage"] = self.usage(len(steps))
        return out


class _Chat(_Answer):
    """A /v1/chat/completions answer: `chat.completion.chunk`s (streamed) or one `chat.completion`; n choices,
    each its `index`."""

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

    def per_choice(self, steps: list[Any]) -> dict[int, list[Any]]:
        per: dict[int, list[Any]] = {i: [] for i in range(self.req.n)}
        for step in steps:
            per[step.index].append(step)
        return per

    async def events_whole(self, steps: list[Any]) -> AsyncIterator[str]:
        """Finished answers as a stream: per choice the role, the content or the tool calls (with their index),
        the finish."""
        for i, own in self.per_choice(steps).items():
            message, finish = self.message(own)
            yield sse(self.chunk({"role": "assistant", "content": ""}, None, None, i))
            if "tool_calls" in message:
                calls = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
                yield sse(self.chunk({"tool_calls": calls}, None, None, i))
            else:
                yield sse(self.chunk({"content": message["content"]}, self.logprobs(own), None, i))
            yield sse(self.chunk({}, None, finish, i))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk({}, None, None), "choices": [], "usage": self.usage(len(steps))})
        yield DONE

    def logprobs(self, steps: Iterable[Any]) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        return {"content": [chat_logprob(self.tok_text(s), s) for s in steps], "refusal": None}

    def chunk(self, delta: dict[str, Any], lp: Any, finish: str | None, index: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.served.name, "system_fingerprint": None,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    async def events(self, steps: AsyncIterator[Any]) -> AsyncIterator[str]:
        n = 0
        for i in range(self.req.n):
            yield sse(self.chunk({"role": "assistant", "content": ""}, None, None, i))
        async for step in steps:
            n += 1
            yield sse(self.chunk({"content": step.text}, self.logprobs([step]), step.finish_reason, step.index))
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield sse({**self.chunk({}, None, None), "choices": [], "usage": self.usage(n)})
        yield DONE

    def body(self, steps: list[Any]) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.served.name,
            "system_fingerprint": None,
            "choices": [{"index": i, "message": message, "logprobs": self.logprobs(own), "finish_reason": finish}
                        for i, own in self.per_choice(steps).items()
                        for message, finish in [self.message(own)]],
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

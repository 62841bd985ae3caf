"""What every route needs: the served model and its runner (`Served`, a FastAPI dependency), and the checks that
turn a request into library arguments (prompt length in tokens, the sampling config) with their 400s.

    @router.post("/x")
    async def x(req: S.SomeRequest, served: Served = Depends(get_served)):
        ids = await served.call(encode_checked, served.model, req.prompt)

`create_app` stores one `Served` in `app.state.served`; routers are module-level and find it there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from lmhead.models.chat import chat_prompt
from lmhead.sampling.fields import sampling_config_from
from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.limits import RETRY_AFTER_S, ServeLimits
from lmhead.server.runner import ModelRunner, QueueFull

if TYPE_CHECKING:
    from lmhead.sampling import SamplingConfig

T = TypeVar("T")


@dataclass
class Served:
    """The served model, the runner that serialises its calls, the name clients address it by, and what a
    request may use (`limits.ServeLimits`; None: the model's own context, no KV or queue bound)."""

    model: Any
    runner: ModelRunner
    name: str
    limits: ServeLimits | None = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A model call through the runner; the library's ValueError/TypeError become a 400."""
        with _as_400():
            return await self.runner.call(fn, *args)

    def generate(self, prompt: Any, max_new_tokens: int, **kwargs: Any) -> AsyncIterator[Any]:
        """The Steps of a generation decoded in the runner's shared batch (see `ModelRunner.generate`); a full
        queue is a 503 with Retry-After."""
        try:
            return self.runner.generate(prompt, max_new_tokens, **kwargs)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later", None, "server_busy",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from exc

    async def collect(self, steps: AsyncIterator[T], request: Request) -> list[T]:
        """All of `steps` (a non-streamed answer); a client that hangs up stops the generation (see
        `ModelRunner.collect`); the library's ValueError/TypeError become a 400."""
        with _as_400():
            return await self.runner.collect(steps, request.is_disconnected)

    def stream(self, make_iter: Callable[[], Iterable[T]]) -> AsyncIterator[T]:
        """`make_iter()`'s items, produced in the runner's worker thread (see `ModelRunner.stream`)."""
        return self.runner.stream(make_iter)


@contextmanager
def _as_400() -> Iterator[None]:
    try:
        yield
    except APIError:
        raise
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc


async def get_served(request: Request) -> Served:
    """The dependency that hands a route the app's `Served` (with `?model=NAME`: that model's, loaded on first use
    by the app's `registry.ModelRegistry`)."""
    name = request.query_params.get("model")
    registry = getattr(request.app.state, "registry", None)
    if name is None or registry is None:
        return request.app.state.served
    return await registry.get(name)


def max_prompt_tokens(model: Any) -> int:
    """The longest prompt the server accepts, in tokens: its bound, and room for one new token in the context."""
    context = getattr(model, "context_length", None) or S.MAX_PROMPT_TOKENS + 1
    return max(1, min(S.MAX_PROMPT_TOKENS, context - 1))


def encode_checked(model: Any, prompt: str, param: str = "prompt") -> list[int]:
    """The prompt's ids; 400 if it is empty or longer than the bound (in tokens)."""
    if not prompt:
        raise APIError(400, f"{param} must not be empty", param)
    ids = model.encode(prompt)
    limit = max_prompt_tokens(model)
    if len(ids) > limit:
        raise APIError(400, f"{param} is {len(ids)} tokens; the limit is {limit}", param, "context_length_exceeded")
    return ids


def chat_ids(model: Any, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """A chat's prompt (`models.chat.chat_prompt`) and its ids: one call on the model's thread, not two (while a
    batch decodes, each call waits for a round to end). The routes check its length against the context."""
    prompt = chat_prompt(model, messages)
    if not prompt:
        raise APIError(400, "messages must not be empty", "messages")
    return prompt, model.encode(prompt)


def sampling_config(req: Any, seed: int | None = None) -> SamplingConfig:
    """`sampling.fields.sampling_config_from(req, seed)` (the CLI's function too); a bad setting is a 400. Pure and
    bounded by the request's schema: routes call it on the event loop, not through the model's thread."""
    try:
        return sampling_config_from(req, seed)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), getattr(exc, "option", None)) from exc


# --- /v1's bounds, from the served limits ---------------------------------------------------------------------


def check_chars(limits: ServeLimits | None, texts: list[str], param: str) -> None:
    """422 (before tokenising) when a text is over the served character bound (`ServeLimits.prompt_chars`)."""
    bound = limits.prompt_chars if limits is not None else S.MAX_PROMPT_CHARS
    for text in texts:
        if len(text) > bound:
            raise APIError(422, f"{param}: the text holds {len(text):,} characters; the limit is {bound:,} "
                                f"(16 a token of the served context)", param)


def prompt_ids(model: Any, prompts: list[str] | list[list[int]], param: str = "prompt") -> list[list[int]]:
    """The ids of each prompt (strings tokenised as `Model.encode` does; token ids checked against the
    vocabulary): one call on the model's thread. An empty prompt or an id outside the vocabulary is a 400."""
    out = []
    vocab = model.vocab_size
    for i, p in enumerate(prompts):
        where = param if len(prompts) == 1 else f"{param}.{i}"
        if isinstance(p, str):
            if not p:
                raise APIError(400, f"{where} must not be empty", param)
            out.append(model.encode(p))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{where}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param)
        out.append(list(p))
    return out


def context_of(served: Served) -> int:
    """The served context in tokens (prompt + max_tokens at most)."""
    if served.limits is not None:
        return served.limits.context
    return getattr(served.model, "context_length", None) or S.MAX_CONTEXT_TOKENS


def check_fit(served: Served, lengths: list[int], max_tokens: int, param: str = "prompt") -> None:
    """400 `context_length_exceeded` naming both numbers when a prompt's tokens and max_tokens pass the context;
    400 naming max_tokens past `--max-tokens`."""
    context = context_of(served)
    longest = max(lengths)
    if longest + max_tokens > context:
        raise APIError(400, f"This model's maximum context length is {context:,} tokens. However, you requested "
                            f"{longest + max_tokens:,} tokens ({longest:,} in the {param}, {max_tokens:,} in "
                            f"max_tokens). Please reduce the {param} or max_tokens.", param,
                       "context_length_exceeded")
    limits = served.limits
    if limits is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens is {max_tokens:,}; this server allows at most {limits.max_tokens:,} "
                            f"(lmhead serve --max-tokens)", "max_tokens")


def check_rows(served: Served, rows: int, longest: int) -> None:
    """400 naming n when a request's rows (prompts × n) are more than --parallel or their KV cache cannot fit
    the server's KV memory even alone (it would wait forever)."""
    limits = served.limits
    if limits is None:
        return
    if rows > limits.parallel:
        raise APIError(400, f"n × prompts is {rows}; this server decodes at most {limits.parallel} rows at once "
                            f"(lmhead serve --parallel)", "n")
    need = limits.batch_kv_bytes(rows, longest)
    if need > limits.kv_bytes:
        raise APIError(400, f"n × prompts = {rows} rows of {longest:,} tokens need {need / 2**30:.2f} GiB of KV "
                            f"memory; this server has {limits.kv_bytes / 2**30:.2f} GiB (lmhead serve --kv-memory)",
                       "n")

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

from lmhead.checks import sampling_config_from
from lmhead.models.chat import chat_prompt
from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.runner import ModelRunner

if TYPE_CHECKING:
    from lmhead.sampling import SamplingConfig

T = TypeVar("T")


@dataclass
class Served:
    """The served model, the runner that serialises its calls, and the name clients address it by."""

    model: Any
    runner: ModelRunner
    name: str

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A model call through the runner; the library's ValueError/TypeError become a 400."""
        with _as_400():
            return await self.runner.call(fn, *args)

    def generate(self, prompt: str, max_new_tokens: int, **kwargs: Any) -> AsyncIterator[Any]:
        """The Steps of a generation decoded in the runner's shared batch (see `ModelRunner.generate`)."""
        return self.runner.generate(prompt, max_new_tokens, **kwargs)

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
    """A chat's prompt (`models.chat.chat_prompt`) and its ids (`encode_checked`, naming "messages"): one call on
    the model's thread, not two (while a batch decodes, each call waits for a round to end)."""
    prompt = chat_prompt(model, messages)
    return prompt, encode_checked(model, prompt, "messages")


def sampling_config(req: Any, seed: int | None = None) -> SamplingConfig:
    """`checks.sampling_config_from(req, seed)` (the CLI's function too); a bad setting is a 400. Pure and bounded
    by the request's schema: routes call it on the event loop, not through the model's thread."""
    try:
        return sampling_config_from(req, seed)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), getattr(exc, "option", None)) from exc

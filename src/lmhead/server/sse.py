"""Server-sent events: one JSON object per `data:` line, `data: [DONE]` at the end (as OpenAI streams).

`primed` starts a stream before the response is sent, so that an error in its first model step is still a
JSON error with a status code rather than a stream that breaks after a 200.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from lmhead.server.errors import APIError

DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    """One event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def primed(events: AsyncIterator[str], first_step: int = 1) -> AsyncIterator[str]:
    """Start a stream before answering, so that an error in its first step is a JSON error, not a broken stream.

    Runs the generator up to its `first_step`-th event: the first model step (a chat stream opens with a
    role-only chunk, so its first step is its second event). A ValueError/TypeError there is a 400.
    """
    first: list[str] = []
    try:
        async for event in events:
            first.append(event)
            if len(first) == first_step or event == DONE:
                break
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc

    async def rest() -> AsyncIterator[str]:
        for event in first:
            yield event
        if first and first[-1] != DONE:
            async for event in events:
                yield event

    return rest()

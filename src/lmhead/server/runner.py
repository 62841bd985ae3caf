"""One model, many requests: every model call runs in a worker thread, one at a time.

The event loop never runs model code: `call()` hands a blocking function to anyio's thread pool and awaits it,
so the loop keeps accepting connections and serving the page while the model works. An asyncio lock queues
callers fairly (FIFO) without parking a thread per waiting request, and a threading lock around the call itself
makes exclusion hold even if an awaiting request is cancelled (anyio does not abandon a running thread).

`stream()` runs a whole generation under the lock in one worker thread and hands its steps to the request
through an asyncio queue: a slow reader never holds the model, and a generation's KV cache and sampling
state live only in its own generator — no request sees another's state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import anyio.to_thread

T = TypeVar("T")
_END = object()


class ModelRunner:
    """Serialises access to one model. `await runner.call(fn, *args)`; `async for x in runner.stream(make)`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._alock = asyncio.Lock()
        self._tlock = threading.Lock()
        self.calls = 0

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._tlock:
            self.calls += 1
            return fn(*args)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in a worker thread while holding the model; returns its result or raises."""
        async with self._alock:
            return await anyio.to_thread.run_sync(self._locked, fn, *args)

    async def stream(self, make_iter: Callable[[], Iterable[T]]) -> AsyncIterator[T]:
        """Iterate `make_iter()` in a worker thread under the lock, yielding its items as they come."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def produce() -> None:
            try:
                iterator = iter(make_iter())
                try:
                    for item in iterator:
                        loop.call_soon_threadsafe(queue.put_nowait, (item, None))
                        if cancelled.is_set():
                            break
                finally:
                    close = getattr(iterator, "close", None)
                    if close is not None:
                        close()
            except Exception as exc:  # handed to the request, which turns it into an error response/event
                loop.call_soon_threadsafe(queue.put_nowait, (_END, exc))
                return
            loop.call_soon_threadsafe(queue.put_nowait, (_END, None))

        task = asyncio.ensure_future(self.call(produce))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors went through the queue
        try:
            while True:
                item, exc = await queue.get()
                if item is _END:
                    if exc is not None:
                        raise exc
                    break
                yield item
        finally:
            cancelled.set()  # a reader that went away stops the generation after its current step

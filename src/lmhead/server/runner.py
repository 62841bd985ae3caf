"""One model, many requests: a scheduler thread owns the model and decodes every generation in one batch.

    request ──generate(prompt, ...)──▶ waiting ──admit: prepare (tokenise, check), prefill──▶ live rows
    each turn of the scheduler thread:
        pending calls (explain endpoints: predict, step, layers, score; the routes' checks) run, alone, in
            order, for about as long as one decode round takes (all of them when nothing decodes)
        each generic stream (`stream`) gives one item
        waiting generations join the batch (each row's prompt starting from the longest run of blocks the
            prefix cache holds: `prefix_cache.PrefixCache`, `lmhead.generate.Batch.begin_join`: their prompts prefilled
            together, one piece per turn, sized by `decode.budget.PrefillBudget` — chunked prefill, so a long
            prompt does not hold the running streams for its whole prefill — then merged into the running
            rows' caches); no other request joins while one does
        rows whose request went away are retired (`Batch.remove`)
        one batched decode round for every live row (`Batch.step`); each row's Step goes to its request's
            queue; finished rows leave
    the thread ends when there is nothing to do and starts again with the next request

Admission (with `limits`, server/limits.py): a waiting request joins when the live rows, with its own, are at
most `limits.parallel` and their KV cache fits `limits.kv_bytes` (`ServeLimits.batch_kv_bytes`, from the
request's row count and its longest row's prompt + max_tokens); otherwise it waits its turn, first come first
served — never an out-of-memory kill, never a shorter answer. Past `limits.queue` waiting requests a new one is
refused at once (`QueueFull`: the route's 503 with Retry-After).

Continuous batching, as vLLM's and llama.cpp's servers do it: requests that arrive together, or while others
decode, share decode steps, so 8 concurrent generations cost little more than one. Each answer is what its
request gets alone: rows have their own configs and seeds (a seeded row draws from (seed, step) only), left
padding and merged caches are invisible to attention, and `decode.logits.decode_logits` keeps a reproducible
row's head call its own wherever the compressed head's approximate tail could reach its choice.

The event loop never runs model code: it hands jobs to the thread and awaits futures and queues, so it keeps
accepting connections and serving the page while the model works. A request that goes away (a streamed
reader that stops, or a non-streamed client that hangs up: `collect` polls for the disconnect) has its rows
retired before the next round.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from lmhead.decode.rows import Row, Step, prepare
from lmhead.generate import Batch
from lmhead.prefix_cache import PrefixCache

T = TypeVar("T")
_END = object()


class QueueFull(Exception):
    """A generation refused because `limits.queue` requests already wait for room."""

MAX_BATCH = 32  # live rows at most; later requests wait for a row to finish
PREFIX_CACHE_BYTES = 1 << 30  # the prefix cache's bound (at most a quarter of the KV memory)
DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there


@dataclass(eq=False)
class _Job:
    """A request's stream of items: its queue on the request's event loop, and whether it was abandoned."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    done: bool = False

    def put(self, item: Any, exc: BaseException | None = None) -> None:
        """Hand an item (or _END and an exception) to the request; a loop that is gone cancels the job."""
        if self.done:
            return
        if item is _END:
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (item, exc))
        except RuntimeError:  # the request's event loop has closed
            self.cancelled = True

    async def items(self, wake: Callable[[], None]) -> AsyncIterator[Any]:
        try:
            while True:
                item, exc = await self.queue.get()
                if item is _END:
                    if exc is not None:
                        raise exc
                    return
                yield item
        finally:
            self.cancelled = True  # a reader that went away: the thread retires its rows before the next round
            wake()


@dataclass(eq=False)
class _Generation(_Job):
    """A generation request: `make_rows()` (run in the thread) gives its rows; `left` rows still decode."""

    make_rows: Callable[[], list[Row]] | None = None
    rows: list[Row] = field(default_factory=list)
    left: int = 0
    size: tuple[int, int] = (1, 0)  # (rows, tokens of its longest row: prompt + max_tokens), for admission
    submitted: float = field(default_factory=time.perf_counter)  # when it arrived: its time to first token
    last: float | None = None  # when its latest token was handed out (None: none yet)


@dataclass(eq=False)
class _Stream(_Job):
    """A generic stream: `make_iter()`'s items, one per turn of the thread."""

    make_iter: Callable[[], Iterable[Any]] | None = None
    iterator: Iterator[Any] | None = None


class ModelRunner:
    """Schedules every use of one model onto one thread. `await runner.call(fn, *args)`;
    `async for step in runner.generate(prompt, n, config=...)` (batched); `await runner.collect(steps,
    request.is_disconnected)`; `async for x in runner.stream(make)` (any iterator over the model).

    Counters (read by tests and benchmarks): `calls`, `rounds` (batched decode rounds), `tokens` (steps handed
    to requests), `retired` (rows retired because their request went away), `max_live` (the largest batch).
    """

    def __init__(self, model: Any, max_batch: int = MAX_BATCH, limits: Any = None,
                 prefix_cache_bytes: int | None = None) -> None:
        self.model = model
        self.limits = limits  # limits.ServeLimits or None (no KV bound, no queue bound)
        self.max_batch = max_batch if limits is None else limits.parallel
        self._cond = threading.Condition()
        self._calls: deque[tuple[concurrent.futures.Future, Callable[..., Any], tuple]] = deque()
        self._waiting: deque[_Generation] = deque()
        self._streams: list[_Stream] = []
        self._thread: threading.Thread | None = None
        self._live: list[_Generation] = []  # the generations with rows in the batch (the thread's own)
        self._round_s = 0.0  # how long the last decode round took
        self.calls = self.rounds = self.tokens = self.retired = self.max_live = 0
        self.prompt_tokens = self.finished = 0  # prompt tokens of the rows admitted; requests that finished
        self.metrics: Any = None  # `metrics.ServerMetrics` (the app's): told each token's latency
        self.failed: BaseException | None = None  # what ended the thread's loop, if a bug did (health: 503)
        self._batch: Batch | None = None  # the thread's batch (read by the metrics: its KV memory)
        # prompts' blocks of keys and values (stored as they are computed, and rows' blocks as they leave), reused
        # by every prompt that begins with them; kept across the thread's restarts, bounded apart from the live
        # rows' KV memory (prefix_cache_bytes: `--prefix-cache-memory`; default at most a quarter of it)
        if prefix_cache_bytes is None:
            prefix_cache_bytes = PREFIX_CACHE_BYTES if limits is None else min(PREFIX_CACHE_BYTES, limits.kv_bytes // 4)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._prefilled = 0  # prompt positions computed by the batches of the thread's earlier runs

    # --- the event loop's side -------------------------------------------------------------------------------

    def problem(self) -> str | None:
        """Why the runner cannot answer (health's 503), or None: its loop ended on an error, or its thread died."""
        if self.failed is not None:
            return f"the scheduler stopped on an error: {type(self.failed).__name__}: {self.failed}"
        thread = self._thread
        if thread is not None and not thread.is_alive() and self._thread is thread:
            return "the scheduler thread is not running"
        return None

    def load(self) -> tuple[int, int]:
        """(requests with rows in the batch, requests waiting for room)."""
        with self._cond:
            return len(self._live), sum(not job.cancelled for job in self._waiting)

    @property
    def prefilled(self) -> int:
        """Prompt positions computed so far (those the prefix cache gave are not)."""
        with self._cond:
            return self._prefilled + (self._batch.prefilled if self._batch is not None else 0)

    def kv_bytes(self) -> int:
        """Bytes of the batch's KV caches (`Batch.kv_bytes`): the live rows' and those of rows joining."""
        batch = self._batch
        return 0 if batch is None else batch.kv_bytes

    def _submit(self, add: Callable[[], None]) -> None:
        with self._cond:
            add()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lmhead-scheduler", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the model's thread, alone, between two decode rounds; returns its result or
        raises. A call whose request went away before it started is skipped."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(partial(self._calls.append, (future, fn, args)))
        return await asyncio.wrap_future(future)

    def generate(self, prompt_or_prompts: Any, max_new_tokens: int = 32, *, size: tuple[int, int] | None = None,
                 prepare_rows: Callable[..., list[Row]] = prepare, **kwargs: Any) -> AsyncIterator[Step]:
        """The Steps of `lmhead.generate.generate(model, prompt_or_prompts, max_new_tokens, **kwargs)` (config,
        stop, top_logprobs, exact_logprobs), decoded in the shared batch; `prepare_rows` makes the rows
        (`decode.rows.prepare`, or `decode.rows.prepare_ids` for token ids). size: (rows, tokens of the longest row)
        for admission (default: one row at the full `max_new_tokens` past an unknown prompt: admitted alone).
        The arguments are checked on the thread when the request is admitted: a ValueError/TypeError comes out
        of the first iteration. Past `limits.queue` waiting requests: QueueFull, at once."""
        if self.limits is not None:
            with self._cond:
                waiting = sum(not job.cancelled for job in self._waiting)
            if waiting >= self.limits.queue:
                raise QueueFull(f"{waiting} requests are waiting for room; the limit is {self.limits.queue}")
        job = _Generation(asyncio.get_running_loop(),
                          make_rows=partial(prepare_rows, self.model, prompt_or_prompts, max_new_tokens, **kwargs),
                          size=size or (1, 0))
        self._submit(partial(self._waiting.append, job))
        return job.items(self._wake)

    def stream(self, make_iter: Callable[[], Iterable[T]]) -> AsyncIterator[T]:
        """Iterate `make_iter()` on the model's thread, one item per turn (between decode rounds), yielding
        the items as they come; a reader that stops closes the iterator."""
        job = _Stream(asyncio.get_running_loop(), make_iter=make_iter)
        self._submit(partial(self._streams.append, job))
        return job.items(self._wake)

    async def collect(self, items: AsyncIterator[T],
                      is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> list[T]:
        """All of `items` (a non-streamed answer). With `is_disconnected` (Starlette's
        `request.is_disconnected`), polled every DISCONNECT_POLL_S: a client that hangs up stops the
        generation (its rows are retired) and what was generated so far is returned, to nobody."""
        got: list[T] = []

        async def drain() -> None:
            async for item in items:
                got.append(item)

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()  # raises the generation's error
                    return got
                if is_disconnected is not None and await is_disconnected():
                    return got
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await items.aclose()  # marks the job cancelled (if it is not over) and wakes the thread

    # --- the model's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        batch = Batch(self.model, draft="auto", prefix_cache=self.prefix_cache)
        self._live, self._batch = [], batch
        try:
            while self._turn(batch):
                pass
        except BaseException as exc:  # a bug in the loop itself: no request may wait forever
            self.failed = exc
            with self._cond:
                jobs = [*self._live, *self._waiting, *self._streams]
                calls = list(self._calls)
                self._waiting.clear()
                self._streams.clear()
                self._calls.clear()
                self._thread = None
            for job in jobs:
                job.put(_END, exc)
            for future, _, _ in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)
            raise

    def _turn(self, batch: Batch) -> bool:
        """One turn of the thread (see the module docstring); False when there is nothing left to do."""
        with self._cond:
            while not (self._calls or self._waiting or self._streams or self._live):
                if not self._cond.wait(timeout=1.0) and not (self._calls or self._waiting or self._streams):
                    self._prefilled += batch.prefilled
                    self._batch = None
                    self._thread = None  # idle: the next request starts a new thread
                    return False
            streams = list(self._streams)
            admit: list[_Generation] = []
            while self._waiting and batch.can_join:
                job = self._waiting[0]
                if job.cancelled:  # a request that went away while it waited takes no room
                    self._waiting.popleft()
                    continue
                if not self._fits(batch, admit, job):
                    break  # it waits its turn: no later request overtakes it
                admit.append(self._waiting.popleft())
        self._run_calls()
        for job in streams:
            self._advance(job)
        if batch.joining:
            self._continue_join(batch, self._live)
        live = self._retire(batch, self._admit(batch, self._live, admit))
        if batch.rows:
            t = time.perf_counter()
            live = self._round(batch, live)
            self._round_s = time.perf_counter() - t
        self._live = live
        return True

    def _fits(self, batch: Batch, admit: list[_Generation], job: _Generation) -> bool:
        """Whether `job` may join the live rows and those admitted this turn: rows ≤ max_batch and (with limits)
        their KV cache within limits.kv_bytes. A request joins an empty batch whatever its size (the routes
        refuse one that cannot fit alone)."""
        if not batch.rows and not admit:
            return True
        rows = len(batch.rows) + sum(j.size[0] for j in admit) + job.size[0]
        if rows > self.max_batch:
            return False
        if self.limits is None:
            return True
        longest = max([len(r.prompt_ids) + r.budget for r in batch.rows] + [j.size[1] for j in (*admit, job)])
        return self.limits.batch_kv_bytes(rows, longest) <= self.limits.kv_bytes

    def _run_calls(self) -> None:
        """Pending calls, in order, for about as long as the last decode round took (at least one; all of
        them when nothing decodes): explain calls and generations share the thread's time."""
        start = time.perf_counter()
        budget = self._round_s if self._live else float("inf")
        while True:
            with self._cond:
                if not self._calls:
                    return
                future, fn, args = self._calls.popleft()
            self._run_call(future, fn, args)
            if time.perf_counter() - start >= budget:
                return

    def _run_call(self, future: concurrent.futures.Future, fn: Callable[..., Any], args: tuple) -> None:
        if not future.set_running_or_notify_cancel():
            return
        self.calls += 1
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the request, which turns it into an error response
            future.set_exception(exc)

    def _advance(self, job: _Stream) -> None:
        """One item of a generic stream (its iterator is made on the first turn, closed on the last)."""
        try:
            if job.iterator is None:
                job.iterator = iter(job.make_iter())
            if not job.cancelled:
                job.put(next(job.iterator))
                return
        except StopIteration:
            job.put(_END)
        except Exception as exc:  # handed to the request, which turns it into an error response/event
            job.put(_END, exc)
        close = getattr(job.iterator, "close", None)
        if close is not None:
            close()
        job.done = True
        with self._cond:
            self._streams.remove(job)

    def _admit(self, batch: Batch, live: list[_Generation], admit: list[_Generation]) -> list[_Generation]:
        """Check and tokenise the admitted requests, then prefill their rows together into the batch."""
        ready, rows = [], []
        for job in admit:
            try:
                job.rows = job.make_rows()
            except Exception as exc:  # a bad argument: the request's 400
                job.put(_END, exc)
                continue
            for row in job.rows:
                row.owner = job
            job.left = len(job.rows)
            self.prompt_tokens += sum(len(row.prompt_ids) for row in job.rows)
            ready.append(job)
            rows.extend(job.rows)
        if not rows:
            return live
        try:
            batch.begin_join(rows)  # on an empty batch the whole prefill at once; else its first piece here
            batch.prefill()
        except Exception as exc:
            batch.drop_join()
            for job in ready:
                job.put(_END, exc)
            return live
        self.max_live = max(self.max_live, len(batch.rows))
        return [*live, *ready]

    def _continue_join(self, batch: Batch, live: list[_Generation]) -> None:
        """The next piece of the joining rows' prefill (between two decode rounds of the live ones)."""
        joining = {id(r) for r in batch.joining}
        try:
            batch.prefill()
        except Exception as exc:  # the joining requests get the error; the live rows go on
            batch.drop_join()
            for job in live:
                if any(id(r) in joining for r in job.rows):
                    job.put(_END, exc)
            return
        self.max_live = max(self.max_live, len(batch.rows))

    def _retire(self, batch: Batch, live: list[_Generation]) -> list[_Generation]:
        """Drop the rows of requests that went away."""
        joining = {id(r) for r in batch.joining}  # retired once they are live (after their prefill)
        gone = [job for job in live if job.cancelled and not any(id(r) in joining for r in job.rows)]
        if gone:
            rows = [row for job in gone for row in job.rows if row in batch.rows]
            self.retired += len(rows)
            batch.remove(rows)
        return [job for job in live if job not in gone and not job.done]

    def _round(self, batch: Batch, live: list[_Generation]) -> list[_Generation]:
        """One decode round for every live row; each request gets its rows' steps; finished requests end."""
        try:
            pairs = batch.step()
        except Exception as exc:  # the batch's state is lost: every live request gets the error
            for job in live:
                job.put(_END, exc)
            batch.remove(list(batch.rows))
            return []
        self.rounds += 1
        self._time_tokens(pairs)
        for row, step in pairs:
            job = row.owner
            job.put(step)
            self.tokens += 1
            if step.finish_reason is not None:
                job.left -= 1
                if job.left == 0:
                    job.put(_END)
                    self.finished += 1
        return [job for job in live if not job.done]

    def _time_tokens(self, pairs: list) -> None:
        """Tell the metrics each request's time to first token, and the time per output token of the others (a
        request given k tokens this round: k intervals of (now - its previous token) / k)."""
        now, given = time.perf_counter(), {}
        for row, _ in pairs:
            given[row.owner] = given.get(row.owner, 0) + 1
        for job, k in given.items():
            if self.metrics is not None:
                if job.last is None:
                    self.metrics.first_token(now - job.submitted)
                else:
                    self.metrics.output_tokens((now - job.last) / k, k)
            job.last = now

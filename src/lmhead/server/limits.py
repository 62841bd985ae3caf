"""What the server lets a request use, from the model: context, new tokens, live rows, KV memory, the queue.

    limits = serve_limits(model, ctx_size=None, max_tokens=None, parallel=None, kv_memory=None, queue=None)
    limits.context        prompt + max_tokens ≤ this (the model's context, or `lmhead serve --ctx-size`)
    limits.max_tokens     a request's max_tokens at most (default: the context; `--max-tokens`)
    limits.parallel       rows decoding at once (`--parallel`; later requests wait for a row)
    limits.kv_bytes       the KV memory every live row together may hold (`--kv-memory`, default half of the
                          memory available when the server starts)
    limits.queue          requests waiting at most; one more is a 503 with Retry-After (`--queue`)
    limits.prompt_chars   characters of one prompt at most, checked before tokenising (16 per token of context,
                          at least schemas.MAX_PROMPT_CHARS)

A request's KV memory is what its rows hold in the batch's cache (`row_kv_bytes`): every row of a batch holds as
many columns as the longest row needs (the cache is one rectangle), and a row that joins a running batch is merged
into a new cache while the old one still exists — so the scheduler admits a request only when the batch, with it,
fits twice in `kv_bytes` (`batch_kv_bytes`); until then it waits, and it is never cut short for memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from lmhead.server import schemas as S

CHARS_PER_TOKEN = 16  # the character bound per token of context (a token of text is rarely longer)
MAX_QUEUE = 256  # requests waiting for room, by default
RETRY_AFTER_S = 1  # what a 503's Retry-After says
_COLUMN_SLACK = 18  # columns a row's cache holds beyond its tokens: one full draft and two (decode.engine.Decoder)
_ROW_BOOKKEEPING = 17  # bytes per column beside keys and values: valid (1), positions (8), tokens (8)


@dataclass(frozen=True)
class ServeLimits:
    """The server's bounds (see the module docstring); `serve_limits` makes them from a model and checks them."""

    context: int
    max_tokens: int
    parallel: int
    kv_bytes: int
    queue: int
    column_bytes: int  # KV bytes of one column of one row

    @property
    def prompt_chars(self) -> int:
        return max(S.MAX_PROMPT_CHARS, CHARS_PER_TOKEN * self.context)

    @property
    def body_bytes(self) -> int:
        """The body bound that lets every valid request through: a prompt's characters as JSON escapes (6 bytes
        each at most) for a few prompts, at least guard.MAX_BODY_BYTES."""
        from lmhead.server.guard import MAX_BODY_BYTES

        return max(MAX_BODY_BYTES, 8 * self.prompt_chars)

    def row_kv_bytes(self, tokens: int) -> int:
        """KV bytes of one row that holds `tokens` tokens (prompt + new ones) in the batch's cache."""
        return (tokens + _COLUMN_SLACK) * self.column_bytes

    def batch_kv_bytes(self, rows: int, longest: int) -> int:
        """KV bytes of a batch of `rows` rows whose longest holds `longest` tokens, while a merge holds two."""
        return 2 * rows * self.row_kv_bytes(longest)

    def as_dict(self) -> dict[str, int]:
        return {"context": self.context, "max_tokens": self.max_tokens, "parallel": self.parallel,
                "kv_bytes": self.kv_bytes, "queue": self.queue, "prompt_chars": self.prompt_chars}


def column_bytes(model: Any) -> int:
    """KV bytes of one cache column of one row: keys and values of every layer (the lean body's cache, or the
    config's shapes in float32 for transformers' modules) and the row's bookkeeping."""
    lean = getattr(model, "lean", None)
    if lean is not None:
        per = len(lean.layers) * lean.kv_heads * lean.head_dim * torch.empty((), dtype=lean.dtype).element_size()
    else:
        from lmhead.models import parts

        cfg = parts.text_config(model.config)
        heads = getattr(cfg, "num_attention_heads", 1) or 1
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        per = cfg.num_hidden_layers * kv * head_dim * 4
    return 2 * per + _ROW_BOOKKEEPING


def available_memory() -> int | None:
    """Bytes of memory available now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages, size = (os.sysconf(n) if hasattr(os, "sysconf") else -1 for n in ("SC_AVPHYS_PAGES", "SC_PAGE_SIZE"))
    return pages * size if pages > 0 and size > 0 else None


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    return value


def serve_limits(model: Any, ctx_size: int | None = None, max_tokens: int | None = None,
                 parallel: int | None = None, kv_memory: int | None = None, queue: int | None = None,
                 ) -> ServeLimits:
    """The checked limits for serving `model`. ctx_size ≤ the model's context (default: it), max_tokens ≤
    ctx_size − 1 (default ctx_size − 1), parallel ≥ 1 (default runner.MAX_BATCH), kv_memory in bytes (default
    half the memory available now), queue ≥ 0. A setting out of range is a ValueError naming its `lmhead serve`
    option; so is a KV budget that cannot hold one row at the full context (lower --ctx-size or raise
    --kv-memory)."""
    from lmhead.server.runner import MAX_BATCH

    model_ctx = getattr(model, "context_length", None) or S.MAX_CONTEXT_TOKENS
    context = min(model_ctx, S.MAX_CONTEXT_TOKENS) if ctx_size is None else _positive("--ctx-size", ctx_size)
    if context > model_ctx:
        raise ValueError(f"--ctx-size must be at most the model's context of {model_ctx:,} tokens, got {context:,}")
    if context < 2:
        raise ValueError(f"--ctx-size must be at least 2 (a prompt token and a new one), got {context}")
    most = context - 1
    max_tokens = most if max_tokens is None else _positive("--max-tokens", max_tokens)
    if max_tokens > most:
        raise ValueError(f"--max-tokens must be at most {most:,} (the context of {context:,} tokens less one "
                         f"prompt token), got {max_tokens:,}")
    parallel = MAX_BATCH if parallel is None else _positive("--parallel", parallel)
    if queue is None:
        queue = MAX_QUEUE
    elif isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
        raise ValueError(f"--queue must be an integer ≥ 0, got {queue!r}")
    col = column_bytes(model)
    if kv_memory is None:
        free = available_memory()
        kv_memory = free // 2 if free else 4 << 30
    elif isinstance(kv_memory, bool) or not isinstance(kv_memory, int) or kv_memory < 1:
        raise ValueError(f"--kv-memory must be a positive number of bytes, got {kv_memory!r}")
    limits = ServeLimits(context, max_tokens, parallel, kv_memory, queue, col)
    need = limits.batch_kv_bytes(1, context)
    if need > kv_memory:
        raise ValueError(f"--ctx-size {context:,}: one request at the full context needs {need / 2**30:.2f} GiB of "
                         f"KV memory; --kv-memory allows {kv_memory / 2**30:.2f} GiB (lower --ctx-size or raise "
                         f"--kv-memory)")
    return limits

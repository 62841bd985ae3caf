"""The body alone: texts → the final hidden state (after the final norm) → one vector per text.

    texts ──tokenizer──▶ ids (each ≤ the context, or its last `truncate_prompt_tokens`) ──sorted by length,
        batches of ≤ BATCH_TOKENS padded tokens, left padding──▶ the body (one prefill per batch, in pieces of
        CHUNK columns through one KV cache) ──▶ hidden [B,T,D] ──pool (last | mean | cls | none)──▶ [B,D]
        ──normalize (L2)──▶ embeddings, in the order given

The hidden state is what transformers' `AutoModel` returns as `last_hidden_state` (the pooled numbers are
compared with it in tests/test_heads_embed.py). The pooling's default is the file's `{arch}.pooling_type`, as
llama.cpp's converter writes it (0 none, 1 mean, 2 cls, 3 last, 4 rank), else "last", the decoders' convention
(Qwen3-Embedding, e5-mistral: the last token sees the whole text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["BATCH_TOKENS", "CHUNK", "POOLINGS", "check_pooling", "default_pooling", "embed", "final_states",
           "pool", "pooled_states", "pooler", "token_ids"]

POOLINGS: tuple[str, ...] = ("last", "mean", "cls", "none")
# llama.cpp's enum llama_pooling_type, as its converter writes `{arch}.pooling_type` (4 = rank: a reranker)
GGUF_POOLING: dict[int, str] = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# padded tokens per prefill: a batch's attention scores stay a few MB and the products get many rows
BATCH_TOKENS = 8192
# columns per piece of one prefill (one cache for the batch), fewer where a piece's attention scores
# [B, heads, piece, T] would pass SCORES_BYTES: a long input's prefill stays bounded in memory
CHUNK = 512
SCORES_BYTES = 256 * 2**20


def check_pooling(pooling: Any, allowed: Sequence[str] = POOLINGS) -> str:
    """`pooling` if it is one of `allowed`, else ValueError naming them."""
    if pooling not in allowed:
        raise ValueError(f"pooling must be one of {', '.join(allowed)}; got {pooling!r}")
    return pooling


def default_pooling(model: Any) -> str:
    """The pooling the model's file asks for (`{arch}.pooling_type`), else "last"; cached on the model."""
    cached = getattr(model, "_pooling_type", None)
    if cached is not None:
        return cached
    found = "last"
    path = getattr(model, "gguf_path", None)
    if path is not None:
        from lmhead.models.gguf_meta import read_metadata

        meta, _ = read_metadata(path)
        value = meta.get(f"{meta['general.architecture']}.pooling_type")
        if value is not None:
            found = GGUF_POOLING.get(int(value), "last")
    model._pooling_type = found
    return found


def token_ids(model: Any, inputs: str | Sequence[str] | Sequence[Sequence[int]],
              truncate_prompt_tokens: int | None = None, name: str = "input", limit: int | None = None
              ) -> list[list[int]]:
    """Each input's token ids (a text encoded with the tokenizer's special tokens, or ids as given), checked:
    not empty, every id in the vocabulary, at most `limit` tokens (default: the model's context) — or its last
    `truncate_prompt_tokens` ids where that is given (vLLM's rule). Errors name `name` and the item's index."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or len(inputs) == 0:
        raise ValueError(f"{name} must be a non-empty list of texts or of token id lists")
    if truncate_prompt_tokens is not None and (isinstance(truncate_prompt_tokens, bool)
                                               or not isinstance(truncate_prompt_tokens, int)
                                               or truncate_prompt_tokens < 1):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1; got {truncate_prompt_tokens!r}")
    vocab, limit = model.vocab_size, model.context_length if limit is None else limit
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{name}[{i}] is an empty string")
            ids = list(model.tokenizer.encode(item))
        elif isinstance(item, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            ids = list(item)
            if not ids:
                raise ValueError(f"{name}[{i}] is an empty list of token ids")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}[{i}] holds token id {bad}, outside the vocabulary [0, {vocab})")
        else:
            raise TypeError(f"{name}[{i}] must be a string or a list of token ids; got {type(item).__name__}")
        if truncate_prompt_tokens is not None:
            ids = ids[-truncate_prompt_tokens:]
        if len(ids) > limit:
            raise ValueError(f"{name}[{i}] has {len(ids)} tokens, more than the model's context of {limit} "
                             f"(truncate_prompt_tokens keeps the last n)")
        out.append(ids)
    return out


@torch.no_grad()
def final_states(model: Any, ids: list[list[int]], keep: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> list[torch.Tensor]:
    """The final hidden state [T_i, D] (after the final norm) of each id list — or `keep(state)` of it, so that
    a pooled batch holds one vector a text, not its every position — in the order given: rows sorted by length
    into left-padded batches of at most BATCH_TOKENS padded tokens, each batch one prefill (the lean body in
    pieces of at most CHUNK columns through one KV cache; else transformers' body)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[torch.Tensor | None] = [None] * len(ids)
    start = 0
    while start < len(order):
        stop = start + 1
        # sorted ascending: the batch's width is its last row's length
        while stop < len(order) and (stop + 1 - start) * len(ids[order[stop]]) <= BATCH_TOKENS:
            stop += 1
        rows = [ids[i] for i in order[start:stop]]
        hidden = _batch_states(model, rows)
        for j, i in enumerate(order[start:stop]):
            state = hidden[j, hidden.shape[1] - len(rows[j]):]
            out[i] = state.clone() if keep is None else keep(state).clone()
        start = stop
    return out  # type: ignore[return-value]


def _batch_states(model: Any, rows: list[list[int]]) -> torch.Tensor:
    """hidden [B,T,D] for left-padded `rows` (T = the longest)."""
    b, t = len(rows), max(len(r) for r in rows)
    pad = getattr(model.tokenizer, "pad_token_id", None) or 0
    ids = torch.full((b, t), pad, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    for j, r in enumerate(rows):
        ids[j, t - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[j, t - len(r):] = True
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # rope positions count each row's real tokens
    lean = getattr(model, "lean", None)
    if lean is None:
        return model.hidden_states(ids, attention_mask=mask.long(), position_ids=positions)
    cache = lean.new_cache(b, t)
    piece = max(1, min(CHUNK, SCORES_BYTES // (4 * b * lean.heads * t)))
    pieces = [lean(ids[:, s:s + piece], positions[:, s:s + piece], cache, mask[:, s:s + piece].contiguous())
              for s in range(0, t, piece)]
    return torch.cat(pieces, dim=1)


def pooler(pooling: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """One text's states [T, D] → [D] for `pooling`: "last" the last token's, "mean" the mean over the text's
    tokens, "cls" the first token's; None for "none" (every position kept)."""
    check_pooling(pooling)
    return {"last": lambda s: s[-1], "cls": lambda s: s[0], "mean": lambda s: s.mean(dim=0), "none": None}[pooling]


def pool(states: list[torch.Tensor], pooling: str) -> torch.Tensor | list[torch.Tensor]:
    """Each text's states [T_i, D] → [B,D] by `pooler(pooling)`; "none" returns the list unchanged."""
    one = pooler(pooling)
    return states if one is None else torch.stack([one(s) for s in states])


def pooled_states(model: Any, ids: list[list[int]], pooling: str) -> torch.Tensor | list[torch.Tensor]:
    """`final_states` pooled by `pooling` as each batch comes out: [B,D] (a list of [T_i, D] for "none")."""
    one = pooler(pooling)
    states = final_states(model, ids, keep=one)
    return states if one is None else torch.stack(states)


def normalized(x: torch.Tensor) -> torch.Tensor:
    """Rows of `x` [..., D] scaled to unit L2 length (a zero row stays zero)."""
    return torch.nn.functional.normalize(x, p=2.0, dim=-1)


def embed(model: Any, inputs: str | Sequence[str] | Sequence[Sequence[int]], pooling: str | None = None,
          normalize: bool = True, truncate_prompt_tokens: int | None = None) -> torch.Tensor | list[torch.Tensor]:
    """Embeddings of `inputs` (texts, or token id lists): [B,D] float32 pooled by `pooling` (None: the file's
    `pooling_type`, else "last"; see `pool`) and L2-normalised when `normalize`; with pooling="none" a list of
    [T_i, D] tensors (normalised per token when `normalize`)."""
    if pooling is None:
        pooling = default_pooling(model)
        if pooling == "rank":  # a reranker's file: its classification head reads the last token
            pooling = "last"
    check_pooling(pooling)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool; got {type(normalize).__name__}")
    pooled = pooled_states(model, token_ids(model, inputs, truncate_prompt_tokens), pooling)
    if not normalize:
        return pooled
    return [normalized(s) for s in pooled] if isinstance(pooled, list) else normalized(pooled)

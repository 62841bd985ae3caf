"""Fields given as text by other servers' clients, turned into the token ids the declared steps take.

    {"bad_words": ["the", [1, 2]]}  →  bad_words ((id of "the"), (id of " the"), (1, 2))        (vLLM)
    {"dry_sequence_breakers": ["\n", ":"]}  →  every token whose text holds "\n" or ":"         (llama.cpp)

A word is tokenised as vLLM tokenises it (`SamplingParams.update_from_tokenizer`): its text without leading
spaces, and again after one space — kept where that gives as many tokens with another first one (the word in the
middle of a text) — without special tokens. A word that tokenises to nothing is a 400 naming it.

A DRY sequence breaker string is, as the step declares it, the tokens that hold it: every token of the vocabulary
whose text contains it (llama.cpp's breakers that lie within one token; one that no token holds, which llama.cpp
matches across tokens, is a 400 naming it). Token ids are taken as they are.
"""

from __future__ import annotations

from typing import Any

from lmhead.server.errors import APIError

__all__ = ["breaker_ids", "with_word_ids", "word_sequences"]

_TEXTS: dict[int, tuple[Any, list[str]]] = {}  # id(tokenizer) → (tokenizer, each token's text): decoded once


def word_sequences(tokenizer: Any, words: list[str | list[int]]) -> list[list[int]]:
    """`words` (strings or token-id sequences) → token-id sequences, strings tokenised as vLLM does; APIError 400
    naming a word that tokenises to nothing."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        if not isinstance(word, str):
            out.append(list(word))
            continue
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise APIError(400, f"bad_words[{i}]: {word!r} tokenises to no tokens", "bad_words")
        out.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(list(spaced))
    return out


def breaker_ids(tokenizer: Any, breakers: list[str | int]) -> list[int]:
    """DRY sequence breakers (strings or token ids) → token ids: a string's are every token whose text holds it;
    APIError 400 naming an empty string or one that no token holds."""
    held = _TEXTS.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = _TEXTS[id(tokenizer)] = (tokenizer, tokenizer.batch_decode([[i] for i in range(len(tokenizer))]))
    texts = held[1]
    out: list[int] = []
    for i, b in enumerate(breakers):
        if not isinstance(b, str):
            out.append(b)
            continue
        ids = [t for t, text in enumerate(texts) if b in text] if b else []
        if not ids:
            raise APIError(400, f"dry_sequence_breakers[{i}]: {b!r} is held by no token of the vocabulary; give "
                                "a part of it or token ids", "dry_sequence_breakers")
        out.extend(ids)
    return sorted(set(out))


def _as_ids(tokenizer: Any, words: list | None, breakers: list | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if words is not None:
        out["bad_words"] = word_sequences(tokenizer, words)
    if breakers is not None:
        out["dry_sequence_breakers"] = breaker_ids(tokenizer, breakers)
    return out


async def with_word_ids(served: Any, req: Any) -> Any:
    """`req` with its `bad_words` and `dry_sequence_breakers` strings turned into token ids (on the model's
    thread, where its tokenizer is used), or `req` itself where it has none."""
    words, breakers = getattr(req, "bad_words", None), getattr(req, "dry_sequence_breakers", None)
    words = list(words) if words and any(isinstance(w, str) for w in words) else None
    breakers = list(breakers) if breakers and any(isinstance(b, str) for b in breakers) else None
    if words is None and breakers is None:
        return req
    return req.model_copy(update=await served.call(_as_ids, served.model.tokenizer, words, breakers))

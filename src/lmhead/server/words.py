"""vLLM's `bad_words` as its clients send them: words (strings), beside token-id sequences.

    {"bad_words": ["the", [1, 2]]}  →  bad_words ((id of "the"), (id of " the"), (1, 2))

A word is tokenised as vLLM tokenises it (`SamplingParams.update_from_tokenizer`): its text without leading
spaces, and again after one space — kept where that gives as many tokens with another first one (the word in the
middle of a text) — without special tokens. A word that tokenises to nothing is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from lmhead.server.errors import APIError

__all__ = ["word_sequences", "with_word_ids"]


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


async def with_word_ids(served: Any, req: Any) -> Any:
    """`req` with its `bad_words` strings tokenised (on the model's thread, where its tokenizer is used), or `req`
    itself where it has none."""
    words = getattr(req, "bad_words", None)
    if not words or not any(isinstance(w, str) for w in words):
        return req
    ids = await served.call(word_sequences, served.model.tokenizer, list(words))
    return req.model_copy(update={"bad_words": ids})

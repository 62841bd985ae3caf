"""A multi-turn chat with one model: the history as messages, each turn's prompt from the model's chat template.

    chat = Conversation(model, system="Be brief.", config=SamplingConfig(temperature=0.7), max_new_tokens=512)
    for step in chat.reply("Hi!"):        # the answer's Steps, streamed; the history keeps the answer
        print(step.text, end="")
    chat.reset()                          # a new conversation (the system message stays)

`lmhead chat` runs one. A base model (no chat template) is a ValueError when the chat is made. Each turn's
prompt is the whole history through the template, decoded by `generate.Batch` with the chat's prefix cache
(`prefix_cache.PrefixCache`): the columns of the previous turn's prompt and answer are reused, so a turn prefills
its new tokens, not the history. A history that leaves no room for an answer in the context is a ValueError
naming both numbers (the history is kept: /reset starts again).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lmhead.decode.rows import prepare
from lmhead.generate import Batch
from lmhead.models.chat import chat_prompt
from lmhead.prefix_cache import PrefixCache


class Conversation:
    """The conversation so far (`messages`: [{"role", "content"}], the system message first when given)."""

    def __init__(self, model: Any, system: str | None = None, config: Any = None, max_new_tokens: int = 512,
                 draft: str = "auto") -> None:
        if system is not None and (not isinstance(system, str) or not system):
            raise ValueError("system: must be a non-empty string")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be an integer ≥ 1, got {max_new_tokens!r}")
        self.model, self.system, self.config = model, system, config
        self.max_new_tokens, self.draft = max_new_tokens, draft
        self.prefix_cache = PrefixCache()
        self.messages: list[dict[str, str]] = []
        self.reset()
        chat_prompt(model, [*self.messages, {"role": "user", "content": "x"}], require_template=True)

    def reset(self) -> None:
        """Forget every turn but the system message."""
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def reply(self, text: str) -> Iterator[Any]:
        """The model's answer to the user's `text` after the history, as `Step`s (`Model.generate`). The turn and
        the answer join the history when the answer ends — also when the caller stops early (closes the
        iterator, or Ctrl-C raises inside it): what was produced is the answer then."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("the message is empty")
        turns = [*self.messages, {"role": "user", "content": text}]
        prompt = chat_prompt(self.model, turns, require_template=True)
        ids = self.model.encode(prompt)
        context = self.model.context_length
        if context is not None and len(ids) >= context:
            raise ValueError(f"the conversation is {len(ids):,} tokens; the model's context holds {context:,} "
                             f"(/reset starts a new one)")
        budget = self.max_new_tokens if context is None else min(self.max_new_tokens, context - len(ids))
        return self._answer(turns, self._steps(prompt, budget))

    def _steps(self, prompt: str, budget: int) -> Iterator[Any]:
        """The answer's Steps (no logprobs computed), the prompt's known prefix taken from the prefix cache."""
        batch = Batch(self.model, draft=self.draft, prefix_cache=self.prefix_cache)
        batch.add(prepare(self.model, prompt, budget, self.config, scores=False))
        while batch.rows:
            for _, step in batch.step():
                yield step

    def _answer(self, turns: list[dict[str, str]], steps: Iterator[Any]) -> Iterator[Any]:
        parts: list[str] = []
        try:
            for step in steps:
                parts.append(step.text)
                yield step
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
            self.messages = [*turns, {"role": "assistant", "content": "".join(parts)}]

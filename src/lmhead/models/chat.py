"""A chat as a prompt: the tokenizer's chat template, or a plain transcript for a model without one.

    prompt = chat_prompt(model, [{"role": "user", "content": "Hi"}])   # then model.generate(prompt, ...)

The server's /v1/chat/completions calls this; the prompt it returns goes through the same `generate` as any
other prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant")


def chat_prompt(model: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """The prompt text for a chat, ending where the assistant's next turn begins.

    model: an `lmhead.Model` (its `tokenizer` is used). messages: [{"role", "content"}] with a role in `ROLES`
    ("developer" is OpenAI's newer name for "system" and is passed to the template as "system") and the
    content as one string. With a chat template: `tokenizer.apply_chat_template(..., add_generation_prompt=True)`;
    without one (a base model): "role: content" lines, then "assistant:" for the model to continue.
    """
    turns = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
             for m in messages]
    tok = model.tokenizer
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"

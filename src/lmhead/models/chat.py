"""A chat as a prompt: the tokenizer's chat template, or a plain transcript for a model without one.

    prompt = chat_prompt(model, [{"role": "user", "content": "Hi"}])   # then model.generate(prompt, ...)
    prompt = chat_prompt(model, chat_messages("Hi", system="Be brief."), require_template=True)   # the CLI

The server's /v1/chat/completions and the CLI's `--chat` call this; the prompt it returns goes through the
same `generate` / `predict` as any other prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant")


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """One user turn `prompt`, after a system turn `system` when given: [{"role", "content"}]."""
    for what, text in (("prompt", prompt), ("system", system)):
        if text is None and what == "system":
            continue
        if not isinstance(text, str):
            raise TypeError(f"{what}: expected a string, got {type(text).__name__}")
        if not text:
            raise ValueError(f"{what}: must be a non-empty string")
    turns = [{"role": "system", "content": system}] if system is not None else []
    return [*turns, {"role": "user", "content": prompt}]


def has_chat_template(model: Any) -> bool:
    """Whether the model's tokenizer carries a chat template (instruction-tuned models do, base models not)."""
    return bool(getattr(model.tokenizer, "chat_template", None))


def chat_prompt(model: Any, messages: Sequence[Mapping[str, str]], *, require_template: bool = False) -> str:
    """The prompt text for a chat, ending where the assistant's next turn begins.

    model: an `lmhead.Model` (its `tokenizer` is used). messages: [{"role", "content"}] with a role in `ROLES`
    ("developer" is OpenAI's newer name for "system" and is passed to the template as "system") and the
    content as one string. With a chat template: `tokenizer.apply_chat_template(..., add_generation_prompt=True)`;
    without one (a base model): "role: content" lines, then "assistant:" for the model to continue — or, with
    `require_template`, a ValueError saying the model is a base model and which models have a template.
    """
    turns = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
             for m in messages]
    tok = model.tokenizer
    if has_chat_template(model):
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if require_template:
        from lmhead.models.registry import MODELS

        instruct = ", ".join(name for name, spec in MODELS.items() if spec.instruct)
        raise ValueError(f"model {getattr(model, 'name', '?')!r} has no chat template: it is a base model, which "
                         f"continues text rather than answering a chat; give it text to continue (no chat mode), "
                         f"or use an instruction-tuned model ({instruct})")
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"

"""Structured output on /v1: the request's fields in any of three dialects → one lmhead constraint, and tool calls.

    response_format  {"type": "json_object"} | {"type": "json_schema", "json_schema": {name, schema, strict}}  OpenAI
    structured_outputs {json | regex | choice | grammar | json_object}                                       vLLM
    json_schema, grammar (GBNF, or Lark)                                                                      llama.cpp
    tools + tool_choice ("none", "auto", "required", {"type": "function", "function": {"name"}})  chat, OpenAI

At most one of them per request (two would ask for two shapes of one answer: a 400 naming both). Tools: the
answer is constrained to a call `{"name": ..., "arguments": {...}}` with the arguments matching the function's
`parameters` ("required", or the named function), or — "auto" — either such a call or text that does not begin
with "{"; `ToolCalls.read` turns the generated text back into OpenAI's `tool_calls`. The tools reach the model
through its chat template where the template renders them, else as a system turn that lists them.

A constraint that does not compile is the library's `ConstraintError` (a ValueError: the route's 400), raised by
`compile_for` before any token is generated, so a stream never opens on a request that cannot be served.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lmhead.constrain import Choice, Constraint, Grammar, JSONObject, JSONSchema, Regex, compile_constraint
from lmhead.server import schemas as S
from lmhead.server.errors import APIError

__all__ = ["ToolCalls", "chat_turns", "compile_for", "constraint_for", "page_constraint", "tool_prompt"]

# the keys OpenAI's tool-call object uses; the model writes {"name": ..., "arguments": {...}}
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _grammar(text: str) -> Grammar:
    """llama.cpp's and vLLM's `grammar`: GBNF where its rules use `::=`, else Lark (`Grammar.from_text`)."""
    return Grammar.from_text(text)


def _from_response_format(fmt: S.ResponseFormat) -> Constraint | None:
    if fmt.type == "text":
        if fmt.json_schema is not None:
            raise APIError(400, "response_format.json_schema is only read with type 'json_schema'",
                           "response_format.json_schema")
        return None
    if fmt.type == "json_object":
        return JSONObject()
    if fmt.json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs a json_schema object "
                            "({name, schema, strict})", "response_format.json_schema")
    schema = fmt.json_schema.schema_
    return JSONSchema(schema) if schema is not None else JSONObject()


def _from_structured_outputs(so: S.StructuredOutputs) -> Constraint:
    given = [k for k in ("json_", "regex", "choice", "grammar", "json_object")
             if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        names = ", ".join(k.rstrip("_") for k in given) or "none"
        raise APIError(400, f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                            f"got {names}", "structured_outputs")
    if so.json_ is not None:
        return JSONSchema(so.json_)
    if so.regex is not None:
        return Regex(so.regex)
    if so.choice is not None:
        return Choice(so.choice)
    if so.grammar is not None:
        return _grammar(so.grammar)
    return JSONObject()


def _call_schema(tool: S.Tool) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None:  # a function without parameters takes an empty object
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tool_choice(req: S.ChatRequest) -> tuple[str, list[S.Tool]]:
    """("none" | "auto" | "required", the tools the answer may call)."""
    tools = list(req.tools or [])
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, S.NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                                f"tools", "tool_choice")
        return "required", named
    if choice != "none" and not tools:
        raise APIError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
    return choice, tools


def _tools_constraint(mode: str, tools: list[S.Tool]) -> Constraint:
    calls = [_call_schema(t) for t in tools]
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if mode == "required":
        return JSONSchema(schema)
    # auto: a call, or text that does not open with "{" (then it is an answer in words)
    embedded = json.dumps({**schema, "x-guidance": _COMPACT})
    return Grammar(f"start: call | text\ncall: %json {embedded}\ntext: /[^{{](.|\\n)*/\n")


@dataclass(frozen=True)
class ToolCalls:
    """How a chat answer with tools is read back: `read(text)` → OpenAI's `tool_calls` list, or None where the
    text is an answer in words ("auto")."""

    names: tuple[str, ...]

    def read(self, text: str) -> list[dict[str, Any]] | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names or "arguments" not in value:
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}}]


def constraint_for(req: Any) -> tuple[Constraint | None, ToolCalls | None]:
    """The one constraint a request asks for (None: a free answer) and, for a chat with tools, how to read its
    tool calls. 400 (naming both) where a request asks for two."""
    asked: list[tuple[str, Constraint | None]] = []
    if req.response_format is not None:
        asked.append(("response_format", _from_response_format(req.response_format)))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    if req.json_schema is not None:
        asked.append(("json_schema", JSONSchema(req.json_schema)))
    if req.grammar is not None:
        asked.append(("grammar", _grammar(req.grammar)))
    tools = None
    if isinstance(req, S.ChatRequest):
        mode, chosen = _tool_choice(req)
        if mode != "none":
            asked.append(("tools", _tools_constraint(mode, chosen)))
            tools = ToolCalls(tuple(t.function.name for t in chosen))
    asked = [(name, c) for name, c in asked if c is not None]  # response_format "text": a free answer
    if len(asked) > 1:
        raise APIError(400, "a request takes one structured-output option; got " + " and ".join(n for n, _ in asked),
                       asked[1][0])
    return (asked[0][1] if asked else None), tools


def page_constraint(box: S.PageConstraint | None) -> Constraint | None:
    """The explainer page's constraint box as a constraint (a choice's options comma-separated)."""
    if box is None:
        return None
    if box.kind == "json_schema":
        return JSONSchema(box.text)
    if box.kind == "regex":
        return Regex(box.text)
    return Choice([c.strip() for c in box.text.split(",") if c.strip()])


def chat_turns(messages: list[S.ChatMessage]) -> list[dict[str, str]]:
    """A chat's turns as {"role", "content"} for any chat template: an assistant turn that called a tool becomes
    the call as the model writes one (`{"name": ..., "arguments": {...}}`), a tool's result a user turn that names
    the function it answers."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or []}
    turns = []
    for m in messages:
        if m.role == "tool":
            which = names.get(m.tool_call_id or "", m.name or "the function")
            turns.append({"role": "user", "content": f"Result of {which}: {m.text()}"})
        elif m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise APIError(400, f"tool_calls[{c.id}].function.arguments is not JSON", "messages") from None
                calls.append(json.dumps({"name": c.function.name, "arguments": args}, ensure_ascii=False))
            turns.append({"role": "assistant", "content": (m.text() + "\n" if m.text() else "") + "\n".join(calls)})
        else:
            turns.append({"role": m.role, "content": m.text()})
    return turns


def compile_for(model: Any, constraint: Constraint | None) -> None:
    """Compile `constraint` for the model's tokenizer now (cached: the rows' compile then costs nothing), so that
    one that cannot be compiled is a 400 before any token. Runs off the event loop (`asyncio.to_thread`)."""
    if constraint is not None:
        compile_constraint(constraint, model.tokenizer, int(model.exact_head.weight.shape[0]),
                           tuple(model.eos_token_ids))


def tool_prompt(model: Any, messages: list[dict[str, str]], tools: list[S.Tool]) -> tuple[str, list[int]]:
    """The prompt of a chat with `tools` and its ids (`served.encode_checked`, naming "messages"): the template's
    own rendering of the tools where it has one (its `tools` argument changes the text), else the chat with a
    system turn that lists them and says how to call one. Runs on the model's thread, like `served.chat_ids`."""
    from lmhead.models.chat import chat_prompt
    from lmhead.server.served import encode_checked

    specs = [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]
    tok = model.tokenizer
    turns = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages]
    if getattr(tok, "chat_template", None):
        try:
            with_tools = tok.apply_chat_template(turns, tools=specs, tokenize=False, add_generation_prompt=True)
            without = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that fails on tools: they go in a system turn instead
            with_tools = without = ""
        if with_tools != without:
            return with_tools, encode_checked(model, with_tools, "messages")
    lines = "\n".join(json.dumps(s["function"], ensure_ascii=False, separators=(",", ":")) for s in specs)
    note = f'Functions:\n{lines}\nTo call one, answer {{"name": ..., "arguments": {{...}}}} only.'
    if turns and turns[0]["role"] == "system":
        turns = [{"role": "system", "content": turns[0]["content"] + "\n\n" + note}, *turns[1:]]
    else:
        turns = [{"role": "system", "content": note}, *turns]
    prompt = chat_prompt(model, turns)
    return prompt, encode_checked(model, prompt, "messages")

"""What a caller asks the output to be: the constraint objects (immutable, hashable, checked when made).

    JSONSchema(schema)        a JSON value matching a JSON schema (a dict, or its JSON text)
    JSONObject()              any JSON object (OpenAI's and vLLM's `json_object`)
    Regex(pattern)            text the whole of which matches a regular expression (Rust `regex` syntax)
    Choice(["a", "b"])        exactly one of the strings
    Grammar(text, "lark")     a context-free grammar: Lark as llguidance reads it, or llama.cpp's GBNF

Each one becomes an llguidance grammar (`grammar()`, a str); `lmhead.constrain.compiled.compile_constraint`
compiles it for a tokenizer once. A constraint holds text only (a schema is kept as compact JSON text, its keys in
the order given: the order the answer writes properties in), so equal constraints share one compiled form.

JSON whitespace: "compact" (the default) writes JSON as `json.dumps` does — ", " between items, ": " after keys,
no other whitespace — which keeps a small model from spending its tokens on blank lines; "flexible" allows any
JSON whitespace between tokens (llguidance's own default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Choice", "Constraint", "ConstraintError", "Grammar", "JSONObject", "JSONSchema", "Regex",
           "MAX_CONSTRAINT_CHARS", "WHITESPACE_MODES", "GRAMMAR_SYNTAXES"]

MAX_CONSTRAINT_CHARS = 1 << 20  # a schema or grammar longer than this is refused before any compile
WHITESPACE_MODES = ("compact", "flexible")
GRAMMAR_SYNTAXES = ("lark", "gbnf")


class ConstraintError(ValueError):
    """A constraint that cannot be used: malformed, too large, or asking for a feature llguidance does not
    support (the message names it). The server answers 400, the CLI exits with status 2."""


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if not value:
        raise ConstraintError(f"{name}: must not be empty")
    if len(value) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"{name}: {len(value):,} characters is more than the {MAX_CONSTRAINT_CHARS:,} allowed")
    return value


def _json_options(whitespace: str) -> dict[str, Any]:
    if whitespace not in WHITESPACE_MODES:
        raise ValueError(f"whitespace: must be one of {', '.join(WHITESPACE_MODES)}; got {whitespace!r}")
    if whitespace == "flexible":
        return {"whitespace_flexible": True}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Constraint:
    """The base of the constraint objects: `grammar()` is the llguidance grammar it stands for; `kind` names
    it in messages ("json_schema", "json_object", "regex", "choice", "grammar")."""

    kind: str = ""

    def grammar(self) -> str:
        raise NotImplementedError

    def describe(self) -> str:
        """A short human-readable form (the explainer and error messages)."""
        raise NotImplementedError


@dataclass(frozen=True)
class JSONSchema(Constraint):
    """A JSON value that matches `schema` (a dict or its JSON text; kept as compact JSON text, keys in order).
    whitespace: "compact" or "flexible" (module docstring)."""

    schema: str
    whitespace: str = "compact"
    kind = "json_schema"

    def __init__(self, schema: dict[str, Any] | str | bool, whitespace: str = "compact") -> None:
        if isinstance(schema, str):
            try:
                value = json.loads(_text("schema", schema))
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"schema: not valid JSON ({exc.msg} at line {exc.lineno} column "
                                      f"{exc.colno})") from None
        else:
            value = schema
        if isinstance(value, bool):  # true: any value; false: nothing (refused, it could never finish)
            if not value:
                raise ConstraintError("schema: `false` admits no value")
            value = {}
        if not isinstance(value, dict):
            raise ConstraintError(f"schema: a JSON schema is an object (or true), got {type(value).__name__}")
        try:
            # key order kept: a schema's properties come out in the order it lists them
            text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"schema: cannot be written as JSON ({exc})") from None
        _text("schema", text)
        _json_options(whitespace)
        object.__setattr__(self, "schema", text)
        object.__setattr__(self, "whitespace", whitespace)

    @property
    def value(self) -> dict[str, Any]:
        """The schema as a dict (a new one each time: the constraint itself stays immutable)."""
        return json.loads(self.schema)

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_json_schema(self.schema, overrides=_json_options(self.whitespace))

    def describe(self) -> str:
        return f"JSON schema {self.schema[:80]}{'…' if len(self.schema) > 80 else ''}"


class JSONObject(JSONSchema):
    """Any JSON object (`{"type": "object"}`): OpenAI's `response_format: {"type": "json_object"}`."""

    kind = "json_object"

    def __init__(self, whitespace: str = "compact") -> None:
        super().__init__({"type": "object"}, whitespace)

    def __repr__(self) -> str:
        return f"JSONObject(whitespace={self.whitespace!r})"

    def describe(self) -> str:
        return "any JSON object"


@dataclass(frozen=True)
class Regex(Constraint):
    """Text that matches `pattern` as a whole (Rust `regex` syntax: no look-around, no back-references)."""

    pattern: str
    kind = "regex"

    def __post_init__(self) -> None:
        _text("pattern", self.pattern)

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_regex(self.pattern)

    def describe(self) -> str:
        return f"regex /{self.pattern}/"


@dataclass(frozen=True)
class Choice(Constraint):
    """Exactly one of `options` (non-empty strings; given as any sequence, kept as a tuple)."""

    options: tuple[str, ...]
    kind = "choice"

    def __init__(self, options) -> None:
        if isinstance(options, str) or not hasattr(options, "__iter__"):
            raise TypeError(f"options: expected a list of str, got {type(options).__name__}")
        items = tuple(options)
        if not items:
            raise ConstraintError("options: the list of choices is empty")
        for i, s in enumerate(items):
            _text(f"options[{i}]", s)
        object.__setattr__(self, "options", items)

    def grammar(self) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in self.options))

    def describe(self) -> str:
        return "one of " + ", ".join(repr(s) for s in self.options)


@dataclass(frozen=True)
class Grammar(Constraint):
    """A context-free grammar: `syntax` "lark" (llguidance's Lark dialect; `start` is the start rule) or "gbnf"
    (llama.cpp's; `root` is the start rule), converted by llguidance."""

    text: str
    syntax: str = "lark"
    kind = "grammar"

    def __post_init__(self) -> None:
        _text("grammar", self.text)
        if self.syntax not in GRAMMAR_SYNTAXES:
            raise ValueError(f"syntax: must be one of {', '.join(GRAMMAR_SYNTAXES)}; got {self.syntax!r}")

    @classmethod
    def from_text(cls, text: str) -> Grammar:
        """A grammar in either syntax: GBNF where its rules are written `name ::= ...` (llama.cpp's), else Lark."""
        return cls(text, syntax="gbnf" if isinstance(text, str) and "::=" in text else "lark")

    def grammar(self) -> str:
        from llguidance import LLMatcher

        if self.syntax == "lark":
            return LLMatcher.grammar_from_lark(self.text)
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(self.text)
        except Exception as exc:  # the converter raises plain exceptions with its reason
            raise ConstraintError(f"grammar: this GBNF grammar does not convert: {exc}") from None
        return LLMatcher.grammar_from_lark(lark)

    def describe(self) -> str:
        return f"{self.syntax} grammar ({len(self.text)} characters)"

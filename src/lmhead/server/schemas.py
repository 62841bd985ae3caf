"""Request and response bodies of the server's JSON API (pydantic).

Every request model forbids unknown fields (`extra="forbid"`): a misspelt option is a 422, never silently
ignored. Bounds that do not depend on the model (top_logprobs ≤ 20, sampling ranges, a stop string, a name,
ceilings on every text and list) are checked here, before anything is tokenised; bounds that follow the served
model (server/limits.py: a prompt's characters, prompt + max_tokens ≤ the context, n × prompts ≤ --parallel,
token ids in the vocabulary) are checked by served.py. The body as a whole is bounded before it is parsed
(guard.py: 413). Booleans are strict (`"stream": "yes"` is a 422, as OpenAI's schema says boolean).

Two families:
* `/api/*` — the explainer page's own API (predict, step, generate, layers, score, model, params).
* `/v1/*`  — OpenAI-compatible completions and chat completions, with `top_k`, `min_p` and
  `repetition_penalty` as extensions (as vLLM and llama.cpp's server accept them), and structured output in
  the three dialects clients send (server/structured.py turns them into one constraint): OpenAI's
  `response_format` (and `tools` / `tool_choice` on chat), vLLM's `structured_outputs`, llama.cpp's
  `json_schema` and `grammar`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model, field_validator

from lmhead.sampling.steps import ENTRY_FIELDS, PARAMS

# Bounds (also reported by GET /api/model so the page and clients can see them).
MAX_PROMPT_CHARS = 20_000  # checked before tokenizing, so a huge body costs nothing
MAX_PROMPT_TOKENS = 1024
MAX_NEW_TOKENS = 256
MAX_CANDIDATES = 1000  # the page asks for the top 200 by default
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
MAX_STOP_CHARS = 1000  # each stop string
MAX_MESSAGES = MAX_PROMPT_TOKENS  # every chat message costs at least one token of the template
MAX_LOGIT_BIAS = 1024  # entries
MAX_NAME_CHARS = 256  # `user`, a message's `name`, `model`
MAX_GRAMMAR_CHARS = 100_000  # a regex, a grammar (a schema is bounded by the body's size: guard.py)
MAX_CHOICES = 256  # structured_outputs.choice
MAX_TOOLS = 128
# /v1's ceilings, whatever the model: the served bounds (limits.py) lie below them
MAX_CONTEXT_TOKENS = 131_072  # token ids of one prompt, max_tokens
MAX_TEXT_CHARS = 16 * MAX_CONTEXT_TOKENS  # one prompt's characters (limits.ServeLimits.prompt_chars: 16 a token)
MAX_PROMPTS = 64  # prompts of one completions request
MAX_N = 16  # choices per prompt


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _declared(param: Any, **override: Any) -> tuple[Any, Any]:
    """A declared step parameter (lmhead.sampling.steps.Param) as a pydantic field: its type, default and range
    as declared (a range with single values beside it, such as top_n_sigma's -1, is left to SamplingConfig's
    check: a 400 naming the field). `override`: an interface's own bounds of it (low, high, low_open, high_open;
    max_length: how many entries a bias or an id list may hold)."""
    max_length = override.pop("max_length", None)
    param = dataclasses.replace(param, **override)
    bounds: dict[str, float] = {}
    if param.kind in ("float", "int") and not param.also:
        bounds["gt" if param.low_open else "ge"] = param.low
        if param.high is not None:
            bounds["lt" if param.high_open else "le"] = param.high
    # sequences (bad_words): token-id sequences, or words as vLLM's clients send them (server/words.py tokenises them)
    # dry_sequence_breakers: token ids, or strings as llama.cpp's clients send them (server/words.py: the tokens
    # that hold them)
    ids = list[str | int] if param.name == "dry_sequence_breakers" else list[int]
    kind = {"float": float, "int": int, "ids": ids, "sequences": list[str | list[int]], "names": str | list[str],
            "bias": dict[str, float]}[param.kind]
    if max_length is not None:
        kind = Annotated[kind, Field(max_length=max_length)]
    if param.kind not in ("float", "int"):
        kind = kind | None
    default = param.default if param.kind in ("float", "int") else None
    return kind, Field(default, description=f"{param.allowed}. {param.doc}", **bounds)


def _fields(names: tuple[str, ...], overrides: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """The pydantic fields of the declared parameters `names`, each with its interface's overrides."""
    return {n: _declared(PARAMS[n], **overrides.get(n, {})) for n in names}


# the steps' own fields (typical_p, top_n_sigma, xtc_*, dry_*, mirostat*, dynatemp_*, epsilon/eta cut-offs,
# no_repeat_ngram_size, bad_words, allowed_token_ids, min_tokens, stop_token_ids, samplers), under the names their
# origins use, generated from their declarations
StepFields = create_model("StepFields", __base__=_Request, __doc__="The declared steps' settings (see "
                          "lmhead.sampling.steps).", **{p.name: _declared(p) for p in ENTRY_FIELDS})

# what each interface bounds otherwise than the declaration (everything else is as declared): the page's temperature
# slider stops at 2; OpenAI's API bounds temperature to [0, 2] and the presence / frequency penalties to [-2, 2],
# vLLM's clients send top_k -1 for off and any repetition_penalty > 0; a bias or a ban list holds at most
# MAX_LOGIT_BIAS entries
_LISTS = {"logit_bias": {"max_length": MAX_LOGIT_BIAS}, "banned_tokens": {"max_length": MAX_LOGIT_BIAS}}
PAGE_OVERRIDES: dict[str, dict[str, Any]] = {"temperature": {"high": 2.0}, **_LISTS}
OPENAI_OVERRIDES: dict[str, dict[str, Any]] = {
    "temperature": {"high": 2.0}, "presence_penalty": {"low": -2.0, "high": 2.0},
    "frequency_penalty": {"low": -2.0, "high": 2.0}, "top_k": {"low": -1},
    "repetition_penalty": {"low": 0.0, "low_open": True, "high": None}, **_LISTS}
# the settings every entry point took before the other steps declared themselves (lmhead.sampling.steps.LEGACY_FIELDS
# less the seed, which each interface takes on its own terms); /v1 takes no banned_tokens (OpenAI's clients ban by
# logit_bias -100)
_PAGE_SETTINGS = ("temperature", "top_k", "top_p", "min_p", "logit_bias", "banned_tokens", "repetition_penalty",
                  "presence_penalty", "frequency_penalty")
_OPENAI_SETTINGS = tuple(n for n in _PAGE_SETTINGS if n != "banned_tokens")

# the page's settings: every step's, so that the page can show each one
SamplingFields = create_model(
    "SamplingFields", __base__=StepFields,
    __doc__="The logits pipeline's settings as the page sets them: every declared step's parameters (the temperature "
            "bounded for the page's slider).",
    **_fields(_PAGE_SETTINGS, PAGE_OVERRIDES))
# /v1's: the same declarations, with OpenAI's bounds
OpenAISamplingFields = create_model(
    "OpenAISamplingFields", __base__=StepFields,
    __doc__="The logits pipeline's settings as /v1 takes them: every declared step's parameters, OpenAI's bounds.",
    **_fields(_OPENAI_SETTINGS, OPENAI_OVERRIDES))


# --- /api ---------------------------------------------------------------------------------------------------


_ANSWER_FROM = ("where the constrained answer starts, in characters (code points) of the prompt (default: after "
                "it); the text from there is the answer so far, which must match the constraint")


class PageConstraint(_Request):
    """The page's constraint box: the answer that starts after the prompt is JSON matching a schema, a regex's
    match, or one of comma-separated strings."""

    kind: Literal["json_schema", "regex", "choice"]
    text: Annotated[str, Field(min_length=1, max_length=100_000)]


class PredictRequest(SamplingFields):
    """POST /api/predict: the next-token candidates of a prompt, raw (T=1) and after the pipeline."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    top: int = Field(200, ge=1, le=MAX_CANDIDATES, description="how many candidates to return (by logit)")
    constraint: PageConstraint | None = Field(None, description="structured output: its mask cuts first")
    answer_from: int | None = Field(None, ge=0, le=MAX_PROMPT_CHARS, description=_ANSWER_FROM)


class StepRequest(SamplingFields):
    """POST /api/step: choose one next token with the current settings and append it to the prompt."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    constraint: PageConstraint | None = Field(None, description="structured output: its mask cuts first")
    answer_from: int | None = Field(None, ge=0, le=MAX_PROMPT_CHARS, description=_ANSWER_FROM)
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="same seed and step → same token")
    step: int = Field(0, ge=0, le=1_000_000, description="index of this step in a seeded run")


class GenerateRequest(StepRequest):
    """POST /api/generate: several steps, streamed as server-sent events."""

    max_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS)


class LayersRequest(_Request):
    """POST /api/layers: the logit lens at the last position."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    top: int = Field(5, ge=1, le=MAX_TOP_LOGPROBS)


class ScoreRequest(_Request):
    """POST /api/score: every token of a text with its log-probability and rank, and the perplexity."""

    text: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)


class StepResponse(BaseModel):
    token_id: int
    text: str
    prompt: str = Field(..., description="the prompt with the chosen token's text appended")
    probability: float = Field(..., description="the token's probability after the pipeline")
    raw_probability: float | None = Field(None, description="its probability at T=1 with no cuts")
    rank: int | None = Field(None, description="1 = the most likely token (raw logits)")
    finish_reason: str | None = None
    seed: int | None = None
    step: int = 0


# --- /v1 (OpenAI-compatible) --------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: StrictBool = False


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Prompt = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_CONTEXT_TOKENS)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class JSONSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`: a named schema; `strict` is accepted (the output always matches)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema (absent: any JSON)")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    """OpenAI's `response_format`: "text" (free), "json_object" (any JSON object), "json_schema"."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (Lark or GBNF),
    json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: GrammarText | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                      Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: GrammarText | None = None
    json_object: StrictBool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _OpenAIRequest(OpenAISamplingFields):
    model: Name | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS,
                                  description="prompt + max_tokens ≤ the served context (default: the rest of it)")
    n: int = Field(1, ge=1, le=MAX_N, description="choices per prompt, each its own draw (with a seed: seed + i)")
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int) -> int:
        return 0 if v == -1 else v  # vLLM's and llama.cpp's "off"
    # lmhead's extension: logprobs from the fp32 head (by default: the decode head's, see lmhead.generate)
    exact_logprobs: StrictBool = Field(False, description="compute the returned logprobs with the full-precision head")
    # vLLM's extensions (stop_token_ids and min_tokens are the declared steps': StepFields; stop_token_ids
    # also end a choice, v1.py)
    ignore_eos: StrictBool = Field(False, description="the model's end-of-sequence ids do not end a choice")
    include_stop_str_in_output: StrictBool = Field(False, description="a choice's text keeps the stop string")
    # structured output: at most one of these (server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice, grammar")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp server's: the answer matches this schema")
    grammar: GrammarText | None = Field(None, description="llama.cpp server's: a GBNF (or Lark) grammar")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_OpenAIRequest):
    prompt: (Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]) = Field(
        ..., description="a string, a list of strings, a list of token ids or a list of lists of token ids: one "
                         "choice (n choices) per prompt, in order (`index`)")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(16, ge=0, le=MAX_CONTEXT_TOKENS,
                                   description="0 with echo: the prompt's scores only")
    echo: StrictBool = Field(False, description="the prompt before each choice's text (and its tokens' logprobs: "
                                                "the first one's null)")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                        description="vLLM's: each prompt token's logprob and its top alternatives")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if p and isinstance(p[0], int) else list(p)  # type: ignore[list-item]


class TextPart(_Request):
    type: Literal["text"]
    text: Prompt


class CalledFunction(_Request):
    name: Annotated[str, Field(max_length=64)]
    arguments: Prompt = Field(..., description="the arguments as JSON text")


class ToolCall(_Request):
    """A call an earlier assistant turn made (sent back by the client with the tool's result after it)."""

    id: Name
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Prompt | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Request):
    name: FunctionName
    description: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON schema (absent: no arguments)")
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(
        ..., min_length=1, max_length=MAX_MESSAGES,
        description=f"at most {MAX_PROMPT_CHARS:,} characters of text in all (before the chat template)")
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_CONTEXT_TOKENS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = Field(None, description="accepted; an answer makes at most one call")

    @field_validator("messages")
    @classmethod
    def _bounded_text(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        # each message is bounded alone; their sum is what the template and the tokenizer would see (the served
        # bound, below this ceiling, is served.check_chars')
        total = sum(len(m.text()) for m in messages)
        if total > MAX_TEXT_CHARS:
            raise ValueError(f"the messages hold {total:,} characters of text in all; the limit is "
                             f"{MAX_TEXT_CHARS:,}")
        return messages


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages through the chat template."""

    model: Name | None = None
    prompt: Prompt | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: StrictBool = Field(True, description="the tokenizer's special tokens (a prompt's BOS)")
    add_generation_prompt: StrictBool = Field(True, description="messages: the assistant turn's opening")
    return_token_strs: StrictBool = Field(False, description="each token's text too")


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's shape): token ids → text."""

    model: Name | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_CONTEXT_TOKENS)]


def openai_error(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

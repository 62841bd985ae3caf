"""Request and response bodies of the server's JSON API (pydantic).

Every request model forbids unknown fields (`extra="forbid"`): a misspelt option is a 422, never silently
ignored. Bounds that do not depend on the model (max_tokens, top_logprobs ≤ 20, sampling ranges, every text's
characters — a prompt, the messages' total, a stop string, a name) are checked here, before anything is
tokenised; bounds that need the tokenizer (prompt length in tokens) are checked by served.py (400). The body
as a whole is bounded before it is parsed (guard.py: 413).

Two families:
* `/api/*` — the explainer page's own API (predict, step, generate, layers, score, model, params).
* `/v1/*`  — OpenAI-compatible completions and chat completions, with `top_k`, `min_p` and
  `repetition_penalty` as extensions (as vLLM and llama.cpp's server accept them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

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


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _declared(param: Any) -> tuple[Any, Any]:
    """A declared step parameter (lmhead.sampling.steps.Param) as a pydantic field: its type, default and range
    as declared (a range with single values beside it, such as top_n_sigma's -1, is left to SamplingConfig's
    check: a 400 naming the field)."""
    bounds: dict[str, float] = {}
    if param.kind in ("float", "int") and not param.also:
        bounds["gt" if param.low_open else "ge"] = param.low
        if param.high is not None:
            bounds["lt" if param.high_open else "le"] = param.high
    kind = {"float": float, "int": int, "ids": list[int] | None, "sequences": list[list[int]] | None,
            "names": str | list[str] | None}[param.kind]
    default = param.default if param.kind in ("float", "int") else None
    return kind, Field(default, description=f"{param.allowed}. {param.doc}", **bounds)


# the steps' own fields (typical_p, top_n_sigma, xtc_*, dry_*, mirostat*, dynatemp_*, epsilon/eta cut-offs,
# no_repeat_ngram_size, bad_words, allowed_token_ids, min_tokens, stop_token_ids, samplers), under the names their
# origins use, generated from their declarations
StepFields = create_model("StepFields", __base__=_Request, __doc__="The declared steps' settings (see "
                          "lmhead.sampling.steps).", **{p.name: _declared(p) for p in ENTRY_FIELDS})


class _PageFields(StepFields):
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy (argmax)")
    top_k: int = Field(0, ge=0, description="0 = off")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="0 = off")
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token id (as a string) → a bias in [-1e4, 1e4] added to its logit")
    banned_tokens: Annotated[list[int], Field(max_length=MAX_LOGIT_BIAS)] | None = Field(
        None, description="token ids that can never be chosen")


# the page's settings: every step's, so that the page can show each one (the penalties from their declarations)
SamplingFields = create_model(
    "SamplingFields", __base__=_PageFields,
    __doc__="The logits pipeline's settings as the page sets them: temperature → top-k → top-p → min-p (the "
            "temperature bounded for the page's slider), the logit bias and bans, the penalties and every declared "
            "step's (StepFields).",
    **{n: _declared(PARAMS[n]) for n in ("repetition_penalty", "presence_penalty", "frequency_penalty")})


# --- /api ---------------------------------------------------------------------------------------------------


class PredictRequest(SamplingFields):
    """POST /api/predict: the next-token candidates of a prompt, raw (T=1) and after the pipeline."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
    top: int = Field(200, ge=1, le=MAX_CANDIDATES, description="how many candidates to return (by logit)")


class StepRequest(SamplingFields):
    """POST /api/step: choose one next token with the current settings and append it to the prompt."""

    prompt: str = Field(..., min_length=1, max_length=MAX_PROMPT_CHARS)
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
    include_usage: bool = False


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Prompt = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _OpenAIRequest(StepFields):
    model: Name | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: Name | None = None
    # extensions (vLLM, llama.cpp server)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    # lmhead's extension: logprobs from the fp32 head (by default: the decode head's, see lmhead.generate)
    exact_logprobs: bool = Field(False, description="compute the returned logprobs with the full-precision head")

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(_OpenAIRequest):
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=1)] = Field(
        ..., description=f"one prompt (a list of one is accepted), at most {MAX_PROMPT_CHARS:,} characters")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS)


class TextPart(_Request):
    type: Literal["text"]
    text: Prompt


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: Prompt | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)]
    name: Name | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(
        ..., min_length=1, max_length=MAX_MESSAGES,
        description=f"at most {MAX_PROMPT_CHARS:,} characters of text in all (before the chat template)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)

    @field_validator("messages")
    @classmethod
    def _bounded_text(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        # each message is bounded alone; their sum is what the template and the tokenizer would see
        total = sum(len(m.text()) for m in messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages hold {total:,} characters of text in all; the limit is "
                             f"{MAX_PROMPT_CHARS:,}")
        return messages


def openai_error(message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

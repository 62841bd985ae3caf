"""The body alone over HTTP: embeddings, rerank, classify and score (one router; `create_app` includes it).

    POST /v1/embeddings          OpenAI's shape: `input` a string, a list of strings, token ids or lists of
                                 them; `encoding_format` float | base64 (little-endian float32, what the openai
                                 client asks for by default); `dimensions` (the first n values, renormalised);
                                 `usage`. Extensions (vLLM's): truncate_prompt_tokens, pooling, normalize
    POST /v1/rerank, /rerank     llama-server's, Jina's and Cohere's shape: query, documents (strings or
                                 {"text": ...}), top_n, return_documents → results [{index, relevance_score,
                                 document: {text}}], best first
    POST /v1/classify, /classify vLLM's: input (a string or a list) → data [{index, label, probs, num_classes}],
                                 under the served classification head (`lmhead serve --classifier FILE`, else
                                 the model file's own `cls.output` head)
    POST /v1/score, /score       vLLM's: text_1 against text_2 (one against many, or pairwise) → data [{index,
                                 score}]: the reranker's relevance of text_2 to text_1
    POST /api/embed              Ollama's: input (a string or a list) → embeddings (L2-normalised), with truncate
                                 (default true: each input's end cut to the served context; false: a 400)
    POST /api/swap               the page's view of the swap (`explain_swap.swap`): the prompt's last hidden state
                                 through the LM head and through a head of `labels` (their words' LM-head rows:
                                 the zero-shot classifier) or the served classification head

Every call runs on the model's scheduler thread (`Served.call`, the runner that serves generation), so these
requests queue with the explain calls and never run beside a decode round; a large request is several calls
(`pieces`: at most BATCH_TOKENS tokens each), so running generations decode between them. Inputs are checked
against the served context (`--ctx-size`). The library does the work
(`lmhead.heads`); a ValueError of it is a 400 naming the field.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from lmhead.explain_swap import swap
from lmhead.heads.classifier import ClassificationHead, from_file, verbaliser
from lmhead.heads.pooling import BATCH_TOKENS, POOLINGS, default_pooling, normalized, pooled_states, token_ids
from lmhead.heads.reranker import rank_head, rerank_prompts, score_ids
from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.served import Served, check_chars, context_of, get_served

router = APIRouter(tags=["pooling"])

MAX_INPUTS = 2048  # texts of one request (OpenAI's embeddings limit)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(max_length=S.MAX_NAME_CHARS)] | None = None
    user: Annotated[str, Field(max_length=S.MAX_NAME_CHARS)] | None = None


Inputs = (S.Prompt | Annotated[list[S.Prompt], Field(min_length=1, max_length=MAX_INPUTS)] | S.TokenIds
          | Annotated[list[S.TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])


class EmbeddingRequest(_Request):
    input: Inputs = Field(..., description="a string, a list of strings, token ids or a list of token id lists")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="the first n values of each embedding, renormalised")
    truncate_prompt_tokens: int | None = Field(None, ge=1, description="keep each input's last n tokens")
    pooling: Literal[POOLINGS[:3]] | None = Field(None, description="default: the file's pooling_type, else last")
    normalize: StrictBool = True


class Document(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere's documents may carry fields of their own
    text: S.Prompt


class RerankRequest(_Request):
    query: S.Prompt
    documents: Annotated[list[S.Prompt | Document], Field(min_length=1, max_length=MAX_INPUTS)]
    top_n: int | None = Field(None, ge=1)
    return_documents: StrictBool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class ClassifyRequest(_Request):
    input: S.Prompt | Annotated[list[S.Prompt], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class SwapRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: S.Prompt
    labels: Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]],
                      Field(min_length=2, max_length=64)] | None = Field(
        None, description="class words (the LM head's rows of them); none: the served classification head")
    top: int = Field(10, ge=1, le=100, description="the LM head's candidates shown")


class OllamaEmbedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, Field(max_length=S.MAX_NAME_CHARS)] | None = None
    input: S.Prompt | Annotated[list[S.Prompt], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate: StrictBool = True
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None      # Ollama's runtime options: accepted, not used here
    keep_alive: str | int | None = None         # the model stays loaded: accepted, not used


class ScoreRequest(_Request):
    text_1: S.Prompt | Annotated[list[S.Prompt], Field(min_length=1, max_length=MAX_INPUTS)]
    text_2: S.Prompt | Annotated[list[S.Prompt], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate_prompt_tokens: int | None = Field(None, ge=1)


def _check_model(served: Served, name: str | None) -> None:
    if name is not None and name not in (served.name, getattr(served.model, "name", None)):
        raise APIError(404, f"The model `{name}` does not exist; this server serves `{served.name}`", "model",
                       "model_not_found")


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [value]
    return [value] if value and isinstance(value[0], int) else list(value)


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def pieces(lengths: list[int], budget: int | None = None) -> list[slice]:
    """Consecutive slices of the inputs, each at most `budget` tokens (default BATCH_TOKENS; one input at least):
    each is one call on the model's thread, so decode rounds of running generations go on between them."""
    budget = BATCH_TOKENS if budget is None else budget
    out, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            out.append(slice(start, i))
            start, used = i, 0
        used += n
    out.append(slice(start, len(lengths)))
    return out


def pooled(model: Any, ids: list[list[int]], pooling: str | None, normalize: bool, dimensions: int | None
           ) -> torch.Tensor:
    """Embeddings [B,D'] of checked id lists: pooled (None: the file's pooling_type, else last), cut to
    `dimensions` and renormalised."""
    if pooling is None:
        pooling = default_pooling(model)
        pooling = "last" if pooling in ("rank", "none") else pooling
    out = pooled_states(model, ids, pooling)
    if dimensions is not None:
        out = out[:, :dimensions]
    return normalized(out) if normalize else out


async def _checked_ids(served: Served, inputs: list[Any], truncate: int | None, name: str) -> list[list[int]]:
    """The inputs' token ids (one call on the model's thread), each within the served context."""
    ids = await served.call(token_ids, served.model, inputs, truncate, name)
    context = context_of(served)
    for i, x in enumerate(ids):
        if len(x) > context:
            raise APIError(400, f"{name}[{i}] has {len(x)} tokens, more than the served context of {context} "
                                "(truncate_prompt_tokens keeps the last n)", name)
    return ids


async def _in_pieces(served: Served, fn: Any, ids: list[list[int]], *args: Any) -> torch.Tensor:
    """fn(model, ids[piece], *args) for each piece of `pieces`, each one call on the model's thread, joined."""
    return torch.cat([await served.call(fn, served.model, ids[part], *args)
                      for part in pieces([len(x) for x in ids])])


@router.post("/v1/embeddings", summary="OpenAI-compatible embeddings: the body alone, pooled")
async def v1_embeddings(req: EmbeddingRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    inputs = _as_list(req.input)
    check_chars(served.limits, [x for x in inputs if isinstance(x, str)], "input")
    width = int(served.model.exact_head.d_model)
    if req.dimensions is not None and req.dimensions > width:
        raise APIError(400, f"dimensions: {req.dimensions} is more than the model's width {width}", "dimensions")
    ids = await _checked_ids(served, inputs, req.truncate_prompt_tokens, "input")
    vectors = await _in_pieces(served, pooled, ids, req.pooling, req.normalize, req.dimensions)
    data = []
    for i, v in enumerate(vectors):
        value: Any = (base64.b64encode(v.contiguous().numpy().astype("<f4").tobytes()).decode()
                      if req.encoding_format == "base64" else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": served.name, "usage": _usage(sum(len(x) for x in ids))}


def _rank_inputs(model: Any, query: str, docs: list[str]) -> tuple[list[str], Any]:
    """(the reranker's prompts, its scoring head) for a query's documents."""
    return rerank_prompts(model, query, docs), rank_head(model)


async def _scores(served: Served, query: str, docs: list[str], truncate: int | None) -> tuple[list[float], int]:
    """(each document's relevance to `query`, the prompts' tokens), scored in pieces on the model's thread."""
    prompts, stored = await served.call(_rank_inputs, served.model, query, docs)
    ids = await _checked_ids(served, prompts, truncate, "documents")
    return (await _in_pieces(served, score_ids, ids, stored)).tolist(), sum(len(x) for x in ids)


@router.post("/v1/rerank", summary="Rerank documents against a query (llama-server, Jina, Cohere)")
@router.post("/rerank", include_in_schema=False)
async def v1_rerank(req: RerankRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    check_chars(served.limits, [req.query, *docs], "documents")
    scores, tokens = await _scores(served, req.query, docs, req.truncate_prompt_tokens)
    out = []
    for i in sorted(range(len(docs)), key=lambda i: -scores[i])[:req.top_n]:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            item["document"] = {"text": docs[i]}
        out.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": served.name, "results": out,
            "usage": _usage(tokens)}


def _classifier(request: Request, served: Served, other: str = "") -> ClassificationHead:
    head = getattr(request.app.state, "classifier", None)
    if head is None:
        head = from_file(served.model)
    if head is None:
        raise APIError(400, f"this server has no classification head: {other}start it with --classifier FILE (a "
                            "head saved by `lmhead train-head`), or serve a model whose file holds one (cls.output)",
                       "labels" if other else "model")
    return head


def _class_probs(model: Any, ids: list[list[int]], head: ClassificationHead) -> torch.Tensor:
    return head.predict(pooled_states(model, ids, head.pooling))


@router.post("/v1/classify", summary="Classify texts with the served classification head (vLLM)")
@router.post("/classify", include_in_schema=False)
async def v1_classify(req: ClassifyRequest, request: Request, served: Served = Depends(get_served)
                      ) -> dict[str, Any]:
    _check_model(served, req.model)
    texts = _as_list(req.input)
    check_chars(served.limits, texts, "input")
    head = _classifier(request, served)
    await served.call(head.check_model, served.model)
    ids = await _checked_ids(served, [head.template.format(text=t) for t in texts], req.truncate_prompt_tokens,
                             "input")
    probs, tokens = await _in_pieces(served, _class_probs, ids, head), sum(len(x) for x in ids)
    data = [{"index": i, "label": head.labels[int(p.argmax())], "probs": p.tolist(),
             "num_classes": len(head.labels)} for i, p in enumerate(probs)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served.name, "data": data, "usage": _usage(tokens)}


@router.post("/v1/score", summary="Score text_2 against text_1 with the reranker (vLLM)")
@router.post("/score", include_in_schema=False)
async def v1_score(req: ScoreRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    firsts, seconds = _as_list(req.text_1), _as_list(req.text_2)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise APIError(400, f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                            "as many as text_2", "text_1")
    check_chars(served.limits, firsts + seconds, "text_2")
    if len(firsts) == 1:
        scores, _ = await _scores(served, firsts[0], seconds, req.truncate_prompt_tokens)
    else:
        scores = [(await _scores(served, a, [b], req.truncate_prompt_tokens))[0][0]
                  for a, b in zip(firsts, seconds, strict=True)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served.name, "data": [{"index": i, "object": "score", "score": s}
                                           for i, s in enumerate(scores)]}


def _swap_job(model: Any, prompt: str, labels: list[str] | None, head: ClassificationHead | None, top: int
              ) -> dict[str, Any]:
    if labels is not None:
        head = verbaliser(model, labels, template="{text}")
    return swap(model, prompt, head, top=top).to_dict()


@router.post("/api/swap", summary="One hidden state through the LM head and through a classification head")
async def api_swap(req: SwapRequest, request: Request, served: Served = Depends(get_served)) -> dict[str, Any]:
    if not req.prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    check_chars(served.limits, [req.prompt], "prompt")
    head = None if req.labels is not None else _classifier(request, served, "give labels, or ")
    return await served.call(_swap_job, served.model, req.prompt, req.labels, head, req.top)


def _ollama_ids(model: Any, texts: list[str], context: int, truncate: bool) -> list[list[int]]:
    """Each text's ids; past `context` its end is cut (Ollama's truncate) or it is a ValueError naming it."""
    ids = token_ids(model, texts, None, "input", limit=None if not truncate else 1 << 62)
    if truncate:
        ids = [x[:context] for x in ids]
    for i, x in enumerate(ids):
        if len(x) > context:
            raise ValueError(f"input[{i}] has {len(x)} tokens, more than the served context of {context} "
                             "(truncate: true cuts its end)")
    return ids


@router.post("/api/embed", summary="Ollama's embeddings")
async def ollama_embed(req: OllamaEmbedRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    start = time.perf_counter_ns()
    texts = _as_list(req.input)
    check_chars(served.limits, texts, "input")
    width = int(served.model.exact_head.d_model)
    if req.dimensions is not None and req.dimensions > width:
        raise APIError(400, f"dimensions: {req.dimensions} is more than the model's width {width}", "dimensions")
    ids = await served.call(_ollama_ids, served.model, texts, context_of(served), req.truncate)
    vectors = await _in_pieces(served, pooled, ids, None, True, req.dimensions)
    return {"model": served.name, "embeddings": vectors.tolist(), "total_duration": time.perf_counter_ns() - start,
            "load_duration": 0, "prompt_eval_count": sum(len(x) for x in ids)}

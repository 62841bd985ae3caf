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

Every call runs on the model's scheduler thread (`Served.call`, the runner that serves generation), so these
requests queue with the explain calls and never run beside a decode round. The library does the work
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

from lmhead.heads.classifier import ClassificationHead, from_file
from lmhead.heads.pooling import POOLINGS, final_states, normalized, pool, token_ids
from lmhead.heads.reranker import rerank, score_pairs
from lmhead.server import schemas as S
from lmhead.server.errors import APIError
from lmhead.server.served import Served, check_chars, get_served

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


def embeddings(model: Any, inputs: list[Any], pooling: str | None, normalize: bool, dimensions: int | None,
               truncate: int | None) -> tuple[torch.Tensor, int]:
    """(embeddings [B,D'] float32, prompt tokens) for the route: pooled, cut to `dimensions` and renormalised."""
    from lmhead.heads.pooling import default_pooling

    width = int(model.exact_head.d_model)
    if dimensions is not None and dimensions > width:
        raise ValueError(f"dimensions: {dimensions} is more than the model's width {width}")
    ids = token_ids(model, inputs, truncate)
    if pooling is None:
        pooling = default_pooling(model)
        pooling = "last" if pooling in ("rank", "none") else pooling
    out = pool(final_states(model, ids), pooling)
    if dimensions is not None:
        out = out[:, :dimensions]
    return (normalized(out) if normalize else out), sum(len(x) for x in ids)


@router.post("/v1/embeddings", summary="OpenAI-compatible embeddings: the body alone, pooled")
async def v1_embeddings(req: EmbeddingRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    inputs = _as_list(req.input)
    check_chars(served.limits, [x for x in inputs if isinstance(x, str)], "input")
    vectors, tokens = await served.call(embeddings, served.model, inputs, req.pooling, req.normalize,
                                        req.dimensions, req.truncate_prompt_tokens)
    data = []
    for i, v in enumerate(vectors):
        value: Any = (base64.b64encode(v.contiguous().numpy().astype("<f4").tobytes()).decode()
                      if req.encoding_format == "base64" else v.tolist())
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {"object": "list", "data": data, "model": served.name, "usage": _usage(tokens)}


def _rerank_job(model: Any, query: str, docs: list[str], top_n: int | None, truncate: int | None
                ) -> tuple[list[dict[str, Any]], int]:
    results = rerank(model, query, docs, top_n=top_n, truncate_prompt_tokens=truncate)
    from lmhead.heads.reranker import rerank_prompts

    tokens = sum(len(x) for x in token_ids(model, rerank_prompts(model, query, docs), truncate, "documents"))
    return results, tokens


@router.post("/v1/rerank", summary="Rerank documents against a query (llama-server, Jina, Cohere)")
@router.post("/rerank", include_in_schema=False)
async def v1_rerank(req: RerankRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    check_chars(served.limits, [req.query, *docs], "documents")
    results, tokens = await served.call(_rerank_job, served.model, req.query, docs, req.top_n,
                                        req.truncate_prompt_tokens)
    out = []
    for r in results:
        item: dict[str, Any] = {"index": r["index"], "relevance_score": r["relevance_score"]}
        if req.return_documents:
            item["document"] = {"text": r["document"]}
        out.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": served.name, "results": out,
            "usage": _usage(tokens)}


def _classifier(request: Request, served: Served) -> ClassificationHead:
    head = getattr(request.app.state, "classifier", None)
    if head is None:
        head = from_file(served.model)
    if head is None:
        raise APIError(400, "this server has no classification head: start it with --classifier FILE (a head "
                            "saved by `lmhead train-head`), or serve a model whose file holds one (cls.output)",
                       "model")
    return head


def _classify_job(model: Any, head: ClassificationHead, texts: list[str], truncate: int | None
                  ) -> tuple[torch.Tensor, int]:
    head.check_model(model)
    ids = token_ids(model, [head.template.format(text=t) for t in texts], truncate)
    return head.predict(pool(final_states(model, ids), head.pooling)), sum(map(len, ids))


@router.post("/v1/classify", summary="Classify texts with the served classification head (vLLM)")
@router.post("/classify", include_in_schema=False)
async def v1_classify(req: ClassifyRequest, request: Request, served: Served = Depends(get_served)
                      ) -> dict[str, Any]:
    _check_model(served, req.model)
    texts = _as_list(req.input)
    check_chars(served.limits, texts, "input")
    head = _classifier(request, served)
    probs, tokens = await served.call(_classify_job, served.model, head, texts, req.truncate_prompt_tokens)
    data = [{"index": i, "label": head.labels[int(p.argmax())], "probs": p.tolist(),
             "num_classes": len(head.labels)} for i, p in enumerate(probs)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served.name, "data": data, "usage": _usage(tokens)}


def _score_job(model: Any, firsts: list[str], seconds: list[str], truncate: int | None) -> list[float]:
    if len(firsts) == 1:
        return score_pairs(model, firsts[0], seconds, truncate_prompt_tokens=truncate).tolist()
    return [float(score_pairs(model, a, [b], truncate_prompt_tokens=truncate)[0])
            for a, b in zip(firsts, seconds, strict=True)]


@router.post("/v1/score", summary="Score text_2 against text_1 with the reranker (vLLM)")
@router.post("/score", include_in_schema=False)
async def v1_score(req: ScoreRequest, served: Served = Depends(get_served)) -> dict[str, Any]:
    _check_model(served, req.model)
    firsts, seconds = _as_list(req.text_1), _as_list(req.text_2)
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise APIError(400, f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                            "as many as text_2", "text_1")
    check_chars(served.limits, firsts + seconds, "text_2")
    scores = await served.call(_score_job, served.model, firsts, seconds, req.truncate_prompt_tokens)
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": served.name, "data": [{"index": i, "object": "score", "score": s}
                                           for i, s in enumerate(scores)]}

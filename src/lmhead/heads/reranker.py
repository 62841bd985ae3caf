"""A reranker: (query, document) pairs scored by one projection of the last token's final hidden state.

    (query, document) ──template──▶ ids ──the body──▶ hidden at the last position h [D]
        ──▶ "lm":   p(yes) = sigmoid(W[yes]·h − W[no]·h)   two rows of the LM head (Qwen3-Reranker's rule:
                                                            softmax over the logits of "no" and "yes")
        ──▶ "file": softmax(C·h + c)[0] over the file's `cls.output` head [K,D] (llama.cpp's pooling "rank";
                    a single-row head's raw logit)
    documents sorted by score, highest first, the first `top_n` kept

The template is the file's `tokenizer.chat_template.rerank` where it has one (llama.cpp's placeholders
`{query}` and `{document}`), else Qwen3-Reranker's prompt with its default instruction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmhead.heads.classifier import from_file, head_rows
from lmhead.heads.pooling import default_pooling, pooled_states, token_ids

__all__ = ["INSTRUCTION", "QWEN3_TEMPLATE", "rank_head", "rerank", "rerank_prompts", "score_ids", "score_pairs"]

INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _file_template(model: Any) -> str | None:
    cached = model.__dict__.get("_rerank_template", False)
    if cached is not False:
        return cached
    found = None
    path = getattr(model, "gguf_path", None)
    if path is not None:
        from lmhead.models.gguf_meta import read_metadata

        found = read_metadata(path)[0].get("tokenizer.chat_template.rerank")
    model._rerank_template = found if isinstance(found, str) and "{query}" in found else None
    return model._rerank_template


def rerank_prompts(model: Any, query: str, documents: Sequence[str], instruction: str = INSTRUCTION) -> list[str]:
    """Each document's prompt: the file's rerank template, else QWEN3_TEMPLATE."""
    template = _file_template(model) or QWEN3_TEMPLATE
    return [template.replace("{instruction}", instruction).replace("{query}", query).replace("{document}", d)
            for d in documents]


def _check(query: Any, documents: Any, top_n: Any) -> None:
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty string")
    if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents:
        raise ValueError("documents must be a non-empty list of strings")
    for i, d in enumerate(documents):
        if not isinstance(d, str) or not d:
            raise ValueError(f"documents[{i}] must be a non-empty string")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f"top_n must be an integer >= 1; got {top_n!r}")


def rank_head(model: Any, head: str = "auto") -> Any:
    """The scoring head `head` names: the file's ClassificationHead ("file", or "auto" where the file's pooling is
    "rank"), else None — the LM head's yes/no rows ("lm")."""
    if head not in ("auto", "lm", "file"):
        raise ValueError(f"head must be one of auto, lm, file; got {head!r}")
    stored = from_file(model) if head in ("auto", "file") else None
    if head == "file" and stored is None:
        raise ValueError("head='file': the model's file holds no classification head (cls.output)")
    return None if head == "auto" and default_pooling(model) != "rank" else stored


@torch.no_grad()
def score_ids(model: Any, ids: list[list[int]], stored: Any = None) -> torch.Tensor:
    """Scores [N] of reranker prompts given as checked token ids: the last position's final hidden state through
    `stored` (a ClassificationHead: softmax, its first row; a single row's raw logit) or, where None, the LM
    head's yes/no rows (sigmoid of their difference)."""
    last = pooled_states(model, ids, "last")                          # [N,D]
    if stored is not None:
        logits = stored(last)                                            # [N,K]
        return logits[:, 0] if logits.shape[1] == 1 else torch.softmax(logits, dim=-1)[:, 0]
    weight, bias = head_rows(model, [_first_token(model, w) for w in ("yes", "no")])
    logits = last @ weight.T + (0 if bias is None else bias)            # [N,2]: yes, no
    return torch.sigmoid(logits[:, 0] - logits[:, 1])


def score_pairs(model: Any, query: str, documents: Sequence[str], head: str = "auto",
                instruction: str = INSTRUCTION, truncate_prompt_tokens: int | None = None) -> torch.Tensor:
    """Relevance scores [N] of each document to `query`, in the documents' order. `head`: "lm" (the LM head's
    yes/no rows), "file" (the file's `cls.output` head), "auto" (the file's head where its pooling is "rank",
    else "lm")."""
    _check(query, documents, None)
    stored = rank_head(model, head)
    ids = token_ids(model, rerank_prompts(model, query, documents, instruction), truncate_prompt_tokens,
                    name="documents")
    return score_ids(model, ids, stored)


def _first_token(model: Any, word: str) -> int:
    ids = model.tokenizer.encode(word, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes {word!r} to no tokens")
    return int(ids[0])


def rerank(model: Any, query: str, documents: Sequence[str], top_n: int | None = None, head: str = "auto",
           instruction: str = INSTRUCTION, truncate_prompt_tokens: int | None = None) -> list[dict[str, Any]]:
    """The documents ranked by relevance to `query`: [{"index", "relevance_score", "document"}], highest score
    first, at most `top_n` (see `score_pairs` for the scores)."""
    _check(query, documents, top_n)
    scores = score_pairs(model, query, documents, head=head, instruction=instruction,
                         truncate_prompt_tokens=truncate_prompt_tokens).tolist()
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n]
    return [{"index": i, "relevance_score": float(scores[i]), "document": documents[i]} for i in order]

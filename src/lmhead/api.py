"""The model users hold: `lmhead.Model` and `lmhead.load_model`, which builds it.

`lmhead.models.model.Model` is the loaded model (body, heads, tokenizer) and sits on the models floor, below the
decode loop and the explainer; the calls that run those on it live here, above both:

    model = lmhead.load_model("gemma-3-270m")
    model.generate(prompt, ...)    lmhead.generate.generate(model, prompt, ...)
    model.predict(prompt, ...)     lmhead.explain.predict(model, prompt, ...)
    model.evaluate(text, ...)      lmhead.explain.evaluate(model, text, ...)
    model.perplexity(text, ...)    lmhead.explain.perplexity(model, text, ...)

The library's own callers (the CLI, the server) call those functions with either class.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from lmhead import explain
from lmhead.generate import generate
from lmhead.models import DEFAULT_MODEL, loading
from lmhead.models.model import Model as LoadedModel

__all__ = ["Model", "load_model"]


class Model(LoadedModel):
    """A loaded language model (`lmhead.models.model.Model`: attributes, heads, bodies) with generate, predict,
    evaluate and perplexity. Build it with `load_model(...)`, or `Model(hf_model, tokenizer)`."""

    def generate(self, prompt_or_prompts: str | Sequence[str], max_new_tokens: int = 32, config=None,
                 stop: str | Sequence[str] | None = None, top_logprobs: int = 0, **kwargs: Any) -> Iterator:
        """Stream generated tokens as `Step`s; see `lmhead.generate.generate` (keyword options: generator,
        profile, draft, draft_tokens, stats)."""
        return generate(self, prompt_or_prompts, max_new_tokens, config=config, stop=stop,
                        top_logprobs=top_logprobs, **kwargs)

    def predict(self, prompt: str, top: int = 10, config=None, layers: bool = False, **kwargs):
        """The next-token candidates for `prompt`; see `lmhead.explain.predict`."""
        return explain.predict(self, prompt, top=top, config=config, layers=layers, **kwargs)

    def evaluate(self, text: str, **kwargs):
        """Perplexity, loss and (tokens=True) per-token scores of `text`; see `lmhead.explain.evaluate`."""
        return explain.evaluate(self, text, **kwargs)

    def perplexity(self, text: str, **kwargs):
        """The model's perplexity on `text`; see `lmhead.explain.perplexity`."""
        return explain.perplexity(self, text, **kwargs)

    def embed(self, inputs, pooling: str | None = None, normalize: bool = True,
              truncate_prompt_tokens: int | None = None):
        """The body alone: [B,D] float32 embeddings of texts (or token id lists), the final hidden state pooled
        ("last" | "mean" | "cls"; None: the file's pooling_type, else "last") and L2-normalised; pooling="none"
        gives a list of [T_i, D]. See `lmhead.heads.pooling.embed`."""
        from lmhead.heads.pooling import embed

        return embed(self, inputs, pooling=pooling, normalize=normalize,
                     truncate_prompt_tokens=truncate_prompt_tokens)

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None, **kwargs: Any):
        """The documents ranked by relevance to `query`: [{"index", "relevance_score", "document"}], best first
        (the LM head's yes/no rows, or the file's `cls.output` head); see `lmhead.heads.reranker.rerank`."""
        from lmhead.heads.reranker import rerank

        return rerank(self, query, documents, top_n=top_n, **kwargs)

    def classify(self, texts: Sequence[str], head):
        """Class probabilities [B,K] of `texts` under a `ClassificationHead` (or a path to a saved one), the
        features pooled as the head was trained."""
        from lmhead.heads.classifier import classify

        return classify(self, texts, head)


def load_model(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL, *, verify: bool = False, progress: bool = True,
               head: str = "auto", body: str = "auto") -> Model:
    """Load a model by name ("gemma-3-270m", "smollm2-135m"), GGUF file path or HF folder path → `Model`.
    The options and the cache: `lmhead.models.load_model`'s docstring."""
    return loading.load_model(name_or_path, verify=verify, progress=progress, head=head, body=body,
                              model_class=Model)

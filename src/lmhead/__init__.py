"""lmhead — the output layer of a language model.

hidden [B,T,D] ──LMHead──▶ logits [B,T,V] ──logits pipeline──▶ probabilities ──draw──▶ next id
training: hidden [N,D] + W [V,D] + targets ──linear_cross_entropy (chunked, never [N,V])──▶ loss

The public API is re-exported here and nothing else is public. Names are imported lazily (PEP 562) so that
`import lmhead` and the CLI start fast and the optional extras (transformers, FastAPI) load only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "LMHead": "head",
    "linear_cross_entropy": "loss",
    "SamplingConfig": "sampling",
    "process_logits": "sampling",
    "probabilities": "sampling",
    "sample": "sampling",
    "logprobs": "sampling",
    "entropy": "sampling",
    "LogProbs": "sampling",
    "apply_logit_bias": "sampling",
    "apply_penalties": "sampling",
    "apply_temperature": "sampling",
    "apply_top_k": "sampling",
    "apply_top_p": "sampling",
    "apply_min_p": "sampling",
    "load_model": "api",
    "Model": "api",
    "ModelError": "models",
    "Step": "decode.rows",
    "JSONSchema": "constrain",
    "JSONObject": "constrain",
    "Regex": "constrain",
    "Choice": "constrain",
    "Grammar": "constrain",
    "ConstraintError": "constrain",
    "predict": "explain",
    "perplexity": "explain",
    "evaluate": "explain",
    "score_tokens": "explain",
    "Prediction": "explain",
    "Evaluation": "explain",
    "TokenScore": "explain",
    "count_parameters": "params",
    "logits_memory": "params",
    "head_memory": "params",
    "CompressedHead": "compressed",
    "HEAD_MODES": "compressed",
    "use_head": "models.heads",
    "VocabParallelLMHead": "distributed",
    "VocabParallelEmbedding": "distributed",
    "vocab_parallel_cross_entropy": "distributed",
    "vocab_parallel_linear_cross_entropy": "distributed",
    "vocab_parallel_sample": "distributed",
    "vocab_parallel_probabilities": "distributed",
    "gather_vocab_parallel_logits": "distributed",
    "vocab_range": "distributed",
    "init_distributed": "distributed",
    "apply_fused_loss": "integrations.transformers",
    "undo_fused_loss": "integrations.transformers",
    "fused_loss": "integrations.transformers",
    "SamplingLogitsProcessor": "integrations.generation",
    "train_head": "heads.train",
    "ClassificationHead": "heads.classifier",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmhead' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lmhead.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

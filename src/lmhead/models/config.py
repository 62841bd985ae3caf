"""A model's config.json read as plain attributes, without importing transformers' config classes.

    config.json ──json──▶ ModelConfig: cfg.hidden_size, cfg.layer_types, cfg.get_text_config(), cfg.to_dict()

A model loaded straight from its GGUF file (`file_model.py`) keeps the config transformers wrote for it once
(`AutoConfig` on the file, cached beside its tokenizer), so every field has transformers' value and name; what
reads a config (the lean body, `parts.context_length`, the server's model info) reads this one the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig"]


class ModelConfig:
    """Attribute access over a config dict; a missing key reads as None (as transformers' defaults mostly do)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__["_values"] = dict(values)

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls(json.loads(Path(path).read_text()))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._values.get(name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[name] = value

    def get_text_config(self, *args: Any, **kwargs: Any) -> ModelConfig:
        return self

    def standardize_rope_params(self) -> None:
        """Nothing: transformers' rope functions (YaRN's) call it on their config, and a config transformers saved
        holds its rope_parameters in the standard form already."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __repr__(self) -> str:
        return f"ModelConfig(model_type={self.model_type!r}, layers={self.num_hidden_layers})"

"""The calibration text and the hidden states a model gives on it (they choose a compressed head's column
scales and kernel: `lmhead.compressed.CompressedHead(calibration=...)`)."""

from __future__ import annotations

from typing import Any

import torch

# Prose, dialogue, code, numbers, another language: the outlier dimensions of a model's final hidden states
# show up on all of them.
CALIBRATION_TEXT = (
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter. "
    "\"Where are you going?\" she asked. \"To the market,\" he said, \"before the rain comes.\"\n"
    "The capital of France is Paris; the mitochondria is the powerhouse of the cell. In 1969, Apollo 11 "
    "landed on the Moon. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "1, 2, 3, 5, 8, 13, 21 | x = [i ** 2 for i in range(10)] | SELECT name FROM users WHERE id = 42;\n"
    "Le chat est sur la table. Der Hund schläft. El sol brilla. 今日は天気がいいです。"
)


def calibration_hidden(model: Any) -> torch.Tensor | None:
    """The model's final hidden states [T,D] fp32 over CALIBRATION_TEXT (None for objects without a body:
    anything lacking `hidden_states` and `encode`)."""
    if not hasattr(model, "hidden_states") or not hasattr(model, "encode"):
        return None
    ids = torch.tensor([model.encode(CALIBRATION_TEXT)])
    with torch.inference_mode():
        return model.hidden_states(ids)[0].float().clone()

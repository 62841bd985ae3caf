"""Data shipped with lmhead (never downloaded).

`topics.jsonl`: 240 short English sentences in 4 classes (sports, science, business, food; 60 each, the classes
interleaved line by line), one JSON object a line: {"text": ..., "label": ...}. Written for this project and
dedicated to the public domain (CC0 1.0): the classification head's tests and demo train and evaluate on it.
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = ["TOPIC_LABELS", "topics"]

TOPIC_LABELS: tuple[str, ...] = ("sports", "science", "business", "food")


def topics() -> tuple[list[str], list[str]]:
    """(texts, labels) of `topics.jsonl`, in the file's order."""
    texts, labels = [], []
    for line in resources.files(__package__).joinpath("topics.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append(row["text"])
        labels.append(row["label"])
    return texts, labels

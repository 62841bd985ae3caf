"""The tokenizer of a folder lmhead wrote, read straight from its tokenizer.json, and transformers' progress bars
switched off while a model is read — shared by `loading.py` (HF folders) and `file_model.py` (GGUF files)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["fast_tokenizer", "no_progress_bars"]

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token")


def fast_tokenizer(folder: Path):
    """The tokenizer of a cached folder, built straight from tokenizer.json by the Rust `tokenizers` library.

    Equal to `AutoTokenizer.from_pretrained(folder)` (tests/test_models_real.py checks encodings and decodings)
    but seconds faster for Gemma's 262,144-token vocabulary: AutoTokenizer parses the 33 MB tokenizer.json in
    Python twice and rebuilds the vocabulary in GemmaTokenizer.__init__.
    """
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text())
    kwargs = {k: config[k] for k in _SPECIAL_TOKEN_KEYS if isinstance(config.get(k), str)}
    if isinstance(config.get("model_max_length"), int):
        kwargs["model_max_length"] = config["model_max_length"]
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text()
    # tokenizer_file, not tokenizer_object: transformers deep-copies a tokenizer object (another full parse)
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **kwargs)


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    if enabled:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()

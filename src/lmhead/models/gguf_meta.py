"""transformers' GGUF reading of a file's config and tokenizer, with the file's header read once by lmhead.

    with header_reader():            # inside: gguf.GGUFReader is `MetadataReader`, and transformers'
        AutoConfig.from_pretrained(folder, gguf_file=name)       # own `read_gguf_metadata` reads the same
        AutoTokenizer.from_pretrained(folder, gguf_file=name)    # parsed header

transformers' loader (`load_gguf_checkpoint`) opens the file with gguf-py's `GGUFReader` for every object it
builds, and that reader makes a numpy view of every part of every field — for Gemma 3's 262,144-token vocabulary
(its tokens, scores, types and merges) most of the first run's time, paid again per object, and then parses each
part into a Python value one call at a time; its tokenizer reads the vocabulary once more with its own reader
(`read_gguf_metadata`, a struct call per string). `MetadataReader` holds what transformers reads when it asks
for no tensors (each field's parts, data indices and types, and the tensors' names), parsed once per file by
`gguf_file.Header` into the values transformers would make of them, and kept for the block; an array of more
than one element is one part holding the whole list, which transformers' loop over the parts returns as that
list (its rule: a single parsed value is the field's value). transformers then maps fields, builds the config
and converts the tokenizer exactly as it does from its readers (tests/test_gguf_file.py compares the two on
every architecture's file).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Container, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lmhead.models.gguf_file import Header

__all__ = ["MetadataReader", "header_reader", "read_metadata", "gpt_oss_config"]


class _Parsed:
    """A value already parsed (what transformers' `_gguf_parse_value` would make of gguf-py's part)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _python(kind: int, value: Any) -> Any:
    """A metadata value as transformers' `_gguf_parse_value` returns it: strings decoded, bools as bool."""
    if kind == 8:
        return value.decode("utf-8")
    if kind == 7:
        return bool(value)
    return value


class _Field:
    """One metadata field as gguf-py's `ReaderField`: `parts[i]` for each index `i` of `data` is one value
    (`_Parsed`, which the block's `_gguf_parse_value` returns as it is); an array of two or more elements is a
    single part holding the list."""

    __slots__ = ("data", "name", "parts", "types")

    def __init__(self, name: str, types: list[int], value: Any) -> None:
        self.name, self.types = name, types
        if types[0] != 9:
            self.parts = [_Parsed(_python(types[0], value))]
        elif len(value) < 2:  # [] is no value and [x] is x to transformers: one part per element keeps that
            self.parts = [_Parsed(_python(types[1], v)) for v in value]
        else:
            self.parts = [_Parsed(_python_list(types[1], value))]
        self.data = range(len(self.parts))


def _python_list(kind: int, values: list[Any]) -> list[Any]:
    if kind == 8:
        return [v.decode("utf-8") for v in values]
    return [bool(v) for v in values] if kind == 7 else values


class _ParsedFile:
    """A file's header parsed once: `Header(arrays=True)` and the `_Field`s made of it."""

    def __init__(self, path: Path) -> None:
        head = Header(path, arrays=True)
        self.head = head
        # gguf-py's reader lists the header's own numbers first, as fields (transformers ignores them)
        self.fields = {"GGUF.version": _Field("GGUF.version", [4], head.version),
                       "GGUF.tensor_count": _Field("GGUF.tensor_count", [10], head.n_tensors),
                       "GGUF.kv_count": _Field("GGUF.kv_count", [10], head.n_kv)}
        self.fields.update((name, _Field(name, head.types[name], value)) for name, value in head.fields.items())
        self.tensors = [SimpleNamespace(name=t[0]) for t in head.tensors]


_cache: dict[tuple[str, int, int], _ParsedFile] = {}


def _parsed(path: str | Path) -> _ParsedFile:
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _cache:
        _cache[key] = _ParsedFile(path)
    return _cache[key]


# fields transformers' reader misreads: its gpt-oss branch takes `field.parts[0]` (in gguf-py's reader the key's
# length, not the value: float() of it is the TypeError "only 0-dimensional arrays can be converted to Python
# scalars"). Hidden from it; `gpt_oss_config` reads them instead.
_MISREAD = ("gpt-oss.rope.scaling.",)


class MetadataReader:
    """The fields and tensor names of a GGUF file, as transformers reads them from gguf-py's `GGUFReader` (less
    the fields it misreads, `_MISREAD`)."""

    def __init__(self, path: str | Path, mode: str = "r") -> None:
        parsed = _parsed(path)
        self.fields = {k: v for k, v in parsed.fields.items() if not k.startswith(_MISREAD)}
        self.tensors = parsed.tensors


# llama.cpp's rope scaling keys ({arch}.rope.scaling.*) → transformers' rope_parameters
_ROPE_KEYS = {"type": "rope_type", "factor": "factor", "original_context_length": "original_max_position_embeddings",
              "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


def gpt_oss_config(path: str | Path, config: Any) -> None:
    """Complete a gpt-oss config with what transformers' GGUF reader leaves out, from the file's header: its
    `head_dim` (gpt-oss.attention.key_length; the reader keeps GptOssConfig's 64), `sliding_window`
    (gpt-oss.attention.sliding_window; the reader looks for gpt-oss.sliding_window and keeps 128) and
    `rope_parameters`
    (transformers' names) — the YaRN keys llama.cpp's converter writes (type, factor, original context, β fast
    and slow), the rope base, and `truncate` False (gpt-oss's own config: its correction range is not rounded).
    Other models: unchanged."""
    if getattr(config, "model_type", None) != "gpt_oss":
        return
    fields = Header(Path(path)).fields
    for key, name in (("gpt-oss.attention.key_length", "head_dim"), ("gpt-oss.attention.sliding_window",
                                                                     "sliding_window")):
        if isinstance(fields.get(key), int):
            setattr(config, name, fields[key])
    prefix = "gpt-oss.rope.scaling."
    params: dict[str, Any] = {"rope_theta": float(fields.get("gpt-oss.rope.freq_base", 150000.0))}
    for key, value in fields.items():
        if key.startswith(prefix) and key[len(prefix):] in _ROPE_KEYS:
            name = _ROPE_KEYS[key[len(prefix):]]
            params[name] = value.decode() if isinstance(value, bytes) else value
    if params.get("rope_type", "none") in ("none", None):
        params["rope_type"] = "default"
    elif params["rope_type"] == "yarn":
        params["truncate"] = False
        params["original_max_position_embeddings"] = int(params.get("original_max_position_embeddings", 4096))
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            if name in params:
                params[name] = float(params[name])
    config.rope_parameters = params


def read_metadata(path: str | Path, string_arrays: Container[str] = ()) -> tuple[dict[str, Any], tuple[str, ...]]:
    """transformers' `read_gguf_metadata`: (metadata, tensor names) — values as Python values, number arrays as
    lists, string arrays as lists for the keys in `string_arrays` and as their lengths for the others."""
    parsed = _parsed(path)
    metadata: dict[str, Any] = {}
    for name, field in parsed.fields.items():
        if name.startswith("GGUF."):
            continue
        if field.types[0] != 9:
            metadata[name] = field.parts[0].value
        elif field.types[1] == 8 and name not in string_arrays:
            metadata[name] = len(parsed.head.fields[name])
        else:  # a copy: the caller may change its lists, the block's later readers must not see it
            metadata[name] = list(field.parts[0].value) if len(parsed.head.fields[name]) > 1 \
                else [p.value for p in field.parts]
    if "general.architecture" not in metadata:
        raise ValueError(f"{path} has no `general.architecture` in its metadata.")
    return metadata, tuple(t.name for t in parsed.tensors)


@contextlib.contextmanager
def header_reader() -> Iterator[None]:
    """gguf-py's `GGUFReader` is `MetadataReader` and transformers' `read_gguf_metadata` is `read_metadata`
    inside the block (each file's header parsed once), and both restored after; for reading config and
    tokenizer only (neither holds tensor data)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    original, parse = gguf.GGUFReader, loader._gguf_parse_value
    # transformers 5 reads metadata with its own reader too (the package and the module it lives in)
    readers = []
    for module in ("transformers.integrations.gguf", "transformers.integrations.gguf.reader"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, "read_gguf_metadata"):
            readers.append((mod, mod.__dict__.get("read_gguf_metadata", _ABSENT)))

    def parse_value(value: Any, types: Any) -> Any:
        if type(value) is not _Parsed:
            return parse(value, types)
        return list(value.value) if type(value.value) is list else value.value  # each caller its own list

    gguf.GGUFReader, loader._gguf_parse_value = MetadataReader, parse_value
    for mod, _ in readers:
        mod.read_gguf_metadata = read_metadata
    try:
        yield
    finally:
        gguf.GGUFReader, loader._gguf_parse_value = original, parse
        for mod, before in readers:
            if before is _ABSENT:  # a lazy module's attribute, made on first use
                del mod.read_gguf_metadata
            else:
                mod.read_gguf_metadata = before
        _cache.clear()


_ABSENT = object()

"""transformers' GGUF reading of a file's config and tokenizer, with the file's header read once by lmhead.

    with header_reader():            # inside: gguf.GGUFReader is `MetadataReader`
        AutoConfig.from_pretrained(folder, gguf_file=name)
        AutoTokenizer.from_pretrained(folder, gguf_file=name)

transformers' loader (`load_gguf_checkpoint`) opens the file with gguf-py's `GGUFReader` for every object it
builds, and that reader makes a numpy view of every part of every field — for Gemma 3's 262,144-token vocabulary
(its tokens, scores, types and merges) most of the first run's time, paid again per object, and then parses each
part into a Python value one call at a time. `MetadataReader` holds what transformers reads when it asks for no
tensors (each field's parts, data indices and types as gguf-py lays them out, and the tensors' names), parsed
once per file by `gguf_file.Header` into the values transformers would make of them, and kept for the block.
transformers then maps fields, builds the config and converts the tokenizer exactly as it does from gguf-py's
reader (tests/test_gguf_file.py compares the two on every architecture's file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lmhead.models.gguf_file import Header

__all__ = ["MetadataReader", "header_reader"]


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
    (`_Parsed`, which the block's `_gguf_parse_value` returns as it is)."""

    __slots__ = ("data", "name", "parts", "types")

    def __init__(self, name: str, types: list[int], value: Any) -> None:
        self.name, self.types = name, types
        if types[0] == 9:  # an array: one part per element
            self.parts = [_Parsed(_python(types[1], v)) for v in value]
        else:
            self.parts = [_Parsed(_python(types[0], value))]
        self.data = range(len(self.parts))


class MetadataReader:
    """The fields and tensor names of a GGUF file, as transformers reads them from gguf-py's `GGUFReader`."""

    _cache: dict[tuple[str, int, int], tuple[dict[str, _Field], list[Any]]] = {}

    def __init__(self, path: str | Path, mode: str = "r") -> None:
        path = Path(path)
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in self._cache:
            head = Header(path, arrays=True)
            # gguf-py's reader lists the header's own numbers first, as fields (transformers ignores them)
            fields = {"GGUF.version": _Field("GGUF.version", [4], head.version),
                      "GGUF.tensor_count": _Field("GGUF.tensor_count", [10], head.n_tensors),
                      "GGUF.kv_count": _Field("GGUF.kv_count", [10], head.n_kv)}
            fields.update((name, _Field(name, head.types[name], value)) for name, value in head.fields.items())
            tensors = [SimpleNamespace(name=t[0]) for t in head.tensors]
            self._cache[key] = (fields, tensors)
        self.fields, self.tensors = self._cache[key]


@contextlib.contextmanager
def header_reader() -> Iterator[None]:
    """gguf-py's `GGUFReader` is `MetadataReader` inside the block (each file's header parsed once), and restored
    after; for reading config and tokenizer only (`MetadataReader` holds no tensor data)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader

    original, parse = gguf.GGUFReader, loader._gguf_parse_value

    def parse_value(value: Any, types: Any) -> Any:
        return value.value if type(value) is _Parsed else parse(value, types)

    gguf.GGUFReader, loader._gguf_parse_value = MetadataReader, parse_value
    try:
        yield
    finally:
        gguf.GGUFReader, loader._gguf_parse_value = original, parse
        MetadataReader._cache.clear()

"""A transformers fast tokenizer's encode and decode without transformers, and for a large BPE vocabulary
without parsing it: the prompt is encoded by `tokenizers` over the part of the vocabulary the prompt can reach,
ids are decoded from the vocabulary's table, and transformers' tokenizer is built (from tokenizer.json, as
before) only when anything else is asked of it.

    tokenizer (transformers', once per cached model) ──tables_of──▶ the start tables, with the special ids,
        chat template and flags transformers gives ──▶ <cache>/tokenizer/<model sha>-<suffix>.safetensors (with
        its checksum; rebuilt when it does not match)
    "reach" (Gemma 3's 262,144 pieces): pieces [V], merges as ids [M] × (left, right, result) in rank order, the
        pipeline without its vocabulary
        prompt ──normalizer──▶ every substring (up to the longest piece) that is a piece ──▶ those pieces + the
            merges whose result is one of them, in their order ──tokenizers' BPE on the pipeline──▶ ids
        ids ──pieces (special tokens skipped when asked)──▶ tokenizers' decoder ──▶ text
    "whole" (any other: SmolLM2's and Llama 3's byte-level BPE): the tokenizer JSON transformers runs, read by
        `tokenizers` alone (what transformers' fast tokenizer calls to encode and decode)

Why "reach" gives the full tokenizer's ids: BPE starts a word from its characters' pieces (or their
byte-fallback pieces) and repeatedly merges the adjacent pair of lowest rank that has a merge. Every merge that
can apply to a word makes a substring of it, so the merges kept (those whose result is a substring of the
normalized prompt) are all it can use, and keeping their order keeps every choice. That holds where a word is a
substring of the normalized prompt: a normalizer that replaces single characters, a pre-tokenizer that splits
on literal strings (Gemma's). `tables_of` makes no tables whose encodings and decodings of test texts differ
from transformers' (transformers' tokenizer is used then, as before).

Why: tokenizers rebuilds a vocabulary and its merges on every start (Gemma 3's 262,144 pieces and 514,906
merges are most of its start), and transformers' import is needed only for the tokenizer's other methods.
"""

from __future__ import annotations

import json
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CHECK_TEXTS", "LazyTokenizer", "TablesPlan", "TokenizerTables", "read_tables", "start_tokenizer",
           "tables_from", "tables_of", "tables_path", "tables_plan", "transformers_tokenizer", "write_tables"]

_SUFFIX = "start-tables-v2"
_MIN_PIECES = 100_000  # smaller vocabularies parse quickly: their tables are "whole"
_MAX_PROMPT_CHARS = 50_000  # past this the substring scan costs more than the full parse
# texts a tokenizer read back from the cache must encode as the one it was made from (file_model uses the first)
CHECK_TEXTS = ("The cat sat on the mat. 12345 ünïcödé — \n\t  spaces; <b>tags</b> and emoji 🙂",
               "  leading spaces\n\n\nnew lines\r\n日本語のテキスト、중국어, العربية ",)
_FACTS = ("pad_token_id", "eos_token_id", "bos_token_id", "unk_token_id", "all_special_ids", "chat_template",
          "vocab_size", "clean_up_tokenization_spaces")


class TokenizerTables:
    """What encoding a prompt and decoding ids need of a transformers fast tokenizer, without transformers.

    Two kinds. "reach" (a large BPE vocabulary whose words are substrings of the normalized text): pieces, the
    model's vocabulary by id [V]; merges, int32 [M, 3] (left id, right id, result id) in rank order; skeleton, the
    tokenizer's JSON with only its added tokens as vocabulary and no merges. "whole" (any other): pieces and
    merges None, skeleton the whole tokenizer JSON transformers' tokenizer runs (`backend_tokenizer`), which
    `tokenizers` encodes and decodes as transformers would. facts: transformers' special ids, chat template and
    flags (`_FACTS`), taken when the tables were made.
    """

    def __init__(self, pieces: list[str] | None, merges: np.ndarray | None, skeleton: str,
                 facts: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.pieces, self.merges, self.skeleton, self.facts = pieces, merges, skeleton, facts
        self._pipeline = Tokenizer.from_str(skeleton)
        self._lock = threading.Lock()  # encode swaps the pipeline's model: one call at a time
        self._ids = self._pipeline.get_vocab_size(with_added_tokens=True)
        if pieces is None:
            return
        spec = json.loads(skeleton)
        self._options = {k: v for k, v in spec["model"].items()
                         if k not in ("type", "vocab", "merges") and v is not None}
        self._index: dict[str, int] | None = None
        self._special = {int(a["id"]) for a in spec.get("added_tokens", []) if a.get("special")}
        # pieces every encode keeps: the added tokens (the pipeline found their ids), the byte-fallback pieces
        self._always = [int(a["id"]) for a in spec.get("added_tokens", [])]
        self._always += [i for i in (self._id(f"<0x{b:02X}>") for b in range(256)) if i is not None]
        unk = spec["model"].get("unk_token")
        if unk is not None and self._id(unk) is not None:
            self._always.append(self._id(unk))
        self._longest = max(map(len, pieces))
        self._ids = len(pieces)

    @property
    def kind(self) -> str:
        return "whole" if self.pieces is None else "reach"

    def _id(self, piece: str) -> int | None:
        return self.index.get(piece)

    @property
    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = dict(zip(self.pieces, range(len(self.pieces)), strict=True))
        return self._index

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int] | None:
        """The ids of `text` as the full tokenizer encodes it; None when the text is too long for the scan."""
        if self.pieces is None:
            return list(self._pipeline.encode(text, add_special_tokens=add_special_tokens).ids)
        norm = self._pipeline.normalizer.normalize_str(text) if self._pipeline.normalizer is not None else text
        if len(norm) > _MAX_PROMPT_CHARS:
            return None
        get, n, longest = self.index.get, len(norm), self._longest
        reached = set(self._always)
        for i in range(n):
            for j in range(i + 1, min(n, i + longest) + 1):
                k = get(norm[i:j])
                if k is not None:
                    reached.add(k)
        # the merges whose result was reached, by a mask over the ids: np.isin would sort a copy of every merge's
        # result (megabytes for a large vocabulary, left resident on the heap for the rest of the run)
        ids = np.fromiter(reached, np.int64, len(reached))
        mask = np.zeros(max(self._ids, int(ids.max()) + 1 if ids.size else 0), dtype=bool)
        mask[ids] = True
        keep = np.flatnonzero(mask[self.merges[:, 2]])
        pieces = self.pieces
        merges = [(pieces[a], pieces[b]) for a, b in self.merges[keep, :2].tolist()]
        vocab = {pieces[k]: k for k in reached}
        from tokenizers.models import BPE

        model = BPE(vocab, merges, **self._options)
        with self._lock:
            self._pipeline.model = model
            return list(self._pipeline.encode(text, add_special_tokens=add_special_tokens).ids)

    def token(self, i: int) -> str | None:
        """The piece of id `i` (as `tokenizers.Tokenizer.id_to_token`: None past the vocabulary)."""
        if self.pieces is None:
            return self._pipeline.id_to_token(i)
        return self.pieces[i] if i < len(self.pieces) else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str | None:
        """`ids` as text, as `tokenizers.Tokenizer.decode` gives it (the ids' pieces, special tokens left out when
        asked, through the decoder); None for an id outside the vocabulary."""
        if any(type(i) is not int or not 0 <= i < self._ids for i in ids):
            return None
        if self.pieces is None:
            return self._pipeline.decode(ids, skip_special_tokens=skip_special_tokens)
        tokens = []
        for i in ids:
            if skip_special_tokens and i in self._special:
                continue
            tokens.append(self.pieces[i])  # an added token is the piece of its id (`tables_of` checks it)
        decoder = self._pipeline.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)


@dataclass
class TablesPlan:
    """What the tables need of a transformers fast tokenizer, taken while it is alive, so that the tables can be
    made after it is released (`tables_from`): its facts (`_FACTS`), its pipeline's JSON, and its encodings and
    decodings of CHECK_TEXTS, which the tables must give back."""

    facts: dict[str, Any]
    spec: str
    answers: list[Any]


def tables_plan(tokenizer: Any) -> TablesPlan | None:
    """The plan of `tokenizer`'s tables, or None for a slow (Python) tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    facts = {k: getattr(tokenizer, k, None) for k in _FACTS} | {"len": len(tokenizer)}
    answers = []
    for text in CHECK_TEXTS:
        ids = tokenizer.encode(text)
        answers.append((ids, tokenizer.encode(text, add_special_tokens=False),
                        *(tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                          for skip in (False, True))))
    return TablesPlan(facts, backend.to_str(), answers)


def tables_from(plan: TablesPlan) -> TokenizerTables | None:
    """The tables of a plan ("reach" where the module's docstring says it is exact and the vocabulary is large,
    else "whole"), or None where they do not encode and decode the test texts as the tokenizer did. A large
    vocabulary's parsed JSON is a few hundred MB of objects: made from a plan, they are not held beside the
    tokenizer."""
    spec = json.loads(plan.spec)
    spec["truncation"] = spec["padding"] = None  # transformers turns both off for a call that asks for neither
    tables = _reach(spec, plan.facts) or TokenizerTables(None, None, json.dumps(spec, ensure_ascii=False),
                                                         plan.facts)
    del spec
    return tables if _answers(tables) == plan.answers else None


def tables_of(tokenizer: Any) -> TokenizerTables | None:
    """The tables of a transformers fast tokenizer (`tables_from` its plan), or None (a slow tokenizer, or tables
    that do not encode and decode the test texts as it does)."""
    plan = tables_plan(tokenizer)
    return None if plan is None else tables_from(plan)


def _reach(spec: dict[str, Any], facts: dict[str, Any]) -> TokenizerTables | None:
    model = spec.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    if model.get("type") != "BPE" or len(vocab) < _MIN_PIECES:
        return None
    if model.get("dropout") is not None or not _literal(spec):
        return None
    if sorted(vocab.values()) != list(range(len(vocab))):
        return None
    pieces = [""] * len(vocab)
    for piece, i in vocab.items():
        pieces[i] = piece
    if any("\0" in piece for piece in pieces):
        return None  # the pieces are stored NUL-separated
    added = spec.get("added_tokens") or []
    if any(vocab.get(a["content"]) != a["id"] for a in added):
        return None  # an added token outside the model's vocabulary would be found as a piece here
    pairs = model.get("merges") or []
    if any(isinstance(m, str) for m in pairs):  # tokenizers' older format: "left right"
        pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in pairs]
    lefts, rights = list(map(itemgetter(0), pairs)), list(map(itemgetter(1), pairs))
    merges = np.empty((len(pairs), 3), dtype=np.int32)
    try:  # a piece's id by C-level maps over the [M] merges (a Python loop over Gemma's is most of this step)
        for column, strings in enumerate((lefts, rights, map(operator.add, lefts, rights))):
            merges[:, column] = np.fromiter(map(vocab.__getitem__, strings), dtype=np.int32, count=len(pairs))
    except KeyError:
        return None
    skeleton = dict(spec, model=dict(model, vocab={a["content"]: a["id"] for a in added}, merges=[]))
    return TokenizerTables(pieces, merges, json.dumps(skeleton, ensure_ascii=False), facts)


def _literal(spec: dict[str, Any]) -> bool:
    """Whether every word the pre-tokenizer makes is a substring of the normalized text."""
    def steps(part: Any, key: str) -> list[Any]:
        if part is None:
            return []
        return [s for p in part[key] for s in steps(p, key)] if part.get("type") == "Sequence" else [part]

    def single_char(p: dict[str, Any]) -> bool:
        pattern = p.get("pattern") or {}
        return p.get("type") == "Replace" and len(pattern.get("String", "")) == 1
    normalizers = steps(spec.get("normalizer"), "normalizers")
    pre = steps(spec.get("pre_tokenizer"), "pretokenizers")
    return (all(single_char(p) for p in normalizers)
            and all(p.get("type") == "Split" and "String" in (p.get("pattern") or {}) and not p.get("invert")
                    for p in pre))


def _answers(tables: TokenizerTables) -> list[Any]:
    """The tables' encodings and decodings of CHECK_TEXTS, as `tables_plan` takes them of the tokenizer."""
    out = []
    for text in CHECK_TEXTS:
        ids = tables.encode(text)
        out.append((ids, tables.encode(text, False), *(tables.decode(ids or [], skip) for skip in (False, True))))
    return out


def write_tables(path: Path, tables: TokenizerTables) -> bool:
    """Write the tables to `path` (safetensors with its checksum, renamed into place); False when not writable."""
    import torch

    from lmhead.models import cache

    state = {"skeleton": _bytes(tables.skeleton), "facts": _bytes(json.dumps(tables.facts))}
    if tables.pieces is not None:
        state["pieces"] = _bytes("\0".join(tables.pieces))
        state["merges"] = torch.from_numpy(np.ascontiguousarray(tables.merges))
    return cache.write_tensors(path, state)


def read_tables(path: Path) -> TokenizerTables | None:
    """The tables at `path`, or None when missing, damaged (checksum) or unreadable."""
    from lmhead.models import cache

    got = cache.read_tensors(path)
    if got is None:
        return None
    state, _ = got
    try:
        text = {k: state[k].numpy().tobytes().decode("utf-8") for k in ("pieces", "skeleton", "facts") if k in state}
        pieces = text["pieces"].split("\0") if "pieces" in text else None
        merges = state["merges"].numpy() if pieces is not None else None
        return TokenizerTables(pieces, merges, text["skeleton"], json.loads(text["facts"]))
    except Exception:  # a missing entry, bad UTF-8 or JSON, or a pipeline tokenizers cannot read
        return None


def tables_path(folder: Path) -> Path | None:
    """Where the tables of a cached model folder live (None for a folder outside the cache)."""
    from lmhead.models import cache

    return cache.derived_path(folder, "tokenizer", _SUFFIX)


def start_tokenizer(folder: Path, build: Callable[[], Any], built: Any = None) -> Any:
    """The tokenizer of a cached model folder: a `LazyTokenizer` over its tables when they are there and
    intact; else the tables are made from transformers' tokenizer (`built`, or `build()`) and written, and the
    `LazyTokenizer` over them is returned as a later start's would be (transformers' tokenizer — a large
    vocabulary's hundreds of MB — not held meanwhile; `full` builds it again where asked); transformers' own
    where no tables could be made or written. `built` may also be tables already made and checked (the first
    read of a GGUF file makes them before its tokenizer is released: `file_model`), which are written."""
    path = tables_path(folder)
    if built is None and path is not None and (tables := read_tables(path)) is not None:
        return LazyTokenizer(tables, build)
    if isinstance(built, TokenizerTables):  # made by the first read of a file (file_model), checked there
        if path is not None and write_tables(path, built):
            _remove_earlier(path)
        return LazyTokenizer(built, build)
    tokenizer = build() if built is None else built
    del built
    if path is not None and (tables := tables_of(tokenizer)) is not None and write_tables(path, tables):
        _remove_earlier(path)
        return LazyTokenizer(tables, build)
    return tokenizer


def _remove_earlier(path: Path) -> None:
    for old in path.parent.glob(path.name.replace(_SUFFIX, "start-tables-*")):
        if old != path:  # an earlier format's tables of the same model
            old.unlink(missing_ok=True)


def _bytes(text: str):
    import torch

    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


class LazyTokenizer:
    """A transformers tokenizer that is built on first need: `encode`, `decode`, `convert_ids_to_tokens` and the
    special ids answer from the tables; anything else (calling it, chat templates, offsets, ...) builds
    transformers' tokenizer once and asks it (`full`). Setting `pad_token_id` is kept and passed on when it is
    built.
    """

    def __init__(self, tables: TokenizerTables, build: Callable[[], Any]) -> None:
        object.__setattr__(self, "_tables", tables)
        object.__setattr__(self, "_build", build)
        object.__setattr__(self, "_full", None)
        object.__setattr__(self, "_pad", None)

    @property
    def full(self) -> Any:
        """transformers' tokenizer (built now if it was not yet)."""
        if self._full is None:
            full = self._build()
            if self._pad is not None:
                full.pad_token_id = self._pad
            object.__setattr__(self, "_full", full)
        return self._full

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if self._full is None and not kwargs and isinstance(text, str) and isinstance(add_special_tokens, bool):
            ids = self._tables.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        return self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        clean = clean_up_tokenization_spaces
        clean = self._tables.facts.get("clean_up_tokenization_spaces") if clean is None else clean
        if not kwargs and clean is False and isinstance(skip_special_tokens, bool):
            ids = [token_ids] if type(token_ids) is int else token_ids
            if isinstance(ids, (list, tuple)):
                text = self._tables.decode(list(ids), skip_special_tokens)
                if text is not None:
                    return text
        return self.full.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        one = type(ids) is int
        seq = [ids] if one else ids
        settled = self._full is None and (self._pad is None or not skip_special_tokens)
        if settled and isinstance(seq, (list, tuple)) and all(type(i) is int and i >= 0 for i in seq):
            skip = set(self._tables.facts.get("all_special_ids") or []) if skip_special_tokens and not one else set()
            tokens = [self._tables.token(i) for i in seq if i not in skip]
            return tokens[0] if one else tokens
        return self.full.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    @property
    def pad_token_id(self) -> int | None:
        if self._full is not None:
            return self._full.pad_token_id
        return self._pad if self._pad is not None else self._tables.facts.get("pad_token_id")

    @pad_token_id.setter
    def pad_token_id(self, value: int | None) -> None:
        if self._full is not None:
            self._full.pad_token_id = value
        else:
            object.__setattr__(self, "_pad", value)

    def __getattr__(self, name: str) -> Any:
        facts = self._tables.facts
        # a pad token set here becomes one of transformers' special tokens: from then on, transformers answers
        if self._full is None and self._pad is None and name in facts and name != "clean_up_tokenization_spaces":
            return facts[name]
        # a file without a pad token gets the end token as its pad (models/model.py): a pad that is already
        # special adds no id and, with no pad before it, drops none, so the list is transformers' own unbuilt
        if (self._full is None and name == "all_special_ids" and facts.get("pad_token_id") is None
                and self._pad in (facts.get(name) or ())):
            return facts[name]
        return getattr(self.full, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "pad_token_id":
            LazyTokenizer.pad_token_id.fset(self, value)
        else:
            setattr(self.full, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full(*args, **kwargs)

    def __len__(self) -> int:
        return int(self._tables.facts["len"]) if self._full is None else len(self._full)

    def __repr__(self) -> str:
        return f"LazyTokenizer({'built' if self._full is not None else 'not built'}: {len(self._tables.pieces)} pieces)"


def transformers_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer behind `tokenizer` (a LazyTokenizer builds it now, once), or `tokenizer` itself."""
    return tokenizer.full if isinstance(tokenizer, LazyTokenizer) else tokenizer

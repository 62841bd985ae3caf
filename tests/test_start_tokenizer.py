"""The start tables of a large BPE tokenizer (models/start_tokenizer.py) against transformers' tokenizer of the
same cached folder: every encoding and decoding equal, the tables checked on load, transformers' tokenizer built
only when something else is asked of it. Marked `model`: Gemma 3's real 262,144-piece tokenizer."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmhead import load_model
from lmhead.generate import generate
from lmhead.models.hf_tokenizer import fast_tokenizer
from lmhead.models.start_tokenizer import (
    LazyTokenizer,
    TokenizerTables,
    read_tables,
    start_tokenizer,
    tables_from,
    tables_of,
    tables_path,
    tables_plan,
    write_tables,
)
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.model

TEXTS = ["", " ", "a", "The cat sat on the", "  two  spaces   three\t\ttabs\n\n\nlines\r\n",
         "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos><bos>text<eos>",
         "<b>bold</b> <h1>title</h1>", "ünïcödé — “quotes” 日本語のテキスト 중국어 العربية 🙂🙃👍🏽",
         "\x00\x01\x7f\u200b\ufeff control characters", "▁already▁a▁piece", "12345 3.14159 0xDEADBEEF",
         "def f(x):\n    return x ** 2  # comment\n", "https://example.org/path?q=1&r=two#frag",
         "a" * 300, "🙂" * 40, "Pneumonoultramicroscopicsilicovolcanoconiosis"]
PIECES = ["the", " ", "  ", "\n", "\t", "ü", "日本", "🙂", "<start_of_turn>", "<b>", "</b>", "<eos>", "1", "23",
          "é", "\u200b", "\x01", "▁", "ing", "Ġ", "<0x41>", "<unused5>", ".", "'s"]


@pytest.fixture(scope="module")
def gemma():
    model = load_model("gemma-3-270m")
    full = fast_tokenizer(model.path)
    tables = tables_of(full)
    assert tables is not None and tables.kind == "reach"
    return model, full, tables


@pytest.fixture(scope="module", params=["gemma-3-270m", "smollm2-135m"])
def both(request):
    model = load_model(request.param)
    full = fast_tokenizer(model.path)
    tables = tables_of(full)
    assert tables is not None and tables.kind == ("reach" if request.param == "gemma-3-270m" else "whole")
    return model, full, tables


def test_the_tables_encode_every_text_as_transformers_tokenizer_does(both):
    _, full, tables = both
    for text in TEXTS:
        for special in (True, False):
            assert tables.encode(text, special) == full.encode(text, add_special_tokens=special), text


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=30))
def test_the_tables_encode_random_text_as_transformers_tokenizer_does(both, parts):
    _, full, tables = both
    text = "".join(parts)
    assert tables.encode(text) == full.encode(text)


def test_the_tables_decode_ids_as_transformers_tokenizer_does(both):
    _, full, tables = both
    rng = random.Random(0)
    specials = list(full.all_special_ids) + [1, 2, 105, 106]
    for _ in range(300):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(len(full))
               for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert tables.decode(ids, skip) == full.decode(ids, skip_special_tokens=skip,
                                                            clean_up_tokenization_spaces=False), ids
    assert tables.decode([len(full)]) is None and tables.decode([-1]) is None


def test_a_lazy_tokenizer_names_tokens_as_transformers_tokenizer_does(both):
    model, full, tables = both
    lazy = LazyTokenizer(tables, lambda: fast_tokenizer(model.path))
    rng = random.Random(1)
    ids = [rng.randrange(len(full)) for _ in range(200)] + list(full.all_special_ids) + [len(full) + 5]
    for skip in (False, True):
        assert lazy.convert_ids_to_tokens(ids, skip_special_tokens=skip) == full.convert_ids_to_tokens(
            ids, skip_special_tokens=skip)
    assert [lazy.convert_ids_to_tokens(i) for i in ids] == [full.convert_ids_to_tokens(i) for i in ids]
    assert lazy._full is None


def test_a_lazy_tokenizer_encodes_decodes_and_names_its_special_ids_without_building(both):
    model, full, tables = both
    builds = []
    lazy = LazyTokenizer(tables, lambda: builds.append(1) or fast_tokenizer(model.path))
    ids = lazy.encode("The cat sat on the mat")
    assert ids == full.encode("The cat sat on the mat")
    assert lazy.decode(ids, skip_special_tokens=True) == full.decode(ids, skip_special_tokens=True)
    assert lazy.decode(ids[1]) == full.decode(ids[1])
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "vocab_size",
                 "chat_template"):
        assert getattr(lazy, name) == getattr(full, name), name
    assert len(lazy) == len(full)
    assert not builds
    # anything else: transformers' tokenizer, built once
    assert lazy("The cat")["input_ids"] == full("The cat")["input_ids"]
    assert lazy.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    assert lazy.encode("x", return_tensors="pt").tolist() == [full.encode("x")]
    assert builds == [1]


def test_a_pad_token_set_before_the_build_is_passed_on(gemma):
    model, _, tables = gemma
    lazy = LazyTokenizer(tables, lambda: fast_tokenizer(model.path))
    lazy.pad_token_id = 1
    assert lazy.pad_token_id == 1 and lazy._full is None
    assert lazy.all_special_ids == lazy.full.all_special_ids  # the file's pad (0) no longer special: built
    assert lazy.full.pad_token_id == 1


def test_a_file_without_a_pad_token_names_its_special_ids_unbuilt_with_the_end_token_as_pad(gemma):
    model = gemma[0]

    def without_pad():
        full = fast_tokenizer(model.path)
        full.pad_token = None
        return full

    tables = tables_of(without_pad())
    assert tables.facts["pad_token_id"] is None
    builds = []
    lazy = LazyTokenizer(tables, lambda: builds.append(1) or without_pad())
    lazy.pad_token_id = 1  # the end token, as models/model.py sets it for such a file
    special = lazy.all_special_ids
    assert not builds
    assert special == lazy.full.all_special_ids and lazy.full.pad_token_id == 1
    lazy = LazyTokenizer(tables, without_pad)
    lazy.pad_token_id = 7  # not a special token: transformers' list answers
    assert lazy.all_special_ids == lazy.full.all_special_ids and lazy._full is not None


def test_the_tables_are_checked_on_load_and_rebuilt_when_damaged(gemma, tmp_path):
    model, full, tables = gemma
    folder = tmp_path / "meta" / "m"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"weights_sha256": "ab" * 16}))
    built = []
    build = lambda: built.append(1) or full  # noqa: E731
    path = tables_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    earlier = path.with_name(path.name.replace("start-tables-v2", "start-tables-v1"))
    earlier.write_bytes(b"an earlier format")
    first = start_tokenizer(folder, build)  # none yet: made from transformers' and written, as a later start's
    assert isinstance(first, LazyTokenizer) and first._full is None and built == [1]
    assert not earlier.exists()
    again = read_tables(path)
    assert again.pieces == tables.pieces and (again.merges == tables.merges).all() and again.facts == tables.facts
    lazy = start_tokenizer(folder, build)
    assert isinstance(lazy, LazyTokenizer) and built == [1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert read_tables(path) is None
    assert isinstance(start_tokenizer(folder, build), LazyTokenizer) and built == [1, 1]  # rebuilt, written again
    assert read_tables(path) is not None
    path.write_bytes(path.read_bytes()[:4096])
    assert read_tables(path) is None
    assert write_tables(path, tables) and read_tables(path) is not None


def test_tables_made_from_a_plan_after_the_tokenizer_is_gone_are_its_tables(both):
    _, full, tables = both
    plan = tables_plan(full)
    made = tables_from(plan)
    assert made is not None and made.kind == tables.kind and made.facts == tables.facts
    assert made.pieces == tables.pieces and made.skeleton == tables.skeleton
    plan.answers[0] = (plan.answers[0][0][:-1], *plan.answers[0][1:])  # a tokenizer they would not agree with
    assert tables_from(plan) is None


def test_a_tokenizer_without_a_backend_gets_no_tables():
    class Slow:
        pass

    assert tables_of(Slow()) is None


@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_a_cached_model_generates_the_same_tokens_without_building_transformers_tokenizer(name):
    first = load_model(name)
    again = load_model(name)  # the tables were written by the first load at the latest
    assert isinstance(again.tokenizer, LazyTokenizer)
    greedy = SamplingConfig(temperature=0.0)
    ours = [(s.token_id, s.text) for s in generate(again, "The cat sat on the", 12, config=greedy)]
    plain = first.tokenizer.full if isinstance(first.tokenizer, LazyTokenizer) else first.tokenizer
    first.tokenizer = plain
    theirs = [(s.token_id, s.text) for s in generate(first, "The cat sat on the", 12, config=greedy)]
    assert ours == theirs
    assert again.tokenizer._full is None


@pytest.mark.parametrize("command", ["generate", "predict"])
@pytest.mark.parametrize("name", ["gemma-3-270m", "smollm2-135m"])
def test_the_cli_generates_and_predicts_on_a_cached_model_without_importing_transformers(name, command):
    load_model(name)  # the cache and its tables exist
    more = "'-n', '4', '-t', '0'" if command == "generate" else "'--top', '5'"
    code = (f"import sys; from lmhead.cli import main; rc = main(['{command}', 'The cat sat on the', '-m', '{name}', "
            f"{more}]); print('transformers' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False 0"


def test_the_server_builds_transformers_tokenizer_when_it_starts(gemma):
    from lmhead.server.app import create_app

    model = load_model("gemma-3-270m")
    assert isinstance(model.tokenizer, LazyTokenizer) and model.tokenizer._full is None
    create_app(model)
    assert model.tokenizer._full is not None  # a first chat or /tokenize request does not wait for it


class _SlowSetter:
    """A pipeline that lets other threads run after its model is set (where a thread switch would break an
    unguarded encode)."""

    def __init__(self, inner):
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)
        time.sleep(0.002)


def test_a_lazy_tokenizer_encodes_from_several_threads_and_long_texts_as_transformers_does(gemma):
    model, full, tables = gemma
    tables = TokenizerTables(tables.pieces, tables.merges, tables.skeleton, tables.facts)
    tables._pipeline = _SlowSetter(tables._pipeline)
    lazy = LazyTokenizer(tables, lambda: fast_tokenizer(model.path))
    texts = [t * 3 for t in TEXTS] * 4
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lazy.encode, texts))
    assert got == [full.encode(t) for t in texts]
    assert lazy._full is None
    long = "The cat sat on the mat. " * 3000  # past the substring scan: transformers' tokenizer encodes it
    assert lazy.encode(long) == full.encode(long) and lazy._full is not None

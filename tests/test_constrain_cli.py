"""`lmhead generate` and `lmhead predict` with --json-schema, --json-object, --regex, --choice and --grammar: the
answer matches, predict marks the candidates the constraint cuts, bad constraints exit 2 naming the flag."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from tiny import tiny_model

from lmhead.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model, tok = tiny_model("llama")
    hf_model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _answer(folder, capsys, *flags: str) -> tuple[str, str]:
    code = main(["generate", "The cat", "--model", folder, "-n", "60", "--json", "--temperature", "0", *flags])
    assert code == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return "".join(s["text"] for s in steps), steps[-1]["finish_reason"]


def test_generate_json_schema_from_a_file(folder, capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    text, finish = _answer(folder, capsys, "--json-schema", str(path))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("flags,check", [
    (["--json-object"], lambda t: isinstance(json.loads(t), dict)),
    (["--regex", "[0-9]{2}:[0-9]{2}"], lambda t: re.fullmatch("[0-9]{2}:[0-9]{2}", t)),
    (["--choice", "red,green,blue"], lambda t: t in ("red", "green", "blue")),
])
def test_generate_constraint_flags(folder, capsys, flags, check):
    text, finish = _answer(folder, capsys, *flags)
    assert finish == "stop" and check(text), text


@pytest.mark.parametrize("grammar,words", [('start: "a " ("cat" | "dog")', ("a cat", "a dog")),
                                           ('root ::= "on " ("the" | "a") " mat"', ("on the mat", "on a mat"))])
def test_generate_grammar_file_lark_or_gbnf(folder, capsys, tmp_path, grammar, words):
    path = tmp_path / "g.txt"
    path.write_text(grammar)
    text, finish = _answer(folder, capsys, "--grammar", str(path))
    assert finish == "stop" and text in words


def test_text_output_of_a_constrained_answer(folder, capsys):
    assert main(["generate", "The cat", "--model", folder, "-n", "20", "--temperature", "0",
                 "--choice", "yes,no"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() in ("The catyes", "The catno") and "finish: stop" in out.err


def test_predict_marks_the_candidates_the_constraint_cuts(folder, capsys):
    assert main(["predict", "The cat", "--model", folder, "--top", "30", "--json", "--choice", "sat,on"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["constraint"].startswith("one of")
    kept = [c for c in pred["candidates"] if c["kept"]]
    cut = [c for c in pred["candidates"] if c["cut_by"] == "constraint"]
    assert kept and cut and all("sat".startswith(c["decoded"]) or "on".startswith(c["decoded"]) for c in kept)
    assert sum(c["probability"] for c in kept) == pytest.approx(1.0, abs=1e-6)
    assert all(c["probability"] == 0.0 and c["raw_probability"] > 0.0 for c in cut)  # raw: the model's own
    assert main(["predict", "The cat", "--model", folder, "--top", "5", "--choice", "sat,on"]) == 0
    assert "constraint (applied first): one of" in capsys.readouterr().out


@pytest.mark.parametrize("flags,match", [
    (["--regex", "a(b"], "unclosed group"),
    (["--json-schema", "/no/such/file"], "--json-schema: cannot read"),
    (["--choice", ","], "--choice"),
    (["--regex", "a", "--choice", "b"], "not allowed with argument"),
])
def test_bad_constraints_exit_2_naming_the_flag(folder, capsys, flags, match):
    assert main(["generate", "The cat", "--model", folder, "-n", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "Traceback" not in err, err


def test_unsupported_schema_feature_exits_2(folder, capsys, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "dependentSchemas": {"a": {}}}))
    assert main(["generate", "x", "--model", folder, "-n", "4", "--json-schema", str(path)]) == 2
    assert "does not support" in capsys.readouterr().err

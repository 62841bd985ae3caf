"""`lmhead predict` and `lmhead eval`, run in-process on a tiny model saved as an HF folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny import save_tiny, tiny_tokenizer

from lmhead.cli import main

TEXT = "The quick brown fox jumps over the lazy dog.\nThe cat sat on the mat. Language models predict the next token."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=3))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_predict_json(capsys, folder):
    code, out, err = run(capsys, "predict", "The cat sat on the", "--model", folder, "--top", "6",
                         "--top-k", "3", "--temperature", "0.8", "--json")
    assert code == 0, err
    d = json.loads(out)
    assert len(d["candidates"]) == 6 and d["kept_count"] == 3
    assert [c["kept"] for c in d["candidates"]] == [True] * 3 + [False] * 3
    assert sum(c["probability"] for c in d["candidates"]) == pytest.approx(1.0, abs=1e-6)
    assert d["config"]["top_k"] == 3 and d["config"]["temperature"] == 0.8
    assert d["prompt_tokens"][0]["text"] == "<bos>"
    assert d["layers"] is None


def test_predict_table(capsys, folder):
    code, out, err = run(capsys, "predict", "The cat sat on the", "--model", folder, "--top-p", "0.5")
    assert code == 0, err
    assert "kept:" in out and "of 320 tokens" in out
    assert "entropy: raw" in out and "processed" in out
    assert "top-p" in out  # some candidate is shown as removed by top-p
    assert "·cat" in out  # whitespace made visible in the prompt's tokens


def test_predict_layers(capsys, folder):
    code, out, err = run(capsys, "predict", "The cat sat on the", "--model", folder, "--layers")
    assert code == 0, err
    assert "logit lens" in out and "embed" in out
    code, out, err = run(capsys, "predict", "The cat", "--model", folder, "--layers", "--json")
    d = json.loads(out)
    assert [layer["layer"] for layer in d["layers"]] == [0, 1, 2]
    assert d["layers"][-1]["candidates"][0]["token_id"] == d["candidates"][0]["token_id"]


@pytest.mark.parametrize("argv,word", [
    (["--top-p", "1.5"], "top_p"), (["--top", "0"], "top"), (["--temperature", "-1"], "temperature"),
    (["--top-k", "x"], "top-k"), (["--model", "no-such-model"], "unknown model"),
])
def test_predict_bad_input_exits_2_with_one_line(capsys, folder, argv, word):
    args = ["predict", "The cat"] + (["--model", folder] if "--model" not in argv else []) + argv
    code, out, err = run(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lmhead") and word in err
    assert out == ""


def test_predict_empty_prompt(capsys, folder):
    code, _, err = run(capsys, "predict", "", "--model", folder)
    assert code == 2 and "prompt" in err


def test_eval_json_equals_transformers(capsys, folder, text_file):
    from transformers import AutoModelForCausalLM

    code, out, err = run(capsys, "eval", text_file, "--model", folder, "--json")
    assert code == 0, err
    d = json.loads(out)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tiny_tokenizer()(TEXT)["input_ids"]])
    with torch.no_grad():
        expected = math.exp(float(model(ids, labels=ids).loss))
    assert d["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert d["token_count"] == ids.shape[1] and d["tokens"] is None


def test_eval_tokens_json(capsys, folder, text_file):
    code, out, err = run(capsys, "eval", text_file, "--model", folder, "--tokens", "--json", "--window", "16",
                         "--stride", "8")
    assert code == 0, err
    d = json.loads(out)
    assert (d["window"], d["stride"]) == (16, 8) and d["windows"] > 1
    toks = d["tokens"]
    assert toks[0]["logprob"] is None
    assert all(t["rank"] >= 1 and t["logprob"] <= 0 for t in toks[1:])
    assert math.exp(-sum(t["logprob"] for t in toks[1:]) / (len(toks) - 1)) == pytest.approx(d["perplexity"],
                                                                                         rel=1e-4)


def test_eval_tokens_coloured(capsys, folder, text_file):
    code, out, err = run(capsys, "eval", text_file, "--model", folder, "--tokens")
    assert code == 0, err
    assert "legend:" in out and "top-1" in out and "top-100" in out and "beyond" in out
    assert "perplexity" in out
    assert "quick brown fox" in out  # the text itself, decoded (not the visible-whitespace form)


def test_eval_empty_file_is_an_error(capsys, folder, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    code, out, err = run(capsys, "eval", str(empty), "--model", folder)
    assert code == 2 and "empty" in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize("argv,word", [(["--window", "1"], "window"), (["--window", "8", "--stride", "9"], "stride")])
def test_eval_bad_window(capsys, folder, text_file, argv, word):
    code, _, err = run(capsys, "eval", text_file, "--model", folder, *argv)
    assert code == 2 and word in err


def test_eval_missing_file(capsys, folder, tmp_path):
    code, _, err = run(capsys, "eval", str(tmp_path / "nope.txt"), "--model", folder)
    assert code == 2 and "nope.txt" in err

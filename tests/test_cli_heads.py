"""`lmhead embed`, `rerank`, `classify` and `train-head` on a tiny model folder: outputs equal the library's, a
trained head saved and used, and bad input as exit 2 with one line naming the argument, file and line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import save_tiny

from lmhead.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["The cat sat on the mat.", "A dog", "Numbers: 1 2 3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-heads"), "llama", seed=5))


@pytest.fixture(scope="module")
def model(folder):
    from lmhead import load_model

    return load_model(folder, progress=False)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_embed_writes_the_librarys_vectors_as_npy_and_json_lines(capsys, tmp_path, folder, model):
    code, _, err = run(capsys, "embed", "--model", folder, *TEXTS, "--pooling", "mean", "--out",
                       str(tmp_path / "e.npy"))
    assert code == 0, err
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "e.npy")), model.embed(TEXTS, pooling="mean"),
                               rtol=1e-6, atol=1e-6)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    code, out, err = run(capsys, "embed", "--model", folder, "--input", str(tmp_path / "in.jsonl"))
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([r["embedding"] for r in rows]), model.embed(TEXTS), rtol=1e-6,
                               atol=1e-6)


def test_rerank_prints_the_documents_best_first(capsys, folder, model, monkeypatch):
    from lmhead.heads import reranker

    monkeypatch.setattr(reranker, "QWEN3_TEMPLATE", "Query: {query}\nDocument: {document}\nRelevant:")
    code, out, err = run(capsys, "rerank", "--model", folder, "cat", *TEXTS, "--top-n", "2")
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    want = model.rerank("cat", TEXTS, top_n=2)
    assert [r["index"] for r in rows] == [w["index"] for w in want]
    assert [r["relevance_score"] for r in rows] == pytest.approx([w["relevance_score"] for w in want], abs=1e-6)


def test_train_head_saves_a_head_that_classify_uses(capsys, tmp_path, folder, model):
    words = {"cat": "The cat sat on the mat", "dog": "The dog sat on the log", "fox": "The quick brown fox jumps"}
    lines = [json.dumps({"text": f"{words[k]} {i}", "label": k}) for i in range(12) for k in words]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    out_path = tmp_path / "head.safetensors"
    code, out, err = run(capsys, "train-head", str(tmp_path / "data.jsonl"), "--model", folder, "--out",
                         str(out_path), "--template", "{text}. It is a", "--max-steps", "60", "--lr", "0.05")
    assert code == 0, err
    report = json.loads(out)
    assert report["classes"] == ["cat", "dog", "fox"] and report["held_out"] == 8 and report["train"] == 28
    assert 0 <= report["zero_shot_accuracy"] <= 1 and 0 <= report["logistic_regression_accuracy"] <= 1
    assert report["parameters"] == 3 * (model.exact_head.d_model + 1)
    code, out, err = run(capsys, "classify", "--model", folder, "--classifier", str(out_path), *TEXTS)
    assert code == 0, err
    rows = [json.loads(x) for x in out.splitlines()]
    probs = model.classify(TEXTS, str(out_path))
    assert [r["label"] for r in rows] == [["cat", "dog", "fox"][i] for i in probs.argmax(-1).tolist()]
    assert list(rows[0]["probs"]) == ["cat", "dog", "fox"]
    code, out, err = run(capsys, "classify", "--model", folder, "--classifier", str(out_path), "--explain", TEXTS[0])
    assert code == 0, err
    assert "LM head: " in out and f"classification head: 3 × {model.exact_head.d_model} = " in out


@pytest.mark.parametrize("content,words", [
    ('{"text": "a", "label": "x"}\nnot json\n', "data.jsonl line 2: not JSON"),
    ('{"text": "a", "label": "x"}\n{"text": "b"}\n', 'data.jsonl line 2: "label" is missing'),
    ('{"text": "", "label": "x"}\n', 'data.jsonl line 1: "text" is missing or not a non-empty string'),
    ('{"text": "a", "label": "x"}\n{"text": "b", "label": "x"}\n', "at least 2 classes"),
])
def test_a_bad_data_file_is_exit_2_naming_the_line(capsys, tmp_path, folder, content, words):
    (tmp_path / "data.jsonl").write_text(content)
    code, out, err = run(capsys, "train-head", str(tmp_path / "data.jsonl"), "--model", folder, "--out",
                         str(tmp_path / "h.safetensors"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and words in err


def test_other_bad_input_is_exit_2_with_one_line(capsys, tmp_path, folder):
    for argv, words in ((["embed", "--model", folder], "give TEXT arguments or --input FILE"),
                        (["embed", "--model", folder, "x", "--out", str(tmp_path / "e.txt")], "must end in .npy"),
                        (["embed", "--model", folder, ""], r"input[0] is an empty string"),
                        (["classify", "--model", folder, "x"], "the model's file holds no classification head"),
                        (["classify", "--model", folder, "x", "--classifier", str(tmp_path / "none")],
                         "no such file"),
                        (["rerank", "--model", folder, "q", "a", "--top-n", "0"], "top_n must be an integer >= 1")):
        code, out, err = run(capsys, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, (argv, err)


def test_serve_gives_classify_its_head_and_refuses_one_of_another_width(capsys, tmp_path, folder, model,
                                                                        monkeypatch):
    import uvicorn

    from lmhead.heads.classifier import ClassificationHead

    width = model.exact_head.d_model
    ClassificationHead(torch.randn(2, width), None, ["x", "y"]).save(tmp_path / "ok.safetensors")
    ClassificationHead(torch.randn(2, width + 1), None, ["x", "y"]).save(tmp_path / "wide.safetensors")
    served = []

    def run_server(self, sockets=None):  # in place of serving: what the app was given
        served.append(self.config.app.state.classifier)
        self.started = True
        for sock in sockets or []:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run_server)
    code, _, err = run(capsys, "serve", "--model", folder, "--port", "0", "--classifier",
                       str(tmp_path / "ok.safetensors"))
    assert code == 0, err
    assert served[0].labels == ["x", "y"] and served[0].width == width
    code, _, err = run(capsys, "serve", "--model", folder, "--port", "0", "--classifier",
                       str(tmp_path / "wide.safetensors"))
    assert code == 2 and len(err.strip().splitlines()) == 1  # before the server says it serves
    assert f"the head is {width + 1} wide but the model's hidden state is {width}" in err
    assert len(served) == 1

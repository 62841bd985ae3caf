"""The packaged models (Gemma 3 270M, SmolLM2 135M): logits, greedy generation and the tokenizer against
transformers. Marked `model`: the first run converts the GGUF files into $LMHEAD_CACHE (minutes), later runs
load the cached safetensors."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from lmhead import Model, load_model
from lmhead.decode.rows import _Detokenizer
from lmhead.generate import generate
from lmhead.models import MODELS, ModelError
from lmhead.sampling import SamplingConfig

pytestmark = pytest.mark.model

GREEDY = SamplingConfig(temperature=0.0)
SHAPES = {"gemma-3-270m": (262144, 640), "smollm2-135m": (49152, 576)}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return load_model(request.param)


def test_named_model_shapes_and_tied_head(model):
    vocab, width = SHAPES[model.name]
    assert tuple(model.head.weight.shape) == (vocab, width)
    hf_model = model.hf_model  # built on first use: from then on the head shares its (tied) weight
    assert model.head.weight.data_ptr() == hf_model.get_input_embeddings().weight.data_ptr()
    assert model.head.weight.dtype == torch.float32 and not model.hf_model.training
    assert model.eos_token_ids and all(0 <= i < vocab for i in model.eos_token_ids)


def test_our_logits_equal_transformers_forward(model):
    ids = torch.tensor([model.tokenizer("The cat sat on the mat because it was")["input_ids"]])
    with torch.inference_mode():
        expected = model.hf_model(ids).logits
    # transformers' own body modules: only our head differs, so the logits agree to fp32 rounding of one product
    plain = Model(model.hf_model, model.tokenizer, body="transformers")
    torch.testing.assert_close(plain.logits(ids), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain.logits(ids, logits_to_keep=1), expected[:, -1:], rtol=1e-4, atol=1e-4)
    # the default body runs its linears through oneDNN (another summation order in each of 30 layers):
    # measured up to 1.4e-4 apart on logits of magnitude ~20 (7e-6 of the largest)
    torch.testing.assert_close(model.logits(ids), expected, rtol=1e-4, atol=5e-4)
    torch.testing.assert_close(model.logits(ids, logits_to_keep=1), expected[:, -1:], rtol=1e-4, atol=5e-4)


def test_greedy_equals_transformers_generate_for_32_tokens(model):
    prompt = "The cat sat on the"
    ours = [s.token_id for s in generate(model, prompt, 32, config=GREEDY)]
    enc = model.tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.hf_model.generate(**enc, max_new_tokens=32, do_sample=False, top_k=None, top_p=None,
                                      pad_token_id=model.tokenizer.pad_token_id)
    theirs = out[0, enc["input_ids"].shape[1]:].tolist()
    assert ours == theirs
    assert len(ours) == 32 or ours[-1] in model.eos_token_ids


def test_batch_rows_equal_running_alone(model):
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
    batch = list(generate(model, prompts, 12, config=GREEDY))
    for i, prompt in enumerate(prompts):
        alone = [s.token_id for s in generate(model, prompt, 12, config=GREEDY)]
        assert [s.token_id for s in batch if s.index == i] == alone


def test_a_seed_reproduces_a_sampled_run(model):
    config = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=0)
    a = [(s.token_id, s.text) for s in generate(model, "The cat sat on the", 16, config=config)]
    b = [(s.token_id, s.text) for s in generate(model, "The cat sat on the", 16, config=config)]
    assert a == b


def test_cached_tokenizer_equals_autotokenizer(model):
    reference = AutoTokenizer.from_pretrained(str(model.path))
    texts = ["The cat sat on the", " leading space", "Ünïcödé 日本語 🙂  two  spaces\n\nnew\ttab",
             "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>user\nhi<|im_end|>", "a" * 40, "x = f(1, 2)"]
    for text in texts:
        ids = reference(text)["input_ids"]
        assert model.tokenizer(text)["input_ids"] == ids
        assert model.tokenizer.decode(ids) == reference.decode(ids)
    assert model.tokenizer.all_special_ids == reference.all_special_ids


@pytest.mark.parametrize("text", ["日本語のテキストです。", "emoji 🙂🙃🎉 done", "naïve café — “quotes”"])
def test_text_deltas_on_multibyte_characters(model, text):
    tok = model.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = _Detokenizer(tok, tok("Say:")["input_ids"], [], set(tok.all_special_ids))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stops", [[], ["\n", "the"]])
def test_the_text_from_windows_is_the_whole_decodes_token_by_token(model, stops):
    # the incremental text (a window decoded from the last complete point) against the whole decoded at every
    # token: random ids — byte tokens that split characters, special tokens, pieces of any script — after prompts
    # of different tails, with and without stop strings; the emitted deltas and the text at every step equal
    tok = model.tokenizer
    g = torch.Generator().manual_seed(7)
    special = set(tok.all_special_ids)
    vocab = len(tok)
    for trial in range(12):
        prompt = tok(["Say:", "Hello there,", "日本語で", "x = [1, 2"][trial % 4])["input_ids"]
        ids = torch.randint(0, vocab, (160,), generator=g).tolist()
        ids[::17] = [sorted(special)[trial % len(special)]] * len(ids[::17])
        if trial % 3 == 0:  # runs of real text between the random pieces
            ids[40:40] = tok("naïve café — 東京 🙂 done", add_special_tokens=False)["input_ids"]
        window, whole = (_Detokenizer(tok, prompt, stops, special) for _ in range(2))
        whole._whole = True  # the reference: every token decodes the whole
        for i in ids:
            assert window.add(i) == whole.add(i)
            assert window._text() == whole._whole_text()
            if whole.stopped:
                break
        assert window.stopped == whole.stopped and window.flush() == whole.flush()
        assert not window._whole  # the windows served (these tokenizers' pieces are local)


def test_truncated_gguf_file_is_a_clear_error(tmp_path, monkeypatch):
    from lmhead.models.registry import _smollm2_gguf

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    source = _smollm2_gguf(tmp_path)
    broken = tmp_path / "broken.gguf"
    with open(source, "rb") as f:
        broken.write_bytes(f.read(source.stat().st_size // 2))
    with pytest.raises(ModelError, match="truncated"):
        load_model(str(broken), progress=False)


def test_a_local_gguf_file_converts_and_matches_the_named_model(tmp_path, monkeypatch):
    from lmhead.models.registry import _smollm2_gguf

    named = load_model("smollm2-135m")
    local = tmp_path / "smol.gguf"
    shutil.copyfile(_smollm2_gguf(tmp_path), local)
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model(str(local), progress=False)
    assert model.name == "smol"
    ids = torch.tensor([model.tokenizer("Hello there, how")["input_ids"]])
    torch.testing.assert_close(model.logits(ids), named.logits(ids))

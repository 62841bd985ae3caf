"""generate.py on tiny random models: equality with transformers' generate, batches, seeds, stops, text deltas."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_model

from lmhead import Model
from lmhead.decode.rows import Step, _Detokenizer
from lmhead.generate import generate
from lmhead.sampling import SamplingConfig, logprobs

GREEDY = SamplingConfig(temperature=0.0)
PROMPTS = ["The cat sat on the", "Hello", "A cat and a dog are friends. The quick brown fox jumps"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    return Model(*tiny_model(request.param), name=f"tiny-{request.param}")


def _run(model, prompt, n=24, config=GREEDY, **kw) -> list[Step]:
    return list(generate(model, prompt, n, config=config, **kw))


def _hf_greedy(model, prompt, n):
    ids = model.tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.hf_model.generate(**ids, max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                                      pad_token_id=model.tokenizer.pad_token_id)
    return out[0, ids["input_ids"].shape[1]:].tolist()


# --- equality with transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(model, prompt):
    # 40 tokens: past the gemma3 tiny model's sliding window of 8
    ours = [s.token_id for s in _run(model, prompt, 40)]
    assert ours == _hf_greedy(model, prompt, 40)[: len(ours)]
    assert len(ours) == 40 or ours[-1] in model.eos_token_ids


def test_greedy_equals_transformers_generate_without_eos(model):
    # with the eos id banned the run always reaches 40 tokens; transformers gets the same ban via its
    # eos-free generation (we compare the first 40 tokens of an eos-free transformers run)
    config = SamplingConfig(temperature=0.0, banned_tokens=tuple(model.eos_token_ids))
    ours = [s.token_id for s in _run(model, "The dog", 40, config=config)]
    assert len(ours) == 40
    ids = model.tokenizer("The dog", return_tensors="pt")
    bad = [[i] for i in model.eos_token_ids]
    with torch.inference_mode():
        out = model.hf_model.generate(**ids, max_new_tokens=40, do_sample=False, bad_words_ids=bad,
                                      pad_token_id=model.tokenizer.pad_token_id)
    assert ours == out[0, ids["input_ids"].shape[1]:].tolist()


def test_step_logprobs_equal_a_full_forward_without_cache(model):
    config = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9, seed=3)
    prompt_ids = model.tokenizer("The cat sat")["input_ids"]
    steps = _run(model, "The cat sat", 12, config=config, top_logprobs=5)
    seq = list(prompt_ids)
    for s in steps:
        logits = model.hf_model(torch.tensor([seq])).logits[:, -1].detach()
        expected = logprobs(logits, [s.token_id], config, top_n=5)
        assert s.logprob == pytest.approx(float(expected.logprob[0]), abs=1e-4)
        assert s.raw_logprob == pytest.approx(float(expected.raw_logprob[0]), abs=1e-4)
        assert s.rank == int(expected.rank[0])
        assert [t.token_id for t in s.top_logprobs] == expected.top_ids[0].tolist()
        assert [t.raw_logprob for t in s.top_logprobs] == pytest.approx(expected.top_raw_logprobs[0].tolist(),
                                                                        abs=1e-4)
        seq.append(s.token_id)


def test_fast_logprobs_equal_sampling_logprobs(model):
    # without top_logprobs the loop computes the chosen token's scores itself: same numbers
    config = SamplingConfig(temperature=0.7, top_k=30, seed=11)
    plain = _run(model, "Numbers: 1 2 3", 10, config=config)
    with_top = _run(model, "Numbers: 1 2 3", 10, config=config, top_logprobs=2)
    assert [s.token_id for s in plain] == [s.token_id for s in with_top]
    for a, b in zip(plain, with_top, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.raw_logprob == pytest.approx(b.raw_logprob, abs=1e-5)
        assert a.rank == b.rank


def test_greedy_steps_have_logprob_zero_and_cut_alternatives(model):
    steps = _run(model, "The cat", 5, top_logprobs=3)
    for s in steps:
        assert s.logprob == 0.0 and s.rank == 1
        assert len(s.top_logprobs) == 3 and s.top_logprobs[0].token_id == s.token_id
        assert s.top_logprobs[0].logprob == 0.0
        assert all(t.logprob == float("-inf") for t in s.top_logprobs[1:])  # cut by greedy
        assert s.top_logprobs[0].raw_logprob >= s.top_logprobs[1].raw_logprob >= s.top_logprobs[2].raw_logprob


# --- batches -----------------------------------------------------------------------------------------------


def test_each_row_of_a_batch_equals_running_it_alone(model):
    batch = _run(model, PROMPTS, 20)
    for i, prompt in enumerate(PROMPTS):
        alone = _run(model, prompt, 20)
        mine = [s for s in batch if s.index == i]
        assert [s.token_id for s in mine] == [s.token_id for s in alone]
        assert "".join(s.text for s in mine) == "".join(s.text for s in alone)
        for a, b in zip(mine, alone, strict=True):
            assert a.raw_logprob == pytest.approx(b.raw_logprob, abs=1e-4)


def test_batch_rows_have_their_own_configs_and_seeds(model):
    configs = [SamplingConfig(temperature=1.2, seed=5), GREEDY, SamplingConfig(temperature=0.8, top_k=5, seed=9)]
    batch = _run(model, PROMPTS, 16, config=configs)
    for i, (prompt, config) in enumerate(zip(PROMPTS, configs, strict=True)):
        alone = _run(model, prompt, 16, config=config)
        assert [s.token_id for s in batch if s.index == i] == [s.token_id for s in alone]


def test_rows_stop_on_their_own(model):
    # row 0 stops after 3 tokens (eos forced by a bias on step... via max tokens: use a stop at eos bias)
    eos = model.eos_token_ids[0]
    configs = [SamplingConfig(temperature=0.0, logit_bias={eos: 1e4}), GREEDY]
    steps = _run(model, ["The cat", "The dog"], 10, config=configs)
    row0 = [s for s in steps if s.index == 0]
    row1 = [s for s in steps if s.index == 1]
    assert len(row0) == 1 and row0[0].token_id == eos and row0[0].finish_reason == "stop" and row0[0].text == ""
    assert [s.token_id for s in row1] == [s.token_id for s in _run(model, "The dog", 10)]


def test_a_single_prompt_yields_index_zero_and_a_list_tags_each_step(model):
    assert {s.index for s in _run(model, "The cat", 3)} == {0}
    assert {s.index for s in _run(model, ["The cat", "The dog"], 3)} == {0, 1}


# --- seeds -------------------------------------------------------------------------------------------------


def test_a_seed_reproduces_a_run(model):
    config = SamplingConfig(temperature=1.5, seed=1234)
    a = [s.token_id for s in _run(model, "The quick brown", 30, config=config)]
    b = [s.token_id for s in _run(model, "The quick brown", 30, config=config)]
    c = [s.token_id for s in _run(model, "The quick brown", 30, config=SamplingConfig(temperature=1.5, seed=99))]
    assert a == b
    assert a != c  # 30 draws at T=1.5 from a 300-token vocabulary: equal only by a vanishing chance


def test_a_generator_reproduces_unseeded_runs(model):
    config = SamplingConfig(temperature=1.5)
    a = [s.token_id for s in _run(model, "Hello", 20, config=config, generator=torch.Generator().manual_seed(1))]
    b = [s.token_id for s in _run(model, "Hello", 20, config=config, generator=torch.Generator().manual_seed(1))]
    assert a == b


def test_a_seeded_row_gives_the_same_tokens_at_any_batch_position(model):
    config = SamplingConfig(temperature=1.3, top_p=0.95, seed=42)
    alone = [s.token_id for s in _run(model, "Hello", 15, config=config)]
    for prompts, index in ((["Hello", "The cat sat"], 0), (["The cat sat on the mat", "Hello"], 1)):
        steps = _run(model, prompts, 15, config=[config, config] if index == 0 else [GREEDY, config])
        assert [s.token_id for s in steps if s.index == index] == alone


# --- stopping ----------------------------------------------------------------------------------------------


def _no_eos(model):
    return SamplingConfig(temperature=0.0, banned_tokens=tuple(model.eos_token_ids))


def _wordy(model):
    """Seeded sampling without eos: a run that produces text (greedy tiny models may repeat one byte)."""
    return SamplingConfig(temperature=0.9, seed=7, banned_tokens=tuple(model.eos_token_ids))


def test_max_new_tokens_finishes_with_length(model):
    steps = _run(model, "The cat", 7, config=_no_eos(model))
    assert len(steps) == 7
    assert [s.finish_reason for s in steps] == [None] * 6 + ["length"]


def test_context_length_finishes_with_length(model):
    prompt = "The cat"
    while len(model.tokenizer(prompt + " sat")["input_ids"]) < model.context_length - 10:
        prompt += " sat"
    room = model.context_length - len(model.tokenizer(prompt)["input_ids"])
    assert 10 <= room < 20
    steps = _run(model, prompt, 50, config=_no_eos(model))
    assert len(steps) == room and steps[-1].finish_reason == "length"


def test_eos_finishes_with_stop_and_adds_no_text(model):
    eos = model.eos_token_ids[0]
    steps = _run(model, "The cat", 10, config=SamplingConfig(temperature=0.0, logit_bias={eos: 1e4}))
    assert len(steps) == 1
    assert steps[0].token_id == eos and steps[0].finish_reason == "stop" and steps[0].text == ""


def _text(steps):
    return "".join(s.text for s in steps)


def test_stop_string_ends_the_text_before_it(model):
    full = _text(_run(model, "The cat", 30, config=_wordy(model)))
    assert len(full) > 12
    stop = full[6:9]
    steps = _run(model, "The cat", 30, config=_wordy(model), stop=stop)
    assert _text(steps) == full[: full.index(stop)]
    assert steps[-1].finish_reason == "stop"
    assert all(s.finish_reason is None for s in steps[:-1])


def test_stop_string_split_across_tokens(model):
    free = _run(model, "The cat", 30, config=_wordy(model))
    full = _text(free)
    # the end of a step's text that is followed by more text: a stop string across that boundary
    ends = [len(_text(free[: i + 1])) for i in range(len(free))]
    b = next(x for x in ends if 2 <= x <= len(full) - 2)
    stop = full[b - 1:b + 1]
    steps = _run(model, "The cat", 30, config=_wordy(model), stop=[stop, "\x00never"])
    assert _text(steps) == full[: full.index(stop)]
    assert steps[-1].finish_reason == "stop"


def test_text_held_back_for_a_possible_stop_string_is_released(model):
    free = _run(model, "The cat", 20, config=_wordy(model))
    full = _text(free)
    stop = full[3:5] + "\x00"  # begins like the text but never completes
    steps = _run(model, "The cat", 20, config=_wordy(model), stop=stop)
    assert _text(steps) == full and steps[-1].finish_reason == "length"
    assert [s.token_id for s in steps] == [s.token_id for s in free]


# --- text deltas -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["héllo wörld", " 日本語のテキスト", "emoji 🙂🙃 and more", "a\n\nb  c\t"])
def test_deltas_join_to_the_decoded_text_and_never_split_a_character(model, text):
    tok = model.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    detok = _Detokenizer(tok, tok("Hi")["input_ids"], [], set(tok.all_special_ids))
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_leading_space_of_the_first_token_is_kept(model):
    tok = model.tokenizer
    ids = tok(" mat", add_special_tokens=False)["input_ids"]
    detok = _Detokenizer(tok, tok("The cat sat on the")["input_ids"], [], set(tok.all_special_ids))
    assert "".join(detok.add(i) for i in ids).startswith(" ")


def test_prompt_plus_deltas_is_the_decoded_sequence(model):
    steps = _run(model, "The cat sat", 25, config=_wordy(model))
    ids = model.tokenizer("The cat sat")["input_ids"] + [s.token_id for s in steps]
    assert "The cat sat" + _text(steps) == model.tokenizer.decode(ids, skip_special_tokens=True)


# --- output and validation ---------------------------------------------------------------------------------


def test_step_to_dict_is_json_ready(model):
    steps = _run(model, "The cat", 3, config=SamplingConfig(temperature=0.8, top_k=4, seed=1), top_logprobs=6)
    d = json.loads(json.dumps(steps[0].to_dict()))
    assert set(d) == {"token_id", "text", "logprob", "raw_logprob", "rank", "finish_reason", "index",
                      "top_logprobs"}
    assert len(d["top_logprobs"]) == 6
    assert {"token_id", "text", "logprob", "raw_logprob"} == set(d["top_logprobs"][0])
    assert d["top_logprobs"][5]["logprob"] is None  # top-k 4: the 5th and 6th were cut (-inf -> null)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompt_or_prompts": ""}, "prompt"),
    ({"prompt_or_prompts": []}, "prompt_or_prompts"),
    ({"prompt_or_prompts": ["ok", ""]}, r"prompt_or_prompts\[1\]"),
    ({"prompt_or_prompts": "x " * 400}, "context"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"stop": ""}, "stop"),
    ({"config": [GREEDY, GREEDY]}, "config"),
    ({"config": {"temperature": -1.0}}, "temperature"),
])
def test_bad_arguments_raise_value_error_naming_them(model, kwargs, match):
    args = {"prompt_or_prompts": "The cat", "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, **args)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prompt_or_prompts": 5}, "prompt_or_prompts"),
    ({"config": "greedy"}, "config"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
])
def test_wrong_types_raise(model, kwargs, match):
    args = {"prompt_or_prompts": "The cat", "max_new_tokens": 4, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        generate(model, **args)


def test_model_generate_delegates(model):
    a = [s.token_id for s in model.generate("The cat", 5, config=GREEDY)]
    assert a == [s.token_id for s in _run(model, "The cat", 5)]


def test_profile_collects_phase_times(model):
    profile: dict[str, float] = {}
    list(generate(model, "The cat", 5, config=GREEDY, profile=profile, draft="none"))
    assert set(profile) == {"body", "head", "sampling", "text"} and all(v > 0 for v in profile.values())
    drafted: dict[str, float] = {}
    list(generate(model, "The cat", 5, config=GREEDY, profile=drafted, draft="int8"))
    assert set(drafted) == {"draft", "body", "head", "sampling", "text"}


@pytest.mark.parametrize("config", [
    GREEDY,
    SamplingConfig(temperature=0.9, top_k=40, top_p=0.9, seed=21),
    SamplingConfig(temperature=1.1, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.3, seed=4),
    SamplingConfig(temperature=0.0, repetition_penalty=1.5, logit_bias={5: 2.0}, banned_tokens=(7,)),
], ids=["greedy", "top-k-top-p", "penalties", "greedy-penalties-bias"])
def test_cached_loop_equals_the_plain_loop_without_cache(model, config):
    from reference import generate_plain

    ours = [s.token_id for s in _run(model, "The cat sat on the mat", 20, config=config)]
    expected = generate_plain(model.hf_model, model.tokenizer, "The cat sat on the mat", 20, config,
                              model.eos_token_ids)
    assert ours == expected


def test_cli_exact_logprobs_are_the_fp32_heads(tmp_path, capsys):
    import math

    from lmhead.cli import main

    hf_model, tok = tiny_model("llama")
    hf_model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    runs = {}
    for name, extra in (("fp32", ["--head", "fp32"]), ("int8", ["--head", "exact-int8"]),
                        ("exact", ["--head", "exact-int8", "--exact-logprobs"])):
        assert main(["generate", "The cat sat", "--model", str(tmp_path), "-n", "6", "--temperature", "0",
                     "--json", *extra]) == 0
        runs[name] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["token_id"] for s in runs["exact"]] == [s["token_id"] for s in runs["fp32"]]
    for a, b in zip(runs["exact"], runs["fp32"], strict=True):
        assert math.isclose(a["raw_logprob"], b["raw_logprob"], abs_tol=1e-5)
    assert max(abs(a["raw_logprob"] - b["raw_logprob"]) for a, b in zip(runs["int8"], runs["fp32"], strict=True)) > 1e-5


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_plain_greedy_rows_take_one_native_pass_with_the_pipelines_tokens_and_scores(model, monkeypatch, draft):
    """Plain greedy rows (no bias, bans or penalties) are chosen and scored by `native.greedy_rows` in one call
    (with n-gram drafts: every position of the verification at once): the same tokens, processed logprob (0),
    raw logprob and rank (1) as the general pipeline and scorer; a row with alternatives or a penalty in the
    batch keeps the general path for what it needs."""
    import lmhead.decode.choice as choice
    import lmhead.decode.engine as engine
    from lmhead.kernels import native

    if native.library() is None:
        pytest.skip("no C compiler")
    calls = []

    def counting(x):
        calls.append(x.shape[0])
        return native.greedy_rows(x)

    def steps(**kw):
        return [(s.index, s.token_id, s.logprob, s.raw_logprob, s.rank, s.top_logprobs)
                for s in generate(model, PROMPTS * 2, 16, draft=draft, **kw)]

    penalised = SamplingConfig(temperature=0.0, repetition_penalty=1.3)
    cases = [dict(config=GREEDY), dict(config=GREEDY, top_logprobs=3), dict(config=[GREEDY, penalised, GREEDY] * 2)]
    for module in (engine, choice):  # the verification's argmax and the plain round's
        monkeypatch.setattr(module, "greedy_rows", counting)
    fast, used = [], []
    for kw in cases:
        calls.clear()
        fast.append(steps(**kw))
        used.append(list(calls))
    assert used[0] and used[0][0] >= 2 * len(PROMPTS) and used[1]  # every row at once, with or without alternatives
    assert used[2] == []  # a penalised row in the batch: the pipeline for all
    for module in (engine, choice):  # the general pipeline and scorer
        monkeypatch.setattr(module, "greedy_rows", lambda x: None)
    slow = [steps(**kw) for kw in cases]
    assert fast == slow
    assert all(s[2] == 0.0 and s[4] == 1 for s in fast[0])


def test_seeded_top_p_and_top_k_rows_drawn_without_the_pipeline_give_its_tokens_and_logprobs(model, monkeypatch):
    from lmhead.decode import choice

    calls = []
    real = choice.seeded_row
    monkeypatch.setattr(choice, "seeded_row", lambda *a: calls.append(real(*a)) or calls[-1])
    configs = [SamplingConfig(temperature=0.8, top_p=0.9, seed=11), SamplingConfig(temperature=1.1, top_p=0.95, seed=3),
               SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7),
               SamplingConfig(temperature=1.3, top_k=5, seed=2)]
    fast = [_run(model, "The cat sat", 12, config=c, draft="none") for c in configs]
    # every step after the prefill's round drew here (C settled each top-p set, each top k)
    assert sum(c is not None for c in calls) >= sum(len(steps) for steps in fast) - 4
    monkeypatch.setattr(choice, "seeded_row", lambda *a: None)  # the pipeline for every step
    for c, steps in zip(configs, fast, strict=True):
        slow = _run(model, "The cat sat", 12, config=c, draft="none")
        assert [(s.token_id, s.logprob, s.raw_logprob) for s in steps] == \
            [(s.token_id, s.logprob, s.raw_logprob) for s in slow]


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0.8, top_p=0.9), SamplingConfig(temperature=1.0),
                                    SamplingConfig(temperature=0.9, top_k=20, top_p=0.95),
                                    SamplingConfig(temperature=1.2, min_p=0.05)])
def test_unseeded_sampled_rows_drawn_in_c_report_their_processed_logprobs(model, config, monkeypatch):
    from lmhead.decode import choice

    calls = []

    def spy(*args):
        calls.append(args)
        return native_sample_row(*args)

    native_sample_row = choice.sample_row
    monkeypatch.setattr(choice, "sample_row", spy)
    prompt_ids = model.tokenizer("The cat sat")["input_ids"]
    steps = _run(model, "The cat sat", 12, config=config, generator=torch.Generator().manual_seed(5))
    assert len(calls) == len(steps)  # the C draw served every step
    seq = list(prompt_ids)
    for s in steps:
        logits = model.hf_model(torch.tensor([seq])).logits[:, -1].detach()
        expected = logprobs(logits, [s.token_id], config)
        assert s.logprob == pytest.approx(float(expected.logprob[0]), abs=1e-4)  # -inf for a token the cut dropped
        assert s.raw_logprob == pytest.approx(float(expected.raw_logprob[0]), abs=1e-4)
        seq.append(s.token_id)

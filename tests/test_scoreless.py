"""Rows without scores (`generate(..., scores=False)`, the server's requests that ask for no logprobs): the same
tokens and text as scored rows, no log-probabilities (None) — and, decoding beside scored rows, the scored
rows keep theirs."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from lmhead import Model
from lmhead.decode.rows import Step, prepare
from lmhead.generate import Batch, generate
from lmhead.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0)
TOP_K = SamplingConfig(temperature=0.8, top_k=40, seed=3)
WHOLE_ROW = SamplingConfig(temperature=0.9, top_p=0.9, seed=5)
PENALISED = SamplingConfig(temperature=0.7, top_k=10, repetition_penalty=1.3, seed=2)
PROMPTS = ["The cat sat on the mat", "A", "Hello there, how are you", "Numbers 1 2 3", "Dog and cat",
           "Once upon a time", "x y z", "Good morning"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request):
    hf_model, tokenizer = tiny_model(request.param, seed=4)
    return Model(hf_model, tokenizer, name=f"tiny-{request.param}")


def tokens(steps: list[Step], n: int) -> list[list[int]]:
    return [[s.token_id for s in steps if s.index == i] for i in range(n)]


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_rows_without_scores_give_the_tokens_of_scored_rows(model, draft):
    configs = [GREEDY, TOP_K, WHOLE_ROW, PENALISED, GREEDY, TOP_K, GREEDY, WHOLE_ROW]
    scored = list(generate(model, PROMPTS, 12, config=configs, draft=draft))
    bare = list(generate(model, PROMPTS, 12, config=configs, draft=draft, scores=False))
    assert tokens(bare, 8) == tokens(scored, 8)
    assert "".join(s.text for s in bare) == "".join(s.text for s in scored)
    assert [s.finish_reason for s in bare] == [s.finish_reason for s in scored]
    assert all(s.logprob is None and s.raw_logprob is None and s.rank is None for s in bare)
    assert all(s.rank is not None and s.raw_logprob is not None for s in scored)
    d = bare[0].to_dict()
    assert d["logprob"] is None and d["raw_logprob"] is None and d["rank"] is None


def test_scored_rows_beside_rows_without_scores_keep_their_scores(model):
    rows = (prepare(model, PROMPTS[:4], 10, config=GREEDY, scores=False)
            + prepare(model, PROMPTS[4:6], 10, config=TOP_K, top_logprobs=2)
            + prepare(model, PROMPTS[6:], 10, config=WHOLE_ROW, exact_logprobs=True))
    batch = Batch(model)
    batch.add(rows)
    got: dict[int, list[Step]] = {id(r): [] for r in rows}
    while batch.rows:
        for row, step in batch.step():
            got[id(row)].append(step)
    for row in rows:
        steps = got[id(row)]
        prompt = model.tokenizer.decode(row.prompt_ids, skip_special_tokens=True)
        want = list(generate(model, prompt, 10, config=row.config, top_logprobs=row.top_n, draft="none",
                             exact_logprobs=row.exact_logprobs))
        assert [s.token_id for s in steps] == [s.token_id for s in want]
        if row.scores:
            assert [s.rank for s in steps] == [s.rank for s in want]
            for a, b in zip(steps, want, strict=True):
                assert a.raw_logprob == pytest.approx(b.raw_logprob, abs=1e-5)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
        else:
            assert all(s.raw_logprob is None and s.logprob is None and not s.top_logprobs for s in steps)


def test_scores_is_checked(model):
    with pytest.raises(TypeError, match="scores"):
        generate(model, "Hi", 2, scores="no")
    with pytest.raises(ValueError, match="top_logprobs"):
        generate(model, "Hi", 2, scores=False, top_logprobs=2)

"""A batch of rows with different settings runs each declared step once over the rows that run it, with the rows'
parameters as tensors (Step.rows): every row's values are the bits it gets alone, and its draws the ids it draws
alone."""

from __future__ import annotations

import pytest
import torch

from lmhead.sampling import SamplingConfig, probabilities, process_logits, sample, sample_with_logprobs
from lmhead.sampling.steps import STEPS, Context, RowState
from lmhead.sampling.steps.base import rows_apply

pytestmark = pytest.mark.usefixtures("one_thread")

HISTORIES = [[3, 7, 9, 3, 7, 9, 3, 7], [1, 2, 1, 2, 1], [4, 4, 4, 4], [], [5, 6, 7, 5, 6], [9, 9, 1, 9, 9, 1]]
PROMPT_LENS = [2, 1, 0, 0, 2, 3]


def rows(n: int = 6, vocab: int = 400, seed: int = 0) -> torch.Tensor:
    """Language-model-like rows: a few high logits over a Gaussian tail; a flat one; a tie at the top."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    x[1] *= 0.3
    x[2, :6] += 8.0
    x[3, 10] = x[3, 11] = float(x[3].max()) + 1.0
    return x


# one step's settings per row (row 5 leaves it off where its declaration allows: the step skips it)
PER_STEP = {
    "temperature": [dict(temperature=t) for t in (0.3, 0.7, 1.3, 2.0, 0.55, 0.9)],
    "top_k": [dict(top_k=k) for k in (1, 5, 17, 399, 400, 1000)],
    "min_p": [dict(min_p=p) for p in (0.01, 0.05, 0.2, 0.5, 1.0, 0.1)],
    "top_a": [dict(top_a=a) for a in (0.01, 0.2, 0.5, 0.9, 1.0, 0.3)],
    "penalties": [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.2),
                  dict(repetition_penalty=0.8, frequency_penalty=-0.4), dict(presence_penalty=2.0),
                  dict(repetition_penalty=2.0, presence_penalty=-1.0), dict(frequency_penalty=1.5)],
    "dry": [dict(dry_multiplier=0.8), dict(dry_multiplier=1.5, dry_base=2.0, dry_allowed_length=1),
            dict(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=(9,)),
            dict(dry_multiplier=3.0, dry_penalty_last_n=4), dict(dry_multiplier=0.5, dry_allowed_length=1),
            dict(dry_multiplier=2.0, dry_allowed_length=1, dry_base=1.1)],
    "no_repeat_ngram": [dict(no_repeat_ngram_size=n) for n in (1, 2, 3, 2, 1, 4)],
    "logit_bias": [dict(logit_bias={1: 3.0, 7: float("-inf")}), dict(banned_tokens=(0, 2, 4)),
                   dict(logit_bias={399: -2.5}), dict(logit_bias={10: 1.0}, banned_tokens=(11,)),
                   dict(banned_tokens=(5,)), dict(logit_bias={3: 0.5, 4: 0.25})],
    "bad_words": [dict(bad_words=((3, 7, 9), (1, 2), (0,)))] * 3
    + [dict(bad_words=((6, 1),)), dict(bad_words=((5, 6, 8),)), dict(bad_words=((1,),))],
    "min_tokens": [dict(min_tokens=m, stop_token_ids=(10, 2)) for m in (1, 5, 9, 3, 6, 7)],
}


@pytest.mark.parametrize("name", sorted(PER_STEP))
def test_a_steps_rows_give_each_row_the_bits_its_apply_gives_it_alone(name):
    step = STEPS[name]
    assert step.rows is not None
    x = rows()
    cfgs = [SamplingConfig(**s) for s in PER_STEP[name]]
    ctxs = [Context(history=h, prompt_len=p) for h, p in zip(HISTORIES, PROMPT_LENS, strict=True)]
    before = x.clone()
    got = rows_apply(step, x, cfgs, ctxs)
    assert torch.equal(x, before)  # the input is never written
    for r, (cfg, ctx) in enumerate(zip(cfgs, ctxs, strict=True)):
        assert torch.equal(got[r:r + 1], step.apply(x[r:r + 1], cfg, ctx)), r


MIXED = [dict(typical_p=0.9, temperature=0.8), dict(top_n_sigma=1.0), dict(dry_multiplier=0.8, top_k=40),
         dict(xtc_probability=1.0, xtc_threshold=0.05), dict(epsilon_cutoff=3e-3, min_p=0.02),
         dict(temperature=0, dry_multiplier=3.0, no_repeat_ngram_size=2), dict(mirostat=2, mirostat_tau=3.0),
         dict(samplers="llama.cpp", top_k=40, top_p=0.9, temperature=0.7, dry_multiplier=0.8),
         dict(top_a=0.2, temperature=1.2, repetition_penalty=1.2), dict(eta_cutoff=3e-3, bad_words=((3, 7, 9),)),
         dict(dynatemp_range=0.5, top_k=50), dict(top_k=30, min_p=0.05, temperature=0.6)]


def _mixed(seeded: bool) -> tuple[torch.Tensor, list, list[list[int]], list[int]]:
    x = torch.cat([rows(6, seed=3), rows(6, seed=4)])
    cfgs = [SamplingConfig(**s, seed=100 + r if seeded else None) for r, s in enumerate(MIXED)]
    return x, cfgs, HISTORIES * 2, PROMPT_LENS * 2


def test_a_mixed_batch_of_declared_steps_processes_each_row_as_alone():
    x, cfgs, hist, plen = _mixed(False)
    out = process_logits(x, cfgs, prev_tokens=hist, prompt_len=plen)
    probs = probabilities(x, cfgs, prev_tokens=hist, prompt_len=plen)
    for r, cfg in enumerate(cfgs):
        alone = dict(prev_tokens=[hist[r]], prompt_len=plen[r])
        assert torch.equal(out[r], process_logits(x[r:r + 1], cfg, **alone)[0]), r
        assert torch.equal(probs[r], probabilities(x[r:r + 1], cfg, **alone)[0]), r


def test_seeded_rows_of_a_mixed_batch_draw_and_score_what_they_do_alone():
    x, cfgs, hist, plen = _mixed(True)
    for step in range(4):
        states = [RowState() for _ in cfgs]
        ids, lp = sample_with_logprobs(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step, state=states)
        for r, cfg in enumerate(cfgs):
            state = RowState()
            one, one_lp = sample_with_logprobs(x[r], cfg, prev_tokens=[hist[r]], prompt_len=plen[r], step=step,
                                               state=[state])
            assert int(ids[r]) == int(one), (step, r)
            assert torch.equal(lp[r], one_lp), (step, r)
            assert state == states[r]  # mirostat's μ moved alike


def test_unseeded_rows_read_the_generator_as_the_rows_drawn_one_by_one():
    x, cfgs, hist, plen = _mixed(False)
    # the rows of the general path only (the batch path's rows draw first, from the same generator)
    x, cfgs, hist, plen = x[:-1], cfgs[:-1], hist[:-1], plen[:-1]
    for seed in range(3):
        together = sample(x, cfgs, generator=torch.Generator().manual_seed(seed), prev_tokens=hist, prompt_len=plen)
        g = torch.Generator().manual_seed(seed)
        one_by_one = [int(sample(x[r], cfg, generator=g, prev_tokens=[hist[r]], prompt_len=plen[r]))
                      for r, cfg in enumerate(cfgs)]
        assert together.tolist() == one_by_one


def todays_settings(n: int = 16, seeded: bool = False) -> list[SamplingConfig]:
    """`n` settings of temperature, top-k, top-p and min-p, each other than the rest (bench_sampling's mixed round),
    greedy rows among them; every row seeded with ``seeded``."""
    out = []
    for r in range(n):
        out.append(SamplingConfig(temperature=0 if r % 7 == 6 else 0.5 + 0.05 * r,
                                  top_k=0 if r % 3 == 0 else 5 + 5 * r, top_p=1.0 if r % 5 == 4 else 0.8 + 0.01 * r,
                                  min_p=0.0 if r % 2 else 0.02 + 0.005 * r, seed=r if seeded else None))
    return out


def _lm_rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Language-model-like rows, one flat, and ties at some rows' k-th value."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 4
    x[3] *= 0.1
    for r in (1, 5):
        top = torch.topk(x[r], 5 + 5 * r + 1).indices
        x[r, top[-1]] = x[r, top[-2]]  # the k-th and (k+1)-th largest tie: the cut keeps both
    return x


@pytest.mark.parametrize("vocab", [3000, 40000])
def test_a_batch_of_todays_settings_each_row_its_own_cuts_each_row_as_alone(vocab):
    x = _lm_rows(16, vocab, seed=vocab)
    cfgs = todays_settings()
    out, probs = process_logits(x, cfgs), probabilities(x, cfgs)
    for r, cfg in enumerate(cfgs):
        assert torch.equal(out[r], process_logits(x[r], cfg)), r
        assert torch.equal(probs[r], probabilities(x[r], cfg)), r


@pytest.mark.parametrize("vocab", [3000, 40000])
def test_seeded_rows_of_todays_settings_draw_and_score_what_they_do_alone(vocab):
    x = _lm_rows(16, vocab, seed=vocab + 1)
    cfgs = todays_settings(seeded=True)
    for step in range(3):
        ids, lp = sample_with_logprobs(x, cfgs, step=step)
        plain = sample(x, cfgs, step=step)
        for r, cfg in enumerate(cfgs):
            one, one_lp = sample_with_logprobs(x[r], cfg, step=step)
            assert int(ids[r]) == int(one) == int(sample(x[r], cfg, step=step)) == int(plain[r]), (step, r)
            assert torch.equal(lp[r], one_lp), (step, r)


def test_rows_of_one_k_and_other_settings_share_one_pass_over_the_vocabulary(monkeypatch):
    """Rows whose cut is their top k, with one k and each its own temperature, top-p and min-p: one partial sort of
    the k + 1 largest for them all (a batch grouped by settings took one per row); rows of other k take each their
    own k + 1 in one call (each row's C threshold pass, one sort of their candidates); in a draw, every row cut inside
    its top k, seeded or not, between rows of other cuts, takes it in that one call, its row read where it lies."""
    from lmhead.sampling import Vocab

    calls = []
    topk, topk_rows = Vocab.topk, Vocab.topk_rows
    monkeypatch.setattr(Vocab, "topk", lambda self, x, k: calls.append((tuple(x.shape), k)) or topk(self, x, k))
    monkeypatch.setattr(Vocab, "topk_rows", lambda self, x, ks, rows=None: calls.append((tuple(x.shape), ks, rows))
                        or topk_rows(self, x, ks, rows))
    x = _lm_rows(6, 20000, seed=2)[[0, 2, 4]]
    cfgs = [SamplingConfig(temperature=0.6 + 0.1 * r, top_k=20, top_p=0.9 if r % 2 else 1.0, min_p=0.01 * r)
            for r in range(3)]
    for run in (lambda: probabilities(x, cfgs), lambda: sample(x, cfgs, generator=torch.Generator().manual_seed(0)),
                lambda: sample(x, [SamplingConfig(top_k=20, temperature=0.5 + 0.1 * r, seed=r) for r in range(3)])):
        calls.clear()
        run()
        assert calls == [((3, 20000), 21)]
    calls.clear()
    probabilities(x, [SamplingConfig(top_k=10 + r, temperature=0.7) for r in range(3)])
    assert calls == [((3, 20000), [11, 12, 13], None)]
    calls.clear()
    wide = _lm_rows(6, 20000, seed=3)[:5]
    mixed = [SamplingConfig(top_k=12, seed=4), SamplingConfig(top_p=0.9), SamplingConfig(top_k=15),
             SamplingConfig(temperature=0), SamplingConfig(top_k=18, top_p=0.8, seed=5)]
    sample(wide, mixed, generator=torch.Generator().manual_seed(0))
    assert calls == [((5, 20000), [13, 19, 16], [0, 4, 2])]


def test_top_k_rows_of_one_k_seeded_and_not_out_of_order_each_draw_from_their_own_row():
    """Rows cut inside one k, seeded ones first then unseeded ones, with rows of other cuts between (their top k + 1
    taken in one call over rows in that order, not x's): each seeded row draws the token it draws alone, and the
    unseeded one its own row's top k."""
    x = _lm_rows(6, 20000, seed=4)[:5]
    cfgs = [SamplingConfig(top_k=20, seed=1), SamplingConfig(top_p=0.9), SamplingConfig(top_k=20),
            SamplingConfig(temperature=0), SamplingConfig(top_k=20, seed=2)]
    ids = sample(x, cfgs, generator=torch.Generator().manual_seed(0), step=3)
    for r in (0, 4):
        assert int(ids[r]) == int(sample(x[r], cfgs[r], step=3))
    assert int(ids[2]) in torch.topk(x[2], 20).indices.tolist()


# --- a step's state is its own: the penalties' and DRY's records of a row's tokens, moved by accept -----------------

RECORDED = [dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2, typical_p=0.95),
            dict(dry_multiplier=0.8, dry_allowed_length=1, temperature=0.9),
            dict(dry_multiplier=1.5, dry_penalty_last_n=6, dry_allowed_length=1, repetition_penalty=0.9,
                 top_n_sigma=2.0),
            dict(temperature=0, frequency_penalty=0.5, dry_multiplier=2.0, dry_allowed_length=1)]


def test_records_moved_by_accept_give_the_numbers_of_records_made_from_the_whole_history(monkeypatch):
    """A generation of 12 tokens: each row's records (made at the first token, then moved by each chosen token) give
    the logits, draws and states that records made from the whole history at every token give; once made, they are
    not made again."""
    from lmhead.sampling.steps import penalties

    of = penalties.PenaltyCounts.of
    x = rows(4, vocab=300, seed=9)
    cfgs = [SamplingConfig(**s, seed=r) for r, s in enumerate(RECORDED)]
    hist = [[3, 7, 9, 3, 7], [1, 2, 1], [4, 4, 4, 4, 5, 6], [2, 5]]
    plen = [2, 1, 3, 2]
    states = [RowState() for _ in cfgs]
    for step in range(12):
        fresh = [RowState() for _ in cfgs]
        want = process_logits(x, cfgs, prev_tokens=hist, prompt_len=plen)  # records made from the history
        assert torch.equal(probabilities(x, cfgs, prev_tokens=hist, prompt_len=plen), torch.softmax(want, dim=-1))
        ids = sample(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step, state=states)
        again = sample(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step, state=fresh)
        assert ids.tolist() == again.tolist()
        assert states == fresh  # the records accept moved are the ones made from the history and the token
        hist = [h + [int(t)] for h, t in zip(hist, ids, strict=True)]
        x = x.roll(1, dims=1)
    calls = []
    monkeypatch.setattr(penalties.PenaltyCounts, "of", classmethod(lambda cls, h, p: calls.append(len(h)) or of(h, p)))
    for step in range(3):
        ids = sample(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step, state=states)
        hist = [h + [int(t)] for h, t in zip(hist, ids, strict=True)]
    assert calls == []  # moved by accept, never made again


def test_a_record_that_does_not_match_the_history_is_made_again_and_a_clone_moves_on_its_own():
    x = rows(4, vocab=300, seed=10)[2:3]
    cfg = SamplingConfig(repetition_penalty=1.5, frequency_penalty=0.3, dry_multiplier=1.0, dry_allowed_length=1,
                         typical_p=0.9, seed=4)
    hist = [5, 6, 5, 6, 5]
    state = RowState()
    tok = int(sample(x, cfg, prev_tokens=[hist], prompt_len=1, state=[state])[0])
    assert set(state.history) == {"penalties", "dry"} and state.history["penalties"].length == len(hist) + 1
    fork = state.clone()
    # the history jumps by two tokens (drafts taken without a draw): the records are made again from it
    jumped = hist + [tok, 9, 9]
    fresh = RowState()
    assert sample(x, cfg, prev_tokens=[jumped], prompt_len=1, state=[state], step=1).tolist() == sample(
        x, cfg, prev_tokens=[jumped], prompt_len=1, state=[fresh], step=1).tolist()
    assert state == fresh
    assert state.history["penalties"].length == len(jumped) + 1
    assert fork.history["penalties"].length == len(hist) + 1  # the fork did not move
    assert fork.history["penalties"] is not state.history["penalties"]
    state.reset()
    assert state == RowState()


def test_a_step_runs_once_over_the_rows_that_run_it_and_not_at_all_where_none_does(monkeypatch):
    from lmhead.sampling.steps import cutoffs, top_a

    seen = {"top_a": [], "typical": []}
    rows_of_top_a, typical = top_a.top_a_rows, cutoffs.typical
    monkeypatch.setattr(top_a, "top_a_rows", lambda x, a, v: seen["top_a"].append(x.shape[0]) or rows_of_top_a(x, a, v))
    monkeypatch.setattr(cutoffs, "typical", lambda x, m: seen["typical"].append(x.shape[0]) or typical(x, m))
    x = rows(4, vocab=500, seed=11)
    cfgs = [SamplingConfig(top_a=0.1, temperature=0.7), SamplingConfig(typical_p=0.9),
            SamplingConfig(top_a=0.3, typical_p=0.8), SamplingConfig(top_n_sigma=1.0)]
    out = process_logits(x, cfgs)
    assert seen == {"top_a": [2], "typical": [1, 1]}  # top-a once over its two rows; typical-p's C pass per row
    for r, cfg in enumerate(cfgs):
        assert torch.equal(out[r], process_logits(x[r], cfg))
    seen["top_a"].clear()
    seen["typical"].clear()
    sample(x, [SamplingConfig(top_n_sigma=1.0 + r) for r in range(4)], generator=torch.Generator().manual_seed(0))
    assert seen == {"top_a": [], "typical": []}  # steps no row runs cost nothing


def test_the_batch_paths_penalties_apply_from_the_records_accept_moves():
    """Rows of today's settings with penalties (the batch path): with states, the penalties apply from each row's
    record, moved by each drawn token and never made again; the ids are those drawn without states."""
    from lmhead.sampling.steps import penalties

    x = _lm_rows(6, 3000, seed=12)[:4]
    cfgs = [SamplingConfig(repetition_penalty=1.4, top_k=20, seed=1), SamplingConfig(presence_penalty=0.8, seed=2),
            SamplingConfig(frequency_penalty=0.6, repetition_penalty=0.8, top_p=0.9, seed=3),
            SamplingConfig(temperature=0, repetition_penalty=3.0)]
    assert all(c.runs_on("batch") for c in cfgs)
    hist = [[5, 6, 7], [1, 1, 2], [9], [4, 4]]
    plen = [2, 1, 1, 0]
    states = [RowState() for _ in cfgs]
    made = []
    of = penalties.PenaltyCounts.of
    for step in range(8):
        if step == 1:  # from the second token on, every record is moved, not made
            penalties.PenaltyCounts.of = classmethod(lambda cls, h, p: made.append(len(h)) or of(h, p))
        try:
            ids = sample(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step, state=states)
        finally:
            penalties.PenaltyCounts.of = of
        assert ids.tolist() == sample(x, cfgs, prev_tokens=hist, prompt_len=plen, step=step).tolist()
        hist = [h + [int(t)] for h, t in zip(hist, ids, strict=True)]
        assert all(s.history["penalties"].length == len(h) for s, h in zip(states, hist, strict=True))
        x = x.roll(3, dims=1)
    assert made == []


@pytest.mark.parametrize("seeded", [False, True])
def test_plain_rows_drawn_without_the_pipelines_checks_are_its_ids_and_logprobs(seeded):
    # the decode loop's rounds of plain rows (temperature and cut-offs alone) skip the history's validation:
    # the same draws from the same generator state, the same logprobs, each row at its own step
    from lmhead.sampling.pipeline import sample_plain_rows

    x = _lm_rows(16, 3000, seed=8)
    cfgs = todays_settings(seeded=seeded)
    steps = [3 + r % 4 for r in range(16)]
    for seed in range(3):
        want = sample_with_logprobs(x, cfgs, generator=torch.Generator().manual_seed(seed), step=steps)
        got = sample_plain_rows(x, cfgs, torch.Generator().manual_seed(seed), steps)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), seed
    with pytest.raises(ValueError, match="one per row"):
        sample_plain_rows(x, cfgs[:3], None, steps)
    with pytest.raises(ValueError, match="cut-offs only"):
        sample_plain_rows(x[:1], [SamplingConfig(repetition_penalty=1.2)], None, [0])
    bad = x[:1].clone()
    bad[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        sample_plain_rows(bad, [SamplingConfig(top_k=5)], None, [0])

"""Chunked prefill: a prompt fed to the lean body in pieces (`decode.engine.Decoder.prefill_piece`) gives the tokens
and logprobs of one forward, and a prompt joining a running batch in pieces (`Batch.begin_join` / `prefill`)
lets the live rows decode between its pieces, then gives what it gives alone."""

from __future__ import annotations

import pytest

import lmhead.decode.engine as engine
from lmhead.decode.rows import prepare
from lmhead.generate import Batch
from lmhead.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0)
LONG = "the cat and the dog went to the market to buy bread and milk " * 3


def _alone(model, prompt, n, config=GREEDY):
    batch = Batch(model)
    batch.add(prepare(model, prompt, n, config))
    out = []
    while batch.rows:
        out += [step for _, step in batch.step()]
    return out


def _finish_and_compare(batch, got: dict[int, list], want_short: list, want_long: list) -> None:
    """Decode the merged batch to its end; the running row (index 0) and the joined one (index 1) give what each
    gives alone."""
    while batch.rows:
        for _, step in batch.step():
            got[step.index].append(step)
    assert [s.token_id for s in got[0]] == [s.token_id for s in want_short]
    assert [s.token_id for s in got[1]] == [s.token_id for s in want_long]
    assert [s.raw_logprob for s in got[1]] == pytest.approx([s.raw_logprob for s in want_long], abs=1e-5)


def test_a_prompt_prefilled_in_pieces_gives_the_tokens_of_one_forward(model, monkeypatch):
    whole = _alone(model, LONG, 12)
    monkeypatch.setattr(engine, "PREFILL_PIECE", 5)
    pieces = _alone(model, LONG, 12)
    assert [s.token_id for s in pieces] == [s.token_id for s in whole]
    assert [s.raw_logprob for s in pieces] == pytest.approx([s.raw_logprob for s in whole], abs=1e-5)
    seeded = SamplingConfig(temperature=0.9, top_k=20, seed=3)
    assert [s.token_id for s in _alone(model, LONG, 12, seeded)] == [
        s.token_id for s in _alone(model, LONG, 12, seeded)]


def test_live_rows_decode_between_the_pieces_of_a_joining_prompt(model, monkeypatch):
    want_long = _alone(model, LONG, 8)
    want_short = _alone(model, "Hello there", 30)
    monkeypatch.setattr(engine, "PREFILL_PIECE", 4)
    batch = Batch(model)
    short = prepare(model, "Hello there", 30, GREEDY)
    batch.add(short)
    got: dict[int, list] = {0: [], 1: []}
    for _, step in batch.step():
        got[0].append(step)
    long = prepare(model, LONG, 8, GREEDY)
    for row in long:
        row.index = 1
    batch.begin_join(long)
    pieces = 0
    while batch.prefill(4):  # a decode round of the live row between every two pieces
        pieces += 1
        assert batch.joining == long and batch.rows == short
        for _, step in batch.step():
            got[0].append(step)
    assert pieces >= len(long[0].prompt_ids) // 4 - 1
    assert batch.rows == [*short, *long] and not batch.joining
    _finish_and_compare(batch, got, want_short, want_long)


def test_a_join_whose_running_rows_all_left_becomes_the_batch(model, monkeypatch):
    want = _alone(model, LONG, 6)
    monkeypatch.setattr(engine, "PREFILL_PIECE", 4)
    batch = Batch(model)
    short = prepare(model, "Hi", 30, GREEDY)
    batch.add(short)
    batch.step()
    long = prepare(model, LONG, 6, GREEDY)
    batch.begin_join(long)
    batch.prefill()
    batch.remove(short)  # the running row's client went away mid-join
    assert not batch.rows and batch.joining == long and not batch.can_join
    while batch.prefill():
        pass
    got = []
    while batch.rows:
        got += [step for _, step in batch.step()]
    assert [s.token_id for s in got] == [s.token_id for s in want]


@pytest.mark.parametrize("sizes", [[8, 16, 3, 40], [1, 2, 5, 7, 11], None])
@pytest.mark.slow
def test_pieces_of_varying_sizes_give_the_tokens_and_logprobs_of_one_prefill(model, sizes):
    want_long = _alone(model, LONG, 8)
    want_short = _alone(model, "Hello there", 20)
    batch = Batch(model)
    short = prepare(model, "Hello there", 20, GREEDY)
    batch.add(short)
    got: dict[int, list] = {0: [s for _, s in batch.step()], 1: []}
    long = prepare(model, LONG, 8, GREEDY)
    for row in long:
        row.index = 1
    batch.begin_join(long)
    i = 0
    while batch.prefill(None if sizes is None else sizes[i % len(sizes)]):  # None: the budget sizes them
        i += 1
        for _, step in batch.step():
            got[0].append(step)
    _finish_and_compare(batch, got, want_short, want_long)


def test_the_budget_sizes_a_piece_from_the_measured_round_and_rate():
    from lmhead.decode.budget import PIECE_UNIT, PrefillBudget
    budget = PrefillBudget()
    assert budget.columns(1, 64) == PIECE_UNIT  # nothing measured yet: one unit
    for _ in range(5):
        budget.note_round(0.010)
    budget.note_piece(0.001, PIECE_UNIT, PIECE_UNIT)  # 1/8 ms a position: a 10 ms round allows 80
    assert budget.columns(1, 64) == min(64, 2 * PIECE_UNIT)  # at most twice the last piece
    budget.note_piece(0.002, 16, 16)
    assert budget.columns(1, 1024) == 32
    budget.note_piece(0.004, 32, 32)
    assert budget.columns(1, 1024) == 64
    budget.note_piece(0.008, 64, 64)
    assert budget.columns(1, 1024) == 80  # the round's time at the last piece's rate
    assert budget.columns(1, 40) == 40  # at most `most`
    assert budget.columns(2, 1024) % 4 == 0 and budget.columns(2, 1024) == 40  # 2 rows: half the columns
    budget.note_piece(10.0, 8, 8)  # a slow piece: the next is one unit
    assert budget.columns(1, 1024) == PIECE_UNIT
    with pytest.raises(ValueError, match="rows"):
        budget.columns(0, 64)

"""Invariants of the logits pipeline over random inputs (hypothesis)."""

from __future__ import annotations

import pytest
import reference as ref
import torch

from lmhead.sampling import SamplingConfig, apply_penalties, probabilities, process_logits, sample

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=100, deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")

# logits: a few values repeat often (ties), with some -inf; at least one finite value per row
values = st.one_of(st.floats(-30, 30, allow_nan=False, width=32), st.sampled_from([0.0, 1.0, -1.0, 2.5]),
                   st.just(float("-inf")))


@st.composite
def logits_batches(draw, max_batch: int = 4, max_vocab: int = 40):
    batch = draw(st.integers(1, max_batch))
    vocab = draw(st.integers(1, max_vocab))
    rows = [draw(st.lists(values, min_size=vocab, max_size=vocab)) for _ in range(batch)]
    x = torch.tensor(rows, dtype=torch.float32)
    for r in range(batch):  # at least one finite logit per row
        if not torch.isfinite(x[r]).any():
            x[r, draw(st.integers(0, vocab - 1))] = draw(st.floats(-5, 5, width=32))
    return x


# The cut-off settings, each either off or drawn from its valid range.
_cut_settings = dict(
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 50)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)
configs = st.builds(SamplingConfig, **_cut_settings)


@SETTINGS
@given(logits_batches(), configs)
def test_rows_sum_to_one_and_kept_tokens_outrank_dropped_ones(x, cfg):
    probs = probabilities(x, cfg)
    torch.testing.assert_close(probs.sum(-1), torch.ones(x.shape[0]))
    for r in range(x.shape[0]):
        kept, dropped = x[r][probs[r] > 0], x[r][probs[r] == 0]
        assert kept.numel() >= 1
        if dropped.numel():
            assert kept.min() >= dropped.max()  # every kept token was at least as likely as every dropped one
        # and within the kept set, probabilities follow the logits
        order = torch.argsort(x[r][probs[r] > 0])
        assert bool((probs[r][probs[r] > 0][order].diff() >= -1e-7).all())


@SETTINGS
@given(logits_batches(), configs)
def test_pipeline_matches_reference(x, cfg):
    ours = process_logits(x, cfg)
    expected = ref.sampling_process(x, [cfg] * x.shape[0])
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))


@SETTINGS
@given(logits_batches(), st.integers(0, 2**31))
def test_greedy_equals_argmax(x, seed):
    cfg = SamplingConfig(temperature=0.0, top_k=3, top_p=0.5, seed=seed)
    assert torch.equal(sample(x, cfg), x.argmax(-1))


@SETTINGS
@given(logits_batches(), st.integers(1, 50))
def test_top_k_keeps_at_most_k_except_ties_at_the_kth(x, k):
    kept = torch.isfinite(process_logits(x, SamplingConfig(top_k=k)))
    for r in range(x.shape[0]):
        finite = torch.isfinite(x[r])
        if k < x.shape[1]:  # HF's rule: exactly the finite tokens ≥ the k-th largest logit
            kth = torch.sort(x[r], descending=True).values[k - 1]
            assert torch.equal(kept[r], finite & (x[r] >= kth))
        if x[r][finite].unique().numel() == int(finite.sum()):  # no ties: never more than k
            assert kept[r].sum() <= k


@SETTINGS
@given(logits_batches(), st.floats(0.01, 1.0), st.floats(0.1, 3.0))
def test_top_p_kept_mass_reaches_p(x, p, temperature):
    cfg = SamplingConfig(top_p=p, temperature=temperature)
    kept = torch.isfinite(process_logits(x, cfg))
    full = torch.softmax(x.double() / temperature, dim=-1)
    mass = (full * kept).sum(-1)
    assert bool((mass >= p - 1e-6).all())
    # and it is the smallest such set, up to ties: without its least likely kept value it would not reach p.
    # Ties as the pipeline sees them, in x / T (a subnormal logit divided by T can tie with 0.0).
    scaled = x / temperature
    for r in range(x.shape[0]):
        least = (scaled[r][kept[r]]).min()
        assert float(full[r][kept[r] & (scaled[r] > least)].sum()) < p + 1e-6


@SETTINGS
@given(logits_batches(max_vocab=20), st.lists(st.integers(0, 19), max_size=30), st.floats(0.01, 5.0),
       st.floats(0.0, 3.0), st.floats(0.0, 3.0), st.integers(0, 30))
def test_penalties_never_raise_a_penalised_token(x, prev, repetition, presence, frequency, prompt_len):
    vocab = x.shape[1]
    prev = [t % vocab for t in prev]
    prevs = [prev] * x.shape[0]
    out = apply_penalties(x, prevs, repetition_penalty=max(repetition, 1.0), presence_penalty=presence,
                          frequency_penalty=frequency, prompt_len=prompt_len)
    seen = torch.zeros(vocab, dtype=torch.bool)
    if prev:
        seen[torch.tensor(prev)] = True
    assert bool((out[:, seen] <= x[:, seen]).all())
    assert torch.equal(out[:, ~seen], x[:, ~seen])  # untouched where the token was never seen
    expected = torch.stack([ref.sampling_penalties(x[b], prev, prompt_len, max(repetition, 1.0), presence,
                                                   frequency) for b in range(x.shape[0])])
    torch.testing.assert_close(out, expected, **ref.tolerance(torch.float32))


@SETTINGS
@given(logits_batches(), configs, st.integers(0, 2**20))
def test_sampled_token_is_always_a_kept_token(x, cfg, seed):
    ids = sample(x, cfg, generator=torch.Generator().manual_seed(seed))
    assert bool((probabilities(x, cfg).gather(1, ids[:, None]) > 0).all())


row_configs = st.builds(
    SamplingConfig,
    **_cut_settings,
    repetition_penalty=st.one_of(st.just(1.0), st.floats(0.5, 3.0)),
    presence_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    frequency_penalty=st.one_of(st.just(0.0), st.floats(-2.0, 2.0)),
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, 3), st.floats(-5, 5) | st.just(float("-inf")),
                                                    max_size=2)),
    banned_tokens=st.lists(st.integers(0, 3), max_size=2).map(tuple),
)


@SETTINGS
@given(st.data())
def test_mixed_batch_with_bias_and_penalties_matches_reference(data):
    x = data.draw(logits_batches(max_vocab=30).filter(lambda t: t.shape[1] >= 4))
    batch, vocab = x.shape
    configs = [data.draw(row_configs) for _ in range(batch)]
    prev = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=12)) for _ in range(batch)]
    plen = [data.draw(st.integers(0, 12)) for _ in range(batch)]
    expected = ref.sampling_process(x, configs, prev, plen)
    if not bool(torch.isfinite(expected).any(dim=-1).all()) or not bool((expected < float("inf")).all()):
        with pytest.raises(ValueError, match="logits"):  # bias / bans left a row with no token
            process_logits(x, configs, prev_tokens=prev, prompt_len=plen)
        return
    ours = process_logits(x, configs, prev_tokens=prev, prompt_len=plen)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(expected))
    keep = torch.isfinite(expected)
    torch.testing.assert_close(ours[keep], expected[keep], rtol=1e-5, atol=1e-5)


@SETTINGS
@given(logits_batches(max_batch=3, max_vocab=300), st.floats(0.01, 0.99), st.floats(0.1, 3.0),
       st.one_of(st.none(), st.integers(0, 2**20)))
def test_top_p_rejection_draw_picks_a_token_of_the_reference_set(x, p, temperature, seed):
    # sample's top-p alone never computes the set; the token it draws must still be in the reference's
    cfg = SamplingConfig(top_p=p, temperature=temperature, seed=seed)
    ids = sample(x, cfg, generator=torch.Generator().manual_seed(7), step=3)
    kept = torch.isfinite(ref.sampling_process(x, [cfg] * x.shape[0]))
    assert bool(kept.gather(1, ids[:, None]).all())


@SETTINGS
@given(st.sampled_from(["repetition_penalty", "presence_penalty", "frequency_penalty", "temperature"]),
       st.floats(allow_nan=False, allow_infinity=False))
def test_a_setting_is_accepted_exactly_within_its_finite_range(name, value):
    low, high = {"repetition_penalty": (1e-4, 1e4), "temperature": (0.0, 1e4)}.get(name, (-1e4, 1e4))
    if low <= value <= high:
        assert getattr(SamplingConfig(**{name: value}), name) == value
    else:
        with pytest.raises(ValueError, match=name):
            SamplingConfig(**{name: value})

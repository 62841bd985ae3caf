"""Bitwise batch invariance of the kernels: a row's numbers are the same bits computed alone, as one of a batch's
rows, as a position of a prefill chunk or a draft's verification, and over one or two threads (the products over
every type: tests/test_gguf_file.py)."""

from __future__ import annotations

import pytest
import torch

from lmhead.kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler")

H, HKV, HD, P = 4, 2, 64, 27  # query heads, key heads, head width, positions


def _attend(qk, v, cos, sin, keys, values, mask, start, threads):
    """lmhead_attend over qk [B,T,H+Hkv,hd], v [B,T,Hkv,hd] into the caches keys, values [B,Hkv,cap,hd] (written at
    start..start+T) → out [B,T,H·hd]."""
    b, t = qk.shape[:2]
    out = torch.empty(b, t, H * HD)
    rc = native.library().lmhead_attend(native.AttendArgs(
        qk=qk.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
        values=values.data_ptr(), mask=None if mask is None else mask.data_ptr(), out=out.data_ptr(),
        qk_stride=(H + HKV) * HD, v_stride=HKV * HD, B=b, T=t, H=H, Hkv=HKV, hd=HD, cap=keys.shape[2], start=start,
        scaling=0.125, softcap=0.0, threads=threads))
    assert rc == 0
    return out


def _causal(start: int, t: int, pad: int = 0) -> torch.Tensor:
    """[1, t, start + t]: query i keeps the columns pad .. start + i (−inf elsewhere)."""
    cols = torch.arange(start + t)
    keep = (cols[None] <= start + torch.arange(t)[:, None]) & (cols[None] >= pad)
    return torch.where(keep, 0.0, float("-inf"))[None].contiguous()


def _sequence(seed: int):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(1, P, H + HKV, HD, generator=g)
    v = torch.randn(1, P, HKV, HD, generator=g)
    angle = torch.arange(P)[:, None] * torch.rand(HD // 2, generator=g)[None]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[None].contiguous()
    sin = torch.cat([-angle.sin(), angle.sin()], -1)[None].contiguous()
    return qk, v, cos, sin


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_of_a_position_is_the_same_bits_alone_in_a_chunk_in_a_batch_and_after_padding(threads):
    qk, v, cos, sin = _sequence(seed=threads)
    cap = P + 8
    # the prefill: every position in one chunk, causal
    keys, values = torch.zeros(1, HKV, cap, HD), torch.zeros(1, HKV, cap, HD)
    whole = _attend(qk, v, cos, sin, keys, values, _causal(0, P), 0, threads)
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    for p in range(P):
        # the decode step of position p over the prefill's cache, one thread or two
        k1, v1 = keys.clone(), values.clone()
        alone = _attend(qk[:, p:p + 1].contiguous(), v[:, p:p + 1].contiguous(), cos[:, p:p + 1].contiguous(),
                        sin[:, p:p + 1].contiguous(), k1, v1, None, p, 3 - threads)
        assert torch.equal(bits(alone[0, 0]), bits(whole[0, p])), p
    # a chunk from position 11 on (a draft's verification), and the same rows as one of a batch of two
    for start in (11, 20):
        t = P - start
        k2, v2 = keys.clone(), values.clone()
        chunk = _attend(qk[:, start:].contiguous(), v[:, start:].contiguous(), cos[:, start:].contiguous(),
                        sin[:, start:].contiguous(), k2, v2, _causal(start, t), start, threads)
        assert torch.equal(bits(chunk[0]), bits(whole[0, start:]))
        other = torch.randn(1, t, H + HKV, HD, generator=torch.Generator().manual_seed(start))
        kb, vb = torch.cat([keys, torch.randn_like(keys)]), torch.cat([values, torch.randn_like(values)])
        batch = _attend(torch.cat([qk[:, start:], other]).contiguous(),
                        torch.cat([v[:, start:], torch.randn(1, t, HKV, HD)]).contiguous(),
                        torch.cat([cos[:, start:]] * 2).contiguous(), torch.cat([sin[:, start:]] * 2).contiguous(),
                        kb, vb, torch.cat([_causal(start, t)] * 2).contiguous(), start, threads)
        assert torch.equal(bits(batch[0]), bits(whole[0, start:]))
    # the row's keys three columns on, behind masked padding (a row of a batch whose others are longer)
    pad = 3
    kp, vp = torch.zeros(1, HKV, cap, HD), torch.zeros(1, HKV, cap, HD)
    qp = torch.cat([torch.zeros(1, pad, H + HKV, HD), qk], 1).contiguous()
    padded = _attend(qp, torch.cat([torch.zeros(1, pad, HKV, HD), v], 1).contiguous(),
                     torch.cat([torch.ones(1, pad, HD), cos], 1).contiguous(),
                     torch.cat([torch.zeros(1, pad, HD), sin], 1).contiguous(), kp, vp, _causal(0, P + pad, pad), 0,
                     threads)
    assert torch.equal(bits(padded[0, pad:]), bits(whole[0]))


def test_norms_of_a_row_are_the_same_bits_alone_and_among_rows():
    g = torch.Generator().manual_seed(0)
    x, a = torch.randn(7, 576, generator=g), torch.randn(7, 576, generator=g)
    w1, w2 = torch.randn(576, generator=g), torch.randn(576, generator=g)
    lib = native.library()
    y_all, y_one = torch.empty(7, 576), torch.empty(1, 576)
    lib.lmhead_rms_norm(x.data_ptr(), w1.data_ptr(), y_all.data_ptr(), 7, 576, 1, 1e-6, 1)
    xo_all, h_all = torch.empty(7, 576), torch.empty(7, 576)
    lib.lmhead_add_norm(x.data_ptr(), a.data_ptr(), w1.data_ptr(), w2.data_ptr(), xo_all.data_ptr(), h_all.data_ptr(),
                        7, 576, 1e-6, 0)
    for r in range(7):
        xr, ar = x[r:r + 1].clone(), a[r:r + 1].clone()
        lib.lmhead_rms_norm(xr.data_ptr(), w1.data_ptr(), y_one.data_ptr(), 1, 576, 1, 1e-6, 1)
        assert torch.equal(y_one[0].view(torch.int32), y_all[r].view(torch.int32))
        xo, h = torch.empty(1, 576), torch.empty(1, 576)
        lib.lmhead_add_norm(xr.data_ptr(), ar.data_ptr(), w1.data_ptr(), w2.data_ptr(), xo.data_ptr(), h.data_ptr(),
                            1, 576, 1e-6, 0)
        assert torch.equal(xo[0].view(torch.int32), xo_all[r].view(torch.int32))
        assert torch.equal(h[0].view(torch.int32), h_all[r].view(torch.int32))


@pytest.mark.parametrize("width", [1003, 49_152, 262_144])
def test_a_rows_normaliser_and_greedy_choice_are_the_same_bits_alone_among_rows_and_over_threads(width):
    # the decode loop's scores of chosen tokens (raw logprob = x − lse): the same numbers for a request in a
    # server round of any size as alone
    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=g) * 4
    ids = torch.randint(0, width, (5,), generator=g)
    lib = native.library()
    alone = [native.row_scores_in(lib, x[r:r + 1].contiguous(), ids[r:r + 1], 1) for r in range(5)]
    for rows in (2, 5):
        for threads in (1, 2):
            lse, greater = native.row_scores_in(lib, x[:rows].contiguous(), ids[:rows], threads)
            for r in range(rows):
                assert torch.equal(lse[r:r + 1].view(torch.int64), alone[r][0].view(torch.int64)), (rows, threads, r)
                assert int(greater[r]) == int(alone[r][1][0])
            got_ids, got_lse = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.float64)
            lib.lmhead_row_greedy(x.data_ptr(), rows, width, got_ids.data_ptr(), got_lse.data_ptr(), threads)
            one_id, one_lse = torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.float64)
            for r in range(rows):
                xr = x[r:r + 1].contiguous()
                lib.lmhead_row_greedy(xr.data_ptr(), 1, width, one_id.data_ptr(), one_lse.data_ptr(), 3 - threads)
                assert int(got_ids[r]) == int(one_id[0]) == int(x[r].argmax())
                assert torch.equal(got_lse[r:r + 1].view(torch.int64), one_lse.view(torch.int64))


def _bits(value) -> list:
    """A row pass's answer as comparable bits: tensors by their bytes, floats by their float64 bits."""
    import struct

    if value is None:
        return [None]
    if isinstance(value, torch.Tensor):
        return [value.dtype, value.contiguous().view(torch.uint8).tolist()]
    if isinstance(value, float):
        return [struct.pack("<d", value)]
    if isinstance(value, (tuple, list)):
        return [b for v in value for b in _bits(v)]
    return [value]


@pytest.mark.parametrize("width", [1003, 49_152, 262_144])
def test_the_sampler_row_passes_are_the_same_bits_over_any_number_of_threads(width):
    # a sampled request's row passes (its normaliser and entropy, the moments the declared steps read, top-p's set,
    # locally typical sampling's set, an unseeded draw) cut a wide row into pieces by its width alone, so a row's
    # sums are the same bits whatever the threads — and so whatever else is in the server's round
    g = torch.Generator().manual_seed(width)
    x = torch.randn(width, generator=g) * 3
    x[torch.randint(0, width, (7,), generator=g)] += 12.0  # a few strong candidates, as a model's row has
    x[torch.randint(0, width, (width // 9,), generator=g)] = float("-inf")  # masked tokens
    passes = {
        "moments": lambda: native.row_moments(x, sigma=True),
        "lse bounded": lambda: native.row_lse_bounded(x),
        "top-p": lambda: native.top_p_row(x, 0.8, 0.9),
        "typical": lambda: native.typical_row(x, 0.9),
        "draw, temperature": lambda: native.sample_row(x, 0.7, 0, 1.0, 0.0, 0.6180339),
        "draw, top-p": lambda: native.sample_row(x, 0.7, 0, 0.9, 0.0, 0.41421356),
        "draw, min-p": lambda: native.sample_row(x, 0.7, 0, 1.0, 0.02, 0.7320508),
        "draw, top-k": lambda: native.sample_row(x, 0.7, 40, 1.0, 0.0, 0.2360679),
    }
    before = torch.get_num_threads()
    try:
        answers = {}
        for threads in (1, 2, 3, 5, 9):
            torch.set_num_threads(threads)
            answers[threads] = {name: _bits(run()) for name, run in passes.items()}
    finally:
        torch.set_num_threads(before)
    assert all(answers[1][name] != [None] for name in passes), answers[1]
    for threads in (2, 3, 5, 9):
        for name in passes:
            assert answers[threads][name] == answers[1][name], (name, threads)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen2_moe"])
def test_a_greedy_requests_tokens_and_logprobs_are_the_same_bits_alone_in_a_batch_and_with_drafts(tmp_path,
                                                                                                   monkeypatch, arch):
    # end to end over a GGUF file run by the kernels: a prompt's steps beside two prompts of other lengths (a
    # padded prefill, then batched decode steps) equal the prompt's steps alone, bit for bit
    from tiny_gguf import write_tiny_gguf

    from lmhead import SamplingConfig, load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model(str(write_tiny_gguf(tmp_path / "m.gguf", arch, kind="Q8_0")), progress=False)
    prompts = ["The cat sat on the mat. The dog", "Once upon a time there", "A B C D E F G H"]

    def steps(ps, draft="none"):
        out: dict[int, list] = {}
        for s in model.generate(ps, max_new_tokens=12, config=SamplingConfig(temperature=0), draft=draft):
            out.setdefault(s.index, []).append((s.token_id, s.logprob, s.raw_logprob, s.rank))
        return out

    alone = steps(prompts[0])[0]
    batch = steps(prompts)
    assert len(alone) == 12 and batch[0] == alone
    assert steps(prompts[1:2])[0] == batch[1]
    # with n-gram drafts: verifications of several positions, rows whose rejected drafts leave masked columns
    # beside rows that kept theirs
    drafted = steps(prompts, "ngram")
    assert drafted[0] == alone and drafted[1] == batch[1] and drafted[2] == batch[2]


@pytest.mark.model
@pytest.mark.slow
def test_a_sampled_requests_tokens_and_logprobs_are_the_same_bits_alone_on_one_thread_and_joining_a_batch():
    # end to end on a packaged model (a vocabulary of 49,152: its row passes are cut into pieces): seeded sampled
    # requests of the pipeline's kinds — top-p, min-p, typical, top-n-sigma and mirostat (the declared steps' moments),
    # top-k, temperature alone, η/ε cutoffs, top-a with dynamic temperature, XTC, DRY with penalties, the cuts
    # together — with and without logprobs and top logprobs, alone on one thread and joining a running batch of
    # each other on two, give the same tokens and the same bits
    from server_harness import real_model
    from test_batching import alone, run_staggered

    from lmhead import SamplingConfig

    model = real_model("smollm2-135m")
    requests = [
        ("The capital of France is", SamplingConfig(temperature=0.8, top_p=0.9, seed=1), 8, {"top_logprobs": 2}),
        ("Once upon a time, in a small village,", SamplingConfig(temperature=0.9, min_p=0.05, seed=2), 8, {}),
        ("def add(a, b):", SamplingConfig(temperature=0.8, typical_p=0.9, seed=3), 8, {"top_logprobs": 1}),
        ("The best way to learn", SamplingConfig(temperature=1.0, top_n_sigma=1.5, seed=4), 8, {}),
        ("My favourite food is", SamplingConfig(temperature=1.0, mirostat=2, seed=5), 8, {}),
        ("Water boils at", SamplingConfig(temperature=0.7, top_k=40, seed=6), 8, {"top_logprobs": 2}),
        ("Hello, my name is", SamplingConfig(temperature=1.0, seed=7), 8, {"exact_logprobs": True}),
        ("In 1492,", SamplingConfig(temperature=0.9, eta_cutoff=3e-4, epsilon_cutoff=3e-4, seed=8), 8, {}),
        ("Q: What is 2+2?", SamplingConfig(temperature=0.9, top_a=0.2, dynatemp_range=0.5, seed=9), 8,
         {"top_logprobs": 1}),
        ("The recipe needs", SamplingConfig(temperature=0.9, xtc_probability=0.5, xtc_threshold=0.1, seed=10), 8, {}),
        ("I think that", SamplingConfig(temperature=0.9, dry_multiplier=0.8, repetition_penalty=1.2,
                                        presence_penalty=0.3, frequency_penalty=0.2, seed=11), 8, {}),
        ("Rain falls", SamplingConfig(temperature=0.7, top_k=50, top_p=0.8, min_p=0.02, seed=12), 8, {}),
    ]

    def steps_of(steps):
        return [(s.token_id, s.text, s.finish_reason, s.rank, s.logprob, s.raw_logprob,
                 [(t.token_id, t.logprob) for t in s.top_logprobs]) for s in steps]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = [steps_of(alone(model, p, cfg, n, kw)) for p, cfg, n, kw in requests]
        torch.set_num_threads(2)
        got = run_staggered(model, requests, joins=[0, 0, 1, 2, 2, 3, 5, 0, 1, 3, 4, 6])
    finally:
        torch.set_num_threads(before)
    for i, steps in enumerate(got):
        assert steps_of(steps) == want[i], requests[i]

"""The compressed head: its greedy token and top-k equal the fp32 head's; its bounds hold; it falls back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import reference
import torch
import torch.nn.functional as F

from lmhead.compressed import HEAD_MODES, CompressedHead, column_scales, kernels, onednn_int8_usable, quantize
from lmhead.models.heads import resolve_head_mode, use_head

# (bits, kernel) of every compressed path this torch build can run
KERNELS8 = ((["fbgemm"] if kernels.fbgemm_int8_usable() else []) + (["onednn"] if onednn_int8_usable() else [])
            + ["int8pack"])
PATHS = [(8, k) for k in KERNELS8] + [(4, "int4pack")]


def _weights(V: int, D: int, seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    # Rows of different scales (as real embeddings have), so per-row scales matter.
    w = torch.randn(V, D, generator=g) * (0.02 + 0.08 * torch.rand(V, 1, generator=g))
    b = torch.randn(V, generator=g) * 0.1 if bias else None
    return w, b


def _hidden(N: int, D: int, seed: int = 1, outliers: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g) * 2
    if outliers:  # a few massive dimensions, as the final hidden states of real models have
        h[:, :3] *= 25
    return h


@pytest.mark.parametrize(("bits", "kernel"), PATHS)
@pytest.mark.parametrize(("bias", "softcap"), [(False, None), (True, None), (True, 20.0)])
def test_topk_exact_equals_the_fp32_head(bits, kernel, bias, softcap):
    V, D = 3001, 200  # not powers of two: the head pads both for the kernels
    w, b = _weights(V, D, bias=bias)
    h = _hidden(6, D)
    head = CompressedHead(w, bias=b, softcap=softcap, bits=bits, kernel=kernel, max_rescore=V,
                          calibration=_hidden(16, D, seed=40))
    for k in (1, 5, 40):
        ref_v, ref_i = reference.head_topk(h, w, k, b, softcap)
        v, i = head.topk_exact(h, k)
        assert torch.equal(i, ref_i)
        torch.testing.assert_close(v, ref_v, **reference.tolerance(torch.float32))
    assert torch.equal(head.argmax_exact(h), reference.head_topk(h, w, 1, b, softcap)[1][:, 0])


def test_forward_makes_the_top_tokens_exact_and_keeps_the_shape():
    V, D = 4099, 256
    w, _ = _weights(V, D, seed=3)
    h = _hidden(6, D, seed=4).view(2, 3, D)
    head = CompressedHead(w, bits=8, exact_k=16)
    out = head(h)
    assert out.shape == (2, 3, V) and out.dtype == torch.float32
    ref = reference.lm_head_logits(h, w)
    ref_v, ref_i = torch.topk(ref, 16)
    v, i = torch.topk(out, 16)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(v, ref_v, **reference.tolerance(torch.float32))
    last = head(h, logits_to_keep=1)
    assert last.shape == (2, 1, V)
    assert torch.equal(last.argmax(-1), ref[:, -1:].argmax(-1))


@pytest.mark.parametrize("kernel", KERNELS8)
def test_adversarial_near_ties_below_the_quantisation_error(kernel):
    # 200 rows that all score within ~1e-3 of each other on h, far below the int8 error (~1e-2): the
    # approximate logits cannot order them, the bound must send them all to re-scoring.
    D, V = 256, 2000
    g = torch.Generator().manual_seed(7)
    h = torch.randn(1, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.05
    base = torch.randn(D, generator=g) * 0.2
    base = base + (3.0 - base @ h[0]) * h[0] / (h[0] @ h[0])  # base·h = 3, far above the other rows
    noise = torch.randn(200, D, generator=g)
    noise -= (noise @ h[0])[:, None] * h[0] / (h[0] @ h[0])  # orthogonal to h: logits unchanged...
    w[:200] = base + 0.02 * noise
    w[:200] += torch.linspace(0, 1e-3, 200)[:, None] * h[0] / (h[0] @ h[0])  # ...then 5e-6 apart
    head = CompressedHead(w, bits=8, kernel=kernel, max_rescore=V)
    ref_v, ref_i = reference.head_topk(h, w, 10)
    y, bound = head.error_bound(h)
    assert float((y[0, :200] - reference.lm_head_logits(h, w)[0, :200]).abs().max()) > 1e-3  # truly unresolved
    v, i = head.topk_exact(h, 10)
    assert torch.equal(i, ref_i)
    assert int(i[0, 0]) == 199
    assert head.argmax_exact(h).item() == 199
    assert head.stats["max_candidates"] >= 200


def test_exact_ties_give_the_reference_values():
    D, V = 128, 500
    w, _ = _weights(V, D, seed=5)
    w[10] = w[20] = w[30] = w[40]  # duplicate rows: equal logits on every hidden state
    h = _hidden(3, D, seed=6)
    head = CompressedHead(w, bits=8, max_rescore=V)
    ref_v, _ = reference.head_topk(h, w, 8)
    v, _ = head.topk_exact(h, 8)
    torch.testing.assert_close(v, ref_v, **reference.tolerance(torch.float32))


@pytest.mark.parametrize(("bits", "kernel"), PATHS)
@pytest.mark.parametrize("calibrated", [False, True])
def test_error_bound_holds_on_every_logit(bits, kernel, calibrated):
    V, D = 2048, 320
    w, b = _weights(V, D, seed=8, bias=True)
    # calibrated on hidden states without outliers: the bound must also hold on states unlike them
    calibration = _hidden(16, D, seed=41, outliers=False) if calibrated else None
    head = CompressedHead(w, bias=b, bits=bits, kernel=kernel, calibration=calibration)
    for outliers in (False, True):
        h = _hidden(8, D, seed=9, outliers=outliers)
        y, bound = head.error_bound(h)
        ref = reference.lm_head_logits(h, w, b)
        assert bool(((y - ref).abs() <= bound).all())
        assert float(((y - ref).abs() / bound).max()) > 0.01  # and it is not vacuous


def test_the_int8pack_kernel_accumulates_within_the_assumed_error_model():
    # The bound assumes fp32 accumulation of bf16(h)·ŵ and one bf16 rounding of the result: check that
    # model against float64 arithmetic, including large hidden values.
    V, D = 1024, 640
    w, _ = _weights(V, D, seed=10)
    head = CompressedHead(w, bits=8, kernel="int8pack")
    h = _hidden(4, D, seed=11) * 10
    exact = reference.approx_logits_exact_arithmetic(h, reference.int8_rowwise_dequant(w))
    y = head.approx_logits(h).double()
    hb = h.to(torch.bfloat16).double()
    wq = reference.int8_rowwise_dequant(w)
    gamma = D * 2.0**-24 / (1 - D * 2.0**-24)
    allowed = gamma * (hb.abs() @ wq.abs().T) + 2.0**-8 / (1 - 2.0**-8) * y.abs()
    assert bool(((y - exact).abs() <= allowed).all())


@pytest.mark.skipif(not onednn_int8_usable(), reason="no usable oneDNN int8 inner product")
def test_the_onednn_kernel_is_exact_up_to_its_output_rounding():
    # int32 accumulation of the uint8 activation times the int8 rows, then fp32 scaling: within 8u·|ŷ| of
    # the float64 product of what the kernel was given (x̂ and ŵ'), with column scales in play.
    V, D = 1024, 640
    w, _ = _weights(V, D, seed=10)
    head = CompressedHead(w, bits=8, kernel="onednn", calibration=_hidden(8, D, seed=42))
    assert not torch.equal(head.column_scale, torch.ones(D))
    h = (_hidden(4, D, seed=11) * 10)[:1]
    y, xhat = kernels.onednn_linear(h / head.column_scale, kernels.OneDNNWeight(head.qweight[:V, :D],
                                                                                 head.scales[:V]))
    assert torch.equal(head.approx_logits(h), y)  # one row: the head's approximate pass is this kernel
    # what the kernel multiplies by: W·diag(c) quantised per row (the same as quantising W' directly)
    dequant = reference.int8_rowwise_dequant(w * head.column_scale)
    torch.testing.assert_close(dequant, head.qweight[:V, :D].double() * head.scales[:V].double()[:, None],
                               rtol=0, atol=0)
    exact = xhat @ dequant.T
    assert bool(((y.double() - exact).abs() <= 8 * 2.0**-24 * exact.abs() + 1e-30).all())


@pytest.mark.skipif(not kernels.fbgemm_int8_usable(), reason="no usable fbgemm dynamic int8 linear")
def test_the_fbgemm_kernel_sees_our_grid_and_is_exact_up_to_its_output_rounding():
    # fbgemm quantises its input itself; handed our power-of-two grid with both ends present, it must
    # multiply exactly x̂ (several rows on one grid) and sum in int32: within 8u·|ŷ| of the float64 product.
    V, D = 1024, 640
    w, _ = _weights(V, D, seed=10)
    head = CompressedHead(w, bits=8, kernel="fbgemm", calibration=_hidden(8, D, seed=42))
    assert not torch.equal(head.column_scale, torch.ones(D))
    h = _hidden(4, D, seed=11) * 10
    y, xhat, magnitude = kernels.fbgemm_linear(h / head.column_scale,
                                               kernels.FbgemmWeight(head.qweight[:V, :D], head.scales[:V]))
    assert torch.equal(head.approx_logits(h), y)  # the head's approximate pass is this kernel, all rows
    hp = h / head.column_scale
    one_grid, s, _ = kernels.fbgemm_grid(hp)
    assert float((one_grid - hp).abs().max()) <= 0.5 * s  # one 7-bit grid covers h' ...
    assert float((xhat - hp.double()).abs().max()) <= 0.5 * s / 16  # ... and the residual's part refines it
    dequant = reference.int8_rowwise_dequant(w * head.column_scale)
    exact = xhat @ dequant.T
    assert bool(((y.double() - exact).abs() <= 10 * 2.0**-24 * magnitude.double() + 1e-30).all())


def test_column_scales_are_powers_of_two_that_flatten_the_outliers():
    D = 64
    w, _ = _weights(500, D, seed=43)
    h = _hidden(32, D, seed=44)  # dimensions 0..2 are 25x the others
    c = column_scales(h, w)
    assert c.shape == (D,) and bool((torch.log2(c) == torch.round(torch.log2(c))).all())
    assert float(c[:3].min()) > float(c[3:].max())  # the outlier dimensions get the largest scales
    spread = (h / c).abs().amax(0)
    assert float(spread.max() / spread.median()) < float(h.abs().amax(0).max() / h.abs().amax(0).median())


@pytest.mark.skipif(not onednn_int8_usable(), reason="no usable oneDNN int8 inner product")
def test_calibration_cuts_the_candidates_on_outlier_hidden_states():
    V, D = 4000, 256
    w, _ = _weights(V, D, seed=45)
    h = _hidden(8, D, seed=46)
    plain = CompressedHead(w, bits=8, kernel="onednn", max_rescore=V)
    calibrated = CompressedHead(w, bits=8, kernel="onednn", max_rescore=V, calibration=_hidden(16, D, seed=47))
    for head in (plain, calibrated):
        for n in range(h.shape[0]):  # one row per call, as in decoding: the onednn kernel serves it
            assert torch.equal(head.topk_exact(h[n:n + 1], 10)[1], reference.head_topk(h[n:n + 1], w, 10)[1])
    assert calibrated.stats["candidates"] < 0.7 * plain.stats["candidates"]  # measured: 268 vs 483


@pytest.mark.parametrize("kernel", KERNELS8)
def test_probabilities_are_within_the_stated_bound(kernel):
    V, D = 3000, 256
    w, _ = _weights(V, D, seed=12)
    h = _hidden(4, D, seed=13)
    head = CompressedHead(w, bits=8, exact_k=64, kernel=kernel, calibration=_hidden(8, D, seed=48))
    p = torch.softmax(head(h), -1)
    ref = torch.softmax(reference.lm_head_logits(h, w), -1)
    bound = head.probability_error_bound(h)
    err = (p - ref).abs().amax(-1)
    assert bool((err <= bound).all())
    if kernel == "int8pack":
        assert bool((bound < 1.0).all())  # not vacuous
    # One row per call: the onednn kernel's own uint8 activations. Their rounding is coarser than bf16's, so
    # the bound is loose on these flat distributions (logits std ~2); on peaked ones (h x 4, as real models'
    # final states give) it is small.
    for scale in (1.0, 4.0):
        hs = h * scale
        ref = torch.softmax(reference.lm_head_logits(hs, w), -1)
        for n in range(4):
            p = torch.softmax(head(hs[n:n + 1]), -1)
            bound = float(head.probability_error_bound(hs[n:n + 1])[0])
            # + fp32 rounding: re-scored logits equal the reference's up to summation order (~1e-6)
            assert float((p - ref[n:n + 1]).abs().max()) <= bound + 1e-6
            assert scale == 1.0 or bound < 0.1


def test_the_kernel_is_chosen_by_how_tight_the_bound_stays_on_the_calibration_rows():
    V, D = 3000, 128
    w, _ = _weights(V, D, seed=49)
    assert CompressedHead(w, bits=8).kernel == "int8pack"  # no calibration: bf16 activations, the tight bound
    # with calibration: the first of fbgemm, onednn whose bound stays tight there, else int8pack
    first = next((k for k in KERNELS8 if k != "int8pack"), None)
    if first is not None:
        assert CompressedHead(w, bits=8, calibration=_hidden(8, D, seed=50)).kernel == first
        assert CompressedHead(w, bits=8, calibration=_hidden(8, D, seed=50), max_rescore=8).kernel == "int8pack"
        # (max_rescore=8: a re-scoring budget that the coarser activation grids cannot meet there)


def test_too_many_candidates_fall_back_to_the_full_head_and_are_counted():
    V, D = 1500, 128
    w, _ = _weights(V, D, seed=14)
    h = _hidden(2, D, seed=15)
    head = CompressedHead(w, bits=4, max_rescore=1)
    v, i = head.topk_exact(h, 3)
    ref_v, ref_i = reference.head_topk(h, w, 3)
    assert torch.equal(i, ref_i)
    assert head.stats["fallback_rows"] == 2 and head.stats["calls"] == 1
    head.reset_stats()
    assert head.stats["fallback_rows"] == 0


def test_many_rows_use_the_full_head():
    V, D = 700, 64
    w, _ = _weights(V, D, seed=16)
    head = CompressedHead(w, bits=8, max_rows=4)
    h = _hidden(9, D, seed=17)
    out = head(h)
    torch.testing.assert_close(out, reference.lm_head_logits(h, w), **reference.tolerance(torch.float32))
    assert head.stats["full_rows"] == 9


def test_approximate_modes_rescore_nothing():
    V, D = 900, 64
    w, _ = _weights(V, D, seed=18)

    class Plain:
        weight, bias, softcap = w, None, None

    head = CompressedHead.from_mode(Plain(), "int8")
    h = _hidden(3, D, seed=19)
    y, bound = head.error_bound(h)
    torch.testing.assert_close(head(h), y)
    assert head.stats["candidates"] == 0
    assert CompressedHead.from_mode(Plain, "fp32") is Plain


def test_logits_exact_for_given_ids():
    V, D = 1000, 96
    w, b = _weights(V, D, seed=20, bias=True)
    head = CompressedHead(w, bias=b, softcap=15.0, bits=8)
    h = _hidden(2, D, seed=21)
    ids = torch.tensor([0, 5, 999, 5])
    ref = reference.lm_head_logits(h, w, b, 15.0)[:, ids]
    torch.testing.assert_close(head.logits_exact_for(h, ids), ref, **reference.tolerance(torch.float32))


def test_memory_accounting():
    w, _ = _weights(1024, 256, seed=22)
    assert CompressedHead(w, bits=8, kernel="int8pack").compressed_bytes == 1024 * 256 + 1024 * 2
    if onednn_int8_usable():  # fp32 scales; the plain int8 copy (for the disk cache) is extra memory
        head = CompressedHead(w, bits=8, kernel="onednn")
        assert head.compressed_bytes == 1024 * 256 + 1024 * 4
        assert head.extra_bytes == head.compressed_bytes + 1024 * 6 * 4 + 1024 * 256 + 1024 * 2
    assert CompressedHead(w, bits=4).compressed_bytes == 1024 * 256 // 2 + 1024 * (256 // 32) * 2 * 2


def test_bad_input_is_rejected_with_the_allowed_range():
    w, _ = _weights(256, 64, seed=23)
    with pytest.raises(ValueError, match="bits"):
        CompressedHead(w, bits=3)
    with pytest.raises(ValueError, match="group_size"):
        CompressedHead(w, bits=8, group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        CompressedHead(w, bits=4, group_size=48)
    with pytest.raises(TypeError, match="weight"):
        CompressedHead(torch.zeros(5))
    with pytest.raises(TypeError, match="weight"):
        CompressedHead(torch.zeros(4, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="bias"):
        CompressedHead(w, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="softcap"):
        CompressedHead(w, softcap=-1.0)
    with pytest.raises(ValueError, match="exact_k"):
        CompressedHead(w, exact_k=-1)
    with pytest.raises(ValueError, match="kernel must be one of fbgemm, onednn, int8pack for bits=8"):
        CompressedHead(w, bits=8, kernel="cublas")
    with pytest.raises(ValueError, match="kernel must be one of int4pack for bits=4"):
        CompressedHead(w, bits=4, kernel="onednn")
    with pytest.raises(ValueError, match=r"smoothing_alpha must be a number in \[0, 1\]"):
        CompressedHead(w, smoothing_alpha=1.5)
    with pytest.raises(ValueError, match=r"calibration must be hidden states \[N, D=64\]"):
        CompressedHead(w, calibration=torch.zeros(3, 65))
    with pytest.raises(ValueError, match="head mode"):
        CompressedHead.from_mode(w, "int2")
    head = CompressedHead(w)
    with pytest.raises(ValueError, match="last dimension D=64"):
        head(torch.zeros(2, 63))
    with pytest.raises(TypeError, match="hidden"):
        head(torch.zeros(2, 64, dtype=torch.long))
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 256\]"):
        head.topk_exact(torch.zeros(1, 64), 0)
    with pytest.raises(ValueError, match="ids"):
        head.logits_exact_for(torch.zeros(1, 64), torch.tensor([256]))
    with pytest.raises(ValueError, match="logits_to_keep"):
        head(torch.zeros(1, 2, 64), logits_to_keep=-1)
    with pytest.raises(ValueError, match=r"exact_k must be an int in \[0, 256\]"):
        head(torch.zeros(1, 64), exact_k=257)


def test_a_softcap_must_be_finite_like_everywhere_else():
    w, _ = _weights(256, 64, seed=23)
    for bad in (float("inf"), float("nan"), 0.0, True):
        with pytest.raises(ValueError, match="softcap must be None or a finite number > 0"):
            CompressedHead(w, softcap=bad)


def test_the_call_signature_is_the_heads_one():
    # head(hidden, logits_to_keep=0, exact_k=None): None is the head's own exact_k, as for LMHead
    w, b = _weights(500, 64, seed=34, bias=True)
    h = _hidden(3, 64, seed=35)
    head = CompressedHead(w, bias=b, bits=8, exact_k=5)
    assert head.exact_k == 5 and CompressedHead(w[:40], exact_k=64).exact_k == 40  # at most V
    torch.testing.assert_close(head(h, exact_k=None), head(h), rtol=0, atol=0)
    assert torch.equal(torch.topk(head(h, exact_k=20), 20).indices, reference.head_topk(h, w, 20, b)[1])
    # approx_logits: the kernel's pass alone, bias added: the approximate values error_bound bounds
    y, bound = head.error_bound(h)
    torch.testing.assert_close(head.approx_logits(h), y, rtol=0, atol=0)
    assert bool(((y - reference.lm_head_logits(h, w, b)).abs() <= bound).all())


@pytest.mark.parametrize("kernel", KERNELS8)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_hidden_falls_back_to_the_full_head(kernel, value):
    w, _ = _weights(256, 64, seed=24)
    head = CompressedHead(w, kernel=kernel, calibration=_hidden(8, 64, seed=25))
    h = torch.zeros(1, 64)
    h[0, 0] = value
    out = head(h)
    assert torch.equal(out.isnan(), reference.lm_head_logits(h, w).isnan())  # the full head's answer
    assert not bool(torch.isfinite(out).any())
    assert head.stats["fallback_rows"] == 1


class _FakeModel:
    """What `use_head` needs of a `Model`: `.exact_head` (weight, bias, softcap) and `.path` (the cache folder)."""

    def __init__(self, weight: torch.Tensor, path: Path) -> None:
        self.exact_head = self.head = type("Head", (), {"weight": weight, "bias": None, "softcap": None})()
        self.path = path


def _model_folder(root: Path, sha: str) -> Path:
    folder = root / "models" / "m"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"files": {"model.safetensors": {"sha256": sha}}}))
    return folder


def test_use_head_swaps_the_head_and_caches_the_compressed_tensors(tmp_path, monkeypatch):
    w, _ = _weights(640, 64, seed=25)
    folder = _model_folder(tmp_path, "ab" * 32)
    model = use_head(_FakeModel(w, folder), "exact-int8")
    assert isinstance(model.head, CompressedHead) and model.exact_head.weight is w
    cached = list((tmp_path / "heads").glob("*-exact-int8.safetensors"))
    assert len(cached) == 1
    h = _hidden(2, 64, seed=26)

    def no_compress(*args):
        raise AssertionError("compressed again although the cache holds it")

    monkeypatch.setattr(quantize, "quantize", no_compress)
    again = use_head(_FakeModel(w, folder), "exact-int8")
    assert torch.equal(again.head(h), model.head(h)) and again.head.kernel == model.head.kernel
    assert use_head(again, "fp32").head is again.exact_head
    with pytest.raises(ValueError, match="head must be one of auto"):
        use_head(again, "exact-int3")
    assert use_head(again, "auto").head is again.exact_head  # a small head: fp32 is as fast


def test_a_cached_state_of_other_weights_is_not_used(tmp_path):
    w, _ = _weights(640, 64, seed=27)
    other, _ = _weights(640, 64, seed=28)
    folder = _model_folder(tmp_path, "cd" * 32)
    use_head(_FakeModel(other, folder), "exact-int8")  # caches the other weights' state under the same key
    model = use_head(_FakeModel(w, folder), "exact-int8")
    h = _hidden(3, 64, seed=29)
    assert torch.equal(model.head.argmax_exact(h), reference.head_topk(h, w, 1)[1][:, 0])
    y, bound = model.head.error_bound(h)
    assert bool(((y - reference.lm_head_logits(h, w)).abs() <= bound).all())


def test_loss_is_the_full_precision_loss():
    w, _ = _weights(300, 32, seed=30)
    head = CompressedHead(w, bits=8)
    h = _hidden(5, 32, seed=31)
    t = torch.tensor([1, 2, 3, 299, 0])
    torch.testing.assert_close(head.loss(h, t), F.cross_entropy(F.linear(h, w), t),
                               **reference.tolerance(torch.float32))


def test_strict_topk_is_the_full_heads_answer_on_near_ties():
    w, _ = _weights(400, 64, seed=32)
    h = _hidden(1, 64, seed=33)
    row = w[8] + 1000 * h[0] / (h[0] @ h[0])  # far above the others...
    w[7], w[8] = row, row  # ...and an exact tie: no summation order can separate them
    head = CompressedHead(w, bits=8)
    v, i = head.topk_exact(h, 5, strict=True)
    ref = reference.lm_head_logits(h, w)
    assert head.stats["tie_fallback_rows"] == 1
    assert torch.equal(v, torch.topk(ref, 5).values) and torch.equal(i, torch.topk(ref, 5).indices)


def test_auto_picks_int8_for_big_heads_and_fp32_for_small_ones():
    assert resolve_head_mode("auto", torch.empty(262144, 640)) == "exact-int8"  # Gemma 3: 671 MB
    assert resolve_head_mode("auto", torch.empty(49152, 576)) == "fp32"  # SmolLM2: 113 MB
    # the fp32 head reading the GGUF file's codes is exact and faster than both
    assert resolve_head_mode("auto", torch.empty(262144, 640), coded=True) == "fp32"
    assert resolve_head_mode("int4", torch.empty(4, 4)) == "int4"
    with pytest.raises(ValueError, match="head must be one of auto"):
        resolve_head_mode("fast", torch.empty(4, 4))


def test_modes_are_documented():
    assert set(HEAD_MODES) == {"fp32", "exact-int8", "int8", "int4"}


# --- on a real model's hidden states --------------------------------------------------------------------


@pytest.mark.model
def test_exact_on_smollm2_hidden_states():
    from lmhead import load_model

    model = load_model("smollm2-135m", progress=False)
    w = model.head.weight.detach()
    head = CompressedHead(w, bits=8)
    prompts = ["The cat sat on the", "def fibonacci(n):\n    return", "The capital of France is",
               "1, 2, 3, 4,", "Once upon a time, in a land far away, there lived"]
    rows = []
    for p in prompts:
        ids = torch.tensor([model.encode(p)])
        rows.append(model.hidden_states(ids)[0])  # every position: many different distributions
    h = torch.cat(rows)
    ref_v, ref_i = reference.head_topk(h, w, 10)
    for n in range(h.shape[0]):
        v, i = head.topk_exact(h[n:n + 1], 10)
        assert torch.equal(i[0], ref_i[n])
        torch.testing.assert_close(v[0], ref_v[n], **reference.tolerance(torch.float32))
        assert head.argmax_exact(h[n:n + 1]).item() == ref_i[n, 0].item()
    assert head.stats["fallback_rows"] == 0
    assert head.stats["max_candidates"] < 5000
    p = torch.softmax(head(h[-1:]), -1)
    ref = torch.softmax(F.linear(h[-1:], w), -1)
    assert float((p - ref).abs().max()) < 1e-3
    assert math.isfinite(float(head.probability_error_bound(h[-1:])[0]))


@pytest.mark.model
def test_load_model_with_a_compressed_head_generates_the_fp32_tokens():
    from lmhead import SamplingConfig, load_model
    greedy = SamplingConfig(temperature=0.0)
    fp32 = load_model("smollm2-135m", head="fp32", progress=False)
    exact = load_model("smollm2-135m", head="exact-int8", progress=False)
    assert isinstance(exact.head, CompressedHead)
    for prompt in ("The cat sat on the", "In a hole in the ground"):
        a = [s.token_id for s in fp32.generate(prompt, 24, config=greedy)]
        b = [s.token_id for s in exact.generate(prompt, 24, config=greedy)]
        assert a == b
    assert Path(exact.path).exists()


@pytest.mark.model
def test_gemmas_exact_int8_head_is_exact_on_its_hidden_states():
    # Gemma 3's exact-int8 head (the default where the GGUF codes are not available): calibrated column
    # scales, the first of the fbgemm and onednn kernels that is usable (both are tight enough on Gemma's
    # calibration rows)
    from lmhead import load_model

    model = load_model("gemma-3-270m", progress=False, head="exact-int8")
    head = model.head
    assert isinstance(head, CompressedHead)
    assert head.kernel == next((k for k in KERNELS8 if k != "int8pack"), "int8pack")
    w = head.weight.detach()
    prompts = ["The cat sat on the", "def fibonacci(n):\n    return", "Le chat est", "1, 2, 3, 4,"]
    h = torch.cat([model.hidden_states(torch.tensor([model.encode(p)]))[0] for p in prompts])
    head.reset_stats()
    for n in range(h.shape[0]):  # one row per call, as in decoding
        v, i = head.topk_exact(h[n:n + 1], 10)
        ref_v, ref_i = reference.head_topk(h[n:n + 1], w, 10)
        assert torch.equal(i, ref_i)
        torch.testing.assert_close(v, ref_v, **reference.tolerance(torch.float32))
        p = torch.softmax(head(h[n:n + 1]), -1)
        assert float((p - torch.softmax(F.linear(h[n:n + 1], w), -1)).abs().max()) < 1e-3
    # a rare row has too many candidates and takes the fp32 head (still exact): measured 0-1 of these 40
    assert head.stats["fallback_rows"] <= 2


def test_predictions_show_the_fp32_heads_candidates_beyond_exact_k():
    # predict(head="decode") runs the model's (compressed) head but asks it for as many exact tokens as it
    # shows: 120 > 64 (the default, head="exact", is the fp32 head itself)
    from tiny import tiny_model

    from lmhead import Model

    hf, tok = tiny_model("llama")
    model = use_head(Model(hf, tok), "exact-int8", cache=False)
    assert isinstance(model.head, CompressedHead) and model.exact_head is not model.head
    model.head.reset_stats()
    pred = model.predict("the cat sat", top=120, head="decode")
    assert model.head.stats["calls"] == 1  # the model's own head served it
    ids = torch.tensor([model.encode("the cat sat")])
    ref = model.exact_head(model.hidden_states(ids)[:, -1])[0]
    got = torch.tensor([c.logit for c in pred.candidates])
    torch.testing.assert_close(got, torch.topk(ref, 120).values, **reference.tolerance(torch.float32))

"""The integer path of coded products (kernels/sliced_kernel.h: the query row in 8-bit slices, vpdpbusd on
AVX-512 VNNI; packed 4-bit codes and int8 codes without offsets) against float64: within the float32 product's
error bound γ_K·Σ|w·x| on random rows, outlier channels, tiny and zero groups and real activations of both
packaged models; each row the same bits alone or in a batch; rows it cannot bound (non-finite, near float32's
smallest) through the float32 path; the choice of path per machine measured once and kept."""

from __future__ import annotations

import json

import pytest
import torch
from reference import coded_weight, float32_dot_bound

from lmhead.kernels import native
from lmhead.models.coded_linear import CodedLinear
from lmhead.models.quant_types import LEVELS

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None or LIB.lmhead_sliced(-1) == 0 and LIB.lmhead_sliced(3) == 0,
                                reason="the integer path is built only where the CPU has AVX-512 VNNI")


KINDS = ["unsigned", "signed", "signed16", "offsets16", "iq4", "mxfp4", "int8", "int8_16", "int8_q5"]


@pytest.fixture
def sliced():
    """The integer path on for the test, the machine's choice restored after it."""
    before = LIB.lmhead_sliced(-1)
    LIB.lmhead_sliced(3)
    yield
    LIB.lmhead_sliced(before)


def _matrix(n: int, k: int, kind: str, g: torch.Generator) -> tuple[CodedLinear, torch.Tensor]:
    """A coded matrix and the float64 weights it encodes: packed 4-bit "unsigned" (Q4_1, Q4_K: codes 0..15 with
    offsets), "signed" (Q4_0: −8..7), "signed16" (Q3_K: groups of 16), "offsets16" (Q2_K: 0..3, offsets), a level
    table's ("iq4": IQ4_NL, IQ4_XS; "mxfp4"); int8 codes without offsets, one a byte: "int8" (Q8_0), "int8_16"
    (Q6_K: groups of 16), "int8_q5" (Q5_0)."""
    group = 16 if kind.endswith("16") else 32
    if kind in LEVELS:  # a level table's layout: the codes are its levels
        codes = torch.from_numpy(LEVELS[kind])[torch.randint(0, 16, (n, k), generator=g)]
    else:
        low, high = {"unsigned": (0, 16), "signed": (-8, 8), "signed16": (-4, 4), "offsets16": (0, 4),
                     "int8": (-128, 128), "int8_16": (-32, 32), "int8_q5": (-16, 16)}[kind]
        codes = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    offset = torch.randn(n, k // group, generator=g) * 0.01 if kind in ("unsigned", "offsets16") else None
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    w = coded_weight(codes, scale, offset)
    four_bit = (kind if kind in LEVELS else None if kind.startswith("int8") else "unsigned" if kind == "unsigned"
                else "signed")
    coded = CodedLinear(codes, scale, offset, four_bit=four_bit)
    assert coded.four_bit == four_bit and coded.group == group
    assert coded.flags & native.ROWS4  # the integer path reads blocks of four rows
    return coded, w


def _within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """The largest |y − x·wᵀ| (float64) as a fraction of the float32 dot product's bound γ_K·Σ|w·x|."""
    return float(((y.double() - x.double() @ w.T).abs() / float32_dot_bound(x, w)).max())


def _rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Query rows with what LLM activations have: massive outlier channels, groups of tiny values, zero groups."""
    x = torch.randn(m, k, generator=g)
    x[:, 5] = 300.0  # an outlier beside ordinary values in its group
    x[:, 64:96] *= 1e-6  # a group of tiny values
    x[:, k - 32:] = 0.0  # a zero group
    x[0, k - 40] = -1e4
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [128, 576, 1536])
def test_integer_path_is_within_the_float32_products_bound(sliced, kind, k):
    g = torch.Generator().manual_seed(k)
    coded, w = _matrix(64, k, kind, g)
    for m in (1, 3, 9):
        x = _rows(m, k, g)
        assert _within_bound(coded(x), x, w) < 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_integer_path_is_about_as_accurate_as_the_float_path(kind):
    g = torch.Generator().manual_seed(1)
    coded, w = _matrix(256, 1024, kind, g)
    x = torch.randn(4, 1024, generator=g)  # ordinary rows (outliers: the bound above, not the float path's luck)
    before = LIB.lmhead_sliced(-1)
    try:
        errors = {}
        for mode in (0, 3):
            LIB.lmhead_sliced(mode)
            errors[mode] = _within_bound(coded(x), x, w)
    finally:
        LIB.lmhead_sliced(before)
    assert errors[3] < 4 * errors[0] + 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_bits_alone_and_in_any_batch(sliced, kind):
    g = torch.Generator().manual_seed(2)
    coded, _ = _matrix(96, 576, kind, g)
    x = _rows(13, 576, g)
    x[4, 7] = float("inf")  # a row the integer path cannot bound: the float32 path, for this row only
    x[9, :] *= 1e-30  # near float32's smallest: the float32 path too
    alone = torch.cat([coded(x[i:i + 1]) for i in range(13)])
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731 (inf row)
    for batch in (torch.arange(13), torch.tensor([9, 4, 0, 12, 1]), torch.arange(12, -1, -1)):
        same(coded(x[batch]), alone[batch])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        same(coded(x), alone)
    finally:
        torch.set_num_threads(threads)


def test_rows_the_integer_path_cannot_bound_take_the_float_path(sliced):
    g = torch.Generator().manual_seed(3)
    coded, w = _matrix(32, 256, "unsigned", g)
    x = torch.randn(2, 256, generator=g)
    x[1] *= 1e-30
    LIB.lmhead_sliced(0)
    want = coded(x)
    LIB.lmhead_sliced(3)
    got = coded(x)
    assert torch.equal(got[1], want[1])  # the float32 path's bits
    assert _within_bound(got, x, w) < 1.0
    x[0, 3] = float("nan")
    assert torch.isnan(coded(x)[0]).all() and not torch.isnan(coded(x)[1]).any()


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma-3-270m"])
def test_real_activations_are_within_the_bound(sliced, name):
    """Every packed matrix of the first and last blocks against the activations it multiplies in transformers'
    forward of a prompt (RMS-normed inputs with their outlier channels, the MLP's gated products), in whichever
    integer path this machine chose for it."""
    from lmhead import load_model

    model = load_model(name, progress=False)
    ids = torch.tensor([model.encode("The quick brown fox jumps over the lazy dog because it was late for")])
    checked = []
    for index in (0, len(model.lean.layers) - 1):
        block = model.hf_model.base_model.layers[index]
        inputs = {"qkv": block.self_attn.q_proj, "o": block.self_attn.o_proj, "gate_up": block.mlp.gate_proj,
                  "down": block.mlp.down_proj}
        for part, matrix in model.lean.layers[index].coded.items():
            # a fused product of mixed types: each row block in its own layout (models/row_blocks.py)
            for coded in getattr(matrix, "blocks", [matrix]):
                int8_offsets = coded.four_bit is None and coded.offset is not None  # the float32 path only
                # the four-row layout's integer path, or the integer path by groups (models/groups16.py)
                if part not in inputs or not coded.flags & (native.ROWS4 | native.GROUPS16) or int8_offsets:
                    continue
                x = _inputs_of(model, inputs[part], ids)
                assert _within_bound(coded(x), x, coded.dequantize().double()) < 1.0, (index, part)
                checked.append((index, part))
    assert checked  # both models hold packed 4-bit matrices (Q4_1, Q4_K)


def _inputs_of(model, module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What `module` multiplies [T, K] in transformers' forward of `ids`."""
    got: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda mod, inp, out: got.append(inp[0].detach()[0].float().clone()))
    try:
        with torch.no_grad():
            model.hf_model(ids)
    finally:
        handle.remove()
    return got[0]


def test_the_choice_is_measured_once_kept_and_a_damaged_record_measured_again(tmp_path, monkeypatch, capsys):
    from lmhead.kernels import paths

    before = LIB.lmhead_sliced(-1)
    monkeypatch.delenv("LMHEAD_SLICED", raising=False)
    library = tmp_path / "lmhead-test.so"
    record = tmp_path / "lmhead-test.so.paths.json"
    try:
        chosen = paths.choose(LIB, library)
        assert chosen["how"] == "measured" and record.exists()
        assert LIB.lmhead_sliced(-1) == sum(bit for kind, bit in paths.KINDS.items() if chosen[kind]["sliced"])
        assert "µs" in paths.describe()
        record.write_text('{"packed": {"sliced": "yes"}}')  # damaged: measured again, not used
        assert paths.choose(LIB, library)["how"] == "measured"
        assert isinstance(json.loads(record.read_text())["int8"]["sliced"], bool)
        monkeypatch.setenv("LMHEAD_SLICED", "0")
        assert paths.choose(LIB, library)["how"] == "LMHEAD_SLICED" and LIB.lmhead_sliced(-1) == 0
        monkeypatch.setenv("LMHEAD_SLICED", "1")
        paths.choose(LIB, library)
        assert LIB.lmhead_sliced(-1) == 3
        monkeypatch.setenv("LMHEAD_SLICED", "yes")  # not 0 or 1: said in one line, and the kept choice used
        assert paths.choose(LIB, library)["how"] == "measured"
        assert "LMHEAD_SLICED must be 0 or 1, got 'yes'" in capsys.readouterr().err
    finally:
        LIB.lmhead_sliced(before)


def test_the_screen_rescores_candidates_with_the_products_own_path(sliced):
    """Where the int8 codes take the integer path, the screen's exact values of a head's candidates are the whole
    product's (Q8_0-like codes with float16 scales: the screened layout)."""
    g = torch.Generator().manual_seed(4)
    n, k = 1024, 256
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    coded = CodedLinear(codes, (torch.rand(n, k // 32, generator=g) * 0.004 + 1e-4).half().float())
    assert coded.screens
    x = _rows(3, k, g)
    ids = [torch.tensor([0, 5, 6, 1023]), torch.tensor([17]), torch.arange(0, n, 3)]
    with torch.inference_mode():
        whole = torch.cat([coded(x[r:r + 1]) for r in range(3)])
        picked = coded.values_at(x, ids)
        top = coded.screen(x, [1, 5, 40])
    for r, i in enumerate(ids):
        assert torch.equal(picked[r, i], whole[r, i])
    for r, kk in enumerate([1, 5, 40]):
        assert torch.equal(top[r].topk(kk).indices, whole[r].topk(kk).indices)
        assert torch.equal(top[r].topk(kk).values, whole[r].topk(kk).values)


def test_the_choice_by_groups_weighs_a_round_and_an_older_record_is_measured_again(tmp_path, monkeypatch):
    from lmhead.kernels import paths
    from lmhead.models import groups16

    if not groups16.built():
        pytest.skip("the integer path by groups needs AVX-512 VNNI")
    before = LIB.lmhead_sliced(-1)
    for name in ("LMHEAD_SLICED", "LMHEAD_GROUPS16"):
        monkeypatch.delenv(name, raising=False)
    library = tmp_path / "lmhead-test.so"
    record = tmp_path / "lmhead-test.so.paths.json"
    try:
        chosen = paths.choose(LIB, library)["groups16"]
        for kind in paths.KINDS:
            c = chosen[kind]
            # a generated token's sweep plus a prompt token's share of a round's, both layouts measured
            cost = {on: c[f"{key}_us"] + c[f"{key}_round_us"] / paths._ROUND
                    for on, key in ((True, "groups16"), (False, "rows4"))}
            assert c["groups16"] == (cost[True] < cost[False]) == paths.groups16_chosen(kind), c
        kept = json.loads(record.read_text())
        for kind in paths.KINDS:  # a record from before the rounds were measured: measured again
            kept["groups16"][kind] = {"groups16": False, "rows4_us": 1.0, "groups16_us": 2.0}
        record.write_text(json.dumps(kept))
        assert "groups16_round_us" in paths.choose(LIB, library)["groups16"]["int8"]
        assert "groups16_round_us" in json.loads(record.read_text())["groups16"]["packed"]
    finally:
        LIB.lmhead_sliced(before)


def test_layouts_timed_on_busy_cores_are_used_not_kept_and_timed_again_by_the_next_load(tmp_path, monkeypatch,
                                                                                       capsys):
    from lmhead.kernels import paths
    from lmhead.models import groups16

    if not groups16.built():
        pytest.skip("the integer path by groups needs AVX-512 VNNI")
    before = LIB.lmhead_sliced(-1)
    for name in ("LMHEAD_SLICED", "LMHEAD_GROUPS16"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(paths, "_chosen", dict(paths._chosen))  # this process's choice back afterwards
    library = tmp_path / "lmhead-test.so"
    record = tmp_path / "lmhead-test.so.paths.json"
    tries = []

    def timed(us: float):
        def measure(lib, kind):
            tries.append(kind)
            return {"groups16": True, "rows4_us": us, "groups16_us": us * 0.9, "rows4_round_us": us * 8,
                    "groups16_round_us": us * 4}
        return measure

    try:
        # both cores taken: every two-thread product a time slice long, against one-thread products of tens of µs
        monkeypatch.setattr(paths, "_measure_groups16", timed(7700.0))
        chosen = paths.choose(LIB, library)
        assert len(tries) == paths._TRIES * len(paths.KINDS)
        assert chosen["groups16"]["int8"]["rows4_us"] == 7700.0  # this process uses what it timed
        assert "busy" in capsys.readouterr().err
        kept = json.loads(record.read_text())
        assert "groups16" not in kept and isinstance(kept["int8"]["sliced"], bool)  # the one-thread choice kept
        one = min(kept["int8"]["float_us"], kept["int8"]["sliced_us"])
        monkeypatch.setattr(paths, "_measure_groups16", timed(one))  # the next load's, on idle cores
        again = paths.choose(LIB, library)["groups16"]
        assert again["int8"]["rows4_us"] == one and json.loads(record.read_text())["groups16"] == again
        assert capsys.readouterr().err == ""
    finally:
        LIB.lmhead_sliced(before)

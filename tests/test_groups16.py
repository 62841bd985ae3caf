"""The integer path by groups (kernels/groups_kernel.h, kernels/layout16.py, models/groups16.py): its layout gives
the codes back, its products are within the float32 dot product's bound of the float64 ones, a row's value is the
same bits alone, in a batch (AMX's tiles where the CPU has them), under any thread count, rows it cannot take get
the float32 sums, and the packaged models' body matrices, embedding and head take it where it is chosen (the
head's screen over it: tests/test_screen.py)."""

from __future__ import annotations

import pytest
import torch
from reference import coded_weight, float32_dot_bound, group_sliced, subscale_numbers

from lmhead.kernels import layout16, native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear, SubScales
from lmhead.models.expert_layout import ExpertMatrices
from lmhead.models.quant_types import LEVELS

pytestmark = pytest.mark.skipif(not groups16.built(), reason="the integer path by groups needs AVX-512 VNNI")

# (four_bit, lowest code, highest + 1, offsets, the group of a K-quant's sub-scales or 0 for float16 scales a group
# of 32, the plane of 5- and 6-bit codes): Q8_0/Q5_0, Q5_1 (and in its plane), Q4_0, Q4_1; Q4_K, Q5_K (and in its
# plane); Q6_K (and in its plane), Q3_K, Q2_K; a level table's codes (lowest and highest None): IQ4_NL, IQ4_XS,
# MXFP4; 5-bit signed and 6-bit unsigned codes in their planes
KINDS = {"int8": (None, -127, 128, False, 0, None), "int8 offsets": (None, 0, 32, True, 0, None),
         "signed": ("signed", -8, 8, False, 0, None), "unsigned": ("unsigned", 0, 16, True, 0, None),
         "unsigned sub": ("unsigned", 0, 16, True, 32, None), "int8 sub": (None, 0, 32, True, 32, None),
         "int8 sub16": (None, -32, 32, False, 16, None), "signed sub16": ("signed", -4, 4, False, 16, None),
         "signed sub16 offsets": ("signed", 0, 4, True, 16, None), "iq4": ("iq4", None, None, False, 0, None),
         "iq4 sub": ("iq4", None, None, False, 32, None), "mxfp4": ("mxfp4", None, None, False, 0, None),
         "plane5 offsets": (None, 0, 32, True, 0, "unsigned5"), "plane5 sub": (None, 0, 32, True, 32, "unsigned5"),
         "plane6 sub16": (None, -32, 32, False, 16, "signed6"), "plane5 signed": (None, -16, 16, False, 0, "signed5"),
         "plane6 unsigned sub": (None, 0, 64, True, 32, "unsigned6")}


@pytest.fixture(autouse=True)
def chosen(monkeypatch):
    monkeypatch.setenv("LMHEAD_GROUPS16", "1")


def _subscales(n: int, k: int, group: int, g: torch.Generator, sign: float) -> SubScales:
    """A K-quant's scales (d a float16 number per 256 weights, an int8 sub per group: Q6_K's in −128 … 127, the
    others' 6-bit), as its blocks hold them; `sign` −1: offsets (−dmin)."""
    s = SubScales(n, k, group)
    s.d.copy_((torch.rand(n, k // 256, generator=g) * 1e-3 * sign).half().float())
    lo, hi = (-128, 128) if group == 16 and sign > 0 else (0, 64)
    s.sub.copy_(torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.int8))
    return s


def _matrix(kind: str, n: int, k: int, seed: int = 0, plane: str | None | bool = True
            ) -> tuple[CodedLinear, torch.Tensor]:
    """`plane` False: the kind's codes in the int8 layout even where it has a plane."""
    four_bit, lo, hi, offsets, sub, kind_plane = KINDS[kind]
    plane = kind_plane if plane else None
    g = torch.Generator().manual_seed(seed)
    if lo is None:  # a level table's codes: its levels
        levels = torch.from_numpy(LEVELS[four_bit])
        codes = levels[torch.randint(0, 16, (n, k), generator=g)]
    else:
        codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    if sub:  # as a file's K-quant is read: its codes in chunks, its sub-scales as its blocks hold them
        scale, offset = _subscales(n, k, sub, g, 1.0), _subscales(n, k, sub, g, -1.0) if offsets else None
        coded = CodedLinear.from_chunks(n, k, scale, offset, [(0, codes[:64]), (64, codes[64:])], four_bit,
                                        groups16=True, plane=plane)
        scale, offset = (None if s is None else subscale_numbers(s.d, s.sub) for s in (scale, offset))
    else:
        scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
        offset = (torch.rand(n, k // 32, generator=g) * -0.1).half().float() if offsets else None
        coded = CodedLinear(codes, scale, offset, four_bit=four_bit, groups16=True, plane=plane)
    assert coded.by_groups and coded.flags & native.GROUPS16 and coded.plane == plane
    return coded, coded_weight(codes, scale, offset)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_layout_gives_the_codes_and_scales_back(kind):
    coded, w = _matrix(kind, 128, 512 if KINDS[kind][4] else 320)
    assert coded.codes.shape == (128, layout16.row_bytes(512 if KINDS[kind][4] else 320, KINDS[kind][0],
                                                         KINDS[kind][5]))
    assert torch.equal(coded.dequantize(), w.float())  # a K-quant's code·scale + offset rounded once, as its file's
    assert torch.equal(coded.rows(torch.tensor([0, 17, 127])), w[[0, 17, 127]].float())


# a K-quant's rows are whole blocks of 256
SHAPES = [(kind, n, k) for kind in sorted(KINDS)
          for n, k in ([(48, 256), (80, 1024), (32, 2048)] if KINDS[kind][4]
                       else [(48, 256), (192, 576), (128, 1600), (80, 288)])]  # 288: an odd count of groups


@pytest.mark.parametrize("kind, n, k", SHAPES)
def test_a_rows_product_is_within_the_bound_and_the_same_bits_alone_in_a_batch_and_over_threads(kind, n, k):
    coded, w = _matrix(kind, n, k, seed=n + k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, k, generator=g) * torch.logspace(-3, 3, k)  # sums whose order would show
    x[:, 5] *= 50  # an outlier channel
    x[4] = 0.0
    lib = native.library()

    def product(rows: torch.Tensor, threads: int) -> torch.Tensor:
        y = torch.empty(rows.shape[0], n)
        assert lib.lmhead_coded_matmul(rows.data_ptr(), rows.shape[0], k, coded.codes.data_ptr(),
                                       coded.scale.data_ptr(),
                                       None if coded.offset is None else coded.offset.data_ptr(), n, coded.group,
                                       coded.flags, y.data_ptr(), threads) == 0
        return y

    alone = torch.cat([product(x[i:i + 1].clone(), 1) for i in range(x.shape[0])])
    exact = x.double() @ w.T
    assert bool(((alone.double() - exact).abs() <= float32_dot_bound(x, w)).all())
    assert bool((alone[4] == 0).all())
    for m in (2, 16, 17, 37):  # 16 and more: AMX's tiles where the CPU grants them
        for threads in (1, 2, 3):
            assert torch.equal(product(x[:m].contiguous(), threads).view(torch.int32),
                               alone[:m].view(torch.int32)), (m, threads)


PLANES = sorted(kind for kind in KINDS if KINDS[kind][5])


@pytest.mark.parametrize("kind", PLANES)
def test_5_and_6_bit_codes_in_a_plane_give_the_int8_layouts_bits_in_fewer_bytes(kind):
    # the same exact integer sums from fewer bytes: every product, alone and in a batch (AMX's tiles where the CPU
    # has them), and every row the same bits as the codes a byte each
    n, k = 80, 1024
    planed, w = _matrix(kind, n, k, seed=3)
    bytewise, _ = _matrix(kind, n, k, seed=3, plane=False)
    assert planed.codes.nbytes * 8 == bytewise.codes.nbytes * (4 + layout16.PLANES[KINDS[kind][5]][0])
    assert torch.equal(planed.dequantize(), bytewise.dequantize())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(19, k, generator=g) * torch.logspace(-2, 2, k)
    for m in (1, 3, 19):
        assert torch.equal(planed(x[:m].contiguous()).view(torch.int32), bytewise(x[:m].contiguous()).view(torch.int32))
    assert torch.equal(planed.rows(torch.tensor([0, 33, 79])), w[[0, 33, 79]].float())


def test_a_head_the_screen_reads_keeps_a_byte_a_code_where_body_matrices_of_its_type_take_the_plane():
    from lmhead.models.file_model import _screened
    from lmhead.models.quant_types import TYPES

    assert {kind for kind, t in TYPES.items() if t.plane and _screened(kind)} == {"Q5_0"}
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(-16, 16, (64, 512), generator=g, dtype=torch.int8)
    scale = (torch.rand(64, 16, generator=g) * 0.01 + 1e-4).half().float()
    body = CodedLinear(codes, scale, four_bit=None, groups16=True, plane=TYPES["Q5_0"].plane)
    head = CodedLinear(codes, scale, four_bit=None, groups16=True)
    assert body.plane == "signed5" and not body.screens
    assert head.plane is None and head.screens
    x = torch.randn(3, 512, generator=g)
    assert torch.equal(body(x), head(x))


def test_a_plane_that_is_none_of_the_layouts_is_refused_by_name():
    codes, scale = torch.zeros(16, 256, dtype=torch.int8), torch.ones(16, 8)
    with pytest.raises(ValueError, match="plane must be None or one of"):
        CodedLinear(codes, scale, four_bit=None, groups16=True, plane="signed7")


@pytest.mark.parametrize("plane, codes", [("signed6", [-33, 0]), ("signed6", [0, 32]), ("unsigned5", [-1, 0]),
                                          ("unsigned5", [0, 32]), ("signed5", [16, 0])])
def test_a_plane_refuses_codes_outside_its_range(plane, codes):
    c = torch.zeros(16, 256, dtype=torch.int8)
    c[3, 7], c[9, 200] = codes
    with pytest.raises(ValueError, match=plane):
        layout16.lay_out(c, None, plane)


@pytest.mark.parametrize("kind", ["int8", "unsigned", "signed sub16 offsets", "plane6 sub16"])
def test_a_prefill_chunk_of_several_tile_chunks_gives_each_row_its_bits_alone(kind):
    # AMX's tiles take a prefill's rows in chunks whose slices stay in L2 (K = 2048: 64 rows a chunk): 150 rows are
    # three chunks, the last one short, and six rows for the one-row kernel; each row is its bits alone
    n, k = 32, 2048
    coded, w = _matrix(kind, n, k, seed=3)
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(4)) * torch.logspace(-2, 2, k)
    alone = torch.cat([coded(x[i:i + 1]) for i in range(x.shape[0])])
    assert bool(((alone.double() - x.double() @ w.T).abs() <= float32_dot_bound(x, w)).all())
    for m in (150, 80, 64):
        assert torch.equal(coded(x[:m]).view(torch.int32), alone[:m].view(torch.int32)), m


def test_an_activation_half_a_step_between_two_slicings_rounds_up():
    """Weight row r reads one activation (code 1, scale 1: every sum exact), so its output is that activation as
    sliced; the activations sit at exact half steps of d₂ = 2⁻¹⁶ (each group's largest is 100, d₀ = 1), where
    rounding half up, half to even and half away from zero differ."""
    k, steps = 256, [-3, -2, -1, 0, 1, 2, 5, -6, 40, -41, 1000, -1001, 7, -8, 0, 3]
    x = torch.zeros(k)
    x[::32] = 100.0
    at = torch.arange(16) * 16 + 1
    x[at] = (torch.tensor(steps, dtype=torch.float64) + 0.5).float() * 2.0 ** -16
    x[at[-1]] = 1e-3  # and one that is no half step
    codes = torch.zeros(16, k, dtype=torch.int8)
    codes[torch.arange(16), at] = 1
    coded = CodedLinear(codes, torch.ones(16, k // 32), None, four_bit=None, groups16=True)
    assert coded.by_groups
    want = group_sliced(x)[at]
    assert want[3].item() == 2.0 ** -16 and want[2].item() == 0.0 and want[1].item() == -2.0 ** -16
    rows = x.expand(17, k).contiguous()  # one row (VNNI) and a block of sixteen (AMX's tiles where granted)
    assert torch.equal(coded(x[None])[0].double(), want)
    assert torch.equal(coded(rows).double(), want.expand(17, 16))


def test_mxfp4_scales_that_are_powers_of_two_are_held_as_exponent_bytes_with_the_float16_layouts_bits():
    n, k = 64, 512
    g = torch.Generator().manual_seed(7)
    codes = torch.from_numpy(LEVELS["mxfp4"])[torch.randint(0, 16, (n, k), generator=g)]
    scale = 2.0 ** torch.randint(-24, 16, (n, k // 32), generator=g).float()  # 2^(e − 128), e in 104 … 143
    coded = CodedLinear(codes, scale, four_bit="mxfp4", groups16=True)
    assert coded.by_groups and coded.flags & native.E8M0 and coded.scale.dtype == torch.uint8
    assert coded.nbytes == n * k // 2 + n * k // 32  # a block of 32 in 17 bytes, as the file holds it
    assert torch.equal(coded.dequantize(), coded_weight(codes, scale).float())
    halves = CodedLinear.from_layout(coded.codes, layout16.scales_out(scale), None, k, 32, "mxfp4", False,
                                     by_groups=True)
    assert halves.flags & native.HALF and not halves.flags & native.E8M0
    x = torch.randn(37, k, generator=g) * torch.logspace(-3, 3, k)
    for m in (1, 16, 37):  # one row (VNNI), and AMX's tiles where granted
        assert torch.equal(coded(x[:m]).view(torch.int32), halves(x[:m]).view(torch.int32))
    wide = scale.clone()
    wide[3, 2] = 2.0 ** 20  # beyond float16's range (and the byte's in this layout): the four-row layout
    assert not CodedLinear(codes, wide, four_bit="mxfp4", groups16=True).by_groups


def test_exponent_bytes_below_two_are_the_two_subnormal_scales_in_the_kernels_products():
    # the loader lays out only bytes within layout16.EXPONENTS; the C entry takes any byte, and 0 and 1 are
    # 2⁻¹²⁸ and 2⁻¹²⁷ (float32 subnormals, exact): the products stay within float32's bound of the float64 ones
    n, k = 64, 512
    g = torch.Generator().manual_seed(8)
    index = torch.randint(0, 16, (n, k), generator=g)
    levels = torch.from_numpy(LEVELS["mxfp4"])
    e = torch.randint(120, 131, (n, k // 32), generator=g)
    e[:16] = torch.randint(0, 4, (16, k // 32), generator=g)  # a block of sixteen rows of the smallest scales
    e[40, :3] = torch.tensor([0, 1, 2])
    laid = layout16.lay_out(levels[index], "mxfp4")
    coded = CodedLinear.from_layout(laid, layout16.scales_out(e.to(torch.uint8)), None, k, 32, "mxfp4", False,
                                    by_groups=True)
    assert coded.flags & native.E8M0 and coded.flags & native.GROUPS16
    w = levels[index].double() * torch.repeat_interleave(2.0 ** (e.double() - 128), 32, dim=1)
    x = torch.randn(37, k, generator=g).double() * 2.0 ** 60  # every product a normal float32
    x = x.float()
    for m in (1, 16, 37):  # one row (VNNI), and AMX's tiles where granted
        y = coded(x[:m])
        assert bool(((y.double() - x[:m].double() @ w.T).abs() <= float32_dot_bound(x[:m], w)).all()), m
        assert bool((y[:, :16] != 0).any())  # the subnormal scales' rows are numbers, not flushed to zero


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rows_the_integer_path_cannot_take_get_the_float32_sums(kind):
    coded, w = _matrix(kind, 64, 256)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 256, generator=g)
    x[1] *= 1e-30  # groups whose scale times d₂ would leave float32's normal range
    x[2, 9] = float("nan")
    x[3, 0] = float("inf")
    y = coded(x)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 4]]).any()
    assert not torch.isfinite(y[3]).any()
    keep = [i for i in range(20) if i not in (2, 3)]
    assert bool(((y[keep].double() - x[keep].double() @ w.T).abs() <= float32_dot_bound(x[keep], w)).all())
    alone = torch.cat([coded(x[i:i + 1].clone()) for i in range(20)])
    assert torch.equal(alone[keep].view(torch.int32), y[keep].view(torch.int32))


@pytest.mark.parametrize("kind", ["unsigned", "unsigned sub", "signed sub16 offsets"])
def test_a_matrix_by_groups_keeps_its_layout_as_the_experts_of_one(kind):
    coded, _ = _matrix(kind, 128, 512)
    ex = ExpertMatrices(coded.codes.unsqueeze(0), coded.scale.unsqueeze(0), coded.offset.unsqueeze(0), 512,
                        coded.group, coded.four_bit, False, coded.sub, by_groups=True)
    again = ex[0]
    assert again.by_groups and again.out_features == 128 and again.flags == coded.flags
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    assert torch.equal(again(x), coded(x))


def test_codes_given_in_chunks_are_laid_out_as_the_whole_matrix_sixteen_rows_at_a_time():
    # a file's matrix read in pieces of any multiple of four rows (q, k and v one after another): the same layout as
    # the whole matrix's, without the whole int8 matrix made first
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (96, 256), generator=g, dtype=torch.int8)
    scale = (torch.rand(96, 8, generator=g) * 0.01 + 1e-4).half().float()
    pieces = [(0, codes[:20]), (20, codes[20:24]), (24, codes[24:24]), (24, codes[24:60]), (60, codes[60:])]
    whole = CodedLinear(codes, scale, groups16=True)
    chunked = CodedLinear.from_chunks(96, 256, scale, None, pieces, None, groups16=True)
    assert chunked.by_groups and torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.scale, whole.scale)
    # scales float16 cannot hold: the four-row layout, of the same codes
    big = scale * 1e6
    four = CodedLinear.from_chunks(96, 256, big, None, pieces, None, groups16=True)
    assert not four.by_groups and torch.equal(four.dequantize(), CodedLinear(codes, big).dequantize())
    with pytest.raises(ValueError, match="row order"):
        CodedLinear.from_chunks(96, 256, scale, None, [(0, codes[:32]), (48, codes[48:])], None, groups16=True)
    with pytest.raises(ValueError, match="cover 32 of 96 rows"):
        CodedLinear.from_chunks(96, 256, scale, None, [(0, codes[:32])], None, groups16=True)


def test_ineligible_shapes_and_the_choice_keep_the_four_row_layout(monkeypatch):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (88, 512), generator=g, dtype=torch.int8)  # N not a multiple of 16
    scale = torch.rand(88, 16, generator=g).half().float()
    assert not CodedLinear(codes, scale, groups16=True).by_groups
    assert not CodedLinear(codes[:64, :224], scale[:64, :7], groups16=True).by_groups  # K below 256
    assert not CodedLinear(codes[:64], scale[:64]).by_groups  # not asked for
    monkeypatch.setenv("LMHEAD_GROUPS16", "0")
    assert not CodedLinear(codes[:64], scale[:64], groups16=True).by_groups


@pytest.mark.model
def test_the_packaged_smollm2s_body_embedding_and_head_take_it(tmp_path, monkeypatch):
    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model("smollm2-135m", progress=False)
    for layer in model.lean.layers:
        assert all(c.by_groups for c in layer.coded.values())  # Q4_1, N a multiple of 64, K ≥ 256
    head = model.exact_head.product
    assert head is model.lean.embed_codes  # tied: one matrix, its rows the embedding's
    assert head.by_groups and head.screens  # Q8_0
    warm = load_model("smollm2-135m", progress=False)  # mapped from the layout cache
    assert all(c.by_groups for c in warm.lean.layers[0].coded.values()) and warm.exact_head.product.by_groups
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(6))
    assert torch.equal(warm.lean.layers[0].coded["qkv"](x), model.lean.layers[0].coded["qkv"](x))
    assert torch.equal(warm.exact_head.product(x), head(x))
    ids = torch.tensor([0, 17, 49151])
    assert torch.equal(warm.lean.embedding(ids), head.dequantize()[ids])


@pytest.mark.model
def test_the_packaged_gemmas_matrices_take_it_with_their_sub_scales_and_planes(tmp_path, monkeypatch):
    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model("gemma-3-270m", progress=False)
    taken = set()
    for layer in model.lean.layers:
        for c in layer.coded.values():
            for m in getattr(c, "blocks", [c]):  # q/k/v of mixed types: row blocks of their own layouts
                assert m.by_groups
                taken.add((m.group, m.sub, m.plane))
    # Q4_K's groups of 32 and Q6_K's of 16 with their sub-scales, Q6_K's codes in six bits; Q5_0's and Q8_0's
    # float16 scales, Q5_0's codes in five bits and Q8_0's a byte each
    assert taken == {(32, True, None), (16, True, "signed6"), (32, False, "signed5"), (32, False, None)}
    head = model.exact_head.product
    assert head.plane is None and head.screens  # its Q8_0 head, screened

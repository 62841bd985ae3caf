"""The integer path by groups (kernels/groups_kernel.h, kernels/layout16.py, models/groups16.py): its layout gives
the codes back, its products are within the float32 dot product's bound of the float64 ones, a row's value is the
same bits alone, in a batch (AMX's tiles where the CPU has them), under any thread count, rows it cannot take get
the float32 sums, and the packaged models' body matrices take it where it is chosen — their embedding and head do
not."""

from __future__ import annotations

import pytest
import torch
from reference import coded_weight, float32_dot_bound

from lmhead.kernels import native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear
from lmhead.models.expert_layout import ExpertMatrices

pytestmark = pytest.mark.skipif(not groups16.built(), reason="the integer path by groups needs AVX-512 VNNI")

KINDS = {"int8": (None, -127, 128, False), "signed": ("signed", -8, 8, False), "unsigned": ("unsigned", 0, 16, True)}


@pytest.fixture(autouse=True)
def chosen(monkeypatch):
    monkeypatch.setenv("LMHEAD_GROUPS16", "1")


def _matrix(kind: str, n: int, k: int, seed: int = 0) -> tuple[CodedLinear, torch.Tensor]:
    four_bit, lo, hi, offsets = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    offset = (torch.rand(n, k // 32, generator=g) * -0.1).half().float() if offsets else None
    coded = CodedLinear(codes, scale, offset, four_bit=four_bit, groups16=True)
    assert coded.by_groups and coded.flags & native.GROUPS16
    return coded, coded_weight(codes, scale, offset)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_layout_gives_the_codes_and_scales_back(kind):
    coded, w = _matrix(kind, 128, 320)
    assert torch.equal(coded.dequantize().double(), w)
    assert torch.equal(coded.rows(torch.tensor([0, 17, 127])).double(), w[[0, 17, 127]])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("n, k", [(48, 256), (192, 576), (128, 1536 + 64)])
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
                                       None if coded.offset is None else coded.offset.data_ptr(), n, 32,
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


def test_a_matrix_by_groups_keeps_its_layout_as_the_experts_of_one():
    coded, _ = _matrix("unsigned", 128, 512)
    ex = ExpertMatrices(coded.codes.unsqueeze(0), coded.scale.unsqueeze(0), coded.offset.unsqueeze(0), 512, 32,
                        coded.four_bit, False, False, by_groups=True)
    again = ex[0]
    assert again.by_groups and again.out_features == 128 and again.flags == coded.flags
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    assert torch.equal(again(x), coded(x))


def test_ineligible_shapes_and_the_choice_keep_the_four_row_layout(monkeypatch):
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (88, 512), generator=g, dtype=torch.int8)  # N not a multiple of 16
    scale = torch.rand(88, 16, generator=g).half().float()
    assert not CodedLinear(codes, scale, groups16=True).by_groups
    assert not CodedLinear(codes[:64, :224], scale[:64, :7], groups16=True).by_groups  # K below 256
    assert not CodedLinear(codes[:64], scale[:64]).by_groups  # not a body's matrix
    monkeypatch.setenv("LMHEAD_GROUPS16", "0")
    assert not CodedLinear(codes[:64], scale[:64], groups16=True).by_groups


@pytest.mark.model
def test_the_packaged_smollm2s_body_takes_it_and_its_embedding_and_head_do_not(tmp_path, monkeypatch):
    from lmhead import load_model

    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    model = load_model("smollm2-135m", progress=False)
    for layer in model.lean.layers:
        assert all(c.by_groups for c in layer.coded.values())  # Q4_1, N a multiple of 64, K ≥ 256
    assert not model.lean.embed_codes.by_groups and model.exact_head.product.screens
    warm = load_model("smollm2-135m", progress=False)  # mapped from the layout cache
    assert all(c.by_groups for c in warm.lean.layers[0].coded.values())
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(6))
    assert torch.equal(warm.lean.layers[0].coded["qkv"](x), model.lean.layers[0].coded["qkv"](x))

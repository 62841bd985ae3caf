"""benchmarks/group_slices.c, the candidate bench_group_slices.py measures: its products are within the float32 dot
product's bound of the float64 one, and a query row's value is the same bits computed alone (VNNI) or as one of
sixteen rows of an AMX tile — what its record's "VNNI = AMX" column claims."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_group_slices  # noqa: E402


@pytest.fixture(scope="module")
def gs(tmp_path_factory):
    lib = bench_group_slices.build(tmp_path_factory.mktemp("group_slices"))
    if lib is None:
        pytest.skip("group_slices.c needs AVX-512 VNNI")
    return lib


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_a_rows_value_is_within_the_float32_bound_and_the_same_bits_alone_and_in_a_tile(gs, kind):
    g = torch.Generator().manual_seed(1)
    n, k, m = 64, 320, 19  # one tile of sixteen query rows, three more rows through VNNI
    groups = k // 32
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        codes, offset = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None
        layout = (torch.empty(n * k, dtype=torch.int8), torch.empty(n * groups, dtype=torch.int32),
                  torch.empty(n * groups))
        gs.gs_layout(codes.data_ptr(), scale.data_ptr(), n, k, *(t.data_ptr() for t in layout))
        product = gs.gs_product
    else:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
        offset = (-(torch.rand(n, groups, generator=g) * 0.1)).half().float()
        layout = (torch.zeros(n * k // 2, dtype=torch.uint8), torch.empty(n * groups), torch.empty(n * groups))
        gs.gs4_layout(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), n, k, *(t.data_ptr() for t in layout))
        product = gs.gs4_product
    w = codes.double().view(n, -1, 32) * scale.double()[..., None]
    w = (w if offset is None else w + offset.double()[..., None]).view(n, k)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    x[:, 7] *= 40  # an outlier channel
    x[3] = 0.0  # a row of zeros: every group's scale is 1, its slices 0

    def run(rows: torch.Tensor, amx: int, threads: int = 2) -> torch.Tensor:
        y = torch.empty(rows.shape[0], n)
        assert product(rows.data_ptr(), rows.shape[0], k, *(t.data_ptr() for t in layout), n, y.data_ptr(), threads,
                       amx) == 0
        return y

    tiled = run(x, 1)
    alone = torch.cat([run(x[i:i + 1].clone(), 0, 1) for i in range(m)])
    assert torch.equal(tiled.view(torch.int32), alone.view(torch.int32))
    exact = x.double() @ w.T
    bound = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (x.double().abs() @ w.abs().T)
    assert bool(((alone.double() - exact).abs() <= bound).all())
    assert bool((alone[3] == 0).all())

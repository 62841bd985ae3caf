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
    layout = bench_group_slices.Layout(gs, kind, n, k, g)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    x[:, 7] *= 40  # an outlier channel
    x[3] = 0.0  # a row of zeros: every group's scale is 1, its slices 0

    tiled = torch.empty(m, n)
    layout.product(x, tiled, 2, amx=True)
    alone = torch.empty(m, n)
    for i in range(m):
        layout.product(x[i:i + 1].clone(), alone[i:i + 1], 1, amx=False)
    assert torch.equal(tiled.view(torch.int32), alone.view(torch.int32))
    w = layout.weights()
    exact = x.double() @ w.T
    bound = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (x.double().abs() @ w.abs().T)
    assert bool(((alone.double() - exact).abs() <= bound).all())
    assert bool((alone[3] == 0).all())

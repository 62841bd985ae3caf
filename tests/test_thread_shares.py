"""How a product's weight rows are shared by the threads (kernels/thread_shares.h): each thread takes its share's
rounds from the front and, once its share is done, the others' from their back. A row's product is the same bits,
alone or among a prefill chunk's rows, over any number of threads — more threads than cores (some start late and
their shares are taken by the others), more than the claims kept on the stack — and every weight row is computed
once, for every kernel family: float32, float16 and bfloat16 weights, int8 and packed codes in blocks of four rows
(the float32 and the integer path) and by groups of sixteen rows (AMX's tiles for a chunk's sixteen rows where the
CPU grants them)."""

from __future__ import annotations

import pytest
import torch
from reference import coded_weight, float32_dot_bound

from lmhead.kernels import native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="the native kernels are not built on this machine")

THREADS = (2, 3, 7, 20)  # 7 on a machine of fewer cores: threads that start late; 20: claims off the stack
N, K = 2576, 512  # 161 blocks of sixteen rows, 644 of four: shares of several rounds, not whole ones, at 20


def _product(coded: CodedLinear, x: torch.Tensor, threads: int) -> torch.Tensor:
    y = torch.full((x.shape[0], N), float("nan"))  # a row no thread computed stays NaN
    assert LIB.lmhead_coded_matmul(x.data_ptr(), x.shape[0], K, coded.codes.data_ptr(),
                                   None if coded.dense else coded.scale.data_ptr(),
                                   None if coded.offset is None else coded.offset.data_ptr(), N, coded.group,
                                   coded.flags, y.data_ptr(), threads) == 0
    return y


def _coded(kind: str, g: torch.Generator) -> tuple[CodedLinear, torch.Tensor]:
    """A matrix of `kind` and the float64 weights it holds."""
    if kind in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
        w = (torch.randn(N, K, generator=g) * 0.05).to(dtype)
        return CodedLinear.dense16(w), w.double()
    layout, packed = kind.split()
    low, high = (0, 16) if packed == "packed" else (-127, 128)
    codes = torch.randint(low, high, (N, K), generator=g, dtype=torch.int8)
    scale = (torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3).half().float()
    offset = (torch.rand(N, K // 32, generator=g) * -0.1).half().float() if packed == "packed" else None
    coded = CodedLinear(codes, scale, offset, four_bit="unsigned" if packed == "packed" else None,
                        groups16=layout == "groups")
    assert bool(coded.flags & native.GROUPS16) == (layout == "groups")
    assert bool(coded.flags & native.ROWS4) == (layout == "rows4")
    return coded, coded_weight(codes, scale, offset).double()


KINDS = ["F32", "F16", "BF16", "rows4 int8", "rows4 packed", "groups int8", "groups packed"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_product_is_the_same_bits_alone_or_in_a_chunk_over_any_number_of_threads(kind, monkeypatch):
    if kind.startswith("groups"):
        if not groups16.built():
            pytest.skip("the integer path by groups needs AVX-512 VNNI")
        monkeypatch.setenv("LMHEAD_GROUPS16", "1")
    g = torch.Generator().manual_seed(len(kind))
    coded, w = _coded(kind, g)
    x = torch.randn(17, K, generator=g) * torch.logspace(-2, 2, K)
    modes = (0, 3) if kind.startswith("rows4") and LIB.lmhead_sliced(-1) != 0 else (None,)  # float32, integer
    before = LIB.lmhead_sliced(-1)
    try:
        for mode in modes:
            if mode is not None:
                LIB.lmhead_sliced(mode)
            alone = torch.cat([_product(coded, x[i:i + 1].clone(), 1) for i in range(x.shape[0])])
            assert bool(((alone.double() - x.double() @ w.T).abs() <= float32_dot_bound(x, w)).all()), mode
            for rows in (1, 17):  # a decode step's row; a prefill chunk's (AMX's tiles where the CPU grants them)
                for threads in THREADS:
                    for _ in range(3):  # which thread takes which round differs from call to call
                        assert torch.equal(_product(coded, x[:rows].contiguous(), threads).view(torch.int32),
                                           alone[:rows].view(torch.int32)), (mode, rows, threads)
    finally:
        LIB.lmhead_sliced(before)

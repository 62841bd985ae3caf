"""One layer's attention in C (`lmhead_attend`, kernels/body_kernels.c) against plain softmax attention
(`reference.attention_step`): query heads taken together per key head and key block, and each query's span of
kept columns, on contexts of several key blocks."""

from __future__ import annotations

import shutil

import pytest
import reference as ref
import torch

from lmhead.kernels import native

MIN = torch.finfo(torch.float32).min  # transformers' masked columns


def test_the_c_kernels_build_and_pass_their_self_test_where_there_is_a_compiler():
    """Where a C compiler exists the kernels must load: a kernel that fails its self-test makes `library()` None
    and every test of the C paths skip, which would otherwise pass unseen."""
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler on this machine")
    assert native.library() is not None


def _mask(kind: str, b: int, t: int, start: int, window: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    length = start + t
    col = torch.arange(length)
    mask = torch.zeros(b, t, length)
    for r in range(b):
        for i in range(t):
            pos = start + i
            keep = col <= pos
            if kind == "sliding":
                keep &= pos - col < window
            if kind == "padded":
                keep &= col >= 7 * r  # row r's first 7·r columns are padding
            if kind == "nothing" and r == 1:
                keep[:] = False  # a query with nothing to attend to: transformers' numbers (uniform)
            mask[r, i] = torch.where(keep, 0.0, MIN)
    return mask


@pytest.mark.skipif(native.library() is None, reason="the C kernels are not built")
@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (4, 1, 256), (6, 2, 48), (4, 4, 32)])
@pytest.mark.parametrize("kind", ["none", "causal", "sliding", "padded", "nothing"])
@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_in_c_equals_plain_softmax_attention(heads, kv_heads, hd, kind, t, threads):
    g = torch.Generator().manual_seed(heads * 100 + hd + t)
    b, start = 2, 150 if hd < 256 else 70  # several key blocks: 4096 / hd keys each
    cap = start + t + 5
    qk = torch.randn(b, t, heads + kv_heads, hd, generator=g)
    v = torch.randn(b, t, kv_heads, hd, generator=g)
    cos, sin = torch.randn(b, t, hd, generator=g), torch.randn(b, t, hd, generator=g)
    keys, values = torch.randn(b, kv_heads, cap, hd, generator=g), torch.randn(b, kv_heads, cap, hd, generator=g)
    mask = _mask(kind, b, t, start, window=40)
    softcap = 30.0 if heads == 4 else 0.0
    want, want_k, want_v = ref.attention_step(qk, v, cos, sin, keys, values, mask, start, 0.3, softcap)
    out = torch.empty(b, t, heads * hd)
    rc = native.library().lmhead_attend(native.AttendArgs(
        qk=qk.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
        values=values.data_ptr(), mask=None if mask is None else mask.data_ptr(), out=out.data_ptr(),
        qk_stride=(heads + kv_heads) * hd, v_stride=kv_heads * hd, B=b, T=t, H=heads, Hkv=kv_heads, hd=hd, cap=cap,
        start=start, scaling=0.3, softcap=softcap, threads=threads))
    assert rc == 0
    torch.testing.assert_close(keys, want_k, **ref.tolerance(torch.float32))
    torch.testing.assert_close(values, want_v, **ref.tolerance(torch.float32))
    # float32 dots of up to 256 terms and sums of up to 150 exponentials (exp8: 2 ulp) against float64
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)

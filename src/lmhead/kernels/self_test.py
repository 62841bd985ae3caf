"""The compiled kernels checked when they load: every entry point against plain torch math on small random inputs,
built with an unknown compiler on an unknown machine — checked, not assumed (`native.library` calls `failed_check`)."""

from __future__ import annotations

import ctypes
import math

import torch

from lmhead.kernels import layout16
from lmhead.kernels.abi import (
    BF16,
    F16,
    F32,
    GROUPS16,
    HALF,
    IQ4,
    IQ4_LEVELS,
    PACKED,
    ROWS4,
    SIGNED4,
    SUB,
    AttendArgs,
    MatDesc,
    row_moments_in,
    row_scores_in,
    top_p_row_in,
    typical_row_in,
)
from lmhead.kernels.layout4 import block4, pack4


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-5))


def failed_check(lib: ctypes.CDLL) -> str | None:
    """Every entry point against plain torch math on small random inputs (every path of the coded product:
    1 and several rows, groups 16 and 32, with and without offsets): built with an unknown compiler on an
    unknown machine, it is checked, not assumed. The first check that fails, by name (its float32 path's where the
    integer path passed), or None when every one passes."""
    g = torch.Generator().manual_seed(0)  # one stream of draws through every check, in this order
    checks = (grouped_products, four_row_blocks, packed_and_half, signed_and_levels, sub_scales, dense_weights,
              by_groups, by_groups_subscaled, norms_and_gates, row_entry_points, steps_test, attend_test)
    for check in checks:
        if not check(lib, g):
            return check.__name__
    # where the products of four-row blocks also have the integer path (sliced_kernel.h, on by default), their
    # float32 path
    every = lib.lmhead_sliced(-1)
    if every:
        lib.lmhead_sliced(0)
        try:
            for check in (four_row_blocks, packed_and_half, signed_and_levels, sub_scales):
                if not check(lib, g):
                    return f"{check.__name__} on the float32 path"
        finally:
            lib.lmhead_sliced(every)
    return None


def grouped_products(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The coded product with groups of 32 and 16, with and without offsets, over 1 to 9 rows."""
    for group, offset in ((32, False), (32, True), (16, False), (16, True)):
        codes = torch.randint(-32, 32, (37, 4 * group), generator=g, dtype=torch.int8)
        scale = torch.rand(37, 4, generator=g) * 0.01
        off = torch.randn(37, 4, generator=g) * 0.01 if offset else None
        w = codes.float().view(37, 4, group) * scale[..., None]
        if off is not None:
            w = w + off[..., None]
        w = w.view(37, -1)
        for m in (1, 3, 6, 9):
            x = torch.randn(m, 4 * group, generator=g)
            y = torch.empty(m, 37)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 4 * group, codes.data_ptr(), scale.data_ptr(),
                                         None if off is None else off.data_ptr(), 37, group, 0, y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w.double().T):
                return False
    return True


def by_groups(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The integer path by groups (groups_kernel.h), where it is built: int8 codes, signed and unsigned 4-bit ones
    with offsets, IQ4_NL's levels, 6-bit signed and 5-bit unsigned ones with offsets (their top bits in a plane),
    one row and seventeen (AMX's tiles where the CPU grants them)."""
    if lib.lmhead_groups16() == 0:
        return True
    for four_bit, plane, lo, hi, offset in ((None, None, -127, 128, False), ("signed", None, -8, 8, False),
                                            ("unsigned", None, 0, 16, True), ("iq4", None, 0, 16, False),
                                            (None, "signed6", -32, 32, False), (None, "unsigned5", 0, 32, True)):
        codes = torch.randint(lo, hi, (64, 256), generator=g, dtype=torch.int8)
        if four_bit == "iq4":
            codes = torch.tensor(IQ4_LEVELS, dtype=torch.int8)[codes.long()]
        scale = (torch.rand(64, 8, generator=g) * 0.01).half()
        off = (torch.randn(64, 8, generator=g) * 0.01).half() if offset else None
        w = codes.double().view(64, 8, 32) * scale.double()[..., None]
        w = (w if off is None else w + off.double()[..., None]).view(64, 256)
        laid, s16 = layout16.lay_out(codes, four_bit, plane), layout16.scales_out(scale)
        m16 = None if off is None else layout16.scales_out(off)
        flags = (GROUPS16 | HALF | (PACKED if four_bit else 0) | (SIGNED4 if four_bit == "signed" else 0)
                 | (IQ4 if four_bit == "iq4" else 0) | layout16.plane_flags(plane))
        for m in (1, 17):
            x = torch.randn(m, 256, generator=g)
            y = torch.empty(m, 64)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 256, laid.data_ptr(), s16.data_ptr(),
                                         None if m16 is None else m16.data_ptr(), 64, 32, flags, y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w.T):
                return False
            if four_bit is None and plane is None and not by_groups_screened(lib, x, laid, s16, y):
                return False
        # the rows the C step reads from the layout (coded_kernel.c's lmhead_groups_row): code·scale + offset in float32
        w32 = codes.float().view(64, 8, 32) * scale.float()[..., None]
        w32 = (w32 if off is None else w32 + off.float()[..., None]).view(64, 256)
        ids, rows = torch.tensor([0, 17, 63]), torch.empty(3, 256)
        desc = MatDesc(laid.data_ptr(), s16.data_ptr(), None if m16 is None else m16.data_ptr(), 32, 64, 256, flags)
        if (lib.lmhead_coded_rows(ctypes.byref(desc), ids.data_ptr(), 3, rows.data_ptr()) != 0
                or not torch.equal(rows, w32[ids])):
            return False
    return True


def by_groups_screened(lib: ctypes.CDLL, x: torch.Tensor, laid: torch.Tensor, s16: torch.Tensor,
                       y: torch.Tensor) -> bool:
    """The screen's rescoring over int8 codes by groups (groups_screen.h) gives the product's own bits y [M, 64]
    for every id; its approximate values are within its bound of them."""
    m = x.shape[0]
    ids = torch.arange(64).repeat(m, 1)
    counts = torch.full((m,), 64, dtype=torch.int64)
    exact, approx = torch.empty(m, 64), torch.empty(m, 64)
    norms, beta = torch.empty(64), torch.empty(m, dtype=torch.float64)
    if (lib.lmhead_screen_rescore16(x.data_ptr(), m, 256, laid.data_ptr(), s16.data_ptr(), 64, ids.data_ptr(),
                                    counts.data_ptr(), 64, exact.data_ptr(), 2) != 0
            or lib.lmhead_screen_norms16(laid.data_ptr(), s16.data_ptr(), 64, 256, norms.data_ptr(), 2) != 0
            or lib.lmhead_screen16(x.data_ptr(), m, 256, laid.data_ptr(), s16.data_ptr(), 64, approx.data_ptr(),
                                   beta.data_ptr(), 2) != 0):
        return False
    bound = norms.double()[None] * beta[:, None]
    return torch.equal(exact, y) and bool(((approx.double() - y.double()).abs() <= bound).all())


def by_groups_subscaled(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The integer path by groups over a K-quant's sub-scales: unsigned 4-bit codes with offsets in groups of 32
    (Q4_K's), int8 codes in groups of 16 (Q6_K's), one row and seventeen, where the path is built."""
    if lib.lmhead_groups16() == 0:
        return True
    for four_bit, lo, hi, group, offset in (("unsigned", 0, 16, 32, True), (None, -32, 32, 16, False)):
        codes = torch.randint(lo, hi, (32, 512), generator=g, dtype=torch.int8)
        numbers, bufs = [], []
        for sign in (1.0, -1.0) if offset else (1.0,):
            d = (torch.rand(32, 2, generator=g) * 2e-4 * sign).half().float()
            sub = torch.randint(0, 64, (32, 512 // group), generator=g, dtype=torch.int8)
            numbers.append(d.double().repeat_interleave(256 // group, dim=1) * sub.double())
            bufs.append(layout16.subscales_out(d, sub))
        w = codes.double().view(32, -1, group) * numbers[0][..., None]
        w = (w if not offset else w + numbers[1][..., None]).view(32, 512)
        laid = layout16.lay_out(codes, four_bit)
        flags = GROUPS16 | SUB | (PACKED if four_bit else 0)
        for m in (1, 17):
            x = torch.randn(m, 512, generator=g)
            y = torch.empty(m, 32)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 512, laid.data_ptr(), bufs[0].data_ptr(),
                                         bufs[1].data_ptr() if offset else None, 32, group, flags, y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w.T):
                return False
    return True


def four_row_blocks(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """Q6_K's and Q3_K's layout (groups of 16 in blocks of four rows) and Q2_K's (with offsets)."""
    # Q6_K's and Q3_K's layout: groups of 16 in blocks of four rows (two groups to a 32-byte unit); Q2_K's: with
    # offsets
    codes = torch.randint(-32, 32, (16, 128), generator=g, dtype=torch.int8)
    scale = torch.rand(16, 8, generator=g) * 0.01
    off = torch.randn(16, 8, generator=g) * 0.01
    blocked = block4(codes)
    for o in (None, off):
        w = (codes.float().view(16, 8, 16) * scale[..., None] + (0 if o is None else o[..., None])).view(16, 128)
        for m in (1, 3, 6, 9):
            x, y = torch.randn(m, 128, generator=g), torch.empty(m, 16)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 128, blocked.data_ptr(), scale.data_ptr(),
                                         None if o is None else o.data_ptr(), 16, 16, ROWS4, y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w.double().T):
                return False
    return True


def packed_and_half(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """Packed 4-bit codes, float16 scales and offsets, and both, in plain rows and blocks of four."""
    # packed 4-bit codes (the same product from half the bytes), float16 scales, both
    codes = torch.randint(0, 16, (19, 128), generator=g, dtype=torch.int8)
    scale = (torch.rand(19, 4, generator=g) * 0.01).half()
    off = (torch.randn(19, 4, generator=g) * 0.01).half()
    w = (codes.float().view(19, 4, 32) * scale.float()[..., None] + off.float()[..., None]).view(19, 128)
    packed = pack4(codes)  # held: the kernel reads its memory
    for flags in (PACKED, HALF, PACKED | HALF, ROWS4, ROWS4 | PACKED, ROWS4 | PACKED | HALF):
        rows = 16 if flags & ROWS4 else 19  # ROWS4: whole blocks of four rows
        c = packed[:rows] if flags & PACKED else codes[:rows]
        c = block4(c) if flags & ROWS4 else c
        s, o = (scale, off) if flags & HALF else (scale.float(), off.float())
        s, o = s[:rows].contiguous(), o[:rows].contiguous()
        for m in (1, 5, 9):
            x, y = torch.randn(m, 128, generator=g), torch.empty(m, rows)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 128, c.data_ptr(), s.data_ptr(), o.data_ptr(),
                                         rows, 32, flags, y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w[:rows].double().T):
                return False
        if flags & ROWS4:  # without offsets too (Q8_0, Q5_0)
            x, y = torch.randn(1, 128, generator=g), torch.empty(1, rows)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), 1, 128, c.data_ptr(), s.data_ptr(), None, rows, 32, flags,
                                         y.data_ptr(), 2)
            wo = (codes[:rows].float().view(rows, 4, 32) * scale[:rows].float()[..., None]).view(rows, 128)
            if rc != 0 or not close(y, x.double() @ wo.double().T):
                return False
    return True


def signed_and_levels(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """Signed packed codes (Q4_0), IQ4_NL's levels, and signed codes in groups of 16."""
    # signed packed 4-bit codes (Q4_0) and IQ4_NL's levels, without offsets: K = 192 leaves a unit past the 512-bit
    # pairs; signed codes in groups of 16 (Q3_K without offsets, Q2_K with them), float32 scales
    levels = torch.tensor(IQ4_LEVELS)
    for k, iq4, group, offsets in ((128, False, 32, False), (192, False, 32, False), (128, True, 32, False),
                                   (192, True, 32, False), (192, False, 16, False), (192, False, 16, True)):
        index = torch.randint(0, 16, (20, k), generator=g, dtype=torch.int8)
        codes = levels[index.long()] if iq4 else index - 8
        scale = (torch.randn(20, k // group, generator=g) * 0.01).half()
        off = (torch.randn(20, k // group, generator=g) * 0.01).float() if offsets else None
        w = (codes.float().view(20, -1, group) * scale.float()[..., None]).view(20, k)
        w = w if off is None else w + off.repeat_interleave(group, dim=1)
        packed = pack4(index) if iq4 else pack4(codes, signed=True)
        level = IQ4 if iq4 else SIGNED4
        s = scale if group == 32 else scale.float()
        for flags in (PACKED | level, ROWS4 | PACKED | level):
            flags |= HALF if group == 32 else 0
            c = block4(packed) if flags & ROWS4 else packed
            for m in (1, 2, 5, 9):
                x, y = torch.randn(m, k, generator=g), torch.empty(m, 20)
                rc = lib.lmhead_coded_matmul(x.data_ptr(), m, k, c.data_ptr(), s.data_ptr(),
                                             None if off is None else off.data_ptr(), 20, group, flags, y.data_ptr(), 2)
                if rc != 0 or not close(y, x.double() @ w.double().T):
                    return False
    return True


def sub_scales(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The K-quants' sub-scales: d per 256 weights times an int8 per group."""
    # K-quant sub-scales (SUB): d per 256 weights times an int8 per group, scales and offsets, int8 and packed codes
    for group, packed, k in ((16, False, 512), (32, False, 768), (16, True, 512)):  # 768: a row's groups not 16s
        ng, nsup = k // group, k // 256
        codes = torch.randint(-8 if packed else -32, 8 if packed else 32, (20, k), generator=g, dtype=torch.int8)
        bufs, floats = [], []
        for _ in range(2):  # scale, offset
            d = (torch.randn(20, nsup, generator=g) * 1e-3).half().float()
            sub = torch.randint(-8, 8, (20, ng), generator=g, dtype=torch.int8)
            bufs.append(torch.cat([d.contiguous().view(torch.uint8).flatten(), sub.view(torch.uint8).flatten()]))
            floats.append(d.repeat_interleave(ng // nsup, dim=1) * sub.float())
        w = (codes.float().view(20, ng, group) * floats[0][..., None] + floats[1][..., None]).view(20, k)
        c = pack4(codes, signed=True) if packed else codes
        for flags in (SUB | (PACKED | SIGNED4 if packed else 0), SUB | ROWS4 | (PACKED | SIGNED4 if packed else 0)):
            cc = block4(c) if flags & ROWS4 else c
            for m in (1, 2, 5, 9):
                x, y = torch.randn(m, k, generator=g), torch.empty(m, 20)
                rc = lib.lmhead_coded_matmul(x.data_ptr(), m, k, cc.data_ptr(), bufs[0].data_ptr(), bufs[1].data_ptr(),
                                             20, group, flags, y.data_ptr(), 2)
                if rc != 0 or not close(y, x.double() @ w.double().T):
                    return False
    return True


def dense_weights(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """Float16, bfloat16 and float32 weights."""
    # float16, bfloat16 and float32 weights, K not a multiple of the vector width
    for flags, dtype in ((F16, torch.float16), (BF16, torch.bfloat16), (F32, torch.float32)):
        w16 = torch.randn(7, 75, generator=g).to(dtype)
        for m in (1, 4, 9):
            x, y = torch.randn(m, 75, generator=g), torch.empty(m, 7)
            rc = lib.lmhead_coded_matmul(x.data_ptr(), m, 75, w16.data_ptr(), None, None, 7, 75, flags,
                                         y.data_ptr(), 2)
            if rc != 0 or not close(y, x.double() @ w16.double().T):
                return False
    return True


def norms_and_gates(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The RMS norms (w or 1 + w), the residual add-and-norm, and the gated activations."""
    x, a = torch.randn(3, 40, generator=g), torch.randn(3, 40, generator=g)
    w1, w2 = torch.randn(40, generator=g), torch.randn(40, generator=g)
    eps = 1e-6
    for plus_one in (0, 1):
        def norm(v, w, plus_one=plus_one):
            y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
            return y * (1 + w) if plus_one else w * y
        y = torch.empty(3, 40)
        lib.lmhead_rms_norm(x.data_ptr(), w1.data_ptr(), y.data_ptr(), 3, 40, 1, eps, plus_one)
        if not close(y, norm(x, w1)):
            return False
        xo, h = torch.empty(3, 40), torch.empty(3, 40)
        lib.lmhead_add_norm(x.data_ptr(), a.data_ptr(), w1.data_ptr(), w2.data_ptr(), xo.data_ptr(), h.data_ptr(),
                            3, 40, eps, plus_one)
        if not (close(xo, x + norm(a, w1)) and close(h, norm(x + norm(a, w1), w2))):
            return False
    gu, out = torch.randn(2, 80, generator=g), torch.empty(2, 40)
    for act, fn in ((0, lambda t: torch.nn.functional.gelu(t, approximate="tanh")), (1, torch.nn.functional.silu)):
        lib.lmhead_gated(gu.data_ptr(), out.data_ptr(), 2, 40, act)
        if not close(out, fn(gu[:, :40]) * gu[:, 40:]):
            return False
    gu = gu * 6  # gpt-oss's clamped SwiGLU, its clamps reached
    lib.lmhead_swiglu_oai(gu.data_ptr(), out.data_ptr(), 2, 40, 1.702, 7.0)
    gate, up = gu[:, :40].clamp(max=7.0), gu[:, 40:].clamp(-7.0, 7.0)
    return close(out, (up + 1) * (gate * torch.sigmoid(gate * 1.702)))


def row_entry_points(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """The sampler rows' entry points: scores, greedy, top-p, a threshold selection and the seeded race."""
    rows = torch.randn(3, 1003, generator=g) * 4
    rows[1, 17] = float("-inf")
    lse, greater = row_scores_in(lib, rows, torch.tensor([5, 17, 1002]), threads=2)
    if not close(lse, torch.logsumexp(rows.double(), -1)) or greater.tolist() != [
            int((rows[b] > rows[b, t]).sum()) for b, t in enumerate((5, 17, 1002))]:
        return False
    rows[2, 3] = rows[2, 900] = rows[2].max() + 1  # a tie: the first position
    ids, lse = torch.empty(3, dtype=torch.int64), torch.empty(3, dtype=torch.float64)
    lib.lmhead_row_greedy(rows.data_ptr(), 3, 1003, ids.data_ptr(), lse.data_ptr(), 2)
    if ids.tolist() != rows.argmax(-1).tolist() or not close(lse, torch.logsumexp(rows.double(), -1)):
        return False
    row = torch.randn(1003, generator=g) * 3
    kept = top_p_row_in(lib, row, 0.7, 0.9)
    xt = row / 0.7
    v, i = torch.sort(xt, descending=True, stable=True)
    probs = torch.softmax(v.double(), -1)
    keep = probs.flip(-1).cumsum(-1).flip(-1) > 1 - 0.9
    keep[0] = True
    if kept is None or not (torch.equal(kept[1][0], i[keep]) and torch.equal(kept[0][0], v[keep])):
        return False
    row = torch.randn(100, generator=g)
    out = torch.empty(100, dtype=torch.int64)
    if lib.lmhead_select_ge(row.data_ptr(), 100, 0.5, out.data_ptr(), 100) != int((row >= 0.5).sum()):
        return False
    if out[:int((row >= 0.5).sum())].tolist() != (row >= 0.5).nonzero().squeeze(1).tolist():
        return False
    # the seeded race: kept candidates (-inf dropped) in id order, the first largest e^(v − max) / E
    vals, ids = torch.tensor([0.5, float("-inf"), 2.0, 1.0]), torch.tensor([40, 3, 9, 2])
    noise = torch.tensor([0.25, 4.0, 1.0])  # ids 2, 9, 40: keys e^-1 / 0.25, e^0 / 4, e^-1.5 / 1
    return lib.lmhead_race_row(vals.data_ptr(), ids.data_ptr(), 4, noise.data_ptr(), 3) == 3



def steps_test(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """step_kernels.c against torch's float64: the moments, a threshold cut, and the typical set by sorting, on a
    row wide enough to be cut into pieces over two threads."""
    row = torch.randn(40_003, generator=g) * 4
    row[7] = float("-inf")
    for threads in (1, 2):
        got = row_moments_in(lib, row, True, threads)
        d = row.double()
        fin = d[torch.isfinite(d)]
        e = torch.exp(d - d.max())
        want = (float(d.max()), fin.numel(), float(e.sum()), float((e[torch.isfinite(d)] * (fin - d.max())).sum()),
                float(fin.min()), float(fin.mean()), float(((fin - fin.mean()) ** 2).mean().sqrt()))
        if got is None or not all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
                                  for a, b in zip(got, want, strict=True)):
            return False
        mass = 0.7
        p = torch.softmax(d, -1)
        score = (d - (d.max() + got[3] / got[2])).abs()
        order = torch.sort(score, stable=True).indices
        last = int((p[order].cumsum(0) < mass).sum())
        keep = score <= score[order[last]]
        typ = typical_row_in(lib, row, mass, threads)
        if typ is None or not torch.equal(typ, torch.where(keep, row, float("-inf"))):
            return False
    out, d = (ctypes.c_double * 5)(), row.double()
    if lib.lmhead_coded_avx2():  # the bounded log-normaliser has no path without AVX2
        if lib.lmhead_row_lse_bounded(row.data_ptr(), row.shape[0], ctypes.addressof(out), 2):
            return False
        logp = torch.log_softmax(d, 0)
        exact, entropy = float(torch.logsumexp(d - d.max(), 0)), float(-(logp.exp() * logp).nansum())
        if not (out[0] == float(d.max()) and abs(out[1] - exact) <= out[2] < 1e-4
                and abs(out[3] - entropy) <= out[4] < 1e-4):
            return False
    kept = torch.empty_like(row)
    lib.lmhead_keep_ge(row.data_ptr(), row.shape[0], 0.5, kept.data_ptr())
    if not torch.equal(kept, torch.where(row >= 0.5, row, float("-inf"))):
        return False
    unsure = lib.lmhead_keep_ge_unsure(row.data_ptr(), row.shape[0], 0.5, 0.25, 0.75, float(row.max()), kept.data_ptr())
    return torch.equal(kept, torch.where(row >= 0.5, row, float("-inf"))) and unsure == int(
        ((row >= 0.25) & (row <= 0.75)).sum())


def attend_test(lib: ctypes.CDLL, g: torch.Generator) -> bool:
    """lmhead_attend against torch: rope, cache write, masked grouped attention (2 query heads per key head),
    without and with a sink logit per head (gpt-oss)."""
    b, t, h, hkv, hd, cap, start = 2, 3, 4, 2, 8, 10, 4
    qk = torch.randn(b, t, h + hkv, hd, generator=g)
    v = torch.randn(b, t, hkv, hd, generator=g)
    cos, sin = torch.randn(b, t, hd, generator=g), torch.randn(b, t, hd, generator=g)
    cache_k, cache_v = torch.randn(b, hkv, cap, hd, generator=g), torch.randn(b, hkv, cap, hd, generator=g)
    mask = torch.where(torch.rand(b, t, start + t, generator=g) < 0.3, -1e30, 0.0)
    for sinks in (None, torch.randn(h, generator=g) * 3):
        keys, values = cache_k.clone(), cache_v.clone()
        out = torch.empty(b, t, h * hd)
        want_k, want_v = keys.clone(), values.clone()
        rc = lib.lmhead_attend(AttendArgs(
            qk=qk.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(), keys=keys.data_ptr(),
            values=values.data_ptr(), mask=mask.data_ptr(), out=out.data_ptr(), qk_stride=(h + hkv) * hd,
            v_stride=hkv * hd, B=b, T=t, H=h, Hkv=hkv, hd=hd, cap=cap, start=start, scaling=0.5, softcap=0.0,
            threads=2, sinks=None if sinks is None else sinks.data_ptr()))
        roped = qk * cos[:, :, None] + qk.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin[:, :, None]
        want_k[:, :, start:start + t] = roped[:, :, h:].transpose(1, 2)
        want_v[:, :, start:start + t] = v.transpose(1, 2)
        q = roped[:, :, :h].transpose(1, 2)                                           # [B,H,T,hd]
        kk = want_k[:, :, :start + t].repeat_interleave(h // hkv, dim=1)
        vv = want_v[:, :, :start + t].repeat_interleave(h // hkv, dim=1)
        scores = q @ kk.transpose(-1, -2) * 0.5 + mask[:, None]
        if sinks is None:
            probs = torch.softmax(scores, -1)
        else:  # transformers' GptOss: the sink one more column of the softmax, dropped after it
            probs = torch.softmax(torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, t, 1)], -1), -1)[..., :-1]
        want = (probs @ vv).transpose(1, 2).reshape(b, t, h * hd)
        if not (rc == 0 and close(out, want) and close(keys, want_k) and close(values, want_v)):
            return False
    return True

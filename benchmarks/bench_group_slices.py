"""The integer path by groups (kernels/groups_kernel.h) beside the four-row layout's paths on the same codes.

    .venv/bin/python benchmarks/bench_group_slices.py [--repeats 7]

On Q8_0-like codes (random int8, float16 scales), Q4_1-like ones (random 0..15, float16 scales and offsets) and
K-quants' (Q4_K: 0..15 in groups of 32, Q6_K: −32..31 in groups of 16, their sub-scales as their blocks hold them)
at the packaged models' and the 1B shape's matrix shapes, 1, 16 and 256 query rows, two threads, each variant timed
in turn (best of --repeats): the four-row layout's float32 path and its integer path (slices per lane of four or
eight activations; where built), and the layout by groups (slices per group of 32; each group's exact sums from
VNNI, or from AMX's tiles for whole blocks of sixteen query rows where the CPU grants them). Every output of the
path by groups is checked within the float32 dot product's bound γ_K·Σ|w·x| of the float64 product (the column
gives the largest error over its bound). docs/decode.md reads the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from records import Figure, Recorder  # same folder: run as a script, it is on sys.path

from lmhead.kernels import native
from lmhead.models import groups16
from lmhead.models.coded_linear import CodedLinear, SubScales

# (codes, matrix, N, K): int8 codes as Q8_0's; packed 4-bit codes with offsets as Q4_1's (SmolLM2's packaged type)
CASES = [("Q8_0", "SmolLM2 gate/up", 3072, 576), ("Q8_0", "Gemma 3 gate/up", 4096, 640),
         ("Q8_0", "Gemma 3 down", 640, 2048), ("Q8_0", "1B shape gate/up", 16384, 2048),
         ("Q4_1", "SmolLM2 q/k/v", 960, 576), ("Q4_1", "SmolLM2 gate/up", 3072, 576),
         ("Q4_1", "SmolLM2 down", 576, 1536), ("Q4_1", "1B shape gate/up", 16384, 2048),
         ("Q4_K", "Gemma 3 attention out", 640, 1024), ("Q4_K", "1B shape gate/up", 16384, 2048),
         ("Q6_K", "Gemma 3 down", 640, 2048)]
ROWS = (1, 16, 256)
THREADS = 2
BITS = {"Q8_0": 2, "Q4_1": 1, "Q4_K": 1, "Q6_K": 2}  # lmhead_sliced's bit for each kind of product (paths.KINDS)


def _subscales(n: int, k: int, group: int, g: torch.Generator, sign: float) -> SubScales:
    """A K-quant's scales as its blocks hold them: d a float16 number per 256 weights, an int8 sub a group."""
    s = SubScales(n, k, group)
    s.d.copy_((torch.rand(n, k // 256, generator=g) * 4e-4 * sign).half().float())
    s.sub.copy_(torch.randint(1, 64, (n, k // group), generator=g, dtype=torch.int8))
    return s


def _matrices(kind: str, n: int, k: int, g: torch.Generator) -> tuple[CodedLinear, CodedLinear]:
    """The same codes in the four-row layout and by groups."""
    if kind in ("Q4_K", "Q6_K"):
        group, four_bit = (32, "unsigned") if kind == "Q4_K" else (16, None)
        codes = torch.randint(*((0, 16) if kind == "Q4_K" else (-32, 32)), (n, k), generator=g, dtype=torch.int8)
        scale = _subscales(n, k, group, g, 1.0)
        offset = _subscales(n, k, group, g, -1.0) if kind == "Q4_K" else None
        return tuple(CodedLinear.from_chunks(n, k, scale, offset, [(0, codes)], four_bit, groups16=by)
                     for by in (False, True))
    groups = k // 32
    scale = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
    if kind == "Q8_0":
        codes, offset, four_bit = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), None, None
    else:
        codes, four_bit = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8), "unsigned"
        offset = (-(torch.rand(n, groups, generator=g) * 0.1)).half().float()
    return tuple(CodedLinear(codes, scale, offset, four_bit=four_bit, groups16=by) for by in (False, True))


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    lib = native.library()
    if lib is None or not groups16.built():
        print("the integer path by groups is not built here (it needs AVX-512 VNNI): nothing to compare")
        return 0
    os.environ["LMHEAD_GROUPS16"] = "1"  # the layout made whatever this machine chose, to measure it
    old = lib.lmhead_sliced(-1)
    rec = Recorder("kernels")
    print(rec.header())
    table = rec.table("group_slices", "Products of int8 codes (Q8_0-like), packed 4-bit codes with offsets "
                      "(Q4_1-like) and K-quants' (Q4_K-like, Q6_K-like), two threads, ms per call, best of each "
                      "variant in turn: the four-row layout's float32 path and its integer path (slices per lane of "
                      "activations), and the integer path by groups (kernels/groups_kernel.h: slices per group of "
                      "32, each group's (or sixteen's) exact sums from VNNI"
                      f"{', or from AMX tiles for whole blocks of 16 rows' if lib.lmhead_groups16() == 2 else ''}; "
                      "the same bits either way)",
                      ["codes", "matrix", "N x K", "rows", "float32", "slices per lane", "by groups",
                       "vs float32", "vs the faster other", "largest error / bound"])
    g = torch.Generator().manual_seed(0)
    for kind, name, n, k in CASES:
        rows4, by_groups = _matrices(kind, n, k, g)
        assert by_groups.by_groups and not rows4.by_groups
        w = by_groups.dequantize().double()
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            x[:, 7] *= 40  # a massive-activation channel, as LLMs have

            def four_rows(mode: int, x=x, rows4=rows4):
                def run():
                    lib.lmhead_sliced(mode)
                    try:
                        return rows4(x)
                    finally:
                        lib.lmhead_sliced(old)
                return run

            prev = torch.get_num_threads()
            torch.set_num_threads(THREADS)
            t = {"float32": best_ms(four_rows(0), args.repeats),
                 "lanes": best_ms(four_rows(BITS[kind]), args.repeats) if lib.lmhead_sliced(-1) else None,
                 "groups": best_ms(lambda x=x, c=by_groups: c(x), args.repeats)}
            y = by_groups(x)
            torch.set_num_threads(prev)
            bound = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (x.double().abs() @ w.abs().T)
            err = float(((y.double() - x.double() @ w.T).abs() / bound).max())
            other = min(v for key, v in t.items() if key != "groups" and v is not None)
            cells = [kind, name, f"{n} x {k}", m] + [f"{t[key]:.3f}" if t[key] is not None else "—"
                                                     for key in ("float32", "lanes", "groups")]
            cells += [f"{t['float32'] / t['groups']:.2f}x", f"{other / t['groups']:.2f}x", f"{err:.3f}"]
            print(" | ".join(str(c) for c in cells), f"| load {os.getloadavg()[0]:.2f}", flush=True)
            table.row(cells, [Figure(f"{kind} {name}, {m} rows, by groups", t["groups"], "ms",
                                     "the four-row layout's faster path", other)])
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

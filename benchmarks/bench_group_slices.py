"""A candidate for the int8-code products measured beside the library's: query rows sliced per group of 32
activations, each group's three exact integer sums from VNNI (decode-sized calls) or AMX's tiles (prefill), the same
bits either way (benchmarks/group_slices.c says how).

    .venv/bin/python benchmarks/bench_group_slices.py [--repeats 7]

On Q8_0-like codes (random int8, float16 scales) and Q4_1-like ones (random 0..15, float16 scales and offsets) at
the packaged models' and the 1B shape's matrix shapes, 1, 16 and 256 query rows, two threads, each variant timed in
turn (best of --repeats): the library's float32 path, its integer path (slices per lane of four or eight
activations; where built), the group slices through VNNI and through AMX
(where this CPU and kernel grant the tiles). Checked on every call measured: the VNNI and AMX results are the same
bits, and every output is within the float32 dot product's bound γ_K·Σ|w·x| of the float64 product (the column
gives the largest error over its bound). The candidate is not the library's code; docs/decode.md reads the table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from records import Figure, Recorder  # same folder: run as a script, it is on sys.path

from lmhead.kernels import native
from lmhead.models.coded_linear import CodedLinear

# (codes, matrix, N, K): int8 codes as Q8_0's; packed 4-bit codes with offsets as Q4_1's (SmolLM2's packaged type)
CASES = [("Q8_0", "SmolLM2 gate/up", 3072, 576), ("Q8_0", "Gemma 3 gate/up", 4096, 640),
         ("Q8_0", "Gemma 3 down", 640, 2048), ("Q8_0", "1B shape gate/up", 16384, 2048),
         ("Q4_1", "SmolLM2 q/k/v", 960, 576), ("Q4_1", "SmolLM2 gate/up", 3072, 576),
         ("Q4_1", "SmolLM2 down", 576, 1536), ("Q4_1", "1B shape gate/up", 16384, 2048)]
ROWS = (1, 16, 256)
THREADS = 2
BITS = {"Q8_0": 2, "Q4_1": 1}  # lmhead_sliced's bit for each kind of product (kernels/paths.py's KINDS)


def build(work: Path) -> ctypes.CDLL | None:
    """group_slices.c as a shared library (with AMX where the compiler takes it), or None where it does not build
    (no AVX-512 VNNI)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    src, out = Path(__file__).with_name("group_slices.c"), work / "group_slices.so"
    base = [cc, "-O3", "-march=native", "-fPIC", "-fopenmp", "-shared", str(src), "-o", str(out), "-lm"]
    for extra in (["-mamx-tile", "-mamx-int8"], []):
        if subprocess.run(base[:1] + extra + base[1:], capture_output=True).returncode == 0:
            lib = ctypes.CDLL(str(out))
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            lib.gs_product.argtypes = [p, i64, i64, p, p, p, i64, ctypes.c_int, p, ctypes.c_int, ctypes.c_int]
            lib.gs_layout.argtypes = [p, p, p, i64, i64, ctypes.c_int, p, p, p]
            return lib
    return None


class Layout:
    """Random codes of `kind` ("Q8_0": int8; "Q4_1": 0..15 with offsets), float16 scales (and offsets) [N, K/32],
    and the candidate's layout of them (`gs_layout`)."""

    def __init__(self, gs: ctypes.CDLL, kind: str, n: int, k: int, g: torch.Generator) -> None:
        self.gs, self.n, self.k, self.packed = gs, n, k, kind == "Q4_1"
        groups = k // 32
        self.scale = (torch.rand(n, groups, generator=g) * 0.02 + 1e-3).half().float()
        if self.packed:
            self.codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int8)
            self.offset = (-(torch.rand(n, groups, generator=g) * 0.1)).half().float()
        else:
            self.codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
            self.offset = None
        self.laid = torch.empty(n * k // 2 if self.packed else n * k, dtype=torch.uint8)
        self.s16 = torch.empty(n * groups)
        self.m16 = torch.empty(n * groups) if self.packed else None
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        gs.gs_layout(self.codes.data_ptr(), self.scale.data_ptr(), ptr(self.offset), n, k, int(self.packed),
                     self.laid.data_ptr(), self.s16.data_ptr(), ptr(self.m16))
        self._ptrs = (self.laid.data_ptr(), self.s16.data_ptr(), ptr(self.m16))

    def weights(self) -> torch.Tensor:
        """The float64 matrix [N, K] the codes encode."""
        w = self.codes.double().view(self.n, -1, 32) * self.scale.double()[..., None]
        return (w if self.offset is None else w + self.offset.double()[..., None]).view(self.n, self.k)

    def product(self, x: torch.Tensor, y: torch.Tensor, threads: int, amx: bool) -> None:
        """y [M, N] = x [M, K] · Wᵀ through the candidate (AMX's tiles for whole blocks of 16 rows where `amx`)."""
        rc = self.gs.gs_product(x.data_ptr(), x.shape[0], self.k, *self._ptrs, self.n, int(self.packed),
                                y.data_ptr(), threads, int(amx))
        if rc != 0:
            raise RuntimeError(f"gs_product returned {rc}")


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
    if lib is None:
        print("the library's kernels are not built here: nothing to compare")
        return 0
    with tempfile.TemporaryDirectory() as work:
        gs = build(Path(work))
        if gs is None:
            print("group_slices.c does not build here (it needs AVX-512 VNNI): nothing to compare")
            return 0
        amx = gs.gs_amx() == 0
        old = lib.lmhead_sliced(-1)
        lanes = lib.lmhead_sliced(3) == 3
        lib.lmhead_sliced(old)
        rec = Recorder("kernels")
        print(rec.header())
        table = rec.table("group_slices", "Products of int8 codes (Q8_0-like) and packed 4-bit codes with offsets "
                          "(Q4_1-like), two threads, ms per call, best of each variant in turn: the library's float32 "
                          "path and its integer path (slices per lane of activations), and a candidate "
                          "(benchmarks/group_slices.c: slices per group of 32, each group's exact sums from VNNI or "
                          "from AMX's tiles, the same bits)",
                          ["codes", "matrix", "N x K", "rows", "float32", "slices per lane", "groups, VNNI",
                           "groups, AMX", "best vs float32", "largest error / bound", "VNNI = AMX"])
        g = torch.Generator().manual_seed(0)
        for kind, name, n, k in CASES:
            layout = Layout(gs, kind, n, k, g)
            coded = CodedLinear(layout.codes, layout.scale, layout.offset)
            w = layout.weights()
            for m in ROWS:
                x = torch.randn(m, k, generator=g)
                x[:, 7] *= 40  # a massive-activation channel, as LLMs have
                ys = {"vnni": torch.empty(m, n), "amx": torch.empty(m, n)}

                def ours(mode: int, coded=coded, x=x):
                    def run():
                        lib.lmhead_sliced(mode)
                        try:
                            return coded(x)
                        finally:
                            lib.lmhead_sliced(old)
                    return run

                def group(variant: str, layout=layout, x=x, ys=ys):
                    def run():
                        layout.product(x, ys[variant], THREADS, variant == "amx")
                    return run

                prev = torch.get_num_threads()
                torch.set_num_threads(THREADS)
                t = {"float32": best_ms(ours(0), args.repeats)}
                t["lanes"] = best_ms(ours(BITS[kind]), args.repeats) if lanes else None
                t["vnni"] = best_ms(group("vnni"), args.repeats)
                t["amx"] = best_ms(group("amx"), args.repeats) if amx and m >= 16 else None
                torch.set_num_threads(prev)
                exact = x.double() @ w.T
                bound = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (x.double().abs() @ w.abs().T)
                err = float(((ys["vnni"].double() - exact).abs() / bound).max())
                same = "—" if t["amx"] is None else ("yes" if torch.equal(ys["vnni"].view(torch.int32),
                                                                          ys["amx"].view(torch.int32)) else "NO")
                best = min(v for key, v in t.items() if key != "float32" and v is not None)
                cells = [kind, name, f"{n} x {k}", m] + [f"{t[key]:.3f}" if t[key] is not None else "—"
                                                         for key in ("float32", "lanes", "vnni", "amx")]
                cells += [f"{t['float32'] / best:.2f}x", f"{err:.3f}", same]
                print(" | ".join(str(c) for c in cells), f"| load {os.getloadavg()[0]:.2f}", flush=True)
                table.row(cells, [Figure(f"{kind} {name}, {m} rows, best candidate", best, "ms", "float32 path",
                                         t["float32"])])
        table.note(f"AMX tiles granted: {'yes' if amx else 'no'}; the library's integer path built: "
                   f"{'yes' if lanes else 'no'}")
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

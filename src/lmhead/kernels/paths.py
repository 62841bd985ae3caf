"""Which path each product takes on this CPU, chosen once per machine by measuring, not assumed.

Packed 4-bit products (Q4_0, Q4_1, Q4_K) have two paths where the library was built with AVX-512 VNNI: the float32
one (each code converted and multiplied in float32) and the integer one (sliced_kernel.h: the query row in three
8-bit slices, the codes' products summed exactly in int32 by vpdpbusd; within the float32 product's own error
bound, checked per query row). Both give the same tokens to float32 rounding; which is faster depends on the CPU,
so the first process to load a build times the two on a decode-sized product and keeps the answer beside the
library (`<library>.paths.json`, written to a temporary file and renamed, checked on load). `LMHEAD_SLICED=0` or
`1` overrides it. `describe()` says what was chosen and why (benchmarks print it with their records).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import time
from pathlib import Path

import torch

from lmhead.kernels.abi import PACKED, ROWS4
from lmhead.kernels.layout4 import block4, pack4

__all__ = ["choose", "describe"]

_N, _K = 1024, 1024  # a decode-sized product: 0.5 MB of codes, from L2/L3 as a model's are
_REPEATS = 7
_chosen: dict = {}


def _time_product(lib: ctypes.CDLL, mode: int, args: tuple, y: torch.Tensor) -> float:
    lib.lmhead_sliced(mode)
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        lib.lmhead_coded_matmul(*args, y.data_ptr(), 1)
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(lib: ctypes.CDLL) -> dict:
    """Both paths of one packed product (one query row, one thread), interleaved, the faster of each's best."""
    g = torch.Generator().manual_seed(0)
    codes = block4(pack4(torch.randint(0, 16, (_N, _K), generator=g, dtype=torch.int8)))
    scale = torch.rand(_N, _K // 32, generator=g) * 0.01
    offset = torch.randn(_N, _K // 32, generator=g) * 0.01
    x = torch.randn(1, _K, generator=g)
    y = torch.empty(1, _N)
    args = (x.data_ptr(), 1, _K, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), _N, 32, PACKED | ROWS4)
    times = {0: float("inf"), 1: float("inf")}
    for _ in range(3):
        for mode in (0, 1):
            times[mode] = min(times[mode], _time_product(lib, mode, args, y))
    return {"sliced": times[1] < times[0], "float_us": round(times[0] * 1e6, 1),
            "sliced_us": round(times[1] * 1e6, 1), "how": "measured"}


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("sliced"), bool):
        return None
    return data


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    with contextlib.suppress(OSError):
        tmp.unlink()


def choose(lib: ctypes.CDLL, library_path: Path) -> dict:
    """Set the library's path for packed products (`lmhead_sliced`) and return what was chosen and why."""
    global _chosen
    if lib.lmhead_sliced(-1) == 0 and lib.lmhead_sliced(1) == 0:
        _chosen = {"sliced": False, "how": "not built: this CPU has no AVX-512 VNNI"}
        return _chosen
    env = os.environ.get("LMHEAD_SLICED")
    if env in ("0", "1"):
        _chosen = {"sliced": env == "1", "how": "LMHEAD_SLICED"}
    else:
        record = library_path.with_name(library_path.name + ".paths.json")
        _chosen = _read(record) or {}
        if not _chosen:
            _chosen = _measure(lib)
            _write(record, _chosen)
    lib.lmhead_sliced(int(_chosen["sliced"]))
    return _chosen


def describe() -> str:
    """One line: the path packed 4-bit products take here, and why."""
    if not _chosen:
        return "packed 4-bit products: float32 (no native library)"
    path = "int8 slices (AVX-512 VNNI)" if _chosen["sliced"] else "float32"
    why = _chosen.get("how", "")
    if why == "measured":
        why = f"measured: float32 {_chosen['float_us']} µs, int8 slices {_chosen['sliced_us']} µs a product"
    return f"packed 4-bit products: {path} ({why})"

"""Which path each product takes on this CPU, chosen once per machine by measuring, not assumed.

Where the library was built with AVX-512 VNNI, products over blocks of four rows have two paths: the float32 one
(each code converted and multiplied in float32) and the integer one (sliced_kernel.h: the query row in three 8-bit
slices, the codes' products summed exactly in int32 by vpdpbusd; within the float32 product's own error bound,
checked per query row). Both give the same tokens to float32 rounding; which is faster depends on the CPU and the
layout, so the first process to load a build times the two on a decode-sized product of each kind — packed 4-bit
codes (Q4_0, Q4_1, Q4_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4) and int8 codes without offsets (Q8_0, Q5_0, Q6_K) —
and keeps the answer beside the library (`<library>.paths.json`, written to a temporary file and renamed, checked
on load). `LMHEAD_SLICED=0` or `1` turns the integer path off or on for both. Where the library also builds the
integer path by groups (groups_kernel.h: matrices laid out sixteen rows a vector, the K-quants' among them),
whether each kind takes it is measured the same way on a decode-like sweep (`groups16_chosen`; `LMHEAD_GROUPS16`).
`describe()` says what was chosen and why (benchmarks print it with their records).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

from lmhead.kernels import layout16
from lmhead.kernels.abi import GROUPS16, HALF, PACKED, ROWS4
from lmhead.kernels.layout4 import block4, pack4

__all__ = ["choose", "describe", "groups16_chosen"]

_N, _K = 1024, 1024  # a decode-sized product: 0.5–1 MB of codes, from L2/L3 as a model's are
_REPEATS = 7
KINDS = {"packed": 1, "int8": 2}  # lmhead_sliced's bits
_chosen: dict = {}


def _time_product(lib: ctypes.CDLL, mode: int, args: tuple, y: torch.Tensor) -> float:
    lib.lmhead_sliced(mode)
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        lib.lmhead_coded_matmul(*args, y.data_ptr(), 1)
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(lib: ctypes.CDLL, kind: str) -> dict:
    """Both paths of one product of `kind` (one query row, one thread), interleaved, each's best."""
    g = torch.Generator().manual_seed(0)
    if kind == "packed":
        codes = block4(pack4(torch.randint(0, 16, (_N, _K), generator=g, dtype=torch.int8)))
        offset = torch.randn(_N, _K // 32, generator=g) * 0.01
        flags = PACKED | ROWS4
    else:
        codes = block4(torch.randint(-127, 128, (_N, _K), generator=g, dtype=torch.int8))
        offset, flags = None, ROWS4
    scale = torch.rand(_N, _K // 32, generator=g) * 0.01
    x = torch.randn(1, _K, generator=g)
    y = torch.empty(1, _N)
    args = (x.data_ptr(), 1, _K, codes.data_ptr(), scale.data_ptr(), None if offset is None else offset.data_ptr(),
            _N, 32, flags)
    times = {0: float("inf"), 1: float("inf")}
    for _ in range(3):
        for on in (0, 1):
            times[on] = min(times[on], _time_product(lib, KINDS[kind] if on else 0, args, y))
    return {"sliced": times[1] < times[0], "float_us": round(times[0] * 1e6, 1),
            "sliced_us": round(times[1] * 1e6, 1)}


_STREAM = 16  # matrices a decode-like sweep cycles through (several MB: from the L3 or memory, as a step reads)


_ROUND = 16  # query rows of a round's or a prefill's product (a block of AMX's tiles)


def _measure_groups16(lib: ctypes.CDLL, kind: str) -> dict:
    """The body's product of `kind` ("packed": Q4_1-like codes with offsets; "int8": Q8_0-like) by groups
    (kernels/groups_kernel.h) against the four-row layout's (under the path chosen for it), on two threads through
    _STREAM decode-sized matrices in turn — a step streams its matrices, so their prefetching and the threads'
    shares count, not a hot product alone —, interleaved, each's best sweep: one query row (a decode step) and
    _ROUND rows (a server round, a prefill's chunk). One layout serves both (a row's bits must not depend on its
    batch), so the one chosen costs less for a generated token and a prompt token weighted alike: the one-row sweep
    plus a row's share of the _ROUND-row sweep."""
    g = torch.Generator().manual_seed(0)
    packed = kind == "packed"
    four_bit = "unsigned" if packed else None
    calls: dict[bool, list] = {False: [], True: []}
    keep = []  # the buffers the calls point into
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    x = torch.randn(_ROUND, _K, generator=g)
    y = torch.empty(_ROUND, _N)
    for _ in range(_STREAM):
        codes = torch.randint(0, 16, (_N, _K), generator=g, dtype=torch.int8) if packed else \
            torch.randint(-127, 128, (_N, _K), generator=g, dtype=torch.int8)
        scale = (torch.rand(_N, _K // 32, generator=g) * 0.01).half()
        offset = (torch.rand(_N, _K // 32, generator=g) * -0.1).half() if packed else None
        rows4 = block4(pack4(codes) if packed else codes)
        laid = layout16.lay_out(codes, four_bit)
        s16, m16 = layout16.scales_out(scale), None if offset is None else layout16.scales_out(offset)
        keep += [rows4, scale, offset, laid, s16, m16]
        calls[False].append((x.data_ptr(), 1, _K, rows4.data_ptr(), scale.data_ptr(), ptr(offset), _N, 32,
                             ROWS4 | HALF | (PACKED if packed else 0)))
        calls[True].append((x.data_ptr(), 1, _K, laid.data_ptr(), s16.data_ptr(), ptr(m16), _N, 32,
                            GROUPS16 | HALF | (PACKED if packed else 0)))

    def sweep(on: bool, m: int) -> float:
        t0 = time.perf_counter()
        for args in calls[on]:
            lib.lmhead_coded_matmul(args[0], m, *args[2:], y.data_ptr(), 2)
        return time.perf_counter() - t0

    times = {(on, m): float("inf") for on in (False, True) for m in (1, _ROUND)}
    for _ in range(_REPEATS):
        for on, m in times:
            times[on, m] = min(times[on, m], sweep(on, m))
    us = {key: round(t / _STREAM * 1e6, 1) for key, t in times.items()}  # per product, as the record says
    cost = {on: us[on, 1] + us[on, _ROUND] / _ROUND for on in (False, True)}
    return {"groups16": cost[True] < cost[False], "rows4_us": us[False, 1], "groups16_us": us[True, 1],
            "rows4_round_us": us[False, _ROUND], "groups16_round_us": us[True, _ROUND]}


_BUSY = 4.0  # a two-thread sweep's product this many times a one-thread product's: the cores were busy
_TRIES = 2


def _busy(chosen: dict, measured: dict) -> bool:
    """Whether the two-thread sweeps ran on busy cores: a decode-sized product on two threads takes about a
    one-thread product's time or less, but where both cores are taken each fork and barrier waits for a time slice
    (milliseconds, not microseconds), so the sweeps' times say nothing about the layouts."""
    for kind in KINDS:
        one = [chosen[kind][key] for key in ("float_us", "sliced_us") if key in chosen[kind]]
        if one and min(measured[kind]["rows4_us"], measured[kind]["groups16_us"]) > _BUSY * min(one):
            return True
    return False


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or any(not isinstance(data.get(k), dict) or
                                         not isinstance(data[k].get("sliced"), bool) for k in KINDS):
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
    """Set which products take the library's integer path (`lmhead_sliced`) and return what was chosen and why:
    {kind: {"sliced": bool, ...}, "how": ...}."""
    global _chosen
    if lib.lmhead_sliced(-1) == 0 and lib.lmhead_sliced(3) == 0:
        _chosen = {"how": "not built: this CPU has no AVX-512 VNNI"}
        return _chosen
    env = os.environ.get("LMHEAD_SLICED")
    if env not in (None, "", "0", "1"):
        print(f"lmhead: LMHEAD_SLICED must be 0 or 1, got {env!r}; choosing by measuring", file=sys.stderr,
              flush=True)
    if env in ("0", "1"):
        _chosen = {kind: {"sliced": env == "1"} for kind in KINDS} | {"how": "LMHEAD_SLICED"}
    else:
        record = library_path.with_name(library_path.name + ".paths.json")
        _chosen = _read(record) or {}
        if not _chosen:
            _chosen = {kind: _measure(lib, kind) for kind in KINDS} | {"how": "measured"}
            _write(record, _chosen)
    lib.lmhead_sliced(sum(bit for kind, bit in KINDS.items() if _chosen[kind]["sliced"]))
    _chosen["groups16_built"] = lib.lmhead_groups16() > 0  # not a kind: not kept in the record
    measured = _chosen.get("groups16", {})
    if (_chosen["groups16_built"] and env not in ("0", "1")
            and not all("groups16_round_us" in measured.get(kind, {}) for kind in KINDS)):  # or an older record's
        for _ in range(_TRIES):
            _chosen["groups16"] = {kind: _measure_groups16(lib, kind) for kind in KINDS}
            busy = _busy(_chosen, _chosen["groups16"])
            if not busy:
                break
        if busy:  # not kept: a record made on busy cores would choose for every later process
            print("lmhead: the CPU's cores were busy while the layouts by groups were timed; this process uses "
                  "those times, and the next process to load the kernels times them again", file=sys.stderr,
                  flush=True)
        else:
            _write(library_path.with_name(library_path.name + ".paths.json"),
                   {k: v for k, v in _chosen.items() if k != "groups16_built"})
    return _chosen


def groups16_chosen(kind: str) -> bool:
    """Whether the matrices of `kind` ("packed" or "int8" codes, a K-quant's too) — the body's, the embedding's and
    the head's — take the integer path by groups (`models/groups16.py`) where the library builds it (`choose` has
    run): measured cheaper here for a generated token and a prompt token weighted alike (`_measure_groups16`;
    `LMHEAD_GROUPS16=0` or `1` says, else `LMHEAD_SLICED`, which turns every integer path off or on)."""
    if not _chosen.get("groups16_built"):
        return False
    for env in (os.environ.get("LMHEAD_GROUPS16"), os.environ.get("LMHEAD_SLICED")):
        if env in ("0", "1"):
            return env == "1"
    return bool(_chosen.get("groups16", {}).get(kind, {}).get("groups16", False))


def chosen() -> dict:
    """What `choose` chose for this process's library: {kind: {"sliced": bool, ...}, "how": ...} (empty before)."""
    return dict(_chosen)


def describe() -> str:
    """One line: the path each kind of product takes here, and why."""
    if not _chosen:
        return "float32 products (no native library)"
    if not any(kind in _chosen for kind in KINDS):
        return f"float32 products ({_chosen['how']})"
    parts = []
    for kind, name in (("packed", "packed 4-bit"), ("int8", "int8-code")):
        c = _chosen[kind]
        path = "int8 slices (AVX-512 VNNI)" if c["sliced"] else "float32"
        timing = f": float32 {c['float_us']} µs, int8 slices {c['sliced_us']} µs" if "float_us" in c else ""
        parts.append(f"{name} products {path}{timing}")
    for kind, name in (("packed", "packed 4-bit"), ("int8", "int8")):
        c = _chosen.get("groups16", {}).get(kind)
        if c and "groups16_round_us" in c:  # (a record from before the rounds, kept under LMHEAD_SLICED: not said)
            parts.append(f"{name} codes of the body, embedding and head {'by groups' if c['groups16'] else 'as above'} "
                         f"(a decode-like sweep of one row and of {_ROUND}: four-row layout {c['rows4_us']} and "
                         f"{c['rows4_round_us']} µs, by groups {c['groups16_us']} and {c['groups16_round_us']} µs)")
    return "; ".join(parts) + f" ({_chosen['how']})"

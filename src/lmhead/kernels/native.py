"""lmhead's C kernels: built once per machine with the system C compiler, loaded with ctypes, self-tested.

    coded_kernel.c   the product over GGUF codes (models/coded_linear.py)
    body_kernels.c   the decode step's small work: RMSNorm, residual add + norms, gated activation, and
                     rope + cache write + attention for the new tokens (models/lean.py's step-by-step path)
    decode_kernels.c `lmhead_step`, every block of a decode step in one call over the coded matrices, and
                     `lmhead_decode`, the same from token ids with the step's bookkeeping (models/lean.py)
    row_kernels.c    the decode loop's passes over whole rows: raw logprob and rank of each chosen token
                     (`row_scores`, lmhead/decode/scores.py); a greedy row's argmax and normaliser in one call
                     (`greedy_rows`, lmhead/decode/engine.py); a row's exact top-p set (`top_p_row`,
                     lmhead/sampling/top_p.py); an unseeded row's draw (`sample_row`); `topk`'s candidates
    step_kernels.c   the declared sampler steps' passes over a row, in float64 (lmhead/sampling/steps/moments.py):
                     a row's moments (`row_moments`), locally typical sampling's kept set (`typical_row`), a cut
                     at a threshold (`keep_ge`)
    experts_kernel.c a mixture-of-experts MLP over a layer's chosen experts in one call (bound in
                     kernels/experts.py, called by models/moe.py)
    simd_math.h, body_kernels.h, decode_kernels.h, quant_types.h   what the sources share (vector exp;
                     declarations, structs; the coded layouts' flags and level tables)
    row_pieces.h     how the row passes cut a row for the threads (by its width alone: the same bits whatever
                     the thread count or the batch); kernel_results.h: a kernel's int results (abi.NO_MEMORY)
      ──cc -O3 -march=native -fopenmp (kernels/builder.py)──▶ <cache>/kernels/lmhead-<hash>.so (a temporary
      file renamed into place; begun in the background by `load_model` while it reads the file)

Why C: torch ships no kernel for grouped int8 codes × float32 activations (its int4/int8 weight-only ops
quantise the activations or measured slower than float32 here: benchmarks/bench_body.py), and a decode step
of a small model is dominated by the dispatch of ~400 tiny element-wise torch ops. The library links the
libgomp torch has already loaded, so the two share one thread pool. Where there is no compiler, or the
library fails its self-test against plain torch math, `library()` is None and every caller uses torch's ops
(the same numbers, slower). LMHEAD_NATIVE=0 switches it off (benchmarks compare with and without).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import sys

import torch

from lmhead.kernels import builder
from lmhead.kernels.abi import (
    ACT_VALUES,
    ARGS,
    BF16,
    E8M0,
    F16,
    F32,
    FLAGS,
    GROUPS16,
    HALF,
    HALF_MAX_GROUPS,
    HIGH1,
    HIGH2,
    IQ4,
    IQ4_LEVELS,
    LEVELS,
    MXFP4,
    PACKED,
    ROUTE_FN,
    ROWS4,
    SAMPLE_CAP,
    SIGNED4,
    SUB,
    AttendArgs,
    DecodeArgs,
    LayerDesc,
    MatDesc,
    StepArgs,
    row_moments_in,
    row_scores_in,
    top_p_row_in,
    typical_row_in,
)
from lmhead.kernels.builder import SOURCES, library_path
from lmhead.kernels.layout4 import block4, pack4, unblock4, unpack4

__all__ = ["BF16", "E8M0", "F16", "F32", "FLAGS", "GROUPS16", "HALF", "HALF_MAX_GROUPS", "HIGH1", "HIGH2", "IQ4",
           "IQ4_LEVELS", "LEVELS", "MXFP4", "PACKED", "ROUTE_FN", "ROWS4", "SIGNED4", "SOURCES", "SUB", "AttendArgs",
           "DecodeArgs", "LayerDesc", "MatDesc", "StepArgs", "block4", "keep_ge", "keep_ge_unsure", "library",
           "library_path", "pack4",
           "row_lse_bounded", "row_moments", "row_scores", "screen_min_rows", "select_ge", "sub_sixteen", "top_k_row",
           "topk", "topk_rows", "typical_row", "unblock4", "unpack4"]

_ABI = 34  # lmhead_coded_abi() of the sources above


def _layout_mismatch(lib: ctypes.CDLL) -> str | None:
    """Which argument struct the library and its ctypes mirror disagree on the size of (None: none): a call with
    a wrong layout would read and write memory at the wrong places, so the library is not used at all."""
    for name, mirror in ARGS.items():
        size = getattr(lib, f"{name}_size")
        size.restype = ctypes.c_size_t
        if size() != ctypes.sizeof(mirror):
            return f"{name} is {size()} bytes in C and {ctypes.sizeof(mirror)} in kernels/native.py"
    return None


def _facts_mismatch(lib: ctypes.CDLL) -> str | None:
    """Where the library's flags or level tables (quant_types.h) differ from this module's mirror (None: nowhere):
    codes laid out for other flags or levels would be multiplied as other numbers."""
    values = (ctypes.c_int64 * 64)()
    count = lib.lmhead_flag_values(values, 64)
    if tuple(values[:count]) != FLAGS:
        return f"its flags are {tuple(values[:count])}, kernels/native.py's {FLAGS}"
    table = (ctypes.c_int8 * 16)()
    for flag, levels in LEVELS.items():
        if lib.lmhead_level_table(flag, table) != 0 or tuple(table) != levels:
            return f"its level table of flag {flag} is not kernels/native.py's {levels}"
    acts = (ctypes.c_int * 16)()
    count = lib.lmhead_act_values(acts, 16)
    if tuple(acts[:count]) != ACT_VALUES:
        return f"its activation codes are {tuple(acts[:count])}, kernels/abi.py's {ACT_VALUES}"
    return None


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.lmhead_coded_abi.restype = i32
    lib.lmhead_coded_avx2.restype = i32
    lib.lmhead_sliced.argtypes = [i32]
    lib.lmhead_sliced.restype = i32
    lib.lmhead_groups16.restype = i32
    lib.lmhead_flag_values.argtypes = [p, i32]
    lib.lmhead_flag_values.restype = i32
    lib.lmhead_level_table.argtypes = [i32, p]
    lib.lmhead_level_table.restype = i32
    lib.lmhead_act_values.argtypes = [p, i32]
    lib.lmhead_act_values.restype = i32
    lib.lmhead_coded_matmul.argtypes = [p, i64, i64, p, p, p, i64, i64, i32, p, i32]
    lib.lmhead_coded_matmul.restype = i32
    lib.lmhead_rms_norm.argtypes = [p, p, p, i64, i64, i64, f32, i32]
    lib.lmhead_rms_norm.restype = None
    lib.lmhead_add_norm.argtypes = [p, p, p, p, p, p, i64, i64, f32, i32]
    lib.lmhead_add_norm.restype = None
    lib.lmhead_gated.argtypes = [p, p, i64, i64, i32]
    lib.lmhead_gated.restype = None
    lib.lmhead_swiglu_oai.argtypes = [p, p, i64, i64, f32, f32]
    lib.lmhead_swiglu_oai.restype = None
    lib.lmhead_row_scores.argtypes = [p, i64, i64, p, p, p, i32]
    lib.lmhead_row_scores.restype = None
    lib.lmhead_row_greedy.argtypes = [p, i64, i64, p, p, i32]
    lib.lmhead_row_greedy.restype = None
    lib.lmhead_top_p_row.argtypes = [p, i64, f32, ctypes.c_double, p, p, i64, i32]
    lib.lmhead_top_p_row.restype = i64
    lib.lmhead_sample_row.argtypes = [p, i64, f32, i64, ctypes.c_double, ctypes.c_double, ctypes.c_double, p, p,
                                      i32]
    lib.lmhead_sample_row.restype = i32
    lib.lmhead_race_row.argtypes = [p, p, i64, p, i64]
    lib.lmhead_race_row.restype = i64
    lib.lmhead_top_k_row.argtypes = [p, i64, f32, i64, p, p, i64]
    lib.lmhead_top_k_row.restype = i64
    lib.lmhead_select_ge.argtypes = [p, i64, f32, p, i64]
    lib.lmhead_select_ge.restype = i64
    lib.lmhead_row_moments.argtypes = [p, i64, i32, p, i32]
    lib.lmhead_row_moments.restype = i32
    lib.lmhead_keep_ge.argtypes = [p, i64, f32, p]
    lib.lmhead_keep_ge.restype = None
    lib.lmhead_typical_row.argtypes = [p, i64, ctypes.c_double, p, i32]
    lib.lmhead_typical_row.restype = i64
    lib.lmhead_row_lse_bounded.argtypes = [p, i64, p, i32]
    lib.lmhead_row_lse_bounded.restype = i32
    lib.lmhead_keep_ge_unsure.argtypes = [p, i64, f32, f32, f32, f32, p]
    lib.lmhead_keep_ge_unsure.restype = i64
    lib.lmhead_attend.argtypes = [ctypes.POINTER(AttendArgs)]
    lib.lmhead_attend.restype = i32
    lib.lmhead_step.argtypes = [ctypes.POINTER(StepArgs)]
    lib.lmhead_step.restype = i32
    lib.lmhead_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
    lib.lmhead_decode.restype = i32
    lib.lmhead_coded_rows.argtypes = [ctypes.POINTER(MatDesc), p, i64, p]
    lib.lmhead_coded_rows.restype = i32
    lib.lmhead_screen_norms.argtypes = [p, p, i64, i64, p, i32]
    lib.lmhead_screen_norms.restype = i32
    lib.lmhead_screen.argtypes = [p, i64, i64, p, p, i64, p, p, i32]
    lib.lmhead_screen.restype = i32
    lib.lmhead_screen_select.argtypes = [p, i64, i64, p, p, p, i64, p, p, i32]
    lib.lmhead_screen_select.restype = i32
    lib.lmhead_screen_rescore.argtypes = [p, i64, i64, p, p, i64, p, p, i64, p, i32]
    lib.lmhead_screen_rescore.restype = i32
    lib.lmhead_screen_min_rows.restype = i32
    # the same three over the integer path by groups' layout (kernels/groups_screen.h)
    lib.lmhead_screen_norms16.argtypes = lib.lmhead_screen_norms.argtypes
    lib.lmhead_screen_norms16.restype = i32
    lib.lmhead_screen16.argtypes = lib.lmhead_screen.argtypes
    lib.lmhead_screen16.restype = i32
    lib.lmhead_screen_rescore16.argtypes = lib.lmhead_screen_rescore.argtypes
    lib.lmhead_screen_rescore16.restype = i32
    return lib


@functools.cache
def avx2() -> bool:
    """Whether the library was built with its AVX2 kernels (the screen has no other)."""
    lib = library()
    return lib is not None and bool(lib.lmhead_coded_avx2())


@functools.cache
def sub_sixteen() -> bool:
    """Whether the library converts sixteen K-quant scales (d·sub) an instruction (its AVX-512 build): then a dense
    matrix of groups of 32 keeps its scales as its blocks do (`models.gguf_file`), else as float32 numbers."""
    lib = library()
    return lib is not None and hasattr(lib, "lmhead_sub_sixteen") and bool(lib.lmhead_sub_sixteen())


@functools.cache
def screen_min_rows() -> int:
    """The fewest query rows from which this build's screen (`CodedLinear.screen`) is cheaper than the exact
    product: 2 with AVX-512 VNNI's int8 grids, 4 with AVX2's int16 ones; 0 without a screen."""
    lib = library()
    return int(lib.lmhead_screen_min_rows()) if lib is not None else 0


_refusal: str | None = None  # why `library()` refused the build it loaded (`refusal`)


def refusal() -> str | None:
    """Why the library that was built is not used (an ABI or layout mismatch, a self-test check that failed), or
    None (it runs, was never built, or `library()` has not been called)."""
    return _refusal


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler, LMHEAD_NATIVE=0, or a failed self-test: one line on stderr names
    the check, and `refusal()` holds it)."""
    global _refusal
    if os.environ.get("LMHEAD_NATIVE", "1") == "0":
        return None
    try:
        path = library_path()
    except OSError:
        return None
    builder.wait()  # a build `builder.start()` began
    for attempt in range(2):
        if path.exists() and not builder.intact(path):
            # a library cut short or damaged in the cache would crash the process when mapped (a bus error)
            print(f"lmhead: the compiled kernels {path} do not match their checksum; building them again",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                path.unlink()
        if not path.exists() and not builder.build(path):
            return None
        try:
            lib = _bind(ctypes.CDLL(str(path)))
            if lib.lmhead_coded_abi() == _ABI:
                mismatch = _layout_mismatch(lib) or _facts_mismatch(lib)
                if mismatch is not None:  # the same sources build the same structs: rebuilding would not help
                    _refusal = f"they do not match their loader ({mismatch})"
                    print(f"lmhead: the compiled kernels {path} do not match their loader ({mismatch}); running "
                          "without them", file=sys.stderr, flush=True)
                    return None
                from lmhead.kernels.self_test import failed_check  # it calls this module's bindings

                failed = failed_check(lib)
                if failed is None:
                    from lmhead.kernels.paths import choose

                    choose(lib, path)
                    _refusal = None  # a damaged file's refusal, built again since
                    return lib
                _refusal = f"their self-test failed ({failed})"
                if attempt == 1:  # built again from the sources, and refused again: not a damaged file
                    print(f"lmhead: the compiled kernels {path} failed their self-test ({failed}); running without "
                          "them (torch's float32 path)", file=sys.stderr, flush=True)
        except (OSError, AttributeError):
            pass
        if attempt == 0:  # a damaged or foreign file: build it again once
            try:
                path.unlink()
            except OSError:
                return None
    return None


_TOPK_STRIDE = 16  # `topk`: every 16th logit sets the threshold
_TOPK_MIN_WIDTH = 16384  # narrower rows: torch.topk alone
_TOPK_CAP = 1 << 15  # more candidates than this: torch.topk
_TOPK_MAX_ROWS = 4  # rows are thresholded one after another; torch.topk shares more rows over the threads
_TOPK_MAX_K_ROWS = 64  # several rows: only for a small k (four rows with k 257 measured 0.92x torch.topk)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """torch.topk(x, k, dim=-1) for rows x [b,V] (float32, CPU, V ≥ 16,384, k ≤ V/256) by a threshold: the k-th
    largest of every 16th logit is at most the row's k-th largest, so only the logits at or above it (for a
    language model's logits a few thousand of 262,144; found in one pass in C) are sorted. The same values in
    the same order; among equal values the indices may come in another order. None (the caller uses
    torch.topk) without the library, for a row with a NaN (torch.topk ranks NaN first) and when too many
    logits reach the threshold (a flat row), for more than 4 rows and for several rows with k > 64 (torch.topk
    shares rows over the threads). `benchmarks/bench_kernels.py`, 262,144 logits, quiet: one row, k 41 / 257,
    0.48 / 0.56 ms with torch.topk, 0.15 / 0.39 ms this way; four rows, k 41: 0.92 against 0.45 ms."""
    lib = library()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.requires_grad
            or not 1 <= k <= x.shape[1] // 256 or x.shape[1] < _TOPK_MIN_WIDTH or x.shape[0] > _TOPK_MAX_ROWS
            or (x.shape[0] > 1 and k > _TOPK_MAX_K_ROWS)):
        return None
    x = x.contiguous()
    cands = _threshold_candidates(lib, x, [k] * x.shape[0])
    if cands is None:
        return None
    values = torch.empty(x.shape[0], k, dtype=torch.float32)
    indices = torch.empty(x.shape[0], k, dtype=torch.int64)
    for r, cand in enumerate(cands):
        v, i = torch.topk(x[r].index_select(0, cand), k)
        values[r], indices[r] = v, cand.index_select(0, i)
    return values, indices


def _threshold_candidates(lib: ctypes.CDLL, x: torch.Tensor, ks: list[int],
                          rows: list[int] | None = None) -> list[torch.Tensor] | None:
    """Each row of x [b,V] (contiguous; ``rows``: those rows of it) its positions at or above its threshold, the
    ks[r]-th largest of every 16th logit (so at least its ks[r] largest are among them): one C pass a row. None for a
    row with a NaN (-2) or more candidates than _TOPK_CAP (-1); never fewer than k otherwise."""
    rows = list(range(x.shape[0])) if rows is None else rows
    whole = rows == list(range(x.shape[0]))
    strided = x[:, ::_TOPK_STRIDE] if whole else x[torch.tensor(rows), ::_TOPK_STRIDE]
    sample = torch.topk(strided, max(ks), dim=-1).values
    thresholds = sample[:, -1] if len(set(ks)) == 1 else sample.gather(1, torch.tensor(ks)[:, None] - 1)[:, 0]
    found = torch.empty(_TOPK_CAP, dtype=torch.int64)
    out = []
    for r, t, k in zip(rows, thresholds.tolist(), ks, strict=True):
        n = lib.lmhead_select_ge(x[r].data_ptr(), x.shape[1], t, found.data_ptr(), _TOPK_CAP)
        if n < k:
            return None
        out.append(found[:n].clone())
    return out


def topk_rows(x: torch.Tensor, ks: list[int],
              rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's own top k for rows x [b,V] (float32, CPU, V ≥ 16,384; ``rows``: those rows of it, read where
    they lie), row r keeping ks[r] ≤ V/256 → values and ids [len(ks), max k], row r's first ks[r] columns its
    torch.topk(x[r], ks[r]) values in order (tied values' ids in any order), the rest -inf and id 0. The threshold
    pass of `topk` for every row, its candidates sorted together: one partial sort of the few thousand candidates of
    all rows instead of a sort a row (a server round's rows each with their own top-k). None where `topk` gives None
    for a row (the caller goes row by row)."""
    lib = library()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.requires_grad
            or len(ks) != (x.shape[0] if rows is None else len(rows)) or x.shape[1] < _TOPK_MIN_WIDTH or not ks
            or not all(1 <= k <= x.shape[1] // 256 for k in ks)):
        return None
    x = x.contiguous()
    cands = _threshold_candidates(lib, x, ks, rows)
    if cands is None:
        return None
    cand = torch.nn.utils.rnn.pad_sequence(cands, batch_first=True)  # [b, most candidates], id 0 past a row's
    beyond = torch.arange(cand.shape[1]) >= torch.tensor([len(c) for c in cands])[:, None]
    # the candidates' logits, gathered from the rows where they lie (no copy of the rows)
    picked = x.gather(1, cand) if rows is None else x[torch.tensor(rows)[:, None], cand]
    values, pos = torch.topk(picked.masked_fill_(beyond, -math.inf), max(ks), dim=-1)
    past = torch.arange(max(ks)) >= torch.tensor(ks)[:, None]
    return values.masked_fill_(past, -math.inf), cand.gather(1, pos).masked_fill_(past, 0)


def row_scores(x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The decode loop's score of each row's token from logits x [B,V] (float32, CPU) and ids [B]: the
    log-softmax normaliser lse [B] float64 (raw logprob = x[b, id] − lse[b]) and greater [B] int64, the count
    of logits > x[b, id] (rank − 1), in two passes over each row (row_kernels.c). None without the library or
    where a row is not all finite numbers (the caller's torch path then gives torch's answer: NaN, ±inf)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    # the C passes read x[b, ids[b]]: an id outside the row would be read outside the tensor
    if ids.dim() != 1 or ids.shape[0] != x.shape[0] or ids.is_floating_point():
        raise ValueError(f"ids must be [{x.shape[0]}] integer token ids, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= x.shape[1]):
        raise ValueError(f"ids must be in [0, {x.shape[1]}), got {ids.tolist()}")
    lse, greater = row_scores_in(lib, x.contiguous(), ids, torch.get_num_threads())
    if not bool(torch.isfinite(lse).all()):
        return None
    return lse, greater


def token_scores(x: torch.Tensor, ids: list[int]) -> tuple[list[float], list[int]] | None:
    """`row_scores` for ids given as a list, answered as Python numbers: each row's raw log-probability of its id
    (x[b, id], in double, minus the normaliser) and rank (1 + the count of logits above it), with no torch
    operation around the C passes (the decode loop's scores of sampled tokens: each torch operation cost ~50 µs
    on the caches a step leaves). x [B,V] float32 CPU. ValueError for ids that are not one int in [0, V) per row;
    None without the library, or where a row is not all finite numbers (the caller's torch path answers)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    b, v = x.shape
    if len(ids) != b or not all(type(t) is int and 0 <= t < v for t in ids):
        raise ValueError(f"ids must be {b} integer token ids in [0, {v}), got {ids!r}")
    x = x if x.is_contiguous() else x.contiguous()
    chosen, lse, greater = (ctypes.c_int64 * b)(*ids), (ctypes.c_double * b)(), (ctypes.c_int64 * b)()
    lib.lmhead_row_scores(x.data_ptr(), b, v, ctypes.addressof(chosen), ctypes.addressof(lse),
                          ctypes.addressof(greater), torch.get_num_threads())
    if not all(math.isfinite(n) for n in lse):
        return None
    base = x.data_ptr()
    raw = [ctypes.c_float.from_address(base + 4 * (r * v + t)).value - lse[r] for r, t in enumerate(ids)]
    return raw, [1 + g for g in greater]


def greedy_rows(x: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """Plain greedy rows of logits x [B,V] (float32, CPU) in one C call: ids [B], the first position of each
    row's maximum (`torch.argmax`'s choice), and raw [B], its raw log-probability (the max, in double, minus the
    log-softmax normaliser; its rank is 1), as Python numbers: no torch operation after the call (each cost
    ~50 µs on the caches a decode step leaves). None without the library or where a row is not all finite numbers
    (the caller's torch path then gives torch's answer or its error)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    b, v = x.shape
    ids, lse = (ctypes.c_int64 * b)(), (ctypes.c_double * b)()
    lib.lmhead_row_greedy(x.data_ptr(), b, v, ctypes.addressof(ids), ctypes.addressof(lse), torch.get_num_threads())
    if not all(math.isfinite(n) for n in lse):
        return None
    base = x.data_ptr()
    chosen = list(ids)
    return chosen, [ctypes.c_float.from_address(base + 4 * (r * v + t)).value - lse[r] for r, t in enumerate(chosen)]


def top_p_row(x: torch.Tensor, temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The exact top-p set of one row of logits x [V] (float32, CPU) at `temperature`, by sampling/top_p.py's rule
    (`top_p_sorted`): (vals [1,m] float32, the kept tokens' x / temperature sorted descending, ties by id;
    ids [1,m] int64), in three passes over the row in C (the first two split over the threads) and a sort of the
    few candidates. None without the library, for a row that is not all finite numbers or too flat for its
    thresholds (more than TOP_P_CAP candidates, or no threshold within 32 of the maximum holds the mass): the
    caller's torch path then answers."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return top_p_row_in(lib, x, temperature, top_p)


def sample_row(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
               u: float) -> tuple[int, float] | None:
    """One unseeded draw from a row of logits x [V] (float32, CPU) at `temperature` with top-k `top_k` (0: none),
    top-p `top_p` (1: none) and min-p `min_p` (0: none), and nothing else in the pipeline (no bias or penalties):
    (id, its processed log-probability) by inverse CDF with the uniform u in [0, 1), in one C call (the cut-offs
    in the pipeline's order over the top-k set, `top_p_row`'s set or the tokens min-p keeps; or the whole row).
    The same distribution as `sampling.sample`'s for such a row; other ids for the same generator state. None
    without the library, for a row that is not all finite numbers, or a cut not settled in C (a flat row's top-p
    set, a top-k or a min-p alone keeping more than 8,192 tokens): the caller's torch path then answers (and
    raises its errors)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out_id, out_lp = ctypes.c_int64(), ctypes.c_double()
    rc = lib.lmhead_sample_row(x.data_ptr(), x.shape[0], float(temperature), int(top_k), float(top_p), float(min_p),
                               float(u), ctypes.byref(out_id), ctypes.byref(out_lp), torch.get_num_threads())
    return (out_id.value, out_lp.value) if rc == 0 else None


def top_k_row(x: torch.Tensor, temperature: float, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One row of logits x [V] (float32, CPU) → its tokens whose x / temperature (float32, as torch divides) is at
    least the k-th largest: (vals [1,n] those values sorted descending, ties by id; ids [1,n] int64), n ≥ k, in one
    pass over the row in C. The first k + 1 values are torch.topk(x, k + 1)'s over the temperature (x / T is
    monotone). None without the library, for k outside 1 … min(V − 1, SAMPLE_CAP), a row with a NaN, a value +inf
    over the temperature or fewer than k finite, or more than SAMPLE_CAP such tokens (the caller's torch path then
    answers, and raises its errors)."""
    lib = library()
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1
            or not 1 <= k < min(x.shape[0], SAMPLE_CAP + 1)):
        return None
    x = x if x.is_contiguous() else x.contiguous()
    ids = torch.empty(SAMPLE_CAP, dtype=torch.int64)
    vals = torch.empty(SAMPLE_CAP, dtype=torch.float32)
    n = lib.lmhead_top_k_row(x.data_ptr(), x.shape[0], float(temperature), int(k), ids.data_ptr(), vals.data_ptr(),
                             SAMPLE_CAP)
    return (vals[None, :n], ids[None, :n]) if n >= k else None


def race_row(vals: torch.Tensor, ids: torch.Tensor, noise: torch.Tensor) -> int | None:
    """A seeded row's exponential race in C (`sampling.race.draw_part`): candidates vals [m] (float32, x/T, -inf
    where dropped) with their ids [m] (int64), in any order, and noise [n] (float32) the Exp(1) draws of its n kept
    candidates in id order → the winner's place in vals: argmax of e^(v − max) / max(E, tiny) over the kept in id
    order, the first of equal keys, in double. None without the library, or for tensors it does not take (another
    dtype or device, n not the count of finite vals)."""
    lib = library()
    if (lib is None or vals.dtype != torch.float32 or ids.dtype != torch.int64 or noise.dtype != torch.float32
            or any(t.device.type != "cpu" or t.dim() != 1 or not t.is_contiguous() for t in (vals, ids, noise))
            or vals.shape[0] != ids.shape[0]):
        return None
    won = lib.lmhead_race_row(vals.data_ptr(), ids.data_ptr(), vals.shape[0], noise.data_ptr(), noise.shape[0])
    return won if won >= 0 else None


def row_moments(x: torch.Tensor, sigma: bool = False, exps: bool = True) -> tuple[float, ...] | None:
    """One row of logits x [V] (float32, CPU) → (max, the count of finite logits, S = Σ e^(x − max), A = Σ e^(x −
    max)·(x − max) (NaN without `exps`), the least finite logit, the mean of the finite logits, and with `sigma`
    their population standard deviation, else 0), in float64 from one pass over the row in C, one more for the
    exps and one for `sigma`. None without the library, or for a row with a NaN, +inf or no finite logit (the
    caller's torch path answers)."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return row_moments_in(lib, x if x.is_contiguous() else x.contiguous(), sigma, torch.get_num_threads(), exps)


def row_lse_bounded(x: torch.Tensor) -> tuple[float, float, float, float, float] | None:
    """One row of logits x [V] (float32, CPU) → (max, log S', δ, H', δ_H): the log-normaliser's log Σ e^(x − max)
    and the entropy from float32 exps summed in double, with bounds δ and δ_H on their distances from the exact ones
    (step_kernels.c), in two passes. None without the library or AVX2, or for a row with a NaN, +inf or no finite
    logit."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = (ctypes.c_double * 5)()
    if lib.lmhead_row_lse_bounded(x.data_ptr(), x.shape[0], ctypes.addressof(out), torch.get_num_threads()):
        return None
    return out[0], out[1], out[2], out[3], out[4]


def keep_ge_unsure(x: torch.Tensor, threshold: float, low: float, high: float,
                   top: float) -> tuple[torch.Tensor, int] | None:
    """`keep_ge` (float32 values), and how many logits below `top` lie in [low, high] — the ones a threshold known
    only to lie in [low, high] may not have decided. None without the library."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    unsure = lib.lmhead_keep_ge_unsure(x.data_ptr(), x.shape[0], threshold, low, high, top, out.data_ptr())
    return out, unsure


def keep_ge(x: torch.Tensor, threshold: float) -> torch.Tensor | None:
    """x [V] (float32, CPU) with every logit below `threshold` (a float32 value) at -inf, in one pass in C. None
    without the library."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    lib.lmhead_keep_ge(x.data_ptr(), x.shape[0], threshold, out.data_ptr())
    return out


def select_ge(x: torch.Tensor, threshold: float, cap: int) -> torch.Tensor | None:
    """The positions of x [V] (float32, CPU) holding values ≥ `threshold` (a float32 value), ascending, int64, in
    one pass in C. None without the library, for a NaN, or when more than `cap` reach it."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1:
        return None
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(max(cap, 1), dtype=torch.int64)
    n = lib.lmhead_select_ge(x.data_ptr(), x.shape[0], threshold, out.data_ptr(), max(cap, 1))
    return out[:n] if n >= 0 else None


def typical_row(x: torch.Tensor, mass: float) -> torch.Tensor | None:
    """Locally typical sampling on one row of logits x [V] (float32, CPU) with mass `mass`: x with the tokens outside
    the typical set at -inf (step_kernels.c: the reference's rule in float64, in four passes over the row and a
    sort of one bin's tokens). None without the library or for a row with a NaN, +inf or no finite logit."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 1 or x.shape[0] == 0:
        return None
    return typical_row_in(lib, x if x.is_contiguous() else x.contiguous(), mass, torch.get_num_threads())

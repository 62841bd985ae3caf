"""A row's moments in float64 and the cut at a threshold: the passes the cut-offs and dynamic temperature share.

Their references (tests/reference.py) decide in float64 — a token's probability q = e^(x − max) / S, the entropy
H = −Σ q log q, the mean and standard deviation of the finite logits — and each of their rules is a threshold on
the logit itself (q ≥ ε ⟺ x ≥ max + log(ε·S); −log2 q ≤ μ ⟺ x ≥ max + log S − μ·ln 2), so a cut is one pass for the
maximum, one for S and A = Σ e^(x − max)·(x − max) (log-normaliser max + log S, entropy log S − A/S) and one that
writes the row: no softmax, no float64 copy of the row, no mask tensor. Where a rule reads only the log-normaliser
and the entropy (epsilon, eta, mirostat v2, XTC), float32 exps with a bound on their error set the threshold, and
the float64 moments are taken only when a logit lies within that bound of it (`keep_probable`, `probable_ids`).
Locally typical sampling orders tokens by |−log q − H| = |x − c| with c = max + A/S, and only the tokens near the
crossing of its mass need sorting.

The passes run in C (kernels/native.py: step_kernels.c) for a CPU row where the library is built, in torch's float64
otherwise (``native=False``: the same numbers up to float64 rounding, slower; the tests compare the two). A row
with a NaN, +inf or no finite logit has no moments (None): the steps leave it as it is and the pipeline's check of
the row names the problem.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lmhead.sampling.vocab import NEG_INF


@dataclass(frozen=True)
class Moments:
    """One row's moments (float64): its maximum, how many logits are finite, S = Σ e^(x − max), A = Σ e^(x −
    max)·(x − max), the least finite logit, the mean of the finite logits and (when asked) their population
    standard deviation (0 otherwise)."""

    max: float
    finite: int
    norm: float
    tilt: float
    least: float
    mean: float
    sd: float

    @property
    def lse(self) -> float:
        """log Σ e^x: a token's log-probability is x − lse."""
        return self.max + math.log(self.norm)

    @property
    def entropy(self) -> float:
        """H = −Σ q log q in nats (≥ 0: log S ≥ 0 and A ≤ 0)."""
        return math.log(self.norm) - self.tilt / self.norm

    @property
    def center(self) -> float:
        """Σ q·x, the logit whose surprise is the entropy: |−log q − H| = |x − center|."""
        return self.max + self.tilt / self.norm


def _library(x: Tensor, use: bool):
    """kernels.native for a CPU float32 row when `use` (imported on first use, as the pipeline's other C paths)."""
    if not (use and x.device.type == "cpu" and x.dtype == torch.float32):
        return None
    from lmhead.kernels import native

    return native


def moments(x: Tensor, sigma: bool = False, native: bool = True, exps: bool = True) -> Moments | None:
    """The moments of one row x [1,V] or [V] (sd only with `sigma`; norm and tilt NaN without `exps`, which saves
    the pass of exps); None for a row with a NaN, +inf or no finite logit."""
    row = x.reshape(-1)
    lib = _library(row, native)
    got = lib.row_moments(row, sigma, exps) if lib else None
    if got is None:
        got = _torch_moments(row, sigma, exps)
    return None if got is None else Moments(got[0], int(got[1]), *got[2:])


def _torch_moments(row: Tensor, sigma: bool, exps: bool) -> tuple[float, ...] | None:
    d = row.double()
    finite = d > NEG_INF
    if not bool(finite.any()) or bool(torch.isnan(d).any()) or bool(torch.isposinf(d).any()):
        return None
    top = d.max()
    vals = d[finite]
    mean = vals.mean()
    sd = float(((vals - mean) ** 2).mean().sqrt()) if sigma else 0.0
    norm = tilt = math.nan
    if exps:
        e = torch.exp(d - top)
        norm, tilt = float(e.sum()), float((e[finite] * (vals - top)).sum())
    return float(top), vals.numel(), norm, tilt, float(vals.min()), float(mean), sd


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def ceil32(t: float) -> float:
    """The least float32 value ≥ t (±inf beyond float32's range): for a float32 x, x ≥ t ⟺ x ≥ ceil32(t)."""
    if not -_FLOAT32_MAX <= t <= _FLOAT32_MAX:  # ±inf, NaN and beyond float32's range
        return t if not math.isfinite(t) else math.copysign(math.inf, t)
    f = struct.unpack("f", struct.pack("f", t))[0]  # t rounded to the nearest float32
    if f < t:  # the next float32 up: one step of the bit pattern away from zero, or towards it below zero
        bits = struct.unpack("<i", struct.pack("<f", f))[0]
        f = struct.unpack("<f", struct.pack("<i", bits + 1 if f >= 0 else bits - 1))[0] if f != 0 else 2.0 ** -149
    return f


def keep_at_least(x: Tensor, threshold: float, native: bool = True) -> Tensor:
    """x [1,V] with every logit below `threshold` (a float64 number, compared exactly) at -inf."""
    t = ceil32(threshold)
    row = x.reshape(-1)
    lib = _library(row, native)
    out = lib.keep_ge(row, t) if lib and not math.isnan(t) else None
    if out is None:
        out = torch.where(row >= t, row, torch.full_like(row, NEG_INF))
    return out.view_as(x)


def at_least_ids(x: Tensor, threshold: float, cap: int, native: bool = True) -> Tensor:
    """The ids of the logits ≥ `threshold` (compared exactly) in x [1,V], ascending; `cap` bounds how many the C pass
    collects (more: torch's pass finds them)."""
    t = ceil32(threshold)
    row = x.reshape(-1)
    lib = _library(row, native)
    ids = lib.select_ge(row, t, cap) if lib and not math.isnan(t) else None
    return (row >= t).nonzero().squeeze(1) if ids is None else ids


def floor32(t: float) -> float:
    """The greatest float32 value ≤ t."""
    return -ceil32(-t)


def _bounded_threshold(row: Tensor, lib, log_q: float,
                       by_entropy: Callable[[float], float] | None) -> tuple[float, float, float, float] | None:
    """(max, t, low, high) from the float32 log-normaliser: the logit threshold t = max + log q + log S' (log q from
    the float32 entropy with `by_entropy`), and the float32 band [low, high] the exact threshold lies in (the
    bounds, and room for the rounding of t). None where there is no bounded log-normaliser."""
    got = lib.row_lse_bounded(row)
    if got is None:
        return None
    top, log_s, delta, entropy, delta_h = got
    if by_entropy is not None:
        log_q, delta = by_entropy(entropy), delta + delta_h
    t = top + log_q + log_s
    delta += 1e-12 * (abs(top) + abs(log_q) + abs(log_s) + 1.0)
    return top, t, floor32(t - delta), ceil32(t + delta)


def keep_probable(x: Tensor, log_q: float, mo: Moments | None = None, native: bool = True,
                  by_entropy: Callable[[float], float] | None = None) -> Tensor:
    """x [1,V] keeping the tokens with log-probability log q ≥ `log_q` (q = e^(x − max) / S, exact) — or ≥
    by_entropy(H), H the entropy, for a rule that moves by no more than H does — and the most probable token and its
    ties whatever its probability (transformers' min_tokens_to_keep = 1). Without `mo`, at float32 cost where that
    decides every token: a float32 log-normaliser (and entropy) with bounds on their errors set the threshold, and
    unless a logit below the maximum lies within the bounds of it the cut is the exact one; else (or without the
    library) from the float64 moments."""
    row = x.reshape(-1)
    lib = _library(row, native) if mo is None else None
    got = _bounded_threshold(row, lib, log_q, by_entropy) if lib else None
    if got is not None:
        top, t, low, high = got
        cut = lib.keep_ge_unsure(row, ceil32(min(t, top)), low, high, top)
        if cut is not None and cut[1] == 0:
            return cut[0].view_as(x)
    mo = mo if mo is not None else moments(row, native=native)
    if mo is None:
        return x
    if by_entropy is not None:
        log_q = by_entropy(mo.entropy)
    return keep_at_least(x, min(mo.lse + log_q, mo.max), native=native)


def probable_ids(x: Tensor, log_q: float, cap: int, native: bool = True) -> Tensor | None:
    """The ids of the tokens of x [1,V] with log-probability ≥ `log_q` (exact), ascending; `cap` bounds how many
    the C pass collects. From the float32 log-normaliser where its bound decides every token (none of the
    collected within the bound of the threshold), else from the float64 moments. None for a row without moments."""
    row = x.reshape(-1)
    lib = _library(row, native)
    got = _bounded_threshold(row, lib, log_q, None) if lib else None
    if got is not None:
        _, _, low, high = got
        ids = at_least_ids(x, low, cap, native=native)
        if not bool((row[ids] <= high).any()):
            return ids
    mo = moments(row, native=native)
    return None if mo is None else at_least_ids(x, mo.lse + log_q, cap, native=native)


def typical(x: Tensor, mass: float, native: bool = True) -> Tensor:
    """Locally typical sampling (transformers' TypicalLogitsWarper; the reference's rule in float64) on x [1,V]:
    tokens in order of |−log q − H| = |x − c| (Moments.center), kept up to and including the first whose
    cumulative mass reaches `mass`, with every token scoring no more than that one (ties whole); -inf elsewhere."""
    row = x.reshape(-1)
    lib = _library(row, native)
    out = lib.typical_row(row, mass) if lib else None
    if out is not None:
        return out.view_as(x)
    mo = moments(row, native=False)
    if mo is None:
        return x
    d = row.double()
    score = (d - mo.center).abs()  # -inf logits score inf
    ordered, order = torch.sort(score, stable=True)
    cum = torch.exp(d - mo.max)[order].cumsum(0)
    last = int((cum < mass * mo.norm).sum().clamp(max=row.shape[0] - 1))
    return torch.where(score <= ordered[last], row, torch.full_like(row, NEG_INF)).view_as(x)

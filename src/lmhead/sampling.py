"""The logits pipeline: from a row of logits to the next token id.

For each row of logits ``[B,V]`` the pipeline runs these steps, in this order (we follow Hugging Face
transformers' order: temperature → top-k → top-p → min-p; llama.cpp applies temperature last and vLLM min-p
before top-k/top-p, which gives different candidate sets for the same settings):

1. logit bias and banned tokens   ``apply_logit_bias``  add ``logit_bias[id]`` (-inf bans); banned ids → -inf
2. penalties                      ``apply_penalties``   repetition (CTRL/HF, multiplicative: logit > 0 → /p,
                                  else ×p) over the prompt and the generated tokens, each token once; then
                                  frequency and presence (OpenAI: logit − count·frequency − (count>0)·presence)
                                  over the generated tokens only
3. temperature                    ``apply_temperature`` logits / T; T = 0 (or T < 1e-5, as vLLM) is greedy:
                                  argmax after steps 1–2, the cut-off steps 4–6 are skipped
4. top-k                          ``apply_top_k``       keep the k largest (tokens tied with the k-th are kept,
                                  as in HF); 0 = off
5. top-p                          ``apply_top_p``       keep the most probable tokens until their mass reaches
                                  p; the token that crosses p is kept (ties with it too); at least one token
6. min-p                          ``apply_min_p``       keep tokens with p ≥ min_p · p_max
7. softmax                        ``probabilities``
8. draw                           ``sample``            the exponential race argmax(p / Exp(1)) over the kept
                                  candidates; rows kept whole (no cut-off) by a two-level inverse CDF with
                                  one uniform per row; top-p alone from the set C finds at once (a few
                                  unseeded rows) or by rejection from the whole row (all exact; no
                                  ``torch.multinomial``)

Every step is also a pure function on ``[B,V]`` logits (logits in, float32 logits out, rejected tokens = -inf,
at least one token kept) that can be used on its own. ``process_logits`` (steps 1–6), ``probabilities``
(1–7), ``sample`` (1–8) and ``logprobs`` run the whole pipeline with a fast path: disabled steps cost nothing,
greedy rows only take an argmax, top-k takes ``torch.topk`` first and does top-p / min-p inside the k
survivors (exactly equivalent, no full sort), and top-p without top-k partially sorts a small window
(top 256, then 1024) until the window provably holds every kept token, with an exact histogram select (sort
only the tokens of the bin where the mass crosses p) for rows whose top-p set is wider. ``sample`` with top-p
alone does not find the top-p set at all: it draws from the whole row and keeps the draw iff the mass
strictly above it is < p, else draws again above it (``_top_p_draw``: exact; a pass of exps, or a partial sort
of 256, per round, and a round passes with probability ≥ p). ``sample_with_logprobs`` draws and returns each
drawn token's processed log-probability from the same cut (the decode loop's step), ``chosen_logprobs``
scores given ids without a [B,V] processed row. With the same
settings ``probabilities`` equals transformers' ``TemperatureLogitsWarper → TopKLogitsWarper →
TopPLogitsWarper → MinPLogitsWarper`` + softmax (tests/test_sampling_hf.py).

Ties: top-k keeps every token tied with the k-th largest (HF's ``scores < kth`` rule). Top-p treats tied
tokens alike: a token is kept iff the mass of the tokens strictly more probable than it is < p, so a tie that
straddles the cut is kept whole (HF's result there depends on its unstable sort's order among equal values).

Shapes: ``logits`` is ``[B,V]`` (a ``[V]`` row is accepted and treated as a batch of one; outputs then drop
the batch dimension, except ``logprobs``). Logits of any floating dtype are processed in float32.
A config may be one ``SamplingConfig`` for the whole batch or a list with one per row: one batch can mix
greedy and sampled rows with different settings; rows with the same cut-off settings run together.

The vocabulary axis: the pipeline reads across the vocabulary (row max, top-k candidates with their ids, sums
of masses and counts, the few tokens of one histogram bin) only through a ``Vocab``: the whole vocabulary in
this process by default. ``lmhead.distributed.ShardedVocab`` implements the same methods over ranks that each
hold a slice of the columns, so the vocab-parallel sampler is this very pipeline (steps 1-2 on each rank's own
columns, then the same code on every rank).

Layout of this module: ``Vocab`` → config (``SamplingConfig``) → input checks (``as_configs``,
``as_prev_tokens``, ``as_row_ints``) → steps 1-2 → steps 3-6 (the cut-offs and their fast paths) → the pipeline
functions → step 8 (``seeded_generator``, ``race_draw``, the whole-row draw, ``sample``) → logprobs, entropy.

Seeds: with ``config.seed`` set, a row's draw depends only on (seed, step) and the row's own logits — a
``torch.Generator`` seeded from (seed, step) draws noise over the row's kept tokens (top-p alone: its
proposals over the whole row) in token-id order, and the row is cut and drawn on its own — so the same seed
gives the same token whatever the batch size or position.

Settings are bounded where float32 stays finite (temperature ≤ 1e4, repetition_penalty in [1e-4, 1e4],
|presence|, |frequency|, |logit_bias| ≤ 1e4); an overflow that still happens on logits near float32's limit is
a ValueError naming the setting (repetition_penalty, temperature), not the logits.
Rows without a seed use the ``generator`` argument (or torch's default generator).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lmhead.checks import is_int, is_real

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogProbs",
    "SamplingConfig",
    "Vocab",
    "apply_logit_bias",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "as_configs",
    "as_prev_tokens",
    "chosen_logprobs",
    "as_row_ints",
    "entropy",
    "logprobs",
    "probabilities",
    "process_logits",
    "race_draw",
    "sample",
    "sample_with_logprobs",
    "seeded_generator",
]

# Temperatures below this are greedy (vLLM's rule): dividing by ~0 would overflow to ±inf.
GREEDY_TEMPERATURE = 1e-5
# The largest magnitudes the settings may take. Within them a logit of any realistic size (|x| ≲ 1e20) stays a
# finite float32 through every step: (x + bias) · penalty / T ≤ 1e20 · 1e4 / 1e-5 — and a setting above float32's
# range (1e308) would become ±inf in a float32 tensor and turn rows into NaN. An overflow that still happens
# (logits near float32's limit) is an error naming the setting.
TEMPERATURE_LIMIT = 1e4
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
PENALTY_LIMIT = 1e4  # |presence_penalty|, |frequency_penalty|
LOGIT_BIAS_LIMIT = 1e4  # |logit_bias| of a finite bias; -inf bans
# Top-p without top-k: the first partial-sort window, its growth factor, and the widest window before a full
# sort is cheaper. The margin keeps a window from being accepted on a float-rounding knife edge.
_WINDOW_START = 256
_WINDOW_GROWTH = 4
_WINDOWS = 2
_WINDOW_MAX_FRACTION = 8
_WINDOW_MARGIN = 1e-5
# Top-p on wide rows: histogram bins per row; logits more than 104 below the max have probability 0 in float32.
_BINS = 4096
_NATIVE_TOP_P_ROWS = 8  # `_top_p_parts`: up to this many rows are settled one by one in C
_UNDERFLOW = 104.0
# Passes over whole rows run in chunks of about this many elements (reused buffers: no page faults), and
# whole-row draws pick a block of _BLOCK tokens first.
_CHUNK_ELEMENTS = 1 << 20
_BLOCK = 1024
# In the passes that sum masses, a token more than 64 below the row's max (x/T) counts 0: e^-64 ≈ 1.6e-28 of the
# max is far below what a float64 uniform can pick (2^-53), and exp of -inf, or of anything below -87 (float32
# subnormal results), runs 6 to 100 times slower than exp of a normal value.
_TAIL = -64.0
_TAIL_EXP = torch.tensor(_TAIL).exp().item()
# Top-p alone in `sample`: rejection rounds before the rows left draw from their exact top-p set (a round
# passes with probability ≥ p; small p takes about ln(1/p) + 1 rounds).
_DRAW_ROUNDS = 6
_FLOOR_ROWS = 64


_NEG_INF = float("-inf")
_MASK64 = (1 << 64) - 1


def _tail_exp_(d: Tensor) -> Tensor:
    """In place on d = x/T − max (≤ 0, -inf allowed): exp(d), with d < −64 counted 0 (see _TAIL)."""
    return torch.threshold_(d.clamp_min_(_TAIL).exp_(), _TAIL_EXP, 0.0)


def _chunk_columns(batch: int, vocab: int, multiple: int = 1) -> int:
    cols = max(multiple, _CHUNK_ELEMENTS // max(batch, 1) // multiple * multiple)
    return min(cols, -(-vocab // multiple) * multiple)


# --- the vocabulary axis: every reduction over V goes through here ------------------------------------------


class Vocab:
    """The vocabulary axis of the logits a pipeline call runs on, and the reductions over it.

    The pipeline reads across the vocabulary only through these methods; everything else it does is per token
    (steps 1-2, the final masks) or on a few candidates [b,m] that every caller holds alike. This class is the
    whole vocabulary in one process (the default of ``process_logits`` / ``probabilities`` / ``sample``).
    ``lmhead.distributed.ShardedVocab`` is the same axis split over ranks: each rank passes its columns
    [start, start + V_r) of the [B,V] logits, the methods combine the ranks' small partial results (maxima,
    top-k candidates, sums), and the very same pipeline code runs on every rank.

    size   V, the whole vocabulary            start  the global id of the first local column (0 here)
    name   what the logits are called in error messages
    Shapes: x [b,V_r] are the local columns (V_r = V here); ids are global token ids.
    """

    def __init__(self, size: int, start: int = 0, name: str = "logits") -> None:
        self.size, self.start, self.name = size, start, name

    def amax(self, x: Tensor) -> Tensor:
        """[b,V_r] → [b,1] the row maximum over V (NaN and +inf propagate)."""
        return x.amax(dim=-1, keepdim=True)

    def amin(self, x: Tensor) -> Tensor:
        """[b,V_r] → [b,1] the row minimum over V."""
        return x.amin(dim=-1, keepdim=True)

    def argmax(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[b,V_r] → (max [b,1], its id [b,1] long): the lowest id among ties, as torch.max on the full row."""
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[-1] and not x.requires_grad:
            # numpy's argmax follows the same rule (first maximum; a NaN counts as the maximum) and on this
            # kind of machine takes 1/20 of torch's CPU max-with-index (31 µs against 680 µs over 262,144 logits:
            # a greedy decode step paid it twice)
            idx = torch.from_numpy(np.ascontiguousarray(x.numpy()).argmax(axis=-1).astype(np.int64)).unsqueeze(-1)
            return x.gather(-1, idx), idx
        return x.max(dim=-1, keepdim=True)

    def topk(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """[b,V_r] → the k largest over V (k ≤ V): values [b,k] descending, ids [b,k] long (tied values in any
        order)."""
        if x.device.type == "cpu":  # a wide CPU row: a threshold pass in C, then a sort of the few above it
            from lmhead.models import native

            got = native.topk(x, k)
            if got is not None:
                return got
        return torch.topk(x, k, dim=-1)

    def sum(self, partial: Tensor) -> Tensor:
        """Per-row partial results over the local columns ([b,...] masses, counts) → summed over all of V."""
        return partial

    def cat(self, *parts: Tensor) -> tuple[Tensor, ...]:
        """1-D tensors of any length, one set per shard → each concatenated over the shards (rank order)."""
        return parts

    def softmax(self, x: Tensor) -> Tensor:
        """[b,V_r] → the local columns of softmax over V."""
        return torch.softmax(x, dim=-1)

    def columns(self, vals: Tensor, ids: Tensor, fill: float, width: int) -> Tensor:
        """Candidates (vals, global ids) [b,m] → [b,V_r] local columns, `fill` where no candidate is."""
        out = torch.full((vals.shape[0], width), fill, dtype=vals.dtype, device=vals.device)
        return out.scatter_(1, ids, vals)


# --- config -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingConfig:
    """Settings of the logits pipeline for one row (or a whole batch). Validates itself.

    temperature         in [0, 1e4]. 0 (or anything < 1e-5, as vLLM) is greedy: argmax after bias and
                        penalties; top-k / top-p / min-p are then ignored.
    top_k               int ≥ 0; 0 = off. Keeps the k largest logits (ties with the k-th kept).
    top_p               in (0, 1]; 1 = off. Smallest set whose mass reaches top_p (crossing token kept).
    min_p               in [0, 1]; 0 = off. Keeps tokens with p ≥ min_p · p_max.
    repetition_penalty  in [1e-4, 1e4]; 1 = off. CTRL/HF: logit > 0 → logit / r, else logit · r, once per
                        token seen in the prompt or the generated tokens.
    presence_penalty    in [-1e4, 1e4]; 0 = off. OpenAI: minus presence once for each token generated so far.
    frequency_penalty   in [-1e4, 1e4]; 0 = off. OpenAI: minus frequency · count over the generated tokens.
    logit_bias          mapping token id (int ≥ 0) → float in [-1e4, 1e4] added to the logit, or -inf, which
                        bans the token (+inf and NaN are rejected). Stored as a read-only mapping.
    The bounds (TEMPERATURE_LIMIT, REPETITION_PENALTY_RANGE, PENALTY_LIMIT, LOGIT_BIAS_LIMIT) keep the float32
    arithmetic of every step finite; a value outside them is a ValueError naming the setting and its range.
    banned_tokens       token ids (int ≥ 0) that can never be chosen.
    seed                int or None. With a seed, a row's draw depends only on (seed, step).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    banned_tokens: tuple[int, ...] = ()
    seed: int | None = field(default=None)

    def __post_init__(self) -> None:
        def real(name: str, allowed: str, ok: Any) -> float:
            value = getattr(self, name)
            if not is_real(value) or math.isnan(value) or not ok(float(value)):
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
            return float(value)

        set_ = lambda name, v: object.__setattr__(self, name, v)  # frozen: __post_init__ normalises
        set_("temperature", real("temperature", f"in [0, {TEMPERATURE_LIMIT:g}] (0 = greedy)",
                                 lambda v: 0 <= v <= TEMPERATURE_LIMIT))
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {self.top_k!r}")
        set_("top_p", real("top_p", "in (0, 1] (1 = off)", lambda v: 0 < v <= 1))
        set_("min_p", real("min_p", "in [0, 1] (0 = off)", lambda v: 0 <= v <= 1))
        low, high = REPETITION_PENALTY_RANGE
        set_("repetition_penalty", real("repetition_penalty", f"in [{low:g}, {high:g}] (1 = off)",
                                        lambda v: low <= v <= high))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(name, real(name, f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] (0 = off)",
                            lambda v: abs(v) <= PENALTY_LIMIT))

        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise ValueError(f"logit_bias must be a mapping token id -> float or None, got {type(bias)}")
            clean: dict[int, float] = {}
            for tok, val in bias.items():
                if not is_int(tok) or tok < 0:
                    raise ValueError(f"logit_bias keys must be token ids (int ≥ 0), got {tok!r}")
                if not is_real(val) or not (abs(val) <= LOGIT_BIAS_LIMIT or val == -math.inf):
                    raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}] "
                                     f"or -inf (bans), got {val!r} for token {tok}")
                clean[tok] = float(val)
            set_("logit_bias", MappingProxyType(clean) if clean else None)

        banned = self.banned_tokens
        if isinstance(banned, (str, bytes)) or not isinstance(banned, (Sequence, set, frozenset, Tensor)):
            raise ValueError(f"banned_tokens must be a sequence of token ids (int ≥ 0), got {banned!r}")
        banned = tuple(int(t) if isinstance(t, Tensor) else t for t in banned)
        for tok in banned:
            if not is_int(tok) or tok < 0:
                raise ValueError(f"banned_tokens must hold token ids (int ≥ 0), got {tok!r}")
        set_("banned_tokens", banned)

        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")

    def __hash__(self) -> int:  # logit_bias is a mapping: hash its items
        bias = tuple(sorted(self.logit_bias.items())) if self.logit_bias else None
        return hash((self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                     self.presence_penalty, self.frequency_penalty, bias, self.banned_tokens, self.seed))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or below 1e-5): the argmax after bias and penalties."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    def _cut_key(self, vocab_size: int) -> tuple:
        """Rows with equal keys are cut together (steps 3–6). Disabled settings are normalised away."""
        if self.is_greedy:
            return ("greedy",)
        top_k = self.top_k if 0 < self.top_k < vocab_size else 0  # k ≥ V keeps everything
        return ("sample", self.temperature, top_k, self.top_p, self.min_p)


ConfigArg = SamplingConfig | Sequence[SamplingConfig] | None


# --- input validation -------------------------------------------------------------------------------------


def _check_logits(logits: object, name: str = "logits") -> tuple[Tensor, bool]:
    """[B,V] or [V] floating tensor → ([B,V] float32, was_1d). Values are checked later (see _check_top)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [B, V], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor (float32/bfloat16/float16/float64), got {logits.dtype}")
    if logits.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape [B, V] or [V], got {tuple(logits.shape)}")
    one_row = logits.dim() == 1
    x = logits.unsqueeze(0) if one_row else logits
    if x.shape[-1] == 0:
        raise ValueError(f"{name} must have a vocabulary dimension V ≥ 1, got shape {tuple(logits.shape)}")
    return x.float(), one_row


def _check_top(top: Tensor, name: str = "logits", temperature: float = 1.0) -> None:
    """`top` is each row's largest value (max propagates NaN and +inf): one check covers NaN, +inf and rows
    that are all -inf, at no extra pass over the vocabulary. With a temperature, also that top / temperature
    (the largest scaled logit) is a finite float32: otherwise the row would turn into NaN."""
    if top.numel() == 0:
        return
    if not bool(torch.isfinite(top).all()):
        bad = (~torch.isfinite(top)).nonzero()[0, 0].item()
        value = top.reshape(-1)[bad].item()
        if math.isnan(value):
            raise ValueError(f"{name} must not contain NaN (row {bad})")
        if value > 0:
            raise ValueError(f"{name} must not contain +inf (row {bad})")
        raise ValueError(f"{name}: row {bad} is all -inf (after logit_bias / banned_tokens): no token can be "
                         "chosen")
    if temperature != 1.0 and not bool(torch.isfinite(top / temperature).all()):
        bad = (~torch.isfinite(top / temperature)).nonzero()[0, 0].item()
        raise ValueError(f"temperature={temperature:g} takes the largest {name} value of row {bad} "
                         f"({top.reshape(-1)[bad].item():g}) outside float32's range; use a larger temperature")


def _check_overflow(x: Tensor, cols: Tensor, mine: Tensor, before: Tensor, name: str, setting: Tensor,
                    start: int) -> None:
    """The logits at cols [B,L] (where `mine`) were `before` a step that used the per-row `setting` [B]: one
    that was finite and is not any more is a ValueError naming the setting (not the logits, which were fine)."""
    bad = mine & torch.isfinite(before) & ~torch.isfinite(x.gather(1, cols))
    if bool(bad.any()):
        row, j = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}={setting[row].item():g} takes the logit {before[row, j].item():g} of token "
                         f"{cols[row, j].item() + start} (row {row}) outside float32's range; use a {name} "
                         "closer to 1")


def _check_values(x: Tensor, name: str = "logits") -> None:
    if x.numel():
        _check_top(x.amax(dim=-1), name)


def as_configs(config: ConfigArg | Mapping[str, Any], batch: int) -> list[SamplingConfig]:
    """A config argument → one SamplingConfig per row (a list of ``batch``).

    None is the default config; one SamplingConfig (or a mapping of its fields) serves every row; a list or
    tuple must hold exactly one SamplingConfig per row. Raises TypeError / ValueError naming ``config``."""
    if config is None:
        return [SamplingConfig()] * batch
    if isinstance(config, SamplingConfig):
        return [config] * batch
    if isinstance(config, Mapping):
        return [SamplingConfig(**config)] * batch  # SamplingConfig validates the values
    if isinstance(config, (list, tuple)):
        if len(config) != batch:
            raise ValueError(f"config: a list needs one SamplingConfig per row ({batch}), got {len(config)}")
        for c in config:
            if not isinstance(c, SamplingConfig):
                raise TypeError(f"config must hold SamplingConfig objects, got {type(c).__name__}")
        return list(config)
    raise TypeError(f"config must be a SamplingConfig or a list of them, got {type(config).__name__}")


def _config_arg(config: ConfigArg, batch: int) -> list[SamplingConfig] | SamplingConfig:
    """as_configs, but one config for the whole batch stays one (its rows then run as one group, no indexing)."""
    if isinstance(config, (list, tuple)):
        return as_configs(config, batch)
    return as_configs(config, 1)[0]


def as_row_ints(value: object, batch: int, name: str, device: torch.device) -> Tensor:
    """An int ≥ 0 or one per row (prompt_len, step) → LongTensor [B]; ValueError naming ``name`` otherwise."""
    if isinstance(value, Tensor):
        t = value.to(device=device, dtype=torch.long).reshape(-1)
    elif is_int(value):
        t = torch.full((batch,), int(value), dtype=torch.long, device=device)
    elif isinstance(value, Sequence) and all(is_int(v) for v in value):
        t = torch.tensor(list(value), dtype=torch.long, device=device)
    else:
        raise ValueError(f"{name} must be an int ≥ 0 or one int ≥ 0 per row, got {value!r}")
    if t.numel() != batch or bool((t < 0).any()):
        raise ValueError(f"{name} must be an int ≥ 0 or one int ≥ 0 per row ({batch}), got {value!r}")
    return t


def as_prev_tokens(prev: object, batch: int, vocab: int | None, device: torch.device,
                   one_row: bool = False) -> Tensor:
    """prev_tokens ([B,L] integer tensor or a list of lists; one list for a [V] row when ``one_row``) →
    LongTensor [B,L], -1 = padding; ids checked to be in [0, vocab) (only ≥ 0 when vocab is None)."""
    if isinstance(prev, Tensor):
        if prev.is_floating_point() or prev.is_complex() or prev.dtype == torch.bool:
            raise TypeError(f"prev_tokens must be an integer tensor [B, L], got {prev.dtype}")
        t = prev.to(device=device, dtype=torch.long)
        if one_row and t.dim() == 1:
            t = t.unsqueeze(0)
    elif isinstance(prev, Sequence):
        rows = [prev] if one_row and all(is_int(v) for v in prev) else list(prev)
        if len(rows) != batch:
            raise ValueError(f"prev_tokens needs one list of token ids per row ({batch}), got {len(rows)}")
        width = max((len(r) for r in rows), default=0)
        t = torch.full((batch, width), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            if len(r):
                try:
                    t[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
                except (TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(f"prev_tokens row {i} must be a list of token ids, got {r!r}") from e
        t = t.to(device)
    else:
        raise TypeError(f"prev_tokens must be a LongTensor [B, L] (-1 = padding) or a list of lists, got {prev!r}")
    if t.dim() != 2 or t.shape[0] != batch:
        raise ValueError(f"prev_tokens must have shape [B={batch}, L], got {tuple(t.shape)}")
    if t.numel() and (bool((t < -1).any()) or (vocab is not None and bool((t >= vocab).any()))):
        raise ValueError(f"prev_tokens must hold token ids in [0, {vocab or 'V'}) or -1 (padding)")
    return t


# --- steps 1-2: bias and penalties (pure functions) -------------------------------------------------------


def _bias_index(configs: list[SamplingConfig] | SamplingConfig, batch: int, vocab: int, device: torch.device,
                start: int = 0, width: int | None = None):
    """(rows, cols, values) of every logit_bias entry and (rows, cols) of every banned token, in the local
    columns [start, start + width) of a vocabulary of `vocab` ids (entries outside them are another shard's)."""
    end = vocab if width is None else start + width

    def entries(c: SamplingConfig):
        ids = list(c.logit_bias.keys()) if c.logit_bias else []
        vals = list(c.logit_bias.values()) if c.logit_bias else []
        banned = list(c.banned_tokens)
        for name, toks in (("logit_bias", ids), ("banned_tokens", banned)):
            if toks and max(toks) >= vocab:
                raise ValueError(f"{name}: token id {max(toks)} is outside the vocabulary [0, {vocab})")
        if (start, end) != (0, vocab):
            kept = [(i - start, v) for i, v in zip(ids, vals, strict=True) if start <= i < end]
            ids, vals = [i for i, _ in kept], [v for _, v in kept]
            banned = [i - start for i in banned if start <= i < end]
        return ids, vals, banned

    rows_b, cols_b, vals_b, rows_x, cols_x = [], [], [], [], []
    if isinstance(configs, SamplingConfig):
        ids, vals, banned = entries(configs)
        return (None, torch.tensor(ids, dtype=torch.long, device=device),
                torch.tensor(vals, dtype=torch.float32, device=device),
                None, torch.tensor(banned, dtype=torch.long, device=device))
    for r, c in enumerate(configs):
        ids, vals, banned = entries(c)
        rows_b += [r] * len(ids)
        cols_b += ids
        vals_b += vals
        rows_x += [r] * len(banned)
        cols_x += banned
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)
    return (as_long(rows_b), as_long(cols_b), torch.tensor(vals_b, dtype=torch.float32, device=device),
            as_long(rows_x), as_long(cols_x))


def _apply_bias_(x: Tensor, rows, cols, vals, rows_x, cols_x) -> None:
    """In place on x [B,V]: add biases, then set banned ids to -inf."""
    if cols.numel():
        if rows is None:
            x[:, cols] += vals
        else:
            x[rows, cols] += vals  # (row, id) pairs are unique: a mapping per row
    if cols_x.numel():
        if rows_x is None:
            x[:, cols_x] = _NEG_INF
        else:
            x[rows_x, cols_x] = _NEG_INF


def apply_logit_bias(logits: Tensor, logit_bias: Mapping[int, float] | None = None,
                     banned_tokens: Sequence[int] = ()) -> Tensor:
    """Step 1 on [B,V] logits → new [B,V] float32: add ``logit_bias[id]`` to every row (-inf bans), then set
    ``banned_tokens`` to -inf. Ids must be in [0, V)."""
    x, one_row = _check_logits(logits)
    cfg = SamplingConfig(logit_bias=logit_bias, banned_tokens=tuple(banned_tokens))
    x = x.clone()
    _apply_bias_(x, *_bias_index(cfg, x.shape[0], x.shape[1], x.device))
    _check_values(x)
    return x[0] if one_row else x


def _penalize_(x: Tensor, prev: Tensor, prompt_len: Tensor, rep: Tensor, pres: Tensor, freq: Tensor,
               start: int = 0) -> None:
    """In place on x [B,V_r] (global ids [start, start + V_r)) with per-row penalties [B] and prev [B,L] (global
    ids, -1 = padding)."""
    batch, vocab = x.shape
    valid = prev >= 0
    local = prev - start
    mine = valid & (local >= 0) & (local < vocab)
    # padding and other shards' tokens go to an extra column that is dropped (they still count as positions)
    safe = torch.where(mine, local, vocab)
    if bool((rep != 1.0).any()):
        # repetition (CTRL / HF): every token seen in the prompt or the generation, once
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=x.device)
        seen.scatter_(1, safe, True)
        seen = seen[:, :vocab]
        r = rep.unsqueeze(1)
        cols = safe.clamp(max=vocab - 1)
        before = x.gather(1, cols)
        x.copy_(torch.where(seen, torch.where(x < 0, x * r, x / r), x))
        # a logit beyond ~3.4e34 can leave float32's range even with a bounded penalty; presence and frequency
        # cannot (a bounded shift of a finite float32 rounds back to a finite one)
        _check_overflow(x, cols, mine, before, "repetition_penalty", rep, start)
    if bool((pres != 0.0).any() or (freq != 0.0).any()):
        # presence / frequency (OpenAI): generated tokens only = valid tokens after the first prompt_len
        ordinal = valid.long().cumsum(1) - 1
        generated = valid & (ordinal >= prompt_len.unsqueeze(1))
        counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=x.device)
        counts.scatter_add_(1, torch.where(generated, safe, vocab), generated.float())
        counts = counts[:, :vocab]
        x.sub_(counts * freq.unsqueeze(1) + (counts > 0).float() * pres.unsqueeze(1))


def _as_row_floats(value: float | Sequence[float] | Tensor, batch: int, name: str, device: torch.device,
                   ok: Any, allowed: str) -> Tensor:
    """A setting given as one number or one per row → float32 [B]; checked in float64, before a value beyond
    float32's range could become ±inf."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64, device=device).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        t = None
    if t is not None and t.numel() == 1:
        t = t.expand(batch)
    if t is None or t.numel() != batch or not bool(ok(t).all()):
        raise ValueError(f"{name} must be {allowed} (one number or one per row), got {value!r}")
    return t.float()


def apply_penalties(logits: Tensor, prev_tokens: Tensor | Sequence[Sequence[int]] | None,
                    repetition_penalty: float | Sequence[float] = 1.0,
                    presence_penalty: float | Sequence[float] = 0.0,
                    frequency_penalty: float | Sequence[float] = 0.0,
                    prompt_len: int | Sequence[int] = 0) -> Tensor:
    """Step 2 on [B,V] logits → new [B,V] float32.

    ``prev_tokens`` is the sequence so far per row ([B,L] LongTensor, -1 = padding, or a list of lists),
    prompt first; the first ``prompt_len`` tokens of a row (padding not counted) are its prompt.
    Repetition (CTRL/HF): each token seen in the prompt or the generated tokens, once: logit > 0 → logit / r,
    else logit · r. Then frequency / presence (OpenAI), over the generated tokens only:
    logit − count·frequency − (count > 0)·presence. Each penalty is a number or one per row.
    """
    x, one_row = _check_logits(logits)
    x = x.clone()
    batch, vocab = x.shape
    dev = x.device
    low, high = REPETITION_PENALTY_RANGE
    rep = _as_row_floats(repetition_penalty, batch, "repetition_penalty", dev,
                         lambda t: (t >= low) & (t <= high), f"in [{low:g}, {high:g}]")
    pres, freq = (_as_row_floats(value, batch, name, dev, lambda t: t.abs() <= PENALTY_LIMIT,
                                 f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
                  for name, value in (("presence_penalty", presence_penalty),
                                      ("frequency_penalty", frequency_penalty)))
    if prev_tokens is not None:
        prev = as_prev_tokens(prev_tokens, batch, vocab, dev, one_row)
        _penalize_(x, prev, as_row_ints(prompt_len, batch, "prompt_len", dev), rep, pres, freq)
    _check_values(x)
    return x[0] if one_row else x


def _preprocess(logits: Tensor, config: ConfigArg, prev_tokens: object, prompt_len: object,
                vocab: Vocab | None = None):
    """Validate, upcast to float32 and apply steps 1-2. Returns (x [B,V_r], configs, one_row, vocab).

    ``vocab`` says which columns of the vocabulary the logits hold (None: all of it, in this process); steps
    1-2 are per token, so a shard applies them to its own columns. x is the caller's tensor itself (not a
    copy) when nothing needs changing: callers never write into it."""
    x, one_row = _check_logits(logits)
    batch, width = x.shape
    if vocab is None:
        vocab = Vocab(width)
    elif not 0 <= vocab.start <= vocab.start + width <= vocab.size:
        raise ValueError(f"logits hold columns [{vocab.start}, {vocab.start + width}) of a vocabulary of "
                         f"{vocab.size}")
    configs = _config_arg(config, batch)
    cfgs = [configs] if isinstance(configs, SamplingConfig) else configs
    has_bias = any(c.logit_bias or c.banned_tokens for c in cfgs)
    has_pen = prev_tokens is not None and any(c.has_penalties for c in cfgs)
    if prev_tokens is not None:  # always validated, even when no penalty uses it
        prev = as_prev_tokens(prev_tokens, batch, vocab.size, x.device, one_row)
        plen = as_row_ints(prompt_len, batch, "prompt_len", x.device)
    if not (has_bias or has_pen):
        return x, configs, one_row, vocab
    x = x.clone() if x.data_ptr() == logits.data_ptr() else x
    if has_bias:
        _apply_bias_(x, *_bias_index(configs, batch, vocab.size, x.device, vocab.start, width))
    if has_pen:
        if isinstance(configs, SamplingConfig):
            per_row = lambda name: torch.full((batch,), getattr(configs, name), device=x.device)
        else:
            per_row = lambda name: torch.tensor([getattr(c, name) for c in configs], device=x.device)
        _penalize_(x, prev, plen, per_row("repetition_penalty"), per_row("presence_penalty"),
                   per_row("frequency_penalty"), vocab.start)
    return x, configs, one_row, vocab


# --- steps 3-6: temperature and the cut-offs --------------------------------------------------------------


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """Step 3 on [B,V] logits → logits / temperature (float32). temperature must be in [1e-5, 1e4] here;
    greedy decoding (temperature 0) is a path of the pipeline, not a division."""
    x, one_row = _check_logits(logits)
    if not is_real(temperature) or not GREEDY_TEMPERATURE <= temperature <= TEMPERATURE_LIMIT:
        raise ValueError(f"temperature must be in [{GREEDY_TEMPERATURE:g}, {TEMPERATURE_LIMIT:g}] here, got "
                         f"{temperature!r}")
    if x.numel():
        _check_top(x.amax(dim=-1), "logits", float(temperature))
    x = x / float(temperature)
    return x[0] if one_row else x


def _top_p_sorted(vals: Tensor, top_p: float, probs: Tensor | None = None) -> Tensor:
    """Top-p on candidates sorted by value, descending ([b,m], ties adjacent) → vals with cut ones at -inf.

    ``probs`` are the candidates' probabilities over the full row when the candidates are only a window of it
    (the mass outside the window is then 1 − their sum); None means the candidates are the whole support.
    HF's rule: in ascending order, drop tokens whose inclusive cumulative mass ≤ 1 − p, keep the largest.
    A tie group uses the mass at its first (most probable) position, so it is kept or dropped whole."""
    if probs is None:
        probs = torch.softmax(vals, dim=-1)
        tail = 0.0
    else:
        tail = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp_min(0.0)
    ascending_mass = probs.flip(-1).cumsum(-1).flip(-1) + tail  # mass of this token and all below it
    start = torch.ones_like(vals, dtype=torch.bool)
    start[:, 1:] = vals[:, 1:] != vals[:, :-1]
    if not bool(start.all()):  # ties: each position takes the mass at its tie group's first position
        pos = torch.arange(vals.shape[1], device=vals.device).expand_as(vals)
        first = torch.where(start, pos, 0).cummax(dim=-1).values
        ascending_mass = ascending_mass.gather(1, first)
    remove = ascending_mass <= (1 - top_p)
    remove[:, 0] = False
    return vals.masked_fill(remove, _NEG_INF)


def _min_p_sorted(vals: Tensor, min_p: float) -> Tensor:
    """Min-p on candidates sorted descending (position 0 is the most probable, always kept).
    As HF: probabilities of the (already cut) candidates, drop p < min_p · p_max."""
    probs = torch.softmax(vals, dim=-1)
    remove = probs < min_p * probs[:, :1]
    remove[:, 0] = False
    return vals.masked_fill(remove, _NEG_INF)


def _min_p_rows(x: Tensor, min_p: float, vocab: Vocab) -> Tensor:
    """Min-p on whole rows [b,V_r], exactly HF's MinPLogitsWarper. The argmax is always kept without a
    special case: its p is the maximum itself, and min_p · p_max ≤ p_max for min_p ≤ 1."""
    probs = vocab.softmax(x)
    remove = probs < min_p * vocab.amax(probs)
    return x.masked_fill(remove, _NEG_INF)


# A part of a batch after the cut: (rows, vals, idx). rows: indices into the batch (None = all rows);
# vals: temperature-scaled logits, -inf = cut; idx: the token id of each column of vals, or None when vals
# are whole rows [b,V]. Candidates [b,m] are sorted by value, descending.
_Part = tuple[Tensor | None, Tensor, Tensor | None]


def _sub(rows: Tensor | None, pick: Tensor) -> Tensor:
    return pick if rows is None else rows[pick]


def _top_k_parts(x: Tensor, temperature: float, top_k: int, vocab: Vocab,
                 top: tuple[Tensor, Tensor] | None = None) -> list[_Part]:
    """The top k+1 once (``top``: already taken, ``vocab.topk(x, top_k + 1)``); rows whose k-th and (k+1)-th
    values tie (after the division by T, as HF compares) take every token ≥ the k-th, as HF's ``scores < kth``
    rule keeps them."""
    vals, idx = vocab.topk(x, top_k + 1) if top is None else top
    _check_top(vals[:, 0], vocab.name, temperature)
    vals = vals / temperature  # x / T is monotone: topk of x is a topk of x / T
    tie = (vals[:, top_k - 1] == vals[:, top_k]) & torch.isfinite(vals[:, top_k - 1])
    if not bool(tie.any()):
        return [(None, vals[:, :top_k], idx[:, :top_k])]
    parts: list[_Part] = []
    plain = (~tie).nonzero().squeeze(1)
    if plain.numel():
        parts.append((plain, vals[plain, :top_k], idx[plain, :top_k]))
    tied = tie.nonzero().squeeze(1)
    xt = x[tied]
    kth = vals[tied, top_k - 1 : top_k]
    count = vocab.sum(((xt / temperature) >= kth).sum(dim=-1, keepdim=True))
    v, i = vocab.topk(xt, int(count.max()))
    cut = torch.arange(v.shape[1], device=v.device) >= count
    parts.append((tied, (v / temperature).masked_fill(cut, _NEG_INF), i))
    return parts


def _block_sums(x: Tensor, top: Tensor, temperature: float, block: int = _BLOCK, start: int = 0,
                floor: Tensor | None = None) -> Tensor:
    """Σ exp(x/T − top) over each block of `block` columns → [b, n] float32, the n blocks that x's columns
    touch on a grid of blocks that starts at id 0 (x [b,V_r] holds ids [start, start + V_r); the first block
    is start // block, its columns before `start` count 0). With `floor` [b,1], only the tokens with
    x/T > floor count (the mass strictly above a value).

    Runs over cache-sized chunks with one reused buffer: no [B,V] temporary (whose page faults alone cost
    about as much as the arithmetic)."""
    batch, width = x.shape
    if floor is not None and batch > _FLOOR_ROWS:  # rows in groups: chunks stay long, threshold_ calls few
        return torch.cat([_block_sums(x[r : r + _FLOOR_ROWS], top[r : r + _FLOOR_ROWS], temperature, block, start,
                                      floor[r : r + _FLOOR_ROWS]) for r in range(0, batch, _FLOOR_ROWS)])
    offset = start % block  # grid positions before the first column
    span = offset + width
    chunk = _chunk_columns(batch, span, block)
    out = torch.empty(batch, -(-span // block), dtype=torch.float32, device=x.device)
    buf = torch.empty(batch, chunk, dtype=torch.float32, device=x.device)
    floors = [] if floor is None else floor[:, 0].tolist()  # float32 values: exact as Python floats
    for pos in range(0, span, chunk):  # grid positions [pos, pos + chunk)
        head = max(offset - pos, 0)
        part = x[:, max(pos - offset, 0) : pos + chunk - offset]
        end = head + part.shape[1]
        padded = -(-end // block) * block
        if head:
            buf[:, :head] = 0.0
        b = buf[:, head:end]
        torch.div(part, temperature, out=b)
        for row, value in enumerate(floors):  # threshold_ per row: a broadcast bool mask costs as much as the exp
            torch.threshold_(b[row], value, _NEG_INF)
        _tail_exp_(b.sub_(top))
        if padded > end:
            buf[:, end:padded] = 0.0
        out[:, pos // block : pos // block + padded // block] = buf[:, :padded].view(batch, -1, block).sum(-1)
    return out


def _top_p_parts(x: Tensor, temperature: float, top_p: float, vocab: Vocab, native: bool = True) -> list[_Part]:
    """Top-p without top-k, with no full sort.

    First partial sorts of a small window (top 256, then 1024): a window is enough once the mass strictly
    above its smallest value reaches p — then every token outside it, and any tie at its edge, is dropped and
    the rest of the row only enters through the normaliser. That settles language-model-like rows (their
    top-p sets hold tens of tokens). Rows with a wide top-p set go to `_top_p_bins`, which is exact too.

    A few whole CPU rows are settled in C first (`models.native.top_p_row`: the same rule, three passes and a
    sort of the candidates, one call per row instead of ~40 torch ops); the rows it declines take the path
    above. Not with ``native=False``: a seeded draw races noise over the candidates in id order, dropped ones
    included, so its id depends on the candidate list — it keeps the windows', which never depend on whether C
    ran or on the batch's size."""
    parts, rest = _top_p_native(x, temperature, top_p, vocab) if native else ([], list(range(x.shape[0])))
    if not parts:
        return _top_p_windows(x, temperature, top_p, vocab)
    if rest:
        _check_top(vocab.amax(x)[:, 0], vocab.name, temperature)  # an error names the row of x, not of the rest
        rows = torch.tensor(rest)
        parts += [(_sub(rows, sub) if sub is not None else rows, vals, idx)
                  for sub, vals, idx in _top_p_windows(x[rows], temperature, top_p, vocab)]
    return parts


def _top_p_native(x: Tensor, temperature: float, top_p: float, vocab: Vocab) -> tuple[list[_Part], list[int]]:
    """The rows of x [b,V] whose top-p set C settles (`models.native.top_p_row`: a few whole float32 CPU rows,
    one call each; language-model rows, whose sets hold tens of tokens) as parts, and the rows it leaves (flat
    rows, more rows than _NATIVE_TOP_P_ROWS, a sharded vocabulary, no library)."""
    if not (type(vocab) is Vocab and x.device.type == "cpu" and x.dtype == torch.float32
            and x.shape[1] == vocab.size and 0 < x.shape[0] <= _NATIVE_TOP_P_ROWS):
        return [], list(range(x.shape[0]))
    from lmhead.models.native import top_p_row

    found = [top_p_row(x[r], temperature, top_p) for r in range(x.shape[0])]
    if len(found) == 1:
        return ([(None, *found[0])], []) if found[0] is not None else ([], [0])
    return ([(torch.tensor([r]), *f) for r, f in enumerate(found) if f is not None],
            [r for r, f in enumerate(found) if f is None])


def _top_p_windows(x: Tensor, temperature: float, top_p: float, vocab: Vocab) -> list[_Part]:
    """`_top_p_parts` in torch: windows of the top 256 and 1024, then `_top_p_bins`."""
    top = vocab.amax(x)
    _check_top(top[:, 0], vocab.name, temperature)
    top_t = top / temperature
    # the softmax normaliser over the full row, in cache-sized chunks (no sort, no [B,V] temporary), summed
    # in float64 so that the window's masses are as exact as float32 logits allow
    norm = vocab.sum(_block_sums(x, top_t, temperature).sum(dim=-1, keepdim=True, dtype=torch.float64))
    parts: list[_Part] = []
    rows: Tensor | None = None
    xs, top_t = x, top_t.double()
    window = min(_WINDOW_START, vocab.size)
    for _ in range(_WINDOWS):
        if window * _WINDOW_MAX_FRACTION > vocab.size:
            break
        v, i = vocab.topk(xs, window)
        vals = v / temperature
        probs = torch.exp(vals.double() - top_t) / norm  # [b,W] float64, over the full row
        strictly_above = (probs * (vals > vals[:, -1:])).sum(dim=-1)
        done = strictly_above >= top_p + _WINDOW_MARGIN
        hopeless = strictly_above < top_p / _WINDOW_GROWTH  # a wider window would most likely fail too
        if bool(hopeless.all()):
            break
        if bool(done.all()):
            parts.append((rows, _top_p_sorted(vals, top_p, probs), i))
            return parts
        if bool(done.any()):
            d = done.nonzero().squeeze(1)
            parts.append((_sub(rows, d), _top_p_sorted(vals[d], top_p, probs[d]), i[d]))
            rest = (~done).nonzero().squeeze(1)
            rows, xs, top_t, norm = _sub(rows, rest), xs[rest], top_t[rest], norm[rest]
        window *= _WINDOW_GROWTH
    parts.append((rows, _top_p_bins(xs, temperature, top_t, norm, top_p, vocab), None))
    return parts


def _top_p_bins(xs: Tensor, temperature: float, top_t: Tensor, norm: Tensor, top_p: float,
                vocab: Vocab) -> Tensor:
    """Exact top-p on whole rows [b,V_r] by a histogram select instead of a sort (two chunked passes over V).

    top_t = max(x)/T (float64) and norm = Σ exp(x/T − top_t) (float64) per row. The logit range is cut into
    equal bins; the bin index is monotone in the logit, so tied tokens share a bin and a higher bin only holds
    larger logits. Per-bin masses give the crossing bin, where the mass of the top tokens reaches p: tokens
    above it are kept, below it dropped, and only the (few) tokens of that bin are sorted to place the cut
    exactly (kept iff the mass strictly above < p, i.e. the mass at or below > 1 − p, summed from the bottom as
    HF does). Returns x/T with the dropped tokens at -inf. Over shards, the bin masses are summed and the
    crossing bin's tokens gathered: both small."""
    batch, width = xs.shape
    nbins = max(1, min(_BINS, vocab.size // 16))
    hi = top_t.float()
    # min(x)/T is min(x/T) (division by T > 0 is monotone); below hi − 104, exp(·) is 0 in float32 anyway
    lo = torch.maximum(vocab.amin(xs) / temperature, hi - _UNDERFLOW)
    scale = nbins / (hi - lo).clamp_min(1e-30)  # a flat row: every finite token in one bin
    chunk = _chunk_columns(batch, width)
    xt_buf = torch.empty(batch, chunk, dtype=torch.float32, device=xs.device)
    bin_buf = torch.empty_like(xt_buf)
    idx_buf = torch.empty(batch, chunk, dtype=torch.long, device=xs.device)

    def chunks():  # (x/T, bin index as float) per chunk, in reused buffers; -inf → bin 0
        for start in range(0, width, chunk):
            part = xs[:, start : start + chunk]
            xt, bins = xt_buf[:, : part.shape[1]], bin_buf[:, : part.shape[1]]
            torch.div(part, temperature, out=xt)
            torch.sub(xt, lo, out=bins).mul_(scale).floor_().clamp_(0, nbins - 1)
            yield xt, bins

    mass = torch.zeros(batch, nbins, dtype=torch.float32, device=xs.device)
    for xt, bins in chunks():
        index = idx_buf[:, : xt.shape[1]]
        index.copy_(bins)
        mass.scatter_add_(1, index, xt.sub_(hi).exp_())
    mass = vocab.sum(mass)
    # HF's form of the rule, summed from the bottom so that small tails keep their precision: a token is kept
    # iff the mass of itself, its ties and everything below it is > 1 − p
    from_bottom = mass.double().cumsum(-1) / norm  # mass of bins 0..b
    crossing = (from_bottom <= 1 - top_p).sum(dim=-1, keepdim=True).clamp_(max=nbins - 1)
    below = torch.where(crossing > 0, from_bottom.gather(1, (crossing - 1).clamp_min(0)), torch.zeros_like(norm))
    row_ids, values = [], []  # the crossing bin's tokens
    for xt, bins in chunks():
        hit = (bins == crossing.float()).nonzero()
        row_ids.append(hit[:, 0])
        values.append(xt[hit[:, 0], hit[:, 1]])
    row_ids, values = vocab.cat(torch.cat(row_ids), torch.cat(values))
    cut = _cut_in_bin(row_ids, values, batch, top_t, norm, below, top_p)
    out = xs / temperature
    for start_col in range(0, width, chunk):
        o = out[:, start_col : start_col + chunk]
        o.masked_fill_(o < cut, _NEG_INF)
    return out


def _cut_in_bin(row_ids: Tensor, values: Tensor, batch: int, top_t: Tensor, norm: Tensor, below: Tensor,
                top_p: float) -> Tensor:
    """The crossing bin's tokens (their rows [n], their x/T [n]) → [b,1] the smallest x/T that top-p keeps.

    ``below`` [b,1] is the mass of the bins under the crossing one; top_t and norm as in `_top_p_bins`."""
    values, order = torch.sort(values, stable=True)
    row_ids, order = torch.sort(row_ids[order], stable=True)  # by row, each row's values ascending
    values = values[order]
    count = torch.bincount(row_ids, minlength=batch)
    first = torch.cumsum(count, 0) - count
    v = torch.full((batch, max(1, int(count.max()))), float("inf"), device=values.device)  # +inf pads the end
    v[row_ids, torch.arange(row_ids.numel(), device=values.device) - first[row_ids]] = values
    probs = torch.where(torch.isfinite(v), torch.exp(v.double() - top_t) / norm, torch.zeros_like(v.double()))
    ascending = probs.cumsum(-1)
    last = torch.ones_like(v, dtype=torch.bool)  # a tie group takes the mass at its last (largest) position
    last[:, :-1] = v[:, :-1] != v[:, 1:]
    pos = torch.arange(v.shape[1], device=v.device).expand_as(v)
    group_end = torch.where(last, pos, v.shape[1] - 1).flip(-1).cummin(dim=-1).values.flip(-1)
    keep = (below + ascending.gather(1, group_end) > 1 - top_p) & torch.isfinite(v)
    # the bin's largest token is kept by the choice of the bin (its mass with all below is > 1 − p); say so
    # explicitly, so that a rounding difference between bin and token sums cannot drop the whole bin
    keep.scatter_(1, (count - 1).clamp_min(0).unsqueeze(1), True)
    return torch.where(keep, v, torch.full_like(v, float("inf"))).amin(dim=-1, keepdim=True)


def _cut(x: Tensor, cfg: SamplingConfig, vocab: Vocab, top: tuple[Tensor, Tensor] | None = None,
         native: bool = True) -> list[_Part]:
    """Steps 3-6 for rows that share one cut key (``top``: a top-k config's top k+1, already taken; ``native``:
    whether top-p may settle rows in C — not for a seeded draw, see `_top_p_parts`)."""
    if cfg.is_greedy:
        v, i = vocab.argmax(x)
        _check_top(v[:, 0], vocab.name)
        return [(None, v, i)]
    _, temperature, top_k, top_p, min_p = cfg._cut_key(vocab.size)
    if top_k:
        parts = _top_k_parts(x, temperature, top_k, vocab, top)
        if top_p < 1.0:
            # topk's output is sorted, so tied values are adjacent: all _top_p_sorted needs
            parts = [(r, _top_p_sorted(v, top_p), i) for r, v, i in parts]
    elif top_p < 1.0:
        parts = _top_p_parts(x, temperature, top_p, vocab, native)
    else:
        _check_top(vocab.amax(x)[:, 0], vocab.name, temperature)
        xt = x / temperature
        return [(None, _min_p_rows(xt, min_p, vocab) if min_p > 0 else xt, None)]
    if min_p > 0:
        parts = [(r, _min_p_sorted(v, min_p) if i is not None else _min_p_rows(v, min_p, vocab), i)
                 for r, v, i in parts]
    return parts


def _groups(configs: list[SamplingConfig] | SamplingConfig, batch: int, vocab_size: int,
            device: torch.device) -> list[tuple[Tensor | None, SamplingConfig]]:
    """Rows sharing a cut key, as (rows or None for the whole batch, config)."""
    if isinstance(configs, SamplingConfig):
        return [(None, configs)]
    groups: dict[tuple, list[int]] = {}
    first: dict[tuple, SamplingConfig] = {}
    for r, c in enumerate(configs):
        key = c._cut_key(vocab_size)
        groups.setdefault(key, []).append(r)
        first.setdefault(key, c)
    return [(None if len(rows) == batch else torch.tensor(rows, device=device), first[key])
            for key, rows in groups.items()]


def _parts(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab):
    """Steps 3-6 over the whole batch → list of (rows, vals, idx, config), rows indexing the batch."""
    out = []
    if x.shape[0] == 0:
        return out
    for rows, cfg in _groups(configs, x.shape[0], vocab.size, x.device):
        xs = x if rows is None else x[rows]
        for sub, vals, idx in _cut(xs, cfg, vocab):
            out.append((rows if sub is None else _sub(rows, sub), vals, idx, cfg))
    return out


def _scatter_rows(out: Tensor, rows: Tensor | None, block: Tensor, idx: Tensor | None, fill: float,
                  vocab: Vocab) -> None:
    """Write candidates (or whole rows) into out [B,V_r] at `rows`."""
    if idx is not None:
        block = vocab.columns(block, idx, fill, out.shape[1])
    if rows is None:
        out.copy_(block)
    else:
        out[rows] = block


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Step 4 on [B,V] logits → new [B,V] float32 with every logit below the k-th largest at -inf (tokens tied
    with the k-th are kept, as HF's TopKLogitsWarper). top_k = 0 (or ≥ V) is off."""
    x, one_row = _check_logits(logits)
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int ≥ 0 (0 = off), got {top_k!r}")
    _check_values(x)
    if 0 < top_k < x.shape[1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, _NEG_INF)
    else:
        x = x.clone()
    return x[0] if one_row else x


def apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Step 5 on [B,V] logits → new [B,V] float32: keep the most probable tokens until their mass reaches
    top_p (the crossing token kept, ties with it too, at least one token); the rest at -inf. top_p in (0, 1],
    1 = off. Avoids a full sort with a growing window (exact)."""
    x, one_row = _check_logits(logits)
    if not is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if top_p >= 1.0:
        _check_values(x)
        out = x.clone()
    else:
        out = torch.full_like(x, _NEG_INF)
        vocab = Vocab(x.shape[1])
        for rows, vals, idx in _top_p_parts(x, 1.0, float(top_p), vocab):  # T = 1: vals are the logits
            _scatter_rows(out, rows, vals, idx, _NEG_INF, vocab)
    return out[0] if one_row else out


def apply_min_p(logits: Tensor, min_p: float) -> Tensor:
    """Step 6 on [B,V] logits → new [B,V] float32: tokens with p < min_p · p_max at -inf (HF's rule, the
    argmax always kept). min_p in [0, 1], 0 = off."""
    x, one_row = _check_logits(logits)
    if not is_real(min_p) or not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
    _check_values(x)
    x = _min_p_rows(x, float(min_p), Vocab(x.shape[1])) if min_p > 0 else x.clone()
    return x[0] if one_row else x


# --- the pipeline -----------------------------------------------------------------------------------------


def process_logits(logits: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                   prompt_len: int | Sequence[int] = 0, *, vocab: Vocab | None = None) -> Tensor:
    """Steps 1-6: [B,V] logits → [B,V] float32 processed logits (temperature-scaled), rejected tokens -inf.

    A greedy row keeps only its argmax (at its biased / penalised logit). ``config`` is one SamplingConfig or
    a list with one per row; ``prev_tokens`` ([B,L] LongTensor, -1 = padding, or list of lists) is the
    sequence so far, its first ``prompt_len`` tokens (int or one per row) the prompt. ``vocab`` (None: the
    logits are the whole vocabulary) says which columns [start, start + V_r) of it the logits hold, and
    carries the reductions across it; the result then holds the same columns ([B,V_r])."""
    x, configs, one_row, vocab = _preprocess(logits, config, prev_tokens, prompt_len, vocab)
    out = torch.empty_like(x)
    for rows, vals, idx, _ in _parts(x, configs, vocab):
        _scatter_rows(out, rows, vals, idx, _NEG_INF, vocab)
    return out[0] if one_row else out


def probabilities(logits: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                  prompt_len: int | Sequence[int] = 0, *, vocab: Vocab | None = None) -> Tensor:
    """Steps 1-7: [B,V] logits → [B,V] float32 probabilities over the full vocabulary (rows sum to 1, cut
    tokens 0). Same arguments as ``process_logits``."""
    x, configs, one_row, vocab = _preprocess(logits, config, prev_tokens, prompt_len, vocab)
    out = torch.empty_like(x)
    for rows, vals, idx, _ in _parts(x, configs, vocab):
        probs = vocab.softmax(vals) if idx is None else torch.softmax(vals, dim=-1)
        _scatter_rows(out, rows, probs, idx, 0.0, vocab)
    return out[0] if one_row else out


# --- step 8: the draw -------------------------------------------------------------------------------------


def _mix_seed(seed: int, step: int) -> int:
    """(seed, step) → a 64-bit generator seed (splitmix64 finaliser, twice): nearby seeds and steps give
    unrelated streams."""
    def splitmix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    return splitmix(splitmix(seed & _MASK64) ^ (step & _MASK64))


def seeded_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded row draws from at position ``step``: seeded from (seed, step) by splitmix64, so
    nearby seeds and steps give unrelated streams and the draw depends on nothing else."""
    return torch.Generator(device=device).manual_seed(_mix_seed(seed, step))


def race_draw(probs: Tensor, generator: torch.Generator | list[torch.Generator] | None = None) -> Tensor:
    """The exponential race on [b,m] probabilities → [b] positions: argmax(p / Exp(1)) picks i with probability
    p_i (exact, no multinomial). Noise is drawn for the m columns in order, from ``generator`` — or, given one
    generator per row, each row's from its own (the noise a row gets alone)."""
    noise = torch.empty_like(probs)
    if isinstance(generator, list):
        for row, gen in zip(noise, generator, strict=True):
            row.exponential_(generator=gen)
    else:
        noise.exponential_(generator=generator)
    return (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)


def _grid_sums(x: Tensor, top: Tensor, temperature: float, floor: Tensor | None, vocab: Vocab) -> Tensor:
    """Σ exp(x/T − top) per block of 1024 ids over the whole vocabulary (only x/T > floor when a floor [b,1] is
    given) → [b, ⌈V/1024⌉] float32. x [b,V_r] are local columns; over shards each rank's blocks are put in
    place on the whole grid and summed (each column belongs to one shard)."""
    block = min(_BLOCK, vocab.size)
    sums = _block_sums(x, top, temperature, block, vocab.start, floor)
    n_blocks = -(-vocab.size // block)
    if sums.shape[1] != n_blocks:  # a shard: its blocks in place on the whole grid
        first = vocab.start // block
        grid = torch.zeros(x.shape[0], n_blocks, dtype=sums.dtype, device=sums.device)
        grid[:, first : first + sums.shape[1]] = sums
        sums = grid
    return vocab.sum(sums)


def _draw_in_blocks(x: Tensor, temperature: float, top: Tensor, floor: Tensor | None, sums: Tensor, u: Tensor,
                    vocab: Vocab) -> tuple[Tensor, Tensor]:
    """Inverse CDF with one uniform u [b,1] (float64, in [0, 1)) per row, in two levels: the block by its mass in
    `sums` (from `_grid_sums` with the same floor), then the token inside it → (ids [b] global, their x/T
    [b,1]). Zero-mass tokens are never picked: rounding that leaves u at or past a total takes the last block
    or token with mass. Over shards the chosen block's 1024 values are summed (each column is one shard's)."""
    width = x.shape[1]
    block = min(_BLOCK, vocab.size)
    positions = torch.arange(max(block, sums.shape[1]), device=x.device)
    cdf = sums.cumsum(dim=-1, dtype=torch.float64)
    u = u * cdf[:, -1:]
    last_blk = torch.where(sums > 0, positions[: sums.shape[1]], -1).amax(dim=-1, keepdim=True)
    blk = torch.minimum(torch.searchsorted(cdf, u, right=True), last_blk)
    rest = u - torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp_min(0)), torch.zeros_like(u))
    cols = blk * block + positions[:block]  # global ids; the last block may run past V
    local = cols - vocab.start
    mine = (local >= 0) & (local < width)
    xt = vocab.sum(torch.where(mine, x.gather(1, local.clamp(0, width - 1)) / temperature, 0.0))
    live = cols < vocab.size
    if floor is not None:
        live &= xt > floor
    e = _tail_exp_(torch.where(live, xt - top, _NEG_INF))  # as the block sums count them
    within = e.cumsum(dim=-1, dtype=torch.float64)
    last = torch.where(e > 0, positions[:block], -1).amax(dim=-1, keepdim=True)
    pick = torch.minimum(torch.searchsorted(within, rest, right=True), last)
    return cols.gather(1, pick).squeeze(1), xt.gather(1, pick)


def _draw_rows(vals: Tensor, generator: torch.Generator | None, vocab: Vocab) -> Tensor:
    """Draw from whole rows of scaled logits [b,V_r] (-inf = cut) → [b] ids, by inverse CDF with one uniform
    per row (`_draw_in_blocks`): two light passes over V and no [B,V] temporary (V exponentials or a full
    cumsum cost several times more)."""
    top = vocab.amax(vals)
    sums = _grid_sums(vals, top, 1.0, None, vocab)
    u = torch.rand(vals.shape[0], 1, dtype=torch.float64, device=vals.device, generator=generator)
    return _draw_in_blocks(vals, 1.0, top, None, sums, u, vocab)[0]


def _draw_part(vals: Tensor, idx: Tensor | None, seeded: bool, generator: torch.Generator | list | None,
               vocab: Vocab) -> Tensor:
    """A sampled part of the cut ([b,V_r] whole rows when idx is None, else [b,m] candidates and their ids) → [b]
    ids. A seeded row's candidates race in token-id order, so that the noise each token gets does not depend
    on the order the cut produced them in (``generator``: one per row for seeded rows drawn together)."""
    if idx is None:
        return _draw_rows(vals, generator, vocab)
    if seeded:
        order = idx.argsort(dim=-1)
        vals, idx = vals.gather(1, order), idx.gather(1, order)
    return idx.gather(1, race_draw(torch.softmax(vals, dim=-1), generator).unsqueeze(1)).squeeze(1)


def _mass_above(vals: Tensor, top: Tensor, value: Tensor) -> Tensor:
    """Σ exp(v − top) over the candidates vals [n,m] (x/T) strictly above value [n,1] → [n] float64, counted as
    the block masses count them (`_tail_exp_`)."""
    return _tail_exp_(torch.where(vals > value, vals - top, _NEG_INF)).sum(dim=-1, dtype=torch.float64)


def _settle(x: Tensor, temperature: float, top_p: float, top: Tensor, norm: Tensor, chosen: Tensor, value: Tensor,
            generator: torch.Generator | None, seeded: bool, vocab: Vocab) -> tuple[Tensor, Tensor, Tensor]:
    """One rejection round's test for rows [n,V_r] whose draws `chosen` [n] have x/T `value` [n,1] (top = the
    row max x/T [n,1], norm = the row's mass [n] float64) → (done [n] bool, ids [n] where done, the block
    masses above each value [n, ⌈V/1024⌉] for the rows not done: the next round's proposal).

    A draw is kept iff the mass strictly above its value is < p · norm. That mass is a pass of exps over the
    row — or, for a draw above the row's 256th largest value, the top 256 (one partial sort for the batch,
    when at least half of the rows can have their draw there: fewer than norm / e(draw) tokens lie above it).
    A row whose top 256 hold its whole top-p set and whose draw is not kept then draws from that set's exact
    cut instead of another round (language-model rows)."""
    n, n_blocks = x.shape[0], -(-vocab.size // min(_BLOCK, vocab.size))
    limit = top_p * norm
    if 2 * int((norm / torch.exp((value - top)[:, 0].double()) >= _WINDOW_START).sum()) > n:
        sums = _grid_sums(x, top, temperature, value, vocab)  # mostly wide rows: one pass over all of them
        return sums.sum(dim=-1, dtype=torch.float64) < limit, chosen, sums
    vals, idx = vocab.topk(x, min(_WINDOW_START, vocab.size))
    vals = vals / temperature
    in_window = value[:, 0] > vals[:, -1]  # every token above the draw is in the window
    above = _mass_above(vals, top, value)
    done = in_window & (above < limit)
    if bool(done.all()):  # the usual case: every draw kept
        return done, chosen, torch.empty(n, n_blocks, device=x.device)
    probs = torch.exp(vals.double() - top.double()) / norm[:, None]  # [n,256], over the full row
    covered = ~done & ((probs * (vals > vals[:, -1:])).sum(dim=-1) >= top_p + _WINDOW_MARGIN)
    ids = chosen.clone()
    if bool(covered.any()):
        c = covered.nonzero().squeeze(1)
        ids[c] = _draw_part(_top_p_sorted(vals[c], top_p, probs[c]), idx[c], seeded, generator, vocab)
        done |= covered
    sums = torch.zeros(n, n_blocks, dtype=torch.float32, device=x.device)
    rest = (~done).nonzero().squeeze(1)
    if rest.numel():  # the mass above a draw outside the window, and the next proposal, from a pass over the row
        sums[rest] = _grid_sums(x[rest], top[rest], temperature, value[rest], vocab)
        done[rest] = ~in_window[rest] & (sums[rest].sum(dim=-1, dtype=torch.float64) < limit[rest])
    return done, ids, sums


def _top_p_draw(x: Tensor, temperature: float, top_p: float, generator: torch.Generator | None, seeded: bool,
                vocab: Vocab) -> Tensor:
    """Draw from the top-p distribution of rows [b,V_r] (top-p alone: no top-k, no min-p) → [b] global ids,
    without finding the top-p set: by rejection.

    The top-p set K is the tokens whose mass strictly above them is < p; it is an upper set (every token at
    least as probable as a kept one is kept). A round draws a token from the row restricted to x/T > floor (at
    first the whole row) by `_draw_in_blocks`, then `_settle` sums the mass strictly above the drawn value:
    < p · (the row's mass) → the token is in K and is the row's draw; otherwise the token and everything at or
    below it are outside K, its value becomes the floor, and the block masses above it are the next round's
    proposal. A draw from p restricted to any S ⊇ K, kept only when it lands in K, is exactly p restricted to
    K (ties are kept or dropped together; the row's maximum, whose mass above is 0, always passes), so the ids
    follow the top-p distribution exactly; a row that stops the rounds and draws from its exact top-p set
    instead (`_settle`'s window; after _DRAW_ROUNDS rounds `_top_p_parts`) keeps the mixture exact. A round
    passes with probability ≥ p. Cost: the row max, a pass of exps, and per round one pass (or a partial sort
    of 256) over the rows it concerns."""
    top = vocab.amax(x)
    _check_top(top[:, 0], vocab.name, temperature)
    top_t = top / temperature
    sums = _grid_sums(x, top_t, temperature, None, vocab)
    norm = sums.sum(dim=-1, dtype=torch.float64)  # the row's mass, in float64 as the reference sums it
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    floor = None
    for _ in range(_DRAW_ROUNDS):
        u = torch.rand(rows.numel(), 1, dtype=torch.float64, device=x.device, generator=generator)
        chosen, value = _draw_in_blocks(x, temperature, top_t, floor, sums, u, vocab)
        done, chosen, sums = _settle(x, temperature, top_p, top_t, norm, chosen, value, generator, seeded, vocab)
        ids[rows[done]] = chosen[done]
        if bool(done.all()):
            return ids
        rest = (~done).nonzero().squeeze(1)
        rows, x, top_t, norm, sums, floor = rows[rest], x[rest], top_t[rest], norm[rest], sums[rest], value[rest]
    for sub, vals, idx in _top_p_parts(x, temperature, top_p, vocab, native=False):  # `sample`'s ids as they were
        ids[_sub(rows, sub)] = _draw_part(vals, idx, seeded, generator, vocab)
    return ids


def _top_p_draw_unseeded(x: Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
                         vocab: Vocab) -> Tensor:
    """Unseeded rows [b,V_r] with top-p alone → [b] ids from the top-p distribution: rows whose set C settles at
    once (`_top_p_native`; a language model's row of 49,152: ~0.4 ms against ~1.5 for the rejection's torch
    passes) race over it, the others draw by rejection (`_top_p_draw`: flat rows, wide batches)."""
    parts, rest = _top_p_native(x, temperature, top_p, vocab)
    if not parts:
        return _top_p_draw(x, temperature, top_p, generator, False, vocab)
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    if rest:
        _check_top(vocab.amax(x)[:, 0], vocab.name, temperature)  # an error names the row of x, not of the rest
        index = torch.tensor(rest, device=x.device)
        ids[index] = _top_p_draw(x[index], temperature, top_p, generator, False, vocab)
    for rows, vals, idx in parts:
        ids[slice(None) if rows is None else rows] = _draw_part(vals, idx, False, generator, vocab)
    return ids


def _part_logprobs(vals: Tensor, idx: Tensor | None, ids: Tensor, vocab: Vocab) -> Tensor:
    """The processed log-probability of ids [b] (global) in a part of the cut: candidates [b,m] normalised over
    themselves (the -inf elsewhere in the row add nothing), whole rows [b,V] by a log-softmax over the row
    (whole vocabulary only). -inf for an id the cut dropped."""
    if idx is None:
        return torch.log_softmax(vals, dim=-1).gather(1, (ids - vocab.start)[:, None]).squeeze(1)
    lse = torch.logsumexp(vals, dim=-1, keepdim=True)
    return torch.where(idx == ids[:, None], vals - lse, _NEG_INF).amax(dim=-1)


def _draw_group(x: Tensor, cfg: SamplingConfig, generator: torch.Generator | None, vocab: Vocab,
                top: tuple[Tensor, Tensor] | None = None, scored: bool = False) -> tuple[Tensor, Tensor | None]:
    """Steps 3-8 for rows [b,V_r] that share one cut key → ([b] global ids, with ``scored`` their processed
    log-probabilities [b] from the same cut, else None; NaN for rows drawn without a cut: top-p alone)."""
    if not cfg.is_greedy:
        _, temperature, top_k, top_p, min_p = cfg._cut_key(vocab.size)
        # top-p alone draws by rejection, without the top-p set — unless the set is wanted anyway for the logprob
        # of an unseeded draw (a seeded row keeps `sample`'s ids), or C finds it at once (unseeded rows)
        if top_p < 1.0 and not top_k and not min_p and not (scored and cfg.seed is None):
            if cfg.seed is None:
                return _top_p_draw_unseeded(x, temperature, top_p, generator, vocab), None
            ids = _top_p_draw(x, temperature, top_p, generator, True, vocab)
            return ids, torch.full(ids.shape, math.nan, device=x.device) if scored else None
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    lp = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if scored else None
    for sub, vals, idx in _cut(x, cfg, vocab, top, native=cfg.seed is None):
        chosen = idx[:, 0] if cfg.is_greedy else _draw_part(vals, idx, cfg.seed is not None, generator, vocab)
        for out, got in ((ids, chosen), (lp, _part_logprobs(vals, idx, chosen, vocab) if scored else None)):
            if out is None:
                continue
            if sub is None:
                out.copy_(got)
            else:
                out[sub] = got
    return ids, lp


def _draw_seeded_top_k(x: Tensor, cfg: SamplingConfig, gens: list[torch.Generator], vocab: Vocab,
                       scored: bool) -> tuple[Tensor, Tensor | None]:
    """Seeded rows [b,V_r] that share a top-k cut key, each with its own (seed, step) generator → ([b] ids, [b]
    logprobs or None): the ids `_draw_group` gives each row alone. The cut, the softmax and the race work row by
    row, and each row's noise comes from its own generator over its k candidates in id order, so one pass serves
    them all; rows whose cut keeps more than k (a tie at the k-th value: a width of their own) draw alone."""
    top_k = cfg._cut_key(vocab.size)[2]
    top = vocab.topk(x, top_k + 1)
    ids = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    lp = torch.empty(x.shape[0], dtype=torch.float32, device=x.device) if scored else None
    for sub, vals, idx in _cut(x, cfg, vocab, top, native=False):
        rows = list(range(x.shape[0])) if sub is None else sub.tolist()
        if vals.shape[1] != top_k:
            for r in rows:
                got = _draw_group(x[r:r + 1], cfg, gens[r], vocab, (top[0][r:r + 1], top[1][r:r + 1]), scored)
                ids[r] = got[0][0]
                if scored:
                    lp[r] = got[1][0]
            continue
        chosen = _draw_part(vals, idx, True, [gens[r] for r in rows], vocab)
        index = slice(None) if sub is None else sub
        ids[index] = chosen
        if scored:
            lp[index] = _part_logprobs(vals, idx, chosen, vocab)
    return ids, lp


# rows apart in the batch are copied together (one pass for them all) when their width is at most this: a screened
# round's candidates; whole rows of a large vocabulary cost more to copy (~1 ms for four of 262,144) than the
# separate passes save
_GATHER_MAX_WIDTH = 4096


def _draw_groups(x: Tensor, configs: list[SamplingConfig] | SamplingConfig, generator: torch.Generator | None,
                 steps: list[int] | None, vocab: Vocab, scored: bool) -> tuple[Tensor, Tensor | None]:
    """Steps 3-8 over the batch → ([B] ids, [B] processed logprobs of them or None). Rows that share a cut key
    are cut together; a seeded row draws with its own (seed, step) noise — rows that share a top-k cut share its
    partial sort and draw in one pass (`_draw_seeded_top_k`: each row's top k+1 is the same whether sorted
    alone or beside others, and a seeded draw orders its candidates by id), so the ids do not depend on the
    batch."""
    batch = x.shape[0]
    cfgs = [configs] * batch if isinstance(configs, SamplingConfig) else configs
    ids = torch.empty(batch, dtype=torch.long, device=x.device)
    lp = torch.empty(batch, dtype=torch.float32, device=x.device) if scored else None
    groups: dict[tuple, list[int]] = {}
    for r, c in enumerate(cfgs):
        groups.setdefault((c._cut_key(vocab.size), c.seed is not None and not c.is_greedy), []).append(r)

    def put(rows: list[int], got: tuple[Tensor, Tensor | None]) -> None:
        index = (slice(None) if len(rows) == batch else slice(rows[0], rows[0] + 1) if len(rows) == 1
                 else torch.tensor(rows, device=x.device))
        ids[index] = got[0]
        if scored:
            lp[index] = got[1]

    for (key, seeded), rows in groups.items():
        # rows side by side are read as one view; rows apart are copied together where they are narrow or draw
        # together (unseeded sampled rows share the generator): wide greedy and seeded rows apart are read in
        # place, one by one
        together = rows[-1] - rows[0] == len(rows) - 1
        joint = together or x.shape[1] <= _GATHER_MAX_WIDTH
        cfg = cfgs[rows[0]]
        if not joint and (cfg.is_greedy or seeded):
            for r in rows:
                gen = seeded_generator(cfgs[r].seed, steps[r], x.device) if seeded else generator
                one = vocab.topk(x[r:r + 1], key[2] + 1) if seeded and key[2] else None
                put([r], _draw_group(x[r:r + 1], cfgs[r], gen, vocab, one, scored))
            continue
        xs = x[rows[0]:rows[-1] + 1] if together else x[torch.tensor(rows, device=x.device)]
        if not seeded:
            put(rows, _draw_group(xs, cfg, generator, vocab, scored=scored))
        elif key[2]:
            gens = [seeded_generator(cfgs[r].seed, steps[r], x.device) for r in rows]
            put(rows, _draw_seeded_top_k(xs, cfg, gens, vocab, scored))
        else:  # top-p alone, min-p alone or no cut: each row's own draw
            for j, r in enumerate(rows):
                put([r], _draw_group(xs[j:j + 1], cfgs[r], seeded_generator(cfgs[r].seed, steps[r], x.device),
                                     vocab, scored=scored))
    return ids, lp


def sample(logits: Tensor, config: ConfigArg = None, generator: torch.Generator | None = None,
           prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0,
           step: int | Sequence[int] = 0, *, vocab: Vocab | None = None) -> Tensor:
    """Steps 1-8: [B,V] logits → [B] long token ids (a 0-d tensor for a [V] row).

    Greedy rows (temperature 0) take the argmax (the first one on ties). With top-k set only the [B,k]
    survivors are touched after ``torch.topk`` and drawn by the exponential race; rows with top-p alone draw
    by rejection from the whole row (``_top_p_draw``: no top-p set is computed) — but a few unseeded whole CPU
    rows whose set one C pass finds (a language model's rows) race over that set; other rows kept whole (no
    cut-off, min-p) draw by inverse CDF with one uniform per row.
    Rows without a seed draw from ``generator`` (or torch's default generator). A row whose config has a seed
    draws from a generator seeded with (seed, step), on its own, over its tokens in token-id order, so the id
    does not depend on the batch; ``step`` (int or one per row) is the position of the token being drawn.
    ``vocab`` as in ``process_logits`` (the ids are global)."""
    ids, _, one_row = _sample(logits, config, generator, prev_tokens, prompt_len, step, vocab, scored=False)
    return ids[0] if one_row else ids


def sample_with_logprobs(logits: Tensor, config: ConfigArg = None, generator: torch.Generator | None = None,
                         prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0,
                         step: int | Sequence[int] = 0) -> tuple[Tensor, Tensor]:
    """``sample`` and each drawn token's processed log-probability, ``chosen_logprobs`` of the ids, taken from
    the very cut the draw was made from (no second pass over the vocabulary). [B,V] logits → (ids [B] long,
    logprobs [B] float32); a [V] row → two 0-d tensors. The decode loop's step.

    The ids are ``sample``'s for the same seeds and generator state, except on unseeded rows with top-p alone
    that ``sample`` draws by rejection without finding the top-p set (rows C does not settle): here the set is
    found for the logprob and the draw is made from it — the same distribution, other ids for the same generator
    state (and so, in the same call, on the unseeded rows drawn after such a row from the same generator)."""
    ids, lp, one_row = _sample(logits, config, generator, prev_tokens, prompt_len, step, None, scored=True)
    missing = torch.isnan(lp)
    if bool(missing.any()):  # rows drawn without a cut (seeded, top-p alone): their kept set, found now
        rows = missing.nonzero().squeeze(1)
        x, configs, _, vocab = _preprocess(logits, config, prev_tokens, prompt_len)  # bias, penalties: once
        cfgs = [configs] * x.shape[0] if isinstance(configs, SamplingConfig) else configs
        lp[rows] = _chosen(x[rows], ids[rows], [cfgs[r] for r in rows.tolist()], vocab)
    return (ids[0], lp[0]) if one_row else (ids, lp)


def _sample(logits: Tensor, config: ConfigArg, generator: torch.Generator | None, prev_tokens: Any,
            prompt_len: int | Sequence[int], step: int | Sequence[int], vocab: Vocab | None,
            scored: bool) -> tuple[Tensor, Tensor | None, bool]:
    x, configs, one_row, vocab = _preprocess(logits, config, prev_tokens, prompt_len, vocab)
    batch = x.shape[0]
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    cfgs = [configs] if isinstance(configs, SamplingConfig) else configs
    steps = None
    if any(c.seed is not None for c in cfgs):
        steps = as_row_ints(step, batch, "step", torch.device("cpu")).tolist()
    if batch == 0:
        return (torch.empty(0, dtype=torch.long, device=x.device),
                torch.empty(0, device=x.device) if scored else None, one_row)
    ids, lp = _draw_groups(x, configs, generator, steps, vocab, scored)
    return ids, lp, one_row


# --- logprobs and entropy ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogProbs:
    """Log-probabilities of the chosen tokens, per row, raw and processed.

    raw = log_softmax of the logits as given; processed = log of ``probabilities`` (after bias, penalties,
    temperature and the cut-offs; -inf for a token the pipeline cut, and a greedy row is one-hot).

    token_ids          [B] long   the chosen tokens
    logprob            [B]        processed log-probability of the chosen token
    raw_logprob        [B]        raw log-probability of the chosen token
    rank               [B] long   raw rank: 1 + the number of tokens with a strictly greater raw logit
                                  (tied tokens share the best rank, e.g. 1, 2, 2, 4)
    top_ids            [B,n] long the n most likely tokens of the processed distribution (cut tokens, if
                                  n exceeds the kept set, follow by raw logit)
    top_logprobs       [B,n]      their processed log-probabilities (-inf for cut tokens)
    top_raw_logprobs   [B,n]      their raw log-probabilities
    raw_top_ids        [B,n] long the n most likely tokens of the raw distribution
    raw_top_logprobs   [B,n]      their raw log-probabilities
    """

    token_ids: Tensor
    logprob: Tensor
    raw_logprob: Tensor
    rank: Tensor
    top_ids: Tensor
    top_logprobs: Tensor
    top_raw_logprobs: Tensor
    raw_top_ids: Tensor
    raw_top_logprobs: Tensor

    def to_list(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per row (plain ints and floats); -inf log-probabilities become None."""
        def num(v: float) -> float | None:
            return v if math.isfinite(v) else None

        rows = []
        for b in range(self.token_ids.shape[0]):
            top = zip(self.top_ids[b].tolist(), self.top_logprobs[b].tolist(), self.top_raw_logprobs[b].tolist(),
                      strict=True)
            raw_top = zip(self.raw_top_ids[b].tolist(), self.raw_top_logprobs[b].tolist(), strict=True)
            rows.append({
                "token_id": int(self.token_ids[b]),
                "logprob": num(float(self.logprob[b])),
                "raw_logprob": num(float(self.raw_logprob[b])),
                "rank": int(self.rank[b]),
                "top": [{"token_id": i, "logprob": num(v), "raw_logprob": num(r)} for i, v, r in top],
                "raw_top": [{"token_id": i, "logprob": num(v)} for i, v in raw_top],
            })
        return rows


def logprobs(logits: Tensor, token_ids: Tensor | Sequence[int] | int, config: ConfigArg = None,
             top_n: int = 0, prev_tokens: Any = None, prompt_len: int | Sequence[int] = 0) -> LogProbs:
    """Raw and processed log-probabilities of ``token_ids`` [B] under [B,V] logits, with the top-n
    alternatives of each (top_n clamped to V). A [V] row is a batch of one (the fields keep the batch
    dimension). Same config / prev_tokens / prompt_len as ``process_logits``."""
    x, one_row = _check_logits(logits)
    batch, vocab = x.shape
    if not is_int(top_n) or top_n < 0:
        raise ValueError(f"top_n must be an int ≥ 0, got {top_n!r}")
    if isinstance(token_ids, Tensor):
        if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be integer ids, got {token_ids.dtype}")
        tok = token_ids.to(device=x.device, dtype=torch.long).reshape(-1)
    elif is_int(token_ids):
        tok = torch.tensor([token_ids], dtype=torch.long, device=x.device)
    elif isinstance(token_ids, Sequence) and all(is_int(t) for t in token_ids):
        tok = torch.tensor(list(token_ids), dtype=torch.long, device=x.device)
    else:
        raise TypeError(f"token_ids must be a LongTensor [B] or a list of ints, got {token_ids!r}")
    if tok.numel() != batch:
        raise ValueError(f"token_ids must hold one id per row ({batch}), got {tok.numel()}")
    if tok.numel() and (bool((tok < 0).any()) or bool((tok >= vocab).any())):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {tok.tolist()}")
    _check_values(x)
    raw = torch.log_softmax(x, dim=-1)
    processed = process_logits(logits, config, prev_tokens, prompt_len)  # the caller's shape: [V] or [B,V]
    processed = torch.log_softmax(processed.unsqueeze(0) if one_row else processed, dim=-1)
    col = tok.unsqueeze(1)
    n = min(top_n, vocab)
    # kept tokens by processed logprob, then cut ones by raw logprob (float64 keeps both orders exact)
    key = torch.where(torch.isfinite(processed), processed.double(), raw.double() - 1e6)
    top_ids = torch.topk(key, n, dim=-1).indices
    raw_top = torch.topk(raw, n, dim=-1)
    return LogProbs(
        token_ids=tok,
        logprob=processed.gather(1, col).squeeze(1),
        raw_logprob=raw.gather(1, col).squeeze(1),
        rank=1 + (x > x.gather(1, col)).sum(dim=-1),
        top_ids=top_ids,
        top_logprobs=processed.gather(1, top_ids),
        top_raw_logprobs=raw.gather(1, top_ids),
        raw_top_ids=raw_top.indices,
        raw_top_logprobs=raw_top.values,
    )


def chosen_logprobs(logits: Tensor, token_ids: Tensor, config: ConfigArg = None, prev_tokens: Any = None,
                    prompt_len: int | Sequence[int] = 0) -> Tensor:
    """The processed log-probability of each row's token: [B,V] logits, token_ids [B] long → [B] float32,
    equal to ``logprobs(...).logprob`` (log of ``probabilities``; -inf for a token the pipeline cut) but
    normalised over the pipeline's kept candidates where the cut has them (top-k rows, greedy picks: [b,k]
    values, no [B,V] temporary); rows kept whole (top-p without top-k, min-p, no cut) take a log-softmax over
    the row. Same config / prev_tokens / prompt_len as ``process_logits``. The decode loop's per-step score."""
    x, configs, _, vocab = _preprocess(logits, config, prev_tokens, prompt_len)
    tok = token_ids.to(device=x.device, dtype=torch.long).reshape(-1)
    if tok.shape[0] != x.shape[0]:
        raise ValueError(f"token_ids must hold one id per row ({x.shape[0]}), got {tok.shape[0]}")
    return _chosen(x, tok, configs, vocab)


def _chosen(x: Tensor, tok: Tensor, configs: list[SamplingConfig] | SamplingConfig, vocab: Vocab) -> Tensor:
    """`chosen_logprobs` on logits x [B,V_r] already through steps 1-2, ids tok [B]."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for rows, vals, idx, _ in _parts(x, configs, vocab):
        lp = _part_logprobs(vals, idx, tok if rows is None else tok[rows], vocab)
        if rows is None:
            out.copy_(lp)
        else:
            out[rows] = lp
    return out


def entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of softmax(logits) over the last dimension: [...,V] → [...] float32.
    -inf logits are tokens of probability 0 and contribute nothing (0 · log 0 = 0)."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor [..., V], got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V ≥ 1, got {tuple(logits.shape)}")
    x = logits.float()
    _check_values(x.reshape(-1, x.shape[-1]))
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)

"""What a step of the pipeline declares: its parameters with their checks, and the step itself.

A ``Param`` is one field of ``SamplingConfig``: its default, its check (a ValueError naming the field and its
range), the words of its range (``allowed``, shown by the server's schema and the CLI's help) and its kind (which
JSON / command-line type carries it). A ``Step`` is one unit of the chain (llama.cpp's ``llama_sampler_i``, vLLM's
``LogitsProcessor``): its parameters, when it is active, whether it leaves the argmax alone, whether it reads the
row's history or keeps state, which backends run it, how the explainer names a token it cut, and its torch
implementation on a whole row.

Backends: ``torch`` (the exact reference on whole rows: every step), ``c`` (``native.sample_row``'s one C call:
temperature, top-k, top-p, min-p), ``sharded`` (``distributed.ShardedVocab``: the steps whose reductions go
through ``Vocab``), ``batch`` (the vectorised torch path of ``cuts`` / ``draw``, which serves rows whose active
steps all declare it, in the default order).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lmhead.checks import is_int, is_real
from lmhead.sampling.vocab import NEG_INF


@dataclass(frozen=True)
class Param:
    """One field of SamplingConfig. ``check(value)`` → the normalised value, or a ValueError naming the field.

    kind: "float", "int", "ids" (token ids), "sequences" (token-id sequences), "bias" (id → float), "names" (step
    names), "seed". low / high: the numeric range (None where unbounded or not a number)."""

    name: str
    default: Any
    annotation: str
    kind: str
    allowed: str
    doc: str
    check: Callable[[Any], Any]
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()  # single values allowed outside [low, high] (llama.cpp's -1 = off)


def real_param(name: str, default: float, low: float, high: float, doc: str, off: str = "", *,
               low_open: bool = False, high_open: bool = False, also: Sequence[float] = ()) -> Param:
    """A float in [low, high] (open ends as asked; `also`: single values allowed besides, such as llama.cpp's -1
    for "off"). The message says the range and what turns the step off."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    extra = "".join(f" or {v:g}" for v in also)
    allowed = f"in {interval}{extra}" + (f" ({off})" if off else "")

    def check(value: Any) -> float:
        if is_real(value) and not math.isnan(value):
            v = float(value)
            inside = (low < v if low_open else low <= v) and (v < high if high_open else v <= high)
            if inside or v in also:
                return v
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

    return Param(name, float(default), "float", "float", allowed, doc, check, low, high, low_open, high_open,
                 tuple(also))


def int_param(name: str, default: int, low: int, high: int | None, doc: str, off: str = "",
              also: Sequence[int] = ()) -> Param:
    """An int in [low, high] (high None: unbounded; bool rejected; `also`: single values allowed besides)."""
    allowed = (f"an int ≥ {low}" if high is None else f"an int in [{low}, {high}]") + "".join(
        f" or {v}" for v in also) + (f" ({off})" if off else "")

    def check(value: Any) -> int:
        if is_int(value) and ((low <= value and (high is None or value <= high)) or value in also):
            return int(value)
        raise ValueError(f"{name} must be {allowed}, got {value!r}")

    return Param(name, default, "int", "int", allowed, doc, check, low, high, also=tuple(also))


def id_tuple(name: str, value: Any, what: str) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, set, frozenset, Tensor)):
        raise ValueError(f"{name} must be a sequence of token ids (int ≥ 0), got {value!r}")
    out = tuple(int(t) if isinstance(t, Tensor) else t for t in value)
    for tok in out:
        if not is_int(tok) or tok < 0:
            raise ValueError(f"{name} must hold {what} (int ≥ 0), got {tok!r}")
    return tuple(int(t) for t in out)


def ids_param(name: str, doc: str, default: tuple[int, ...] | None = ()) -> Param:
    """Token ids (int ≥ 0), stored as a tuple (None allowed when it is the default: "no restriction")."""
    def check(value: Any) -> tuple[int, ...] | None:
        if value is None and default is None:
            return None
        return id_tuple(name, value, "token ids")

    annotation = "tuple[int, ...]" + (" | None" if default is None else "")
    return Param(name, default, annotation, "ids", "token ids (int ≥ 0)", doc, check)


def sequences_param(name: str, doc: str) -> Param:
    """Non-empty sequences of token ids, stored as a tuple of tuples."""
    def check(value: Any) -> tuple[tuple[int, ...], ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ValueError(f"{name} must be a list of token-id sequences (each non-empty, ids int ≥ 0), "
                             f"got {value!r}")
        out = tuple(id_tuple(name, seq, "token-id sequences") for seq in value)
        if any(len(seq) == 0 for seq in out):
            raise ValueError(f"{name} must be a list of token-id sequences, each non-empty, got {value!r}")
        return out

    return Param(name, (), "tuple[tuple[int, ...], ...]", "sequences",
                 "token-id sequences (each non-empty, ids int ≥ 0)", doc, check)


@dataclass
class RowState:
    """The state a row's stateful steps keep from one token to the next (one object per generated sequence), as
    llama.cpp's ``llama_sampler_i`` keeps it in each sampler: a step reads it in ``apply``, moves it in ``accept``
    (``steps.accept``, after each drawn token), and the row's owner ``reset``s it (a new sequence) or ``clone``s it
    (a sequence that forks, such as the n choices of one prompt).

    mu: mirostat's target surprise bound μ (None until the first mirostat step: then 2·τ, as llama.cpp).
    history: what the steps that read the row's tokens keep of them (``HistoryRecord``s by step name: the
    penalties' counts, DRY's last tokens), made from the history at the step's first call and moved by ``accept``."""

    mu: float | None = None
    history: dict[str, HistoryRecord] = field(default_factory=dict)

    def reset(self) -> None:
        """Back to the state of a sequence's first token."""
        self.mu = None
        self.history = {}

    def clone(self) -> RowState:
        """An independent copy: the fork moves on its own from here."""
        return replace(self, history={name: record.clone() for name, record in self.history.items()})


@dataclass
class HistoryRecord:
    """What a step keeps of a row's tokens (llama.cpp's penalties sampler keeps its token counts so): ``length`` tokens
    taken in, the last of them ``last``, the first ``prompt_len`` of them the prompt. A step reads its record where
    it matches the history it is shown (as long, ending with the same token, the same prompt: its tokens were
    accepted one by one) and makes it again from the history where it does not (a first call, drafts taken in a
    verification, a token forced without a draw), so its numbers never depend on which happened."""

    length: int = 0
    last: int | None = None
    prompt_len: int = 0

    def matches(self, history: list[int], prompt_len: int) -> bool:
        return self.ends(len(history), history[-1] if history else None, prompt_len)

    def ends(self, length: int, last: int | None, prompt_len: int) -> bool:
        """Whether it matches a history of `length` tokens ending with `last` (None: empty), `prompt_len` the prompt."""
        return self.length == length and self.last == last and self.prompt_len == prompt_len

    def take(self, token: int) -> None:
        """One more token (accepted after a draw)."""
        self.length += 1
        self.last = token

    def clone(self) -> HistoryRecord:
        return replace(self)


@dataclass
class Context:
    """What a step sees of its row besides the logits: history [L] (the prompt first, then the generated
    tokens; plain ints), prompt_len (how many of them are the prompt), state (RowState), generator (the row's
    draw generator: a seeded row's (seed, step) one), xtc (for XTC: whether this draw's coin removes the top
    choices; None in `process_logits` / `probabilities`, where the pipeline mixes both outcomes)."""

    history: list[int] = field(default_factory=list)
    prompt_len: int = 0
    state: RowState = field(default_factory=RowState)
    generator: torch.Generator | None = None
    xtc: bool | None = None

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_len


@dataclass(frozen=True)
class Step:
    """One declared step of the chain.

    name        the step's name (in ``samplers`` and the explainer); aliases: other names accepted for it
                (llama.cpp's and transformers' spellings)
    params      the SamplingConfig fields it reads
    stage       1 masks, 2 penalties, 3 temperature, 4 cut-offs (greedy rows run stages 1-2 only)
    active      cfg → whether the step changes anything for this config (a disabled step costs nothing)
    argmax_invariant  the most probable token survives the step (a cut-off), so a greedy row may skip it
    history     reads the row's tokens so far; state: keeps a RowState between tokens
    backends    the backends that run it ("torch", "c", "sharded", "batch"; see the module docstring)
    explain     why the explainer says a token was cut by it
    apply       (x [1,V] float32, cfg, Context) → x [1,V], the exact implementation on a whole row (torch ops, and
                the float64 passes over the row of ``moments``, in C where the library is built)
    origin      the definition it follows (the reference implementation)
    accept      (cfg, RowState, token id, its processed log-probability) → None: what the step keeps moves after a
                chosen token (mirostat's μ; the penalties' and DRY's records of the row's tokens); None for a step
                that keeps nothing. ``state`` marks the steps whose state must move once a token (mirostat: a row
                with one takes no drafts); a record re-made where it does not match the history needs no such care
    after       where lmhead's order runs it: after this step (a step of stage 2-4 the order does not name yet)
    example     settings that turn it on (benchmarks/bench_sampling.py measures each step with them)
    rows        (x [n,V] float32, cfgs [n], Contexts [n]) → x [n,V]: the step once over rows that all run it, its
                parameters read as per-row tensors (``param_rows``), each row's values the bits ``apply`` gives it
                alone; None: ``apply`` row by row (a step whose backend is a pass per row, such as the moments' C
                passes)"""

    name: str
    params: tuple[str, ...]
    stage: int
    active: Callable[[Any], bool]
    argmax_invariant: bool
    explain: str
    apply: Callable[[Tensor, Any, Context], Tensor]
    origin: str
    backends: frozenset[str] = frozenset({"torch"})
    history: bool = False
    state: bool = False
    aliases: tuple[str, ...] = ()
    after: str | None = None
    example: tuple[tuple[str, Any], ...] = ()
    accept: Callable[[Any, RowState, int, float], None] | None = None
    rows: Callable[[Tensor, Sequence[Any], Sequence[Context]], Tensor] | None = None


def param_rows(cfgs: Sequence[Any], name: str, like: Tensor) -> float | Tensor:
    """One parameter of each row's config as a column [n,1] float32 on `like`'s device: what a step's ``rows`` reads
    in place of a number (a float32 column divides, multiplies and compares as the number itself does); the number
    itself where the rows share it."""
    values = [float(getattr(c, name)) for c in cfgs]
    if values.count(values[0]) == len(values):
        return values[0]
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]


def rows_apply(step: Step, x: Tensor, cfgs: Sequence[Any], ctxs: Sequence[Context]) -> Tensor:
    """`step` on rows x [n,V] that all run it: its ``rows`` once, or ``apply`` on each row."""
    if step.rows is not None:
        return step.rows(x, cfgs, ctxs)
    if x.shape[0] == 1:
        return step.apply(x, cfgs[0], ctxs[0])
    return torch.cat([step.apply(x[r:r + 1], cfgs[r], ctxs[r]) for r in range(x.shape[0])])


def subtract_at(x: Tensor, per_row: list[tuple[list[int], list[float]]]) -> Tensor:
    """x [n,V] less each row's values at its ids (row r: (ids, values)), in one indexed write; x itself where none."""
    rows = [r for r, (ids, _) in enumerate(per_row) for _ in ids]
    if not rows:
        return x
    cols = [i for ids, _ in per_row for i in ids]
    vals = torch.tensor([v for _, vs in per_row for v in vs], dtype=torch.float32, device=x.device)
    x = x.clone()
    index = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
    x[index] = x[index] - vals
    return x


def ban_at(x: Tensor, per_row: list[list[int]]) -> Tensor:
    """x [n,V] with each row's ids at -inf, in one indexed write; x itself where none."""
    rows = [r for r, ids in enumerate(per_row) for _ in ids]
    if not rows:
        return x
    x = x.clone()
    x[torch.tensor(rows, device=x.device), torch.tensor([i for ids in per_row for i in ids], device=x.device)] = NEG_INF
    return x

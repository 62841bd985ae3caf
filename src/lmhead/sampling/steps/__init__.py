"""The declared steps of the pipeline and the orders they run in.

Every step lives in one module of this package with its ``Param``s and its ``Step`` (``base``). Everything else is
derived from them: ``SamplingConfig``'s fields and checks (``lmhead.sampling.config``), the server's request fields
and the CLI's flags (``params_for_schema``), the explainer's reasons, the fast-path eligibility (``runs_on``) and the
sharded sampler's refusal of a step it cannot run.

The order (``samplers``): the masks (stage 1) run first always; stages 2-4 run in lmhead's order (below), a named
preset (``PRESETS``: llama.cpp's default chain, transformers' order) or a list of step names (llama.cpp's and
transformers' names accepted, ``canonical``). As in llama.cpp, a step left out of a given list does not run, and
with ``mirostat`` on the chain is the masks, the temperature and mirostat (llama.cpp's rule: the penalties, DRY and
other cut-offs are not applied). A greedy row (temperature 0) runs stages 1-2 and takes the argmax.

lmhead's order: penalties → DRY → no-repeat n-grams → temperature (or dynamic temperature) → top-k → typical-p →
top-p → min-p → top-nσ → XTC → epsilon → eta, and each step a module adds placed after its `after` step (top-a
after min-p). For today's settings that is transformers' order (temperature →
top-k → top-p → min-p).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any

from lmhead.sampling.steps.base import Context, Param, RowState, Step

__all__ = ["ENTRY_FIELDS", "LEGACY_FIELDS", "ORDER", "PARAMS", "PRESETS", "STEPS", "Context", "Param", "RowState",
           "Step", "accept", "canonical", "chain", "describe", "order_of", "runs_on", "step"]

# every module of this package that declares STEPS and PARAMS: a new step is one new module here
_MODULES = tuple(importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
                 if m.name != "base")
_MODULES = tuple(m for m in _MODULES if hasattr(m, "STEPS"))
STEPS: dict[str, Step] = {s.name: s for m in _MODULES for s in m.STEPS}
# the steps "temperature" names in an order: dynamic temperature takes the division's place
_GROUPS = {"temperature": ("temperature", "dynatemp")}
MASKS = tuple(name for name, s in STEPS.items() if s.stage == 1)
_ORDER = ("penalties", "dry", "no_repeat_ngram", "temperature", "top_k", "typical_p", "top_p", "min_p",
          "top_n_sigma", "xtc", "epsilon", "eta")


def _with_new_steps(order: tuple[str, ...]) -> tuple[str, ...]:
    """lmhead's order with each declared step it does not name yet placed after its `after` step."""
    out = list(order)
    pending = [s for s in STEPS.values() if s.stage >= 2 and s.name not in out and s.name not in
               ("dynatemp", "mirostat")]
    while pending:
        placed = [s for s in pending if s.after in out]
        if not placed:
            raise ValueError(f"steps {[s.name for s in pending]}: `after` names no step of the order")
        for s in placed:
            out.insert(out.index(s.after) + 1, s.name)
            pending.remove(s)
    return tuple(out)


ORDER = _with_new_steps(_ORDER)
PRESETS: dict[str, tuple[str, ...] | None] = {
    "lmhead": None,
    # common/common.h's default `samplers` (temperature last)
    "llama.cpp": ("penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature"),
    # generation/utils.py `_get_logits_processor`: processors, then the warpers in this order
    "transformers": ("penalties", "no_repeat_ngram", "temperature", "top_k", "top_p", "min_p", "typical_p",
                     "epsilon", "eta"),
}
_ALIASES = {a: s.name for s in STEPS.values() for a in (s.name, *s.aliases)}
ORDERABLE = tuple(n for n in ORDER if n in STEPS) + ("dynatemp",)


def canonical(name: str) -> str:
    """A step's name as lmhead spells it, from its own or an alias (llama.cpp's ``typ_p``, ``temp``, ``top-k``...;
    case and - / _ ignored). ValueError naming `samplers` for a name that is no orderable step."""
    key = name.strip().lower()
    for k in (key, key.replace("-", "_")):
        if k in _ALIASES and _ALIASES[k] in ORDERABLE:
            return _ALIASES[k]
    raise ValueError(f"samplers: {name!r} is not a step that can be ordered; the names are "
                     f"{', '.join(ORDER)} (and their llama.cpp / transformers spellings), or a preset: "
                     f"{', '.join(PRESETS)}")


def _check_samplers(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value in PRESETS:
            return PRESETS[value]
        value = [v for v in value.replace(",", ";").split(";") if v.strip()]  # llama.cpp's --samplers a;b;c
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"samplers must be a preset ({', '.join(PRESETS)}) or a list of step names, got {value!r}")
    names = tuple(canonical(v) for v in value)
    if len(set(names)) != len(names):
        raise ValueError(f"samplers must name each step once, got {list(value)!r}")
    return names


def _check_seed(value: Any) -> int | None:
    from lmhead.checks import is_int

    if value is not None and not is_int(value):
        raise ValueError(f"seed must be an int or None, got {value!r}")
    return value


SEED = Param("seed", None, "int | None", "seed", "an int or None", "with a seed, a row's draw depends only on "
             "(seed, step).", _check_seed)
SAMPLERS = Param("samplers", None, "tuple[str, ...] | None", "names",
                 f"a preset ({', '.join(PRESETS)}) or a list of step names",
                 "the order of stages 2-4 (see lmhead.sampling.steps); None = lmhead's.", _check_samplers)
# parameters in pipeline order of their modules (masks, penalties, temperature, cut-offs, mirostat, then others)
_FIRST = ("masks", "penalties", "temperature", "cutoffs", "mirostat")
_BY_PLACE = sorted(_MODULES, key=lambda m: (_FIRST.index(m.__name__.rsplit(".", 1)[1])
                                            if m.__name__.rsplit(".", 1)[1] in _FIRST else len(_FIRST)))
PARAMS: dict[str, Param] = {p.name: p for m in _BY_PLACE for p in m.PARAMS}
PARAMS["seed"] = SEED
PARAMS["samplers"] = SAMPLERS
# SamplingConfig's positional order: the fields it had first keep their places
FIELD_ORDER = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "logit_bias", "banned_tokens", "seed",
               *(n for n in PARAMS if n not in {"temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                 "presence_penalty", "frequency_penalty", "logit_bias",
                                                 "banned_tokens", "seed"}))


# the fields every entry point took before the steps declared themselves; the others (ENTRY_FIELDS) reach the
# server's requests and the CLI's flags from their declarations
LEGACY_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "banned_tokens", "seed")
ENTRY_FIELDS = tuple(p for n, p in PARAMS.items() if n not in LEGACY_FIELDS)


def step(name: str) -> Step:
    return STEPS[name]


def order_of(cfg: Any) -> tuple[str, ...]:
    """The names of the steps cfg's order holds, the masks first, whether cfg runs them or not: rows of one order
    run each of its steps in turn over the batch (``lmhead.sampling.general``)."""
    if cfg.mirostat:
        order: Sequence[str] = ("temperature", "mirostat")
    else:
        order = ORDER if cfg.samplers is None else cfg.samplers
    return (*MASKS, *(n for o in order for n in _GROUPS.get(o, (o,))))


def chain(cfg: Any) -> list[Step]:
    """The steps that run for cfg, in order, active ones only (a disabled step costs nothing)."""
    from lmhead.sampling.inputs import once_per  # a config is frozen: its chain is found once per config object

    return list(once_per("chain", cfg, _chain, 4096))


def _chain(cfg: Any) -> tuple[Step, ...]:
    steps = [STEPS[n] for n in order_of(cfg)]
    if cfg.is_greedy:
        steps = [s for s in steps if s.stage <= 2]
    return tuple(s for s in steps if s.active(cfg))


def accept(cfg: Any, state: RowState, token: int, logprob: float) -> None:
    """After a drawn `token` (its processed log-probability `logprob`, natural log): each step of cfg's chain that
    keeps state moves it (``Step.accept``; llama.cpp's ``llama_sampler_accept``), in chain order."""
    for s in chain(cfg):
        if s.accept is not None:
            s.accept(cfg, state, token, logprob)


def runs_on(cfg: Any, backend: str) -> bool:
    """Whether every step cfg runs declares `backend` and the order is lmhead's (where the batch and C paths keep
    theirs): "batch" — the vectorised torch path; "c" — native.sample_row (no masks or penalties either, which C
    does not apply); "sharded" — distributed.ShardedVocab."""
    if backend != "sharded" and (cfg.samplers is not None or cfg.mirostat):
        return False
    return all(backend in s.backends for s in chain(cfg))


def _json(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_json(v) for v in value]
    return value


def describe(params: Sequence[str] | None = None) -> dict[str, Any]:
    """The declarations as JSON-ready data, for a client that runs its own copy of the chain (the explainer page
    builds its controls and its pipeline from them): every step in the order `chain` lists them (name, stage, its
    parameters, aliases, the explainer's reason, origin, whether it reads the history, keeps state or leaves the
    argmax alone), each parameter (kind, default, range and its words, doc), lmhead's order, the masks, the steps
    an order's name stands for (``groups``), the presets and the names an order may hold. ``params``: only these
    parameters (those a client's requests accept); None: all."""
    names = [*MASKS, *(n for o in ORDER for n in _GROUPS.get(o, (o,))), "mirostat"]
    keep = set(PARAMS if params is None else params)
    steps = [{"name": s.name, "stage": s.stage, "params": [p for p in s.params if p in keep],
              "aliases": list(s.aliases), "explain": s.explain, "origin": s.origin, "history": s.history,
              "state": s.state, "argmax_invariant": s.argmax_invariant}
             for s in (STEPS[n] for n in dict.fromkeys(names) if n in STEPS)]
    fields = {p.name: {"kind": p.kind, "default": _json(p.default), "low": p.low, "high": p.high,
                       "low_open": p.low_open, "high_open": p.high_open, "also": list(p.also), "allowed": p.allowed,
                       "doc": p.doc} for p in PARAMS.values() if p.name in keep}
    return {"steps": steps, "params": fields, "order": list(ORDER), "masks": list(MASKS),
            "groups": {k: list(v) for k, v in _GROUPS.items()}, "orderable": list(ORDERABLE),
            "presets": {k: None if v is None else list(v) for k, v in PRESETS.items()}}

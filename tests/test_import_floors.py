"""The package's floors (FLOORS below): no module of src/lmhead imports a module of a higher floor, and no two
modules import each other, read from the source with `ast` (imports inside functions count: they run too).

    ground → kernels → head → models → sampling/decode → speculative → explain/generate → server/cli

A module's floor is that of the longest prefix in FLOORS naming it; `from lmhead.x import y` names lmhead.x.y where
that is a module, else lmhead.x. The package itself (`lmhead/__init__.py`) imports nothing at import time: `from
lmhead import name` names the module its public API re-exports `name` from (`_EXPORTS`), and `import lmhead` or
`from lmhead import __version__` the package, on the ground floor. Imports under `if TYPE_CHECKING:` do not run and
are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# lowest first; a module may import its own floor and the ones below it
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("lmhead", "lmhead.checks", "lmhead.params", "lmhead.models.errors", "lmhead.models.cache",
                "lmhead.data")),
    ("kernels", ("lmhead.kernels",)),
    ("head", ("lmhead.head", "lmhead.loss", "lmhead.compressed")),
    ("models", ("lmhead.models",)),
    ("sampling/decode", ("lmhead.sampling", "lmhead.constrain", "lmhead.decode", "lmhead.prefix_cache",
                         "lmhead.distributed", "lmhead.heads")),
    ("speculative", ("lmhead.speculative",)),
    ("explain/generate", ("lmhead.explain", "lmhead.explain_charts", "lmhead._explain_display", "lmhead.generate",
                          "lmhead.conversation", "lmhead.prompt_scores", "lmhead.integrations", "lmhead.api",
                          "lmhead.explain_swap", "lmhead.machine")),
    ("server/cli", ("lmhead.server", "lmhead.cli")),
]

# what the source still does against the rule, each to be fixed (then dropped here: the tests check the list is exact)
KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_MUTUAL: set[tuple[str, str]] = set()


def _exports() -> dict[str, str]:
    """The public API's re-exports: name → the module that defines it (`lmhead/__init__.py`'s `_EXPORTS`)."""
    tree = ast.parse((SRC / "lmhead" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_EXPORTS":
            return {k: f"lmhead.{v}" for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("lmhead/__init__.py has no _EXPORTS")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "lmhead").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
EXPORTS = _exports()


def floor_of(module: str) -> int:
    best, floor = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), i
    assert floor is not None, f"{module} is on no floor: add it to FLOORS"
    return floor


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(module: str) -> set[str]:
    """The lmhead modules `module` imports (itself excluded)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else
                     EXPORTS.get(a.name, base) if base == "lmhead" else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import lmhead.x.y` of a name that is no module: its module
                name = name.rpartition(".")[0]
            if name.startswith("lmhead") and name != module:
                found.add(name)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_is_on_a_floor():
    for m in MODULES:
        floor_of(m)


def test_no_module_imports_a_higher_floor():
    upward = {(m, t) for m, targets in GRAPH.items() for t in targets if floor_of(t) > floor_of(m)}
    assert sorted(f"{m} ({FLOORS[floor_of(m)][0]}) imports {t} ({FLOORS[floor_of(t)][0]})"
                  for m, t in upward - KNOWN_UPWARD) == []
    assert sorted(KNOWN_UPWARD - upward) == []  # fixed: drop it from KNOWN_UPWARD


def test_no_two_modules_import_each_other():
    # a package's __init__ re-exporting its submodules, which import their siblings through the package's name,
    # is one module's parts, not two modules
    def one_package(a: str, b: str) -> bool:
        return MODULES[a].name == "__init__.py" and b.startswith(a + ".") or \
            MODULES[b].name == "__init__.py" and a.startswith(b + ".")

    mutual = {(a, b) for a, targets in GRAPH.items() for b in targets
              if a < b and a in GRAPH[b] and not one_package(a, b)}
    assert sorted(f"{a} <-> {b}" for a, b in mutual - KNOWN_MUTUAL) == []
    assert sorted(KNOWN_MUTUAL - mutual) == []  # fixed: drop it from KNOWN_MUTUAL


@pytest.mark.parametrize("source, expected", [
    ("from lmhead import checks", {"lmhead.checks"}),
    ("from lmhead import SamplingConfig, __version__", {"lmhead.sampling", "lmhead"}),
    ("import lmhead", {"lmhead"}),
    ("from lmhead.kernels import native", {"lmhead.kernels.native"}),
    ("from lmhead.decode.rows import Row", {"lmhead.decode.rows"}),
    ("import lmhead.decode.engine as engine", {"lmhead.decode.engine"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lmhead.generate import Batch", set()),
])
def test_imports_are_read_as_the_modules_they_name(tmp_path, monkeypatch, source, expected):
    path = tmp_path / "probe.py"
    path.write_text(source + "\n")
    monkeypatch.setitem(MODULES, "lmhead.probe", path)
    assert imports_of("lmhead.probe") == expected

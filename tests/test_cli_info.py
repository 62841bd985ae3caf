"""`lmhead info`: the machine, the kernels' paths, the cache and the models, as lines and as one JSON object."""

from __future__ import annotations

import json

import pytest

from lmhead.cli import main
from lmhead.kernels import native, paths


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_json_names_the_cpu_the_kernels_path_each_kind_takes_the_cache_and_the_models(capsys, tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("LMHEAD_CACHE", str(tmp_path / "cache"))
    code, out, _ = _run(capsys, "info", "--json")
    facts = json.loads(out)
    assert code == 0 and out.count("\n") == 1
    assert set(facts) == {"lmhead", "python", "torch", "threads", "cpu", "kernels", "weights", "cache", "models"}
    assert facts["cpu"]["cores"] >= 1 and set(facts["cpu"]["features"]) >= {"AVX2", "AVX-512 VNNI", "AMX int8"}
    assert facts["cache"]["folder"] == str(tmp_path / "cache")
    assert set(facts["models"]) == {"gemma-3-270m", "smollm2-135m"}
    kernels = facts["kernels"]
    if native.library() is None:
        assert kernels["available"] is False and kernels["why"]
    else:  # the path this process's products take, as chosen when the library loaded
        assert kernels["available"] is True and kernels["products"] == paths.describe()
        assert kernels["paths"] == {kind: v for kind, v in paths.chosen().items() if isinstance(v, dict)}


def test_info_lines_say_which_path_the_products_take(capsys):
    code, out, err = _run(capsys, "info")
    assert code == 0 and "Traceback" not in err
    lines = out.splitlines()
    assert lines[0].startswith("lmhead ") and lines[1].startswith("CPU ")
    assert any(line.startswith("kernels ") for line in lines) and any(line.startswith("cache ") for line in lines)
    if native.library() is not None:
        assert any(line.startswith("products ") and paths.describe() in line for line in lines)


def test_info_without_the_kernels_says_why_and_what_runs_instead(capsys, monkeypatch):
    monkeypatch.setenv("LMHEAD_NATIVE", "0")
    code, out, _ = _run(capsys, "info")
    assert code == 0
    kernels = next(line for line in out.splitlines() if line.startswith("kernels "))
    assert "not running" in kernels and "LMHEAD_NATIVE=0" in kernels and "float32" in kernels


def test_info_says_which_pages_a_load_puts_its_matrices_on(capsys, monkeypatch):
    from lmhead.models import huge_pages

    code, out, _ = _run(capsys, "info")
    (line,) = [line for line in out.splitlines() if line.startswith("weights ")]
    assert code == 0 and ("2 MiB pages" in line) == huge_pages.available()
    monkeypatch.setenv("LMHEAD_HUGE_PAGES", "0")
    code, out, _ = _run(capsys, "info", "--json")
    assert code == 0 and json.loads(out)["weights"] == "on 4 KiB pages (LMHEAD_HUGE_PAGES=0)"


@pytest.mark.parametrize("argv", [["info", "--bogus"], ["info", "extra"]])
def test_info_with_an_unknown_argument_is_one_line_and_exit_2(capsys, argv):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("lmhead") and "Traceback" not in err

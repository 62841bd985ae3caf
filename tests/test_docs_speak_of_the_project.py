"""The project speaks of itself — commits, releases, dates, machines — never of the rounds of work that wrote it.

A line such as "Fourteenth session's run", "measured in this session" or "26.8 / 58.3 (fifth …)" tells a reader
nothing they can check; a commit, a date and a machine do. Every text file under README.md, docs/, src/,
benchmarks/ and examples/ is read, one folder per test.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth")
ROUND = re.compile(
    r"\bsessions?\b|\bsessions'"                           # "fourteenth session", "this session", "sessions' runs"
    r"|\brounds? of work\b"
    # "(fourth)", "(fifth …)", "(seventh, slow phase)"
    rf"|(?<![\w.])\((?:{ORDINALS})(?:\)|\s*…|, (?:slow|fast|quiet|load|in))"
    rf"|\b(?:{ORDINALS})\s+(?:sitting|sprint)s?\b",
    re.I)
SUFFIXES = {".md", ".py", ".c", ".h", ".js", ".html", ".css", ".sh", ".txt", ".toml", ".json"}


def files(where: str) -> list[Path]:
    path = ROOT / where
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                  and "__pycache__" not in p.parts and "results" not in p.relative_to(path).parts[:1])


def hits(where: str) -> list[str]:
    found = []
    for path in files(where):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if ROUND.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:140]}")
    return found


def test_the_pattern_finds_the_ways_a_round_of_work_gets_named():
    named = ["Fourteenth session (bf26fe6)", "the tenth session's run", "Earlier releases: 26.8 (fifth …)",
             "13.8 / 11.8 (fourth) greedy", "(seventh, slow phase)", "measured in this session", "over the last "
             "five sessions", "an earlier session on another machine"]
    plain = ["a server round joins rows", "the first run of a new GGUF converts it", "(first maximum; a NaN)",
             "a fourth matmul per chunk", "commit bf26fe6, 2026-12-02, AMD EPYC family 23 model 1",
             "for s in range(first, t, chunk):", "if len(first) == n:", "out of the first iteration"]
    assert [t for t in named if not ROUND.search(t)] == []
    assert [t for t in plain if ROUND.search(t)] == []


@pytest.mark.parametrize("where", ["README.md", "docs", "benchmarks", "examples"])
def test_readme_docs_benchmarks_and_examples_name_no_round_of_work(where):
    assert hits(where) == []


def test_source_names_no_round_of_work():
    assert hits("src") == []

"""Render the README's and docs' result tables from the records the benchmarks wrote (`make results`).

A table in README.md or docs/*.md is a marked block:

    <!-- results:sampling:top_k_top_p -->
    (everything here is replaced)
    <!-- /results -->

and becomes, for each machine kind that benchmarks/results/sampling.json holds a `top_k_top_p` record of (the
current kind first: that of the newest record of all), the record's title, a line naming the command, commit,
date, machine and load, and the cells exactly as the benchmark printed them. A record from another machine kind
than the current one says so in that line. It is an error — nothing is written — when a marked block names a record that
does not exist, when a record's row lacks a cell, or when a line outside the marked blocks quotes a timing
(tokens/s, ms, µs, GB/s, or a speed-up such as 1.08×): every such figure must be one a benchmark printed.

A block opened as `<!-- results:sampling:top_k_top_p:current -->` keeps the table's newest record alone (the
README's one current table per area).

    python benchmarks/render.py            # rewrite the blocks in place
    python benchmarks/render.py --check    # exit 1 if a block is stale or a figure is unbacked; write nothing
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS, ROOT, machine, machine_kind  # noqa: E402

BLOCK = re.compile(r"(<!-- results:(?P<area>[\w-]+):(?P<table>[\w.-]+)(?::(?P<current>current))? -->\n)(?P<body>.*?)"
                   r"(?P<end><!-- /results -->)", re.S)
OPEN = re.compile(r"<!-- results:")
# What a benchmark measures (rates, times, bandwidth, speed-ups): such a figure may only appear inside a block.
TIMING = re.compile(r"\d(?:[\d,]*\.?\d*)\s*(?:tok/s|tokens/s|ms\b|µs\b|GB/s)|\d\.\d+\s*[×x](?![\w\d])")


class RenderError(Exception):
    """A table that cannot be rendered from records, or a figure no record backs."""


@dataclass
class Page:
    path: Path
    text: str


def load_records(folder: Path, area: str) -> dict:
    path = folder / f"{area}.json"
    if not path.exists():
        raise RenderError(f"no record for area {area!r}: {path.name} is missing (run the benchmark that writes it)")
    return json.loads(path.read_text())


def _size(n: int | None) -> str:
    return f"{n >> 20} MiB L3" if n else "L3 unknown"


def caption(record: dict, now_kind: str) -> str:
    m = record["machine"]
    kind = machine_kind(m)
    sha = (record.get("commit") or "unknown")[:10] + (" + local changes" if record.get("dirty") else "")
    load = record.get("load_average", {})
    start, end = load.get("start") or ["?"], load.get("end") or ["?"]
    bw = f"{m['read_gbs']} GB/s read" if m.get("read_gbs") else "read bandwidth not measured"
    line = (f"`{record['command']}` · commit {sha} · {record['date'][:10]} · {m['cpu']} ({kind}; "
            f"{' '.join(m.get('flags') or []) or 'no AVX2'}), {m.get('cores')} cores, {_size(m.get('l3_bytes'))}, "
            f"{bw} · load average {start[0]} → {end[0]}")
    if m.get("paths"):
        line += f" · {m['paths']}"
    busy = [x for x in (start[0], end[0]) if isinstance(x, (int, float))]
    if busy and m.get("cores") and max(busy) > m["cores"]:
        line += f" · **load above the {m['cores']} cores**: other processes shared the CPU, timings are slow"
    if kind != now_kind:
        line += f" · **another machine kind** than the newest records' ({now_kind})"
    return line


def table_markdown(name: str, record: dict) -> list[str]:
    columns = record.get("columns") or []
    if not record.get("rows"):
        raise RenderError(f"record {name!r} has no rows")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for i, row in enumerate(record["rows"]):
        if len(row) != len(columns) or any(cell == "" for cell in row):
            raise RenderError(f"record {name!r}, row {i + 1}: a cell has no value ({row})")
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    return lines


def render_block(area: str, table: str, folder: Path, now_kind: str, current: bool = False) -> str:
    data = load_records(folder, area)
    kinds = data.get("tables", {}).get(table)
    if not kinds:
        raise RenderError(f"no record for table {area}:{table} in {area}.json")
    order = sorted(kinds, key=lambda k: (k != now_kind, k))  # the current kind first, then the others
    if current:  # a `:current` block: the newest record of the table alone
        order = [max(kinds, key=lambda k: kinds[k]["date"])]
    out: list[str] = []
    for kind in order:
        record = kinds[kind]
        out += [f"**{record['title']}**", "", caption(record, now_kind), "", *table_markdown(table, record)]
        if record.get("notes"):
            out += [""] + [f"{note}  " for note in record["notes"]]
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def unbacked(text: str) -> list[tuple[int, str]]:
    """Lines outside the marked blocks that quote a timing figure, with their line numbers."""
    spans = [(m.start(), m.end()) for m in BLOCK.finditer(text)]
    found = []
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        inside = any(a <= offset < b for a, b in spans)
        if not inside and TIMING.search(line) and "<!-- results:" not in line:
            found.append((number, line.rstrip("\n")))
        offset += len(line)
    return found


def render_text(text: str, folder: Path, now_kind: str, where: str = "") -> str:
    if len(OPEN.findall(text)) != len(BLOCK.findall(text)):
        raise RenderError(f"{where}: a `<!-- results:area:table -->` marker without its `<!-- /results -->`")

    def replace(m: re.Match) -> str:
        try:
            return m.group(1) + render_block(m["area"], m["table"], folder, now_kind, bool(m["current"])) + m["end"]
        except RenderError as e:
            raise RenderError(f"{where}: {e}") from None

    return BLOCK.sub(replace, text)


def pages(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def current_kind(folder: Path) -> str | None:
    """The machine kind of the newest record: the kind the project measures on now (not the renderer's host,
    so that a page renders the same wherever `make results` runs)."""
    newest: tuple[str, str] | None = None
    for path in folder.glob("*.json"):
        for kinds in json.loads(path.read_text()).get("tables", {}).values():
            for kind, record in kinds.items():
                if newest is None or record["date"] > newest[0]:
                    newest = (record["date"], kind)
    return newest[1] if newest else None


def render_all(root: Path = ROOT, folder: Path = RESULTS, now_kind: str | None = None) -> list[Page]:
    """Every page rendered, or RenderError listing every problem found (nothing is written on error)."""
    now_kind = now_kind or current_kind(folder) or machine_kind(machine(bandwidth=False))
    problems: list[str] = []
    out: list[Page] = []
    for path in pages(root):
        where = str(path.relative_to(root))
        text = path.read_text()
        problems += [f"{where}:{n}: a timing no record backs (put it in a results block): {line.strip()}"
                     for n, line in unbacked(text)]
        try:
            out.append(Page(path, render_text(text, folder, now_kind, where)))
        except RenderError as e:
            problems.append(str(e))
    if problems:
        raise RenderError("\n".join(problems))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page would change")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the records' folder")
    args = ap.parse_args(argv)
    try:
        rendered = render_all(folder=args.results)
    except RenderError as e:
        print(e, file=sys.stderr)
        return 1
    stale = [p for p in rendered if p.path.read_text() != p.text]
    if args.check:
        for p in stale:
            print(f"{p.path.relative_to(ROOT)}: tables differ from the records (run `make results`)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.path.write_text(p.text)
        print(f"rendered {p.path.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

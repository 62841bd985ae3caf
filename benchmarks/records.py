"""The benchmarks' result records: every script in benchmarks/ writes the tables it prints as JSON here.

A record is one printed table with what it needs to be read later: the command that printed it, the commit
(`git rev-parse HEAD`, and whether the tree had changes), the date, the machine (CPU model name, /proc/cpuinfo
vendor/family/model, the SIMD flags that decide which kernels run, cores, L3, a read bandwidth measured in the
same run) and the load average at its start and end. Its rows are the cells exactly as the script printed them,
and each figure also as numbers: its value, its baseline's name and value, and their ratio.

    rec = Recorder("sampling")                       # one per run of a script; measures the machine once
    t = rec.table("top_k_top_p", "T=0.8, top-k=50, top-p=0.9", ["B", "V", "lmhead ms", "hf ms", "hf/lmhead"])
    t.row(["1", "49152", "0.41", "6.36", "15.5×"],
          [Figure("lmhead sample, B=1 V=49152", 0.41, "ms", "hf warpers + multinomial", 6.36)])
    rec.write()                                      # benchmarks/results/sampling.json

`benchmarks/results/<area>.json` keeps, per table, the latest record of each machine kind (vendor, family,
model): a new run replaces that kind's old one rather than adding to it, and the figures of other kinds stay
beside it. `benchmarks/render.py` turns them into the README's and docs' tables.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Figure:
    """One measured number beside its baseline, measured side by side; ratio = baseline / value unless given."""

    what: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if self.ratio is None and self.baseline_value is not None and self.value:
            self.ratio = self.baseline_value / self.value


@dataclass
class Table:
    """The cells a script printed (strings, as printed) and the figures behind them."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, cells: list[object], figures: list[Figure] | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title!r}: a row of {len(cells)} cells for {len(self.columns)} columns")
        row = [str(c).strip() for c in cells]
        if "" in row or any(c is None for c in cells):  # a cell that does not apply is "-", never left blank
            raise ValueError(f"{self.title!r}: an empty cell in {row}")
        self.rows.append(row)
        self.figures.extend(figures or [])

    def note(self, text: str) -> None:
        """A line printed under the table (a check's outcome, a skipped size) that belongs with it."""
        self.notes.append(text)


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float | None:
    """Read bandwidth: a float32 tensor far larger than any L3 summed on torch's threads (median of repeats)."""
    try:
        import torch
    except ImportError:
        return None
    x = torch.ones(mib * (1 << 20) // 4)
    x.sum()  # pages touched, threads started
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    times.sort()
    return round(x.numel() * 4 / times[len(times) // 2] / 1e9, 1)


def machine(bandwidth: bool = True) -> dict:
    """What a figure depends on: the CPU's kind and flags, its cores and L3, and its measured read bandwidth."""
    from lmhead.machine import cpu

    c = cpu()
    return {
        "cpu": c["name"],
        "vendor": c["vendor"],
        "family": c["family"],
        "model": c["model"],
        "flags": c["flags"],
        "cores": os.cpu_count(),
        "l3_bytes": c["l3_bytes"],
        "read_gbs": read_bandwidth_gbs() if bandwidth else None,
        "paths": kernel_paths(),
    }


def kernel_paths() -> str | None:
    """Which path the kernels' products take on this machine and why (kernels/paths.py), None without them."""
    try:
        from lmhead.kernels import native, paths
    except ImportError:
        return None
    return paths.describe() if native.library() is not None else None


def machine_kind(m: dict) -> str:
    """The key records are kept under: CPUs of one vendor, family and model run the same kernels alike."""
    return f"{m.get('vendor') or m.get('cpu')} family {m.get('family')} model {m.get('model')}"


def commit() -> dict:
    """The checked-out commit and whether the tree differs from it (a figure from uncommitted code says so)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "HEAD").strip()
    # The code that ran: the library and the scripts (the records themselves excluded).
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks",
                     ":!benchmarks/results").strip())
    return {"commit": sha or None, "dirty": dirty}


class Recorder:
    """One run of one benchmark script: its tables, written together under benchmarks/results/<area>.json."""

    def __init__(self, area: str, argv: list[str] | None = None, bandwidth: bool = True,
                 command: str | None = None) -> None:
        self.area = area
        script = Path(sys.argv[0])
        try:
            script = script.resolve().relative_to(ROOT)
        except ValueError:
            pass
        args = sys.argv[1:] if argv is None else argv
        self.command = command or " ".join(["python", str(script), *args])
        self.started = datetime.datetime.now(datetime.timezone.utc)
        self.load_start = load_average()
        self.code = commit()  # the code as it was when the measurement began
        self.machine = machine(bandwidth)
        self.tables: dict[str, Table] = {}

    def table(self, name: str, title: str, columns: list[str]) -> Table:
        self.tables[name] = Table(title, list(columns))
        return self.tables[name]

    def header(self) -> str:
        """One line for the top of a script's output: the machine and load the record will hold."""
        m = self.machine
        l3 = f"{m['l3_bytes'] >> 20} MiB L3" if m["l3_bytes"] else "L3 unknown"
        bw = f"{m['read_gbs']} GB/s read" if m["read_gbs"] else "read bandwidth not measured"
        return (f"machine: {m['cpu']} ({machine_kind(m)}; {' '.join(m['flags']) or 'no AVX2'}), {m['cores']} cores, "
                f"{l3}, {bw}; load average {' '.join(map(str, self.load_start))}")

    def records(self) -> dict[str, dict]:
        meta = {"command": self.command, "date": self.started.isoformat(timespec="seconds"), **self.code,
                "machine": self.machine, "load_average": {"start": self.load_start, "end": load_average()}}
        return {name: {**meta, **asdict(t)} for name, t in self.tables.items() if t.rows}

    def write(self, folder: Path | None = None) -> Path | None:
        """Merge this run's tables into <folder>/<area>.json: each replaces its machine kind's older record."""
        new = self.records()
        if not new:
            return None
        folder = folder or RESULTS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.area}.json"
        data = json.loads(path.read_text()) if path.exists() else {"area": self.area, "tables": {}}
        kind = machine_kind(self.machine)
        for name, record in new.items():
            data["tables"].setdefault(name, {})[kind] = record
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        tmp.replace(path)
        print(f"record: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
              f"({', '.join(new)}; {kind})", file=sys.stderr)
        return path

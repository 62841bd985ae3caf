"""benchmarks/bench_server.py survives its baseline: a llama-bench or llama-server that crashes (a segmentation
fault) or is not built is a failed row of its table, and the benchmark goes on and writes its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRASH = "#!/bin/sh\nkill -SEGV $$\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama")


def _bench(tmp_path: Path, gguf: Path, bins: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    results = tmp_path / "results"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server.py"), "--model", str(gguf),
                          "--llama-bin", str(bins), "--results", str(results), *args],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads((results / "server.json").read_text())


@pytest.mark.slow
def test_a_crashing_llama_bench_is_a_failed_row_and_the_prefill_benchmark_goes_on(tmp_path, tiny):
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "llama-bench").write_text(CRASH)
    (bins / "llama-bench").chmod(0o755)
    out, record = _bench(tmp_path, tiny, bins, "--prefill", "16")
    assert "crashed (SIGSEGV)" in out.stdout
    assert "failed: crashed (SIGSEGV)" in json.dumps(record)


@pytest.mark.slow
def test_a_crashing_or_missing_llama_server_is_a_failed_row_and_the_comparison_goes_on(tmp_path, tiny):
    bins = tmp_path / "bin"
    bins.mkdir()
    (bins / "llama-server").write_text(CRASH)
    (bins / "llama-server").chmod(0o755)
    out, record = _bench(tmp_path, tiny, bins, "--llama-server", "1", "--concurrent", "2", "--tokens", "2")
    assert "failed: crashed (SIGSEGV)" in json.dumps(record)
    (bins / "llama-server").unlink()
    out, record = _bench(tmp_path, tiny, bins, "--llama-server", "1", "--concurrent", "2", "--tokens", "2")
    assert "failed: not built" in json.dumps(record) and "llama-server failed in every run" in out.stdout

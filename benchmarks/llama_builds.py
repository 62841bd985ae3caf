"""Which llama.cpp build a benchmark compares with (benchmarks/build_llama_bench.sh makes them).

Decode compares with the native build (`build/llama.cpp/bin`). Prefill and the server compare with the build
without AMX (`build/llama.cpp-noamx/bin`) where there is one: on a CPU with AMX the native build's AMX path dies
with SIGSEGV in `llama-bench -p 512` and at `llama-server`'s start, so only the build without it gives those
figures there."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "build" / "llama.cpp" / "bin"
NO_AMX = ROOT / "build" / "llama.cpp-noamx" / "bin"


def batched_bin() -> Path:
    """The folder of llama-bench and llama-server for prefill and serving: the build without AMX where it was
    made (CPUs with AMX), the native build elsewhere."""
    return NO_AMX if (NO_AMX / "llama-server").exists() else NATIVE


def described(folder: Path) -> str:
    """How a table names the build its baseline ran: "llama.cpp built without AMX" or "llama.cpp"."""
    return "llama.cpp built without AMX" if folder.resolve() == NO_AMX.resolve() else "llama.cpp"

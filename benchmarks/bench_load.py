"""Time to the first token, whole-run time, peak memory and cache bytes of `lmhead generate`, cold and warm,
beside llama.cpp's `llama-bench` on the same GGUF file when it is built (`make llama-bench`).

    python benchmarks/bench_load.py                       # both packaged models
    python benchmarks/bench_load.py --model path/to.gguf  # any GGUF file (repeatable)

cold: a fresh, empty LMHEAD_CACHE (the file's config and tokenizer are read once, nothing is converted);
warm: the same cache again. Each run is its own process: `lmhead generate -n N` (greedy), the first token's time
read from its streamed output, peak RSS from the child's rusage. llama.cpp: `llama-bench -p 16 -n N -r 1` wall
time and peak RSS (it maps the file; `-p 0`, marked so, where its prompt pass crashes). Run it alone on a quiet
machine: the load average is printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from records import Figure, Recorder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LMHEAD = Path(sys.executable).with_name("lmhead")
LLAMA_BENCH = ROOT / "build" / "llama.cpp" / "bin" / "llama-bench"


TIME = Path("/usr/bin/time")


def _spawn(cmd: list[str], **kw) -> tuple[subprocess.Popen, Path | None]:
    """`cmd` started under /usr/bin/time (its peak RSS written to a file). A child forked straight from this
    process would report this process's resident size at the fork as its own peak (Linux keeps the larger
    high-water mark across exec), and this process holds the bandwidth probe's buffer."""
    if not TIME.exists():
        return subprocess.Popen(cmd, **kw), None
    out = Path(tempfile.mkstemp(suffix=".rss")[1])
    return subprocess.Popen([str(TIME), "-f", "%M", "-o", str(out), *cmd], **kw), out


def _wait(proc: subprocess.Popen, rss_file: Path | None) -> tuple[int, float]:
    """(exit code, peak RSS MiB) of a finished child: /usr/bin/time's measure of the command, else wait4's."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if rss_file is None:
        return proc.returncode, usage.ru_maxrss / 1024
    text = rss_file.read_text().split()
    rss_file.unlink()
    return proc.returncode, int(text[-1]) / 1024 if text and text[-1].isdigit() else float("nan")


def lmhead_run(model: str, n: int, cache: Path) -> dict[str, float]:
    """One `lmhead generate` process: first-token and total seconds, peak RSS MiB."""
    env = {**os.environ, "LMHEAD_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc, rss_file = _spawn([str(LMHEAD), "generate", "The cat sat on the", "-m", model, "--max-new-tokens",
                             str(n), "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env)
    first = None
    while True:
        byte = proc.stdout.read(1)
        if not byte:
            break
        if first is None and byte.strip():
            first = time.perf_counter() - t0
    code, rss = _wait(proc, rss_file)
    total = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"lmhead generate -m {model} exited {code}")
    return {"first": first or total, "total": total, "rss": rss}


def llama_run(gguf: Path, n: int) -> dict[str, float] | None:
    """llama-bench's wall time and peak RSS for a 16-token prompt and n tokens — or, where its prompt pass fails
    (some builds crash on batches of 8 or more on some CPUs), for n tokens alone, marked `prompt: 0`; None
    where it is not built or fails both ways (said on stdout)."""
    if not LLAMA_BENCH.exists():
        return None
    for prompt in (16, 0):
        t0 = time.perf_counter()
        proc, rss_file = _spawn([str(LLAMA_BENCH), "-m", str(gguf), "-t", "2", "-p", str(prompt), "-n", str(n),
                                 "-r", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        code, rss = _wait(proc, rss_file)
        if code == 0:
            return {"total": time.perf_counter() - t0, "rss": rss, "prompt": prompt}
        print(f"llama-bench -p {prompt} -n {n} on {gguf.name} exited with {code}", flush=True)
    return None


def gguf_of(model: str, cache: Path) -> Path | None:
    """The GGUF file a model name or path loads (after a run filled `cache`)."""
    if model.endswith(".gguf"):
        return Path(model)
    found = list((cache / "meta").glob(f"{model}/model.gguf"))
    if found:
        return found[0]
    from lmhead.models.registry import MODELS

    spec = MODELS.get(model)
    return spec.gguf(Path(tempfile.mkdtemp())) if spec else None


def cache_bytes(cache: Path, exclude: Path | None) -> int:
    """Bytes lmhead wrote to its cache for the model (the packaged model's assembled GGUF file excluded: it is
    the model file itself, not derived from it)."""
    total = 0
    for p in cache.rglob("*"):
        if p.is_file() and (exclude is None or p.resolve() != exclude.resolve()) and p.suffix != ".so":
            total += p.stat().st_size
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model name or .gguf path (default: both packaged)")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    models = args.model or ["gemma-3-270m", "smollm2-135m"]
    rec = Recorder("load")
    print(f"{rec.header()}; {args.new_tokens} new tokens; llama-bench "
          f"{'found' if LLAMA_BENCH.exists() else 'not built'}")
    columns = ["model", "run", "first token s", "total s", "peak RSS MiB", "cache MB", "llama.cpp total s",
               "llama.cpp RSS MiB"]
    table = rec.table("runs", f"lmhead generate -n {args.new_tokens}, cold and warm cache, beside llama-bench",
                      columns)
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|")
    for model in models:
        with tempfile.TemporaryDirectory(prefix="lmhead-bench-load-") as tmp:
            cache = Path(tmp)
            cold = lmhead_run(model, args.new_tokens, cache)
            warm = lmhead_run(model, args.new_tokens, cache)
            gguf = gguf_of(model, cache)
            kept = cache_bytes(cache, gguf if gguf is not None and cache in gguf.parents else None)
            llama = llama_run(gguf, args.new_tokens) if gguf is not None else None
            for name, run in (("cold", cold), ("warm", warm)):
                cells = [model, name, f"{run['first']:.2f}", f"{run['total']:.2f}", f"{run['rss']:.0f}",
                         f"{kept / 1e6:.1f}",
                         (f"{llama['total']:.2f}" + ("" if llama["prompt"] else " (-p 0)")) if llama else "-",
                         f"{llama['rss']:.0f}" if llama else "-"]
                print("| " + " | ".join(cells) + " |")
                table.row(cells, [Figure(f"{model} {name} run, whole", run["total"], "s",
                                         "llama-bench" if llama else None, llama["total"] if llama else None)])
    print(f"load average after {os.getloadavg()[0]:.2f}")
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

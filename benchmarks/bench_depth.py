"""Decode speed deep into a context: lmhead against llama.cpp's `llama-bench -d` on the same GGUF file.

    .venv/bin/python benchmarks/bench_depth.py [--model gemma-3-270m --model smollm2-135m]
        [--depth 0 --depth 1024 --depth 2048] [--new-tokens 64] [--repeats 3] [--no-check]

Per model and depth: a context of `depth` tokens (words drawn from a fixed list by a seeded generator) and then
one of bench_decode.py's prompts; lmhead's greedy decode without drafts, its rate taken over the tokens after
the first (the prefill excluded, as llama-bench's generation rate after `-d` tokens excludes filling them),
medians of repeats interleaved with llama-bench's runs (`-t 2 -p 0 -n N -d depth`): the native build (decode's
baseline, its AMX batch-1 kernels its fastest on a CPU with AMX), and where it dies — filling `-d` tokens is a
prefill, which its AMX path does not survive there — the build without AMX (llama_builds.py), named in the row; a
depth neither build runs leaves its cells empty and the table goes on. Each attention step reads
the whole context's keys and values, so the rate falls with depth; Gemma 3's sliding-window layers (15 of 18,
window 512) read only their window. Greedy tokens are checked against transformers' `generate()` on the same
weights (the full-precision model; --no-check skips it). The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import PROMPTS, llama_cpp_rate, transformers_generate  # noqa: E402
from llama_builds import NATIVE, NO_AMX, described  # noqa: E402
from records import Figure, Recorder  # noqa: E402

WORDS = ("the of and to in is was that for on with as by at from his her they this which but were had not are "
         "river mountain city market winter summer garden letter ship road bridge school king queen music paper "
         "light stone water forest morning evening history science number language window family village engine "
         "quickly slowly under over between before after during because although while where when").split()


def context(tokenizer, depth: int, prompt: str, seed: int = 0) -> str:
    """About `depth` tokens of seeded words, then `prompt` (the whole a few tokens longer than depth)."""
    if depth <= 0:
        return prompt
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(64))
        if len(tokenizer(" ".join(words))["input_ids"]) >= depth:
            break
    while len(tokenizer(" ".join(words))["input_ids"]) > depth:
        words.pop()
    return " ".join(words) + ". " + prompt


def decode_rate(model, prompt: str, n: int) -> tuple[float, list[int]]:
    """Greedy tokens per second after the first token (no drafts), and the ids."""
    from lmhead.sampling import SamplingConfig

    times, ids = [], []
    for step in model.generate(prompt, n, config=SamplingConfig(temperature=0), draft="none"):
        times.append(time.perf_counter())
        ids.append(step.token_id)
    if len(times) < 2:  # the model ended its text at once: no rate to take
        raise SystemExit(f"bench_depth.py: the model stopped after {len(times)} token(s); no decode rate to measure")
    return (len(times) - 1) / (times[-1] - times[0]), ids


def bench_model(name: str, args: argparse.Namespace, rec: Recorder) -> None:
    from lmhead import load_model

    model = load_model(name, progress=False)
    prompts = {d: context(model.tokenizer, d, PROMPTS[0]) for d in args.depth}
    builds = [NATIVE] + ([NO_AMX] if (NO_AMX / "llama-bench").exists() else [])
    title = (f"{name}: greedy decode after a context of d tokens, {args.new_tokens} new tokens, "
             f"{torch.get_num_threads()} threads, medians of {args.repeats}")
    print(f"\n## {title}")
    columns = ["depth", "lmhead tok/s", "llama.cpp tok/s", "lmhead / llama.cpp", "llama.cpp build",
               "greedy = transformers"]
    table = rec.table(name.replace("-", "_").replace(".", "_"), title, columns)
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for depth in args.depth:
        ours, theirs = [], []
        ids: list[int] = []
        usable = list(builds)  # a build that died at this depth is not asked again
        for _ in range(args.repeats):
            rate, ids = decode_rate(model, prompts[depth], args.new_tokens)
            ours.append(rate)
            while args.llama_cpp and usable:
                try:
                    lc = llama_cpp_rate(name, args.new_tokens, 1, depth, usable[0] / "llama-bench")
                except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as exc:
                    print(f"{described(usable[0])}'s llama-bench failed at depth {depth} ({exc})", flush=True)
                    usable.pop(0)
                    continue
                if lc is not None:
                    theirs.append(lc)
                break
        same = "-"
        if args.check:
            _, ref = transformers_generate(model, prompts[depth], args.new_tokens, sampled=False)
            same = "yes" if ref == ids else f"no (first difference at token {_first_difference(ref, ids)})"
        o = statistics.median(ours)
        t = statistics.median(theirs) if theirs else None
        cells = [str(depth), f"{o:.1f}", f"{t:.1f}" if t else "-", f"{o / t:.2f}x" if t else "-",
                 described(usable[0]) if t else "-", same]
        print("| " + " | ".join(cells) + " |", flush=True)
        table.row(cells, [Figure(f"{name} greedy decode at depth {depth}", o, "tok/s",
                                 "llama.cpp llama-bench" if t else None, t, o / t if t else None)])
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model name (repeatable; default both packaged)")
    parser.add_argument("--depth", action="append", type=int, help="context tokens (repeatable; default 0, 1024, 2048)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per depth (default 3)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the greedy check against transformers' generate()")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                        help="skip llama.cpp even when build/llama.cpp/bin/llama-bench exists")
    args = parser.parse_args(argv)
    args.model = args.model or ["gemma-3-270m", "smollm2-135m"]
    args.depth = args.depth or [0, 1024, 2048]
    for d in args.depth:
        if d < 0:
            parser.error(f"--depth must be >= 0, got {d}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 (the rate is taken after the first token), got {args.new_tokens}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    rec = Recorder("depth")
    print(rec.header())
    try:
        for name in args.model:
            bench_model(name, args, rec)
    finally:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

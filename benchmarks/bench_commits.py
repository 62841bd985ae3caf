"""Two commits side by side: decode tok/s and the sampler's time per token of a base commit and this checkout,
interleaved in child processes (base, this, this, base, ...) so a busy machine slows both alike.

    .venv/bin/python benchmarks/bench_commits.py --base-src /path/to/base/checkout/src
        [--model smollm2-135m --model gemma-3-270m | --model FILE.gguf] [--new-tokens 64] [--prompts 3] [--repeats 2]
        [--no-decode] [--no-sampling]

Each child imports lmhead from one `src` folder (PYTHONPATH) and measures with the public API only, so any two
commits can be compared (make the base one with `git worktree add --detach DIR COMMIT`):
- decode: `load_model(name).generate(prompt, N, config, profile=...)` at batch 1, greedy and sampled (T=0.8,
  top-p 0.9, seeded), tokens / wall time (prefill included) after a warm-up generation, and the body's and the
  head's milliseconds per token from the loop's own profile. The greedy tokens of the two
  commits must be equal (printed as a check); the sampled ones are compared too (seeded per (seed, step)).
- sampling: `lmhead.sample` on one row [1, V] of random logits (std 5; V = 49,152 and 262,144) for the settings
  people use (greedy, temperature, top-k + top-p, min-p, repetition penalty over 256 tokens of history), median
  of repeated calls.
The table shows medians and base / this ratios for time (this / base for tok/s): above 1 is faster here. It is
written as the record `benchmarks/results/commits.json`; the load average is printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from records import Figure, Recorder  # noqa: E402

HERE_SRC = Path(__file__).resolve().parent.parent / "src"
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important inventions of the twentieth century are",
    "Photosynthesis is the process by which plants",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Dear hiring manager, I am writing to apply for",
]
# name -> SamplingConfig keywords (and whether the call gets 256 tokens of history)
SETTINGS = {
    "greedy": ({"temperature": 0.0}, False),
    "T=0.8": ({"temperature": 0.8}, False),
    "T=0.8 top-k 50 top-p 0.9": ({"temperature": 0.8, "top_k": 50, "top_p": 0.9}, False),
    "T=0.8 min-p 0.05": ({"temperature": 0.8, "min_p": 0.05}, False),
    "T=0.8 top-p 0.9 rep 1.1": ({"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1}, True),
}
SIZES = (49152, 262144)

CHILD_DECODE = r"""
import json, sys, time
import lmhead
name, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
model = lmhead.load_model(name)
configs = {"greedy": lmhead.SamplingConfig(temperature=0.0),
           "sampled": lmhead.SamplingConfig(temperature=0.8, top_p=0.9, seed=0)}
list(model.generate(prompts[0], 8, config=configs["greedy"]))  # warm-up: kernels, caches, allocator
out = {}
for mode, cfg in configs.items():
    rates, tokens, profile, made = [], [], {}, 0
    for p in prompts:
        t = time.perf_counter()
        ids = [s.token_id for s in model.generate(p, n, config=cfg, profile=profile)]
        rates.append(len(ids) / (time.perf_counter() - t))
        tokens.append(ids)
        made += len(ids)
    phases = {k: v * 1e3 / made for k, v in profile.items()}  # ms per token
    out[mode] = {"rates": rates, "tokens": tokens, "phases": phases}
print("RESULT " + json.dumps(out))
"""

CHILD_SAMPLING = r"""
import json, sys, time
import torch, lmhead
settings, sizes, repeats = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
out = {}
for V in sizes:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, V, generator=g) * 5
    hist = torch.randint(0, V, (1, 256), generator=g)
    for name, (kw, with_hist) in settings.items():
        cfg = lmhead.SamplingConfig(**kw)
        gen = torch.Generator().manual_seed(1)
        call = (lambda: lmhead.sample(x, cfg, gen, prev_tokens=hist)) if with_hist else \
            (lambda: lmhead.sample(x, cfg, gen))
        for _ in range(5):
            call()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[f"{name}|{V}"] = sorted(times)[len(times) // 2] * 1e3
print("RESULT " + json.dumps(out))
"""


def _child(src: Path, code: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"a child run from {src} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")


def _show(t) -> None:
    print(f"\n{t.title}")
    print("| " + " | ".join(t.columns) + " |")
    print("|" + "---|" * len(t.columns))
    for row in t.rows:
        print("| " + " | ".join(row) + " |", flush=True)


def _commit(src: Path) -> str:
    r = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "?"


def _phase(runs: list[dict], mode: str, key: str) -> str:
    """The median over runs of one phase's ms per token ("-" where a run's profile lacks it)."""
    got = [run[mode]["phases"].get(key) for run in runs]
    return "-" if None in got else f"{statistics.median(got):.2f}"


def bench_decode(args, rec: Recorder, base: Path, base_name: str, here_name: str) -> None:
    prompts = json.dumps(PROMPTS[: args.prompts])
    for name in args.model or ["smollm2-135m", "gemma-3-270m"]:
        runs: dict[str, list[dict]] = {"base": [], "this": []}
        order = ["base", "this", "this", "base"] * ((args.repeats + 1) // 2)
        for who in order[: 2 * args.repeats]:
            src = base if who == "base" else HERE_SRC
            runs[who].append(_child(src, CHILD_DECODE, name, str(args.new_tokens), prompts))
            print(f"  {name}: {who} run {len(runs[who])} done", file=sys.stderr)
        label = Path(name).stem if name.endswith(".gguf") else name  # a GGUF file: its name, not its folders
        t = rec.table(f"decode_{label}", f"{label}, batch 1, {args.new_tokens} new tokens × {args.prompts} prompts",
                      ["mode", f"base {base_name} tok/s", f"this {here_name} tok/s", "this/base", "tokens equal",
                       "body ms/token (base → this)", "head ms/token (base → this)"])
        for mode in ("greedy", "sampled"):
            b = statistics.median(r for run in runs["base"] for r in run[mode]["rates"])
            h = statistics.median(r for run in runs["this"] for r in run[mode]["rates"])
            same = all(rb[mode]["tokens"] == rh[mode]["tokens"] for rb in runs["base"] for rh in runs["this"])

            t.row([mode, f"{b:.1f}", f"{h:.1f}", f"{h / b:.2f}×", "yes" if same else "no",
                   f"{_phase(runs['base'], mode, 'body')} → {_phase(runs['this'], mode, 'body')}",
                   f"{_phase(runs['base'], mode, 'head')} → {_phase(runs['this'], mode, 'head')}"],
                  [Figure(f"{name} {mode} decode, this commit", h, "tok/s", f"base commit {base_name}", b, h / b)])
        _show(t)


def bench_sampling(args, rec: Recorder, base: Path, base_name: str, here_name: str) -> None:
    settings, sizes = json.dumps(SETTINGS), json.dumps(SIZES)
    runs: dict[str, list[dict]] = {"base": [], "this": []}
    for who in ["base", "this", "this", "base"] * ((args.repeats + 1) // 2):
        src = base if who == "base" else HERE_SRC
        runs[who].append(_child(src, CHILD_SAMPLING, settings, sizes, str(args.sampling_repeats)))
    t = rec.table("sampling", "lmhead.sample on one row [1, V] (std 5), one thread, median ms per call",
                  ["setting", "V", f"base {base_name} ms", f"this {here_name} ms", "base/this"])
    for V in SIZES:
        for name in SETTINGS:
            key = f"{name}|{V}"
            b = statistics.median(run[key] for run in runs["base"])
            h = statistics.median(run[key] for run in runs["this"])
            t.row([name, str(V), f"{b:.3f}", f"{h:.3f}", f"{b / h:.2f}×"],
                  [Figure(f"sample {name}, V={V}, this commit", h, "ms", f"base commit {base_name}", b, b / h)])
    _show(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-src", required=True, type=Path, help="the base commit's src folder")
    ap.add_argument("--model", action="append", help="packaged model (repeatable; default both)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3, choices=range(1, len(PROMPTS) + 1))
    ap.add_argument("--repeats", type=int, default=2, help="runs per commit, interleaved (default 2)")
    ap.add_argument("--sampling-repeats", type=int, default=51, help="calls per setting and size (median)")
    ap.add_argument("--no-decode", dest="decode", action="store_false")
    ap.add_argument("--no-sampling", dest="sampling", action="store_false")
    args = ap.parse_args()
    if not (args.base_src / "lmhead" / "__init__.py").exists():
        ap.error(f"--base-src: {args.base_src} holds no lmhead package")
    if args.new_tokens < 2 or args.repeats < 1 or args.sampling_repeats < 1:
        ap.error("--new-tokens must be at least 2, --repeats and --sampling-repeats at least 1")
    base_name, here_name = _commit(args.base_src), _commit(HERE_SRC)
    rec = Recorder("commits")
    print(rec.header(), flush=True)
    if args.sampling:
        bench_sampling(args, rec, args.base_src, base_name, here_name)
    if args.decode:
        bench_decode(args, rec, args.base_src, base_name, here_name)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rec.write()


if __name__ == "__main__":
    main()

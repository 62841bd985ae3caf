"""Decode speed: lmhead's generate loop against transformers' generate() and llama.cpp on the same weights.

    .venv/bin/python benchmarks/bench_decode.py [--model gemma-3-270m --model smollm2-135m] [--new-tokens 128]
        [--prompts 5] [--repeats 1] [--draft none --draft int8] [--head auto] [--body auto] [--no-llama-cpp]
    .venv/bin/python benchmarks/bench_decode.py --types smollm2-135m [--type Q8_0 ...] [--new-tokens 64]

Per model, batch 1, greedy and sampled (T=0.8, top-p 0.9): lmhead (one row per draft mode), transformers'
`generate()` on the same loaded model (`model.hf_model`, its own modules), and llama.cpp's `llama-bench -t 2
-p 0 -n N` on the same GGUF file when it is built (`make llama-bench`; optional, it compiles for minutes).
Runs are interleaved (lmhead, transformers, transformers, lmhead, ...) so that a busy machine slows all alike, and
llama-bench runs once beside each greedy round of lmhead's (-r 1; its median is the table's);
the table shows medians of tokens/s (generated tokens / wall time, prefill included: the ratio to transformers'
generate(), timed alike) and of lmhead's steps' rate (the tokens after the first over the time after it: the
one-token steps that llama-bench's tg times, without the prompt's prefill — the ratio to llama.cpp), and for lmhead
where a token's time goes (draft, body, head, sampling, text in ms per token) beside what the body's and the
head's bytes take at the read bandwidth measured in the same run. Greedy tokens must equal transformers'
(the full-precision model's) on every prompt. The load average is printed with each table.

--types: the packaged file requantised by llama.cpp's `llama-quantize --allow-requantize` into each GGUF type
(Q8_0 … Q2_K, IQ4_NL, IQ4_XS, MXFP4, F16, BF16, F32), each loaded from the file by lmhead and decoded greedily beside
`llama-bench` on the same file (tests/test_gguf_file.py holds each type's exactness).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from records import Figure, Recorder, Table  # noqa: E402

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The three most important inventions of the twentieth century are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which plants",
    "Dear hiring manager, I am writing to apply for",
]
LLAMA_BENCH = Path(__file__).resolve().parent.parent / "build" / "llama.cpp" / "bin" / "llama-bench"


def timed_generate(model, prompt: str, n: int, config, draft: str = "none",
                   profile: dict[str, float] | None = None) -> tuple[list[int], float, float]:
    """(the generated ids, the call's wall seconds, the seconds to its first token: the prompt's prefill and the
    token it gives) — `steps_rate` of them is the decode rate llama-bench's tg measures."""
    ids: list[int] = []
    t = time.perf_counter()
    first = 0.0
    for s in model.generate(prompt, n, config=config, profile=profile, draft=draft):
        ids.append(s.token_id)
        if len(ids) == 1:
            first = time.perf_counter() - t
    return ids, time.perf_counter() - t, first


def steps_rate(ids: list[int], wall: float, first: float) -> float | None:
    """The tokens after the first over the time after it: the one-token steps (or draft rounds) that llama-bench's
    tg times, without the prompt's prefill; None where fewer than two tokens came."""
    return (len(ids) - 1) / (wall - first) if len(ids) > 1 else None


def _ours(model, prompt: str, n: int, config, draft: str) -> tuple[float, list[int], dict[str, float], float | None]:
    """(wall seconds, the generated ids, where the time went, `steps_rate`)."""
    profile: dict[str, float] = {}
    ids, wall, first = timed_generate(model, prompt, n, config, draft, profile)
    return wall, ids, profile, steps_rate(ids, wall, first)


def transformers_generate(model, prompt: str, n: int, sampled: bool) -> tuple[float, list[int]]:
    enc = model.tokenizer(prompt, return_tensors="pt")
    kw = dict(do_sample=True, temperature=0.8, top_k=None, top_p=0.9) if sampled else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.hf_model.generate(**enc, max_new_tokens=n, pad_token_id=model.tokenizer.pad_token_id, **kw)
    return time.perf_counter() - t, out[0, enc["input_ids"].shape[1]:].tolist()


def llama_cpp_rate(name: str, n: int, repeats: int, depth: int = 0, bench: Path = LLAMA_BENCH) -> float | None:
    """llama-bench's token-generation rate (tok/s) on the model's GGUF file — after `depth` tokens already in its
    cache (`-d`) — or None when it is not built (`bench`: which build's llama-bench)."""
    if not bench.exists():
        return None
    from lmhead.models.registry import MODELS

    with tempfile.TemporaryDirectory() as work:
        return llama_bench_rate(MODELS[name].gguf(Path(work)), n, repeats, depth, bench)


def llama_bench_rate(gguf: Path, n: int, repeats: int, depth: int = 0, bench: Path = LLAMA_BENCH) -> float:
    """llama-bench's token-generation rate (tok/s) on a GGUF file, 2 threads."""
    out = subprocess.run([str(bench), "-m", str(gguf), "-t", "2", "-p", "0", "-n", str(n),
                          "-d", str(depth), "-r", str(repeats), "-o", "csv"],
                         capture_output=True, text=True, check=True).stdout
    row = list(csv.DictReader(io.StringIO(out)))[-1]
    return float(row["avg_ts"])


# llama-quantize's presets, one for each GGUF type a file may hold (Q4_1: the packaged file's type, requantised)
TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0", "Q3_K_M", "Q2_K", "IQ4_NL", "IQ4_XS",
         "MXFP4", "F16", "BF16", "F32"]
# types with no preset of their own: llama-quantize's arguments that write every matrix so. MXFP4_MOE makes a
# dense model's matrices Q8_0 (only MoE experts MXFP4): each matrix's type given by name instead (a regex search
# over the tensor names), the embedding and the output too
_ARGS = {"MXFP4": ["--tensor-type", "attn=mxfp4", "--tensor-type", "ffn=mxfp4", "--token-embedding-type", "mxfp4",
                   "--output-tensor-type", "mxfp4"]}
_PRESET = {"MXFP4": "MXFP4_MOE"}


def bench_types(args, rec: Recorder) -> None:
    """--types: the packaged model requantised by llama-quantize into each type, lmhead beside llama-bench."""
    from lmhead.models.registry import MODELS
    from lmhead.sampling import SamplingConfig

    quantize = LLAMA_BENCH.with_name("llama-quantize")
    if not (quantize.exists() and LLAMA_BENCH.exists()):
        raise SystemExit("--types needs build/llama.cpp/bin/llama-quantize and llama-bench (make llama-bench)")
    name, n = args.types, args.new_tokens
    greedy = SamplingConfig(temperature=0.0)
    table = rec.table(f"types_{name.replace('-', '_')}", f"{name} requantised with llama-quantize "
                      f"--allow-requantize: greedy decode of {n} tokens, batch 1, lmhead (draft none; its tok/s the "
                      "one-token steps after the prompt's prefill, the steps llama-bench's tg times) beside "
                      "llama-bench -t 2 -p 0 -r 1 on the same file, 3 alternating rounds (medians; range: the "
                      "rounds' ratios)", ["type", "file MB", "lmhead tok/s", "llama-bench tok/s", "ratio", "range",
                                          "load"])
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        os.environ["LMHEAD_CACHE"] = str(work / "cache")  # each file's metadata cache, gone with the files
        from lmhead import load_model

        source = MODELS[name].gguf(work)
        for kind in args.type or TYPES:
            out = work / f"{name}-{kind}.gguf"
            done = subprocess.run([str(quantize), "--allow-requantize", *_ARGS.get(kind, []), str(source), str(out),
                                   _PRESET.get(kind, kind), "2"], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{kind}: llama-quantize failed ({done.stderr.strip().splitlines()[-1:]})", flush=True)
                continue
            model = load_model(str(out), progress=False)
            _ours(model, PROMPTS[0], 4, greedy, "none")  # warm-up
            # alternating rounds: on a shared host a burst of load lands on both sides, not on one side's run
            rounds = []
            for _ in range(3):
                _, _, _, steps = _ours(model, PROMPTS[0], n, greedy, "none")
                if steps is not None:  # a round that ended at its first token has no steps to time
                    rounds.append((steps, llama_bench_rate(out, n, 1)))
            if not rounds:
                print(f"{kind}: every round ended at its first token (no steps to time)", flush=True)
                continue
            ours = statistics.median(r[0] for r in rounds)
            theirs = statistics.median(r[1] for r in rounds)
            ratios = sorted(a / b for a, b in rounds)
            spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            load = f"{os.getloadavg()[0]:.2f}"
            mb = out.stat().st_size / 1e6
            print(f"{kind}: {mb:.0f} MB, lmhead {ours:.1f} tok/s, llama-bench {theirs:.1f} tok/s, ratio "
                  f"{ours / theirs:.2f} (rounds {spread}), load {load}", flush=True)
            table.row([kind, f"{mb:.0f}", f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}", spread, load],
                      [Figure(f"{name} {kind} decode", ours, "tok/s", "llama-bench", theirs, ours / theirs)])
            del model
            out.unlink()


def _body_bytes(model) -> int:
    """Bytes a decode step reads from the body: its matrices (embedding rows excluded: one row per token) —
    the GGUF codes where the lean body reads them (`models/gguf_codes.py`), else the float32 weights."""
    lean = getattr(model, "lean", None)
    if lean is not None and all(layer.coded and len(layer.coded) == 4 for layer in lean.layers):
        return lean.nbytes
    embed = model.hf_model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.hf_model.base_model.parameters()
               if p.dim() == 2 and p.data_ptr() != embed.data_ptr())


def _head_bytes(model) -> int:
    head = model.head
    if getattr(head, "product", None) is not None:  # the fp32 head reading its GGUF codes
        return head.product.nbytes
    if hasattr(head, "compressed_bytes"):
        size = head.compressed_bytes
        return int(size() if callable(size) else size)
    return head.weight.numel() * head.weight.element_size()


COLUMNS = ["mode", "who", "tok/s", "steps tok/s", "vs transformers", "vs llama.cpp", "identical to fp32 greedy",
           "draft", "body", "head", "sampling", "text (ms/token)"]


def _print_row(table: Table, cells: list[str], figures: list[Figure]) -> None:
    print("| " + " | ".join(cells) + " |")
    table.row(cells, figures)


def bench_model(name: str, args, rec: Recorder) -> None:
    with tempfile.TemporaryDirectory() as work:
        _bench_model(name, args, rec, Path(work))


def _bench_model(name: str, args, rec: Recorder, work: Path) -> None:
    from lmhead import load_model
    from lmhead.models.registry import MODELS
    from lmhead.sampling import SamplingConfig

    model = load_model(name, head=args.head, body=args.body, progress=False)
    # llama-bench on the model's file, one run beside each greedy round of lmhead's (the machine's speed moves
    # within minutes: a ratio is only as good as its two sides' closeness in time); the median of those runs
    gguf = MODELS[name].gguf(work) if args.llama_cpp and LLAMA_BENCH.exists() else None
    llama_rates: list[float] = []
    prompts = PROMPTS[: args.prompts]
    modes = {"greedy": SamplingConfig(temperature=0.0), "sampled": SamplingConfig(temperature=0.8, top_p=0.9)}
    for draft in args.draft:  # warm-up: lazy initialisation in torch, transformers and oneDNN
        _ours(model, prompts[0], 4, modes["greedy"], draft)
    transformers_generate(model, prompts[0], 4, sampled=False)
    bandwidth = rec.machine["read_gbs"]
    title = (f"{name}: batch 1, {args.new_tokens} new tokens, {len(prompts)} prompts x {args.repeats} interleaved "
             f"repeats, torch threads {torch.get_num_threads()}, head {type(model.head).__name__} ({args.head}), "
             f"body {'lean' if model.lean is not None else args.body}; steps tok/s: the tokens after the first over "
             "the time after it, llama-bench's tg's measure, and the ratio to llama.cpp's")
    print(f"\n## {title}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    table = rec.table(name.replace("-", "_").replace(".", "_"), title, COLUMNS)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for mode, config in modes.items():
        rates: dict[str, list[float]] = {d: [] for d in args.draft} | {"transformers": []}
        steps: dict[str, list[float]] = {d: [] for d in args.draft}
        phases: dict[str, dict[str, float]] = {d: {} for d in args.draft}
        tokens = {d: 0 for d in args.draft}
        same = {d: 0 for d in args.draft}
        outs: dict[tuple[str, str], list[int]] = {}
        for r in range(args.repeats):
            for prompt in prompts:
                order = [*args.draft, "transformers"]
                for who in order if r % 2 == 0 else order[::-1]:
                    if who == "transformers":
                        t, ref = transformers_generate(model, prompt, args.new_tokens, sampled=mode == "sampled")
                        rates[who].append(len(ref) / t)
                        continue
                    t, ids, profile, rate = _ours(model, prompt, args.new_tokens, config, who)
                    rates[who].append(len(ids) / t)
                    if rate is not None:  # a run that ended at its first token has no steps to time
                        steps[who].append(rate)
                    if gguf is not None and mode == "greedy" and who == args.draft[0]:
                        try:
                            llama_rates.append(llama_bench_rate(gguf, args.new_tokens, 1))
                        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as exc:
                            print(f"llama-bench failed ({exc}): the table goes on without it", flush=True)
                            gguf = None  # a crashing baseline is left out, not the end of the benchmark
                    tokens[who] += len(ids)
                    for k, v in profile.items():
                        phases[who][k] = phases[who].get(k, 0.0) + v
                    outs[(who, prompt)] = ids
            if mode == "greedy":
                for prompt in prompts:
                    _, ref = transformers_generate(model, prompt, args.new_tokens, sampled=False)
                    for d in args.draft:
                        same[d] += int(outs[(d, prompt)] == ref)
        hf = statistics.median(rates["transformers"])
        llama = statistics.median(llama_rates) if llama_rates else None
        for d in args.draft:
            ours = statistics.median(rates[d])
            ours_steps = statistics.median(steps[d]) if steps[d] else None
            ms = {k: 1e3 * v / max(tokens[d], 1) for k, v in phases[d].items()}
            vs_llama = f"{ours_steps / llama:.2f}x" if llama and ours_steps else "-"
            ident = f"{same[d] // args.repeats}/{len(prompts)}" if mode == "greedy" else "-"
            figures = [Figure(f"{name} {mode}, lmhead draft={d}", ours, "tok/s", "transformers generate()", hf,
                              ours / hf)]
            if llama and ours_steps:
                figures.append(Figure(f"{name} {mode}, lmhead draft={d} steps", ours_steps, "tok/s",
                                      "llama.cpp llama-bench", llama, ours_steps / llama))
            _print_row(table, [mode, f"lmhead draft={d}", f"{ours:.1f}",
                               "-" if ours_steps is None else f"{ours_steps:.1f}", f"{ours / hf:.2f}x",
                               vs_llama, ident,
                               f"{ms.get('draft', 0):.1f}", f"{ms.get('body', 0):.1f}", f"{ms.get('head', 0):.1f}",
                               f"{ms.get('sampling', 0):.1f}", f"{ms.get('text', 0):.1f}"], figures)
        _print_row(table, [mode, "transformers generate()", f"{hf:.1f}", "-", "1.00x", "-", "-", "-", "-", "-", "-",
                           "-"], [])
    if llama:
        _print_row(table, ["greedy", f"llama.cpp llama-bench -t 2 (its own Q4/Q8 arithmetic; median of "
                           f"{len(llama_rates)} runs, each beside a greedy round)", f"{llama:.1f}", f"{llama:.1f}",
                           "-", "1.00x", "-", "-", "-", "-", "-", "-"], [])
    body_ms, head_ms = _body_bytes(model) / bandwidth / 1e6, _head_bytes(model) / bandwidth / 1e6
    note = (f"read bandwidth {bandwidth:.1f} GB/s: the body's matrices ({_body_bytes(model) / 1e6:.0f} MB) take "
            f"{body_ms:.1f} ms to read, the head ({_head_bytes(model) / 1e6:.0f} MB) {head_ms:.1f} ms")
    print(f"{note}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    table.note(note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model name (repeatable; default both packaged)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (default 128)")
    parser.add_argument("--prompts", type=int, default=5, choices=range(1, len(PROMPTS) + 1),
                        help="how many of the built-in prompts (default 5)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats per prompt (default 1)")
    parser.add_argument("--draft", action="append", choices=["none", "ngram", "int8"],
                        help="lmhead draft modes to run (repeatable; default none and ngram)")
    parser.add_argument("--head", default="auto", help="LM head: auto (default), fp32, exact-int8, int8, int4")
    parser.add_argument("--body", default="auto", help="body: auto (default), lean, onednn, transformers")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                        help="skip llama.cpp even when build/llama.cpp/bin/llama-bench exists")
    parser.add_argument("--types", default=None, metavar="MODEL",
                        help="instead: MODEL requantised into each GGUF type by llama-quantize, beside llama-bench")
    parser.add_argument("--type", action="append", help="with --types: only these types (repeatable)")
    args = parser.parse_args(argv)
    if args.types:
        rec = Recorder("decode")
        print(rec.header())
        try:
            bench_types(args, rec)
        finally:
            rec.write()
        return 0
    args.model = args.model or ["gemma-3-270m", "smollm2-135m"]
    args.draft = args.draft or ["none", "ngram"]
    rec = Recorder("decode")
    print(rec.header())
    try:
        for name in args.model:
            bench_model(name, args, rec)
    finally:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

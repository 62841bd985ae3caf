"""The server under concurrent clients: continuous batching against one generation at a time.

    .venv/bin/python benchmarks/bench_server.py [--model gemma-3-270m] [--concurrent 8] [--tokens 64]
        [--clients 32] [--requests 4] [--load-tokens 16]

Two real uvicorn servers on loopback, one after the other, each in a subprocess with the same model:
`batched` (the server as shipped: requests share decode rounds) and `serial` (the same server with
`runner.max_batch = 1`: one generation at a time — the server before continuous batching, the baseline).
On each:
  1. one --tokens completion on the idle server (latency)
  2. --concurrent such completions one after another, then the same ones at once (wall time of each);
     target: on `batched`, one after another takes ≥ 3× as long as at once
  3. --clients clients × --requests requests (--load-tokens completions), each client sending its next
     request when the last is answered: p50 / p99 latency; target: p50 `batched` ≤ p50 `serial` / 2
Every completion is greedy or seeded (top-k 40), so both servers must give the same text: mismatches are
counted and printed. The load average is printed before and after (a shared machine's timings are noise).

    .venv/bin/python benchmarks/bench_server.py --in-process 4

The same --concurrent requests without HTTP, in one process, alternating: all of them in one `Batch` (as the
server's rounds) and one after another (each alone), --in-process times each; the median ratio, every run's
time per round by phase (`Batch(profile=...)`), the load average of each run, and whether the tokens are equal.
Steadier than two servers one after another, whose phases a busy machine can split.

    .venv/bin/python benchmarks/bench_server.py --chat-turns 10 [--model smollm2-135m] [--tokens 64]

A --chat-turns chat (`lmhead.conversation.Conversation`, greedy, --tokens an answer) with its prefix cache and
with none, alternating by turn: per turn the prompt's tokens, the tokens prefilled (prompt less the reused
columns) and the time to the first token of each; target: the last turn's time to first token within 1.5× of
the first's with the cache.

    .venv/bin/python benchmarks/bench_server.py --join-gap 4096 [--concurrent 8] [--tokens 64]

--concurrent streams decode in one `Batch` while a --join-gap-token prompt joins (`Batch.begin_join`, one piece
sized by `decode.budget.PrefillBudget` between two rounds) and, for comparison, with the whole prompt prefilled
at once (the piece as long as the prompt): the longest gap between two rounds of the running streams against
their median round; target ≤ 3× with chunked prefill.

    .venv/bin/python benchmarks/bench_server.py --llama-server 3 [--concurrent 8] [--tokens 64] [--prompt-tokens 2048]

lmhead's server (as shipped, `lmhead serve`) beside llama.cpp's `llama-server -np --concurrent -t 2` on the same
GGUF file (built by `make llama-bench`), one after the other, --llama-server runs each: --concurrent greedy
completions of exactly --tokens tokens (`ignore_eos`) at once, each prompt --prompt-tokens long (0: the short
prompts), their aggregate tok/s, and each server's peak RSS (VmHWM) over its whole run.

    .venv/bin/python benchmarks/bench_server.py --shared-prefix 2000 [--model smollm2-135m] [--concurrent 8]
        [--tokens 16]

The prefix cache under a shared system prompt: --concurrent streamed requests at once, each a --shared-prefix
token prefix and its own ~20-token question, mean time to first token (TTFT) and aggregate tok/s — with the
prefix cached (a request before them used it), cold (nothing stored: computed once, the others wait for its
blocks) and on a server without a prefix cache — beside one request whose prefix is cached, the median of three
(goals: cached ≤ 1.5× the one request, ≤ 0.25× the cache-less server's); and a prompt extending one whose client
hung up after its first token against the same prompt cold (goal ≤ 0.1×). Each case's prompt positions computed
(lmhead's /metrics) say what its time to first token is the time of. llama-server (`--cache-reuse 256 -np
--concurrent`, where built) runs the cached case beside it.

    .venv/bin/python benchmarks/bench_server.py --prefill 512,4096 [--model smollm2-135m]

Prefill throughput and time to the first token of a prompt of each length on the lean body in process (a
`Batch` with one row of one new token: what a request's first token waits for), beside `llama-bench -p N -n 0`.

    .venv/bin/python benchmarks/bench_server.py --embeddings 3 [--model smollm2-135m] [--embed-texts 256]
        [--embed-tokens 64] [--embed-batch 32]

--embed-texts texts of about --embed-tokens tokens (windows of lmhead.data's topic sentences) through
/v1/embeddings, --embed-batch a request and 4 requests in flight, on `lmhead serve` and on `llama-server
--embedding --pooling last -np 4 -t 2` (where it is built) on the same GGUF file, --embeddings alternating runs:
texts/s of each, their ratio (goal ≥ 1.0) and the mean cosine between the two servers' vectors.

    .venv/bin/python benchmarks/bench_server.py --full-context [--model smollm2-135m] [--concurrent 8] [--tokens 64]

--concurrent requests at once, each at the model's whole context: a prompt of (context − --tokens) token ids and
--tokens greedy tokens (`ignore_eos`), sent to `lmhead serve` (and, where it is built, to `llama-server -np
--concurrent -c concurrent × context`): the server's resident memory before the requests and its peak (VmHWM)
over them, beside the KV bytes the requests need (`server.limits.column_bytes` × context × requests), and the
wall time; every answer's usage must add up to the context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import PROMPTS as DECODE_PROMPTS  # noqa: E402
from llama_builds import batched_bin, described  # noqa: E402
from records import Figure, Recorder  # noqa: E402

# bench_decode's five prompts and three more
PROMPTS = [*DECODE_PROMPTS, "The recipe calls for two cups of flour,", "In 1969, the first humans",
           "A list of prime numbers: 2, 3, 5,"]

SERVER = """
import sys, uvicorn
from lmhead import load_model
from lmhead.server import create_app
model = load_model(sys.argv[1])
app = create_app(model, prefix_cache_bytes=int(sys.argv[4]) if len(sys.argv) > 4 else None)
app.state.runner.max_batch = int(sys.argv[3])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


ROOT = Path(__file__).resolve().parent.parent
LLAMA_BIN = batched_bin()  # --llama-bin
BASELINE_ERRORS = (RuntimeError, OSError, ValueError, KeyError, httpx.HTTPError, subprocess.SubprocessError)


def failure(exc: BaseException | None = None, code: int | None = None) -> str:
    """A baseline that failed, as its table says it: "not built", "crashed (SIGSEGV)", "exit 1", or the error."""
    if code is None and isinstance(exc, subprocess.CalledProcessError):
        code = exc.returncode
    if code is None and exc is not None and getattr(exc, "exit_code", None) is not None:
        code = exc.exit_code
    if code is not None:
        if code < 0:
            try:
                return f"failed: crashed ({signal.Signals(-code).name})"
            except ValueError:
                return f"failed: killed by signal {-code}"
        return f"failed: exit {code}"
    return f"failed: {exc}" if exc is not None else "failed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -c SERVER model port max_batch` in a subprocess; waits until /v1/models answers."""

    def __init__(self, model: str, max_batch: int, prefix_cache_bytes: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = [] if prefix_cache_bytes is None else [str(prefix_cache_bytes)]
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, model, str(self.port), str(max_batch), *extra])
        self.wait_ready("/v1/models", "the server")

    def wait_ready(self, route: str, who: str) -> None:
        """Wait until `route` answers 200 (at most 600 s); the process exiting first is an error."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                exc = RuntimeError(f"{who} exited with {self.proc.returncode}")
                exc.exit_code = self.proc.returncode  # the table's reason (`failure`)
                raise exc
            try:
                if httpx.get(f"{self.url}{route}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{who} did not start in 600 s")

    def peak_rss_mib(self, field: str = "VmHWM") -> float:
        """The server process's peak resident memory so far (VmHWM; VmRSS: now)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=30)


class LlamaServer(Server):
    """llama.cpp's `llama-server` on `gguf` with `parallel` slots of `slot_tokens` each, 2 threads (loopback)."""

    def __init__(self, gguf: Path, parallel: int, slot_tokens: int, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([str(LLAMA_BIN / "llama-server"), "-m", str(gguf), "-t", "2", "--port",
                                      str(self.port), "-np", str(parallel), "-c", str(parallel * slot_tokens),
                                      *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self.wait_ready("/health", "llama-server")
        except BaseException:
            self.close()
            raise


def _gguf(model: str, work: Path) -> Path:
    """The GGUF file of a packaged model name (assembled into `work`) or the path given."""
    from lmhead.models.registry import MODELS

    return MODELS[model].gguf(work) if model in MODELS else Path(model)


def _long_prompt(model, tokens: int) -> str:
    """A text of about `tokens` tokens (the model's own tokenizer) built from the bench prompts."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += model.encode(" " + " ".join(PROMPTS))
    return model.tokenizer.decode(ids[:tokens])


async def _aggregate(url: str, prompts: list[str], tokens: int) -> tuple[float, int]:
    """All `prompts` at once as greedy completions of exactly `tokens` tokens: (wall seconds, tokens produced)."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def one(prompt: str) -> int:
            r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                                                         "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        await one(prompts[0][:200])  # warm-up
        t = time.perf_counter()
        made = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t, sum(made)


def versus_llama_server(args: argparse.Namespace, rec: Recorder) -> None:
    """--llama-server: aggregate tok/s and peak RSS of both servers on the same file (see the docstring)."""
    import tempfile

    from lmhead import load_model

    model = load_model(args.model, progress=False)
    n, k = args.concurrent, args.tokens
    prompts = ([_long_prompt(model, args.prompt_tokens)] * n if args.prompt_tokens
               else [PROMPTS[i % len(PROMPTS)] for i in range(n)])
    slot = (args.prompt_tokens or 64) + k + 64
    name = "versus_llama_server" + (f"_{args.prompt_tokens}" if args.prompt_tokens else "")
    table = rec.table(name, f"{args.model}, loopback: {n} greedy completions of {k} tokens at once, "
                      f"prompts of {args.prompt_tokens or 'about 10'} tokens; lmhead serve beside llama-server -np "
                      f"{n} -t 2 on the same GGUF file", ["run", "lmhead tok/s", "llama-server tok/s", "ratio",
                                                          "lmhead peak RSS (MiB)", "llama-server peak RSS (MiB)",
                                                          "load"])
    rates: dict[str, list[float]] = {"lmhead": [], "llama": []}
    with tempfile.TemporaryDirectory() as work:
        gguf = _gguf(args.model, Path(work))
        for run in range(args.llama_server):
            got = {}
            for who in ("lmhead", "llama"):
                if who == "llama" and not (LLAMA_BIN / "llama-server").exists():
                    got[who] = "failed: not built"
                    continue
                code = None  # the baseline's exit status where it died during the run
                try:
                    server = Server(args.model, 32) if who == "lmhead" else LlamaServer(gguf, n, slot)
                    try:
                        wall, made = asyncio.run(_aggregate(server.url, prompts, k))
                        got[who] = (made / wall, server.peak_rss_mib())
                    finally:
                        code = server.proc.poll()
                        server.close()
                except BASELINE_ERRORS as exc:
                    if who == "lmhead":
                        raise
                    got[who] = failure(exc, code)
                    continue
                rates[who].append(got[who][0])
            load = f"{os.getloadavg()[0]:.2f}"
            if isinstance(got["llama"], str):  # the baseline failed: the row says how; the benchmark goes on
                (a, ra), why = got["lmhead"], got["llama"]
                print(f"run {run}: lmhead {a:.1f} tok/s ({ra:.0f} MiB), llama-server {why}, load {load}", flush=True)
                table.row([run, f"{a:.1f}", why, "—", f"{ra:.0f}", "—", load])
                continue
            (a, ra), (b, rb) = got["lmhead"], got["llama"]
            print(f"run {run}: lmhead {a:.1f} tok/s ({ra:.0f} MiB), llama-server {b:.1f} tok/s ({rb:.0f} MiB), "
                  f"ratio {a / b:.2f}, load {load}", flush=True)
            table.row([run, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", f"{ra:.0f}", f"{rb:.0f}", load])
    if not rates["llama"]:
        a = statistics.median(rates["lmhead"])
        print(f"median: lmhead {a:.1f} tok/s, llama-server failed in every run")
        table.row(["median", f"{a:.1f}", "failed", "—", "—", "—", "—"])
        return
    a, b = statistics.median(rates["lmhead"]), statistics.median(rates["llama"])
    print(f"median: lmhead {a:.1f} tok/s, llama-server {b:.1f} tok/s, ratio {a / b:.2f} (goal ≥ 1.0)")
    table.row(["median", f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", "—", "—", "—"],
              [Figure(f"{n} × {k} tokens at once, aggregate", a, "tok/s", "llama-server", b, a / b)])


QUESTIONS = ["What did the cat buy at the market, and how much did it cost in the end?",
             "Where is the nearest market from the river, and which road leads there?",
             "Who went home first after the storm, and why did they leave so early?",
             "How many birds were sitting on the old fence near the barn that morning?",
             "Why did the baker close the shop before noon on the last day of the week?",
             "When does the train to the city leave, and where does it stop on the way?",
             "Which of the three brothers wrote the letter that arrived on Tuesday evening?",
             "What colour was the boat that the fisherman painted during the long winter?"]


# the questions of the lone cached requests (none of them a prefix of QUESTIONS')
ONE_CACHED = ["Tell me a story about the sea.", "Tell me a story about a fox.", "Tell me a story about winter."]


async def _prefilled(http: httpx.AsyncClient) -> float | None:
    """lmhead's count of prompt positions computed so far (/metrics), None from a server without it."""
    r = await http.get("/metrics")
    for line in r.text.splitlines() if r.status_code == 200 else ():
        if line.startswith("lmhead:prefill_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def _first_token(http: httpx.AsyncClient, body: dict, hang_up: bool = False) -> tuple[float, int]:
    """A streamed completion: (seconds to its first token, chunks with a token); hang_up: leave after the first."""
    t, first, count = time.perf_counter(), float("nan"), 0
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            if json.loads(line[5:]).get("choices"):
                count += 1
                if count == 1:
                    first = time.perf_counter() - t
                    if hang_up:
                        break
    return first, count


async def _shared_prefix_run(url: str, prefix: str, args: argparse.Namespace, cached_too: bool = True
                             ) -> dict[str, float]:
    """On one server: one request whose prefix is cached, the --concurrent requests with their prefix cached and
    with a fresh one (cold), and the hung-up client's case (see the module docstring). TTFTs in seconds."""
    n, k = args.concurrent, args.tokens
    limits = httpx.Limits(max_connections=n + 4)
    out: dict[str, float] = {}

    def body(p: str, q: str) -> dict:
        return {"prompt": p + " " + q, "max_tokens": k, "temperature": 0.0, "ignore_eos": True}

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await _first_token(http, {"prompt": "Hello", "max_tokens": 2})  # warm-up
        for case, p in (("cold", "Second draft. " + prefix), ("cached", prefix)):
            if case == "cached" and cached_too:
                await _first_token(http, body(p, "Tell me a story."))  # the prefix is used once: stored
                # the median of three, each its own question: a first cached request pays once for what later ones
                # find ready (the KV cache's first pages), which is no measure of the prefix cache
                before = await _prefilled(http)
                out["one cached"] = statistics.median([(await _first_token(http, body(p, q)))[0] for q in ONE_CACHED])
                if before is not None:
                    out["one cached: positions computed"] = (await _prefilled(http) - before) / len(ONE_CACHED)
            before = await _prefilled(http)
            t = time.perf_counter()
            got = await asyncio.gather(*(_first_token(http, body(p, QUESTIONS[i % len(QUESTIONS)]))
                                         for i in range(n)))
            wall = time.perf_counter() - t
            out[f"{n} {case}: mean TTFT"] = statistics.mean(f for f, _ in got)
            out[f"{n} {case}: tok/s"] = sum(c for _, c in got) / wall
            if before is not None:
                out[f"{n} {case}: positions computed"] = await _prefilled(http) - before
        if cached_too:
            p = "Third draft. " + prefix + " " + QUESTIONS[1]
            await _first_token(http, {"prompt": p, "max_tokens": 64, "temperature": 0.0}, hang_up=True)
            await asyncio.sleep(1.0)  # the server retires the row
            out["after a hang-up"] = (await _first_token(http, body(p, "And then?")))[0]
            out["same prompt, cold"] = (await _first_token(http, body("Fourth draft. " + prefix + " " + QUESTIONS[1],
                                                                      "And then?")))[0]
    return out


def shared_prefix(args: argparse.Namespace, rec: Recorder) -> None:
    """--shared-prefix: the prefix cache under a shared system prompt (see the module docstring)."""
    import tempfile

    from lmhead import load_model

    model = load_model(args.model, progress=False)
    prefix = _long_prompt(model, args.shared_prefix)
    n = args.concurrent
    results: dict[str, dict[str, float]] = {}
    for who in ("lmhead", "lmhead, no prefix cache"):
        server = Server(args.model, 32, None if who == "lmhead" else 0)
        try:
            results[who] = asyncio.run(_shared_prefix_run(server.url, prefix, args, who == "lmhead"))
        finally:
            server.close()
    why = "failed: not built"
    if (LLAMA_BIN / "llama-server").exists():
        slot = args.shared_prefix + 64 + args.tokens + 64
        with tempfile.TemporaryDirectory() as work:
            try:
                server = LlamaServer(_gguf(args.model, Path(work)), n, slot, ("--cache-reuse", "256"))
                try:
                    results["llama-server"] = asyncio.run(_shared_prefix_run(server.url, prefix, args, False))
                finally:
                    server.close()
            except BASELINE_ERRORS as exc:  # the baseline's failure is a row; the benchmark goes on
                why = failure(exc)
    ours, off = results["lmhead"], results["lmhead, no prefix cache"]
    llama = results.get("llama-server")
    table = rec.table("shared_prefix", f"{args.model}, loopback: {n} streamed greedy completions of {args.tokens} "
                      f"tokens at once, each a {args.shared_prefix}-token prefix and its own question; TTFT in s; "
                      f"llama-server: {described(LLAMA_BIN)}",
                      ["case", "lmhead", "no prefix cache", "llama-server --cache-reuse"])
    for case in (f"{n} cached: mean TTFT", f"{n} cached: tok/s", f"{n} cached: positions computed",
                 f"{n} cold: mean TTFT", f"{n} cold: tok/s", "one cached", "one cached: positions computed",
                 "after a hang-up", "same prompt, cold"):
        fmt = ".0f" if case.endswith("positions computed") else ".3f"
        cells = [f"{r[case]:{fmt}}" if r is not None and case in r else "—" for r in (ours, off)]
        cells.append(f"{llama[case]:.3f}" if llama is not None and case in llama else (why if llama is None else "—"))
        print(f"{case:28}" + "".join(f"{c:>16}" for c in cells), flush=True)
        table.row([case, *cells])
    shared, alone = ours[f"{n} cached: mean TTFT"], ours["one cached"]
    notes = [f"{n} cached / one cached: {shared / alone:.2f} (goal ≤ 1.5)",
             f"{n} cached / no prefix cache: {shared / off[f'{n} cached: mean TTFT']:.2f} (goal ≤ 0.25)",
             f"after a hang-up / cold: {ours['after a hang-up'] / ours['same prompt, cold']:.2f} (goal ≤ 0.1)"]
    if llama is not None:
        notes.append(f"TTFT / llama-server's: {shared / llama[f'{n} cached: mean TTFT']:.2f} (goal ≤ 1.0); tok/s "
                     f"ratio {ours[f'{n} cached: tok/s'] / llama[f'{n} cached: tok/s']:.2f} (goal ≥ 1.0)")
    notes.append(f"load {os.getloadavg()[0]:.2f}")
    print("; ".join(notes))
    table.note("; ".join(notes))


def prefill(args: argparse.Namespace, rec: Recorder) -> None:
    """--prefill: prefill tok/s and time to the first token per prompt length, beside llama-bench -p."""
    import csv
    import io
    import tempfile

    from lmhead import load_model
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch
    from lmhead.models.registry import MODELS
    from lmhead.sampling import SamplingConfig

    model = load_model(args.model, progress=False)
    lengths = [int(x) for x in args.prefill.split(",")]
    # the default model's table keeps its name (the records of every machine kind are under it); a file's is
    # named for the file, not its path
    label = args.model if args.model in MODELS else Path(args.model).stem
    name = "prefill" if args.model == "gemma-3-270m" else f"prefill_{label.replace('-', '_')}"
    table = rec.table(name, f"{label}: a prompt's prefill in process (its first token) beside "
                      f"llama-bench -p N -n 0 -t 2 ({described(LLAMA_BIN)}) on the same GGUF file",
                      ["prompt tokens", "lmhead TTFT (s)", "lmhead tok/s", "llama-bench tok/s", "ratio"])
    llama, failed = {}, "failed: not built"
    if (LLAMA_BIN / "llama-bench").exists():
        try:
            with tempfile.TemporaryDirectory() as work:
                out = subprocess.run([str(LLAMA_BIN / "llama-bench"), "-m", str(_gguf(args.model, Path(work))), "-t",
                                      "2", "-p", args.prefill, "-n", "0", "-r", "3", "-o", "csv"],
                                     capture_output=True, text=True, check=True).stdout
            llama = {int(r["n_prompt"]): float(r["avg_ts"]) for r in csv.DictReader(io.StringIO(out))}
            failed = "—"
        except BASELINE_ERRORS as exc:  # a crashing baseline is a row of the table, not the end of the benchmark
            failed = failure(exc)
        print(f"llama-bench: {failed}" if not llama else "llama-bench: done", flush=True)
    config = SamplingConfig(temperature=0)
    for n in lengths:
        rows = prepare(model, _long_prompt(model, n), 1, config, scores=False)
        times = []
        for _ in range(3):
            batch = Batch(model, draft="none")
            t = time.perf_counter()
            batch.add(prepare(model, _long_prompt(model, n), 1, config, scores=False))
            while batch.rows:
                batch.step()
            times.append(time.perf_counter() - t)
        ttft = statistics.median(times)
        tokens = len(rows[0].prompt_ids)
        ours = tokens / ttft
        theirs = llama.get(n)
        print(f"{tokens} tokens: TTFT {ttft:.2f} s, {ours:.0f} tok/s, llama-bench "
              f"{f'{theirs:.0f} tok/s, ratio {ours / theirs:.2f}' if theirs else '-'}; load {os.getloadavg()[0]:.2f}",
              flush=True)
        table.row([tokens, f"{ttft:.2f}", f"{ours:.0f}", f"{theirs:.0f}" if theirs else failed,
                   f"{ours / theirs:.2f}" if theirs else "-"],
                  [Figure(f"prefill of {n} tokens", ours, "tok/s", "llama-bench -p", theirs, ours / theirs)]
                  if theirs else [])


def body(i: int, tokens: int) -> dict:
    """The i-th request: greedy for even i, seeded top-k sampling for odd i."""
    b = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": tokens}
    return {**b, "temperature": 0.0} if i % 2 == 0 else {**b, "temperature": 0.8, "top_k": 40, "seed": i}


async def complete(http: httpx.AsyncClient, b: dict) -> tuple[float, str]:
    t = time.perf_counter()
    r = await http.post("/v1/completions", json=b)
    r.raise_for_status()
    return time.perf_counter() - t, r.json()["choices"][0]["text"]


async def measure(url: str, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=max(args.clients, args.concurrent) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        await complete(http, body(0, 4))  # warm-up
        idle, _ = await complete(http, body(0, args.tokens))
        batch = [body(i, args.tokens) for i in range(args.concurrent)]
        t = time.perf_counter()
        texts = [(await complete(http, b))[1] for b in batch]
        one_by_one = time.perf_counter() - t
        t = time.perf_counter()
        together = await asyncio.gather(*(complete(http, b) for b in batch))
        at_once = time.perf_counter() - t
        texts += [text for _, text in together]

        latencies: list[float] = []

        async def client(c: int) -> list[str]:
            out = []
            for i in range(args.requests):
                dt, text = await complete(http, body(c * args.requests + i, args.load_tokens))
                latencies.append(dt)
                out.append(text)
            return out

        t = time.perf_counter()
        load = await asyncio.gather(*(client(c) for c in range(args.clients)))
        load_wall = time.perf_counter() - t
    lat = sorted(latencies)
    return {"idle": idle, "one_by_one": one_by_one, "at_once": at_once, "p50": statistics.median(lat),
            "p99": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "load_wall": load_wall,
            "texts": texts + [t for ts in load for t in ts]}


def in_process(args: argparse.Namespace, rec: Recorder) -> None:
    """--in-process: 8 at once against 8 one after another in one process, alternating (see the docstring)."""
    from lmhead import load_model
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch
    from lmhead.sampling import SamplingConfig

    model = load_model(args.model)

    def rows(i: int):
        b = body(i, args.tokens)
        config = SamplingConfig(temperature=b["temperature"], top_k=b.get("top_k", 0), seed=b.get("seed"))
        return prepare(model, b["prompt"], args.tokens, config, scores=False)  # as /v1 without logprobs

    def decode(rs, profile=None) -> list[list[int]]:
        batch = Batch(model, draft="auto", profile=profile)  # the server's own batch
        batch.add(rs)
        rounds = 0
        while batch.rows:
            batch.step()
            rounds += 1
        if profile is not None:
            profile["rounds"] = rounds
        return [r.generated for r in rs]

    def timed(f):
        t = time.perf_counter()
        out = f()
        return time.perf_counter() - t, out

    n = args.concurrent
    decode([r for i in range(n) for r in rows(i)])  # warm-up: kernels, caches
    together, apart = [], []
    table = rec.table("in_process", f"{args.model}: {n} × {args.tokens}-token requests in one process, all in one "
                      "batch against one after another", ["run", f"{n} at once (s)", "one after another (s)",
                                                          "ratio", "tokens equal", "load"])
    for rep in range(args.in_process):
        profile: dict[str, float] = {}
        ta, a = timed(lambda p=profile: decode([r for i in range(n) for r in rows(i)], p))
        tb, b = timed(lambda: [decode(rows(i))[0] for i in range(n)])
        together.append(ta)
        apart.append(tb)
        per_round = {k: round(v * 1e3 / profile["rounds"], 1) for k, v in profile.items() if k != "rounds"}
        print(f"run {rep}: {n} at once {ta:.2f} s ({profile['rounds']} rounds; ms per round {per_round}), "
              f"one after another {tb:.2f} s, ratio {tb / ta:.2f}, tokens equal {a == b}, "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        table.row([rep, f"{ta:.2f}", f"{tb:.2f}", f"{tb / ta:.2f}", a == b, f"{os.getloadavg()[0]:.2f}"])
    ta, tb = statistics.median(together), statistics.median(apart)
    print(f"median: {n} at once {ta:.2f} s, one after another {tb:.2f} s, ratio {tb / ta:.2f} (target ≥ 3)")
    table.row(["median", f"{ta:.2f}", f"{tb:.2f}", f"{tb / ta:.2f}", "—", "—"],
              [Figure(f"{n} requests in one batch", ta, "s", "one after another", tb)])


def chat_turns(args: argparse.Namespace, rec: Recorder) -> None:
    """--chat-turns: prefilled tokens and time to first token per turn, with and without the prefix cache."""
    from lmhead import load_model
    from lmhead.conversation import Conversation
    from lmhead.prefix_cache import PrefixCache
    from lmhead.sampling import SamplingConfig

    model = load_model(args.model)
    chats = {name: Conversation(model, config=SamplingConfig(temperature=0), max_new_tokens=args.tokens)
                for name in ("cache", "none")}
    chats["none"].prefix_cache = PrefixCache(max_bytes=0)  # stores nothing
    print(f"{'turn':>4}{'prompt':>8}{'prefilled (cache)':>19}{'TTFT cache (s)':>16}{'TTFT none (s)':>15}")
    table = rec.table("chat_turns", f"{args.model}: an {args.chat_turns}-turn chat, time to first token with the "
                      "prefix cache and without", ["turn", "prompt tokens", "prefilled (cache)", "TTFT cache (s)",
                                                   "TTFT none (s)"])
    first = None
    for turn in range(args.chat_turns):
        line = [f"{turn + 1:>4}"]
        ttft = {}
        for name, chat in chats.items():
            cache = chat.prefix_cache
            reused = cache.reused
            t = time.perf_counter()
            steps = chat.reply(PROMPTS[turn % len(PROMPTS)] + " Tell me more.")
            next(steps)
            ttft[name] = time.perf_counter() - t
            for _ in steps:
                pass
            if name == "cache":
                prompt = len(model.encode(model.tokenizer.apply_chat_template(
                    chat.messages[:-1], tokenize=False, add_generation_prompt=True)))
                line += [f"{prompt:>8}", f"{prompt - (cache.reused - reused):>19}"]
        first = first or ttft["cache"]
        print("".join(line) + f"{ttft['cache']:>16.3f}{ttft['none']:>15.3f}", flush=True)
        table.row([c.strip() for c in line] + [f"{ttft['cache']:.3f}", f"{ttft['none']:.3f}"],
                  [Figure(f"turn {turn + 1} time to first token", ttft["cache"], "s", "no prefix cache",
                          ttft["none"])])
    summary = (f"last turn's TTFT / first's with the cache: {ttft['cache'] / first:.2f} (target ≤ 1.5); "
               f"load {os.getloadavg()[0]:.2f}")
    print(summary)
    table.note(summary)


def join_gap(args: argparse.Namespace, rec: Recorder) -> None:
    """--join-gap: the longest gap between two rounds of running streams while a long prompt joins."""
    from lmhead import load_model
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch
    from lmhead.sampling import SamplingConfig

    model = load_model(args.model)
    long_ids = (model.encode(" ".join(PROMPTS)) * (args.join_gap // 40 + 1))[:args.join_gap]
    long_prompt = model.tokenizer.decode(long_ids)
    table = rec.table("join_gap", f"{args.model}: {args.concurrent} streams decoding while a {args.join_gap}-token "
                      "prompt joins", ["prefill", "longest gap (ms)", "median round (ms)", "ratio"])
    for name, piece in (("chunked", None), ("whole", args.join_gap + 1)):  # None: the budget sizes the pieces
        batch = Batch(model, draft="none")
        batch.add([r for i in range(args.concurrent)
                   for r in prepare(model, PROMPTS[i % len(PROMPTS)], args.tokens, SamplingConfig(temperature=0))])
        gaps, joined, t = [], False, time.perf_counter()
        while batch.rows:
            if not joined and len(gaps) == 4:
                batch.begin_join(prepare(model, long_prompt, 4, SamplingConfig(temperature=0)))
                joined = True
            batch.prefill(piece)
            batch.step()
            now = time.perf_counter()
            gaps.append(now - t)
            t = now
        normal = statistics.median(gaps)
        table.row([name, f"{max(gaps) * 1e3:.0f}", f"{normal * 1e3:.0f}", f"{max(gaps) / normal:.1f}"],
                  [Figure(f"longest gap, {name} prefill", max(gaps) * 1e3, "ms", "median round", normal * 1e3,
                                 ratio=max(gaps) / normal)])
        print(f"{name}: {args.concurrent} streams, a {args.join_gap}-token prompt joins: longest gap "
              f"{max(gaps) * 1e3:.0f} ms, median round {normal * 1e3:.0f} ms, ratio {max(gaps) / normal:.1f} "
              f"(target ≤ 3 chunked); load {os.getloadavg()[0]:.2f}", flush=True)


def full_context(args: argparse.Namespace, rec: Recorder) -> None:
    """--full-context: resident memory of the server with --concurrent requests at the whole context."""
    import tempfile

    from lmhead import load_model
    from lmhead.server.limits import column_bytes

    model = load_model(args.model, progress=False)
    ctx, n, k = model.context_length, args.concurrent, args.tokens
    base = model.encode(" " + " ".join(PROMPTS))
    prompts = [((base * (ctx // len(base) + 2))[i:])[: ctx - k] for i in range(n)]  # token ids, a row each
    kv_mib = column_bytes(model) * ctx * n / 2**20
    table = rec.table(f"full_context_{args.model}", f"{args.model}: {n} requests at once at the whole context "
                      f"({ctx:,} tokens: {ctx - k:,} prompt token ids + {k} greedy tokens each)",
                      ["server", "RSS before (MiB)", "peak RSS (MiB)", "their KV (MiB)", "wall (s)",
                       "usage = context", "load"])
    del model

    async def run(url: str) -> tuple[float, bool]:
        limits = httpx.Limits(max_connections=n + 4)
        async with httpx.AsyncClient(base_url=url, timeout=7200, limits=limits) as http:
            async def one(ids: list[int]) -> int:
                r = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": k, "temperature": 0.0,
                                                             "ignore_eos": True})
                r.raise_for_status()
                u = r.json()["usage"]
                return u["prompt_tokens"] + u["completion_tokens"]

            t = time.perf_counter()
            totals = await asyncio.gather(*(one(ids) for ids in prompts))
            return time.perf_counter() - t, all(x == ctx for x in totals)

    servers = [("lmhead serve", lambda: Server(args.model, 32))]
    if (LLAMA_BIN / "llama-server").exists():
        servers.append((f"llama-server -np {n}", lambda: LlamaServer(gguf, n, ctx)))
    with tempfile.TemporaryDirectory() as work:
        gguf = _gguf(args.model, Path(work))
        for name, start in servers:
            server = start()
            try:
                before = server.peak_rss_mib("VmRSS")
                wall, whole = asyncio.run(run(server.url))
                peak = server.peak_rss_mib()
            finally:
                server.close()
            load = f"{os.getloadavg()[0]:.2f}"
            print(f"{name}: {n} requests at {ctx:,} tokens: RSS {before:.0f} MiB before, peak {peak:.0f} MiB; their "
                  f"KV {kv_mib:.0f} MiB (lmhead's float32 cache); wall {wall:.1f} s; usage = context: {whole}; "
                  f"load {load}", flush=True)
            table.row([name, f"{before:.0f}", f"{peak:.0f}", f"{kv_mib:.0f}", f"{wall:.1f}",
                       "yes" if whole else "no", load],
                      [Figure(f"{name} peak RSS, {n} requests at the whole context", peak, "MiB")])


def _embedding_texts(model, n: int, tokens: int) -> list[str]:
    """`n` different texts of about `tokens` tokens each: windows of the shipped topic sentences, run together."""
    from lmhead.data import topics

    ids = model.encode(" ".join(topics()[0]))
    step = max(1, (len(ids) - tokens) // max(1, n))
    return [model.tokenizer.decode(ids[i * step:i * step + tokens - 1]) for i in range(n)]


async def _embed_all(url: str, texts: list[str], batch: int, at_once: int) -> tuple[float, list[list[float]]]:
    """All `texts` through /v1/embeddings, `batch` inputs a request, `at_once` requests in flight: (wall s,
    the vectors in order)."""
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    gate = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        async def one(chunk: list[str]) -> list[list[float]]:
            async with gate:
                r = await http.post("/v1/embeddings", json={"input": chunk, "encoding_format": "float"})
                r.raise_for_status()
                return [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]

        await one(texts[:1])  # warm-up
        t = time.perf_counter()
        parts = await asyncio.gather(*(one(c) for c in chunks))
        return time.perf_counter() - t, [v for p in parts for v in p]


def embeddings(args: argparse.Namespace, rec: Recorder) -> None:
    """--embeddings: texts/s through /v1/embeddings, lmhead serve beside llama-server --embedding --pooling last
    on the same GGUF file, alternating runs; the mean cosine of the two servers' vectors (the same numbers up to
    float32 arithmetic: both pool the last token's final hidden state and normalise it)."""
    import tempfile

    from lmhead import load_model

    model = load_model(args.model, progress=False)
    n, k, batch = args.embed_texts, args.embed_tokens, args.embed_batch
    texts = _embedding_texts(model, n, k)
    table = rec.table("embeddings", f"{args.model}, loopback: {n} texts of about {k} tokens through /v1/embeddings, "
                      f"{batch} a request, 4 requests in flight; lmhead serve beside llama-server --embedding "
                      f"--pooling last -np 4 -t 2 ({described(LLAMA_BIN)}) on the same GGUF file",
                      ["run", "lmhead texts/s", "llama-server texts/s", "ratio", "mean cosine", "load"])
    rates: dict[str, list[float]] = {"lmhead": [], "llama": []}
    with tempfile.TemporaryDirectory() as work:
        gguf = _gguf(args.model, Path(work))
        for run in range(args.embeddings):
            got: dict[str, object] = {}
            for who in ("lmhead", "llama"):
                if who == "llama" and not (LLAMA_BIN / "llama-server").exists():
                    got[who] = "failed: not built"
                    continue
                code = None
                try:
                    server = Server(args.model, 32) if who == "lmhead" else LlamaServer(
                        gguf, 4, batch * (k + 16), ("--embedding", "--pooling", "last", "-ub", str(batch * (k + 16)),
                                                    "-b", str(batch * (k + 16))))
                    try:
                        wall, vectors = asyncio.run(_embed_all(server.url, texts, batch, 4))
                        got[who] = (n / wall, vectors)
                    finally:
                        code = server.proc.poll()
                        server.close()
                except BASELINE_ERRORS as exc:
                    if who == "lmhead":
                        raise
                    got[who] = failure(exc, code)
                    continue
                rates[who].append(got[who][0])
            load = f"{os.getloadavg()[0]:.2f}"
            a, mine = got["lmhead"]
            if isinstance(got["llama"], str):
                print(f"run {run}: lmhead {a:.1f} texts/s, llama-server {got['llama']}, load {load}", flush=True)
                table.row([run, f"{a:.1f}", got["llama"], "—", "—", load])
                continue
            b, theirs = got["llama"]
            cos = statistics.fmean(sum(x * y for x, y in zip(u, v, strict=True)) for u, v in zip(mine, theirs,
                                                                                                    strict=True))
            print(f"run {run}: lmhead {a:.1f} texts/s, llama-server {b:.1f} texts/s, ratio {a / b:.2f}, mean cosine "
                  f"{cos:.5f}, load {load}", flush=True)
            table.row([run, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", f"{cos:.5f}", load])
    a = statistics.median(rates["lmhead"])
    if not rates["llama"]:
        print(f"median: lmhead {a:.1f} texts/s, llama-server failed in every run")
        table.row(["median", f"{a:.1f}", "failed", "—", "—", "—"])
        return
    b = statistics.median(rates["llama"])
    print(f"median: lmhead {a:.1f} texts/s, llama-server {b:.1f} texts/s, ratio {a / b:.2f} (goal ≥ 1.0)")
    table.row(["median", f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", "—", "—"],
              [Figure(f"{n} embeddings of {k} tokens", a, "texts/s", "llama-server --embedding", b, a / b)])


def main() -> None:
    global LLAMA_BIN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--load-tokens", type=int, default=16)
    ap.add_argument("--in-process", type=int, default=0, metavar="RUNS",
                    help="no servers: this many alternating in-process runs (see above)")
    ap.add_argument("--chat-turns", type=int, default=0, metavar="N",
                    help="no servers: an N-turn chat with and without the prefix cache (see above)")
    ap.add_argument("--join-gap", type=int, default=0, metavar="TOKENS",
                    help="no servers: the longest gap of running streams while a TOKENS-token prompt joins")
    ap.add_argument("--llama-server", type=int, default=0, metavar="RUNS",
                    help="lmhead serve beside llama-server on the same file, RUNS alternating runs (see above)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="with --llama-server: each prompt's length")
    ap.add_argument("--prefill", default="", metavar="N,N", help="prefill of prompts of these lengths (see above)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                    help="--concurrent requests sharing a TOKENS-token prefix, with and without the prefix cache")
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN, metavar="DIR",
                    help="llama.cpp's binaries (llama-bench, llama-server; default build/llama.cpp-noamx/bin where "
                    "the CPU has AMX, else build/llama.cpp/bin)")
    ap.add_argument("--results", type=Path, default=None, metavar="DIR",
                    help="the records' folder (default benchmarks/results)")
    ap.add_argument("--full-context", action="store_true",
                    help="memory of --concurrent requests at the model's whole context (see above)")
    ap.add_argument("--embeddings", type=int, default=0, metavar="RUNS",
                    help="/v1/embeddings beside llama-server --embedding, RUNS alternating runs (see above)")
    ap.add_argument("--embed-texts", type=int, default=256, metavar="N", help="with --embeddings: texts (256)")
    ap.add_argument("--embed-tokens", type=int, default=64, metavar="N", help="with --embeddings: tokens a text")
    ap.add_argument("--embed-batch", type=int, default=32, metavar="N", help="with --embeddings: texts a request")
    args = ap.parse_args()
    LLAMA_BIN = args.llama_bin
    rec = Recorder("server")
    print(rec.header())
    if args.embeddings:
        embeddings(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    if args.full_context:
        full_context(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    if args.shared_prefix:
        shared_prefix(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    if args.llama_server or args.prefill:
        if args.prefill:
            prefill(args, rec)
        if args.llama_server:
            versus_llama_server(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    if args.chat_turns or args.join_gap:
        if args.chat_turns:
            chat_turns(args, rec)
        if args.join_gap:
            join_gap(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    if args.in_process:
        in_process(args, rec)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rec.write(args.results)
        return
    results = {}
    for name, max_batch in (("batched", 32), ("serial", 1)):
        server = Server(args.model, max_batch)
        try:
            results[name] = asyncio.run(measure(server.url, args))
        finally:
            server.close()
    b, s = results["batched"], results["serial"]
    n, k = args.concurrent, args.tokens
    print(f"\n{args.model}, loopback; {n} × {k}-token completions; {args.clients} clients × {args.requests} "
          f"requests of {args.load_tokens} tokens")
    print(f"{'':34}{'batched':>10}{'serial':>10}{'ratio':>8}")
    table = rec.table("servers", f"{args.model}, loopback: the server as shipped (batched) against one generation at a "
                      f"time (serial); {n} × {k}-token completions, {args.clients} clients × {args.requests} requests "
                      f"of {args.load_tokens} tokens", ["", "batched", "serial", "ratio"])
    rows = [("one request, idle server (s)", b["idle"], s["idle"]),
            (f"{n} one after another (s)", b["one_by_one"], s["one_by_one"]),
            (f"{n} at once (s)", b["at_once"], s["at_once"]),
            (f"{args.clients}×{args.requests}: p50 latency (s)", b["p50"], s["p50"]),
            (f"{args.clients}×{args.requests}: p99 latency (s)", b["p99"], s["p99"]),
            (f"{args.clients}×{args.requests}: wall (s)", b["load_wall"], s["load_wall"])]
    for label, x, y in rows:
        print(f"{label:34}{x:10.2f}{y:10.2f}{y / x:8.2f}")
        table.row([label, f"{x:.2f}", f"{y:.2f}", f"{y / x:.2f}"], [Figure(label, x, "s", "serial server", y)])
    speedup = b["one_by_one"] / b["at_once"]
    halved = s["p50"] / b["p50"]
    print(f"\n{n} at once vs one after another (batched server): {speedup:.2f}× sooner (target ≥ 3)")
    print(f"p50 latency under load, serial / batched: {halved:.2f}× (target ≥ 2)")
    same = sum(x == y for x, y in zip(b["texts"], s["texts"], strict=True))
    print(f"answers equal on both servers: {same} of {len(b['texts'])}")
    table.note(f"{n} at once vs one after another (batched server): {speedup:.2f}× sooner (target ≥ 3); p50 latency "
               f"under load, serial / batched: {halved:.2f}× (target ≥ 2); answers equal on both servers: {same} of "
               f"{len(b['texts'])}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rec.write(args.results)


if __name__ == "__main__":
    main()

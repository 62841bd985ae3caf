"""Structured output: validity, cost and compile time over a suite of JSON schemas of the kinds apps send.

    .venv/bin/python benchmarks/bench_structured.py [--model smollm2-135m --model gemma-3-270m]
        [--mode greedy --mode sampled] [--schemas N] [--max-tokens 256]

Per model and mode (greedy; sampled: temperature 0.7, top-p 0.95, seeded), for each schema of `SCHEMAS` (nested
objects, bounded arrays, enums, const, patterns, anyOf, number ranges, nullable fields, unicode strings, ...):
one chat prompt asking for that object, generated with `JSONSchema(schema)` (and once more without, the
baseline: the same prompt and settings), at most --max-tokens tokens, drafts as `generate`'s default.

Printed per model × mode: the share of answers that finish with "stop" within the budget, the share of those that
validate against their schema with `jsonschema` (must be 100%), constrained and unconstrained decode rates
(tokens after the first / their wall time, medians over the schemas) and their ratio, the per-token mask time
(llguidance's mask fill, p50/p99 over every mask of the run), the compile time per schema (p50/p99, first compile:
the cache is cold for each schema), and the rate of the schema whose keys are all fixed beside free text. The
load average is printed with each table: a timing taken on a busy machine is not evidence.

llama-server beside it: with `build/llama.cpp/bin/llama-server` present (built like llama-bench, an optional
benchmark dependency; `build/llama.cpp-noamx` on a CPU with AMX, see llama_builds.py), the same GGUF file, schema
and prompt through its `json_schema` field; its tok/s (its own `timings.predicted_per_second`) and validity are
printed in the same table, else "-".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_builds import batched_bin  # noqa: E402
from records import Figure, Recorder  # noqa: E402

ROOT = Path(__file__).parents[1]
LLAMA_SERVER = batched_bin() / "llama-server"  # without AMX where the CPU has it (llama_builds.py)

_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}


def _obj(props: dict, required: list[str] | None = None, extra: bool = False) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": extra}


# (what the prompt asks for, the schema): the kinds of schema apps send
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": _S, "age": _I})),
    ("a person with an email", _obj({"name": _S, "email": {"type": "string", "format": "email"}})),
    ("a city with its country and population", _obj({"city": _S, "country": _S, "population": _I})),
    ("a book", _obj({"title": _S, "author": _S, "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a movie rating", _obj({"title": _S, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("a sentiment label", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}})),
    ("a sentiment with confidence", _obj({"label": {"enum": ["pos", "neg"]},
                                          "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("a yes/no answer with a reason", _obj({"answer": _B, "reason": {"type": "string", "maxLength": 80}})),
    ("a todo item", _obj({"task": _S, "done": _B, "priority": {"enum": ["low", "medium", "high"]}})),
    ("a todo list", _obj({"items": {"type": "array", "items": _S, "minItems": 1, "maxItems": 5}})),
    ("three tags", _obj({"tags": {"type": "array", "items": _S, "minItems": 3, "maxItems": 3}})),
    ("a list of numbers", _obj({"numbers": {"type": "array", "items": _I, "maxItems": 8}})),
    ("a point", _obj({"x": _N, "y": _N})),
    ("an RGB colour", _obj({"r": {"type": "integer", "minimum": 0, "maximum": 255},
                            "g": {"type": "integer", "minimum": 0, "maximum": 255},
                            "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("a hex colour", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("a date", _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("a time of day", _obj({"time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}})),
    ("a phone number", _obj({"phone": {"type": "string", "pattern": "^\\+[0-9]{7,12}$"}})),
    ("a US zip code", _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("an address", _obj({"street": _S, "city": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("a person with an address", _obj({"name": _S, "address": _obj({"street": _S, "city": _S})})),
    ("a company with employees", _obj({"company": _S, "employees": {"type": "array", "maxItems": 3,
                                                                     "items": _obj({"name": _S, "role": _S})}})),
    ("an order", _obj({"id": _I, "items": {"type": "array", "maxItems": 4,
                                           "items": _obj({"sku": _S, "qty": {"type": "integer", "minimum": 1}})},
                       "total": {"type": "number", "minimum": 0}})),
    ("a product", _obj({"name": _S, "price": {"type": "number", "exclusiveMinimum": 0},
                        "currency": {"enum": ["USD", "EUR", "GBP"]}})),
    ("a temperature reading", _obj({"celsius": {"type": "number", "minimum": -90, "maximum": 60}})),
    ("a percentage", _obj({"percent": {"type": "integer", "minimum": 0, "maximum": 100}})),
    ("a user with an optional nickname", _obj({"name": _S, "nickname": {"type": ["string", "null"]}})),
    ("a nullable middle name", _obj({"first": _S, "middle": {"anyOf": [_S, {"type": "null"}]}, "last": _S})),
    ("an optional field", _obj({"id": _I, "note": _S}, required=["id"])),
    ("a shape", {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": _N}),
                           _obj({"kind": {"const": "square"}, "side": _N})]}),
    ("an id that is a number or a string", _obj({"id": {"anyOf": [_I, _S]}})),
    ("a result or an error", {"anyOf": [_obj({"result": _S}), _obj({"error": _S, "code": _I})]}),
    ("a versioned record", _obj({"version": {"const": 2}, "data": _S})),
    ("a fixed-key status", _obj({"service": {"const": "api"}, "status": {"enum": ["up", "down"]}})),
    ("a greeting in French", _obj({"language": {"const": "fr"}, "greeting": {"type": "string", "maxLength": 40}})),
    ("a word in Japanese with its reading", _obj({"word": _S, "reading": _S, "meaning": _S})),
    ("an emoji and its name", _obj({"emoji": {"type": "string", "maxLength": 4}, "name": _S})),
    ("a translation", _obj({"source": _S, "target": _S, "lang": {"enum": ["de", "es", "fr", "ja", "zh"]}})),
    ("a weather report", _obj({"city": _S, "temp_c": _N, "conditions": {"enum": ["sunny", "cloudy", "rain"]},
                               "wind_kmh": {"type": "number", "minimum": 0}})),
    ("a tool call", _obj({"name": {"const": "get_weather"}, "arguments": _obj({"city": _S})})),
    ("a function call with two arguments", _obj({"function": {"enum": ["add", "mul"]}, "a": _I, "b": _I})),
    ("a classification with scores", _obj({"scores": _obj({"spam": _N, "ham": _N})})),
    ("named entities", _obj({"entities": {"type": "array", "maxItems": 4, "items": _obj(
        {"text": _S, "type": {"enum": ["PERSON", "ORG", "PLACE"]}})}})),
    ("a key-value map", {"type": "object", "additionalProperties": _I, "maxProperties": 4}),
    ("a nested config", _obj({"server": _obj({"host": _S, "port": {"type": "integer", "minimum": 1,
                                                                   "maximum": 65535}}), "debug": _B})),
    ("a matrix", _obj({"rows": {"type": "array", "maxItems": 3, "items": {"type": "array", "items": _I,
                                                                         "minItems": 3, "maxItems": 3}}})),
    ("a recipe", _obj({"title": _S, "ingredients": {"type": "array", "items": _S, "maxItems": 6},
                       "minutes": {"type": "integer", "minimum": 1, "maximum": 600}})),
    ("an event", _obj({"name": _S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                       "attendees": {"type": "integer", "minimum": 0}})),
    ("a chess move", _obj({"from": {"type": "string", "pattern": "^[a-h][1-8]$"},
                           "to": {"type": "string", "pattern": "^[a-h][1-8]$"}})),
    ("a boolean flag set", _obj({"a": _B, "b": _B, "c": _B, "d": _B})),
    ("a short summary", _obj({"summary": {"type": "string", "minLength": 5, "maxLength": 120}})),
    ("a question and answer", _obj({"question": _S, "answer": _S})),
    ("a log line", _obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "message": _S,
                         "code": {"type": ["integer", "null"]}})),
    ("a score card", _obj({"player": _S, "scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 10}, "maxItems": 5}})),
    ("a plain string", {"type": "string", "maxLength": 60}),
    ("a list of people", {"type": "array", "maxItems": 3, "items": _obj({"name": _S, "age": _I})}),
]
FIXED_KEYS = "a fixed-key status"  # its keys and most of its text are forced tokens


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _prompt(model, what: str, schema: dict) -> str:
    from lmhead.models.chat import chat_prompt

    ask = f"Give {what} as JSON matching this schema: {json.dumps(schema)}"
    return chat_prompt(model, [{"role": "user", "content": ask}])


def _run(model, prompt: str, config, constraint, max_tokens: int, masks: list[float] | None):
    """(text, finish reason, tokens, tok/s after the first token) of one generation."""
    from lmhead.decode.rows import prepare
    from lmhead.generate import Batch

    rows = prepare(model, prompt, max_tokens, config, constraint=constraint, scores=False)
    if masks is not None and rows[0].matcher is not None:
        rows[0].matcher.seconds = masks
    batch = Batch(model, draft="auto")
    times, text, finish = [], [], None
    batch.add(rows)
    while batch.rows:
        for _, step in batch.step():
            times.append(time.perf_counter())
            text.append(step.text)
            finish = step.finish_reason
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")
    return "".join(text), finish, len(times), rate


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


class LlamaServer:
    """llama.cpp's server on a model's GGUF file (loopback), or nothing where it is not built."""

    def __init__(self, name: str) -> None:
        self.proc = None
        if not LLAMA_SERVER.exists():
            return
        from lmhead.models.registry import MODELS

        self.work = tempfile.TemporaryDirectory()
        gguf = MODELS[name].gguf(Path(self.work.name))
        self.url = "http://127.0.0.1:18093"
        self.proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(gguf), "-t", "2", "--port", "18093", "-c", "2048"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(120):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                time.sleep(0.5)

    def run(self, prompt: str, schema: dict, max_tokens: int, greedy: bool) -> tuple[str, float, bool]:
        body = {"prompt": prompt, "n_predict": max_tokens, "json_schema": schema, "seed": 1,
                "temperature": 0.0 if greedy else 0.7, "top_p": 0.95, "cache_prompt": False}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=600).read())
        # this server reports why it stopped as stop_type ("eos": the grammar was complete); older ones as stopped_eos
        stopped = out.get("stop_type") == "eos" or bool(out.get("stopped_eos"))
        return out["content"], float(out["timings"]["predicted_per_second"]), stopped

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.work.cleanup()


def bench(name: str, modes: list[str], suite: list[tuple[str, dict]], max_tokens: int, rec: Recorder) -> list[dict]:
    from lmhead import load_model
    from lmhead.constrain import JSONSchema, compile_constraint, guidance_tokenizer
    from lmhead.sampling import SamplingConfig

    model = load_model(name, progress=False)
    vocab = int(model.vocab_size)
    t = time.perf_counter()
    guidance_tokenizer(model.tokenizer, vocab, tuple(model.eos_token_ids))  # once per model, not per schema
    print(f"\n{name}: llguidance's tokenizer built in {time.perf_counter() - t:.2f} s (once per model)")
    compiles = []
    for _, schema in suite:  # the first compile of each schema: the cache is cold
        t = time.perf_counter()
        compile_constraint(JSONSchema(schema), model.tokenizer, vocab, tuple(model.eos_token_ids))
        compiles.append(time.perf_counter() - t)
    server = LlamaServer(name)
    records = []
    table = rec.table(f"schemas_{name}", f"{name}: {len(suite)} JSON schemas, at most {max_tokens} tokens an answer; "
                      "constrained against free decoding on the same prompts (tok/s), llama-server's json_schema "
                      "beside it", COLUMNS)
    try:
        for mode in modes:
            cfg = SamplingConfig(temperature=0.0) if mode == "greedy" else SamplingConfig(temperature=0.7, top_p=0.95,
                                                                                           seed=1)
            masks: list[float] = []
            rows = []
            for what, schema in suite:
                prompt = _prompt(model, what, schema)
                text, finish, n, rate = _run(model, prompt, cfg, JSONSchema(schema), max_tokens, masks)
                _, _, _, free = _run(model, prompt, cfg, None, max_tokens, None)
                row = {"schema": what, "finish": finish, "tokens": n, "rate": rate, "free_rate": free,
                       "valid": finish == "stop" and _valid(text, schema)}
                if server.proc is not None:
                    lt, lrate, stopped = server.run(prompt, schema, max_tokens, mode == "greedy")
                    row.update(llama_rate=lrate, llama_valid=stopped and _valid(lt, schema))
                rows.append(row)
            records.append(_table(name, mode, rows, masks, compiles, max_tokens, table))
    finally:
        server.close()
    return records


COLUMNS = ["mode", "stop within budget", "valid of stop", "constrained tok/s", "free tok/s", "ratio",
           "mask p50 / p99 (µs)", "compile p50 / p99 (ms)", "fixed keys tok/s", "llama-server tok/s (valid)"]


def _table(name: str, mode: str, rows: list[dict], masks: list[float], compiles: list[float],
           max_tokens: int, table) -> dict:
    stopped = [r for r in rows if r["finish"] == "stop"]
    valid = [r for r in stopped if r["valid"]]
    rate = statistics.median(r["rate"] for r in rows if r["rate"] == r["rate"])
    free = statistics.median(r["free_rate"] for r in rows if r["free_rate"] == r["free_rate"])
    fixed = next((r for r in rows if r["schema"] == FIXED_KEYS), None)
    llama = [r for r in rows if "llama_rate" in r]
    out = {"model": name, "mode": mode, "schemas": len(rows), "stop_share": len(stopped) / len(rows),
           "valid_share_of_stop": len(valid) / len(stopped) if stopped else float("nan"),
           "constrained_tok_s": rate, "free_tok_s": free, "ratio": rate / free,
           "mask_us_p50": 1e6 * _percentile(masks, 0.5), "mask_us_p99": 1e6 * _percentile(masks, 0.99),
           "compile_ms_p50": 1e3 * _percentile(compiles, 0.5), "compile_ms_p99": 1e3 * _percentile(compiles, 0.99),
           "fixed_keys_tok_s": fixed["rate"] if fixed else None, "load": list(os.getloadavg())}
    if llama:
        out["llama_server_tok_s"] = statistics.median(r["llama_rate"] for r in llama)
        out["llama_server_valid"] = sum(r["llama_valid"] for r in llama) / len(llama)
    ls = (f"{out['llama_server_tok_s']:.1f} ({out['llama_server_valid']:.0%})" if llama else "-")
    cells = [mode, f"{out['stop_share']:.0%}", f"{out['valid_share_of_stop']:.0%}", f"{rate:.1f}", f"{free:.1f}",
             f"{out['ratio']:.2f}", f"{out['mask_us_p50']:.0f} / {out['mask_us_p99']:.0f}",
             f"{out['compile_ms_p50']:.1f} / {out['compile_ms_p99']:.1f}",
             f"{fixed['rate']:.1f}" if fixed else "-", ls]
    print(f"\n## {name}, {mode}: {len(rows)} schemas, at most {max_tokens} tokens")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    print("| " + " | ".join(cells) + " |")
    figures = [Figure(f"{name} {mode}: constrained decode", rate, "tok/s", "free decode", free, rate / free)]
    if llama:
        figures.append(Figure(f"{name} {mode}: constrained decode", rate, "tok/s", "llama-server json_schema",
                              out["llama_server_tok_s"], rate / out["llama_server_tok_s"]))
    table.row(cells, figures)
    bad = [r["schema"] for r in stopped if not r["valid"]]
    if bad:
        print(f"INVALID answers that finished with stop: {bad}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model name (repeatable; default both packaged)")
    parser.add_argument("--mode", action="append", choices=["greedy", "sampled"], help="repeatable; default both")
    parser.add_argument("--schemas", type=int, default=len(SCHEMAS), help=f"the first N schemas (default all "
                        f"{len(SCHEMAS)})")
    parser.add_argument("--max-tokens", type=int, default=256, help="budget per answer (default 256)")
    args = parser.parse_args(argv)
    if not 1 <= args.schemas <= len(SCHEMAS):
        parser.error(f"--schemas must be in 1..{len(SCHEMAS)}, got {args.schemas}")
    if args.max_tokens < 2:
        parser.error(f"--max-tokens must be >= 2 (the rate is taken after the first token), got {args.max_tokens}")
    suite = SCHEMAS[:args.schemas]
    rec = Recorder("structured")
    print(rec.header())
    records = []
    for name in args.model or ["smollm2-135m", "gemma-3-270m"]:
        records += bench(name, args.mode or ["greedy", "sampled"], suite, args.max_tokens, rec)
    rec.write()
    return 0 if all(r["valid_share_of_stop"] in (1.0,) or r["valid_share_of_stop"] != r["valid_share_of_stop"]
                    for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())

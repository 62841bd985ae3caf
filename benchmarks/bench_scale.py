"""Real model sizes from their files: Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B shapes with random weights,
written as GGUF and quantised by llama.cpp's own tools, loaded and decoded by lmhead beside llama-bench.

    .venv/bin/python benchmarks/bench_scale.py [--shape llama-3.2-1b ...] [--type Q4_K_M --type Q8_0]
        [--new-tokens 32] [--work DIR] [--keep] [--prepare]

Per shape (the architecture's sizes; SmolLM2's tokenizer and its 49,152-token vocabulary): random bfloat16
weights (normal, σ 0.02; norms 1) written as a Hugging Face folder, shard by shard, then llama.cpp's
`convert_hf_to_gguf.py` (the vendored source `make llama-bench` builds from) to a BF16 GGUF and `llama-quantize`
to each --type. For each file: one child process loads it with lmhead (`load_model`, the file's own codes) and
decodes --new-tokens greedily (draft none) after a warm-up — its load seconds, decode tok/s and peak RSS (under
/usr/bin/time); then `llama-bench -t 2 -p 0 -n N` on the same file, its tok/s and peak RSS. On the 1B shape
transformers' float32 forward on the same file (its GGUF loader: the dequantised weights, the numbers lmhead's
exactness is defined against) generates the same greedy tokens in a third process, and the two lists are compared.

Needs build/llama.cpp/bin/llama-bench and llama-quantize (`make llama-bench`) and about 2.5× the largest BF16 file
in free disk under --work (default: a temporary folder, removed after). `--prepare --work DIR` only writes the files
(minutes, no timing: it may run beside other work); a later run with the same --work measures them. The machine
and load average are printed and recorded (benchmarks/results/scale.json). Measure alone, on a quiet machine.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_load import _spawn, _wait  # noqa: E402
from records import Figure, Recorder  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "llama.cpp" / "bin"
VENDOR = ROOT / "build" / "src"
PROMPT = "The history of the city begins in"

# the architectures' own sizes (config.json of each release); vocabulary: SmolLM2's tokenizer
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
VOCAB = 49152


def vendored_llama_cpp() -> Path:
    found = sorted(VENDOR.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found or not (BIN / "llama-quantize").exists() or not (BIN / "llama-bench").exists():
        raise SystemExit("needs llama.cpp's convert_hf_to_gguf.py, llama-quantize and llama-bench "
                         "(make llama-bench)")
    return found[-1].parent


def tokenizer_folder() -> Path:
    """SmolLM2's tokenizer files as lmhead caches them from its GGUF (read once here if not yet)."""
    from lmhead import load_model
    from lmhead.models import cache

    folder = cache.meta_dir() / "smollm2-135m"
    if not (folder / "tokenizer.json").is_file():
        load_model("smollm2-135m", progress=False)
    return folder


def write_hf(shape: str, out: Path) -> None:
    """A Hugging Face Llama folder of `shape` with random bfloat16 weights, one safetensors shard per layer (the
    whole model never in memory at once)."""
    import torch
    from safetensors.torch import save_file

    dims = SHAPES[shape]
    d, f, heads, kv, hd = (dims[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_folder()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB, rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                  hidden_act="silu", torch_dtype="bfloat16", **dims)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).bfloat16()

    index: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, out / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(VOCAB, d),
                                "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)})
    if not dims["tie_word_embeddings"]:
        shard("head.safetensors", {"lm_head.weight": rand(VOCAB, d)})
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard(f"layer-{i:03d}.safetensors", {
            p + "self_attn.q_proj.weight": rand(heads * hd, d), p + "self_attn.k_proj.weight": rand(kv * hd, d),
            p + "self_attn.v_proj.weight": rand(kv * hd, d), p + "self_attn.o_proj.weight": rand(d, heads * hd),
            p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d),
            p + "mlp.down_proj.weight": rand(d, f),
            p + "input_layernorm.weight": torch.ones(d, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(d, dtype=torch.bfloat16)})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def write_gguf(shape: str, work: Path, kinds: list[str]) -> dict[str, Path]:
    """`shape` as BF16 GGUF (convert_hf_to_gguf.py) and each of `kinds` (llama-quantize); the BF16 file and the
    Hugging Face folder removed afterwards."""
    src = vendored_llama_cpp()
    hf, bf16 = work / f"{shape}-hf", work / f"{shape}-BF16.gguf"
    files = {kind: work / f"{shape}-{kind}.gguf" for kind in kinds}
    if all(p.is_file() for p in files.values()):  # written by an earlier --prepare into the same --work
        return files
    t = time.perf_counter()
    write_hf(shape, hf)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16", "--outfile",
                    str(bf16)], env=env, check=True, capture_output=True)
    shutil.rmtree(hf)
    for kind in kinds:
        subprocess.run([str(BIN / "llama-quantize"), str(bf16), str(files[kind]), kind, "2"], check=True,
                       capture_output=True)
    bf16.unlink()
    print(f"{shape}: wrote {', '.join(f'{k} {p.stat().st_size / 2**30:.2f} GiB' for k, p in files.items())} "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    return files


_CHILD = """
import json, sys, time
t = time.perf_counter()
from lmhead import load_model
from lmhead.sampling import SamplingConfig
model = load_model(sys.argv[1], progress=False)
load = time.perf_counter() - t
greedy = SamplingConfig(temperature=0.0)
n = int(sys.argv[2])
list(model.generate(sys.argv[3], 4, config=greedy, draft="none"))  # warm-up
t = time.perf_counter()
ids = [s.token_id for s in model.generate(sys.argv[3], n, config=greedy, draft="none")]
print(json.dumps({"load": load, "rate": len(ids) / (time.perf_counter() - t), "ids": ids}))
"""

_HF_CHILD = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
path = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
enc = tok(sys.argv[3], return_tensors="pt")
with torch.inference_mode():
    out = model.generate(**enc, max_new_tokens=int(sys.argv[2]), do_sample=False, pad_token_id=tok.eos_token_id)
print(json.dumps({"ids": out[0, enc["input_ids"].shape[1]:].tolist()}))
"""


def _child(code: str, *args: str) -> tuple[dict, float]:
    """(the JSON a child Python printed, its peak RSS MiB)."""
    with tempfile.TemporaryFile("w+") as err:
        proc, rss_file = _spawn([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=err, text=True)
        out = proc.stdout.read()
        status, rss = _wait(proc, rss_file)
        if status != 0:
            err.seek(0)
            raise SystemExit(f"child failed ({status}): {err.read().strip().splitlines()[-3:]}")
    return json.loads(out.strip().splitlines()[-1]), rss


def llama_bench(gguf: Path, n: int) -> tuple[float, float]:
    """(llama-bench's decode tok/s on the file, 2 threads, its peak RSS MiB)."""
    proc, rss_file = _spawn([str(BIN / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "0", "-n", str(n), "-r",
                             "2", "-o", "csv"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    code, rss = _wait(proc, rss_file)
    if code != 0:
        raise SystemExit(f"llama-bench failed on {gguf}")
    return float(list(csv.DictReader(io.StringIO(out)))[-1]["avg_ts"]), rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable (default: all three)")
    parser.add_argument("--type", action="append", help="llama-quantize types (default Q4_K_M and Q8_0)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files in --work")
    parser.add_argument("--prepare", action="store_true", help="only write the files into --work (kept)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    vendored_llama_cpp()
    shapes, kinds = args.shape or list(SHAPES), args.type or ["Q4_K_M", "Q8_0"]
    if args.prepare:
        if args.work is None:
            parser.error("--prepare needs --work (the folder a later run measures)")
        for shape in shapes:
            write_gguf(shape, args.work, kinds)
        return 0
    rec = Recorder("scale")
    print(rec.header(), flush=True)
    columns = ["shape", "type", "file GiB", "lmhead tok/s", "llama-bench tok/s", "ratio", "lmhead RSS MiB",
               "llama-bench RSS MiB", "lmhead load s", "greedy = transformers", "load"]
    table = rec.table("shapes", f"Llama shapes, random weights, SmolLM2's tokenizer: greedy decode of "
                      f"{args.new_tokens} tokens, batch 1, lmhead (draft none) beside llama-bench -t 2 -p 0 on "
                      "the same file", columns)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmhead-bench-scale-"))
    tok = tokenizer_folder()
    try:
        for shape in shapes:
            files = write_gguf(shape, work, kinds)
            for kind, path in files.items():
                ours, rss = _child(_CHILD, str(path), str(args.new_tokens), PROMPT)
                theirs, their_rss = llama_bench(path, args.new_tokens)
                same = "-"
                if shape == "llama-3.2-1b":
                    hf, _ = _child(_HF_CHILD, str(path), str(args.new_tokens), PROMPT, str(tok))
                    same = "yes" if hf["ids"] == ours["ids"] else f"no ({ours['ids'][:8]} vs {hf['ids'][:8]})"
                load = f"{os.getloadavg()[0]:.2f}"
                cells = [shape, kind, f"{path.stat().st_size / 2**30:.2f}", f"{ours['rate']:.2f}", f"{theirs:.2f}",
                         f"{ours['rate'] / theirs:.2f}", f"{rss:.0f}", f"{their_rss:.0f}", f"{ours['load']:.1f}",
                         same, load]
                print("| " + " | ".join(cells) + " |", flush=True)
                table.row(cells, [Figure(f"{shape} {kind} decode", ours["rate"], "tok/s", "llama-bench", theirs,
                                         ours["rate"] / theirs),
                                  Figure(f"{shape} {kind} peak RSS", rss, "MiB", "llama-bench", their_rss,
                                         rss / their_rss)])
                if not args.keep:
                    path.unlink()
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Real model sizes from their files: Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B shapes with random weights,
written as GGUF and quantised by llama.cpp's own tools, loaded and decoded by lmhead beside llama-bench; and the
mixtures of experts Qwen3-30B-A3B (48 layers, 128 experts, 8 a token) and gpt-oss-20b (24 layers, 32 experts of
2880, 4 a token, MXFP4 experts), written as quantised blocks directly.

    .venv/bin/python benchmarks/bench_scale.py [--shape llama-3.2-1b ...] [--type Q4_K_M --type Q8_0]
        [--new-tokens 32] [--work DIR] [--keep] [--prepare] [--layers N]

The MoE shape (`--shape qwen3-30b-a3b`, types Q4_K or Q8_0; default Q4_K, about 17 GB) is never a float model:
each matrix's blocks are written with random codes and a fixed scale (weights of σ about 0.02; the router float32,
normal σ 0.02) straight into the GGUF file, tensor by tensor (`write_moe_gguf`), so nothing larger than one
layer's experts of one kind is in memory. `--layers N` cuts any shape to its first N layers: a 2-layer cut of
Qwen3-30B-A3B is what transformers' float32 forward can hold for the exactness check (greedy tokens compared,
transformers reading the file with the experts' widths from its tensors: `loading.moe_hf_config`).

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

# mixtures of experts: written as quantised blocks directly (`write_moe_gguf`), general.architecture qwen3moe
MOE_SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                          num_experts_per_tok=8, rope_theta=1e6, rms_norm_eps=1e-6),
    # gpt-oss-20b: experts MXFP4, every other matrix Q8_0 (llama.cpp's MXFP4_MOE preset); its widths (2880) are
    # no whole 256-weight blocks, so Q8_0 is its only other type. Biases, sinks and the router's bias normal σ 0.02
    "gpt-oss-20b": dict(arch="gpt-oss", hidden_size=2880, moe_intermediate_size=2880, intermediate_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_experts=32, num_experts_per_tok=4, rope_theta=150000.0, rms_norm_eps=1e-5,
                        sliding_window=128),
}


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


def _random_blocks(kind: str, rows: int, k: int, rng):
    """rows x k weights of `kind` as random blocks [rows, bytes]: random codes, a fixed float16 scale giving
    weights of σ about 0.02 (Q8_0: d·q, q uniform in [−127, 127]; Q4_K: d·8·q − d·60, q uniform in [0, 15])."""
    import numpy as np

    if kind == "Q8_0":
        nb = rows * k // 32
        blocks = rng.integers(-127, 128, size=(nb, 34), dtype=np.int8).view(np.uint8)
        blocks[:, 0:2] = np.frombuffer(np.float16(0.02 / 73).tobytes(), dtype=np.uint8)
    elif kind == "Q4_K":
        nb = rows * k // 256
        blocks = rng.integers(0, 256, size=(nb, 144), dtype=np.uint8)
        d = np.frombuffer(np.float16(0.02 / 37).tobytes(), dtype=np.uint8)
        blocks[:, 0:2], blocks[:, 2:4] = d, d                            # d and dmin
        # six-bit scales 8 and mins 60 for all eight groups, packed as llama.cpp's get_scale_min_k4 reads them
        blocks[:, 4:16] = np.array([8] * 4 + [60 | (3 << 6)] * 4 + [8 | (12 << 4)] * 4, dtype=np.uint8)
    elif kind == "MXFP4":  # an E8M0 exponent 2^(e − 128) times the doubled e2m1 levels (σ about 6): e = 120
        nb = rows * k // 32
        blocks = rng.integers(0, 256, size=(nb, 17), dtype=np.uint8)
        blocks[:, 0] = 120
    else:
        raise SystemExit(f"the MoE shapes are written as Q4_K, Q8_0 or MXFP4 (gpt-oss's experts), not {kind}")
    return blocks.reshape(rows, -1)


def write_moe_gguf(shape: str, path: Path, kind: str, layers: int | None = None) -> Path:
    """`shape` (MOE_SHAPES) as a qwen3moe GGUF of random `kind` blocks (norms 1, routers float32), SmolLM2's
    tokenizer, written tensor by tensor (GGUFWriter's streamed tensor data); `layers`: only the first N. The
    gpt-oss shape: a gpt-oss GGUF laid out as llama.cpp's converter writes one (q/k/v/o and the experts' biases,
    sinks, the router's bias, post_attention_norm, sliding window, YaRN rope), its experts `kind` (MXFP4) and its
    other matrices Q8_0."""
    import gguf
    import numpy as np

    dims = MOE_SHAPES[shape]
    n_layers = layers or dims["num_hidden_layers"]
    d, f, heads, kv, hd, e = (dims[k] for k in ("hidden_size", "moe_intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "num_experts"))
    arch = dims.get("arch", "qwen3moe")
    qtype = gguf.GGMLQuantizationType[kind]
    dense = kind if arch == "qwen3moe" else "Q8_0"  # the matrices outside the experts
    tok = json.loads((tokenizer_folder() / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{shape}")
    w.add_context_length(32768)
    w.add_embedding_length(d)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(dims["intermediate_size"])
    w.add_expert_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(dims["rms_norm_eps"])
    w.add_rope_freq_base(dims["rope_theta"])
    w.add_expert_count(e)
    w.add_expert_used_count(dims["num_experts_per_tok"])
    if arch == "gpt-oss":
        w.add_sliding_window(dims["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    # (name, torch-order shape, kind or None for float32; float32 tensors: "ones" or "normal")
    table: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (VOCAB, d), dense), ("output_norm.weight", (d,), "ones"),
        ("output.weight", (VOCAB, d), dense)]
    for i in range(n_layers):
        p = f"blk.{i}."
        if arch == "gpt-oss":
            table += [(p + "attn_norm.weight", (d,), "ones"), (p + "attn_q.weight", (heads * hd, d), dense),
                      (p + "attn_q.bias", (heads * hd,), "normal"), (p + "attn_k.weight", (kv * hd, d), dense),
                      (p + "attn_k.bias", (kv * hd,), "normal"), (p + "attn_v.weight", (kv * hd, d), dense),
                      (p + "attn_v.bias", (kv * hd,), "normal"), (p + "attn_output.weight", (d, heads * hd), dense),
                      (p + "attn_output.bias", (d,), "normal"), (p + "attn_sinks.weight", (heads,), "normal"),
                      (p + "post_attention_norm.weight", (d,), "ones"),
                      (p + "ffn_gate_inp.weight", (e, d), "normal"), (p + "ffn_gate_inp.bias", (e,), "normal"),
                      (p + "ffn_gate_exps.weight", (e, f, d), kind), (p + "ffn_gate_exps.bias", (e, f), "normal"),
                      (p + "ffn_up_exps.weight", (e, f, d), kind), (p + "ffn_up_exps.bias", (e, f), "normal"),
                      (p + "ffn_down_exps.weight", (e, d, f), kind), (p + "ffn_down_exps.bias", (e, d), "normal")]
            continue
        table += [(p + "attn_norm.weight", (d,), "ones"), (p + "attn_q.weight", (heads * hd, d), kind),
                  (p + "attn_k.weight", (kv * hd, d), kind), (p + "attn_v.weight", (kv * hd, d), kind),
                  (p + "attn_output.weight", (d, heads * hd), kind), (p + "attn_q_norm.weight", (hd,), "ones"),
                  (p + "attn_k_norm.weight", (hd,), "ones"), (p + "ffn_norm.weight", (d,), "ones"),
                  (p + "ffn_gate_inp.weight", (e, d), "normal"), (p + "ffn_gate_exps.weight", (e, f, d), kind),
                  (p + "ffn_up_exps.weight", (e, f, d), kind), (p + "ffn_down_exps.weight", (e, d, f), kind)]
    for name, dims_, how in table:
        if how in ("ones", "normal"):
            w.add_tensor_info(name, dims_, np.dtype(np.float32), 4 * int(np.prod(dims_)))
        else:
            qtype = gguf.GGMLQuantizationType[how]
            block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
            byte_shape = (*dims_[:-1], dims_[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, dims_, how in table:
        if how == "ones":
            w.write_tensor_data(np.ones(dims_, dtype=np.float32))
        elif how == "normal":
            w.write_tensor_data((rng.standard_normal(dims_, dtype=np.float32) * 0.02).astype(np.float32))
        else:
            rows = int(np.prod(dims_[:-1]))
            w.write_tensor_data(_random_blocks(how, rows, dims_[-1], rng))
    w.close()
    return path


def write_gguf(shape: str, work: Path, kinds: list[str], layers: int | None = None) -> dict[str, Path]:
    """`shape` as BF16 GGUF (convert_hf_to_gguf.py) and each of `kinds` (llama-quantize); the BF16 file and the
    Hugging Face folder removed afterwards. A MoE shape: each of `kinds` written directly (`write_moe_gguf`).
    `layers`: the shape cut to its first N layers."""
    cut = f"-{layers}l" if layers else ""
    if shape in MOE_SHAPES:
        files = {kind: work / f"{shape}{cut}-{kind}.gguf" for kind in kinds}
        t = time.perf_counter()
        for kind, path in files.items():
            if not path.is_file():
                work.mkdir(parents=True, exist_ok=True)
                write_moe_gguf(shape, path, kind, layers)
        print(f"{shape}{cut}: {', '.join(f'{k} {p.stat().st_size / 2**30:.2f} GiB' for k, p in files.items())} "
              f"({time.perf_counter() - t:.0f} s)", flush=True)
        return files
    if layers:
        raise SystemExit("--layers cuts the MoE shapes only")
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

_HF_MOE_CHILD = """
import json, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from lmhead.models.loading import moe_hf_config
path = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                             config=moe_hf_config(path)).eval()
enc = tok(sys.argv[3], return_tensors="pt")
with torch.inference_mode():
    out = model.generate(**enc, max_new_tokens=int(sys.argv[2]), do_sample=False, pad_token_id=tok.eos_token_id)
print(json.dumps({"ids": out[0, enc["input_ids"].shape[1]:].tolist()}))
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
    parser.add_argument("--shape", action="append", choices=[*SHAPES, *MOE_SHAPES],
                        help="repeatable (default: the three Llama shapes)")
    parser.add_argument("--type", action="append", help="llama-quantize types (default Q4_K_M and Q8_0; "
                        "qwen3-30b-a3b: Q4_K or Q8_0, default Q4_K; gpt-oss-20b: MXFP4 experts)")
    parser.add_argument("--layers", type=int, default=None, help="the MoE shapes cut to their first N layers "
                        "(2: transformers' float32 forward checks the greedy tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files in --work")
    parser.add_argument("--prepare", action="store_true", help="only write the files into --work (kept)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error("--new-tokens must be >= 1")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    vendored_llama_cpp()
    shapes = args.shape or list(SHAPES)
    if args.layers is not None and any(s not in MOE_SHAPES for s in shapes):
        parser.error(f"--layers cuts the MoE shapes only ({', '.join(MOE_SHAPES)})")

    def kinds_of(shape: str) -> list[str]:
        if MOE_SHAPES.get(shape, {}).get("arch") == "gpt-oss":
            if args.type and args.type != ["MXFP4"]:
                parser.error(f"--type: the gpt-oss shape's experts are MXFP4, got {', '.join(args.type)}")
            return ["MXFP4"]
        if shape in MOE_SHAPES:
            kinds = args.type or ["Q4_K"]
            if any(k not in ("Q4_K", "Q8_0") for k in kinds):
                parser.error(f"--type: the MoE shapes are written as Q4_K or Q8_0, got {', '.join(kinds)}")
            return kinds
        return args.type or ["Q4_K_M", "Q8_0"]

    if args.prepare:
        if args.work is None:
            parser.error("--prepare needs --work (the folder a later run measures)")
        for shape in shapes:
            write_gguf(shape, args.work, kinds_of(shape), args.layers)
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
            files = write_gguf(shape, work, kinds_of(shape), args.layers)
            for kind, path in files.items():
                ours, rss = _child(_CHILD, str(path), str(args.new_tokens), PROMPT)
                theirs, their_rss = llama_bench(path, args.new_tokens)
                same = "-"
                # transformers' GGUF loader reads no gpt-oss file whole (its rope keys: gguf_meta.gpt_oss_config);
                # gpt-oss's exactness is tests/test_gpt_oss.py's, on tiny files
                gpt_oss = MOE_SHAPES.get(shape, {}).get("arch") == "gpt-oss"
                if shape == "llama-3.2-1b" or (shape in MOE_SHAPES and not gpt_oss and args.layers is not None
                                               and args.layers <= 2):
                    code = _HF_MOE_CHILD if shape in MOE_SHAPES else _HF_CHILD
                    hf, _ = _child(code, str(path), str(args.new_tokens), PROMPT, str(tok))
                    same = "yes" if hf["ids"] == ours["ids"] else f"no ({ours['ids'][:8]} vs {hf['ids'][:8]})"
                load = f"{os.getloadavg()[0]:.2f}"
                label = shape + (f" ({args.layers} layers)" if args.layers else "")
                cells = [label, kind, f"{path.stat().st_size / 2**30:.2f}", f"{ours['rate']:.2f}", f"{theirs:.2f}",
                         f"{ours['rate'] / theirs:.2f}", f"{rss:.0f}", f"{their_rss:.0f}", f"{ours['load']:.1f}",
                         same, load]
                print("| " + " | ".join(cells) + " |", flush=True)
                table.row(cells, [Figure(f"{label} {kind} decode", ours["rate"], "tok/s", "llama-bench", theirs,
                                         ours["rate"] / theirs),
                                  Figure(f"{label} {kind} peak RSS", rss, "MiB", "llama-bench", their_rss,
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

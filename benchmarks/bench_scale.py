"""Real model sizes from their files: Llama 3.2 1B, Llama 3.2 3B and Llama 3.1 8B shapes with random weights,
written as GGUF and quantised by llama.cpp's own tools, loaded and decoded by lmhead beside llama-bench; and the
mixtures of experts Qwen3-30B-A3B (48 layers, 128 experts, 8 a token) and gpt-oss-20b (24 layers, 32 experts of
2880, 4 a token, MXFP4 experts), written as quantised blocks directly.

    .venv/bin/python benchmarks/bench_scale.py [--shape llama-3.2-1b ...] [--type Q4_K_M --type Q8_0]
        [--new-tokens 32] [--rounds 1] [--work DIR] [--keep] [--prepare] [--layers N]

The MoE shapes (`--shape qwen3-30b-a3b`: Q4_K_M — llama.cpp's mix of Q4_K and Q6_K, about 17 GB —, Q4_K or
Q8_0; `--shape gpt-oss-20b`: MXFP4 experts, Q8_0 elsewhere) are never float models:
each matrix's blocks are written with random codes and a fixed scale (weights of σ about 0.02; the router float32,
normal σ 0.02) straight into the GGUF file, tensor by tensor (`write_moe_gguf`), so nothing larger than one
layer's experts of one kind is in memory. `--layers N` cuts any shape to its first N layers: a 2-layer cut of
Qwen3-30B-A3B is what transformers' float32 forward can hold for the exactness check (greedy tokens compared,
transformers reading the file with the experts' widths from its tensors: `loading.moe_hf_config`).

Per shape (the architecture's sizes; SmolLM2's tokenizer and its 49,152-token vocabulary): random bfloat16
weights (normal, σ 0.02; norms 1) written as a Hugging Face folder, shard by shard, then llama.cpp's
`convert_hf_to_gguf.py` (the vendored source `make llama-bench` builds from) to a BF16 GGUF and `llama-quantize`
to each --type. For each file: one child process loads it with lmhead (`load_model`, the file's own codes) and
decodes --new-tokens greedily (draft none) after a warm-up — its load seconds and first token (from the process's
start: the warm-up's first token), decode tok/s (the one-token steps after the prompt's prefill, the steps llama-bench's
tg times; beside it the rate with the prefill and its first token, and the prefill's seconds) and peak RSS (under
/usr/bin/time), three times over a cache of its own (cold: the file's metadata and a mixture's laid-out experts
written; then twice warm: read and mapped, the second run measured); then `llama-bench -t 2 -p 0 -n N` on the same
file, its tok/s and peak RSS. `--rounds R` alternates the measured run and llama-bench R times, each side first
in turn (a shared host's slow spell lands on both): the table's rates are the rounds' medians, its ratio the
median of the rounds' ratios with their range beside it. A side that fails (out of memory, a crash, a refusal)
leaves "-" in its cells and the run goes on. On the 1B shape transformers' float32 forward on the same file (its
GGUF loader: the dequantised weights, the numbers lmhead's exactness is defined against) generates the same greedy
tokens in another process, and the two lists are compared.

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
import statistics
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


# the types the MoE shapes are written in: one type for every matrix, or Q4_K_M — llama.cpp's mix of that name
# (llama-quant.cpp for a model of more than 8 experts: Q6_K for the output, and for attn_v and ffn_down(_exps)
# in the first and last eighth of the layers and every third between, Q4_K for the rest)
MOE_TYPES = ("Q4_K_M", "Q4_K", "Q8_0", "MXFP4")


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a _M mix keeps at Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def mix_type(kind: str, name: str, layer: int | None, layers: int) -> str:
    """The type tensor `name` (of block `layer`, None outside the blocks) is written in for --type `kind`."""
    if kind != "Q4_K_M":
        return kind
    if name == "output.weight":
        return "Q6_K"
    if layer is not None and (".attn_v." in name or ".ffn_down" in name) and _more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


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
    weights of σ about 0.02 (Q8_0: d·q, q uniform in [−127, 127]; Q4_K: d·8·q − d·60, q uniform in [0, 15];
    Q6_K: d·8·(q − 32))."""
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
    elif kind == "Q6_K":  # d·sc·(q − 32), q uniform in [0, 63], the sixteen int8 scales 8
        nb = rows * k // 256
        blocks = rng.integers(0, 256, size=(nb, 210), dtype=np.uint8)
        blocks[:, 192:208] = 8
        blocks[:, 208:210] = np.frombuffer(np.float16(0.02 / 8 / 18.5).tobytes(), dtype=np.uint8)
    elif kind == "MXFP4":  # an E8M0 exponent 2^(e − 128) times the doubled e2m1 levels (σ about 6): e = 120
        nb = rows * k // 32
        blocks = rng.integers(0, 256, size=(nb, 17), dtype=np.uint8)
        blocks[:, 0] = 120
    else:
        raise SystemExit(f"the MoE shapes are written as {', '.join(MOE_TYPES)}, not {kind}")
    return blocks.reshape(rows, -1)


def _moe_header(w, shape: str, n_layers: int) -> None:
    """The header of `shape`'s GGUF file (MOE_SHAPES), cut to `n_layers`, and SmolLM2's tokenizer."""
    import gguf

    dims = MOE_SHAPES[shape]
    w.add_name(f"synthetic-{shape}")
    w.add_context_length(32768)
    w.add_embedding_length(dims["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(dims["intermediate_size"])
    w.add_expert_feed_forward_length(dims["moe_intermediate_size"])
    w.add_head_count(dims["num_attention_heads"])
    w.add_head_count_kv(dims["num_key_value_heads"])
    w.add_key_length(dims["head_dim"])
    w.add_value_length(dims["head_dim"])
    w.add_layer_norm_rms_eps(dims["rms_norm_eps"])
    w.add_rope_freq_base(dims["rope_theta"])
    w.add_expert_count(dims["num_experts"])
    w.add_expert_used_count(dims["num_experts_per_tok"])
    if dims.get("arch") == "gpt-oss":
        w.add_sliding_window(dims["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    tok = json.loads((tokenizer_folder() / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _moe_table(shape: str, kind: str, n_layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, torch-order shape, type — or "ones" / "normal" for float32 —) of every tensor of `shape` written as
    `kind` (`mix_type`; gpt-oss: its experts `kind`, the other matrices Q8_0, its biases and sinks normal)."""
    dims = MOE_SHAPES[shape]
    d, f, heads, kv, hd, e = (dims[k] for k in ("hidden_size", "moe_intermediate_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "num_experts"))
    oss = dims.get("arch") == "gpt-oss"
    dense = "Q8_0" if oss else kind

    def t(name: str, layer: int | None = None) -> str:
        return mix_type(dense, name, layer, n_layers)

    table = [("token_embd.weight", (VOCAB, d), t("token_embd.weight")), ("output_norm.weight", (d,), "ones"),
             ("output.weight", (VOCAB, d), t("output.weight"))]
    for i in range(n_layers):
        p = f"blk.{i}."
        table += [(p + "attn_norm.weight", (d,), "ones"), (p + "attn_q.weight", (heads * hd, d), t(p + "attn_q.", i)),
                  (p + "attn_k.weight", (kv * hd, d), t(p + "attn_k.", i)),
                  (p + "attn_v.weight", (kv * hd, d), t(p + "attn_v.", i)),
                  (p + "attn_output.weight", (d, heads * hd), t(p + "attn_output.", i)),
                  (p + "ffn_gate_inp.weight", (e, d), "normal")]
        experts = kind if oss else None
        table += [(p + "ffn_gate_exps.weight", (e, f, d), experts or t(p + "ffn_gate_exps.", i)),
                  (p + "ffn_up_exps.weight", (e, f, d), experts or t(p + "ffn_up_exps.", i)),
                  (p + "ffn_down_exps.weight", (e, d, f), experts or t(p + "ffn_down_exps.", i))]
        if oss:
            table += [(p + "attn_q.bias", (heads * hd,), "normal"), (p + "attn_k.bias", (kv * hd,), "normal"),
                      (p + "attn_v.bias", (kv * hd,), "normal"), (p + "attn_output.bias", (d,), "normal"),
                      (p + "attn_sinks.weight", (heads,), "normal"), (p + "post_attention_norm.weight", (d,), "ones"),
                      (p + "ffn_gate_inp.bias", (e,), "normal"), (p + "ffn_gate_exps.bias", (e, f), "normal"),
                      (p + "ffn_up_exps.bias", (e, f), "normal"), (p + "ffn_down_exps.bias", (e, d), "normal")]
        else:
            table += [(p + "attn_q_norm.weight", (hd,), "ones"), (p + "attn_k_norm.weight", (hd,), "ones"),
                      (p + "ffn_norm.weight", (d,), "ones")]
    return table


def write_moe_gguf(shape: str, path: Path, kind: str, layers: int | None = None) -> Path:
    """`shape` (MOE_SHAPES) as a qwen3moe GGUF of random `kind` blocks (`mix_type`: Q4_K_M is llama.cpp's mix; norms
    1, routers float32), SmolLM2's tokenizer, written tensor by tensor (GGUFWriter's streamed tensor data);
    `layers`: only the first N. The gpt-oss shape: a gpt-oss GGUF laid out as llama.cpp's converter writes one
    (q/k/v/o and the experts' biases, sinks, the router's bias, post_attention_norm, sliding window, YaRN rope),
    its experts `kind` (MXFP4) and its other matrices Q8_0."""
    import gguf
    import numpy as np

    dims = MOE_SHAPES[shape]
    n_layers = layers or dims["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), dims.get("arch", "qwen3moe"))
    _moe_header(w, shape, n_layers)
    rng = np.random.default_rng(0)
    table = _moe_table(shape, kind, n_layers)
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
            w.write_tensor_data(_random_blocks(how, int(np.prod(dims_[:-1])), dims_[-1], rng))
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
for _ in model.generate(sys.argv[3], 4, config=greedy, draft="none"):  # warm-up; its first token ends a cold start
    first = time.perf_counter() - t
    break
# the decode rate as llama-bench's tg measures it (bench_decode.steps_rate): one-token steps only, the prompt's
# prefill and the first token it gives timed apart — a mixture's prefill reads the experts every prompt token chose
from bench_decode import steps_rate, timed_generate
ids, wall, prompt = timed_generate(model, sys.argv[3], n, greedy)
print(json.dumps({"load": load, "first": first, "prompt": prompt, "steps": len(ids) - 1,
                  "rate": steps_rate(ids, wall, prompt), "with_prompt": len(ids) / wall, "ids": ids}))
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


def _child(code: str, *args: str, cache: Path | None = None) -> tuple[dict | None, float]:
    """(the JSON a child Python printed — None where it failed, its error's last lines printed —, its peak RSS
    MiB): a crash (out of memory, a refusal) is a row of the table, not the end of the run. `cache`: its
    LMHEAD_CACHE."""
    env = {**os.environ, **({"LMHEAD_CACHE": str(cache)} if cache is not None else {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile("w+") as err:
        proc, rss_file = _spawn([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=err, text=True,
                                env=env)
        out = proc.stdout.read()
        status, rss = _wait(proc, rss_file)
        if status != 0:
            err.seek(0)
            print(f"child failed ({status}): {err.read().strip().splitlines()[-3:]}", file=sys.stderr, flush=True)
            return None, rss
    return json.loads(out.strip().splitlines()[-1]), rss


def llama_bench(gguf: Path, n: int) -> tuple[float | None, float]:
    """(llama-bench's decode tok/s on the file, 2 threads — None where it failed —, its peak RSS MiB)."""
    proc, rss_file = _spawn([str(BIN / "llama-bench"), "-m", str(gguf), "-t", "2", "-p", "0", "-n", str(n), "-r",
                             "2", "-o", "csv"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    code, rss = _wait(proc, rss_file)
    rows = list(csv.DictReader(io.StringIO(out))) if code == 0 else []
    if not rows:
        print(f"llama-bench failed ({code}) on {gguf}", file=sys.stderr, flush=True)
        return None, rss
    return float(rows[-1]["avg_ts"]), rss


def _types(parser: argparse.ArgumentParser, shape: str, types: list[str] | None) -> list[str]:
    """The --type values for `shape` (defaults: Q4_K_M and Q8_0 for the Llama shapes, Q4_K_M for Qwen3-30B-A3B,
    MXFP4 experts for gpt-oss-20b); a parser error for a type the shape is not written in."""
    if MOE_SHAPES.get(shape, {}).get("arch") == "gpt-oss":
        if types and types != ["MXFP4"]:
            parser.error(f"--type: the gpt-oss shape's experts are MXFP4, got {', '.join(types)}")
        return ["MXFP4"]
    if shape in MOE_SHAPES:
        kinds = types or ["Q4_K_M"]
        if any(k not in MOE_TYPES[:3] for k in kinds):
            parser.error(f"--type: the MoE shapes are written as {', '.join(MOE_TYPES[:3])}, got {', '.join(kinds)}")
        return kinds
    return types or ["Q4_K_M", "Q8_0"]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _measure(shape: str, kind: str, path: Path, args: argparse.Namespace, table) -> None:
    """One file: lmhead's child three times over a cache of its own (cold: the file's metadata and its experts'
    layout made and written; then twice warm: read and mapped, the second measured), llama-bench, and on the 1B
    shape (or a MoE shape of at most 2 layers, not gpt-oss) transformers' greedy tokens; one row of the table (a
    failed side's cells "-"). With --rounds R the measured warm run and llama-bench alternate R times (their order
    swapped each round): the rates are the rounds' medians, the ratio the median of the rounds' ratios and its
    range beside it."""
    cache = Path(tempfile.mkdtemp(prefix="lmhead-cache-", dir=path.parent))
    rounds: list[tuple[float | None, float | None]] = []
    try:
        cold, cold_rss = _child(_CHILD, str(path), str(args.new_tokens), PROMPT, cache=cache)
        # the second warm run is the one measured: the cold run leaves the page cache holding the file's pages and
        # a mixture's laid-out experts together, more than memory keeps (Qwen3-30B-A3B: 17 + 19 GB), so the first
        # warm run still reads experts from disk as its tokens first choose them
        _child(_CHILD, str(path), str(args.new_tokens), PROMPT, cache=cache)
        ours, rss, their_rss = None, 0.0, 0.0
        for r in range(args.rounds):
            # alternating rounds, each side first in turn: on a shared host a slow spell lands on both sides
            for side in ("lmhead", "llama-bench") if r % 2 == 0 else ("llama-bench", "lmhead"):
                if side == "lmhead":
                    run, run_rss = _child(_CHILD, str(path), str(args.new_tokens), PROMPT, cache=cache)
                    ours = ours or run  # the first measured run's tokens, prefill and first token
                    lmhead_rate, rss = (None if run is None else run["rate"]), max(rss, run_rss)
                else:
                    llama_rate, run_rss = llama_bench(path, args.new_tokens)
                    their_rss = max(their_rss, run_rss)
            rounds.append((lmhead_rate, llama_rate))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    same = "-"
    # transformers' GGUF loader reads no gpt-oss file whole (its rope keys: gguf_meta.gpt_oss_config);
    # gpt-oss's exactness is tests/test_gpt_oss.py's, on tiny files
    gpt_oss = MOE_SHAPES.get(shape, {}).get("arch") == "gpt-oss"
    if ours is not None and (shape == "llama-3.2-1b" or (shape in MOE_SHAPES and not gpt_oss
                                                        and args.layers is not None and args.layers <= 2)):
        code = _HF_MOE_CHILD if shape in MOE_SHAPES else _HF_CHILD
        hf, _ = _child(code, str(path), str(args.new_tokens), PROMPT, str(tokenizer_folder()))
        same = "-" if hf is None else "yes" if hf["ids"] == ours["ids"] else \
            f"no ({ours['ids'][:8]} vs {hf['ids'][:8]})"
    both = [(a, b) for a, b in rounds if a is not None and b is not None]
    ours_rates, their_rates = [a for a, _ in rounds if a is not None], [b for _, b in rounds if b is not None]
    rate = statistics.median(ours_rates) if ours_rates else None
    theirs = statistics.median(their_rates) if their_rates else None
    ratios = sorted(a / b for a, b in both)
    ratio = statistics.median(ratios) if ratios else None
    spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if len(ratios) > 1 else "-"
    with_prompt = None if ours is None else ours["with_prompt"]
    layers = MOE_SHAPES.get(shape, SHAPES.get(shape, {})).get("num_hidden_layers")
    label = shape + (f" ({args.layers} of {layers} layers)" if args.layers else "")
    cells = [label, kind, f"{path.stat().st_size / 2**30:.2f}", _fmt(rate), _fmt(theirs), _fmt(ratio), spread,
             _fmt(with_prompt), _fmt(None if ours is None else ours["prompt"]), f"{rss:.0f}", f"{cold_rss:.0f}",
             f"{their_rss:.0f}", _fmt(None if cold is None else cold["load"], ".1f"),
             _fmt(None if ours is None else ours["first"], ".1f"), same, f"{os.getloadavg()[0]:.2f}"]
    print("| " + " | ".join(cells) + " |", flush=True)
    figures = [Figure(f"{label} {kind} peak RSS", rss, "MiB", "llama-bench", their_rss, rss / their_rss)]
    if rate is not None:
        figures.insert(0, Figure(f"{label} {kind} decode", rate, "tok/s", "llama-bench", theirs, ratio))
    table.row(cells, figures)


def _title(moe: bool, n: int, rounds: int = 1) -> str:
    """The title of the table of the MoE shapes' rows or the Llama shapes'."""
    what = ("Mixtures of experts at their real widths (Qwen3-30B-A3B: 128 experts of 768, 8 a token; gpt-oss-20b: "
            "32 of 2880, 4 a token), random quantised blocks (Q4_K_M: llama.cpp's mix; gpt-oss: MXFP4 experts, Q8_0 "
            "elsewhere), SmolLM2's tokenizer, a row's layers the first N of the model's where it says"
            if moe else "Llama shapes, random weights, SmolLM2's tokenizer")
    return (f"{what}: greedy decode of {n} tokens, batch 1, lmhead (draft none; its tok/s the {n - 1} one-token "
            "steps after the prompt's prefill, as llama-bench's tg times one-token steps, and beside it the rate "
            "with the prefill and its first token included; its tok/s and RSS from the warm runs after a first one, "
            "its load and RSS also from the cold run before them over an empty cache, its first token from the "
            "warm process's start) beside llama-bench -t 2 -p 0 on the same file"
            + (f", {rounds} alternating rounds of the two (medians; the range of the rounds' ratios)" if rounds > 1
               else "") + "; '-' where a side failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=[*SHAPES, *MOE_SHAPES],
                        help="repeatable (default: the three Llama shapes)")
    parser.add_argument("--type", action="append", help="llama-quantize types (default Q4_K_M and Q8_0; "
                        "qwen3-30b-a3b: Q4_K_M — llama.cpp's mix —, Q4_K or Q8_0, default Q4_K_M; gpt-oss-20b: "
                        "MXFP4 experts)")
    parser.add_argument("--layers", type=int, default=None, help="the MoE shapes cut to their first N layers "
                        "(2: transformers' float32 forward checks the greedy tokens)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="measured lmhead runs alternating with llama-bench "
                        "runs (medians; the ratio's range beside it)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the GGUF files in --work")
    parser.add_argument("--prepare", action="store_true", help="only write the files into --work (kept)")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (the first token comes from the prompt's prefill, timed apart)")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    shapes = args.shape or list(SHAPES)
    if args.layers is not None and any(s not in MOE_SHAPES for s in shapes):
        parser.error(f"--layers cuts the MoE shapes only ({', '.join(MOE_SHAPES)})")
    kinds = {shape: _types(parser, shape, args.type) for shape in shapes}
    vendored_llama_cpp()
    if args.prepare:
        if args.work is None:
            parser.error("--prepare needs --work (the folder a later run measures)")
        for shape in shapes:
            write_gguf(shape, args.work, kinds[shape], args.layers)
        return 0
    rec = Recorder("scale")
    print(rec.header(), flush=True)
    columns = ["shape", "type", "file GiB", "lmhead tok/s", "llama-bench tok/s", "ratio", "ratio range",
               "lmhead tok/s, prompt included", "lmhead prompt s", "lmhead RSS MiB",
               "lmhead cold RSS MiB", "llama-bench RSS MiB", "lmhead cold load s", "lmhead warm first token s",
               "greedy = transformers", "load"]
    tables = {moe: rec.table("moe" if moe else "shapes", _title(moe, args.new_tokens, args.rounds), columns)
              for moe in sorted({s in MOE_SHAPES for s in shapes})}
    work = args.work or Path(tempfile.mkdtemp(prefix="lmhead-bench-scale-"))
    try:
        for shape in shapes:
            files = write_gguf(shape, work, kinds[shape], args.layers)
            for kind, path in files.items():
                _measure(shape, kind, path, args, tables[shape in MOE_SHAPES])
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

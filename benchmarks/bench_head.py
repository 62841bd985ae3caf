"""The LM head alone at decode time: fp32 vs bf16 vs the compressed heads, against this machine's bandwidth.

    python benchmarks/bench_head.py [--models gemma-3-270m smollm2-135m] [--repeats 15] [--kernels] [--prefill 128]
                                    [--decode 256 [--decode-prompts 5] [--decode-modes exact-int8 fp32]]

For each head (real weights from the converted models under $LMHEAD_CACHE, read straight from the safetensors
file; random weights with a note when the cache is missing) it prints, side by side in one process (medians
of interleaved repeats):
  - ms per decode step of the head alone ([1,D] -> [1,V]) per mode, the bytes that mode reads per step,
    the effective GB/s and that as a share of the read bandwidth measured in the same run (a large sum);
  - for the exact modes: whether argmax / top-10 equal the fp32 head's on real hidden states (from the
    model's body when it loads, else random vectors with outlier dimensions), the candidates re-scored, the
    fallbacks, and the largest probability difference to fp32;
  - with --kernels: every matrix-vector kernel torch ships that we tried (decode and --prefill shapes);
  - with --prefill N: the head on N positions at once per mode;
  - with --decode N: end-to-end greedy decode (lmhead's loop with each head vs transformers' generate()),
    tokens/s and whether the tokens are identical.
Timings on a shared 2-core machine are noisy: compare the ratios, which are measured interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from records import Figure, Recorder, Table  # same folder: run as a script, it is on sys.path

from lmhead.compressed import CompressedHead, onednn_int8_usable

SHAPES = {"gemma-3-270m": (262144, 640), "smollm2-135m": (49152, 576)}
PROMPTS = ["The cat sat on the", "In 1492, Columbus", "def fibonacci(n):\n    ", "The capital of France is",
           "Once upon a time", "Water boils at a temperature of", "import numpy as np\nx = np.",
           "The quick brown fox jumps over the lazy dog. Then the dog woke up and"]


def cache_folder(name: str) -> Path:
    root = os.environ.get("LMHEAD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lmhead")
    return Path(root) / "models" / name


def load_weight(name: str) -> tuple[torch.Tensor, str]:
    """The head weight [V,D]: the tied embedding (or lm_head) from the cached safetensors, else random."""
    path = cache_folder(name) / "model.safetensors"
    if path.exists():
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            key = "lm_head.weight" if "lm_head.weight" in f.keys() else "model.embed_tokens.weight"
            return f.get_tensor(key).float().contiguous(), f"real weights ({path})"
    V, D = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, D, generator=g) * 0.03, "RANDOM weights (no converted model in the cache)"


def load_hidden(name: str, D: int) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Final hidden states [N,D] at every position of a few prompts, from the model's body (else random), and
    the calibration hidden states the loaded model's head uses (`lmhead.models.calibration.CALIBRATION_TEXT`)."""
    from lmhead.models.calibration import CALIBRATION_TEXT

    folder = cache_folder(name)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        rows = []
        with torch.no_grad():
            for p in PROMPTS:
                ids = tok(p, return_tensors="pt").input_ids
                rows.append(model.model(input_ids=ids).last_hidden_state[0])
            ids = tok(CALIBRATION_TEXT, return_tensors="pt").input_ids
            calibration = model.model(input_ids=ids).last_hidden_state[0]
        del model
        return (torch.cat(rows), calibration,
                f"{sum(r.shape[0] for r in rows)} real hidden states ({len(PROMPTS)} prompts)")
    except Exception as exc:  # no cache / no transformers: random vectors shaped like real ones
        g = torch.Generator().manual_seed(1)
        h = torch.randn(64, D, generator=g) * 3
        h[:, :4] *= 20
        return h, None, f"RANDOM hidden states ({type(exc).__name__})"


def read_bandwidth_gbs(repeats: int = 7) -> float:
    """This machine's read bandwidth: a 1 GiB fp32 tensor summed (medians of repeats)."""
    x = torch.ones(256 * 1024 * 1024)
    x.sum()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        t.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(t) / 1e9


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, measured round-robin so that load changes hit all alike."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def kernels(W: torch.Tensor, M: int, repeats: int) -> list[tuple[str, float, float]]:
    """(name, ms, max |error| vs fp32) for every CPU kernel tried, on h [M,D]."""
    V, D = W.shape
    g = torch.Generator().manual_seed(2)
    h = torch.randn(M, D, generator=g)
    hb = h.bfloat16()
    Wb = W.bfloat16()
    s8 = (W.abs().amax(1) / 127).bfloat16()
    q8 = torch.round(W / s8.float()[:, None]).clamp(-127, 127).to(torch.int8)
    heads = {G: CompressedHead(W, bits=4, group_size=G, exact_k=0) for G in (32, 64, 128) if D % G == 0}
    fns = {
        "fp32 F.linear": lambda: F.linear(h, W),
        "fp32 oneDNN _linear_pointwise": lambda: torch.ops.mkldnn._linear_pointwise(h, W, None, "none", [], ""),
        "bf16 F.linear (bf16 weight)": lambda: F.linear(hb, Wb),
        "int8 _weight_int8pack_mm, bf16 x": lambda: torch.ops.aten._weight_int8pack_mm(hb, q8, s8),
        "int8 _weight_int8pack_mm, fp32 x": lambda: torch.ops.aten._weight_int8pack_mm(h, q8, s8.float()),
        "int8 dequantise, then fp32 F.linear": lambda: F.linear(h, q8.float() * s8.float()[:, None]),
    }
    for G, c in heads.items():
        fns[f"int4 _weight_int4pack_mm_for_cpu G={G}"] = lambda c=c: c.approx_logits(h)
    if onednn_int8_usable():
        o8 = CompressedHead(W, bits=8, kernel="onednn", exact_k=0)
        fns["int8 oneDNN qlinear_pointwise, uint8 x"] = lambda: o8.approx_logits(h)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lin = torch.nn.Sequential(torch.nn.Linear(D, V, bias=False))
            lin[0].weight.data = W
            qlin = torch.ao.quantization.quantize_dynamic(lin, {torch.nn.Linear}, dtype=torch.qint8)
        fns["ao quantize_dynamic qint8 (int8 activations too)"] = lambda: qlin(h)
    except Exception as exc:  # removed in some torch builds
        print(f"  (torch.ao dynamic quantisation unavailable: {exc})")
    ref = F.linear(h, W)
    errors = {k: float((f().float() - ref).abs().max()) for k, f in fns.items()}
    times = interleaved(fns, repeats)
    return [(k, times[k] * 1e3, errors[k]) for k in fns]


def alpha_sweep(W: torch.Tensor, H: torch.Tensor, calibration: torch.Tensor | None, alphas: list[float]) -> None:
    """Candidates per row (k=64, one row per call) of the oneDNN head without column scales and with the
    scales of each smoothing exponent α, chosen on the calibration text and counted on the hidden states H."""
    if not onednn_int8_usable() or calibration is None:
        print("alpha sweep: needs oneDNN's int8 kernel and real calibration hidden states")
        return
    a = H.abs().amax(0)
    print(f"per-dimension max |h| over {H.shape[0]} hidden states: median {float(a.median()):.1f}, "
          f"max {float(a.max()):.1f}")
    V = W.shape[0]
    for alpha in [None, *alphas]:
        head = CompressedHead(W, bits=8, kernel="onednn", max_rescore=V, exact_k=64,
                              calibration=None if alpha is None else calibration,
                              smoothing_alpha=0.0 if alpha is None else alpha)
        for n in range(H.shape[0]):
            head(H[n:n + 1])
        s = head.stats
        label = "no column scales" if alpha is None else f"alpha = {alpha:g}"
        print(f"  {label:18s} re-scored per row mean {s['candidates'] / s['rows']:8.0f}, max {s['max_candidates']}")
        del head


def exactness(W: torch.Tensor, H: torch.Tensor, heads: list[tuple[str, CompressedHead]], table: Table) -> None:
    """For each exact head: on every hidden state of H [N,D], one decode step at a time, whether argmax and
    top-10 equal the fp32 head's, the candidates re-scored, the fallbacks and the largest |p − p_fp32|."""
    ref = F.linear(H, W)
    for label, head in heads:
        head.reset_stats()
        argmax_ok = top10_ok = 0
        perr = 0.0
        for n in range(H.shape[0]):
            out = head(H[n:n + 1])
            argmax_ok += int(out.argmax(-1).item() == ref[n].argmax().item())
            top10_ok += int(torch.equal(torch.topk(out[0], 10).indices, torch.topk(ref[n], 10).indices))
            perr = max(perr, float((torch.softmax(out[0], -1) - torch.softmax(ref[n], -1)).abs().max()))
        s = head.stats
        line = (f"{label}: argmax = fp32 on {argmax_ok}/{H.shape[0]}, top-10 on {top10_ok}/{H.shape[0]}; "
                f"re-scored per step mean {s['candidates'] / max(1, s['rows']):.0f}, max {s['max_candidates']}; "
                f"fallbacks {s['fallback_rows']} (too many candidates) + {s['tie_fallback_rows']} (fp32 near-tie); "
                f"max |p - p_fp32| {perr:.2e}")
        print(line)
        table.note(line)


def prefill_times(rec: Recorder, name: str, W: torch.Tensor, Wb: torch.Tensor, i8: CompressedHead,
                  i4: CompressedHead, prefill: int, repeats: int) -> None:
    """The head on `prefill` positions at once, per mode (medians of interleaved repeats); Wb = W in bf16."""
    D = W.shape[1]
    g = torch.Generator().manual_seed(3)
    hp = torch.randn(prefill, D, generator=g)
    full = CompressedHead(W, bits=8, max_rows=prefill)  # force the compressed path for the comparison
    p_modes = {
        "fp32": lambda: F.linear(hp, W),
        "bf16 (approximate)": lambda: F.linear(hp.bfloat16(), Wb),
        "int8 kernel (approximate)": lambda: i8.approx_logits(hp),
        "int4 g32 kernel (approximate)": lambda: i4.approx_logits(hp),
        f"exact-int8 with max_rows={prefill}": lambda: full(hp),
    }
    pt = interleaved(p_modes, max(3, repeats // 5))
    print(f"prefill: {prefill} positions at once")
    table = rec.table(f"prefill_{name}", f"{name}: the head on {prefill} positions at once",
                      ["mode", "ms", "vs fp32"])
    for k, t in pt.items():
        print(f"  {k:36s} {t * 1e3:9.1f} ms  {pt['fp32'] / t:5.2f}x fp32")
        table.row([k, f"{t * 1e3:.1f}", f"{pt['fp32'] / t:.2f}x"], [Figure(k, t * 1e3, "ms", "fp32", pt["fp32"] * 1e3)])


def bench(rec: Recorder, name: str, repeats: int, show_kernels: bool, prefill: int,
          alphas: list[float] | None = None) -> None:
    """Every table of one model's head (see the module docstring)."""
    W, origin = load_weight(name)
    V, D = W.shape
    H, calibration, hidden_origin = load_hidden(name, D)
    print(f"\n## {name}: head [{V} x {D}], {origin}; {hidden_origin}")
    t0 = time.perf_counter()
    i8 = CompressedHead(W, bits=8, calibration=calibration)  # as load_model builds it
    t_i8 = time.perf_counter() - t0
    # the other int8 kernel, for comparison (when the default is oneDNN's)
    i8p = CompressedHead(W, bits=8, kernel="int8pack") if i8.kernel != "int8pack" else None
    t0 = time.perf_counter()
    i4 = CompressedHead(W, bits=4, group_size=32)
    t_i4 = time.perf_counter() - t0
    print(f"compression: int8 ({i8.kernel} kernel) {t_i8:.1f} s, int4 {t_i4:.1f} s")
    Wb = W.bfloat16()
    h = H[-1:].clone()
    modes = {
        "fp32": (lambda: F.linear(h, W), V * D * 4),
        "fp32 oneDNN": (lambda: torch.ops.mkldnn._linear_pointwise(h, W, None, "none", [], ""), V * D * 4),
        "bf16 (approximate)": (lambda: F.linear(h.bfloat16(), Wb), V * D * 2),
        f"int8 {i8.kernel} (approx.)": (lambda: i8.approx_logits(h), i8.compressed_bytes),
        f"exact-int8 {i8.kernel}": (lambda: i8(h), i8.compressed_bytes),
        "int4 g32 (approximate)": (lambda: i4.approx_logits(h), i4.compressed_bytes),
        "exact-int4 g32": (lambda: i4(h), i4.compressed_bytes),
    }
    if i8p is not None:
        modes["int8 int8pack (approx.)"] = (lambda: i8p.approx_logits(h), i8p.compressed_bytes)
        modes["exact-int8 int8pack"] = (lambda: i8p(h), i8p.compressed_bytes)
    bw = read_bandwidth_gbs()
    times = interleaved({k: f for k, (f, _) in modes.items()}, repeats)
    bw2 = read_bandwidth_gbs()
    bw = max(bw, bw2)
    print(f"read bandwidth (1 GiB fp32 sum, best of two runs): {bw:.1f} GB/s; torch threads: "
          f"{torch.get_num_threads()}")
    print(f"{'mode':26s} {'ms/step':>9s} {'vs fp32':>8s} {'MB read':>9s} {'GB/s':>7s} {'of peak':>8s}")
    base = times["fp32"]
    table = rec.table(f"modes_{name}", f"{name}: one decode step of the head alone [{V} x {D}], per mode "
                      f"(read bandwidth {bw:.1f} GB/s in the same run)",
                      ["mode", "ms/step", "vs fp32", "MB read", "GB/s", "of peak"])
    for k, (_, nbytes) in modes.items():
        t = times[k]
        print(f"{k:26s} {t * 1e3:9.2f} {base / t:7.2f}x {nbytes / 1e6:9.1f} {nbytes / t / 1e9:7.1f} "
              f"{nbytes / t / 1e9 / bw:7.0%}")
        table.row([k, f"{t * 1e3:.2f}", f"{base / t:.2f}x", f"{nbytes / 1e6:.1f}", f"{nbytes / t / 1e9:.1f}",
                   f"{nbytes / t / 1e9 / bw:.0%}"], [Figure(k, t * 1e3, "ms", "fp32", base * 1e3)])
    print(f"(exact modes also read the re-scored fp32 rows: ~{D * 4 / 1e3:.1f} kB each)")

    exact_heads = [(f"exact-int8 {i8.kernel}", i8), ("exact-int4 g32", i4)]
    if i8p is not None:
        exact_heads.insert(1, ("exact-int8 int8pack", i8p))
    exactness(W, H, exact_heads, table)

    if alphas:
        alpha_sweep(W, H, calibration, alphas)

    if prefill:
        prefill_times(rec, name, W, Wb, i8, i4, prefill, repeats)

    if show_kernels:
        for M in (1, prefill or 0):
            if not M:
                continue
            print(f"kernels, h [{M}, {D}] x W [{V}, {D}]^T (median ms; max |error| vs fp32 on N(0,1) input):")
            for k, ms, err in kernels(W, M, repeats if M == 1 else max(3, repeats // 5)):
                print(f"  {k:50s} {ms:9.2f} ms  {err:9.2e}")


DECODE_PROMPTS = ["Once upon a time, in a small village by the sea, there lived",
                  "The history of the Roman Empire begins with",
                  "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
                  "The three laws of thermodynamics are",
                  "Dear hiring manager, I am writing to apply for"]


def decode(rec: Recorder, name: str, new_tokens: int, n_prompts: int, modes: list[str]) -> None:
    """End to end greedy decode: transformers' generate() vs lmhead's loop with each head mode (and, for the
    first mode, also on transformers' own body modules instead of the oneDNN linears), same model."""
    from lmhead import load_model
    from lmhead.models.heads import build_head
    from lmhead.sampling import SamplingConfig

    model = load_model(name, progress=False)
    greedy = SamplingConfig(temperature=0.0)
    heads = {m: build_head(model, m) for m in modes}  # compress once; switch by assignment
    fast_body, plain_body = model.body, model.hf_model.base_model
    variants = {f"head={m}": (heads[m], fast_body) for m in modes}
    if fast_body is not plain_body:
        variants[f"head={modes[0]}, transformers body"] = (heads[modes[0]], plain_body)

    def ours(prompt: str, variant: str) -> tuple[float, list[int]]:
        model.head, model.body = variants[variant]
        t0 = time.perf_counter()
        ids = [s.token_id for s in model.generate(prompt, new_tokens, config=greedy)]
        return time.perf_counter() - t0, ids

    def theirs(prompt: str) -> tuple[float, list[int]]:
        enc = model.tokenizer(prompt, return_tensors="pt")
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.hf_model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, temperature=None,
                                          top_k=None, top_p=None, pad_token_id=model.tokenizer.pad_token_id)
        return time.perf_counter() - t0, out[0, enc["input_ids"].shape[1]:].tolist()

    for v in variants:  # warm-up
        ours(DECODE_PROMPTS[0][:20], v)
    theirs(DECODE_PROMPTS[0][:20])
    for head in heads.values():
        if hasattr(head, "reset_stats"):
            head.reset_stats()
    tok = {v: 0 for v in ["transformers", *variants]}
    sec = {v: 0.0 for v in tok}
    same = {v: 0 for v in variants}
    for prompt in DECODE_PROMPTS[:n_prompts]:
        t, ref = theirs(prompt)
        tok["transformers"] += len(ref)
        sec["transformers"] += t
        for v in variants:
            t, ids = ours(prompt, v)
            tok[v] += len(ids)
            sec[v] += t
            same[v] += int(ids == ref)
    print(f"\n## end to end greedy decode, {name}: {n_prompts} prompts x {new_tokens} new tokens, batch 1, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    base = tok["transformers"] / sec["transformers"]
    print(f"{'':48s} {'tokens/s':>9s} {'vs transformers':>16s} {'identical tokens':>17s}")
    print(f"{'transformers generate()':48s} {base:9.2f} {1.0:15.2f}x {'-':>17s}")
    table = rec.table(f"decode_{name}", f"{name}: end-to-end greedy decode, {n_prompts} prompts x {new_tokens} new "
                      "tokens, batch 1, per head", ["", "tokens/s", "vs transformers", "identical tokens"])
    table.row(["transformers generate()", f"{base:.2f}", "1.00x", "-"])
    for v in variants:
        rate = tok[v] / sec[v]
        print(f"{'lmhead, ' + v:48s} {rate:9.2f} {rate / base:15.2f}x {same[v]:>11d}/{n_prompts} prompts")
        table.row([f"lmhead, {v}", f"{rate:.2f}", f"{rate / base:.2f}x", f"{same[v]}/{n_prompts} prompts"],
                  [Figure(f"lmhead, {v}", rate, "tok/s", "transformers generate()", base, rate / base)])
    for m, head in heads.items():
        if hasattr(head, "stats"):
            print(f"{m} stats (all variants with it): {head.stats}")
            table.note(f"{m} stats (all variants with it): {head.stats}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--kernels", action="store_true", help="also time every kernel torch ships")
    p.add_argument("--prefill", type=int, default=0, help="also time N positions at once")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="also run end-to-end greedy decode of N new tokens (lmhead vs transformers)")
    p.add_argument("--decode-prompts", type=int, default=5)
    p.add_argument("--decode-modes", nargs="+", default=["exact-int8", "fp32"])
    p.add_argument("--skip-head", action="store_true", help="only the end-to-end decode")
    p.add_argument("--alphas", nargs="*", type=float, default=None, metavar="A",
                   help="also count the oneDNN head's candidates with column scales of each exponent A")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import psutil

        need = 2.5e9  # Gemma: fp32 weight + bf16 copy + int8 + int4 + the 1 GiB bandwidth probe
        if psutil.virtual_memory().available < need:
            print(f"skipped: needs {need / 2**30:.1f} GiB free")
            return 0
    except ImportError:
        pass
    rec = Recorder("head")
    print(f"{rec.header()}; torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    try:
        for name in args.models:
            if not args.skip_head:
                bench(rec, name, args.repeats, args.kernels, args.prefill, args.alphas)
            if args.decode:
                decode(rec, name, args.decode, args.decode_prompts, args.decode_modes)
    finally:
        rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

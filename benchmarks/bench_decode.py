"""Decode speed: lmhead's generate loop against transformers' generate() on the same loaded model.

    .venv/bin/python benchmarks/bench_decode.py [--model gemma-3-270m] [--new-tokens 64] [--repeats 3]
                                                [--head auto] [--body auto]

Both run under torch.inference_mode on one prompt (batch 1), greedy and sampled (T=0.8, top-k 50, top-p 0.9),
interleaved (lmhead, transformers, transformers, lmhead, ...) so that a busy machine slows both alike; the
table shows medians of tokens/s (generated tokens / wall time, prefill included), their ratio, and where an
lmhead step spends its time (body = the transformer, head = our head, sampling = the pipeline and the
logprobs, text = incremental detokenization). Greedy tokens must be identical to transformers'.
transformers' generate() always runs transformers' own modules (`model.hf_model`); lmhead runs `model.body`
(by default the same weights through oneDNN linears) and `model.head` (by default exact-int8 for Gemma).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _ours(model, prompt: str, n: int, config) -> tuple[float, list[int], dict[str, float]]:
    from lmhead.generate import generate

    profile: dict[str, float] = {}
    t = time.perf_counter()
    ids = [s.token_id for s in generate(model, prompt, n, config=config, profile=profile)]
    return time.perf_counter() - t, ids, profile


def _theirs(model, prompt: str, n: int, sampled: bool) -> tuple[float, list[int]]:
    enc = model.tokenizer(prompt, return_tensors="pt")
    kw = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9) if sampled else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.hf_model.generate(**enc, max_new_tokens=n, pad_token_id=model.tokenizer.pad_token_id, **kw)
    elapsed = time.perf_counter() - t
    return elapsed, out[0, enc["input_ids"].shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="model name, .gguf file or HF folder")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode (default 3)")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--head", default="auto",  # compressed head (issue 7)
                        help="LM head: auto (default), fp32, exact-int8, int8, int4 (see lmhead.compressed)")
    parser.add_argument("--body", default="auto",
                        help="body linears: auto (default: oneDNN), onednn, transformers (models/fast_linear.py)")
    args = parser.parse_args(argv)

    from lmhead.models import load_model
    from lmhead.sampling import SamplingConfig

    model = load_model(args.model, head=args.head, body=args.body)
    modes = {
        "greedy": SamplingConfig(temperature=0.0),
        "sampled": SamplingConfig(temperature=0.8, top_k=50, top_p=0.9),
    }
    # warm-up: first calls pay for lazy initialisation in torch and transformers
    _ours(model, args.prompt, 4, modes["greedy"])
    _theirs(model, args.prompt, 4, sampled=False)

    rows = []
    greedy_same = None
    for mode, config in modes.items():
        ours, theirs, shares = [], [], {}
        for r in range(args.repeats):
            order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
            for who in order:
                if who == "ours":
                    t, ids, profile = _ours(model, args.prompt, args.new_tokens, config)
                    ours.append(len(ids) / t)
                    for k, v in profile.items():
                        shares[k] = shares.get(k, 0.0) + v
                    mine = ids
                else:
                    t, ids = _theirs(model, args.prompt, args.new_tokens, sampled=mode == "sampled")
                    theirs.append(len(ids) / t)
                    hf_ids = ids
            if mode == "greedy":
                same = mine == hf_ids
                greedy_same = same if greedy_same is None else greedy_same and same
                greedy_counts = (sum(a == b for a, b in zip(mine, hf_ids, strict=False)), len(hf_ids))
        total = sum(shares.values())
        rows.append((mode, statistics.median(ours), statistics.median(theirs),
                     {k: v / total for k, v in shares.items()}))

    print(f"model {model.name}, batch 1, {args.new_tokens} new tokens, prompt {args.prompt!r}, "
          f"{args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}, "
          f"head {type(model.head).__name__} ({args.head}, kernel {getattr(model.head, 'kernel', '-')}), "
          f"body {args.body}")
    print(f"{'mode':<9}{'lmhead tok/s':>14}{'transformers tok/s':>20}{'ratio':>8}"
          f"{'body':>8}{'head':>8}{'sampling':>10}{'text':>7}")
    for mode, ours_rate, theirs_rate, share in rows:
        print(f"{mode:<9}{ours_rate:>14.2f}{theirs_rate:>20.2f}{ours_rate / theirs_rate:>7.2f}x"
              f"{share.get('body', 0):>8.0%}{share.get('head', 0):>8.0%}{share.get('sampling', 0):>10.0%}"
              f"{share.get('text', 0):>7.0%}")
    print(f"greedy tokens identical to transformers: {'yes' if greedy_same else 'NO'} "
          f"({greedy_counts[0]}/{greedy_counts[1]} in the last run)")
    return 0 if greedy_same else 1


if __name__ == "__main__":
    sys.exit(main())

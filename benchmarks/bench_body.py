"""The body's linear layers at decode time: transformers' F.linear (MKL) against lmhead's oneDNN linears.

    .venv/bin/python benchmarks/bench_body.py [--model gemma-3-270m] [--repeats 15] [--steps 40]
    .venv/bin/python benchmarks/bench_body.py --dense [--model smollm2-135m] [--prompt-tokens 512]

--dense: the model's float32 weights as a transformers model (`lmhead.Model(hf_model, tokenizer)`), its products
in the kernel's float32 product over those weights (`Model.use_dense`: each row summed in one order whatever the
rows beside it) against torch's (`codes=False`: oneDNN's inner product), alternating rounds: a prompt's prefill
(the time to its first token), the one-token decode steps after it, and whether the greedy tokens agree.

Side by side in one process, medians of interleaved repeats:
  - every nn.Linear of the model's body applied to one token ([1, in] x [out, in]^T, the decode shape), with
    F.linear on torch's threads, F.linear on one thread, and oneDNN (`lmhead.models.fast_linear`); bytes read
    per token, the effective GB/s, and the read bandwidth of a large parallel sum measured in the same run;
  - one decode step of the whole body (KV cache, one new token) with transformers' modules and with
    `Model.body` (the oneDNN linears), and the largest difference of their hidden states.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from bench_head import interleaved  # same folder: run as a script, it is on sys.path
from records import Figure, Recorder


class _Threads:
    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.old)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="model name, .gguf file or HF folder")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats (default 15)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per body timing (default 40)")
    parser.add_argument("--dense", action="store_true",
                        help="the float32 transformers model: the kernel's float32 products against oneDNN's")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="--dense: the prompt's tokens (default 512)")
    parser.add_argument("--rounds", type=int, default=3, help="--dense: alternating rounds (default 3)")
    args = parser.parse_args(argv)
    if args.dense:
        return dense(args)

    from lmhead import load_model
    from lmhead.models.fast_linear import onednn_available

    if not onednn_available():
        print("this torch build has no usable oneDNN linear: nothing to compare")
        return 0
    model = load_model(args.model, head="fp32", progress=False)
    plain = model.hf_model.base_model
    linears = [m for m in plain.modules() if type(m) is torch.nn.Linear]
    xs = {m.in_features: torch.randn(1, m.in_features) for m in linears}
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)

    def f_linear() -> None:
        for m in linears:
            F.linear(xs[m.in_features], m.weight, m.bias)

    def f_linear_1() -> None:
        with _Threads(1):
            f_linear()

    def onednn() -> None:
        for m in linears:
            torch.ops.mkldnn._linear_pointwise(xs[m.in_features], m.weight, m.bias, "none", [], "")

    rec = Recorder("body")
    print(rec.header())
    bw = rec.machine["read_gbs"]
    with torch.inference_mode():
        t = interleaved({"F.linear (MKL)": f_linear, "F.linear, 1 thread": f_linear_1, "oneDNN": onednn},
                        args.repeats)
    print(f"model {model.name}: {len(linears)} linears in the body, {nbytes / 1e6:.1f} MB read per token; "
          f"torch threads {torch.get_num_threads()}; read bandwidth {bw:.1f} GB/s")
    lin = rec.table(f"linears_{model.name}", f"{model.name}: the body's {len(linears)} linears applied to one token "
                    f"({nbytes / 1e6:.1f} MB read)", ["linears, one token", "ms", "vs F.linear", "GB/s", "of peak"])
    for k, s in t.items():
        cells = [k, f"{s * 1e3:.2f}", f"{t['F.linear (MKL)'] / s:.2f}x", f"{nbytes / s / 1e9:.1f}",
                 f"{nbytes / s / 1e9 / bw:.0%}"]
        print(f"{k:24s} {s * 1e3:8.2f} {cells[2]:>12s} {nbytes / s / 1e9:7.1f} {cells[4]:>8s}")
        lin.row(cells, [Figure(k, s * 1e3, "ms", "F.linear (MKL)", t["F.linear (MKL)"] * 1e3)])

    ids = torch.tensor([model.encode("Once upon a time, in a small village by the sea, there lived")])
    bodies = {"transformers modules": plain, "lmhead Model.body (oneDNN)": model.body}
    state = {}
    with torch.inference_mode():
        for k, body in bodies.items():
            cache = model.new_cache()
            body(input_ids=ids, cache=cache, use_cache=True)
            state[k] = [cache, ids.shape[1]]

        def step(k: str):
            def run() -> torch.Tensor:
                cache, pos = state[k]
                out = bodies[k](input_ids=torch.tensor([[1000]]), position_ids=torch.tensor([[pos]]),
                                cache=cache, use_cache=True)
                state[k][1] += 1
                return out.last_hidden_state
            return run

        steps = interleaved({k: step(k) for k in bodies}, args.steps)
        a = bodies["transformers modules"](input_ids=ids).last_hidden_state
        b = bodies["lmhead Model.body (oneDNN)"](input_ids=ids).last_hidden_state
    print(f"{'body, one decode step':28s} {'ms':>8s} {'vs transformers':>16s}")
    base = steps["transformers modules"]
    body = rec.table(f"body_step_{model.name}", f"{model.name}: one decode step of the whole body",
                     ["body, one decode step", "ms", "vs transformers"])
    for k, s in steps.items():
        print(f"{k:28s} {s * 1e3:8.2f} {base / s:15.2f}x")
        body.row([k, f"{s * 1e3:.2f}", f"{base / s:.2f}x"], [Figure(k, s * 1e3, "ms", "transformers modules",
                                                                    base * 1e3)])
    check = (f"max |hidden(oneDNN) - hidden(transformers)| over the prompt: {float((a - b).abs().max()):.2e} "
             f"(largest |hidden| {float(a.abs().max()):.1f})")
    print(check)
    body.note(check)
    rec.write()
    return 0


def dense(args: argparse.Namespace) -> int:
    """--dense: prefill and decode of the model's float32 weights as a transformers model, both products."""
    import os
    import statistics

    from bench_decode import steps_rate, timed_generate
    from bench_server import _long_prompt

    from lmhead import Model, load_model
    from lmhead.sampling import SamplingConfig

    loaded = load_model(args.model, head="fp32", progress=False)
    models = {"kernel float32 (use_dense)": Model(loaded.hf_model, loaded.tokenizer, name=loaded.name),
              "oneDNN (codes=False)": Model(loaded.hf_model, loaded.tokenizer, name=loaded.name, codes=False)}
    if not models["kernel float32 (use_dense)"].dense_matrices:
        print("the kernels are not built here: nothing to compare")
        return 0
    prompt, config = _long_prompt(loaded, args.prompt_tokens), SamplingConfig(temperature=0)
    tokens = len(loaded.encode(prompt))
    rec = Recorder("body")
    print(rec.header())
    got: dict[str, dict[str, list]] = {k: {"prefill": [], "steps": [], "ids": []} for k in models}
    for r in range(args.rounds):
        for k, m in models.items():
            ids, wall, first = timed_generate(m, prompt, args.steps, config)
            got[k]["prefill"].append(tokens / first)
            got[k]["steps"].append(steps_rate(ids, wall, first))
            got[k]["ids"].append(ids)
            print(f"round {r} {k:28s} prefill {tokens / first:7.1f} tok/s, steps {got[k]['steps'][-1]:6.1f} tok/s; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
    base = "oneDNN (codes=False)"
    table = rec.table(f"dense_{loaded.name}", f"{loaded.name}'s float32 weights as a transformers model: a prompt "
                      f"of {tokens} tokens prefilled (to its first token) and {args.steps - 1} one-token decode steps "
                      f"after it, greedy, the kernel's float32 products against oneDNN's, {args.rounds} alternating "
                      "rounds (medians)", ["products", "prefill tok/s", "vs oneDNN", "decode steps tok/s", "vs oneDNN"])
    med = {k: {q: statistics.median(v[q]) for q in ("prefill", "steps")} for k, v in got.items()}
    for k in models:
        table.row([k, f"{med[k]['prefill']:.0f}", f"{med[k]['prefill'] / med[base]['prefill']:.2f}x",
                   f"{med[k]['steps']:.1f}", f"{med[k]['steps'] / med[base]['steps']:.2f}x"],
                  [Figure(f"{k}: prefill", med[k]["prefill"], "tok/s", base, med[base]["prefill"]),
                   Figure(f"{k}: decode steps", med[k]["steps"], "tok/s", base, med[base]["steps"])])
    same = all(a == b for a, b in zip(got["kernel float32 (use_dense)"]["ids"], got[base]["ids"], strict=True))
    table.note(f"greedy tokens equal between the two products in every round: {'yes' if same else 'no'}")
    print(f"greedy tokens equal: {same}")
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

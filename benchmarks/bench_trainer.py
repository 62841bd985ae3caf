"""A transformers Trainer step with lmhead's fused loss (apply_fused_loss) beside the unpatched model's, and
lmhead's generate() processor beside transformers' warpers.

    python benchmarks/bench_trainer.py                       # Gemma 3 270M at 2 x 1024, SmolLM2 at 4 x 1024
    python benchmarks/bench_trainer.py --runs smollm2-135m:2x128 --steps 3      # smaller, quicker
    python benchmarks/bench_trainer.py --sampler-only

Trainer table: each (model, loss) runs in a fresh subprocess (its peak memory is its own), float32 on CPU, a
Trainer step = forward + backward + AdamW, batches of random token ids with labels = ids. Step 1 allocates
AdamW's state and is not timed; the step time is the median of the others. Working memory of a step = peak RSS
during the step − RSS at its start − the gradients it allocates (Trainer frees them after each step): what the
step needs beyond the parameters, gradients and optimizer state. Where it goes: one float32 logits tensor
[B·T, V] is printed beside it, and the difference between the runs in units of that tensor; the patched run's
working memory is the body's activations plus one logits chunk of the fused loss (≤ 256 MiB).

Sampler table: one call of SamplingLogitsProcessor (lmhead's pipeline; draw=True also draws) against
transformers' Temperature → TopK → TopP → MinP warpers + softmax + multinomial on [B, 262144] logits, medians
of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import psutil
import torch

GIB = 2**30


class PeakRSS:
    """This process's peak RSS since reset(), sampled every 2 ms in a thread."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def reset(self) -> int:
        self.peak = rss = self.proc.memory_info().rss
        return rss

    def read(self) -> int:
        return max(self.peak, self.proc.memory_info().rss)


def child(model_name: str, batch: int, seq_len: int, loss: str, steps: int) -> dict:
    """Run `steps` Trainer steps in this process; return times and memory (one JSON object)."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    import lmhead
    from lmhead.integrations.transformers import apply_fused_loss

    loaded = lmhead.load_model(model_name, head="fp32", body="transformers")
    model = loaded.hf_model.train()
    if loss == "lmhead":
        apply_fused_loss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.vocab_size, (batch * steps, seq_len), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    peak = PeakRSS()
    record: list[dict] = []

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            grads_held = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            record.append({"start": peak.reset(), "grads_held": grads_held, "t0": time.perf_counter()})

        def on_pre_optimizer_step(self, args, state, control, **kw):
            record[-1]["grads"] = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            record[-1]["rss_pre_opt"] = peak.proc.memory_info().rss

        def on_step_end(self, args, state, control, **kw):
            record[-1].update(time=time.perf_counter() - record[-1]["t0"], peak=peak.read())

    targs = TrainingArguments(output_dir=os.path.join("/tmp", f"bench_trainer_{os.getpid()}"),
                              per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-5,
                              logging_steps=10**6, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                              disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    timed = record[1:] or record
    working = [r["peak"] - r["start"] - (param_bytes - r["grads_held"]) for r in timed]
    return {"model": loaded.name, "vocab": loaded.vocab_size, "loss": loss, "param_bytes": param_bytes,
            "time": statistics.median(r["time"] for r in timed), "working": max(working),
            "peak": max(r["peak"] for r in record), "logits_bytes": batch * seq_len * loaded.vocab_size * 4}


def trainer_table(runs: list[tuple[str, int, int]], steps: int) -> None:
    print(f"Trainer step (forward + backward + AdamW), float32, CPU, {torch.get_num_threads()} threads; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    head = (f"{'model':>14} {'B x T':>9} {'loss':>7} {'step s':>7} {'working GiB':>12} {'peak RSS GiB':>13}"
            f" {'logits [BT,V] GiB':>18}")
    print(head)
    for name, batch, seq_len in runs:
        res = {}
        for loss in ("lmhead", "plain"):
            need = 4 * 268_098_176 * 4 + (8 * batch * seq_len * 262_144 * 4 if loss == "plain" else 0)
            avail = psutil.virtual_memory().available
            if "gemma" in name and need > avail:
                print(f"{name:>14} {batch}x{seq_len:<7} {loss:>7}  skipped: needs ~{need / GIB:.0f} GiB, "
                      f"{avail / GIB:.1f} GiB available")
                continue
            cmd = [sys.executable, __file__, "--child", name, str(batch), str(seq_len), loss, str(steps)]
            # glibc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold in the heap, where they
            # still count in RSS: a fixed 64 KiB threshold returns every tensor's memory when it is freed
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
            if out.returncode != 0:
                print(f"{name} {loss}: the run failed (exit {out.returncode}; its error is above)")
                continue
            r = res[loss] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{name:>14} {batch}x{seq_len:<7} {loss:>7} {r['time']:>7.2f} {r['working'] / GIB:>12.2f}"
                  f" {r['peak'] / GIB:>13.2f} {r['logits_bytes'] / GIB:>18.2f}")
        if len(res) == 2:
            a, b = res["lmhead"], res["plain"]
            print(f"{'':>14} lmhead/plain: step time {a['time'] / b['time']:.2f}x, working memory "
                  f"{a['working'] / b['working']:.0%}; the plain step holds {(b['working'] - a['working']) / GIB:.2f}"
                  f" GiB more = {(b['working'] - a['working']) / b['logits_bytes']:.1f} logits-sized tensors; "
                  f"lmhead's {a['working'] / GIB:.2f} GiB are the body's activations + one loss chunk")
        print(f"{'':>14} held (not counted): params + grads + AdamW = "
              f"{4 * next(iter(res.values()))['param_bytes'] / GIB:.2f} GiB" if res else "")


def _sampler_calls(x: torch.Tensor, ids: torch.Tensor, cfg, warpers: list) -> dict:
    """The three calls timed: HF's warpers + softmax + multinomial, lmhead drawing, lmhead's logits + HF's draw."""
    from lmhead.integrations.generation import SamplingLogitsProcessor

    ours, ours_logits = SamplingLogitsProcessor(cfg), SamplingLogitsProcessor(cfg, draw=False)

    def hf() -> None:
        s = x
        for w in warpers:
            s = w(ids, s)
        torch.multinomial(torch.softmax(s, dim=-1), 1)

    def draw() -> None:
        ours.reset()
        ours(ids, x)

    def logits() -> None:
        ours_logits.reset()
        torch.multinomial(torch.softmax(ours_logits(ids, x), dim=-1), 1)

    return {"hf": hf, "draw": draw, "logits": logits}


def sampler_table(vocab: int = 262_144, batches: tuple[int, ...] = (1, 8), repeats: int = 15) -> None:
    from transformers.generation import logits_process as lp

    from lmhead.sampling import SamplingConfig

    print(f"\ngenerate() processor, one call on [B, {vocab:,}] float32 logits (temperature 0.8, top-k 50, "
          f"top-p 0.9, min-p 0.05); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'B':>3} {'HF warpers+draw ms':>19} {'lmhead draw=True ms':>20} {'ratio':>6} "
          f"{'lmhead draw=False ms':>21} {'ratio':>6}")
    cfg = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05)
    warpers = [lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(50), lp.TopPLogitsWarper(0.9),
               lp.MinPLogitsWarper(0.05)]
    for b in batches:
        x = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * 3

        fns = _sampler_calls(x, torch.zeros(b, 4, dtype=torch.long), cfg, warpers)
        times = {k: [] for k in fns}
        for _ in range(repeats):  # interleaved: machine noise hits all three alike
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[k].append((time.perf_counter() - t0) * 1e3)
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"{b:>3} {m['hf']:>19.2f} {m['draw']:>20.2f} {m['hf'] / m['draw']:>5.1f}x {m['logits']:>21.2f}"
              f" {m['hf'] / m['logits']:>5.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="gemma-3-270m:2x1024,smollm2-135m:4x1024",
                   help="MODEL:BxT,... (default: the issue's sizes)")
    p.add_argument("--steps", type=int, default=3, help="Trainer steps per run; the first is not timed")
    p.add_argument("--sampler-only", action="store_true")
    p.add_argument("--no-sampler", action="store_true")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        name, b, t, loss, steps = args.child
        print(json.dumps(child(name, int(b), int(t), loss, int(steps))))
        return 0
    if not args.sampler_only:
        runs = []
        for item in args.runs.split(","):
            name, _, size = item.partition(":")
            b, _, t = size.partition("x")
            runs.append((name, int(b), int(t)))
        trainer_table(runs, max(1, args.steps))
    if not args.no_sampler:
        sampler_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A transformers Trainer step with lmhead's fused loss (apply_fused_loss) beside the unpatched model's, and
lmhead's generate() processor beside transformers' warpers.

    python benchmarks/bench_trainer.py                       # Gemma 3 270M at 2 x 1024, SmolLM2 at 4 x 1024
    python benchmarks/bench_trainer.py --runs smollm2-135m:2x128 --steps 3      # smaller, quicker
    python benchmarks/bench_trainer.py --sampler-only

Trainer table: each (model, loss) runs in a fresh subprocess (its peak memory is its own), float32 on CPU, the
model as transformers loads it (its default attention implementation, the same in both runs), a Trainer step =
forward + backward + AdamW, batches of random token ids with labels = ids. Step 1 allocates AdamW's state and is
not timed; the step time is the median of the others. Working memory of a step = the peak over the step of
(RSS − the gradient buffers held at that moment) − RSS at its start: what the step needs beyond the parameters,
gradients and optimizer state (gradients are counted as they appear, by post-accumulate-grad hooks; Trainer
frees them after each step).

Where it goes: during step 1 every tensor autograd saves for backward is counted once (saved_tensors_hooks,
parameters excluded), split into the body's (the transformer layers: inside `model.base_model`) and the rest
(head + loss). The body's saved activations are the same in both runs, so body / plain working memory is the
lowest lmhead/plain ratio any loss can reach with this body; a saved [.., T, T] tensor would mean materialised
attention probabilities (eager attention). One float32 logits tensor [B·T, V] is printed beside it.

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
from records import Figure, Recorder, Table  # same folder: run as a script, it is on sys.path

GIB = 2**30
MIB = 2**20


class PeakRSS:
    """This process's peak of (RSS − gradient bytes held) since reset(), sampled every 2 ms in a thread.

    `grads` (the bytes of .grad tensors now held) is kept by post-accumulate-grad hooks on `params`, so a
    gradient counts as held memory from the moment autograd stores it, not from the start of the step."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.proc = psutil.Process()
        self.params = params
        self.peak = self.peak_working = 0
        self.grads = 0
        self._counted: set[int] = set()
        self._lock = threading.Lock()
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_stored)
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _grad_stored(self, p: torch.Tensor) -> None:
        with self._lock:
            if id(p) not in self._counted:
                self._counted.add(id(p))
                self.grads += p.grad.numel() * p.grad.element_size()

    def _sample(self) -> None:
        rss = self.proc.memory_info().rss
        with self._lock:
            grads = self.grads
        self.peak = max(self.peak, rss)
        self.peak_working = max(self.peak_working, rss - grads)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.002)

    def reset(self) -> int:
        """Start a step: returns its baseline, RSS − gradient bytes held now."""
        with self._lock:
            held = [p for p in self.params if p.grad is not None]
            self._counted = {id(p) for p in held}
            self.grads = sum(p.grad.numel() * p.grad.element_size() for p in held)
        rss = self.proc.memory_info().rss
        self.peak, self.peak_working = rss, rss - self.grads
        return self.peak_working

    def read(self) -> tuple[int, int]:
        """(peak RSS, peak of RSS − gradient bytes) since reset()."""
        self._sample()
        return self.peak, self.peak_working


class SavedForBackward:
    """Bytes autograd saves for backward while active, each storage once, parameters excluded: `body` (saved
    inside `body`'s forward), `rest` (outside it: head + loss), `square` (saved tensors [..., T, T]: attention
    probabilities). Enter with start(), leave with stop() (Trainer callbacks bracket one step)."""

    def __init__(self, model: torch.nn.Module, body: torch.nn.Module, seq_len: int) -> None:
        self.model, self.body, self.seq_len = model, body, seq_len
        self.bytes = {"body": 0, "rest": 0, "square": 0}
        self._depth = 0
        self._seen: set[int] = set()
        self._handles: list = []
        self._ctx = None

    def _enter_body(self, *_: object) -> None:
        self._depth += 1

    def _leave_body(self, *_: object) -> None:
        self._depth -= 1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st.data_ptr()
        if st.nbytes() and key not in self._seen:
            self._seen.add(key)
            self.bytes["body" if self._depth else "rest"] += st.nbytes()
            if t.dim() >= 3 and t.shape[-1] == t.shape[-2] == self.seq_len:
                self.bytes["square"] += st.nbytes()
        return t

    def start(self) -> None:
        self._seen = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._handles = [self.body.register_forward_pre_hook(self._enter_body),
                         self.body.register_forward_hook(self._leave_body)]
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
            for h in self._handles:
                h.remove()


def child(model_name: str, batch: int, seq_len: int, loss: str, steps: int, checkpointing: bool = False) -> dict:
    """Run `steps` Trainer steps in this process; return times, memory and the saved-tensor split (JSON)."""
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
    peak = PeakRSS(params)
    saved = SavedForBackward(model, model.base_model, seq_len)
    record: list[dict] = []

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if not record:
                saved.start()
            record.append({"start": peak.reset(), "t0": time.perf_counter()})

        def on_step_end(self, args, state, control, **kw):
            t = time.perf_counter() - record[-1]["t0"]
            saved.stop()
            rss, working = peak.read()
            record[-1].update(time=t, peak=rss, working=working - record[-1]["start"])

    targs = TrainingArguments(output_dir=os.path.join("/tmp", f"bench_trainer_{os.getpid()}"),
                              per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-5,
                              logging_steps=10**6, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                              disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=checkpointing)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Measure()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    timed = record[1:] or record
    return {"model": loaded.name, "vocab": loaded.vocab_size, "loss": loss, "param_bytes": param_bytes,
            "time": statistics.median(r["time"] for r in timed), "working": max(r["working"] for r in timed),
            "peak": max(r["peak"] for r in record), "logits_bytes": batch * seq_len * loaded.vocab_size * 4,
            "saved_body": saved.bytes["body"], "saved_rest": saved.bytes["rest"],
            "saved_square": saved.bytes["square"], "layers": model.config.num_hidden_layers,
            "attention": str(getattr(model.config, "_attn_implementation", None)), "checkpointing": checkpointing}


def trainer_table(rec: Recorder, runs: list[tuple[str, int, int]], steps: int, checkpointing: bool = False) -> None:
    gc = ", gradient checkpointing in both runs" if checkpointing else ""
    print(f"Trainer step (forward + backward + AdamW{gc}), float32, CPU, {torch.get_num_threads()} threads; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    head = (f"{'model':>14} {'B x T':>9} {'loss':>7} {'step s':>7} {'working GiB':>12} {'peak RSS GiB':>13}"
            f" {'saved: body GiB':>16} {'head+loss GiB':>14}")
    print(head)
    table = rec.table("trainer_checkpointing" if checkpointing else "trainer",
                      f"Trainer step (forward + backward + AdamW{gc}), float32, CPU: lmhead's fused loss against the "
                      "unpatched model's", ["model", "B x T", "loss", "step s", "working GiB", "peak RSS GiB",
                                            "saved: body GiB", "head+loss GiB"])
    for name, batch, seq_len in runs:
        res = {}
        for loss in ("lmhead", "plain"):
            need = 4 * 268_098_176 * 4 + (8 * batch * seq_len * 262_144 * 4 if loss == "plain" else 0)
            avail = psutil.virtual_memory().available
            if "gemma" in name and need > avail:
                print(f"{name:>14} {batch}x{seq_len:<7} {loss:>7}  skipped: needs ~{need / GIB:.0f} GiB, "
                      f"{avail / GIB:.1f} GiB available")
                table.note(f"{name} {batch}x{seq_len} {loss}: skipped, needs ~{need / GIB:.0f} GiB")
                continue
            cmd = [sys.executable, __file__, "--child", name, str(batch), str(seq_len), loss, str(steps),
                   str(int(checkpointing))]
            # glibc keeps freed blocks below its (dynamic, up to 32 MiB) mmap threshold in the heap, where they
            # still count in RSS: a fixed 64 KiB threshold returns every tensor's memory when it is freed
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
            if out.returncode != 0:
                print(f"{name} {loss}: the run failed (exit {out.returncode}; its error is above)")
                continue
            r = res[loss] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{name:>14} {batch}x{seq_len:<7} {loss:>7} {r['time']:>7.2f} {r['working'] / GIB:>12.2f}"
                  f" {r['peak'] / GIB:>13.2f} {r['saved_body'] / GIB:>16.2f} {r['saved_rest'] / GIB:>14.2f}")
            table.row([name, f"{batch}x{seq_len}", loss, f"{r['time']:.2f}", f"{r['working'] / GIB:.2f}",
                       f"{r['peak'] / GIB:.2f}", f"{r['saved_body'] / GIB:.2f}", f"{r['saved_rest'] / GIB:.2f}"])
        if res:
            where_it_goes(res, table, f"{name} {batch}x{seq_len}")


def where_it_goes(res: dict[str, dict], table: Table, run: str) -> None:
    """The lmhead/plain ratios and where the remaining working memory goes (activations vs logits)."""
    any_run = next(iter(res.values()))
    logits, body = any_run["logits_bytes"], any_run["saved_body"]
    square = (f"{any_run['saved_square'] / GIB:.2f} GiB of it [.., T, T] attention probabilities"
              if any_run["saved_square"] else "no [.., T, T] attention tensor saved")
    print(f"{'':>14} where it goes: body activations saved for backward {body / GIB:.2f} GiB = "
          f"{any_run['layers']} layers x {body / any_run['layers'] / MIB:.0f} MiB (attention "
          f"'{any_run['attention']}': {square}); one float32 logits tensor [B*T, V] = {logits / GIB:.2f} GiB")
    if any_run.get("checkpointing"):
        # torch's non-reentrant checkpoint saves through hooks of its own (the innermost hooks win): the layers'
        # inputs it keeps are not in the count, so "body" here is a lower bound
        print(f"{'':>14} (gradient checkpointing: the inputs the checkpoints keep, one [B, T, D] per layer, are "
              f"not in the body count)")
    for loss, r in res.items():
        rest = r["working"] - r["saved_body"]
        print(f"{'':>14} {loss:>7}: working {r['working'] / GIB:.2f} GiB = body activations "
              f"{r['saved_body'] / GIB:.2f} + head/loss and transients {rest / GIB:.2f} GiB "
              f"({rest / logits:.1f} logits-sized tensors; head+loss saved for backward "
              f"{r['saved_rest'] / MIB:.0f} MiB)")
    if len(res) == 2:
        a, b = res["lmhead"], res["plain"]
        line = (f"lmhead/plain: step time {a['time'] / b['time']:.2f}x, working memory "
                f"{a['working'] / b['working']:.0%}; the lowest ratio any loss can reach with this body "
                f"(its activations / plain working memory): {b['saved_body'] / b['working']:.0%}")
        print(f"{'':>14} {line}")
        table.note(f"{run}: {line}")
        table.figures += [Figure(f"{run} step time", a["time"], "s", "unpatched model", b["time"]),
                          Figure(f"{run} working memory", a["working"], "bytes", "unpatched model", b["working"])]
    print(f"{'':>14} held (not counted): params + grads + AdamW = {4 * any_run['param_bytes'] / GIB:.2f} GiB")


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


def sampler_table(rec: Recorder, vocab: int = 262_144, batches: tuple[int, ...] = (1, 8), repeats: int = 15) -> None:
    from transformers.generation import logits_process as lp

    from lmhead.sampling import SamplingConfig

    print(f"\ngenerate() processor, one call on [B, {vocab:,}] float32 logits (temperature 0.8, top-k 50, "
          f"top-p 0.9, min-p 0.05); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'B':>3} {'HF warpers+draw ms':>19} {'lmhead draw=True ms':>20} {'ratio':>6} "
          f"{'lmhead draw=False ms':>21} {'ratio':>6}")
    table = rec.table("sampler", f"generate() processor, one call on [B, {vocab:,}] float32 logits (temperature "
                      "0.8, top-k 50, top-p 0.9, min-p 0.05)", ["B", "HF warpers+draw ms", "lmhead draw=True ms",
                                                                "ratio", "lmhead draw=False ms", "ratio"])
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
        table.row([b, f"{m['hf']:.2f}", f"{m['draw']:.2f}", f"{m['hf'] / m['draw']:.1f}x", f"{m['logits']:.2f}",
                   f"{m['hf'] / m['logits']:.1f}x"],
                  [Figure(f"SamplingLogitsProcessor draw=True, B={b}", m["draw"], "ms", "HF warpers + draw", m["hf"]),
                   Figure(f"SamplingLogitsProcessor draw=False, B={b}", m["logits"], "ms", "HF warpers + draw",
                          m["hf"])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default="gemma-3-270m:2x1024,smollm2-135m:4x1024",
                   help="MODEL:BxT,... (default: the issue's sizes)")
    p.add_argument("--steps", type=int, default=3, help="Trainer steps per run; the first is not timed")
    p.add_argument("--sampler-only", action="store_true")
    p.add_argument("--no-sampler", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="checkpoint the body's layers in both runs (TrainingArguments(gradient_checkpointing=True))")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        name, b, t, loss, steps, gc = (*args.child, "0")[:6]
        print(json.dumps(child(name, int(b), int(t), loss, int(steps), bool(int(gc)))))
        return 0
    rec = Recorder("trainer")
    print(rec.header())
    if not args.sampler_only:
        runs = []
        for item in args.runs.split(","):
            name, _, size = item.partition(":")
            b, _, t = size.partition("x")
            runs.append((name, int(b), int(t)))
        trainer_table(rec, runs, max(1, args.steps), args.gradient_checkpointing)
    if not args.no_sampler:
        sampler_table(rec)
    rec.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

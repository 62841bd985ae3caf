"""A few optimizer steps on a text file with lmhead's loss, beside the same steps with the plain loss.

    python examples/finetune.py FILE [--model gemma-3-270m] [--steps 4] [--seq-len 256] [--batch 1] [--lr 1e-5]

Both runs start from the same weights, see the same batches and use AdamW with the same settings; only the
loss differs:

    lmhead:  loss = model.head.loss(hidden, ids, shift=True)             # linear_cross_entropy, chunked
    plain:   loss = F.cross_entropy(head(hidden)[:, :-1], ids[:, 1:])  # the full [B,T,V] logits

Each runs in a fresh subprocess so that its peak memory is its own. Printed per step: the two losses (they
agree to float32 rounding), and at the end the median step time and the peak resident memory (RSS) of each
process — whole process, and the part above the model, gradients and optimizer state (measured just before
the first step). With --loss lmhead or --loss plain only that run is made, in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

import psutil
import torch
import torch.nn.functional as F


class PeakRSS:
    """Samples this process's RSS every `interval` s in a thread and keeps the maximum."""

    def __init__(self, interval: float = 0.002) -> None:
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRSS:
        self.peak = self.proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def batches(ids: list[int], steps: int, batch: int, seq_len: int) -> list[torch.Tensor]:
    """`steps` batches [batch, seq_len] of consecutive tokens, wrapping around the text if it is short."""
    need = steps * batch * seq_len
    if len(ids) < 2:
        raise SystemExit(f"the text has {len(ids)} token(s); at least 2 are needed")
    reps = -(-need // len(ids))
    flat = torch.tensor((ids * reps)[:need])
    return list(flat.view(steps, batch, seq_len))


def train(args: argparse.Namespace) -> dict:
    """The steps with one loss, in this process. Returns losses, step times and memory."""
    from lmhead import load_model

    torch.manual_seed(0)
    model = load_model(args.model)
    hf, head = model.hf_model, model.head
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    ids = model.tokenizer(text)["input_ids"]
    data = batches(ids, args.steps, args.batch, args.seq_len)
    hf.train()
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    # Allocate gradients and AdamW's state now, so that "above baseline" measures the loss and activations,
    # not these buffers: a step on zero gradients moves no weight (weight_decay=0) and leaves the moments at
    # 0; its step counter is reset, so the optimizer is then exactly a fresh one.
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for state in opt.state.values():
        state["step"].zero_()
    opt.zero_grad(set_to_none=False)
    baseline = psutil.Process().memory_info().rss
    losses, times = [], []
    with PeakRSS() as peak:
        for batch in data:
            t0 = time.perf_counter()
            hidden = hf.base_model(input_ids=batch, use_cache=False).last_hidden_state  # [B,T,D]
            if args.loss == "lmhead":
                loss = head.loss(hidden, batch, shift=True)
            else:
                logits = head(hidden)  # [B,T,V] float32: the tensor lmhead's loss never builds
                vocab = logits.shape[-1]
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), batch[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            print(f"  [{args.loss}] step {len(losses)}: loss {losses[-1]:.6f} ({times[-1]:.2f} s)",
                  file=sys.stderr, flush=True)
    return {"loss": args.loss, "losses": losses, "times": times, "baseline_rss": baseline,
            "peak_rss_steps": peak.peak, "peak_rss_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "model": model.name, "tokens": len(ids), "vocab": model.vocab_size}


def needed_bytes(model_name: str) -> int:
    """Rough need of one run: weights + gradients + two AdamW moments (4 x parameters, fp32) + 1 GiB."""
    params = {"gemma-3-270m": 268_098_176, "smollm2-135m": 134_515_008}.get(model_name, 0)
    return 16 * params + (1 << 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a UTF-8 text file to train on")
    p.add_argument("--model", default="gemma-3-270m", help="gemma-3-270m (default), smollm2-135m, a path")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--loss", choices=["both", "lmhead", "plain"], default="both",
                   help="both (default): each in a fresh subprocess, side by side")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not os.path.isfile(args.file):
        p.error(f"no such file: {args.file}")

    if args.loss != "both":
        result = train(args)
        print(json.dumps(result))
        return 0

    need = needed_bytes(args.model)
    avail = psutil.virtual_memory().available
    if need > avail:
        print(f"skipped: needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
        return 0
    results = {}
    for loss in ("lmhead", "plain"):
        cmd = [sys.executable, __file__, args.file, "--model", args.model, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--loss", loss]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            print(f"the {loss} run failed with exit code {out.returncode} (its error is above)", file=sys.stderr)
            return out.returncode
        results[loss] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results))
        return 0
    ours, plain = results["lmhead"], results["plain"]
    gib = 2**30
    print(f"{ours['model']} (vocab {ours['vocab']:,}) on {args.file} ({ours['tokens']:,} tokens): {args.steps} "
          f"AdamW steps (lr {args.lr:g}), batch {args.batch} x {args.seq_len} tokens")
    print(f"{'step':>4}  {'lmhead loss':>12}  {'plain loss':>12}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(ours["losses"], plain["losses"], strict=True), start=1):
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>8.1e}")
    rows = [
        ("median step time (s)", statistics.median(ours["times"]), statistics.median(plain["times"]), 1),
        ("peak RSS, process (GiB)", ours["peak_rss_process"] / gib, plain["peak_rss_process"] / gib, gib),
        ("peak RSS above model+grads+AdamW (GiB)", (ours["peak_rss_steps"] - ours["baseline_rss"]) / gib,
         (plain["peak_rss_steps"] - plain["baseline_rss"]) / gib, gib),
    ]
    print(f"\n{'':40}  {'lmhead':>8}  {'plain':>8}  {'lmhead/plain':>12}   (runs one after the other: times are"
          " noisy on a shared machine)")
    for name, a, b, _ in rows:
        ratio = f"{a / b:.2f}" if b > 0 else "-"
        print(f"{name:40}  {a:>8.3f}  {b:>8.3f}  {ratio:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fine-tune SmolLM2 with transformers' Trainer and lmhead's fused loss, beside the same run without it.

    python examples/finetune_trainer.py [FILE] [--model smollm2-135m] [--steps 8] [--batch 2] [--seq-len 64]

The one line that matters:

    from lmhead.integrations.transformers import apply_fused_loss
    apply_fused_loss(model)          # model(..., labels=...) -> linear_cross_entropy, logits None

Both runs start from the same weights, see the same batches in the same order and use the same Trainer
settings (AdamW, lr 5e-5, gradient accumulation 2); only the loss differs. Printed: the two loss curves side
by side (they agree to float32 rounding; Trainer logs them rounded) and each run's time. FILE defaults to
examples/data/lm_head.txt, a short text shipped with the example. A few minutes on a laptop CPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_TEXT = Path(__file__).parent / "data" / "lm_head.txt"


def blocks(tokenizer, text: str, seq_len: int) -> list[dict]:
    """The text as consecutive blocks of seq_len token ids (labels = the ids: the model shifts them)."""
    ids = tokenizer(text)["input_ids"]
    if len(ids) < seq_len:
        raise SystemExit(f"the text has {len(ids)} tokens; --seq-len {seq_len} needs more")
    return [{"input_ids": ids[i : i + seq_len], "labels": ids[i : i + seq_len]}
            for i in range(0, len(ids) - seq_len + 1, seq_len // 2)]  # half-overlapping blocks


def run(model, data: list[dict], args: argparse.Namespace, out_dir: str) -> tuple[list[float], float]:
    """Trainer on `data`; returns the logged losses (one per optimizer step) and the wall time."""
    from transformers import PrinterCallback, Trainer, TrainingArguments, default_data_collator

    targs = TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=args.batch, gradient_accumulation_steps=2,
        max_steps=args.steps, learning_rate=5e-5, warmup_steps=0, logging_steps=1, report_to=[], use_cpu=True,
        save_strategy="no", seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=default_data_collator)
    trainer.remove_callback(PrinterCallback)  # the table below prints the losses
    t0 = time.perf_counter()
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", nargs="?", default=str(DEFAULT_TEXT), help="a UTF-8 text (default: the shipped one)")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), gemma-3-270m, a path")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not os.path.isfile(args.file):
        p.error(f"no such file: {args.file}")

    import lmhead
    from lmhead.integrations.transformers import apply_fused_loss

    torch.manual_seed(0)
    loaded = lmhead.load_model(args.model, head="fp32", body="transformers")
    plain = loaded.hf_model.train()
    fused = apply_fused_loss(copy.deepcopy(plain))
    data = blocks(loaded.tokenizer, Path(args.file).read_text(encoding="utf-8"), args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        losses, t_fused = run(fused, data, args, os.path.join(tmp, "lmhead"))
        losses_plain, t_plain = run(plain, data, args, os.path.join(tmp, "plain"))

    print(f"{loaded.name} (vocab {loaded.vocab_size:,}) on {args.file}: {len(data)} blocks of {args.seq_len} "
          f"tokens, {args.steps} AdamW steps of 2 x {args.batch} sequences (Trainer, gradient accumulation 2)")
    print(f"{'step':>4}  {'lmhead loss':>12}  {'plain loss':>12}  {'|diff|':>8}")
    for i, (a, b) in enumerate(zip(losses, losses_plain, strict=True), start=1):
        print(f"{i:>4}  {a:>12.4f}  {b:>12.4f}  {abs(a - b):>8.1e}")
    print(f"time: lmhead {t_fused:.1f} s, plain {t_plain:.1f} s (one after the other; noisy on a shared machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

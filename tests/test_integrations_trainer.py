"""A patched model in transformers' Trainer and TRL's SFTTrainer: real runs of a few steps, with gradient
accumulation, give the unpatched run's losses and final weights (float32 rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tiny import CORPUS, tiny_model  # noqa: E402

from lmhead.integrations.transformers import apply_fused_loss  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread handshakes cost more than the ops


def dataset(tokenizer, n: int = 8):
    """Token-id rows of different lengths (the collator pads them; padding is ignored in the loss)."""
    rows = []
    for i in range(n):
        ids = tokenizer(CORPUS[i % len(CORPUS)])["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return rows


def train(model, tokenizer, tmp_path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        # Adam's first step moves a weight by lr·g/(|g|+ε): where |g| is near ε, a gradient that differs in its
        # last float32 bits (another summation order of the same loss) moves it by up to lr/ε times that; an ε of
        # 1e-6 keeps that within the comparison's tolerance on every CPU's matmul kernels
        adam_epsilon=1e-6)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(tokenizer),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_trainer_steps_equal_the_unpatched_run(tmp_path):
    ref, tokenizer = tiny_model("gemma3", softcap=5.0)
    model = apply_fused_loss(copy.deepcopy(ref))
    losses_ref, weights_ref = train(ref, tokenizer, tmp_path, "ref")
    losses, weights = train(model, tokenizer, tmp_path, "lmhead")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert losses == pytest.approx(losses_ref, rel=1e-4)  # Trainer rounds the logged loss
    for name, w in weights_ref.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-4, atol=1e-5, msg=name)  # two AdamW steps


def test_trl_sft_trainer_runs_with_the_patched_model(tmp_path):
    """TRL's SFTTrainer wraps the model's forward with its own chunked log-prob head (`add_fused_lm_head`,
    called with fused_lm_head=True), so there it, not lmhead, computes the training loss: the patched model must
    train exactly as the unpatched one."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    def run(model, name: str) -> list[float]:
        args = SFTConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, max_steps=2,
                         learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                         seed=0, max_length=32, dataloader_num_workers=0, disable_tqdm=True)
        data = Dataset.from_dict({"text": CORPUS[:8]})
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return [log["loss"] for log in trainer.state.log_history if "loss" in log]

    ref, tokenizer = tiny_model("llama")
    model = apply_fused_loss(copy.deepcopy(ref))
    losses_ref, losses = run(ref, "ref"), run(model, "lmhead")
    assert len(losses) == 2
    assert losses == pytest.approx(losses_ref, rel=1e-4)

"""Conformance: TRL's SFTTrainer as ``trl/scripts/sft.py`` and PEFT's ``examples/sft/train.py`` use it -- the NF4
base handed over with ``peft_config`` (TRL builds the PEFT model), packing, eval and checkpoint saves, TRL's
defaults for bf16 and gradient checkpointing -- plain and with the one line, compared with ``torch.equal``."""

from __future__ import annotations

import pytest

import poros
from conformance_flows import assert_same_files, assert_same_outcome, load, lora_config, outcome, texts, word_tokenizer
from poros.testing import save_tiny_checkpoint

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dataset(seed: int):
    from datasets import Dataset

    return Dataset.from_list([{"text": text} for text in texts(12, seed=seed)])


def run_sft(checkpoint, output_dir, line: str | None) -> dict:
    """``line``: None (plain), ``"prepare_trainer"`` (after construction) or ``"callback"`` (PorosCallback)."""
    model = load(checkpoint, peft_wrap=False)
    args = trl.SFTConfig(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
        seed=11, data_seed=11, disable_tqdm=True, max_length=24, packing=True, dataloader_num_workers=0,
    )  # bf16 and gradient_checkpointing: TRL's defaults (on)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=_dataset(1), eval_dataset=_dataset(2), processing_class=word_tokenizer(),
        peft_config=lora_config(model), callbacks=[poros.PorosCallback()] if line == "callback" else None)
    if line == "prepare_trainer":
        poros.prepare_trainer(trainer)  # the one line: after construction, before train()
    if line is not None:
        assert isinstance(trainer.model, poros.PorosModel)
    trainer.train()
    return outcome(trainer)


@pytest.mark.parametrize(("family", "variant", "line"), [("qwen3", "default", "prepare_trainer"),
                                                         ("gemma4", "e2b", "callback")],
                         ids=["qwen3-prepare_trainer", "gemma4-callback"])
def test_sft_trainer_with_peft_config_is_bitwise(family, variant, line, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    plain = run_sft(checkpoint, tmp_path / "plain", None)
    streamed = run_sft(checkpoint, tmp_path / "poros", line)
    assert plain["trainer"].args.bf16 and plain["trainer"].args.gradient_checkpointing
    assert len(plain["loss"]) == 2 and len(plain["eval_loss"]) == 1
    assert_same_outcome(plain, streamed)
    assert_same_files(tmp_path / "plain" / "checkpoint-2", tmp_path / "poros" / "checkpoint-2",
                      ("adapter_model.safetensors", "optimizer.pt"))

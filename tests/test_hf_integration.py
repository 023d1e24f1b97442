"""`patch_hf_model`: the same HF/PEFT object, streamed in place, trains bitwise — by hand and under HF Trainer."""

from __future__ import annotations

import pytest
import torch
import transformers

import poros
from poros.testing import TINY_VARIANTS, Rows, load_qlora, save_tiny_checkpoint
from test_parity import assert_bitwise, make_batch, train, trainable


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("q3") / "ckpt", "qwen3", seed=7)


def test_patched_model_is_the_same_object_and_trains_bitwise(checkpoint):
    batches = [make_batch(s, 2, 14, "left") for s in range(2)]
    reference = load_qlora(checkpoint, seed=7)
    ref_losses, ref_opt = train(reference, list(trainable(reference).values()), batches)

    model = load_qlora(checkpoint, seed=7)
    handle = poros.patch_hf_model(model)
    losses, opt = train(model, list(trainable(model).values()), batches)  # the PEFT model, called as usual
    assert handle.store.stats.fetches[0] > 0  # it really streamed
    assert_bitwise(reference, model, ref_losses, losses, ref_opt, opt)

    assert handle is model  # patch_hf_model, like prepare, streams the object in place and returns it
    executor, causal_lm = handle.executor, handle.causal_lm
    handle.unpatch()
    assert "forward" not in executor.trunk.__dict__ and "forward" not in causal_lm.__dict__
    assert not hasattr(model, "store") and type(model) is type(reference)
    with torch.no_grad():
        batch = make_batch(9, 2, 14, "right")
        assert torch.equal(reference(**batch, use_cache=False).logits, model(**batch, use_cache=False).logits)



def _trainer_run(model, output_dir):
    rows = []
    for seed in range(8):
        batch = make_batch(seed, 1, 16, "none")
        rows.append({key: value[0] for key, value in batch.items()})
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=11, data_seed=11, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(rows))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, trainer.optimizer


FAMILIES = [(family, variants[0]) for family, variants in TINY_VARIANTS.items()] + [("gemma4", "moe")]


@pytest.mark.parametrize(("family", "variant"), FAMILIES, ids=[f"{f}-{v}" for f, v in FAMILIES])
def test_hf_trainer_with_one_added_line_is_bitwise(family, variant, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    reference = load_qlora(checkpoint, seed=7)
    ref_losses, ref_opt = _trainer_run(reference, tmp_path / "plain")

    model = load_qlora(checkpoint, seed=7)
    poros.patch_hf_model(model)  # the one added line
    losses, opt = _trainer_run(model, tmp_path / "poros")
    assert ref_losses == losses and len(losses) == 3
    ref_params, params = trainable(reference), trainable(model)
    for name in ref_params:
        assert torch.equal(ref_params[name], params[name]), name
        for key, value in ref_opt.state[ref_params[name]].items():
            assert torch.equal(value, opt.state[params[name]][key]), (name, key)


def test_trl_sft_trainer_with_one_added_line_is_bitwise(tmp_path):
    """TRL's SFTTrainer computes the loss with its own fused LM head on the trunk's output:
    streaming the trunk keeps it bitwise too."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1",
                                                     bos_token="t2", unk_token="t3")
    rows = Dataset.from_list([{"input_ids": make_batch(s, 1, 16, "none")["input_ids"][0].tolist()} for s in range(8)])
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "gemma4", "e2b", seed=7)

    def run(streamed: bool, output_dir):
        model = load_qlora(checkpoint, seed=7)
        if streamed:
            poros.patch_hf_model(model)
        args = trl.SFTConfig(
            output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=11, data_seed=11, disable_tqdm=True, max_length=32,
            packing=False, bf16=False,
        )
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e], trainable(model)

    ref_losses, ref_params = run(False, tmp_path / "plain")
    losses, params = run(True, tmp_path / "poros")
    assert ref_losses == losses and len(losses) == 3
    for name in ref_params:
        assert torch.equal(ref_params[name], params[name]), name

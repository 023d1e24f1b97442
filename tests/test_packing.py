"""``packing: true`` (issue 32, data): examples packed into rows of up to ``seq_len`` tokens, kept apart by
their ``position_ids`` restarts (``poros.data.packing``).

* The rows: best-fit decreasing, no example split, positions restarting at 0, each example's first label
  -100, the same loss terms as unpacked; a packed batch has ``position_ids`` and no ``attention_mask``.
* The semantics, on the real transformers model: a packed example's logits are its logits alone (the mask
  transformers builds from the restarts keeps it apart), and a row without restarts would not be.
* Parity: ``PorosTrainer(packing=True)`` (streamed, layer-major) is bitwise a plain HF + PEFT loop over
  the same packed batches, per family: losses, every LoRA tensor and every AdamW state tensor.
* Qwen3.5 refuses it by name (its Gated DeltaNet ignores the restarts).
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from poros.data import BatchIterator, load_dataset
from poros.data.batches import collate, real_tokens
from poros.data.packing import pack_examples
from poros.data.tokenize import IGNORE_INDEX, TokenizedData
from poros.errors import DataError
from poros.testing import all_linear_targets
from poros.training.trainer import PorosTrainer
from test_trainer import (LORA, adapters, assert_same_training_state, chat_file, load_reference_base,  # noqa: F401
                          make_checkpoint, optimizer_states, reference_step, tokenizer)

SEQ_LEN = 64


def _data(lengths):
    examples = [{"input_ids": [100 * i + j for j in range(n)], "labels": [100 * i + j if j else IGNORE_INDEX
                                                                           for j in range(n)]}
                for i, n in enumerate(lengths)]
    return TokenizedData(examples, "text")


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=30), seq_len=st.integers(16, 40))
def test_rows_hold_whole_examples_with_restarting_positions(lengths, seq_len):
    data = _data(lengths)
    packed = pack_examples(data, seq_len)
    assert all(len(row["input_ids"]) <= seq_len for row in packed.examples)
    # every example exactly once, whole: its tokens appear as one run starting at position 0
    seen = []
    for row in packed.examples:
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for start, end in zip(starts, starts[1:]):
            ids = row["input_ids"][start:end]
            assert row["position_ids"][start:end] == list(range(end - start))
            assert row["labels"][start] == IGNORE_INDEX and row["labels"][start + 1:end] == ids[1:]
            seen.append(ids)
    assert sorted(seen) == sorted(example["input_ids"] for example in data.examples)
    # the same loss terms as unpacked
    assert packed.trainable_tokens == data.trainable_tokens and packed.total_tokens == data.total_tokens
    # best fit: no two rows could be merged (first-fit-decreasing bins are more than half full, but one)
    fill = sorted(len(row["input_ids"]) for row in packed.examples)
    assert len(fill) < 2 or fill[0] + fill[1] > seq_len


def test_a_packed_batch_carries_positions_and_no_mask():
    packed = pack_examples(_data([5, 3, 7, 2]), 10)
    batch = collate(packed.examples, pad_token_id=0)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    longest = batch["input_ids"].shape[1]
    for row, example in zip(batch["position_ids"], packed.examples):
        n = len(example["input_ids"])
        assert row[:n].tolist() == example["position_ids"]
        # the padding continues the last example: no restart, so no extra segment; no real token sees it
        assert row[n:].tolist() == list(range(example["position_ids"][-1] + 1, example["position_ids"][-1] + 1 + longest - n))
    assert int(real_tokens(batch, pad_token_id=0)) == 17
    with pytest.raises(DataError, match="more than seq_len=4"):
        pack_examples(_data([5]), 4)


def test_a_packed_example_sees_only_itself(tokenizer):
    """On the real Qwen3 model (sdpa): the logits of an example packed behind another equal its logits alone,
    up to the kernels' shapes; the same row without the restarts (one long sequence) differs."""
    from poros.testing import save_tiny_checkpoint

    torch.manual_seed(0)
    path = save_tiny_checkpoint(__import__("tempfile").mkdtemp(), "qwen3", "default", seed=5, vocab_size=len(tokenizer))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    first, second = torch.randint(5, 500, (1, 9)), torch.randint(5, 500, (1, 6))
    row = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(9), torch.arange(6)])[None]
    with torch.no_grad():
        # use_cache=False, as training runs: transformers reads packing from position_ids only without a cache
        alone = model(input_ids=second, use_cache=False).logits
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[:, 9:]
        joined = model(input_ids=row, use_cache=False).logits[:, 9:]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(joined, alone, atol=1e-3)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "gemma4"])
def test_packed_training_is_bitwise_a_plain_peft_loop(family, tokenizer, chat_file, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", family, tokenizer)
    settings_ = dict(steps=2, seq_len=SEQ_LEN, batch_size=2, grad_accum=2, lr=2e-2, schedule="linear", warmup=0,
                     weight_decay=0.01, max_grad_norm=0.5, seed=11, packing=True)
    trainer = PorosTrainer.from_pretrained(checkpoint, **LORA, seed=11, output_dir=str(tmp_path / "out"))
    result = trainer.train(chat_file, **settings_)

    model = load_reference_base(checkpoint)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=all_linear_targets(model),
                                  task_type="CAUSAL_LM")
    torch.manual_seed(11)
    reference = peft.get_peft_model(model, lora_config)
    reference.train()
    parameters = list(adapters(reference).values())
    optimizer = torch.optim.AdamW(parameters, lr=2e-2, weight_decay=0.01)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=2)
    # the trainer's own tokenizer (the checkpoint's: a family's tiny checkpoint may carry its own chat template)
    data = load_dataset(chat_file, trainer.tokenizer, seq_len=SEQ_LEN, seed=11)
    batches = BatchIterator(pack_examples(data, SEQ_LEN), batch_size=2, pad_token_id=trainer.tokenizer.pad_token_id,
                            seed=11)
    losses, restarts = [], 0
    for _ in range(2):
        micro_batches = [batches.next_batch() for _ in range(2)]
        assert all("attention_mask" not in batch for batch in micro_batches)
        restarts += sum(int((batch["position_ids"][:, 1:] == 0).sum()) for batch in micro_batches)
        losses.append(reference_step(reference, micro_batches, parameters, optimizer, scheduler))
    assert restarts, "the rows must hold more than one example"
    assert result.losses == [float(loss) for loss in losses]
    reference_adapters = adapters(reference)
    assert_same_training_state(reference_adapters, optimizer_states(optimizer, reference_adapters),
                               trainer.model, trainer.optimizer)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_refuses_packing_with_the_reason(family, tokenizer, chat_file, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", family, tokenizer)
    trainer = PorosTrainer.from_pretrained(checkpoint, **LORA, seed=1, output_dir=str(tmp_path / "out"))
    with pytest.raises(DataError, match="Gated DeltaNet .* position_ids restarts"):
        trainer.train(chat_file, steps=1, seq_len=SEQ_LEN, batch_size=1, packing=True)

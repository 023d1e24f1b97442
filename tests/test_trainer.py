"""PorosTrainer end to end on tiny real checkpoints: the saved adapter loads in stock PEFT, training is
bitwise an HF + bitsandbytes + PEFT loop, resuming is bitwise an uninterrupted run, and checkpoints
survive failures mid-save.

Every checkpoint here is a :func:`poros.testing.save_tiny_checkpoint` with the bundled tokenizer
(``poros-tiny-qwen3``, vocab 2048) saved beside it, trained on a small ``.jsonl`` written below.
"""

from __future__ import annotations

import json
import os
import signal

import peft
import pytest
import torch
import transformers

from poros.training import checkpoint as checkpoints
from poros.assets import asset_path
from poros.data import BatchIterator, load_dataset
from poros.errors import OutputDirError
from poros.testing import TINY_VARIANTS, all_linear_targets, save_tiny_checkpoint
from poros.testing.strategies import min_layers
from poros.stream.chunked_loss import use_chunked_loss
from poros.stream.tiling import tile_mlp
from poros.training.trainer import METRIC_FIELDS, PorosTrainer

LORA = {"lora_rank": 4, "lora_alpha": 8}
SEQ_LEN = 32


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """16 short conversations of different lengths: batches of 2 get right padding."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    with path.open("w") as handle:
        for index in range(16):
            answer = f"It is {2 * index + 3}." + " Yes." * (index % 3)
            record = {"messages": [{"role": "user", "content": f"{index} plus {index + 3}?"},
                                   {"role": "assistant", "content": answer}]}
            handle.write(json.dumps(record) + "\n")
    return path


def make_checkpoint(directory, family, tokenizer, variant="default"):
    """The fewest layers that hold every layer kind of the variant (speed), and at least two blocks."""
    path = save_tiny_checkpoint(directory, family, variant, seed=5, vocab_size=len(tokenizer),
                                num_layers=max(2, min_layers(family, variant)))
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory, tokenizer):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3", tokenizer)


def load_reference_base(path):
    """The base loaded the way the parity reference loads it (the same call as poros.testing.load_qlora)."""
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, device_map={"": "cpu"}, dtype=torch.bfloat16,
    )


def adapters(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def optimizer_states(optimizer, named: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {key: value.clone() for key, value in optimizer.state[p].items()} for name, p in named.items()}


def assert_same_training_state(expected_adapters, expected_states, model, optimizer):
    actual = adapters(model)
    assert actual.keys() == expected_adapters.keys() and actual
    differing = [name for name in actual if not torch.equal(actual[name], expected_adapters[name])]
    assert not differing, f"{len(differing)}/{len(actual)} LoRA tensors differ, e.g. {differing[:3]}"
    for name, parameter in actual.items():
        state = optimizer.state[parameter]
        assert state.keys() == expected_states[name].keys()
        for key, value in state.items():
            assert torch.equal(value, expected_states[name][key]), f"AdamW {key} of {name} differs"


def reference_step(reference, micro_batches, parameters, optimizer, scheduler, max_grad_norm=0.5) -> torch.Tensor:
    """One HF-Trainer-style optimizer step of a plain PEFT model over ``micro_batches``: each loss scaled by the
    step's trainable tokens (``num_items_in_batch``), clipped, stepped; the step's loss (their sum)."""
    num_items_in_batch = sum((batch["labels"][..., 1:] != -100).sum() for batch in micro_batches)
    step_loss = 0
    for batch in micro_batches:
        loss = reference(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss
        loss.backward()
        step_loss = step_loss + loss.detach()
    torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


# ---------------------------------------------------------------------------------------------
# Acceptance: from_pretrained -> train -> save -> stock PeftModel.from_pretrained, per family
# ---------------------------------------------------------------------------------------------
FAMILIES = sorted(TINY_VARIANTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_adapter_loads_in_stock_peft_with_equal_logits(family, tmp_path, tokenizer, chat_file):
    checkpoint = make_checkpoint(tmp_path / "ckpt", family, tokenizer)
    trainer = PorosTrainer.from_pretrained(checkpoint, **LORA, output_dir=str(tmp_path / "out"), logging_steps=1,
                                           quantize_experts=False)  # the reference's experts stay bf16
    result = trainer.train(chat_file, steps=2, seq_len=SEQ_LEN, batch_size=1, lr=1e-2)
    assert result.steps == 2 and len(result.losses) == 2 and not result.interrupted
    saved = trainer.save(tmp_path / "adapter")

    files = {p.name for p in saved.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "poros_config.json", "tokenizer.json"} <= files
    assert "config.json" not in files
    adapter_config = json.loads((saved / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(checkpoint)
    record = json.loads((saved / "poros_config.json").read_text())
    assert record["family"] == family and record["steps_done"] == 2 and record["config"]["lora_rank"] == 4
    assert record["guarantee"] in ("bitwise", "numerical", "unverified")

    # stock PEFT on the base loaded the reference way; both in train mode (bitsandbytes repacks NF4
    # weights on some CPUs in eval mode, a different kernel), dropout is 0 so that changes nothing else
    reference = peft.PeftModel.from_pretrained(load_reference_base(checkpoint), saved)
    reference.train()
    batch = BatchIterator(load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN), batch_size=2,
                          pad_token_id=tokenizer.pad_token_id, seed=9).next_batch()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = reference(**inputs, use_cache=False).logits
        actual = trainer.model(**inputs).logits
        with reference.disable_adapter():
            base_only = reference(**inputs, use_cache=False).logits
    assert torch.equal(expected, actual)
    assert not torch.equal(expected, base_only)  # the trained adapter is really in both


# ---------------------------------------------------------------------------------------------
# Parity: PorosTrainer == a plain HF + bitsandbytes + PEFT loop, grad_accum 2, padded batches
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("loss_chunks", "states_on", "mlp_chunks"), [(1, "device", 1), (3, "host", 1), (2, "device", 3)],
                         ids=["hf-loss", "chunked-loss-host-adamw", "tiled-mlp"])
def test_training_is_bitwise_a_plain_peft_loop(qwen3_checkpoint, tokenizer, chat_file, tmp_path, loss_chunks,
                                               states_on, mlp_chunks):
    """loss_chunks > 1: the reference loop uses the same chunked loss (bitwise only against that);
    optimizer_states='host': the reference keeps torch's AdamW on the device; mlp_chunks > 1: the reference
    runs the same tiled MLP (poros.stream.tiling.tile_mlp)."""
    settings = dict(steps=2, seq_len=SEQ_LEN, batch_size=2, grad_accum=2, lr=2e-2, schedule="linear", warmup=0,
                    weight_decay=0.01, max_grad_norm=0.5, seed=11, optimizer_states=states_on)
    trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, seed=11, output_dir=str(tmp_path / "out"),
                                           loss_chunks=loss_chunks, mlp_chunks=mlp_chunks)
    result = trainer.train(chat_file, **settings)
    assert (type(trainer.optimizer).__name__ == "HostAdamW") == (states_on == "host")
    # layer-major accumulation: block 0 crossed the link once per direction per step, not once per micro-batch
    assert trainer.model.store.stats.fetches[0] == 2 * 2

    # the reference: same load, same seed, PEFT's default init, the same batches, HF Trainer's step
    model = load_reference_base(qwen3_checkpoint)
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=all_linear_targets(model),
                                  task_type="CAUSAL_LM")
    torch.manual_seed(11)
    reference = peft.get_peft_model(model, lora_config)
    use_chunked_loss(reference, loss_chunks)
    tile_mlp(reference, mlp_chunks)
    reference.train()
    parameters = list(adapters(reference).values())
    optimizer = torch.optim.AdamW(parameters, lr=2e-2, weight_decay=0.01)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=2)
    batches = BatchIterator(load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN, seed=11), batch_size=2,
                            pad_token_id=tokenizer.pad_token_id, seed=11)
    losses, padded = [], False
    for step in range(2):
        micro_batches = [batches.next_batch() for _ in range(2)]
        padded |= any(bool((batch["attention_mask"] == 0).any()) for batch in micro_batches)
        if step == 0:  # negative control: without num_items_in_batch the reported loss differs
            with torch.no_grad():
                unscaled = sum(reference(**batch, use_cache=False).loss for batch in micro_batches)
        losses.append(reference_step(reference, micro_batches, parameters, optimizer, scheduler))

    assert padded, "the test data must put padding into the batches"
    assert float(unscaled) != float(losses[0])
    # float(float32) is exact, so == on the floats is torch.equal on the losses
    assert result.losses == [float(loss) for loss in losses]
    reference_adapters = adapters(reference)
    assert_same_training_state(reference_adapters, optimizer_states(optimizer, reference_adapters),
                               trainer.model, trainer.optimizer)
    assert trainer.scheduler.get_last_lr() == scheduler.get_last_lr()


# ---------------------------------------------------------------------------------------------
# Resume: N steps + resume + N steps == 2N steps, bit for bit
# ---------------------------------------------------------------------------------------------
RESUME = dict(steps=4, seq_len=SEQ_LEN, batch_size=1, grad_accum=2, lr=2e-2, logging_steps=2, seed=3)


def new_trainer(checkpoint, output_dir):
    # lora_dropout > 0: the dropout masks after a resume depend on the restored torch RNG
    return PorosTrainer.from_pretrained(checkpoint, **LORA, lora_dropout=0.1, seed=3, output_dir=str(output_dir))


@pytest.fixture(scope="module")
def uninterrupted(qwen3_checkpoint, chat_file, tmp_path_factory):
    """4 steps in one go, a checkpoint every 2 steps."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    trainer = new_trainer(qwen3_checkpoint, output_dir)
    result = trainer.train(chat_file, save_steps=2, **RESUME)
    named = adapters(trainer.model)
    return {"result": result, "adapters": {name: p.detach().clone() for name, p in named.items()},
            "optimizer": optimizer_states(trainer.optimizer, named), "lr": trainer.scheduler.get_last_lr(),
            "output_dir": output_dir}


def assert_continues_uninterrupted(run, trainer, result):
    expected = run["result"]
    assert result.steps == 4 and result.losses == expected.losses
    assert_same_training_state(run["adapters"], run["optimizer"], trainer.model, trainer.optimizer)
    assert trainer.scheduler.get_last_lr() == run["lr"]
    timing = {"tokens_per_second", "peak_memory_gb", "h2d_gb_per_s"}
    assert [{k: v for k, v in row.items() if k not in timing} for row in result.log_history] == \
        [{k: v for k, v in row.items() if k not in timing} for row in expected.log_history]


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(uninterrupted, qwen3_checkpoint, chat_file, tmp_path):
    output_dir = uninterrupted["output_dir"]
    assert [p.name for p in checkpoints.list_checkpoints(output_dir)] == ["checkpoint-2", "checkpoint-4"]

    # metrics.jsonl: every field, a row every logging_steps, tokens counted cumulatively
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4] and rows == uninterrupted["result"].log_history
    assert all(set(row) == set(METRIC_FIELDS) for row in rows)
    assert 0 < rows[0]["num_tokens"] < rows[1]["num_tokens"] and rows[0]["peak_memory_kind"] == "process_peak_rss"
    assert all(row["h2d_gb_per_s"] > 0 and row["tokens_per_second"] > 0 for row in rows)  # it streamed

    trainer = new_trainer(qwen3_checkpoint, tmp_path / "resumed")
    result = trainer.train(chat_file, resume_from=output_dir / "checkpoint-2", **RESUME)
    assert_continues_uninterrupted(uninterrupted, trainer, result)
    assert [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()] \
        == [2, 4]


def test_sigint_checkpoints_and_prints_the_resume_command(uninterrupted, qwen3_checkpoint, chat_file, tmp_path,
                                                          monkeypatch, capsys):
    """The interrupt is a real SIGINT sent to this process from a data hook: BatchIterator.next_batch is
    wrapped to signal while step 2 fetches its batch, so step 2 is in flight when it arrives."""
    calls = []
    next_batch = BatchIterator.next_batch

    def signalling_next_batch(self):
        calls.append(1)
        if len(calls) == RESUME["grad_accum"] + 1:  # the first micro-batch of step 2
            os.kill(os.getpid(), signal.SIGINT)
        return next_batch(self)

    handler_before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(BatchIterator, "next_batch", signalling_next_batch)
    output_dir = tmp_path / "out"
    result = new_trainer(qwen3_checkpoint, output_dir).train(chat_file, **RESUME)
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGINT) is handler_before
    assert result.interrupted and result.steps == 2 and result.losses == uninterrupted["result"].losses[:2]
    assert result.last_checkpoint == output_dir / "checkpoint-2"
    assert checkpoints.list_checkpoints(output_dir) == [output_dir / "checkpoint-2"]
    printed = capsys.readouterr().out
    assert "SIGINT" in printed and f"--resume_from {output_dir / 'checkpoint-2'}" in printed
    assert f"train(resume_from='{output_dir / 'checkpoint-2'}')" in printed

    trainer = new_trainer(qwen3_checkpoint, output_dir)
    resumed = trainer.train(chat_file, resume_from="auto", **RESUME)
    assert_continues_uninterrupted(uninterrupted, trainer, resumed)


def test_resume_refuses_a_checkpoint_of_a_different_run(uninterrupted, qwen3_checkpoint, chat_file, tmp_path):
    trainer = new_trainer(qwen3_checkpoint, tmp_path / "out")
    with pytest.raises(Exception, match="grad_accum: checkpoint 2, this run 1") as error:
        trainer.train(chat_file, resume_from=uninterrupted["output_dir"] / "checkpoint-2",
                      **{**RESUME, "grad_accum": 1})
    assert type(error.value).__name__ == "TrainingCheckpointError"
    with pytest.raises(Exception, match="lora_rank") as error:
        trainer.train(chat_file, lora_rank=8)
    assert type(error.value).__name__ == "ConfigError"


# ---------------------------------------------------------------------------------------------
# Atomicity: a failed save leaves the previous checkpoint, and auto-resume picks it
# ---------------------------------------------------------------------------------------------
def test_failed_checkpoint_write_keeps_the_previous_one(qwen3_checkpoint, chat_file, tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    settings = dict(steps=3, seq_len=SEQ_LEN, batch_size=1, save_steps=1, save_total_limit=2)
    trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, output_dir=str(output_dir))
    real_save, saves = torch.save, []

    def failing_save(obj, *args, **kwargs):
        saves.append(args[0])
        if len(saves) == 7:  # the third checkpoint's optimizer.pt: its adapter files are already written
            assert (args[0].parent / "adapter_model.safetensors").is_file()
            raise OSError("disk full")
        return real_save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OutputDirError, match="disk full.*earlier saves are intact"):  # the OSError, as a PorosError
        trainer.train(chat_file, **settings)
    monkeypatch.undo()
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-1", "checkpoint-2", "metrics.jsonl"]
    losses = [json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())["losses"]]

    # what a kill -9 mid-save or a partial copy leaves: neither is ever picked
    (output_dir / ".checkpoint-3.tmp-1-abc123").mkdir()
    (output_dir / "checkpoint-7").mkdir()
    (output_dir / "checkpoint-7" / "adapter_model.safetensors").write_bytes(b"")
    assert checkpoints.latest_checkpoint(output_dir) == output_dir / "checkpoint-2"

    resumed = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, output_dir=str(output_dir))
    result = resumed.train(chat_file, resume_from="auto", **settings)
    assert result.steps == 3 and result.losses[:2] == losses[0]
    # rotation kept the two newest complete ones; the leftover temporary directory is gone
    assert sorted(p.name for p in output_dir.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-7",
                                                            "metrics.jsonl"]


def test_save_over_an_existing_directory(qwen3_checkpoint, chat_file, tmp_path, monkeypatch):
    trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, output_dir=str(tmp_path / "out"))
    target = trainer.save(tmp_path / "adapter")
    first = (target / "adapter_model.safetensors").read_bytes()
    record = json.loads((target / "poros_config.json").read_text())
    assert record["steps_done"] == 0 and "adapter_model.safetensors" in record["files"]
    (target / "notes.txt").write_text("mine")  # not written by save: must survive
    (target / "checkpoint-1").mkdir()
    (target / "stale.bin").write_text("from the previous save")  # written by it: must go
    record["files"].append("stale.bin")
    (target / "poros_config.json").write_text(json.dumps(record))

    trainer.train(chat_file, steps=1, seq_len=SEQ_LEN, batch_size=1, lr=1e-2)

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer write failed")

    monkeypatch.setattr(trainer.tokenizer, "save_pretrained", broken)
    with pytest.raises(RuntimeError, match="tokenizer write failed"):
        trainer.save(target)
    assert (target / "adapter_model.safetensors").read_bytes() == first  # untouched
    monkeypatch.undo()

    trainer.save(target)
    assert (target / "adapter_model.safetensors").read_bytes() != first
    names = sorted(p.name for p in target.iterdir())
    assert "notes.txt" in names and "checkpoint-1" in names and "stale.bin" not in names
    assert "config.json" not in names
    assert json.loads((target / "poros_config.json").read_text())["steps_done"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "out"]  # no temporary left


def test_lora_targets_resolve_through_the_family_descriptor():
    from poros import registry
    from poros.errors import ConfigError
    from poros.testing import tiny_model
    from poros.training.trainer import lora_target_modules

    model = tiny_model("gemma4", "e2b", num_layers=3)
    descriptor = registry.get("gemma4")
    assert lora_target_modules(model, "all-linear") == all_linear_targets(model)
    assert lora_target_modules(model, "default") == list(descriptor.lora_targets_default)
    assert lora_target_modules(model, ["q_proj", "down_proj"]) == ["q_proj", "down_proj"]
    with pytest.raises(ConfigError, match=r"\['qproj'\] match no nn.Linear of this gemma4 model"):
        lora_target_modules(model, ["q_proj", "qproj"])


def test_epochs_train_that_many_passes_under_hf_names_and_resume(tmp_path, qwen3_checkpoint, chat_file):
    """num_train_epochs=2 over 16 examples, 4 per device, 2 micro-batches a step: 2 steps per pass, 4 steps;
    the HF names reach the trainer, the saved config holds the steps the epochs made, and a resume from
    checkpoint-2 with the same epochs finishes the run with the uninterrupted adapter, byte for byte."""
    hf_names = dict(num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    max_seq_length=SEQ_LEN, learning_rate=1e-2, save_steps=2)
    trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, output_dir=str(tmp_path / "run"), logging_steps=1)
    result = trainer.train(chat_file, **hf_names)
    assert result.steps == 4 and len(result.losses) == 4
    assert (trainer.run_config.steps, trainer.run_config.epochs, trainer.run_config.batch_size) == (4, 2.0, 4)
    uninterrupted = (tmp_path / "run" / "checkpoint-4" / "adapter_model.safetensors").read_bytes()
    record = json.loads((tmp_path / "run" / "checkpoint-4" / "poros_config.json").read_text())
    assert (record["config"]["steps"], record["config"]["epochs"]) == (4, 2.0)

    checkpoints.remove_directory(tmp_path / "run" / "checkpoint-4")
    again = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, output_dir=str(tmp_path / "run"), logging_steps=1)
    resumed = again.train(chat_file, **hf_names, resume_from="auto")
    assert resumed.steps == 4
    assert (tmp_path / "run" / "checkpoint-4" / "adapter_model.safetensors").read_bytes() == uninterrupted

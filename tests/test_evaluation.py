"""Evaluation: the eval loss is the resident PEFT model's on the same batches (torch.equal), evaluating never
changes the training run (losses, LoRA tensors, AdamW state, RNG), eval_split holds out the same examples for
the same seed, and a resume in the middle of eval rows continues the uninterrupted run.

Checkpoints are :func:`poros.testing.save_tiny_checkpoint` with the bundled tokenizer beside them.
"""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

from poros.training import evaluation
from poros.assets import asset_path
from poros.config import PorosConfig
from poros.data import BatchIterator, load_dataset
from poros.errors import ConfigError, DataError
from poros.testing import TINY_VARIANTS, all_linear_targets
from test_trainer import make_checkpoint  # the tiny checkpoint with the bundled tokenizer beside it
from poros.training.trainer import METRIC_FIELDS, PorosTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = {"lora_rank": 4, "lora_alpha": 8}
SEQ_LEN = 32
TIMING = {"tokens_per_second", "peak_memory_gb", "h2d_gb_per_s", "eval_runtime"}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))


def write_chat(path, count, offset=0):
    with path.open("w") as handle:
        for index in range(offset, offset + count):
            answer = f"It is {2 * index + 3}." + " Yes." * (index % 3)
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"{index} plus {index + 3}?"},
                                                  {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return write_chat(tmp_path_factory.mktemp("data") / "chat.jsonl", 16)


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    """5 other conversations: batches of 2, 2 and 1 (a short last batch), with right padding."""
    return write_chat(tmp_path_factory.mktemp("eval") / "eval.jsonl", 5, offset=100)


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory, tokenizer):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt", "qwen3", tokenizer)


def adapters(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def training_state(trainer, result):
    named = adapters(trainer.model)
    return {
        "losses": result.losses,
        "adapters": {name: p.detach().clone() for name, p in named.items()},
        "optimizer": {name: {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for name, p in named.items()},
        "lr": trainer.scheduler.get_last_lr(),
        "rng": torch.get_rng_state(),
        "rows": [{k: v for k, v in row.items() if k not in TIMING} for row in result.log_history if "loss" in row],
    }


def assert_same_training(expected, actual):
    assert actual["losses"] == expected["losses"]  # float(float32) is exact: == is torch.equal
    assert actual["adapters"].keys() == expected["adapters"].keys() and actual["adapters"]
    for name, tensor in actual["adapters"].items():
        assert torch.equal(tensor, expected["adapters"][name]), name
        for key, value in actual["optimizer"][name].items():
            assert torch.equal(value, expected["optimizer"][name][key]), f"AdamW {key} of {name}"
    assert actual["lr"] == expected["lr"]
    assert torch.equal(actual["rng"], expected["rng"])
    assert actual["rows"] == expected["rows"]


# ---------------------------------------------------------------------------------------------
# Evaluating leaves the training run bit for bit as it is
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lora_dropout", [0.0, 0.1], ids=["layer-major", "dropout-micro-major"])
def test_a_run_with_evaluation_is_bitwise_the_run_without(qwen3_checkpoint, chat_file, eval_file, tmp_path,
                                                          lora_dropout):
    """With dropout the masks come from the torch RNG: an eval that drew from it would shift every later mask."""
    settings = dict(steps=3, seq_len=SEQ_LEN, batch_size=2, grad_accum=2, lr=2e-2, logging_steps=1, seed=7)
    runs = {}
    for name, eval_settings in {"plain": {}, "eval": {"eval_dataset": str(eval_file), "eval_steps": 1}}.items():
        trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, lora_dropout=lora_dropout, seed=7,
                                               output_dir=str(tmp_path / name))
        result = trainer.train(chat_file, **settings, **eval_settings)
        runs[name] = (training_state(trainer, result), result)
    assert_same_training(runs["plain"][0], runs["eval"][0])

    result = runs["eval"][1]
    eval_rows = [row for row in result.log_history if "eval_loss" in row]
    assert [row["step"] for row in eval_rows] == [1, 2, 3]
    assert all(set(row) == set(evaluation.EVAL_METRIC_FIELDS) for row in eval_rows)
    assert all(row["eval_num_tokens"] > 0 and row["eval_batches"] == 3 for row in eval_rows)
    assert eval_rows[0]["eval_loss"] != eval_rows[-1]["eval_loss"]  # it evaluates the adapter as it trains
    assert result.eval_loss == eval_rows[-1]["eval_loss"]
    assert runs["plain"][1].eval_loss is None and not any("eval_loss" in row for row in runs["plain"][1].log_history)
    on_disk = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == result.log_history
    assert [set(row) == set(METRIC_FIELDS) for row in on_disk] == [True, False] * 3  # train row, then eval row


# ---------------------------------------------------------------------------------------------
# eval_loss == the resident PEFT model's, per family
# ---------------------------------------------------------------------------------------------
def reference_run(checkpoint, chat_file, eval_file, *, steps, lr, seed):
    """An HF + bitsandbytes + PEFT loop (batch 2, no accumulation) with an evaluation after every step."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)  # the family's class, as the trainer loads it
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization,
                                                              device_map={"": "cpu"}, dtype=torch.bfloat16)
    torch.manual_seed(seed)
    reference = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=all_linear_targets(model)))
    # train mode: bitsandbytes repacks NF4 weights on AVX512-BF16 CPUs in eval mode (another kernel);
    # dropout is 0, so nothing else differs
    reference.train()
    parameters = list(adapters(reference).values())
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)  # PorosConfig.weight_decay
    scheduler = transformers.get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=steps)
    batches = BatchIterator(load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN, seed=seed), batch_size=2,
                            pad_token_id=tokenizer.pad_token_id, seed=seed)
    eval_examples = load_dataset(eval_file, tokenizer, seq_len=SEQ_LEN).examples
    eval_batches = [BatchIterator(eval_examples[start:start + 2], batch_size=len(eval_examples[start:start + 2]),
                                  pad_token_id=tokenizer.pad_token_id, shuffle=False).next_batch()
                    for start in range(0, len(eval_examples), 2)]
    assert [len(batch["input_ids"]) for batch in eval_batches] == [2, 2, 1]

    def eval_loss():
        with torch.no_grad():
            items = sum((b["labels"][..., 1:] != -100).sum() for b in eval_batches)
            total = torch.zeros((), dtype=torch.float32)
            for b in eval_batches:
                total = total + reference(**b, num_items_in_batch=items, use_cache=False).loss
        return float(total)

    eval_losses = [eval_loss()]  # before training
    for _ in range(steps):
        batch = batches.next_batch()
        n = (batch["labels"][..., 1:] != -100).sum()
        reference(**batch, num_items_in_batch=n, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        eval_losses.append(eval_loss())
    return eval_losses


@pytest.mark.parametrize("family", sorted(TINY_VARIANTS))
def test_eval_loss_is_the_resident_peft_models(family, tokenizer, chat_file, eval_file, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "ckpt", family, tokenizer)
    trainer = PorosTrainer.from_pretrained(checkpoint, **LORA, seed=3, seq_len=SEQ_LEN, batch_size=2,
                                           quantize_experts=False,  # the reference's experts stay bf16
                                           lora_on_experts=False,  # and carry no LoRA (reference_run)
                                           output_dir=str(tmp_path / "out"))
    before = trainer.evaluate(eval_file)  # the model as from_pretrained leaves it: HF's eval mode
    result = trainer.train(chat_file, steps=2, lr=2e-2, seed=3, eval_dataset=str(eval_file), eval_steps=1)
    expected = reference_run(checkpoint, chat_file, eval_file, steps=2, lr=2e-2, seed=3)
    actual = [before["eval_loss"]] + [row["eval_loss"] for row in result.log_history if "eval_loss" in row]
    assert actual == expected  # exact float32 values: torch.equal
    assert expected[0] != expected[1] != expected[2]
    again = trainer.evaluate()  # the last train()'s eval set
    assert {k: v for k, v in again.items() if k not in TIMING} == \
        {k: v for k, v in result.log_history[-1].items() if k not in TIMING}


# ---------------------------------------------------------------------------------------------
# eval_split, eval_batches, evaluation mode
# ---------------------------------------------------------------------------------------------
def test_eval_split_holds_out_the_same_examples_for_a_seed(tokenizer, chat_file):
    data = load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN)
    train, held = evaluation.hold_out(data, 0.25, seed=1)
    again_train, again_held = evaluation.hold_out(data, 0.25, seed=1)
    assert (train.examples, held.examples) == (again_train.examples, again_held.examples)
    assert len(held) == 4 and len(train) == 12
    key = [json.dumps(example) for example in data.examples]
    assert sorted(key) == sorted(json.dumps(e) for e in train.examples + held.examples)
    assert [key.index(json.dumps(e)) for e in held.examples] == sorted(key.index(json.dumps(e)) for e in held.examples)
    assert evaluation.hold_out(data, 0.25, seed=2)[1].examples != held.examples
    assert len(evaluation.hold_out(data, 0.01, seed=1)[1]) == 1  # at least one
    with pytest.raises(DataError, match="leaves none to train on"):
        evaluation.hold_out(load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN), 0.99, seed=1)


def test_eval_split_trains_on_the_rest_only(qwen3_checkpoint, tokenizer, chat_file, tmp_path):
    """A run with eval_split 0.25 trains exactly as a run on the other 75 % without evaluation."""
    settings = dict(steps=2, seq_len=SEQ_LEN, batch_size=2, lr=2e-2, seed=4, logging_steps=1)
    split = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, seed=4, output_dir=str(tmp_path / "split"))
    result = split.train(chat_file, eval_split=0.25, eval_batches=1, **settings)
    rest, _ = evaluation.hold_out(load_dataset(chat_file, tokenizer, seq_len=SEQ_LEN), 0.25, seed=4)
    plain = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, seed=4, output_dir=str(tmp_path / "plain"))
    expected = plain.train(rest, **settings)
    assert_same_training(training_state(plain, expected), training_state(split, result))
    eval_rows = [row for row in result.log_history if "eval_loss" in row]
    assert [(row["step"], row["eval_batches"]) for row in eval_rows] == [(2, 1)]  # the last step only, 1 batch


def test_evaluation_mode_turns_dropout_off_keeps_4bit_linears_and_restores_every_flag(qwen3_checkpoint, eval_file,
                                                                                       tokenizer, tmp_path):
    trainer = PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, lora_dropout=0.3, seed=3,
                                           output_dir=str(tmp_path))
    model = trainer.model
    model.eval()  # as from_pretrained leaves it: the 4-bit linears must still run in training mode
    with torch.no_grad():  # B != 0, so the adapters (and their dropout) change the output
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    before = [(name, module.training) for name, module in model.named_modules()]
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    linears_4bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit" and
                    type(m).__module__.startswith("bitsandbytes")]
    assert dropouts and linears_4bit
    with evaluation.evaluation_mode(model):
        assert not any(m.training for m in dropouts) and all(m.training for m in linears_4bit)
    assert [(name, module.training) for name, module in model.named_modules()] == before

    config = PorosConfig(eval_dataset=str(eval_file), seq_len=SEQ_LEN, batch_size=2)
    _, eval_set = evaluation.eval_set_for_run(config, None, tokenizer, pad_token_id=tokenizer.pad_token_id)
    first, second = (evaluation.evaluate(model, eval_set.batches, device="cpu", show_progress=False)
                     for _ in range(2))
    assert first.loss == second.loss  # no dropout mask in either
    model.train()
    with torch.no_grad():
        noisy = [model(**eval_set.batches[0], use_cache=False).loss for _ in range(2)]
    assert not torch.equal(*noisy)  # negative control: in training mode the dropout is live


@pytest.mark.parametrize("overrides, message", [
    (["--eval-steps", "5"], "set eval_split (e.g. 0.1) or eval_dataset"),
    (["--eval-split", "1.5"], "a fraction in [0, 1)"),
    (["--eval-split", "0.1", "--eval-dataset", "val.jsonl"], "not both"),
    (["--eval-batches", "0"], "eval_batches=0"),
    (["--report-to", "tensorbord"], "one or more of none, tensorboard"),
    (["--report-to", "none,wandb"], "'none' and 'all' alone"),
])
def test_evaluation_and_tracking_fields_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        PorosConfig().apply_overrides(overrides)
    assert PorosConfig().apply_overrides(["--eval-split", "0.1", "--eval-steps", "50", "--report-to",
                                          "tensorboard,wandb"]).eval_steps == 50


# ---------------------------------------------------------------------------------------------
# Resuming between eval rows
# ---------------------------------------------------------------------------------------------
def test_resume_after_an_eval_row_continues_the_uninterrupted_run(qwen3_checkpoint, chat_file, eval_file, tmp_path):
    """logging every 2 steps, eval every step: checkpoint-1 ends with an eval row, yet the step-2 train row must
    average steps 1 and 2 as the uninterrupted run's does."""
    settings = dict(steps=3, seq_len=SEQ_LEN, batch_size=2, lr=2e-2, seed=6, logging_steps=2, save_steps=1,
                    eval_dataset=str(eval_file), eval_steps=1)

    def new(output_dir):
        return PorosTrainer.from_pretrained(qwen3_checkpoint, **LORA, seed=6, output_dir=str(output_dir))

    whole = new(tmp_path / "whole")
    expected = whole.train(chat_file, **settings)
    resumed = new(tmp_path / "resumed")
    result = resumed.train(chat_file, resume_from=tmp_path / "whole" / "checkpoint-1", **settings)
    assert result.losses == expected.losses
    strip = [{k: v for k, v in row.items() if k not in TIMING} for row in expected.log_history]
    assert [{k: v for k, v in row.items() if k not in TIMING} for row in result.log_history] == strip
    assert [row["step"] for row in expected.log_history] == [1, 2, 2, 3]


# ---------------------------------------------------------------------------------------------
# Acceptance: the command line, on the bundled model and data
# ---------------------------------------------------------------------------------------------
def test_poros_train_with_eval_split_writes_eval_rows_and_a_tensorboard_event_file(tmp_path, child_env):
    """``poros train --eval-split 0.1 --eval-steps 2 --report-to tensorboard`` (4 steps), stdout piped."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = subprocess.run(
        [sys.executable, "-m", "poros.cli.main", "train", "--eval-split", "0.1", "--eval-steps", "2", "--report-to",
         "tensorboard", "--steps", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env=child_env(POROS_LOAD_PLUGINS="", OMP_NUM_THREADS="1"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output_dir = tmp_path / "poros_output"
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    eval_rows = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in eval_rows] == [2, 4]
    assert all(row["eval_batches"] == 40 and row["eval_loss"] > 0 for row in eval_rows)  # 10 % of 400, batch 1
    assert "eval: 40 examples held out of poros-tiny-chat (eval_split 0.1)" in result.stdout
    assert "eval step 2/4 | eval_loss" in result.stdout
    assert "train 1/4 steps (25%) | " in result.stdout  # the plain progress line: stdout is a pipe

    (run,) = (output_dir / "runs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    # float32 in the event file, as in metrics.jsonl: the same values exactly
    assert [(event.step, event.value) for event in events.Scalars("eval/loss")] == \
        [(row["step"], row["eval_loss"]) for row in eval_rows]

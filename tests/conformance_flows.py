"""The client flows the conformance suite runs plain and with the one Poros line, written from what the
real scripts do (not vendored):

* transformers ``examples/pytorch/language-modeling/run_clm.py`` with NF4 + PEFT: tokenize, ``group_texts``
  into ``block_size`` chunks with ``labels = input_ids``, ``Trainer(do_train, do_eval)``, perplexity,
  ``save_model``; the QLoRA loading of PEFT's ``examples/sft/train.py`` (``BitsAndBytesConfig``,
  ``prepare_model_for_kbit_training`` with non-reentrant checkpointing, ``LoraConfig``).
* TRL ``trl/scripts/sft.py`` / PEFT's ``examples/sft/train.py``: ``SFTTrainer(model, args, train_dataset,
  eval_dataset, processing_class, peft_config=...)`` with ``SFTConfig`` (packing, eval, saves).

Every helper builds tiny real models (poros.testing) and returns what the tests compare with ``torch.equal``.
"""

from __future__ import annotations

import json
import pathlib

import peft
import torch
import transformers
from safetensors.torch import load_file

from poros.testing import Rows, all_linear_targets
from test_parity import make_batch

#: one tiny variant per family (the conformance suite runs every family once per flow)
FAMILY_VARIANTS = [("qwen2", "default"), ("qwen3", "default"), ("qwen3_5", "default"), ("gemma3", "default"),
                   ("gemma4", "e2b")]
FAMILY_IDS = [family for family, _ in FAMILY_VARIANTS]


def load(checkpoint, *, seed: int = 7, double_quant: bool = False, quant_type: str = "nf4",
         quant_storage: torch.dtype | None = None, modules_to_save: list[str] | None = None, dropout: float = 0.0,
         kbit: bool = False, peft_wrap: bool = True):
    """QLoRA as the recipes load it: ``BitsAndBytesConfig`` (bf16 compute) -> optional
    ``prepare_model_for_kbit_training`` -> ``get_peft_model(LoraConfig(...))``; ``lora_B`` drawn from a
    seeded generator so adapters matter at step 0 (as poros.testing.load_qlora does)."""
    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=double_quant,
        **({"bnb_4bit_quant_storage": quant_storage} if quant_storage is not None else {}))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, quantization_config=quantization, device_map={"": "cpu"}, dtype=torch.bfloat16)
    keep_cpu_layout(model)
    if kbit:
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    if not peft_wrap:
        return model
    return lora_model(model, seed=seed, modules_to_save=modules_to_save, dropout=dropout)


def lora_model(model, *, seed: int, modules_to_save: list[str] | None = None, dropout: float = 0.0):
    """``get_peft_model`` with :func:`lora_config`, ``lora_B`` drawn from a generator seeded with ``seed``, in
    train mode."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, lora_config(model, modules_to_save=modules_to_save, dropout=dropout))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if ".lora_B." in name:
                parameter.copy_((torch.randn(parameter.shape, generator=generator) * 0.02).to(parameter.dtype))
    model.train()
    return model


def keep_cpu_layout(model) -> None:
    """Keep bitsandbytes from repacking NF4 weights for its AVX512-BF16 CPU inference kernel in no-grad eval
    (both arms): the repack asserts on tiny shapes (N % 32) and leaves later training on another kernel, so
    eval results would depend on the CI machine's CPU. tests/test_conformance_save.py covers the repack."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def lora_config(model, *, modules_to_save=None, dropout: float = 0.0) -> peft.LoraConfig:
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=all_linear_targets(model),
                           modules_to_save=modules_to_save, task_type="CAUSAL_LM")



def rows(count: int, seq: int, *, seed: int = 0) -> Rows:
    """``count`` rows of ``seq`` tokens with ``labels = input_ids`` (HF Trainer's causal-LM input)."""
    out = []
    for s in range(count):
        batch = make_batch(seed + s, 1, seq, "none")
        out.append({key: value[0] for key, value in batch.items()})
    return Rows(out)


def training_args(output_dir, **overrides) -> transformers.TrainingArguments:
    args = dict(output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                learning_rate=1e-2, lr_scheduler_type="constant", optim="adamw_torch", logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, seed=11, data_seed=11, dataloader_num_workers=0,
                disable_tqdm=True)
    args.update(overrides)
    return transformers.TrainingArguments(**args)


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def run_trainer(model, output_dir, *, train_rows, eval_rows=None, line=None, resume_from=None,
                trainer_class=transformers.Trainer, callbacks=None, **overrides):
    """HF Trainer as a user script runs it; ``line(trainer)`` is the one added Poros line (None: plain)."""
    trainer = trainer_class(model=model, args=training_args(output_dir, **overrides), train_dataset=train_rows,
                            eval_dataset=eval_rows, callbacks=callbacks)
    if line is not None:
        line(trainer)
    trainer.train(resume_from_checkpoint=resume_from)
    return outcome(trainer)


def outcome(trainer) -> dict:
    """What a run leaves: logged losses (train and eval), the LoRA tensors, the optimizer state."""
    logs = trainer.state.log_history
    optimizer = trainer.optimizer
    params = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    states = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in params.items()
              if p in optimizer.state}
    return {"loss": [e["loss"] for e in logs if "loss" in e], "eval_loss": [e["eval_loss"] for e in logs
                                                                            if "eval_loss" in e],
            "grad_norm": [e["grad_norm"] for e in logs if "grad_norm" in e], "logs": untimed(logs),
            "params": {name: p.detach().clone() for name, p in params.items()}, "optimizer": states,
            "trainer": trainer}


#: log keys that time the run (the only ones two runs of the same computation may differ in)
TIMING_KEYS = ("_runtime", "_per_second")


def untimed(logs: list[dict]) -> list[dict]:
    """``log_history`` without its timings: the losses, ``grad_norm``, learning rates, TRL's metrics
    (entropy, mean token accuracy, tokens), epochs, steps, ``total_flos``."""
    return [{k: v for k, v in entry.items() if not k.endswith(TIMING_KEYS)} for entry in logs]


def assert_same_outcome(expected: dict, got: dict) -> None:
    assert expected["loss"] == got["loss"] and expected["loss"], (expected["loss"], got["loss"])
    assert expected["eval_loss"] == got["eval_loss"], (expected["eval_loss"], got["eval_loss"])
    assert expected["grad_norm"] == got["grad_norm"], (expected["grad_norm"], got["grad_norm"])
    assert expected["logs"] == got["logs"], (expected["logs"], got["logs"])
    assert expected["params"].keys() == got["params"].keys()
    for name, tensor in expected["params"].items():
        assert torch.equal(tensor, got["params"][name]), name
    assert expected["optimizer"].keys() == got["optimizer"].keys() and expected["optimizer"]
    for name, state in expected["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(value, got["optimizer"][name][key]), (name, key)


def assert_same_files(expected_dir: pathlib.Path, got_dir: pathlib.Path, names=("adapter_model.safetensors",)) -> None:
    """Saved safetensors files hold the same keys and bit-identical tensors; ``optimizer.pt`` the same state."""
    for name in names:
        a, b = pathlib.Path(expected_dir) / name, pathlib.Path(got_dir) / name
        assert a.exists() and b.exists(), (a, b)
        if name.endswith(".safetensors"):
            left, right = load_file(a), load_file(b)
        else:
            left, right = _flat(torch.load(a, weights_only=True)), _flat(torch.load(b, weights_only=True))
        assert left.keys() == right.keys() and left, name
        for key in left:
            assert same_bits(left[key], right[key]), (name, key)


def assert_same_trainer_state(expected_dir: pathlib.Path, got_dir: pathlib.Path) -> None:
    """``trainer_state.json``: the same, but for the timings in its log history."""
    left, right = (json.loads((pathlib.Path(d) / "trainer_state.json").read_text()) for d in (expected_dir, got_dir))
    left["log_history"], right["log_history"] = untimed(left["log_history"]), untimed(right["log_history"])
    assert left == right and left["log_history"], (left, right)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` on the bytes: packed 4-bit weights stored as bf16 (``bnb_4bit_quant_storage``) hold NaN
    patterns, which ``torch.equal`` on the float values calls different from themselves."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() in (2, 4, 8):
        integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(integer), b.contiguous().view(integer))
    return torch.equal(a, b)


def _flat(obj, prefix="") -> dict:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}{i}.").items()}
    return {prefix: torch.tensor(0.0) if obj is None else torch.tensor(float(obj))} \
        if isinstance(obj, (int, float, bool, type(None))) else {}


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t0..t255`` (no download): ``"t5 t9"`` -> ``[5, 9]``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(256)}, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1",
                                                bos_token="t2", unk_token="t3")


def texts(count: int, *, seed: int, low: int = 8, high: int = 24) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [" ".join(f"t{int(t)}" for t in torch.randint(4, 256, (n,), generator=generator)) for n in lengths]


def sft_dataset(seed: int):
    from datasets import Dataset

    return Dataset.from_list([{"text": text} for text in texts(12, seed=seed)])


def run_sft(checkpoint, output_dir, line: str | None, model=None, **overrides) -> dict:
    """TRL's SFT flow; ``line``: None (plain), ``"prepare_trainer"`` (after construction) or ``"callback"``
    (PorosCallback); ``model``: the base to train (default: ``load(checkpoint)``, the recipes' QLoRA load);
    ``overrides``: ``SFTConfig`` fields."""
    import trl

    import poros

    model = load(checkpoint, peft_wrap=False) if model is None else model
    args = trl.SFTConfig(**{**dict(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        per_device_eval_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, report_to=[], use_cpu=True,
        seed=11, data_seed=11, disable_tqdm=True, max_length=24, packing=True, dataloader_num_workers=0,
    ), **overrides})  # bf16 and gradient_checkpointing: TRL's defaults (on)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=sft_dataset(1), eval_dataset=sft_dataset(2),
        processing_class=word_tokenizer(), peft_config=lora_config(model), callbacks=[poros.PorosCallback()] if line == "callback" else None)
    if line == "prepare_trainer":
        poros.prepare_trainer(trainer)  # the one line: after construction, before train()
    if line is not None:
        assert isinstance(trainer.model, poros.PorosModel)
    trainer.train()
    return outcome(trainer)

"""Conformance: HF Trainer flows (a user script, a run_clm-style script) plain and with the one Poros line,
on the tiny model of every family; losses, eval losses, LoRA tensors, optimizer state and saved files compared
with ``torch.equal``."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poros
from conformance_flows import (
    FAMILY_IDS,
    FAMILY_VARIANTS,
    assert_same_files,
    assert_same_outcome,
    assert_same_trainer_state,
    load,
    rows,
    run_trainer,
    texts,
    word_tokenizer,
)
from poros import errors
from poros.testing import save_tiny_checkpoint
from test_parity import make_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: per family, which trainer settings its run switches on: together every one is run on and off
SETTINGS = {
    "qwen2": dict(bf16=False, double_quant=False, dropout=0.0),
    "qwen3": dict(bf16=True, double_quant=True, dropout=0.0),
    "qwen3_5": dict(bf16=True, double_quant=False, dropout=0.1),
    "gemma3": dict(bf16=False, double_quant=True, dropout=0.1),
    "gemma4": dict(bf16=True, double_quant=True, dropout=0.0),
}


@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_trainer_with_prepare_is_bitwise(family, variant, tmp_path):
    """``model = poros.prepare(model)`` before ``Trainer(model=model, ...)``: train with accumulation, eval and a
    checkpoint save, bf16 / double quant / LoRA dropout on or off per family."""
    setting = SETTINGS[family]
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(8, 29), eval_rows=rows(2, 29, seed=100), gradient_accumulation_steps=2,
                bf16=setting["bf16"], eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2)
    options = dict(double_quant=setting["double_quant"], dropout=setting["dropout"])
    plain = run_trainer(load(checkpoint, **options), tmp_path / "plain", **flow)
    streamed = run_trainer(poros.prepare(load(checkpoint, **options)), tmp_path / "poros", **flow)
    assert len(plain["loss"]) == 2 and len(plain["eval_loss"]) == 1
    assert_same_outcome(plain, streamed)
    assert streamed["trainer"].model.store.stats.fetches[0] > 0  # it really streamed
    assert_same_files(tmp_path / "plain" / "checkpoint-2", tmp_path / "poros" / "checkpoint-2",
                      ("adapter_model.safetensors", "optimizer.pt"))


def test_prepare_and_patch_hf_model_give_the_plain_bits(tmp_path):
    """The reported case: tiny Qwen3, batches of 2 x 29 tokens. A wrapper hid the causal LM from the Trainer,
    which then counted num_items_in_batch over unshifted labels (58 instead of 56: loss x 56/58)."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    flow = dict(train_rows=rows(4, 29))
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    prepared = run_trainer(poros.prepare(load(checkpoint)), tmp_path / "prepare", **flow)
    model = load(checkpoint)
    poros.patch_hf_model(model)
    patched = run_trainer(model, tmp_path / "patch", **flow)
    assert_same_outcome(plain, prepared)
    assert_same_outcome(plain, patched)
    for run in (prepared, patched):  # the Trainer sees the model it knows
        trainer = run["trainer"]
        assert trainer._loss_shifts_labels and trainer.model_accepts_loss_kwargs
        assert isinstance(trainer.model, type(plain["trainer"].model)) and isinstance(trainer.model, poros.PorosModel)


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma4", "e2b")], ids=["qwen3", "gemma4"])
def test_checkpoint_save_and_resume_is_bitwise(family, variant, tmp_path):
    """Trainer checkpoints (double quant, bf16) are the plain run's files, and resuming from them continues bitwise."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(8, 29), max_steps=3, save_strategy="steps", save_steps=2, bf16=True)
    outcomes = {}
    for arm, line in (("plain", None), ("poros", poros.prepare_trainer)):
        run_trainer(load(checkpoint, double_quant=True), tmp_path / arm, line=line, **flow)
        outcomes[arm] = run_trainer(load(checkpoint, double_quant=True), tmp_path / f"{arm}-resumed", line=line,
                                    resume_from=str(tmp_path / arm / "checkpoint-2"), **flow)
    assert_same_files(tmp_path / "plain" / "checkpoint-2", tmp_path / "poros" / "checkpoint-2",
                      ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt"))
    assert len(outcomes["plain"]["loss"]) == 3  # steps 1-2 from the checkpoint's history, step 3 trained
    assert_same_outcome(outcomes["plain"], outcomes["poros"])


def test_modules_to_save_is_bitwise(tmp_path):
    """``LoraConfig(modules_to_save=["lm_head", "embed_tokens"])``: full copies trained next to the adapters, their
    gradients accumulated over layer-major windows of 2 micro-batches."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=7, tie_word_embeddings=False)
    flow = dict(train_rows=rows(8, 29), save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)
    options = dict(modules_to_save=["lm_head", "embed_tokens"])
    plain = run_trainer(load(checkpoint, **options), tmp_path / "plain", **flow)
    streamed = run_trainer(load(checkpoint, **options), tmp_path / "poros", line=poros.prepare_trainer, **flow)
    assert any("modules_to_save" in name for name in plain["params"])
    assert_same_outcome(plain, streamed)
    assert _windows(streamed) == 2
    assert_same_files(tmp_path / "plain" / "checkpoint-2", tmp_path / "poros" / "checkpoint-2")


def _clm_rows(tokenizer, block_size: int, seed: int):
    """run_clm's preprocessing: tokenize, concatenate, cut into ``block_size`` blocks, ``labels = input_ids``."""
    tokenized = tokenizer(texts(12, seed=seed))["input_ids"]
    concatenated = [token for ids in tokenized for token in ids]
    total = (len(concatenated) // block_size) * block_size
    blocks = [concatenated[i: i + block_size] for i in range(0, total, block_size)]
    from conformance_flows import Rows

    return Rows([{"input_ids": torch.tensor(b), "attention_mask": torch.ones(len(b), dtype=torch.long),
                  "labels": torch.tensor(b)} for b in blocks])


@pytest.mark.parametrize(("family", "variant"), [("qwen3_5", "default"), ("gemma3", "default")],
                         ids=["qwen3_5", "gemma3"])
def test_run_clm_style_script_is_bitwise(family, variant, tmp_path):
    """run_clm with NF4 + PEFT (kbit preparation, non-reentrant checkpointing): train, evaluate (perplexity),
    save_model -- the added line is ``poros.prepare_trainer(trainer)``."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    tokenizer = word_tokenizer()
    train_rows, eval_rows = _clm_rows(tokenizer, 24, seed=1), _clm_rows(tokenizer, 24, seed=2)
    results = {}
    for arm, line in (("plain", None), ("poros", poros.prepare_trainer)):
        model = load(checkpoint, kbit=True)
        trainer = transformers.Trainer(
            model=model, train_dataset=train_rows, eval_dataset=eval_rows, processing_class=tokenizer,
            data_collator=transformers.default_data_collator,
            args=transformers.TrainingArguments(
                output_dir=str(tmp_path / arm), max_steps=2, per_device_train_batch_size=2,
                per_device_eval_batch_size=2, gradient_checkpointing=True,
                gradient_checkpointing_kwargs={"use_reentrant": False}, learning_rate=1e-2, logging_steps=1,
                report_to=[], use_cpu=True, seed=11, save_strategy="no", disable_tqdm=True))
        if line is not None:
            line(trainer)
        trainer.train()
        metrics = trainer.evaluate()
        trainer.save_model()
        results[arm] = (trainer, metrics)
    (plain, plain_metrics), (streamed, metrics) = results["plain"], results["poros"]
    assert plain_metrics["eval_loss"] == metrics["eval_loss"] and math.isfinite(math.exp(metrics["eval_loss"]))
    assert [e["loss"] for e in plain.state.log_history if "loss" in e] == \
        [e["loss"] for e in streamed.state.log_history if "loss" in e]
    assert_same_files(tmp_path / "plain", tmp_path / "poros")


def test_autocast_forward_and_recompute_are_bitwise(tmp_path):
    """``torch.autocast`` around the forward with fp32 LoRA weights (PEFT's upcast): autocast changes the ops, and
    the recompute in backward must run under the forward's autocast state, as torch.utils.checkpoint does."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "gemma4", "e2b", seed=7)
    batch = make_batch(3, 2, 16, "left")
    grads = []
    for streamed in (False, True):
        model = load(checkpoint)
        assert any(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        if streamed:
            poros.prepare(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (ref_loss, ref_grads), (loss, got) = grads
    assert torch.equal(ref_loss, loss)
    for name, grad in ref_grads.items():
        assert grad is not None and torch.equal(grad, got[name]), name


def test_torch_compile_is_refused_with_the_workaround(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    with pytest.raises(errors.TorchCompileError, match="torch_compile=False"):
        poros.prepare(torch.compile(load(checkpoint)))
    model = load(checkpoint)
    model.compile()  # nn.Module.compile: in place
    with pytest.raises(errors.TorchCompileError, match="torch.compile"):
        poros.prepare(model)
    trainer = transformers.Trainer(model=load(checkpoint), train_dataset=rows(2, 8),
                                   args=transformers.TrainingArguments(
                                       output_dir=str(tmp_path / "out"), torch_compile=True, use_cpu=True,
                                       report_to=[]))
    with pytest.raises(errors.TorchCompileError, match="torch_compile=True.*torch_compile=False"):
        poros.prepare_trainer(trainer)
    assert not isinstance(trainer.model, poros.PorosModel)  # refused before any weight moved


# ---------------------------------------------------------------------------------------------
# Gradient accumulation, layer-major: prepare_trainer / PorosCallback drive each window as one forward_backward
# ---------------------------------------------------------------------------------------------
def _windows(run) -> int:
    """How many accumulation windows the run's trainer ran layer-major."""
    return run["trainer"]._poros_window.windows_run


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("family", "variant"), FAMILY_VARIANTS, ids=FAMILY_IDS)
def test_accumulation_windows_run_layer_major_and_bitwise(family, variant, bf16, tmp_path):
    """Two epochs of 5 micro-batches with ``gradient_accumulation_steps=3``: each epoch ends mid-window (windows
    of 3 and 2), eval and checkpoint saves between steps; losses, grad_norm, eval losses, LoRA and AdamW tensors
    and the saved files are the plain run's bits, and every window ran layer-major."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(10, 29), eval_rows=rows(2, 29, seed=100), gradient_accumulation_steps=3,
                max_steps=-1, num_train_epochs=2, bf16=bf16, eval_strategy="steps", eval_steps=2,
                save_strategy="steps", save_steps=2)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    streamed = run_trainer(load(checkpoint), tmp_path / "poros", line=poros.prepare_trainer, **flow)
    assert len(plain["loss"]) == 4 and len(plain["eval_loss"]) == 2 and len(plain["grad_norm"]) == 4
    assert_same_outcome(plain, streamed)
    assert _windows(streamed) == 4 and streamed["trainer"]._poros_window.reason is None
    for step in ("checkpoint-2", "checkpoint-4"):
        assert_same_files(tmp_path / "plain" / step, tmp_path / "poros" / step,
                          ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt"))
        assert_same_trainer_state(tmp_path / "plain" / step, tmp_path / "poros" / step)


def test_a_window_of_one_runs_layer_major_when_the_boundary_states_wait_on_the_host(tmp_path):
    """Without accumulation a window has nothing to share, but only ``forward_backward`` puts the boundary
    states where the plan said (the Trainer's own step keeps them on the device: issue 43's 128K OOM). With
    them on the host every window of one runs layer-major, the plain run's bits."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    flow = dict(train_rows=rows(3, 29), gradient_accumulation_steps=1, max_steps=3)
    plain = run_trainer(load(checkpoint), tmp_path / "plain", **flow)
    streamed = run_trainer(load(checkpoint), tmp_path / "poros", **flow,
                           line=lambda trainer: poros.prepare_trainer(trainer, boundary_states="host"))
    assert_same_outcome(plain, streamed)
    assert _windows(streamed) == 3
    on_device = run_trainer(load(checkpoint), tmp_path / "device", line=poros.prepare_trainer, **flow)
    assert _windows(on_device) == 0  # on the device: the Trainer's own step, as before


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma4", "e2b")], ids=["qwen3", "gemma4"])
def test_accumulation_fetches_each_block_twice_per_optimizer_step(family, variant, tmp_path):
    """Layer-major: each streamed block crosses to the device once per direction per optimizer step (the last
    block once: backward starts with it), where the micro-major fallback fetches it per micro-batch."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    steps, micro = 2, 4
    flow = dict(train_rows=rows(2 * steps * micro, 29), gradient_accumulation_steps=micro, max_steps=steps)
    fetches = {}
    for arm, dropout in (("layer-major", 0.0), ("micro-major", 0.1)):
        run = run_trainer(load(checkpoint, dropout=dropout), tmp_path / arm, line=poros.prepare_trainer, **flow)
        fetches[arm] = run["trainer"].model.store.stats.fetches
        assert _windows(run) == (steps if arm == "layer-major" else 0)
    blocks = len(fetches["layer-major"])
    assert fetches["layer-major"] == [2 * steps] * (blocks - 1) + [steps]
    assert fetches["micro-major"] == [2 * steps * micro] * (blocks - 1) + [steps * micro]


def test_the_flops_count_walks_the_model_once_per_window_and_counts_the_same(tmp_path, monkeypatch):
    """HF Trainer adds ``floating_point_ops`` after every micro-batch, each a walk of every module and parameter
    (``num_parameters``) while the device sits idle; under ``prepare_trainer`` a window walks once, and
    ``total_flos`` (in the logs and ``trainer_state.json``) is the plain run's."""
    from transformers.modeling_utils import ModuleUtilsMixin

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    steps, micro = 2, 4
    flow = dict(train_rows=rows(steps * micro, 29), gradient_accumulation_steps=micro, max_steps=steps,
                save_strategy="steps", save_steps=steps)
    walks = []
    hf_count = ModuleUtilsMixin.num_parameters

    def counting(self, only_trainable=False, exclude_embeddings=False):
        walks.append(exclude_embeddings)
        return hf_count(self, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)

    def count_from_here(trainer):
        walks.clear()
        monkeypatch.setattr(ModuleUtilsMixin, "num_parameters", counting)

    plain = run_trainer(load(checkpoint), tmp_path / "plain", line=count_from_here, **flow)
    plain_walks = list(walks)
    monkeypatch.setattr(ModuleUtilsMixin, "num_parameters", hf_count)
    streamed = run_trainer(load(checkpoint), tmp_path / "poros",
                           line=lambda trainer: (poros.prepare_trainer(trainer), count_from_here(trainer)), **flow)
    assert _windows(streamed) == steps
    assert plain_walks.count(True) == steps * micro  # one walk per micro-batch: the Trainer's own
    assert walks.count(True) == steps  # one a window
    assert_same_outcome(plain, streamed)
    assert plain["trainer"].state.total_flos == streamed["trainer"].state.total_flos > 0
    assert_same_trainer_state(tmp_path / "plain" / f"checkpoint-{steps}", tmp_path / "poros" / f"checkpoint-{steps}")


@pytest.mark.parametrize("line", ["plain", "prepare_trainer", "PorosCallback"])
def test_del_trainer_frees_the_trainer_and_its_optimizer_state(line, tmp_path):
    """As in a plain run, dropping the last reference to the trainer frees it and its optimizer state at once:
    the line adds no reference cycle (one waits for Python's collector, and the device memory with it)."""
    import gc
    import weakref

    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    flow = dict(train_rows=rows(8, 29), gradient_accumulation_steps=2, max_steps=2)
    lines = {"plain": None, "prepare_trainer": poros.prepare_trainer, "PorosCallback": None}
    callbacks = [poros.PorosCallback()] if line == "PorosCallback" else None
    run = run_trainer(load(checkpoint), tmp_path / line, line=lines[line], callbacks=callbacks, **flow)
    if line != "plain":
        assert _windows(run) == 2
    trainer = weakref.ref(run["trainer"])
    state = [weakref.ref(t) for values in run["trainer"].optimizer.state.values() for t in values.values()
             if isinstance(t, torch.Tensor)]
    assert state
    gc.collect()
    gc.disable()  # only reference counts from here
    try:
        del run
        assert trainer() is None
        assert all(tensor() is None for tensor in state)
    finally:
        gc.enable()


def test_the_step_sets_training_mode_once_per_window_and_stays_bitwise(tmp_path, monkeypatch):
    """HF Trainer's ``training_step`` begins with ``model.train()``, a walk of every module; a layer-major window
    calls the step twice per micro-batch with the device idle, so under ``prepare_trainer`` a window walks once
    (``poros.dropin.train_mode``). An evaluation after every window puts the model in eval mode: the next
    window's first call must walk again. (An active dropout runs windows micro-major, so none is drawn here.)"""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    steps, micro = 2, 4
    flow = dict(train_rows=rows(steps * micro, 29), eval_rows=rows(2, 29, seed=100), gradient_accumulation_steps=micro,
                max_steps=steps, eval_strategy="steps", eval_steps=1, save_strategy="no")
    walks: list[tuple[int, bool]] = []
    module_train = torch.nn.Module.train

    def counting(self, mode=True):
        walks.append((id(self), bool(mode)))
        return module_train(self, mode)

    monkeypatch.setattr(torch.nn.Module, "train", counting)
    arms = {}
    for arm, line in (("plain", None), ("poros", poros.prepare_trainer)):
        walks.clear()
        arms[arm] = run_trainer(load(checkpoint), tmp_path / arm, line=line, **flow)
        leaf = next(m for name, m in arms[arm]["trainer"].model.named_modules() if name.endswith("lora_A.default"))
        arms[arm]["walks"] = [mode for key, mode in walks if key == id(leaf)]
    assert _windows(arms["poros"]) == steps
    # every micro-batch's step sets training mode, each evaluation eval mode (and the Trainer's end of training)
    assert arms["plain"]["walks"].count(True) >= steps * micro
    assert arms["poros"]["walks"].count(True) == arms["plain"]["walks"].count(True) - steps * (micro - 1)
    assert arms["poros"]["walks"].count(False) == arms["plain"]["walks"].count(False) >= steps
    assert not arms["poros"]["trainer"].model.__dict__.get("train")  # the window's stand-in is gone after it
    assert_same_outcome(arms["plain"], arms["poros"])


@pytest.mark.parametrize(("family", "variant"), [("qwen3", "default"), ("gemma4", "e2b")], ids=["qwen3", "gemma4"])
def test_accumulation_save_and_resume_is_bitwise(family, variant, tmp_path):
    """``gradient_accumulation_steps=2`` over 5 micro-batches an epoch (the third window one micro-batch), bf16,
    double quant: the checkpoints are the plain run's files, and resuming mid-epoch continues bitwise."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=7)
    flow = dict(train_rows=rows(10, 29), gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=2,
                save_strategy="steps", save_steps=2, bf16=True)
    outcomes = {}
    for arm, line in (("plain", None), ("poros", poros.prepare_trainer)):
        first = run_trainer(load(checkpoint, double_quant=True), tmp_path / arm, line=line, **flow)
        outcomes[arm] = run_trainer(load(checkpoint, double_quant=True), tmp_path / f"{arm}-resumed", line=line,
                                    resume_from=str(tmp_path / arm / "checkpoint-2"), **flow)
        if line is not None:
            assert _windows(first) == 4 and _windows(outcomes[arm]) == 2  # windows of one micro-batch: micro-major
    for step in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        assert_same_files(tmp_path / "plain" / step, tmp_path / "poros" / step,
                          ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt"))
        assert_same_trainer_state(tmp_path / "plain" / step, tmp_path / "poros" / step)
    assert len(outcomes["plain"]["loss"]) == 6  # steps 1-2 from the checkpoint's history, 3-6 trained
    assert_same_outcome(outcomes["plain"], outcomes["poros"])
    assert_same_files(tmp_path / "plain-resumed" / "checkpoint-6", tmp_path / "poros-resumed" / "checkpoint-6",
                      ("adapter_model.safetensors", "optimizer.pt"))


class _OwnLossTrainer(transformers.Trainer):
    """A user's subclass with its own ``compute_loss`` (here the Trainer's, rescaled): Poros cannot know it is
    safe to run twice per micro-batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * 0.5


def _patched_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    return _TRAINER_COMPUTE_LOSS(self, model, inputs, return_outputs, num_items_in_batch)


_TRAINER_COMPUTE_LOSS = transformers.Trainer.compute_loss


@pytest.mark.parametrize("case", ["dropout", "custom compute_loss", "patched compute_loss", "callback on_substep_end"])
def test_fallback_is_micro_major_bitwise_and_said_once(case, tmp_path, caplog, monkeypatch):
    """Where a window cannot be driven layer-major, the Trainer runs it (micro-major, bitwise) and one warning on
    the ``poros`` logger names the reason, however many windows follow."""
    if case == "patched compute_loss":  # as a library patching the Trainer class would (both arms)
        monkeypatch.setattr(transformers.Trainer, "compute_loss", _patched_compute_loss)
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3", seed=7)
    options = dict(dropout=0.1) if case == "dropout" else {}
    flow = dict(train_rows=rows(12, 29), gradient_accumulation_steps=2, max_steps=3,
                trainer_class=_OwnLossTrainer if case == "custom compute_loss" else transformers.Trainer,
                callbacks=[_SubstepCallback()] if case == "callback on_substep_end" else None)
    plain = run_trainer(load(checkpoint, **options), tmp_path / "plain", **flow)
    with caplog.at_level(logging.WARNING, logger="poros"):
        streamed = run_trainer(load(checkpoint, **options), tmp_path / "poros", line=poros.prepare_trainer, **flow)
    said = [r.getMessage() for r in caplog.records if "micro-major" in r.getMessage()]
    expected = {"dropout": "dropout is active", "custom compute_loss": "_OwnLossTrainer.compute_loss",
                "patched compute_loss": "Trainer.compute_loss is patched",
                "callback on_substep_end": "_SubstepCallback.on_substep_end"}[case]
    assert len(said) == 1 and expected in said[0], said
    assert _windows(streamed) == 0
    assert_same_outcome(plain, streamed)


class _SubstepCallback(transformers.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        return control


class _Recorder(transformers.TrainerCallback):
    """What a user's callback sees: each event with the step, and at ``on_pre_optimizer_step`` the gradients."""

    def __init__(self):
        self.events, self.grads = [], []

    def _note(self, name, state):
        self.events.append((name, state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self._note("step_begin", state)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._note("pre_optimizer_step", state)
        self.grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])

    def on_step_end(self, args, state, control, **kwargs):
        self._note("step_end", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, tuple(sorted(k for k in logs if not k.endswith("runtime")
                                                                  and not k.endswith("per_second")))))

    def on_evaluate(self, args, state, control, **kwargs):
        self._note("evaluate", state)

    def on_save(self, args, state, control, **kwargs):
        self._note("save", state)


def test_callback_drives_the_windows_of_its_trainer(tmp_path):
    """``callbacks=[poros.PorosCallback()]``: the callback finds the trainer it belongs to and drives its windows
    as prepare_trainer does; a user's callback sees the same events, steps and gradients as in the plain run."""
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=7)
    flow = dict(train_rows=rows(8, 29), eval_rows=rows(2, 29, seed=100), gradient_accumulation_steps=2, max_steps=2,
                bf16=True, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1)
    seen = {"plain": _Recorder(), "poros": _Recorder()}
    plain = run_trainer(load(checkpoint), tmp_path / "plain", callbacks=[seen["plain"]], **flow)
    streamed = run_trainer(load(checkpoint), tmp_path / "poros", callbacks=[poros.PorosCallback(), seen["poros"]],
                           **flow)
    assert isinstance(streamed["trainer"].model, poros.PorosModel) and _windows(streamed) == 2
    assert_same_outcome(plain, streamed)
    assert seen["plain"].events == seen["poros"].events and ("evaluate", 1) in seen["plain"].events
    assert len(seen["poros"].grads) == 2
    for expected, got in zip(seen["plain"].grads, seen["poros"].grads):
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(accumulation=st.integers(1, 4), micro_batches=st.integers(2, 7), batch=st.integers(1, 2),
       seq=st.integers(9, 33), bf16=st.booleans())
def test_drawn_accumulation_windows_are_bitwise(accumulation, micro_batches, batch, seq, bf16, tmp_path_factory):
    """Hypothesis draws the accumulation, the epoch's micro-batches (so where it ends mid-window), the batch
    and sequence sizes and bf16; one epoch with the line is the plain run's bits."""
    root = tmp_path_factory.mktemp("drawn")
    checkpoint = save_tiny_checkpoint(root / "ckpt", "qwen2", seed=7)
    flow = dict(train_rows=rows(micro_batches * batch, seq), per_device_train_batch_size=batch,
                gradient_accumulation_steps=accumulation, max_steps=-1, num_train_epochs=1, bf16=bf16)
    plain = run_trainer(load(checkpoint), root / "plain", **flow)
    streamed = run_trainer(load(checkpoint), root / "poros", line=poros.prepare_trainer, **flow)
    assert_same_outcome(plain, streamed)
    full, rest = divmod(micro_batches, accumulation)
    assert _windows(streamed) == (full if accumulation > 1 else 0) + (rest > 1)

"""The Trainer arms: TRL's ``SFTTrainer`` and HF's ``Trainer`` as a user script runs them, plain (the model
resident, HF gradient checkpointing) and with the one added line, ``poros.prepare_trainer(trainer)``,
run one after the other on ONE model object from the same LoRA state, and compared bit for bit.

Arms (``--arms`` of :mod:`tools.bench`):

* ``trl-resident`` / ``trl-poros``: ``trl.SFTTrainer(model=peft_model, args=SFTConfig(...),
  train_dataset=<pre-tokenised rows>, processing_class=<the bundled tokenizer>)``, then ``train()``;
  the ``-poros`` arm adds ``poros.prepare_trainer(trainer)`` between the two. SFTTrainer casts the
  LoRA weights of a quantized model to bf16 (TRL's QLoRA default), in both arms alike.
* ``hf-resident`` / ``hf-poros``: the same with ``transformers.Trainer`` on rows with ``labels``.

With ``--liger`` every Trainer arm sets ``use_liger_kernel=True`` (TRL's arms keep TRL's fused head: SFTTrainer
turns Liger's fused cross-entropy off; HF's arms get it); the Trainer patches the ONE model object when its
``train()`` starts, so each arm trains Liger's kernels, and each arm records what Liger patched (``kernels``).

Every arm starts from the same initial LoRA tensors (fp32, put back before each arm), the same rows in
the same order (the same ``seed`` / ``data_seed``) and the arguments of
:func:`tools.bench.trainer_common.training_arguments`. Per arm: each optimizer step's wall time (the device
synchronised before each clock read, :class:`tools.bench.trainer_common.StepClock`), the peak allocated /
reserved memory over the steps, tokens/s of the median step, the loss and ``grad_norm`` the Trainer
logged at each step, and for a ``-poros`` arm how often each streamed block was fetched per optimizer
step (about 2 when the accumulation window ran layer-major, about 2 x ``gradient_accumulation_steps``
micro-major). :func:`compare_trainer_runs` gives each flow's parity (:func:`tools.bench.arms.parity`: the
logged losses, every LoRA tensor and every AdamW state tensor, ``torch.equal``) and the ratios
poros/resident.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from tools.bench.kernel_profile import KernelProfile
from tools.bench.arms import ArmResult, cap_process, free_memory, optimizer_snapshot, parity, snapshot, trainable
from tools.bench.trainer_common import (StepClock, TrainerSetup, liger_arguments, logged_grad_norms, logged_losses,
                                        sft_config_arguments, sft_dataset, throughput, training_arguments)

#: the Trainer arms, in the order they run: each flow's resident reference before its one-line arm
TRAINER_ARMS = ("trl-resident", "trl-poros", "hf-resident", "hf-poros")
#: the flows and their two arms
FLOWS = {"trl": ("trl-resident", "trl-poros"), "hf": ("hf-resident", "hf-poros")}


def bundled_tokenizer():
    """The tokenizer bundled with Poros: SFTTrainer needs a ``processing_class`` (its pad token); the rows
    come tokenised already, so its vocabulary never meets them."""
    import transformers

    from poros.assets import asset_path

    return transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))


def token_rows(batches: list[dict]) -> list[list[int]]:
    """Every row of ``batches`` as a list of token ids (the rows every arm trains on, in this order)."""
    return [row.tolist() for batch in batches for row in batch["input_ids"]]


def _trainer(flow: str, model, rows: list[list[int]], setup: TrainerSetup, clock: StepClock, tokenizer):
    import transformers

    if flow == "trl":
        import trl

        return trl.SFTTrainer(model=model, args=trl.SFTConfig(**sft_config_arguments(setup), **liger_arguments(setup)),
                              train_dataset=sft_dataset(rows), processing_class=tokenizer, callbacks=[clock])
    from poros.testing.models import Rows

    dataset = Rows([{"input_ids": torch.tensor(ids), "attention_mask": torch.ones(len(ids), dtype=torch.long),
                     "labels": torch.tensor(ids)} for ids in rows])
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(**training_arguments(setup),
                                                                                 **liger_arguments(setup)),
                                train_dataset=dataset, callbacks=[clock])


def restore_lora(named: list[tuple[str, torch.nn.Parameter]], initial: dict[str, torch.Tensor]) -> None:
    """Each LoRA parameter back to its initial tensor, dtype included (SFTTrainer made them bf16)."""
    for name, param in named:
        param.data = initial[name].to(param.device, copy=True)
        param.grad = None


def _gb(count: int | None) -> float | None:
    return None if count is None else round(count / 1e9, 3)


def _kernels(model, handle) -> dict[str, Any] | None:
    """What Liger patched on the arm's model as it trained (None: no Liger): the streamed arm's own report, or
    the same read off the resident model (``poros.dropin.kernels.liger_report``)."""
    from poros.adapters import causal_lm_of
    from poros.dropin.kernels import liger_report

    report = getattr(handle, "kernel_report", None) or liger_report(causal_lm_of(model))
    return report.to_dict() if report is not None and report.applied else None


def run_trainer_arm(name: str, peft_model, named, initial: dict[str, torch.Tensor], rows: list[list[int]],
                    setup: TrainerSetup, tokenizer=None):
    """One Trainer arm from the initial LoRA state; returns ``(ArmResult, handle)``, ``handle`` the
    ``PorosModel`` of a ``-poros`` arm (``unpatch()`` it before another arm) or None."""
    import poros

    flow, line = name.split("-", 1)
    restore_lora(named, initial)
    result, handle, trainer = ArmResult(name), None, None
    clock = StepClock(setup.device)
    profiler = KernelProfile(setup.warmup, setup.device) if setup.profile and setup.warmup else None
    cap = setup.cap_of(name) if setup.device.startswith("cuda") else None
    try:
        trainer = _trainer(flow, peft_model, rows, setup, clock, tokenizer if tokenizer is not None
                           else bundled_tokenizer())
        if profiler is not None:  # the last warm-up step, untimed: first, so the clock's read of that step
            trainer.callback_handler.callbacks.insert(0, profiler)  # comes after the trace is processed
        if line == "poros":
            handle = poros.prepare_trainer(trainer, **setup.prepare_options())  # the one line
            handle.store.stats.reset()
            tail = handle.executor.dequantize.tail
            clock.readings.update(recompute_tail_skips=lambda: tail.skipped, skipped_flops=lambda: tail.skipped_flops)
        if cap is not None:  # a smaller card, emulated from training on (after the one line has streamed the
            cap_process(torch.device(setup.device), cap)  # blocks off the card: the first step's decisions see it)
        trainer.train()
        result.losses = [torch.tensor(loss, dtype=torch.float64) for loss in logged_losses(trainer)]
        result.step_times = clock.step_times
        result.extra["grad_norms"] = logged_grad_norms(trainer)
        result.adapter = snapshot(trainable(trainer.model))
        result.optimizer = optimizer_snapshot(trainer.optimizer, trainable(trainer.model))
        result.extra["kernels"] = _kernels(trainer.model, handle)
        if handle is not None:
            fetches = sum(handle.store.stats.fetches)
            result.extra.update({"guarantee": handle.guarantee, "blocks": len(handle.store.blocks),
                                 "resident_blocks": list(handle.store.resident_blocks),
                                 "recompute": handle.stream_options.recompute,
                                 "kept_activation_blocks": len(handle.executor.recompute.last),
                                 # auto without a plan: the room for kept blocks, refitted at the second step
                                 "kept_room_gb": _gb(handle.executor.recompute.allotted_bytes),
                                 "kept_room_refitted": handle.executor.recompute.refitted,
                                 "dequantize_once": handle.executor.dequantize.last,
                                 # recomputes' unread last products skipped (poros.stream.recompute_tail), a timed step
                                 "recompute_tail_skips": clock.per_timed_step("recompute_tail_skips", setup.warmup),
                                 "skipped_flops": clock.per_timed_step("skipped_flops", setup.warmup),
                                 "budget_plan": None if handle.budget_plan is None else handle.budget_plan.to_dict(),
                                 "block_fetches_per_step": round(fetches / len(handle.store.blocks)
                                                                 / max(1, len(clock.step_times)), 3),
                                 "cuda_graphs": None if handle.executor.graphs is None  # captures, replays, eager
                                 else handle.executor.graphs.report.to_dict()})
    except torch.OutOfMemoryError as exc:
        result.status, result.error = "oom", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next arm still runs
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        if cap is not None:  # the whole card again for the next arm, however this one ended
            cap_process(torch.device(setup.device), None)
    result.extra.update(clock.memory())
    if cap is not None:
        result.extra["vram_limit_gb"] = cap
    result.extra["allocator_per_step"] = clock.allocator(setup.warmup)
    if profiler is not None:
        result.extra["kernel_profile"] = profiler.result
    if getattr(peft_model, "_require_grads_hook", None) is not None:
        peft_model.disable_input_require_grads()  # SFTTrainer enabled it; the next arm's trainer does again
    for _, param in named:
        param.grad = None
    trainer = None  # the optimizer state goes before the next arm measures
    free_memory(torch.device(setup.device))
    return result, handle


def run_trainer_arms(peft_model, batches: list[dict], arms, setup: TrainerSetup) -> dict[str, ArmResult]:
    """The Trainer arms of ``arms`` on ``peft_model``, in :data:`TRAINER_ARMS` order, each from the LoRA
    state the model has now; the model leaves as it came (unpatched, that LoRA state)."""
    named = trainable(peft_model)
    initial = snapshot(named)
    rows = token_rows(batches)
    tokenizer = bundled_tokenizer()
    results: dict[str, ArmResult] = {}
    for name in (arm for arm in TRAINER_ARMS if arm in arms):
        results[name], handle = run_trainer_arm(name, peft_model, named, initial, rows, setup, tokenizer)
        if handle is not None:
            handle.unpatch()  # the next arm (or the Unsloth child, once this model is freed) gets it as it was
        handle = None
    restore_lora(named, initial)
    return results


def summaries(results: dict[str, ArmResult], setup: TrainerSetup) -> dict[str, dict[str, Any]]:
    """Each arm's summary (:meth:`ArmResult.summary`) with its tokens per step and tokens/s."""
    out = {}
    for name, result in results.items():
        summary = result.summary(setup.warmup)
        summary.update(throughput(summary.get("median_step_s"), setup))
        out[name] = summary
    return out


def compare_trainer_runs(results: dict[str, ArmResult], setup: TrainerSetup) -> dict[str, Any]:
    """Per flow whose two arms finished: :func:`tools.bench.arms.parity` of the one-line arm against the
    resident one, and the ratios one-line/resident of the median step and the peaks."""
    out = {}
    for flow, (reference, other) in FLOWS.items():
        a, b = results.get(reference), results.get(other)
        if a is None or b is None or a.status != "ok" or b.status != "ok":
            continue
        out[flow] = parity(a, b)
        for key in ("median_step_s", "peak_allocated_gb", "peak_reserved_gb"):
            x, y = a.summary(setup.warmup).get(key), b.summary(setup.warmup).get(key)
            if x and y is not None:
                out[flow][f"ratio_{key}"] = round(y / x, 4)
    return out

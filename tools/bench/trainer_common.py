"""What every Trainer arm of the bench shares, the Unsloth child process included: the training
arguments, the step clock and the rows.

It imports only torch, transformers and (for :func:`sft_dataset`) datasets, never Poros or another
tool, because :mod:`tools.bench.unsloth_child` imports it under the Unsloth process's own transformers
(the GPU host's 5.17, not the 5.24 of the Poros arms).

* :class:`TrainerSetup` -- the run's settings, one object (device, steps, accumulation, seq, lr, seed);
* :func:`training_arguments` -- the ``TrainingArguments`` / ``SFTConfig`` keywords every arm uses: bf16
  autocast, ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` as given, AdamW
  (``adamw_torch``), a constant learning rate, ``max_grad_norm`` 1.0, a log line per optimizer step,
  no saves, non-reentrant gradient checkpointing (the QLoRA recipes' setting);
* :class:`StepClock` -- a ``TrainerCallback`` that synchronises the device and reads the clock when
  training begins and at the end of every optimizer step, and resets the peak-memory counters when
  training begins (so the peak is the steps', not the load's);
* :func:`sft_dataset` -- pre-tokenised rows (``input_ids`` only) as TRL's ``SFTTrainer`` takes them:
  it skips tokenising, and its collator sets ``labels = input_ids`` (no padding at equal lengths).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

#: the unit of every ``*_gb`` field (as tools.bench.arms.GB)
GB = 1e9


@dataclass(frozen=True)
class TrainerSetup:
    """One run of Trainer arms.

    Args:
        device: where the model trains (``cuda:0`` or ``cpu``).
        warmup: optimizer steps before the timed ones (untimed in the medians).
        steps: timed optimizer steps.
        grad_accum: ``gradient_accumulation_steps``.
        batch: ``per_device_train_batch_size``.
        seq: tokens per row.
        lr: AdamW's learning rate.
        seed: the Trainer's ``seed`` and ``data_seed`` (the same shuffle in every arm).
        output_dir: the Trainer's ``output_dir`` (nothing is saved into it).
        cuda_graphs: the ``-poros`` arms' ``prepare_trainer(trainer, cuda_graphs=...)``.
        vram_budget: the ``-poros`` arms' ``vram_budget`` (the planner picks slots and resident blocks for
            a layer-major window of this batch, seq and accumulation; :meth:`prepare_options`), or None.
        profile: trace the last warm-up step of each arm by kernel category (``tools.bench.kernel_profile``).
        recompute: the ``-poros`` arms' ``recompute`` (None: prepare's default, ``"auto"``).
        dequantize_once: the ``-poros`` arms' ``dequantize_once`` (None: prepare's default, ``"auto"``).
        resident_blocks: the ``-poros`` arms' ``resident_blocks`` (the last N blocks stay on the device),
            or None.
        liger: every Trainer arm (``trl-*``, ``hf-*``, resident and one-line alike) trains with
            ``use_liger_kernel=True`` (:func:`liger_arguments`); the Unsloth child never reads it.
        vram_limit_gb: the arms of ``capped_arms`` (None: every Trainer arm) train with the process capped at
            this many GB (``torch.cuda.set_per_process_memory_fraction``, as the step arms' ``--vram-limit``).
        capped_arms: see ``vram_limit_gb``.
    """

    device: str
    warmup: int
    steps: int
    grad_accum: int
    batch: int
    seq: int
    lr: float
    seed: int
    output_dir: str
    cuda_graphs: bool = False
    recompute: str | None = None
    dequantize_once: bool | str | None = None
    profile: bool = False
    vram_budget: str | None = None
    resident_blocks: int | None = None
    liger: bool = False
    vram_limit_gb: float | None = None
    capped_arms: tuple[str, ...] | None = None

    def cap_of(self, arm: str) -> float | None:
        """The GB cap arm ``arm`` trains under, or None."""
        return self.vram_limit_gb if self.capped_arms is None or arm in self.capped_arms else None

    def prepare_options(self) -> dict[str, Any]:
        """The keywords a ``-poros`` arm passes to ``poros.prepare_trainer`` (to ``poros.prepare``): with a
        ``vram_budget`` the planner's workload too, layer-major as the trainer's windows run."""
        options: dict[str, Any] = {"cuda_graphs": self.cuda_graphs}
        if self.recompute is not None:
            options["recompute"] = self.recompute
        if self.dequantize_once is not None:
            options["dequantize_once"] = self.dequantize_once
        if self.vram_budget is not None:
            from poros.plan.entry import workload_of

            options.update(vram_budget=self.vram_budget, workload=workload_of(
                batch_size=self.batch, seq_len=self.seq, grad_accum=self.grad_accum, schedule="layer-major"))
        if self.resident_blocks is not None:
            options["resident_blocks"] = self.resident_blocks
        return options

    @property
    def tokens_per_step(self) -> int:
        return self.grad_accum * self.batch * self.seq

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__dataclass_fields__}


def training_arguments(setup: TrainerSetup) -> dict[str, Any]:
    """The keywords of ``TrainingArguments`` (HF) and ``SFTConfig`` (TRL) every arm uses."""
    return dict(
        output_dir=setup.output_dir, max_steps=setup.warmup + setup.steps,
        per_device_train_batch_size=setup.batch, gradient_accumulation_steps=setup.grad_accum,
        learning_rate=setup.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], bf16=True,
        use_cpu=torch.device(setup.device).type == "cpu", seed=setup.seed, data_seed=setup.seed,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False})


def liger_arguments(setup: TrainerSetup) -> dict[str, Any]:
    """``use_liger_kernel=True`` for a run with ``setup.liger`` (the Trainer arms of the bench's ``--liger``); {}
    otherwise. Kept out of :func:`training_arguments`, which the Unsloth child shares."""
    return {"use_liger_kernel": True} if setup.liger else {}


def sft_config_arguments(setup: TrainerSetup) -> dict[str, Any]:
    """:func:`training_arguments` plus the ``SFTConfig`` fields: rows of ``seq`` tokens, no packing."""
    return dict(training_arguments(setup), max_length=setup.seq, packing=False, dataset_num_proc=None)


def sft_dataset(token_rows: list[list[int]]):
    """``datasets.Dataset`` of pre-tokenised rows, one ``input_ids`` list each."""
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": list(ids)} for ids in token_rows])


def logged_losses(trainer) -> list[float]:
    """The loss the Trainer logged at each optimizer step (``logging_steps=1``)."""
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def logged_grad_norms(trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


#: the CUDA caching allocator's counters a step is judged by: retries and device allocations / frees are
#: ``cudaMalloc`` / ``cudaFree`` inside the loop, which make the host wait for the device
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                      "allocation.all.allocated", "segment.all.allocated")


class StepClock(TrainerCallback):
    """Wall time of each optimizer step, the device synchronised before each clock read.

    ``step_times[i]`` runs from the end of step ``i - 1`` (from ``on_train_begin`` for the first) to the
    end of step ``i``: the batches' fetch, forwards, backwards, clipping and the optimizer step, and
    the previous step's log line. ``on_train_begin`` also resets the peak-memory counters and records
    the memory allocated then (the weights and the LoRA state).
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.step_times: list[float] = []
        self.allocated_before: int | None = None
        self._last: float | None = None
        self._counters: list[dict[str, int]] = []  # the allocator's counters at the start and after each step
        #: more counters read with the allocator's (name -> a reading), e.g. the recomputes' skipped products
        self.readings: dict[str, Any] = {}
        self._read: list[dict[str, int]] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated_before = torch.cuda.memory_allocated(self.device)
        self._now()
        self._count()  # before the clock starts: reading the counters is no step's work
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = self._now()
        self.step_times.append(now - self._last)
        self._count()  # between the clock reads, so no step pays for it (it queues no device work)
        self._last = time.perf_counter()

    def _count(self) -> None:
        self._read.append({name: read() for name, read in self.readings.items()})
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            self._counters.append({key: stats.get(key, 0) for key in ALLOCATOR_COUNTERS})

    def allocator(self, warmup: int) -> dict[str, float] | None:
        """Per timed step (the steps after ``warmup``): the allocator's :data:`ALLOCATOR_COUNTERS` (None on the CPU)."""
        if len(self._counters) <= warmup + 1:
            return None
        first, last, steps = self._counters[warmup], self._counters[-1], len(self._counters) - 1 - warmup
        return {key: round((last[key] - first[key]) / steps, 2) for key in ALLOCATOR_COUNTERS}

    def per_timed_step(self, name: str, warmup: int) -> float | None:
        """Reading ``name``'s growth per timed step (the steps after ``warmup``), or None without one."""
        if len(self._read) <= warmup + 1 or name not in self._read[warmup]:
            return None
        steps = len(self._read) - 1 - warmup
        return round((self._read[-1][name] - self._read[warmup][name]) / steps, 2)

    def memory(self) -> dict[str, float | None]:
        """Peak allocated / reserved since ``on_train_begin`` and the allocated bytes then, in GB (None on the CPU)."""
        if self.device.type != "cuda":
            return {"peak_allocated_gb": None, "peak_reserved_gb": None, "allocated_before_gb": None}
        return {"peak_allocated_gb": round(torch.cuda.max_memory_allocated(self.device) / GB, 4),
                "peak_reserved_gb": round(torch.cuda.max_memory_reserved(self.device) / GB, 4),
                "allocated_before_gb": None if self.allocated_before is None else round(self.allocated_before / GB, 4)}


def throughput(median_step_s: float | None, setup: TrainerSetup) -> dict[str, Any]:
    """Tokens per optimizer step and per second of the median step."""
    return {"tokens_per_step": setup.tokens_per_step,
            "tokens_per_s": round(setup.tokens_per_step / median_step_s, 2) if median_step_s else None}

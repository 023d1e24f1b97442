"""``PorosTrainer``: load, train and save a QLoRA adapter with the frozen base streamed block by block.

::

    trainer = PorosTrainer.from_pretrained("Qwen/Qwen2.5-32B", lora_rank=16, lora_alpha=32)
    result = trainer.train("data.jsonl", steps=200, seq_len=512)    # -> TrainResult
    trainer.save("./poros_output/qwen32b-lora")                        # PEFT adapter + tokenizer + poros_config.json

One optimizer step, exactly as HF ``Trainer`` does it (so a resident HF + PEFT loop over the same
batches gives the same bits)::

    micro-batches b_1..b_k (k = grad_accum)        n = sum_j (labels_j[..., 1:] != -100).sum()
    for each b_j: loss_j = model(**b_j, num_items_in_batch=n).loss   # sum over tokens / n
                  loss_j.backward()
    step loss = loss_1 + ... + loss_k               grad_norm = clip_grad_norm_(adapters, max_grad_norm)
    optimizer.step(); scheduler.step(); optimizer.zero_grad(set_to_none=True)

Notable choices:

* **Each ``train()`` call is one run**: a new AdamW, schedule and batch order, step 0 — unless
  ``resume_from`` names a checkpoint, which restores all of those and the adapter weights
  (in place, into the same parameters). The adapter weights otherwise carry over.
* **Layer-major accumulation.** With ``grad_accum`` > 1 and no active dropout, the k micro-batches
  run through :meth:`PorosModel.forward_backward`: every block crosses the link twice per
  optimizer step instead of 2k times, with the same gradients bit for bit (the micro-batches'
  boundary states, k per block, wait on the device, or in pinned host memory when ``vram_budget``
  cannot hold them). With dropout, the plain loop above runs.
* **No host sync in the step** except at logging steps: losses, token counts and norms stay
  tensors until a log line (or the end of the run) needs them.
* **Stopping is a checkpoint.** SIGINT/SIGTERM during ``train`` finish the optimizer step in
  flight, write ``checkpoint-{step}``, print the exact resume command and return with
  ``interrupted=True``; a second signal aborts at once.
* **Saving never writes a ``config.json``**: the adapter is PEFT's own ``save_pretrained``
  (stock ``PeftModel.from_pretrained`` loads it), next to the tokenizer and ``poros_config.json``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shlex
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from poros import checkpoint as checkpoints
from poros import distributed
from poros.errors import ConfigError, DataError, TrainingCheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    from poros.config import PorosConfig
    from poros.model import PorosModel

logger = logging.getLogger("poros")

METRICS_FILE = "metrics.jsonl"
#: Fields that shape the model PorosTrainer builds (the base, the adapters, where it streams):
#: fixed when the trainer is created, so ``train()`` cannot override them.
FIELDS_FIXED_AT_LOAD = (
    "model", "revision", "quantization", "double_quant", "compute_dtype", "attn_implementation",
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora",
    "device", "num_slots", "deterministic", "require", "embeddings_on_host",
)
#: Every row of ``metrics.jsonl`` (and of ``TrainResult.log_history``) has these keys.
METRIC_FIELDS = ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "num_tokens",
                 "peak_memory_gb", "peak_memory_kind", "h2d_gb_per_s")


@dataclass
class TrainResult:
    """What :meth:`PorosTrainer.train` returns.

    Attributes:
        steps: optimizer steps done, counting those before a resumed checkpoint.
        losses: the loss of every step from step 1 (the sum of its micro-batch losses).
        final_loss: ``losses[-1]`` (None when no step ran).
        interrupted: True when SIGINT/SIGTERM stopped the run (a checkpoint was written).
        output_dir: where ``metrics.jsonl`` and the checkpoints are.
        last_checkpoint: the newest checkpoint this run wrote, or None.
        log_history: the rows written to ``metrics.jsonl`` (see :data:`METRIC_FIELDS`).
    """

    steps: int
    losses: list[float]
    final_loss: float | None
    interrupted: bool
    output_dir: pathlib.Path
    last_checkpoint: pathlib.Path | None
    log_history: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# LoRA targets
# ---------------------------------------------------------------------------------------------
def lora_target_modules(model: nn.Module, target_modules: str | list[str] | tuple[str, ...] = "all-linear"
                        ) -> list[str]:
    """PEFT ``target_modules`` for a Poros target spec, resolved through the family descriptor.

    Args:
        model: the HF causal LM (or a PEFT model around it).
        target_modules: ``"all-linear"``: the descriptor's ``lora_targets_all_linear`` plus the
            ``model_level_linears`` present on the model (PEFT's all-linear minus what the family
            excludes, e.g. Gemma 4's router); ``"default"``: ``lora_targets_default`` (the
            attention projections); or a list of leaf module names.

    Raises:
        UnknownArchitectureError: the model's family is not registered.
        ConfigError: a listed name matches no ``nn.Linear`` of the model; the message lists the
            linear leaf names the model has.
    """
    from poros import registry
    from poros.descriptor import resolve_path
    from poros.errors import DescriptorError

    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    descriptor = registry.for_config(base.config)
    if target_modules == "all-linear":
        present = []
        for path in descriptor.model_level_linears:
            try:
                resolve_path(base, path)
            except DescriptorError:
                continue
            present.append(path)
        return [*descriptor.lora_targets_all_linear, *present]
    if target_modules == "default":
        return list(descriptor.lora_targets_default)
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    linear_names = [name for name, module in base.named_modules() if isinstance(module, nn.Linear)]
    unknown = [target for target in target_modules
               if not any(name == target or name.endswith(f".{target}") for name in linear_names)]
    if unknown:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear_names} - {"base_layer"})
        raise ConfigError(
            f"target_modules {unknown} match no nn.Linear of this {descriptor.name} model; expected leaf names "
            f"such as {leaves} (or 'all-linear' / 'default'). Fix the names in target_modules."
        )
    return list(target_modules)


# ---------------------------------------------------------------------------------------------
# Stopping on SIGINT / SIGTERM
# ---------------------------------------------------------------------------------------------
class _StopRequest:
    """Turns SIGINT/SIGTERM into a flag checked after each optimizer step; a second signal aborts."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    #: a repeat within this many seconds is the same request (torchrun forwards the Ctrl-C its ranks also got)
    REPEAT_S = 2.0

    def _handle(self, signal_number, frame) -> None:
        if self.signal_name is not None and time.monotonic() - self._first_at > self.REPEAT_S:
            self.restore()  # the second one: stop waiting for the step
            raise KeyboardInterrupt
        if self.signal_name is None:
            self.signal_name, self._first_at = signal.Signals(signal_number).name, time.monotonic()

    def __enter__(self) -> _StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:
                    self._previous[number] = signal.signal(number, self._handle)
        else:
            logger.info("poros: train() runs outside the main thread: SIGINT/SIGTERM will not checkpoint")
        return self

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self.restore()


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class PorosTrainer:
    """Train a LoRA adapter on a streamed NF4 base; save it the way PEFT does.

    Build it with :meth:`from_pretrained` / :meth:`from_config`, or around a :class:`PorosModel`
    you prepared yourself (``PorosTrainer(poros.prepare(peft_model), tokenizer, config)``).

    Attributes:
        model: the :class:`~poros.model.PorosModel`.
        tokenizer: the tokenizer (None when the checkpoint has none).
        config: the :class:`~poros.config.PorosConfig` the trainer was created with; ``train()``
            overrides apply to that run only.
        run_config: the config of the last ``train()`` with its overrides (``config`` before any);
            what :meth:`save` records.
        optimizer, scheduler: those of the last ``train()`` (None before).
        global_step: optimizer steps done by the last ``train()``, resumed steps included.
        launch_command: set by the CLI to the ``argv`` it ran; the resume command printed on an
            interrupt is that command with ``--resume_from <checkpoint>``.
    """

    def __init__(self, model: PorosModel, tokenizer: Any, config: PorosConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.run_config = config
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.global_step = 0
        self.launch_command: list[str] | None = None

    # -- creation ------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, quantization: str = "nf4", lora_rank: int = 16,
                        lora_alpha: int = 32, **config_fields: Any) -> PorosTrainer:
        """Load ``name_or_path`` with an NF4 base and fresh LoRA adapters; see :meth:`from_config`.

        Args:
            name_or_path: HF model id, local checkpoint directory, or ``"poros-tiny-qwen3"``.
            quantization, lora_rank, lora_alpha, **config_fields: any :class:`PorosConfig` field
                (``dataset``, ``steps``... become the defaults of :meth:`train`).

        Raises:
            ConfigError: an unknown field (named, with the closest one) or an invalid value.
            CheckpointLoadError, UnknownArchitectureError, and the gates of :func:`poros.prepare`.
        """
        from poros.config import PorosConfig

        config = PorosConfig().replace(model=os.fspath(name_or_path), quantization=quantization,
                                       lora_rank=lora_rank, lora_alpha=lora_alpha, **config_fields)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: PorosConfig) -> PorosTrainer:
        """Load the model of ``config``, add LoRA adapters, stream it with :func:`poros.prepare`.

        Picks the device (``"auto"``: CUDA when available, else CPU). With ``deterministic`` on
        CUDA, sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (when unset) and
        ``torch.use_deterministic_algorithms(True)`` for the whole process. Loads with
        :func:`poros.load.load_pretrained`, then ``torch.manual_seed(seed)`` and PEFT's
        ``get_peft_model`` with its default initialization (``lora_B`` zero), moves the adapters to
        the compute device (:func:`poros.load.adapters_to_device`), streams the model with
        :func:`poros.prepare`, and prints the detection summary with the guarantee label.

        Raises:
            ConfigError: ``config.validate()`` fails, or ``target_modules`` names no linear.
            CheckpointLoadError, UnknownArchitectureError, and the gates of :func:`poros.prepare`
                (e.g. ``GuaranteeError`` when ``require`` is not met).
        """
        import peft

        from poros.load import adapters_to_device, load_pretrained
        from poros.model import prepare

        config.validate()
        device = distributed.join_launched_job(resolve_device(config.device))  # under torchrun: this rank's
        if config.deterministic and device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        with distributed.shared_host_copy():  # the node's ranks: local rank 0 first (see docs/multi-gpu.md)
            loaded = load_pretrained(
                config.model, quantization=config.quantization, compute_dtype=config.compute_dtype,
                double_quant=config.double_quant, device=device, attn_implementation=config.attn_implementation,
                revision=config.revision,
            )
        lora_config = peft.LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=lora_target_modules(loaded.model, config.target_modules),
            use_rslora=config.use_rslora, use_dora=config.use_dora, task_type="CAUSAL_LM",
        )
        torch.manual_seed(config.seed)
        peft_model = peft.get_peft_model(loaded.model, lora_config)
        adapters_to_device(peft_model, loaded.device)  # PEFT puts block adapters beside their host base layer
        workload = None
        if config.vram_budget is not None:
            from poros.stream.planner import Workload

            workload = Workload(config.batch_size, config.seq_len, config.grad_accum,
                                _stream_schedule(config, peft_model))
        model = prepare(peft_model, num_slots=config.num_slots, embeddings_on_host=config.embeddings_on_host,
                        require=config.require, vram_budget=config.vram_budget, workload=workload)
        if model.budget_plan is not None:
            _echo(model.budget_plan.summary())
        if model.detection is not None:
            _echo(model.detection.summary())
        return cls(model, loaded.tokenizer, config)

    # -- training ------------------------------------------------------------------------------
    def train(self, dataset: str | os.PathLike | None = None, *, steps: int | None = None,
              seq_len: int | None = None, batch_size: int | None = None, grad_accum: int | None = None,
              lr: float | None = None, schedule: str | None = None, warmup: int | None = None,
              seed: int | None = None, resume_from: str | os.PathLike | None = None,
              **other_config_fields: Any) -> TrainResult:
        """Train the adapters; keyword arguments override the config's fields for this run.

        Data: ``poros.data.load_dataset(dataset, tokenizer, ...)`` and a shuffling
        ``BatchIterator(seed=seed)``. Optimizer: ``torch.optim.AdamW`` over the adapters (``lr``,
        ``weight_decay``); schedule: ``transformers.get_scheduler(schedule, ..., warmup, steps)``.
        Every ``logging_steps``: a line on stdout and a row in ``<output_dir>/metrics.jsonl``;
        every ``save_steps`` (and at the last step when ``save_steps`` > 0): ``checkpoint-{step}``.

        Args:
            dataset: HF dataset id, ``.jsonl``/``.json``/``.csv`` file, ``"synthetic"``, a bundled name, or
                an in-memory dataset ``poros.data.load_dataset`` takes (a list of records, a ``datasets``
                object, a ``TokenizedData``; recorded in the config as ``"<in-memory TYPE>"``).
            resume_from: ``"auto"`` (the newest complete checkpoint in ``output_dir``; none: start
                fresh) or a checkpoint directory.
            **other_config_fields: any other :class:`PorosConfig` field that does not shape the
                model (``logging_steps``, ``save_steps``, ``output_dir``, ``weight_decay``...).

        Raises:
            ConfigError: an unknown field or invalid value, or a field of
                :data:`FIELDS_FIXED_AT_LOAD` (those are set when the trainer is created).
            TrainingCheckpointError: ``resume_from`` names a missing or incomplete checkpoint, or one
                written with settings that change the math (each differing field is named).
            DataError: the dataset yields no trainable tokens, or cannot be read.
        """
        data_source = None  # an in-memory dataset (records, datasets object, TokenizedData)
        if dataset is not None and not isinstance(dataset, (str, os.PathLike)):
            data_source, dataset = dataset, f"<in-memory {type(dataset).__name__}>"
        overrides = {name: value for name, value in dict(
            dataset=None if dataset is None else os.fspath(dataset), steps=steps, seq_len=seq_len,
            batch_size=batch_size, grad_accum=grad_accum, lr=lr, schedule=schedule, warmup=warmup, seed=seed,
            resume_from=None if resume_from is None else os.fspath(resume_from),
        ).items() if value is not None}
        overrides.update(other_config_fields)
        config = self.config.replace(**overrides)
        fixed = [name for name in FIELDS_FIXED_AT_LOAD if getattr(config, name) != getattr(self.config, name)]
        if fixed:
            changes = ", ".join(f"{name}={getattr(config, name)!r}" for name in fixed)
            raise ConfigError(
                f"train({changes}): these fields shape the model, which was built with "
                + ", ".join(f"{name}={getattr(self.config, name)!r}" for name in fixed)
                + ". Create a new trainer with them: PorosTrainer.from_pretrained(model, " + changes + ", ...)."
            )
        self.run_config = config
        return _Run(self, config, data_source).execute()

    def generate(self, prompt: str, **options: Any) -> str:
        """The model's continuation of ``prompt`` with the adapter as trained so far; ``options`` as for
        :func:`poros.generate.generate_text` (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``chat``)."""
        from poros.generate import generate_text

        return generate_text(self.model, self.tokenizer, prompt, **options).text

    # -- saving --------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> pathlib.Path:
        """Write the adapter (PEFT layout), the tokenizer and ``poros_config.json`` into ``directory``.

        ``adapter_model.safetensors`` and ``adapter_config.json`` are written by PEFT's own
        ``save_pretrained`` (``base_model_name_or_path`` = ``config.model``), so stock
        ``PeftModel.from_pretrained(base, directory)`` loads them. Never a ``config.json``.
        Everything is written into a temporary directory next to ``directory`` first; a new
        ``directory`` appears complete in one rename. An existing one keeps its other entries
        (checkpoints, ``metrics.jsonl``): only then are the new files moved in, each replacing its
        namesake at once, ``poros_config.json`` last, and files of the previous save that the new one
        lacks are removed.

        Returns:
            ``directory`` as a path.

        Raises:
            UnsupportedModelError: the model has no PEFT adapters to save.
            TrainingCheckpointError: ``directory`` exists and is a file.
        """
        target = pathlib.Path(directory)
        if not distributed.world().is_main:  # data parallel: rank 0 writes (the adapters are the same)
            return target
        previous_files = set(_saved_files(target))
        with checkpoints.atomic_directory(target, merge=True,
                                          written_last=checkpoints.POROS_CONFIG_FILE) as temporary:
            self._write_adapter(temporary)
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(temporary)
            new_files = sorted(p.name for p in temporary.iterdir())
            checkpoints.write_json(temporary / checkpoints.POROS_CONFIG_FILE,
                                   self._poros_config_record(files=[*new_files, checkpoints.POROS_CONFIG_FILE]))
        for name in previous_files - {*new_files, checkpoints.POROS_CONFIG_FILE}:
            stale = target / name
            if stale.is_file():
                stale.unlink()
        _echo(f"poros: saved the adapter to {target}")
        return target

    def _peft_model(self):
        peft_model = self.model  # prepare returns the model it was given, streamed
        if not (hasattr(peft_model, "peft_config") and hasattr(peft_model, "save_pretrained")):
            raise UnsupportedModelError(
                f"the model inside this PorosModel is a {type(peft_model).__name__} without PEFT adapters; saving "
                "writes a PEFT adapter. Wrap the model with peft.get_peft_model(...) before poros.prepare."
            )
        return peft_model

    def _write_adapter(self, directory: pathlib.Path) -> None:
        peft_model = self._peft_model()
        previous = {name: config.base_model_name_or_path for name, config in peft_model.peft_config.items()}
        try:
            for adapter_config in peft_model.peft_config.values():
                adapter_config.base_model_name_or_path = self.run_config.model
            # save_embedding_layers=False: "auto" asks the hub whether the vocabulary was resized; the
            # embeddings are frozen base weights here, never trained.
            peft_model.save_pretrained(directory, save_embedding_layers=False)
        finally:
            for name, value in previous.items():
                peft_model.peft_config[name].base_model_name_or_path = value

    def _poros_config_record(self, **extra: Any) -> dict[str, Any]:
        from poros import __version__

        detection = self.model.detection
        return {
            "poros_version": __version__,
            "family": self.model.descriptor.name,
            "guarantee": detection.guarantee if detection else None,
            "guarantee_reason": detection.reason if detection else None,
            "steps_done": self.global_step,
            "base_model_name_or_path": self.run_config.model,
            "config": self.run_config.to_dict(),
            **extra,
        }

    # -- resuming ------------------------------------------------------------------------------
    def _restore_adapter(self, state_dict: dict[str, torch.Tensor], source: pathlib.Path) -> None:
        """Copy saved adapter tensors into the existing LoRA parameters, in place."""
        from peft import get_peft_model_state_dict

        current = get_peft_model_state_dict(self._peft_model(), save_embedding_layers=False)
        if current.keys() != state_dict.keys():
            missing, unexpected = sorted(current.keys() - state_dict.keys()), sorted(state_dict.keys() - current.keys())
            raise TrainingCheckpointError(
                f"the adapter in {source} does not match this model's adapters: missing {missing[:3]} "
                f"({len(missing)}), unexpected {unexpected[:3]} ({len(unexpected)}); expected the same target "
                "modules and family. Resume with the model and target_modules the checkpoint was trained with."
            )
        with torch.no_grad():
            for key, tensor in current.items():
                saved = state_dict[key]
                if saved.shape != tensor.shape or saved.dtype != tensor.dtype:
                    raise TrainingCheckpointError(
                        f"{key} in {source} is {tuple(saved.shape)} {saved.dtype}, this model's is "
                        f"{tuple(tensor.shape)} {tensor.dtype}; resume with the lora_rank the checkpoint used."
                    )
                tensor.copy_(saved)

    def resume_commands(self, checkpoint_path: str | os.PathLike) -> tuple[str, str]:
        """The ``poros train`` command line and the Python call that continue the last run from a checkpoint.

        The command line is :attr:`launch_command` (when the CLI set it) with its ``--resume_from``
        replaced, else ``poros train`` with every field that differs from its default.
        """
        from poros.config import PorosConfig

        path = os.fspath(checkpoint_path)
        config = self.run_config.to_dict()
        defaults = PorosConfig().to_dict()
        changed = {name: value for name, value in config.items()
                   if value != defaults[name] and name not in ("resume_from", "model")}
        if self.launch_command:
            argv, skip_value = [], False
            for argument in self.launch_command:
                if skip_value:
                    skip_value = False
                elif argument.split("=", 1)[0].replace("-", "_") == "__resume_from":
                    skip_value = "=" not in argument
                else:
                    argv.append(argument)
            command = shlex.join([*argv, "--resume_from", path])
        else:
            flags = [item for name, value in {"model": config["model"], **changed}.items()
                     for item in (f"--{name}", _cli_value(value))]
            command = shlex.join(["poros", "train", *flags, "--resume_from", path])
        in_memory = str(config["dataset"]).startswith("<in-memory")
        keywords = "".join(f", {name}={value!r}" for name, value in changed.items()
                           if not (in_memory and name == "dataset"))
        dataset = "<the same dataset>, " if in_memory else ""
        python = f"PorosTrainer.from_pretrained({config['model']!r}{keywords}).train({dataset}resume_from={path!r})"
        return command, python


def _cli_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as ``torch.device``."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _saved_files(directory: pathlib.Path) -> list[str]:
    """The files a previous :meth:`PorosTrainer.save` wrote into ``directory`` (its ``poros_config.json``)."""
    try:
        record = json.loads((directory / checkpoints.POROS_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = record.get("files", []) if isinstance(record, dict) else []
    return [name for name in files if isinstance(name, str) and "/" not in name and name not in ("", ".", "..")]


def _model_device(model: PorosModel) -> torch.device:
    parameters = model.trainable_parameters()
    return parameters[0].device if parameters else next(model.parameters()).device


_ACTIVE_BAR: list[Any] = []


def _echo(text: str) -> None:
    """A line for the user on stdout (through the progress bar when one is drawn)."""
    if not distributed.world().is_main:  # data parallel: rank 0 speaks for the run
        return
    if _ACTIVE_BAR:
        _ACTIVE_BAR[-1].write(text)
    else:
        print(text, flush=True)


def _peak_memory(device: torch.device) -> tuple[float | None, str]:
    """``(GB, kind)``: CUDA's peak allocated bytes on a CUDA device, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_allocated"
    try:
        import resource
    except ImportError:  # Windows
        return None, "unavailable"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9, "process_peak_rss"


# ---------------------------------------------------------------------------------------------
# One run of train()
# ---------------------------------------------------------------------------------------------
class _Run:
    """The state of one ``train()`` call: data, optimizer, schedule, counters, logging."""

    def __init__(self, trainer: PorosTrainer, config: PorosConfig, data_source: Any = None):
        self.trainer = trainer
        self.config = config
        self.data_source = config.dataset if data_source is None else data_source
        self.model = trainer.model
        self.device = _model_device(trainer.model)
        self.output_dir = pathlib.Path(config.output_dir)
        self.losses: list[float] = []
        self.pending_losses: list[torch.Tensor] = []  # step losses not yet moved to Python
        self.pending_tokens: torch.Tensor | int = 0  # non-pad tokens seen since the last sync
        self.window_losses: list[float] = []  # losses of the steps since the last log line
        self.log_history: list[dict[str, Any]] = []
        self.num_tokens = 0
        self.global_step = 0
        self.last_checkpoint: pathlib.Path | None = None
        #: ranks, shards, DDP and rank-0 writing (inactive on one process); refuses a batch the ranks do not divide
        self.parallel = distributed.DataParallel(self.model, self.device, config.batch_size)

    # -- setup ---------------------------------------------------------------------------------
    def _data(self):
        from poros.data import BatchIterator, load_dataset

        config, tokenizer = self.config, self.trainer.tokenizer
        if tokenizer is None and not (isinstance(self.data_source, str) and self.data_source == "synthetic"):
            raise DataError(f"the checkpoint {config.model} has no tokenizer files, so only dataset 'synthetic' can "
                            "be trained without one. Fix: copy the base model's tokenizer files next to its "
                            "config.json, or pass a tokenizer: PorosTrainer(model, tokenizer, config)")
        data = load_dataset(self.data_source, tokenizer, seq_len=config.seq_len, split=config.dataset_split,
                            chat_template=config.chat_template, seed=config.seed,
                            vocab_size=self.model.config.vocab_size)
        pad_token_id = None
        if tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            pad_token_id = getattr(self.model.config, "pad_token_id", None) or 0
        batches = BatchIterator(data, batch_size=config.batch_size, pad_token_id=pad_token_id, seed=config.seed,
                                shuffle=True)
        return data, batches

    def _optimizer(self):
        import transformers

        config = self.config
        optimizer = torch.optim.AdamW(self.model.trainable_parameters(), lr=config.lr,
                                      weight_decay=config.weight_decay)
        scheduler = transformers.get_scheduler(config.schedule, optimizer, num_warmup_steps=config.warmup,
                                               num_training_steps=config.steps)
        return optimizer, scheduler

    def _checkpoint_to_resume(self) -> checkpoints.TrainingCheckpoint | None:
        resume_from = self.config.resume_from
        if resume_from is None:
            return None
        if resume_from == "auto":
            path = checkpoints.latest_checkpoint(self.output_dir)
            if path is None:
                _echo(f"poros: resume_from='auto': no complete checkpoint in {self.output_dir}, starting fresh")
                return None
        else:
            path = pathlib.Path(resume_from)
        checkpoint = checkpoints.read_checkpoint(path)
        checkpoints.check_resumable(checkpoint, self.config.to_dict())
        return checkpoint

    def _resume(self, checkpoint: checkpoints.TrainingCheckpoint, optimizer, scheduler, batches) -> None:
        self.trainer._restore_adapter(checkpoint.adapter_state_dict(device=self.device), checkpoint.path)
        try:
            optimizer.load_state_dict(checkpoint.optimizer_state_dict(device=self.device))
            scheduler.load_state_dict(checkpoint.scheduler_state_dict())
        except (ValueError, KeyError) as error:
            raise TrainingCheckpointError(
                f"the optimizer or scheduler state in {checkpoint.path} does not fit this run: {error}; expected "
                "the same adapters and optimizer. Resume with the settings the checkpoint was trained with."
            ) from error
        batches.load_state_dict(checkpoint.data_state)
        state = checkpoint.trainer_state
        self.global_step = checkpoint.step
        self.losses = [float(loss) for loss in state.get("losses", [])]
        self.num_tokens = int(state.get("num_tokens", 0))
        self.log_history = list(state.get("log_history", []))
        # the logging window in progress at the checkpoint (a resume between two logging steps): its
        # first row must average the same steps as the uninterrupted run's
        last_logged = self.log_history[-1]["step"] if self.log_history else 0
        self.window_losses = self.losses[last_logged:]
        checkpoints.restore_rng_state(checkpoint.rng_state())
        _echo(f"poros: resumed from {checkpoint.path} at step {checkpoint.step}/{self.config.steps}")

    # -- the loop ------------------------------------------------------------------------------
    def execute(self) -> TrainResult:
        config = self.config
        parallel = self.parallel
        if parallel.is_main:
            checkpoints.remove_partial_saves(self.output_dir)
        parallel.barrier()
        checkpoint = self._checkpoint_to_resume()  # refuses a mismatched checkpoint before any work
        if checkpoint is not None:
            parallel.check_resume(checkpoint.trainer_state, checkpoint.path)
        data, batches = self._data()
        optimizer, scheduler = self._optimizer()
        self.trainer.optimizer, self.trainer.scheduler = optimizer, scheduler
        if checkpoint is not None:
            self._resume(checkpoint, optimizer, scheduler, batches)
        else:
            existing = checkpoints.list_checkpoints(self.output_dir)
            if existing:
                logger.warning("poros: %s already holds %s from an earlier run; this run starts fresh and writes "
                               "its own (resume_from='auto' continues the earlier one)", self.output_dir,
                               ", ".join(p.name for p in existing))
            _seed_everything(config.seed)
        self.trainer.global_step = self.global_step
        if parallel.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._rewrite_metrics()
        _echo(data.summary())
        if parallel.active:
            _echo(parallel.describe(config.batch_size, config.grad_accum))

        parameters = self.model.trainable_parameters()
        self.model.train()
        layer_major = config.grad_accum > 1 and _stream_schedule(config, self.model) == "layer-major"
        if config.grad_accum > 1 and config.stream_schedule == "layer-major" and not layer_major:
            _echo("poros: dropout is active, so gradient accumulation runs micro-major (layer-major would "
                  "draw the dropout masks in another order); set lora_dropout 0 for layer-major")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # peak_memory_gb: this run's training peak
        interrupted = False
        bar = _progress_bar(config.steps, self.global_step)
        window_start, window_first_tokens = time.perf_counter(), self.num_tokens
        window_bytes = self.model.store.stats.bytes_copied if self.model.store is not None else 0
        with _StopRequest() as stop, _showing(bar):
            while self.global_step < config.steps:
                micro_batches = [{key: value.to(self.device, non_blocking=True)
                                  for key, value in parallel.shard(batches.next_batch()).items()}
                                 for _ in range(config.grad_accum)]
                num_items_in_batch = sum((batch["labels"][..., 1:] != -100).sum() for batch in micro_batches)
                step_loss = 0
                if layer_major:  # each block crosses the link twice per step, not twice per micro-batch
                    for loss in self.model.forward_backward(
                            [{**batch, "num_items_in_batch": num_items_in_batch} for batch in micro_batches]):
                        step_loss = step_loss + loss
                else:
                    for index, batch in enumerate(micro_batches):
                        model, sync = parallel.forward_model(index, len(micro_batches))  # DDP (no_sync) or not
                        with sync:
                            loss = model(**batch, num_items_in_batch=num_items_in_batch, use_cache=False).loss
                            loss.backward()
                        step_loss = step_loss + loss.detach()
                if config.max_grad_norm is None:
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
                else:
                    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.max_grad_norm)
                learning_rate = optimizer.param_groups[0]["lr"]  # the rate this step uses
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                self.global_step += 1
                self.trainer.global_step = self.global_step
                self.pending_losses.append(step_loss)
                self.pending_tokens = self.pending_tokens + sum(batch["attention_mask"].sum()
                                                                for batch in micro_batches)
                if bar is not None:
                    bar.update(1)

                if self.global_step % config.logging_steps == 0:
                    self._sync()
                    bytes_copied = self.model.store.stats.bytes_copied if self.model.store is not None else 0
                    elapsed = max(time.perf_counter() - window_start, 1e-9)
                    self._log(learning_rate, grad_norm, self.num_tokens - window_first_tokens, elapsed,
                              bytes_copied - window_bytes, bar)
                    window_start, window_first_tokens, window_bytes = time.perf_counter(), self.num_tokens, bytes_copied
                last_step = self.global_step == config.steps
                # a signal on any rank stops every rank after the same step
                if parallel.any_rank(stop.signal_name is not None, self.device) and not last_step:
                    stop.signal_name = stop.signal_name or "SIGINT"  # (it arrived on another rank)
                    interrupted = True
                    self._save_checkpoint(optimizer, scheduler, batches)
                    self._announce_interrupt(stop.signal_name)
                    break
                if config.save_steps and (self.global_step % config.save_steps == 0 or last_step):
                    self._save_checkpoint(optimizer, scheduler, batches)
        self._sync()
        final = self.losses[-1] if self.losses else None
        if not interrupted:
            _echo(f"poros: trained {self.global_step} steps"
                  + (f", final loss {final:.4f}" if final is not None else ""))
        return TrainResult(self.global_step, list(self.losses), final, interrupted, self.output_dir,
                           self.last_checkpoint, list(self.log_history))

    # -- logging -------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Move the step losses and token counts kept as tensors since the last sync to Python numbers."""
        pending = self.pending_losses
        if pending and self.parallel.active:  # the log shows the mean over ranks
            pending = list(self.parallel.mean(torch.stack([torch.as_tensor(x) for x in pending])))
        synced = [float(loss) for loss in pending]
        self.pending_losses.clear()
        self.losses.extend(synced)
        self.window_losses.extend(synced)
        self.num_tokens += self.parallel.total(self.pending_tokens, self.device)
        self.pending_tokens = 0

    def _log(self, learning_rate: float, grad_norm: torch.Tensor, window_tokens: int, elapsed: float,
             window_bytes: int, bar) -> None:
        window, self.window_losses = self.window_losses, []
        peak, peak_kind = _peak_memory(self.device)
        row = {
            "step": self.global_step,
            "loss": sum(window) / len(window),
            "learning_rate": float(learning_rate),
            "grad_norm": float(grad_norm),
            "tokens_per_second": window_tokens / elapsed,
            "num_tokens": self.num_tokens,
            "peak_memory_gb": peak,
            "peak_memory_kind": peak_kind,
            "h2d_gb_per_s": window_bytes / elapsed / 1e9,
        }
        if self.parallel.active:
            row["world_size"] = self.parallel.world.size
        self.log_history.append(row)
        if self.parallel.is_main:
            with open(self.output_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")
        peak_text = f"{peak:.2f} GB ({peak_kind})" if peak is not None else "n/a"
        _echo(f"step {row['step']}/{self.config.steps} | loss {row['loss']:.4f} | lr {row['learning_rate']:.3e} | "
              f"grad_norm {row['grad_norm']:.4f} | {row['tokens_per_second']:.0f} tok/s | peak {peak_text} | "
              f"h2d {row['h2d_gb_per_s']:.2f} GB/s")
        if bar is not None:
            bar.set_postfix(loss=f"{row['loss']:.4f}")

    def _rewrite_metrics(self) -> None:
        """``metrics.jsonl`` = this run's log history so far (empty on a fresh run)."""
        lines = "".join(json.dumps(row) + "\n" for row in self.log_history)
        temporary = self.output_dir / f".{METRICS_FILE}.tmp-{os.getpid()}"
        temporary.write_text(lines, encoding="utf-8")
        os.replace(temporary, self.output_dir / METRICS_FILE)

    # -- checkpoints -----------------------------------------------------------------------------
    def _save_checkpoint(self, optimizer, scheduler, batches) -> None:
        self._sync()
        config = self.config
        trainer_state = {
            "global_step": self.global_step,
            "max_steps": config.steps,
            "logging_steps": config.logging_steps,
            "save_steps": config.save_steps,
            "train_batch_size": config.batch_size,
            "grad_accum": config.grad_accum,
            "num_tokens": self.num_tokens,
            "world_size": self.parallel.world.size,
            "losses": self.losses,
            "log_history": self.log_history,
        }
        if self.parallel.is_main:  # data parallel: rank 0 writes; the others wait for it
            self.last_checkpoint = checkpoints.write_checkpoint(
                self.output_dir, self.global_step, write_adapter=self.trainer._write_adapter, optimizer=optimizer,
                scheduler=scheduler, trainer_state=trainer_state, data_state=batches.state_dict(),
                poros_config=self.trainer._poros_config_record(), save_total_limit=config.save_total_limit,
            )
            logger.info("poros: wrote %s", self.last_checkpoint)
        else:
            self.last_checkpoint = self.output_dir / f"{checkpoints.CHECKPOINT_PREFIX}{self.global_step}"
        self.parallel.barrier()

    def _announce_interrupt(self, signal_name: str) -> None:
        command, python = self.trainer.resume_commands(self.last_checkpoint)
        _echo(f"poros: {signal_name} received: stopped after step {self.global_step}/{self.config.steps} and saved "
              f"{self.last_checkpoint}\n"
              f"poros: resume with\n    {command}\n"
              f"poros: or in Python\n    {python}")


def _stream_schedule(config, model) -> str:
    """The schedule a run uses: the configured one, micro-major when the model has a dropout."""
    from poros.stream.executor import dropout_modules

    if config.stream_schedule == "layer-major" and dropout_modules(model):
        return "micro-major"
    return config.stream_schedule


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def _progress_bar(total: int, initial: int):
    if not sys.stdout.isatty():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout)


@contextlib.contextmanager
def _showing(bar):
    if bar is None:
        yield
        return
    _ACTIVE_BAR.append(bar)
    try:
        yield
    finally:
        _ACTIVE_BAR.remove(bar)
        bar.close()

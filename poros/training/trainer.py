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

import json
import logging
import os
import pathlib
import shlex
from typing import TYPE_CHECKING, Any

import torch

from poros.training import checkpoint as checkpoints
from poros import distributed
from poros.training import evaluation
from poros.training import model_card
from poros.training import tracking
from poros.adapters import lora_target_modules
from poros.devices import cpu_threads, resolve_device
from poros.errors import ConfigError, PorosError, TrainingCheckpointError, UnsupportedModelError
from poros.training.progress import echo
from poros.training.run import METRIC_FIELDS, METRICS_FILE, TrainingRun, TrainResult, stream_schedule  # noqa: F401 (re-exported)
from poros.training.moe import expert_lora_line, expert_lora_targets, router_aux_line

if TYPE_CHECKING:
    from poros.config import PorosConfig
    from poros.dropin.model import PorosModel

logger = logging.getLogger("poros")

#: Fields that shape the model PorosTrainer builds (the base, the adapters, where it streams):
#: fixed when the trainer is created, so ``train()`` cannot override them.
FIELDS_FIXED_AT_LOAD = (
    "model", "revision", "quantization", "double_quant", "compute_dtype", "attn_implementation",
    "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora", "lora_on_experts",
    "device", "num_slots", "deterministic", "require", "embeddings_on_host", "loss_chunks", "mlp_chunks",
    "lora_placement", "host_tier", "host_budget", "read_ahead", "cache_dir", "no_cache", "cpu_threads",
    "boundary_every",
)
# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class PorosTrainer:
    """Train a LoRA adapter on a streamed NF4 base; save it the way PEFT does.

    Build it with :meth:`from_pretrained` / :meth:`from_config`, or around a :class:`PorosModel`
    you prepared yourself (``PorosTrainer(poros.prepare(peft_model), tokenizer, config)``).

    Attributes:
        model: the :class:`~poros.dropin.model.PorosModel`.
        tokenizer: the tokenizer (None when the checkpoint has none).
        config: the :class:`~poros.config.PorosConfig` the trainer was created with; ``train()``
            overrides apply to that run only.
        run_config: the config of the last ``train()`` with its overrides (``config`` before any);
            what :meth:`save` records.
        optimizer, scheduler: those of the last ``train()`` (None before).
        global_step: optimizer steps done by the last ``train()``, resumed steps included.
        eval_set: the eval batches of the last ``train()`` (``eval_split`` or ``eval_dataset``), or None.
        launch_command: set by the CLI to the ``argv`` it ran; the resume command printed on an
            interrupt is that command with ``--resume_from <checkpoint>``.
        last_result: the :class:`TrainResult` of the last ``train()`` (None before); the model card
            :meth:`save` writes reports it.
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
        self.eval_set: evaluation.EvalSet | None = None
        self.last_result: TrainResult | None = None

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
        :func:`poros.loading.load.load_pretrained`, then ``torch.manual_seed(seed)`` and PEFT's
        ``get_peft_model`` with its default initialization (``lora_B`` zero), moves the adapters to
        the compute device (:func:`poros.loading.load.adapters_to_device`), streams the model with
        :func:`poros.prepare`, and prints the detection summary with the guarantee label. A mixture-of-experts
        model gets its fused experts packed to NF4 first (``quantize_experts``, :func:`poros.quantize_experts`;
        the choice is printed), and ``output_router_logits`` (when set) is written into its config; on a model whose
        config has ``router_aux_loss_coef`` a line says whether the loss adds the router aux loss. After loading,
        ``cpu_threads`` sets torch's CPU thread count for the process (:func:`poros.devices.cpu_threads`).

        Raises:
            ConfigError: ``config.validate()`` fails, or ``target_modules`` names no linear.
            CheckpointLoadError, UnknownArchitectureError, and the gates of :func:`poros.prepare`
                (e.g. ``GuaranteeError`` when ``require`` is not met).
        """
        import peft

        from poros.loading.cache import cache_root
        from poros.dropin import banner
        from poros.dropin.model import prepare
        from poros.loading.experts import quantize_experts_for_run
        from poros.loading.load import adapters_to_device, load_pretrained
        from poros.stream.options import StreamOptions
        from poros.plan.run_plan import fit_host_ram

        config.validate()
        tracking.check_installed(config.report_to)  # before the model loads
        # a missing GPU is named before any weight is read; under torchrun: this rank's device
        device = distributed.join_launched_job(resolve_device(config.device, check=True))
        if config.kernels == "liger" and device.type != "cuda":
            raise ConfigError(f"kernels='liger' on {device}: liger-kernel's kernels are Triton kernels, which run on "
                              "CUDA devices only; expected a CUDA device. Fix: kernels: default on this machine.")
        # the host RAM the run needs against this machine's: a host budget that fits, or a refusal, before loading
        config, refit = fit_host_ram(config)
        if refit is not None:
            echo(refit)
        if config.deterministic and device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        with distributed.shared_host_copy():  # the node's ranks: local rank 0 first (see docs/multi-gpu.md)
            loaded = load_pretrained(
                config.model, quantization=config.quantization, compute_dtype=config.compute_dtype,
                double_quant=config.double_quant, device=device, attn_implementation=config.attn_implementation,
                revision=config.revision, cache_dir=None if config.no_cache else cache_root(config.cache_dir),
            )
        threads = cpu_threads(config.cpu_threads, device, loaded.model.config.get_text_config().hidden_size)
        if threads is not None and threads != torch.get_num_threads():  # for the process, as OMP_NUM_THREADS would
            torch.set_num_threads(threads)
            echo(f"poros: {threads} CPU thread{'s' if threads > 1 else ''} (cpu_threads={config.cpu_threads!r})")
        experts = quantize_experts_for_run(loaded.model, config.quantize_experts)
        if experts is not None:
            echo(experts)
        if config.output_router_logits is not None:
            loaded.model.config.output_router_logits = config.output_router_logits
        router = router_aux_line(loaded.model.config, config.output_router_logits)
        if router is not None:
            echo(router)
        target_parameters = expert_lora_targets(loaded.model, config)
        lora_config = peft.LoraConfig(
            r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=lora_target_modules(loaded.model, config.target_modules),
            use_rslora=config.use_rslora, use_dora=config.use_dora, task_type="CAUSAL_LM",
            target_parameters=target_parameters,
        )
        torch.manual_seed(config.seed)
        peft_model = peft.get_peft_model(loaded.model, lora_config)
        if experts is not None:
            echo(expert_lora_line(peft_model, config))
        adapters_to_device(peft_model, loaded.device)  # PEFT puts block adapters beside their host base layer
        options = StreamOptions.from_config(config, schedule=stream_schedule(config, peft_model))
        with banner.silenced():  # the detection summary below says it in full
            model = prepare(peft_model, options=options)  # loss_chunks > 1: prepare installs the chunked loss
        chunks = model.stream_options.loss_chunks  # the config's, or what the budget plan raised it to
        if getattr(model.kernel_report, "fused_loss", False) and config.loss_chunks > 1:
            echo(f"poros: loss_chunks={config.loss_chunks} is not installed: Liger's fused linear cross-entropy "
                 "(kernels: liger) computes the head and the loss, one chunk of logits at a time")
        if chunks > 1:
            echo(f"poros: loss_chunks={chunks}: the head and the loss are computed over {chunks} token "
                  "chunks (the whole logits never exist): bitwise a resident run with the same loss_chunks, numerically (not bitwise) HF's "
                  "default loss")
        if config.mlp_chunks > 1:
            echo(f"poros: mlp_chunks={config.mlp_chunks}: each block's MLP, norms and attention projections run over "
                  f"{config.mlp_chunks} sequence chunks: bitwise a resident run with the same mlp_chunks, numerically (not bitwise) the whole MLP"
                  + (f"; not tiled: {model._tiled_mlp.untiled}" if model._tiled_mlp.untiled else ""))
        if model.budget_plan is not None:
            echo(model.budget_plan.summary())
        if model.host_plan.notable:
            echo(f"poros: host: {model.host_plan.reason}")
        if model.detection is not None:
            echo(model.detection.summary())
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
            RunLockedError: another live run holds ``output_dir`` (:mod:`poros.training.run_lock`).
            OutputDirError: ``output_dir`` holds another run's results and neither ``overwrite`` nor a
                checkpoint to resume is given; or it cannot be written (full, read-only).
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
        from poros.training import run_lock

        self.last_result = None
        with run_lock.hold(config.output_dir):  # one run per output_dir (re-entrant: the CLI holds it through save)
            self.last_result = TrainingRun(self, config, data_source).execute()  # the model card reads it
            return self.last_result

    def evaluate(self, dataset: Any = None, *, max_batches: int | None = None) -> dict[str, Any]:
        """The eval loss of the adapter now, computed as ``train()`` computes it between steps.

        Evaluates ``dataset`` (anything ``poros.data.load_dataset`` takes), else the eval set of the
        last ``train()``, else the config's ``eval_dataset``; see :func:`poros.training.evaluation.evaluate_trainer`.

        Returns:
            The row ``train()`` logs: ``step`` (:attr:`global_step`), ``eval_loss``, ``eval_perplexity``...
        """
        return evaluation.evaluate_trainer(self, dataset, max_batches=max_batches)

    def generate(self, prompt: str, **options: Any) -> str:
        """The model's continuation of ``prompt`` with the adapter as trained so far; ``options`` as for
        :func:`poros.export.generate.generate_text` (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``chat``)."""
        from poros.export.generate import generate_text

        return generate_text(self.model, self.tokenizer, prompt, **options).text

    # -- saving --------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike | None = None) -> pathlib.Path:
        """Write the adapter (PEFT layout), the tokenizer and ``poros_config.json`` into ``directory`` (default: the
        run's ``output_dir``, beside its checkpoints and ``metrics.jsonl``).

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
        target = pathlib.Path(self.run_config.output_dir if directory is None else directory)
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
            model_card.write_model_card(temporary, self._poros_config_record(), self.last_result,
                                        launch_command=self.launch_command)  # over PEFT's template
        for name in previous_files - {*new_files, checkpoints.POROS_CONFIG_FILE}:
            stale = target / name
            if stale.is_file():
                stale.unlink()
        echo(f"poros: saved the adapter to {target}")
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
                adapter_config.base_model_name_or_path = model_card.base_model_reference(self.run_config.model)
            # save_embedding_layers=False: "auto" asks the hub whether the vocabulary was resized; the
            # embeddings are frozen base weights here, never trained.
            peft_model.save_pretrained(directory, save_embedding_layers=False)
        finally:
            for name, value in previous.items():
                peft_model.peft_config[name].base_model_name_or_path = value

    def _poros_config_record(self, **extra: Any) -> dict[str, Any]:
        from poros import __version__

        detection = self.model.detection
        ranks = distributed.world().size if distributed.reducing() else 1
        return {
            "poros_version": __version__,
            "family": self.model.descriptor.name,
            "guarantee": detection.guarantee if detection else None,
            "guarantee_reason": detection.reason if detection else None,
            "steps_done": self.global_step,
            "base_model_name_or_path": model_card.base_model_reference(self.run_config.model),
            **self._base_identity(),
            "config": self.run_config.to_dict(),
            # batch_size is per device (HF's per_device_train_batch_size); the ranks together train the global batch
            "per_device_batch_size": self.run_config.batch_size,
            "global_batch_size": self.run_config.batch_size * ranks,
            "world_size": ranks,
            **extra,
        }

    def _base_identity(self) -> dict[str, Any]:
        """``{"base_identity": {"model", "sha256"}}``: the fingerprint of the base's weight files
        (:func:`poros.export.adapter_fit.base_identity`) that ``poros merge`` and ``poros generate`` compare;
        empty where the base is no checkpoint on disk (a model built in memory)."""
        from poros.export.adapter_fit import BASE_IDENTITY_KEY, base_identity
        from poros.loading.load import inspect_checkpoint, resolve_checkpoint

        model = self.run_config.model
        try:
            directory = resolve_checkpoint(model, revision=self.run_config.revision)
            files = inspect_checkpoint(directory, allow_pickle=True).weight_files
        except (PorosError, OSError, ValueError):
            return {}
        return {BASE_IDENTITY_KEY: {"model": str(model), "sha256": base_identity(files)}}

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


def _saved_files(directory: pathlib.Path) -> list[str]:
    """The files a previous :meth:`PorosTrainer.save` wrote into ``directory`` (its ``poros_config.json``)."""
    try:
        record = json.loads((directory / checkpoints.POROS_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = record.get("files", []) if isinstance(record, dict) else []
    return [name for name in files if isinstance(name, str) and "/" not in name and name not in ("", ".", "..")]

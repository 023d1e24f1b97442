"""``PorosConfig``: every knob of a training run, as one typed dataclass.

The same object comes from a commented ``poros.yaml`` (written by ``poros init``), from a dict,
from ``--key value`` overrides on the ``poros train`` command line, or from Python. Every way in
is type-checked against the dataclass annotations, and an unknown key fails by name with the
closest field as a suggestion (nanoGPT's configurator, made strict); HF / TRL / axolotl names
(``learning_rate``, ``max_steps``...) mean their Poros field everywhere (:mod:`poros.spellings`)::

    config = PorosConfig.from_yaml("poros.yaml").apply_overrides(["--steps", "50", "--lr", "1e-4"])
    config.to_yaml("poros.yaml")          # commented: every field with its doc line and choices

Torch-free: ``import poros.config`` imports only the standard library and PyYAML.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import shlex
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from poros.errors import ConfigError
from poros.settings import HOST_TIERS, SETTINGS, config_fields, documented_fields, fields_table
from poros.settings import problems as setting_problems
from poros.spellings import (YamlLoader, check_type, choice_list, known_fields, parse_budget, parse_overrides,
                             report_to_names, yaml_line)

__all__ = ["HOST_TIERS", "PorosConfig", "FIELD_SECTIONS", "field_docs", "fields_markdown", "parse_budget", "report_to_names"]

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda|cuda:\d+")
TARGET_KEYWORDS = ("all-linear", "default")


def _field(default: Any, doc: str, *, choices: tuple[Any, ...] = (), section: str = "") -> Any:
    """A dataclass field carrying its one-line ``doc``, its ``choices`` and, on the first field of a
    group, the ``section`` title used by the YAML and the docs."""
    metadata = {"doc": doc, "choices": choices, "section": section}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


#: suffixes of data files, never of a config (a config may be JSON: JSON is YAML)
DATASET_SUFFIXES = (".jsonl", ".csv", ".tsv", ".parquet", ".arrow")
#: the columns of the dataset formats Poros reads (poros.data), none of them a PorosConfig field
DATASET_COLUMNS = frozenset({"messages", "conversations", "text", "prompt", "completion", "instruction"})


def _dataset_for_config(path: Path, what: str) -> ConfigError:
    return ConfigError(f"{path} {what}: a dataset, given where the config goes (poros train's first argument "
                       f"is a poros.yaml). Fix: poros train --dataset {path} (a config before it if you have one), "
                       f"or dataset: {path} in the poros.yaml.")


@dataclass
@config_fields  # the streaming settings (poros.settings.STREAMING), after the fields below
class PorosConfig:
    """A Poros training run: model, adapter, data, optimisation, checkpoints and streaming.

    Build it from keywords, :meth:`from_yaml`, :meth:`from_dict` or :meth:`apply_overrides`;
    construction type-checks every field and runs :meth:`validate`. ``docs/configuration.md``
    documents every field (each field's ``metadata["doc"]`` is its line there and in the YAML).

    Raises:
        ConfigError: a field has the wrong type or an invalid value; the message names the field,
            the value found, what was expected and the fix.
    """

    # -- model ---------------------------------------------------------------------------------
    model: str = _field("poros-tiny-qwen3", "HF model id, local checkpoint directory, or the bundled "
                        "'poros-tiny-qwen3' (a tiny Qwen3 that trains on CPU).", section="model")
    revision: str | None = _field(None, "Git revision (branch, tag or commit) of an HF model id; null: the default "
                                  "branch.")
    quantization: str = _field("nf4", "4-bit type of the frozen base (bitsandbytes bnb_4bit_quant_type).",
                               choices=("nf4", "fp4"))
    double_quant: bool = _field(False, "Quantize the quantization constants too (bnb_4bit_use_double_quant): "
                                "about 0.4 bits less per weight.")
    compute_dtype: str = _field("bfloat16", "Dtype of the computation and of every unquantized base tensor.",
                                choices=("bfloat16", "float16", "float32"))
    quantize_experts: bool | None = _field(None, "MoE models: pack the fused expert tensors to NF4 per expert "
                                           "(poros.quantize_experts); null: on for MoE, printed; false: bf16 experts.")
    output_router_logits: bool | None = _field(None, "MoE models: add the router aux loss (load_balancing_loss_func); null: the model config's own.")
    lora_on_experts: bool = _field(True, "MoE models: LoRA (rank lora_rank per expert) on the fused experts too, NF4 or bf16 (PEFT target_parameters); false: the linears only.")
    # -- adapter ---------------------------------------------------------------------------------
    lora_rank: int = _field(16, "LoRA rank r.", section="LoRA adapter")
    lora_alpha: int = _field(32, "LoRA alpha; the update is scaled by alpha / r (alpha / sqrt(r) with rsLoRA).")
    lora_dropout: float = _field(0.0, "Dropout on the LoRA input, in [0, 1).")
    target_modules: str | list[str] = _field(
        "all-linear", "Linears that get adapters: 'all-linear' (every linear of a decoder block, per family), "
        "'default' (the attention projections), or a list of leaf names such as [q_proj, v_proj].",
        choices=("all-linear", "default", "[names]"))
    use_rslora: bool = _field(False, "Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    use_dora: bool = _field(False, "DoRA: weight-decomposed LoRA (a trainable magnitude vector per target).")
    # -- data -----------------------------------------------------------------------------------
    dataset: str = _field("poros-tiny-chat", "HF dataset id, a .jsonl/.json/.csv file, 'synthetic', or the "
                          "bundled 'poros-tiny-chat'.", section="data")
    dataset_split: str = _field("train", "Split of an HF dataset (or of a local file loaded with datasets).")
    chat_template: str | None = _field(None, "Jinja chat template for conversations; null: the tokenizer's own.")
    seq_len: int = _field(512, "Tokens per example, up to the model's max_position_embeddings; longer examples "
                          "are truncated to it (one WARNING says how many).")
    packing: bool = _field(False, "Pack training examples into rows of up to seq_len tokens (best fit decreasing, as "
                           "TRL's packing=True), each attending only to itself (position_ids restart at 0); eval is not "
                           "packed. Bitwise a resident run with the same packing.")
    # -- evaluation and tracking ------------------------------------------------------------------------
    eval_dataset: str | None = _field(None, "Held-out data for eval_loss: an HF dataset id or a .jsonl/.json/.csv "
                                      "file, read like dataset; null: none (or eval_split).",
                                      section="evaluation and tracking")
    eval_dataset_split: str = _field("validation", "Split of an HF eval_dataset (or the key of a .json object).")
    eval_split: float = _field(0.0, "Fraction of dataset held out for evaluation, in [0, 1): the same examples for "
                               "a given seed and dataset, never trained on; 0: none. Not with eval_dataset.")
    eval_steps: int = _field(0, "Evaluate every this many steps and at the last step; 0: at the last step only. "
                             "Evaluation is a no-grad pass that leaves the training run bit for bit unchanged.")
    eval_batches: int | None = _field(None, "Batches (of batch_size) per evaluation, the first ones in order; "
                                      "null: the whole eval set.")
    report_to: str | list[str] = _field(
        "none", "Experiment trackers that get every metric row and the config: tensorboard (event files in "
        "output_dir/runs/), wandb (offline without an API key), mlflow, trackio, all (those installed) or none; "
        "a list allowed, e.g. [tensorboard, wandb]. Each needs its extra: pip install 'poros-train[tensorboard]'.",
        choices=("none", "tensorboard", "wandb", "mlflow", "trackio", "all"))
    # -- optimisation -------------------------------------------------------------------------------
    batch_size: int = _field(1, "Examples per micro-batch on each device (HF's per_device_train_batch_size): data "
                             "parallel over N ranks trains N x batch_size per micro-batch.", section="optimisation")
    grad_accum: int = _field(1, "Micro-batches accumulated per optimizer step.")
    steps: int = _field(100, "Optimizer steps to train; 0 with epochs: as many as epochs takes. A set steps "
                        "overrides epochs (as HF's max_steps overrides num_train_epochs).")
    epochs: float | None = _field(None, "Passes over the training data (HF's num_train_epochs); given without "
                                  "steps, the run trains ceil(epochs x (batches per epoch // grad_accum)) steps. "
                                  "null: steps decides.")
    lr: float = _field(2e-4, "Peak learning rate of AdamW.")
    schedule: str = _field("cosine", "Learning-rate schedule (transformers get_scheduler names).",
                           choices=("constant", "constant_with_warmup", "linear", "cosine"))
    warmup: int = _field(0, "Linear warm-up steps; fewer than steps.")
    weight_decay: float = _field(0.0, "AdamW weight decay.")
    max_grad_norm: float | None = _field(1.0, "Clip the global gradient norm to this; null disables clipping.")
    seed: int = _field(42, "Seed of the adapter initialisation and of data shuffling.")
    # -- logging and checkpoints ----------------------------------------------------------------------
    logging_steps: int = _field(10, "Print the loss every this many steps.", section="logging and checkpoints")
    save_steps: int = _field(0, "Write output_dir/checkpoint-{step}/ every this many steps; 0: no intermediate "
                             "checkpoints (the final adapter is always saved).")
    save_total_limit: int | None = _field(None, "Keep only the newest this many checkpoints; null keeps all.")
    output_dir: str = _field("./poros_output", "Where the adapter, tokenizer, poros_config.json and checkpoints "
                             "go.")
    resume_from: str | None = _field(None, "Resume training: 'auto' (newest checkpoint in output_dir) or a "
                                     "checkpoint directory; null starts fresh.", choices=(None, "auto", "PATH"))
    overwrite: bool = _field(False, "Let a fresh run replace another run's adapter, checkpoints and metrics in "
                             "output_dir (without it such a run is refused; resume_from continues one).")
    # -- runtime and streaming ---------------------------------------------------------------------------
    device: str = _field("auto", "Compute device: 'auto' (cuda when available, else cpu), 'cpu', 'cuda' or "
                         "'cuda:N'.", choices=("auto", "cpu", "cuda", "cuda:N"), section="runtime and streaming")
    deterministic: bool = _field(True, "torch.use_deterministic_algorithms(True): the bitwise-reproducible mode.")
    attn_implementation: str | None = _field(None, "Attention kernels of the HF model; null: transformers' default.",
                                             choices=(None, "sdpa", "eager"))
    stream_schedule: str = _field("layer-major", "How gradient accumulation streams the blocks: 'layer-major' (each "
                                  "block crosses the link twice per step for all micro-batches, whose boundary "
                                  "states wait on the device, or on the host under a tight vram_budget; bitwise the "
                                  "same gradients; with lora_dropout > 0 "
                                  "the run falls back to micro-major and says so) or 'micro-major' (each "
                                  "micro-batch streams every block, 2 x grad_accum copies per block per step).",
                                  choices=("micro-major", "layer-major"))
    pad_to_multiple_of: int | None = _field(None, "Pad each training batch to a multiple of this many tokens (HF's "
                                            "DataCollatorWithPadding option); null: to its longest row. Fewer lengths "
                                            "for cuda_graphs to capture (each length is graphs of its own). Bitwise a "
                                            "resident run with the same padding (it changes the kernels' shapes).")
    no_cache: bool = _field(False, "Bypass the NF4 block cache: quantize the checkpoint on every load and write "
                            "nothing.")
    cpu_threads: int | str = _field("auto", "Threads of torch's CPU ops (torch.set_num_threads, for the process): "
                                    "'auto' takes 1 on the CPU for a model narrower than poros.devices."
                                    "ONE_THREAD_BELOW_HIDDEN (its ops are too small to share) and torch's default "
                                    "otherwise or when OMP_NUM_THREADS is set; an integer sets it.")

    def __post_init__(self) -> None:
        hints = _type_hints()
        for f in dataclasses.fields(self):
            value = check_type(f.name, getattr(self, f.name), hints[f.name], _example)
            if f.name == "target_modules":
                value = _normalize_targets(value)
            object.__setattr__(self, f.name, value)
        self.validate()

    # -- checks ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every value; raise one :class:`ConfigError` listing every problem.

        Raises:
            ConfigError: each line names the field, the value found, what is expected and the fix.
        """
        problems: list[str] = []

        def need(ok: bool, name: str, expected: str, fix: str) -> None:
            if not ok:
                problems.append(f"{name}={getattr(self, name)!r}: expected {expected}; {fix}")

        problems += setting_problems(self)  # the streaming settings' own checks (poros.settings)
        for name in ("lora_rank", "lora_alpha", "seq_len", "batch_size", "grad_accum", "logging_steps"):
            need(getattr(self, name) >= 1, name, "an integer >= 1", f"set {name} to a positive integer")
        need(self.steps >= 1 or (self.steps == 0 and self.epochs is not None), "steps", "an integer >= 1 (0 only "
             "with epochs)", "set steps to a positive integer, or epochs to train for passes over the data")
        need(self.epochs is None or self.epochs > 0, "epochs", "a number > 0 or null", "e.g. epochs: 3")
        need(self.cpu_threads == "auto" or (isinstance(self.cpu_threads, int) and self.cpu_threads >= 1),
             "cpu_threads", "'auto' or an integer >= 1", "e.g. cpu_threads: 1")
        for name in ("model", "dataset", "dataset_split", "output_dir"):
            need(bool(getattr(self, name).strip()), name, "a non-empty string", f"set {name}")
        for name in ("quantization", "compute_dtype", "schedule", "attn_implementation", "stream_schedule"):
            choices = _metadata(name)["choices"]
            need(getattr(self, name) in choices, name, f"one of {choice_list(choices)}",
                 f"pick one of {choice_list(choices)}")
        need(bool(DEVICE_PATTERN.fullmatch(self.device)), "device", "'auto', 'cpu', 'cuda' or 'cuda:N'",
             "e.g. device: cuda:0")
        need(self.pad_to_multiple_of is None or self.pad_to_multiple_of >= 1, "pad_to_multiple_of",
             "an integer >= 1 or null", "e.g. pad_to_multiple_of: 64")
        need(0.0 <= self.lora_dropout < 1.0, "lora_dropout", "a float in [0, 1)", "e.g. lora_dropout: 0.05")
        need(self.lr > 0, "lr", "a float > 0", "e.g. lr: 2.0e-4")
        need(self.weight_decay >= 0, "weight_decay", "a float >= 0", "e.g. weight_decay: 0.0")
        need(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm", "a float > 0 or null",
             "set max_grad_norm: null to disable clipping")
        need(self.seed >= 0, "seed", "an integer >= 0", "e.g. seed: 42")
        need(self.warmup >= 0, "warmup", "an integer >= 0", "e.g. warmup: 0")
        if self.warmup > 0 and self.steps >= 1:
            need(self.warmup < self.steps, "warmup", f"fewer warm-up steps than steps={self.steps}",
                 f"lower warmup below {self.steps} or raise steps")
        need(self.save_steps >= 0, "save_steps", "an integer >= 0 (0: no intermediate checkpoints)",
             "e.g. save_steps: 50")
        need(self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit",
             "an integer >= 1 or null", "set save_total_limit: null to keep every checkpoint")
        if isinstance(self.target_modules, str):
            need(self.target_modules in TARGET_KEYWORDS, "target_modules", "'all-linear', 'default' or a list of "
                 "module names", "e.g. target_modules: [q_proj, v_proj]")
        else:
            need(bool(self.target_modules) and all(name.strip() for name in self.target_modules), "target_modules",
                 "a non-empty list of non-empty module names", "e.g. target_modules: [q_proj, v_proj]")
        if self.lora_placement == "host":
            need(self.optimizer_states != "device", "optimizer_states", "'auto' or 'host' with lora_placement: host "
                 "(poros.HostAdamW steps the host-kept LoRA tensors)", "set optimizer_states: host")
            need(self.stream_schedule == "layer-major" and self.lora_dropout == 0, "lora_placement",
                 "'device' or 'auto' unless stream_schedule is layer-major and lora_dropout 0 (the LoRA tensors "
                 "travel with their block only in layer-major accumulation)",
                 "set stream_schedule: layer-major and lora_dropout: 0, or lora_placement: device")
        if self.resume_from is not None:
            need(bool(self.resume_from.strip()), "resume_from", "'auto', a checkpoint directory or null",
                 "e.g. resume_from: auto")
        self._validate_evaluation(need)
        if self.chat_template is not None:
            need(bool(self.chat_template.strip()), "chat_template", "a Jinja template or null",
                 "set chat_template: null to use the tokenizer's template")
        if len(problems) == 1:
            raise ConfigError(f"invalid configuration: {problems[0]}")
        if problems:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))

    def _validate_evaluation(self, need) -> None:
        """The evaluation and tracking fields (``need`` as in :meth:`validate`)."""
        need(0.0 <= self.eval_split < 1.0, "eval_split", "a fraction in [0, 1) (0: no held-out split)",
             "e.g. eval_split: 0.1")
        if self.eval_dataset is not None:
            need(bool(self.eval_dataset.strip()), "eval_dataset", "a dataset id, a file or null", "e.g. eval_dataset: "
                 "data/val.jsonl")
            need(self.eval_split == 0.0, "eval_split", "0 when eval_dataset is set (one source of eval data)",
                 "keep eval_dataset or eval_split, not both")
        need(bool(self.eval_dataset_split.strip()), "eval_dataset_split", "a non-empty string", "e.g. validation")
        need(self.eval_steps >= 0, "eval_steps", "an integer >= 0 (0: evaluate at the last step only)",
             "e.g. eval_steps: 50")
        need(self.eval_steps == 0 or self.eval_dataset is not None or self.eval_split > 0, "eval_steps",
             "eval data to evaluate on", "set eval_split (e.g. 0.1) or eval_dataset, or eval_steps: 0")
        need(self.eval_batches is None or self.eval_batches >= 1, "eval_batches", "an integer >= 1 or null",
             "set eval_batches: null to evaluate on the whole eval set")
        names = report_to_names(self.report_to)
        choices = _metadata("report_to")["choices"]
        need(bool(names) and all(name in choices for name in names), "report_to",
             f"one or more of {choice_list(choices)}", "e.g. report_to: tensorboard, or tensorboard,wandb (--report-to tensorboard,wandb)")
        need(len(names) == 1 or not {"none", "all"} & set(names), "report_to", "'none' and 'all' alone",
             "list the trackers, or write report_to: all")

    # -- conversions ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, in declaration order, as plain Python values (lists copied)."""
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> PorosConfig:
        """A new config with ``changes`` applied (type-checked and validated).

        Raises:
            ConfigError: an unknown key (named, with the closest field) or an invalid value.
        """
        changes = _given(changes, "PorosConfig.replace()")
        return PorosConfig(**{**self.to_dict(), **changes})

    def steps_for_epochs(self, batches_per_epoch: int) -> tuple[int, str | None]:
        """``(steps, note)`` of the run: ``steps`` when set (the note says when it overrides ``epochs``), else
        ``ceil(epochs x max(batches_per_epoch // grad_accum, 1))``, HF Trainer's count (of the global batch)."""
        counted = None if self.epochs is None else math.ceil(self.epochs * max(batches_per_epoch // self.grad_accum, 1))
        if counted is None or self.steps == counted:
            return self.steps, None
        if self.steps:
            return self.steps, (f"steps={self.steps} overrides epochs={self.epochs:g} ({counted} steps), as HF's "
                                "max_steps overrides num_train_epochs; set steps: 0 to train by epochs")
        epochs = f"{self.epochs:g} epoch{'' if self.epochs == 1 else 's'}"
        return counted, f"{epochs} of {batches_per_epoch} batches, {self.grad_accum} per step: {counted} steps"

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "the configuration") -> PorosConfig:
        """Build a config from a mapping of field names; missing fields keep their defaults.

        Args:
            data: ``{field: value}``; values must have the field's type (an int is accepted for a
                float field; ``None`` for an optional one).
            source: where ``data`` came from, for error messages (e.g. the YAML path).

        Raises:
            ConfigError: ``data`` is not a mapping, holds an unknown key (named, with the closest
                field), or a value of the wrong type or out of range.
        """
        if not isinstance(data, dict):
            raise ConfigError(f"{source} holds a {type(data).__name__}, expected a mapping of PorosConfig fields "
                              "(key: value lines). Run `poros init` for a commented example.")
        data = _given(data, source)
        try:
            return cls(**data)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> PorosConfig:
        """Read a ``poros.yaml`` (as written by :meth:`to_yaml` or by hand).

        Raises:
            ConfigError: the file is missing or not valid YAML, or :meth:`from_dict` rejects it.
        """
        path = Path(path)
        if path.suffix.lower() in DATASET_SUFFIXES:
            raise _dataset_for_config(path, f"is a {path.suffix} file")
        try:
            stream = path.open(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist; expected a poros.yaml. Create one with "
                              f"`poros init {path}`, or check the path.") from None
        except OSError as error:
            raise ConfigError(f"cannot read config file {str(path)!r}: {error}") from None
        try:
            with stream:
                data = yaml.load(stream, Loader=YamlLoader)  # SafeLoader + YAML 1.2 floats (2e-4)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {' '.join(str(error).split())}. Fix the line shown, or "
                              "write a fresh file with `poros init`.") from None
        columns = sorted(DATASET_COLUMNS & set(data if isinstance(data, dict) else (data[0] if isinstance(data, list)
                                                                                 and data and isinstance(data[0], dict)
                                                                                 else ())))
        if columns and not (isinstance(data, dict) and set(data) & {f.name for f in dataclasses.fields(cls)}):
            raise _dataset_for_config(path, f"holds records with {', '.join(repr(c) for c in columns)}")
        return cls.from_dict({} if data is None else data, source=str(path))

    def to_yaml(self, path: str | Path | None = None, *, commented: bool = True) -> str:
        """The config as YAML; also written to ``path`` when given.

        Args:
            path: file to write (overwritten).
            commented: a header saying what the file is and how to run it, the fields grouped in
                sections, each preceded by its doc line and choices. ``False``: plain ``key: value``.

        Returns:
            The YAML text (what :meth:`from_yaml` reads back to an equal config).
        """
        if not commented:
            text = "".join(yaml_line(name, value) + "\n" for name, value in self.to_dict().items())
        else:
            name = shlex.quote(str(path)) if path is not None else "poros.yaml"
            lines = [
                f"# {name}: a Poros training configuration (every key is a PorosConfig field).",
                "# Written by `poros init`. Edit the values, then:",
                f"#   poros train {name}                # train; the adapter goes to output_dir",
                f"#   poros train {name} --dry-run      # check it and print the memory plan, no training",
                f"#   poros train {name} --steps 50     # any key can be overridden on the command line",
                "# Unknown keys are errors. Every key: docs/configuration.md.",
            ]
            for f in dataclasses.fields(self):
                meta = f.metadata
                if meta["section"]:
                    lines += ["", f"# -- {meta['section']} " + "-" * (72 - len(meta["section"]))]
                choices = f" Choices: {choice_list(meta['choices'])}." if meta["choices"] else ""
                lines += textwrap.wrap(f"{meta['doc']}{choices}", width=98, initial_indent="# ",
                                       subsequent_indent="#   ", break_on_hyphens=False)
                lines.append(yaml_line(f.name, getattr(self, f.name)))
            text = "\n".join(lines) + "\n"
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def apply_overrides(self, arguments: Iterable[str]) -> PorosConfig:
        """A new config with command-line overrides applied (nanoGPT's configurator, type-checked).

        Accepted forms: ``--key value``, ``--key=value``, ``--flag`` (a bool field set to true)
        and ``--no-flag`` (false). ``--seq-len`` and ``--seq_len`` are the same key. Values are
        parsed by the field's type: bools accept true/false/1/0/yes/no/on/off; ints and floats
        their literals (``1e-4``); lists are comma-separated (``--target-modules q_proj,v_proj``);
        ``null``/``none`` gives ``None`` for an optional field.

        Raises:
            ConfigError: an argument that is not ``--key``, an unknown key (named, with the
                closest field), a missing or unparsable value, or an invalid result.
        """
        changes = parse_overrides(arguments, [f.name for f in dataclasses.fields(PorosConfig)], _type_hints(),
                                  _example)
        try:
            return self.replace(**changes)
        except ConfigError as error:
            raise ConfigError(f"command-line overrides: {error}") from None


# -- fields and types --------------------------------------------------------------------------------

def _metadata(name: str) -> dict[str, Any]:
    return _fields_by_name()[name].metadata


def _fields_by_name() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(PorosConfig)}


def field_docs() -> list[dict[str, Any]]:
    """One dict per field: ``name``, ``type`` (as written in the docs), ``default``, ``choices``,
    ``doc``, ``section``; what ``docs/configuration.md`` tabulates."""
    return documented_fields(PorosConfig, _type_hints())


#: section title -> field names, in declaration order.
FIELD_SECTIONS: dict[str, list[str]] = {}  # filled below, once PorosConfig has every field


@functools.cache
def _type_hints() -> dict[str, Any]:
    return typing.get_type_hints(PorosConfig)


def _normalize_targets(value: str | list[str]) -> str | list[str]:
    """``"q_proj, v_proj"`` or ``"q_proj"`` -> a list; ``"all-linear"``/``"default"`` stay strings."""
    if isinstance(value, str) and value not in TARGET_KEYWORDS and value.strip():
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


def _example(name: str) -> str:
    default = _fields_by_name()[name].default
    examples = {"max_grad_norm": "1.0", "save_total_limit": "3", "resume_from": "auto", "attn_implementation": "sdpa",
                "revision": "main", "pad_to_multiple_of": "64", "chat_template": "null", "target_modules": "q_proj,v_proj",
                "eval_dataset": "data/val.jsonl", "eval_batches": "20", "report_to": "tensorboard"}
    if name in SETTINGS and SETTINGS[name].example:
        return SETTINGS[name].example
    if name in examples:
        return examples[name]
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def _given(data: dict[str, Any], source: str) -> dict[str, Any]:
    """``data`` keyed by field names (:func:`~poros.spellings.known_fields`); ``epochs`` given without
    ``steps`` sets steps 0 (the run counts them from epochs)."""
    data = known_fields(data, [f.name for f in dataclasses.fields(PorosConfig)], source)
    if data.get("epochs") is not None and "steps" not in data:
        data["steps"] = 0
    return data


def _accepting_aliases(init):
    """``PorosConfig(learning_rate=1e-4, ...)``: the dataclass ``__init__`` behind :func:`_given`."""

    @functools.wraps(init)
    def __init__(self, **fields: Any) -> None:
        init(self, **_given(fields, "PorosConfig()"))

    return __init__


PorosConfig.__init__ = _accepting_aliases(PorosConfig.__init__)  # type: ignore[method-assign]


def fields_markdown() -> str:
    """The Markdown table of every field (name, type, default, what it does) that
    ``docs/configuration.md`` embeds between its ``fields`` markers; a test keeps them equal."""
    return fields_table(field_docs())


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


for _doc in field_docs():
    FIELD_SECTIONS.setdefault(_doc["section"], []).append(_doc["name"])
del _doc

"""Merge a LoRA adapter into its base checkpoint, one tensor at a time: ``poros merge``.

::

    base checkpoint (safetensors shards)             merged checkpoint (plain HF layout)
     shard k ──header──────────────────────────────────────────────────▶ shard k' header
             ──tensor t──▶ cast to --dtype ──▶ adapted? PEFT's merge ──▶ bytes of t  (one tensor
                                                 (its own module tree)              in memory)
                                                                       + index, config, tokenizer...

PEFT's ``merge_and_unload`` needs the whole base in memory. Here the host holds one tensor (plus
the adapter) at a time: each output shard's header is written from the input shard's, then every
tensor is read, merged if adapted, written and dropped before the next one is read.

Notable features:

* **PEFT's own merge, per weight.** An adapted weight is put, under its module path, into a
  small module tree as an ``nn.Linear``; PEFT injects its LoRA layer there
  (``inject_adapter_in_model`` with the adapter's own ``LoraConfig``, so rank/alpha patterns,
  rsLoRA scaling and DoRA resolve as in the full model), casts the adapter as ``PeftModel`` does,
  loads the adapter's tensors with ``set_peft_model_state_dict`` and the layer runs ``merge()`` --
  the code ``merge_and_unload`` runs. So the result is tensor for tensor ``torch.equal`` to
  ``PeftModel.from_pretrained(base in --dtype, adapter).merge_and_unload()`` on the same device
  (tested per family for LoRA, rsLoRA and DoRA).
* **The checkpoint's own names and layout.** Every tensor keeps its name and shard; only the
  adapted weights change. Multimodal checkpoints (Gemma 3/4, Qwen 3.5 with a vision tower) keep
  their vision tower and their ``model.language_model.*`` names: the adapter's module paths (the
  text causal LM's, as Poros trained it) are matched to checkpoint names through the key mapping
  :mod:`poros.loading.load` loads them with. Tied embeddings stay tied (the checkpoint has no
  ``lm_head.weight``, as ``save_pretrained`` writes it).
* **A plain HF checkpoint out.** ``model-0000k-of-0000N.safetensors`` with
  ``model.safetensors.index.json`` (a single ``model.safetensors`` for a single-file base), the
  base's ``config.json`` (its dtype set to ``--dtype``), ``generation_config.json``, tokenizer and
  processor files (the adapter's tokenizer when it has one); no PEFT key or file: transformers'
  ``from_pretrained`` and vLLM load it as a base model.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch
from torch import nn

from poros.errors import CheckpointLoadError, ConfigError, UnsupportedAdapterError
from poros.export.adapter_fit import PEFT_PREFIX, check_adapter_fits, check_base_identity
from poros.spellings import human_bytes
from poros.export.shards import ShardReader, ShardWriter
from poros.export.merge_experts import ExpertLoRA, expert_loras, expert_slice, is_experts_path, merge_expert_weight

#: adapter tensor names PEFT's LoRA merge consumes (``lora_bias`` and embedding LoRA are refused)
ADAPTER_TENSORS = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
#: files of the base directory copied next to the merged weights (configs, tokenizer, chat template)
COPIED_FILES = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*")
WEIGHT_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass
class MergeResult:
    """What :func:`merge_adapter` wrote.

    Attributes:
        output: the merged checkpoint directory.
        base: the base checkpoint directory read.
        shards: weight files written.
        tensors: tensors written.
        merged_modules: adapted weights merged.
        bytes_written: bytes of the weight files.
        seconds: wall time.
        peak_rss_bytes: the process's peak resident memory at the end (``ru_maxrss``; None where unknown).
        files: the other files written (configs, tokenizer...).
    """

    output: pathlib.Path
    base: pathlib.Path
    shards: int
    tensors: int
    merged_modules: int
    bytes_written: int
    seconds: float
    peak_rss_bytes: int | None = None
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        peak = f", peak RSS {human_bytes(self.peak_rss_bytes)}" if self.peak_rss_bytes else ""
        return (f"poros: merged {self.merged_modules} adapted weights into {self.output}: {self.shards} shards, "
                f"{self.tensors} tensors, {human_bytes(self.bytes_written)} in {self.seconds:.1f} s{peak}")


def merge_adapter(adapter: str | os.PathLike, output: str | os.PathLike, *, model: str | os.PathLike | None = None,
                  dtype: str | torch.dtype = "bfloat16", device: str = "cpu", overwrite: bool = False,
                  progress: TextIO | None = sys.stderr) -> MergeResult:
    """Merge the LoRA adapter in ``adapter`` into its base checkpoint and write a full checkpoint to ``output``.

    Args:
        adapter: the adapter directory (``PorosTrainer.save`` / PEFT ``save_pretrained``).
        output: the directory to write (created; must not exist unless ``overwrite``).
        model: the base checkpoint (directory or hub id); default: the adapter's
            ``poros_config.json`` / ``adapter_config.json`` ``base_model_name_or_path``.
        dtype: dtype of the base's floating tensors, read and written (``merge_and_unload`` on a base
            loaded with ``from_pretrained(..., dtype=dtype)``).
        device: where each adapted weight is merged (``"cpu"`` or ``"cuda"``); the bits
            equal ``merge_and_unload`` run on that device type.
        overwrite: replace an existing ``output``.
        progress: a stream for one plain progress line per shard (None: silent).

    Raises:
        CheckpointLoadError: the adapter or base checkpoint is missing or incomplete; the base is
            quantized or not safetensors.
        UnsupportedAdapterError: an adapter that is not LoRA (with rsLoRA/DoRA), uses ``lora_bias``,
            adapts embeddings or a tied head, or names a module the checkpoint does not have.
        ConfigError: ``output`` exists (without ``overwrite``) or is the base or adapter directory;
            an unknown ``dtype``.
    """
    start = time.perf_counter()
    dtype = floating_dtype(dtype)
    plan = plan_merge(adapter, model, dtype)
    target = pathlib.Path(output).expanduser()
    _check_output(target, plan.base_path, plan.info.path, overwrite)
    shards = plan.checkpoint.weight_files
    staging = target.with_name(f".{target.name}.partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    merged_modules: set[str] = set()
    total_bytes = tensors_written = 0
    try:
        for number, shard in enumerate(shards, start=1):
            name = SINGLE_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            reader = ShardReader(shard)
            entries = [(key, shape, dtype if stored.is_floating_point else stored)
                       for key, (stored, shape) in reader.tensors.items()]
            with reader, ShardWriter(staging / name, entries, {**reader.metadata, "format": "pt"}) as writer:
                for key in writer.names:  # one tensor in memory at a time
                    tensor = plan.merged(key, reader.read(key), device, merged_modules)
                    writer.write(key, tensor)
                    del tensor
            total_bytes += writer.data_bytes
            tensors_written += len(entries)
            weight_map.update({key: name for key, _, _ in entries})
            if progress is not None:
                progress_line(progress, number, len(shards), len(merged_modules), len(plan.modules), start)
        plan.check_all_merged(merged_modules)
    except BaseException:  # nothing half-written is left behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if len(shards) > 1:
        _write_json(staging / WEIGHT_INDEX, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
    files = _copy_side_files(plan.base_path, plan.info.path, staging, dtype)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return MergeResult(target, plan.base_path, len(shards), tensors_written, len(merged_modules), total_bytes,
                       time.perf_counter() - start, peak_rss(), sorted(files))


@dataclass
class MergePlan:
    """What a merge reads, every check done before a base tensor is: the adapter, its base, the LoRA config
    and tensors, the adapted module paths. :func:`merge_adapter` writes safetensors from it,
    :func:`poros.export.gguf.merge_to_gguf` GGUF.

    Attributes:
        info: the adapter (:class:`poros.loading.load.AdapterInfo`).
        base_path: the base checkpoint directory.
        checkpoint: the base's :class:`poros.loading.load.CheckpointInfo` (config, shards, key mapping).
        dtype: the dtype floating tensors are read and merged in.
        lora_config: the adapter's PEFT ``LoraConfig``.
        adapter_tensors: the adapter's tensors, as PEFT saved them.
        modules: the module paths the adapter adapts.
    """

    info: Any
    base_path: pathlib.Path
    checkpoint: Any
    dtype: torch.dtype
    lora_config: Any
    adapter_tensors: dict[str, torch.Tensor]
    modules: list[str]
    expert_lora: dict[str, dict[str, ExpertLoRA]] = field(default_factory=dict)

    def merged(self, key: str, tensor: torch.Tensor, device: str, merged_modules: set[str]) -> torch.Tensor:
        """The checkpoint tensor ``key`` in :attr:`dtype`, the adapter merged in when it adapts it (its module
        path then goes into ``merged_modules``)."""
        tensor = _cast(tensor, self.dtype)
        name = model_key(key, self.checkpoint.key_mapping or {})
        expert = expert_slice(name)
        if expert is not None and expert[0] in self.expert_lora:
            path, parameter, index, rows = expert
            lora = self.expert_lora[path].get(parameter)
            if lora is None:
                return tensor
            merged_modules.update(lora.modules)
            return merge_expert_weight(tensor, lora, index, rows)
        module_path = _module_of(name)
        if module_path in self.modules and key.endswith(".weight"):
            merged_modules.add(module_path)
            return merge_weight(tensor, module_path, self.adapter_tensors, self.lora_config, device)
        return tensor

    def check_all_merged(self, merged_modules: set[str]) -> None:
        """Raise when an adapted module had no weight in the checkpoint (after every tensor was read).

        Raises:
            UnsupportedAdapterError: naming how many and one of them, and the likely cause.
        """
        missing = sorted(set(self.modules) - merged_modules)
        if missing:
            raise UnsupportedAdapterError(
                f"the adapter adapts {len(missing)} modules the checkpoint {self.base_path} has no weight for (e.g. "
                f"{missing[0]}); expected every adapted module's '<path>.weight' in the checkpoint. Is --model the "
                "base this adapter was trained on?")


def plan_merge(adapter: str | os.PathLike, model: str | os.PathLike | None, dtype: torch.dtype) -> MergePlan:
    """Read and check the adapter and its base for a merge, before any base tensor is read.

    Raises:
        CheckpointLoadError, UnsupportedAdapterError: as :func:`merge_adapter` says.
    """
    import peft

    from poros.loading.load import inspect_checkpoint, read_adapter, resolve_checkpoint

    info = read_adapter(adapter, model)
    base_path = resolve_checkpoint(info.base_model)
    checkpoint = inspect_checkpoint(base_path)
    check_adapter_fits(info.path, info.weights, info.base_model, checkpoint.text_config)  # before a weight is read
    check_base_identity(info.path, info.base_model, checkpoint.weight_files)
    if checkpoint.weight_format != "safetensors":
        raise CheckpointLoadError(f"{base_path} has pickle weights; poros merge reads safetensors. Convert the "
                                  "base with save_pretrained(safe_serialization=True) first.")
    if getattr(checkpoint.config, "quantization_config", None):
        raise CheckpointLoadError(
            f"{base_path} is a quantized checkpoint (its config.json has a quantization_config); merging needs the "
            "original bf16/fp16 weights. Pass the unquantized base with --model.")
    lora_config = peft.PeftConfig.from_pretrained(info.path)
    adapter_tensors = _adapter_tensors(info.weights, lora_config)
    modules = sorted({_adapted_module(name) for name in adapter_tensors})
    _check_tied(modules, checkpoint.text_config)
    linear = [m for m in modules if not is_experts_path(m)]
    experts = expert_loras(adapter_tensors, [m for m in modules if is_experts_path(m)], lora_config,
                           checkpoint.text_config)
    return MergePlan(info, base_path, checkpoint, dtype, lora_config, adapter_tensors, linear + [
        m for m in modules if is_experts_path(m)], experts)


def merge_weight(weight: torch.Tensor, module_path: str, adapter_tensors: dict[str, torch.Tensor], lora_config: Any,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """``weight`` (the base weight of the linear at ``module_path``) with the adapter merged, by PEFT's own code.

    The weight goes into a module tree under its path as an ``nn.Linear``; PEFT injects its LoRA
    layer there (the adapter's ``LoraConfig``, its targets narrowed to this path: rank and alpha
    patterns, rsLoRA and DoRA resolve as in the full model), casts the adapter as ``PeftModel``
    does, loads the adapter's tensors and runs the layer's ``merge()``. Returns the merged weight
    on the CPU.

    Raises:
        UnsupportedAdapterError: PEFT does not adapt this path with this config, or leaves adapter
            tensors unplaced.
    """
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer, cast_adapter_dtype

    root = nn.Module()
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.to(device), requires_grad=False)
    _attach(root, module_path, linear)
    config = copy.copy(lora_config)
    config.target_modules = {module_path}  # exactly this one; rank/alpha patterns still match the full path
    config.exclude_modules = None
    peft.inject_adapter_in_model(config, root, adapter_name="default")
    layer = root.get_submodule(module_path)
    if not isinstance(layer, BaseTunerLayer):
        raise UnsupportedAdapterError(f"PEFT does not adapt {module_path} with this adapter_config.json "
                                      "(layers_to_transform?), yet the adapter has tensors for it.")
    cast_adapter_dtype(root, adapter_name="default", autocast_adapter_dtype=True)  # as PeftModel does
    prefix = f"{PEFT_PREFIX}{module_path}."
    state = {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in adapter_tensors.items()
             if name.startswith(prefix)}
    result = peft.set_peft_model_state_dict(root, state, adapter_name="default")
    unexpected = getattr(result, "unexpected_keys", []) or []
    if unexpected:
        raise UnsupportedAdapterError(f"PEFT did not place {len(unexpected)} adapter tensors (e.g. {unexpected[0]}); "
                                      "expected LoRA A/B (and DoRA magnitudes) on linear layers only.")
    with torch.no_grad():
        layer.merge()
    return layer.get_base_layer().weight.data.to("cpu")


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    parent = root
    *parents, leaf = path.split(".")
    for part in parents:
        child = parent._modules.get(part)
        if child is None:
            child = nn.Module()
            parent.add_module(part, child)
        parent = child
    parent.add_module(leaf, module)


def _adapter_tensors(weights: pathlib.Path, lora_config: Any) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    peft_type = str(getattr(lora_config, "peft_type", "")).rsplit(".", 1)[-1].upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"the adapter is PEFT {peft_type}; poros merge merges LoRA adapters (with "
                                      "rsLoRA and DoRA). Merge it with PEFT's merge_and_unload instead.")
    if getattr(lora_config, "lora_bias", False):
        raise UnsupportedAdapterError("the adapter trains LoRA biases (lora_bias=True); poros merge merges weights "
                                      "only. Use PEFT's merge_and_unload for it.")
    tensors = load_file(weights)
    other = sorted(name for name in tensors if not name.endswith(ADAPTER_TENSORS))
    if other:
        raise UnsupportedAdapterError(
            f"the adapter holds {len(other)} tensors that are not LoRA A/B or DoRA magnitudes (e.g. {other[0]}: "
            "embedding LoRA or modules_to_save); poros merge merges LoRA on linear layers. Use PEFT's "
            "merge_and_unload for it.")
    foreign = sorted(name for name in tensors if not name.startswith(PEFT_PREFIX))
    if foreign:
        raise UnsupportedAdapterError(f"adapter tensor {foreign[0]} does not start with '{PEFT_PREFIX}'; expected "
                                      "the layout PEFT's save_pretrained writes for a causal LM.")
    return tensors


def _check_tied(modules: list[str], text_config: Any) -> None:
    if getattr(text_config, "tie_word_embeddings", False):
        head = [m for m in modules if m.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens")]
        if head:
            raise UnsupportedAdapterError(
                f"the adapter adapts {head[0]}, but this model ties its input embedding and its head: one merged "
                "matrix cannot be both. Train without the head in target_modules, or untie the embeddings.")


def _check_output(target: pathlib.Path, base: pathlib.Path, adapter: pathlib.Path, overwrite: bool) -> None:
    resolved = target.resolve()
    if resolved in (base.resolve(), adapter.resolve()):
        raise ConfigError(f"--output {target} is the {'base' if resolved == base.resolve() else 'adapter'} "
                          "directory; write the merged checkpoint to a new directory.")
    if target.exists() and not overwrite:
        raise ConfigError(f"--output {target} exists; pass --overwrite to replace it, or choose a new directory.")


def model_key(key: str, mapping: dict[str, str]) -> str:
    """A checkpoint tensor name as the causal LM names it (a multimodal checkpoint's text tower renamed by
    ``mapping``, the checkpoint's ``key_mapping``)."""
    for pattern, replacement in mapping.items():
        renamed, count = re.subn(pattern, replacement, key)
        if count:
            return renamed
    return key


def _adapted_module(adapter_key: str) -> str:
    """``base_model.model.<path>.lora_A.weight`` (or ``.lora_magnitude_vector``) -> ``<path>``."""
    path = adapter_key.removeprefix(PEFT_PREFIX)
    return path.removesuffix(".lora_magnitude_vector") if path.endswith("lora_magnitude_vector") \
        else path.rsplit(".", 2)[0]


def _module_of(key: str) -> str:
    return key.rsplit(".", 1)[0]


def floating_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``--dtype`` as a torch floating dtype.

    Raises:
        ConfigError: not the name of a floating torch dtype.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ConfigError(f"--dtype {dtype!r} is not a floating torch dtype; use bfloat16, float16 or float32.")
    return found


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _copy_side_files(base: pathlib.Path, adapter: pathlib.Path, staging: pathlib.Path, dtype: torch.dtype) -> list[str]:
    """Configs, tokenizer and processor files of the base; the adapter's tokenizer files over them."""
    from poros.loading.load import TOKENIZER_FILES

    skip = {WEIGHT_INDEX, "adapter_config.json", "poros_config.json"}
    written = []
    for pattern in COPIED_FILES:
        for source in base.glob(pattern):
            if source.is_file() and source.name not in skip and not source.name.endswith(".safetensors"):
                shutil.copyfile(source, staging / source.name)
                written.append(source.name)
    if any((adapter / name).is_file() for name in TOKENIZER_FILES):
        for source in adapter.iterdir():
            if source.is_file() and (source.name.startswith(("tokenizer", "special_tokens_map", "chat_template"))
                                     or source.name in ("vocab.json", "merges.txt")):
                shutil.copyfile(source, staging / source.name)
                written.append(source.name)
    config_file = staging / "config.json"
    config = json.loads(config_file.read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    for holder in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if key in holder:
                holder[key] = dtype_name
    _write_json(config_file, config)
    return sorted(set(written))


def _write_json(path: pathlib.Path, payload: Any) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def peak_rss() -> int | None:
    """The process's peak resident memory in bytes (None off POSIX)."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def progress_line(stream: TextIO, done: int, total: int, merged: int, modules: int, start: float) -> None:
    """One plain line per shard (a pipe or a log file reads it as well as a terminal). A minimal stand-in
    for a shared progress helper; kept here so that merge needs nothing else."""
    elapsed = time.perf_counter() - start
    eta = elapsed / done * (total - done)
    stream.write(f"poros merge: shard {done}/{total}, {merged}/{modules} adapted weights merged, "
                 f"{elapsed:.1f} s elapsed, ~{eta:.0f} s left\n")
    stream.flush()

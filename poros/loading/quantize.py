"""``poros quantize``: write a bf16 checkpoint as a pre-quantized bitsandbytes 4-bit one, block by block.

The output is what ``AutoModelForCausalLM.from_pretrained(src, quantization_config=BitsAndBytesConfig(
load_in_4bit=True, ...)).save_pretrained(out)`` writes -- the same keys (``X.weight`` packed, with
``.absmax``, ``.quant_map``, ``.nested_*`` and ``.quant_state.bitsandbytes__nf4``), dtypes, bytes and
``config.json`` ``quantization_config`` -- so stock transformers (and vLLM's bitsandbytes loader) read
it, and Poros loads its packed bytes as they are (:mod:`poros.loading.prequantized`). Without the
model ever being whole anywhere:

* the quantization is transformers' own (the load ``poros.loading.load.load_pretrained`` does, on the
  compute device: the bytes are the bytes Poros's own NF4 blocks hold);
* each decoder block is serialized the way ``save_pretrained`` serializes it (each module's
  ``_save_to_state_dict``: a ``Linear4bit`` adds its QuantState), handed to the shard writer and dropped
  (its tensors become meta tensors) as soon as the next block starts loading
  (:func:`poros.loading.load.blocks_to_host`'s ``on_block_done``); host RAM holds the non-block weights,
  one block and the shard being filled (``--max-shard-size``, default 5 GB);
* the shards, ``model.safetensors.index.json``, ``config.json`` (with ``quantization_config``),
  ``generation_config.json`` and the tokenizer files are written to a staging directory beside the
  output and renamed into place at the end.

A multimodal checkpoint gives its text tower as the family's causal LM (what Poros trains).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poros.errors import CheckpointLoadError, ConfigError

DEFAULT_SHARD_BYTES = 5 * 10**9
SAFE_INDEX = "model.safetensors.index.json"
#: files beside the weights that travel with the checkpoint (the tokenizer, its chat template)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
              "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")


@dataclass
class QuantizeResult:
    """What :func:`quantize_checkpoint` wrote."""

    output: str
    source: str
    quant_type: str
    double_quant: bool
    device: str
    shards: int
    tensors: int
    bytes_written: int
    seconds: float
    blocks: int
    #: most decoder blocks whose tensors were in memory at once (the one written, the one starting)
    most_blocks_held: int = 0
    files: list[str] = field(default_factory=list)
    #: the seed of ``--random-weights`` (None: the source's weights)
    random_seed: int | None = None

    def summary(self) -> str:
        weights = "" if self.random_seed is None else f"random weights (seed {self.random_seed}), "
        return (f"poros: wrote {self.output}: {weights}{self.quant_type}{' + double quant' if self.double_quant else ''} "
                f"(quantized on {self.device}), {self.blocks} blocks, {self.shards} shard"
                f"{'s' if self.shards != 1 else ''}, {self.tensors} tensors, {self.bytes_written / 2**30:.2f} GiB "
                f"in {self.seconds:.1f} s")


class ShardWriter:
    """Safetensors shards filled in the order tensors arrive, each written once it reaches ``max_bytes``."""

    def __init__(self, directory: pathlib.Path, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[pathlib.Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + nbytes > self.max_bytes:
                self.flush()
            plain = tensor.detach()
            if type(plain) is not torch.Tensor:  # a Params4bit's packed bytes as they are (its .to() would act)
                plain = plain.as_subclass(torch.Tensor)
            self.pending[name] = plain.to("cpu").contiguous()
            self.pending_bytes += nbytes
            self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / f"shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self, total_parameters: int) -> list[str]:
        """Name the shards as ``save_pretrained`` names them and write the index; returns the file names."""
        self.flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.directory / "model.safetensors")
            return ["model.safetensors"]
        count, weight_map, names = len(self.written), {}, []
        for number, (path, keys) in enumerate(self.written, start=1):
            name = f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(self.directory / name)
            weight_map.update(dict.fromkeys(keys, name))
            names.append(name)
        index = {"metadata": {"total_parameters": total_parameters, "total_size": self.total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [*names, SAFE_INDEX]


def parameter_count(modules: list[tuple[str, nn.Module]]) -> int:
    """``PreTrainedModel.num_parameters``'s count for ``modules`` (a 4-bit weight counts its unpacked values;
    a tied parameter once)."""
    import bitsandbytes as bnb

    total, seen = 0, set()
    for _, module in modules:
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel() * 2 * param.element_size() if isinstance(param, bnb.nn.Params4bit) else param.numel()
    return total


def serialize_modules(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` writes for ``modules``: each module's own tensors (a Linear4bit
    adds its QuantState), tied copies removed, transformers' weight conversions reverted (its default
    mapping, as for a model it did not load: the causal LM's names, whatever the source's)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state: dict[str, Any] = {}
    for name, module in modules:
        module._save_to_state_dict(state, f"{name}." if name else "", False)
    state = remove_tied_weights_from_state_dict(state, model)
    loaded_with = model.__dict__.pop("_weight_conversions", None)
    try:
        return revert_weight_conversion(model, state)
    finally:
        if loaded_with is not None:
            model._weight_conversions = loaded_with


def free_tensors(block: nn.Module) -> None:
    """Free a written block: every tensor becomes a meta tensor of its shape (marked as initialised, so
    transformers' post-load initialisation leaves it alone)."""
    for module in block.modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or tensor.device.type == "meta":
                continue
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            if name in module._parameters:
                empty = nn.Parameter(empty, requires_grad=False)
                module._parameters[name] = empty
            else:
                module._buffers[name] = empty
            empty._is_hf_initialized = True
        if hasattr(module, "quant_state"):
            module.quant_state = None


def check_output_dir(output: pathlib.Path, overwrite: bool) -> None:
    if output.exists() and not (output.is_dir() and not any(output.iterdir())) and not overwrite:
        raise ConfigError(f"{output} exists and is not empty; expected a new directory for the 4-bit checkpoint. "
                          "Pass another OUT, or --overwrite to replace it.")


def writer_settings(quantization: str, output: str | os.PathLike, overwrite: bool, compute_dtype: str | torch.dtype,
                    device: str | torch.device | None) -> tuple[pathlib.Path, torch.dtype, torch.device]:
    """What every 4-bit writer checks and resolves first: the quant type, a new (or empty) ``output``
    directory, the compute dtype and the quantize device. Raises ConfigError."""
    from poros.devices import resolve_device

    if quantization not in ("nf4", "fp4"):
        raise ConfigError(f"--quantization {quantization!r}: bitsandbytes 4-bit is 'nf4' or 'fp4'.")
    output = pathlib.Path(output).expanduser()
    check_output_dir(output, overwrite)
    dtype = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    return output, dtype, resolve_device(device or None, with_index=True)


def quantize_checkpoint(model: str | os.PathLike, output: str | os.PathLike, *, quantization: str = "nf4",
                        double_quant: bool = False, compute_dtype: str | torch.dtype = "bfloat16",
                        device: str | torch.device | None = None, revision: str | None = None,
                        max_shard_size: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                        allow_pickle: bool = False) -> QuantizeResult:
    """Write ``model`` (a bf16 checkpoint: directory, hub id, ``poros-tiny-qwen3``) to ``output`` as a
    bitsandbytes 4-bit checkpoint, streamed block by block (see the module docstring).

    Args:
        quantization: ``"nf4"`` or ``"fp4"``.
        double_quant: quantize the scales too (``bnb_4bit_use_double_quant``).
        compute_dtype: ``bnb_4bit_compute_dtype`` and the dtype of the unquantized tensors.
        device: where the blocks are quantized (default CUDA when available, else CPU): Poros quantizes on
            the compute device, so quantize on the kind of device you train on for byte-equal blocks.
        max_shard_size: bytes per safetensors shard (the host holds one shard being filled).
        overwrite: replace a non-empty ``output``.

    Raises:
        CheckpointLoadError: the source is not a checkpoint Poros loads (see
            :func:`poros.loading.load.inspect_checkpoint`) or is pre-quantized already.
        ConfigError: ``quantization`` is not nf4/fp4, or ``output`` exists (without ``overwrite``).
    """
    import transformers

    from poros.descriptor import resolve_path
    from poros.loading.load import (blocks_to_host, check_loading_info, check_shapes, inspect_checkpoint,
                                    resolve_checkpoint)

    start = time.perf_counter()
    output, compute_dtype, device = writer_settings(quantization, output, overwrite, compute_dtype, device)
    path = resolve_checkpoint(model, revision=revision)
    info = inspect_checkpoint(path, allow_pickle=allow_pickle)
    if info.prequantized is not None:
        raise CheckpointLoadError(
            f"{path} is {info.prequantized.describe()} already; `poros quantize` writes a 4-bit checkpoint from a "
            "bf16 one. Train on it as it is (poros train --model ...), or pass its bf16 source.")
    check_shapes(info)
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=double_quant)
    layers_path = info.descriptor.decoder_layers
    counted = {"parameters": 0, "blocks": 0, "most_held": 0}
    extra = {"key_mapping": info.key_mapping} if info.multimodal else {}
    with staging_for(output) as staging:
        writer = ShardWriter(staging, max_shard_size)

        def write_block(loaded: nn.Module, index: str) -> None:
            layers = resolve_path(loaded, layers_path)
            held = sum(any(t.device.type != "meta" for t in [*layer.parameters(), *layer.buffers()])
                       for layer in layers)
            counted["most_held"] = max(counted["most_held"], held)
            modules = block_modules(layers, layers_path, int(index))
            writer.add(serialize_modules(loaded, modules))
            counted["parameters"] += parameter_count(modules)
            counted["blocks"] += 1
            free_tensors(layers[int(index)])

        with blocks_to_host(layers_path + ".", move=False, on_block_done=write_block):
            loaded, loading_info = transformers.AutoModelForCausalLM.from_pretrained(
                path, config=info.text_config, quantization_config=quantization_config,
                device_map={"": str(device)}, dtype=compute_dtype, output_loading_info=True,
                use_safetensors=info.weight_format == "safetensors", **extra)
        check_loading_info(info, loaded, loading_info)
        layers = resolve_path(loaded, layers_path)
        for index in range(counted["blocks"], len(layers)):  # the last block (or every one, if none was seen)
            write_block(loaded, str(index))
        outside = modules_outside(loaded, layers)
        writer.add(serialize_modules(loaded, outside))
        counted["parameters"] += parameter_count(outside)
        files = finish_checkpoint(loaded, writer, counted["parameters"], staging, output, side_files_from=path)
    return QuantizeResult(
        output=str(output), source=str(path), quant_type=quantization, double_quant=double_quant, device=str(device),
        shards=sum(name.endswith(".safetensors") for name in files), tensors=sum(len(k) for _, k in writer.written),
        bytes_written=writer.total_bytes, seconds=time.perf_counter() - start, blocks=counted["blocks"],
        most_blocks_held=counted["most_held"], files=sorted(files))


def block_modules(layers: nn.ModuleList, layers_path: str, index: int) -> list[tuple[str, nn.Module]]:
    """Block ``index``'s modules with their names in the model (the block itself first)."""
    return [(f"{layers_path}.{index}.{name}".rstrip("."), module) for name, module in layers[index].named_modules()]


def modules_outside(model: nn.Module, layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` that is not in a decoder block (the root, the embeddings, the norm, the head)."""
    inside = {id(module) for layer in layers for module in layer.modules()} | {id(layers)}
    return [(name, module) for name, module in model.named_modules() if id(module) not in inside]


@contextlib.contextmanager
def staging_for(output: pathlib.Path):
    """A fresh staging directory beside ``output`` (``.OUT.partial-PID``), removed whatever happens."""
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def finish_checkpoint(model: nn.Module, writer: ShardWriter, parameters: int, staging: pathlib.Path,
                      output: pathlib.Path, *, side_files_from: pathlib.Path | None) -> list[str]:
    """Name the shards and write the index, ``config.json`` and the side files into ``staging``, then move it
    to ``output`` (replacing what is there); returns the file names."""
    files = writer.finish(parameters)
    files += write_config(model, staging)
    if side_files_from is not None:
        files += copy_side_files(side_files_from, staging)
    if output.exists():
        shutil.rmtree(output)
    os.replace(staging, output)
    return files


def write_config(model: nn.Module, directory: pathlib.Path) -> list[str]:
    """``config.json`` (with ``quantization_config``) and ``generation_config.json`` as ``save_pretrained``
    writes them."""
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    written = ["config.json"]
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and model.can_generate():
        generation_config.save_pretrained(directory)
        written.append("generation_config.json")
    return written


def copy_side_files(source: pathlib.Path, directory: pathlib.Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
            copied.append(name)
    return copied


__all__ = ["DEFAULT_SHARD_BYTES", "QuantizeResult", "ShardWriter", "block_modules", "check_output_dir", "writer_settings",
           "copy_side_files", "finish_checkpoint", "free_tensors", "modules_outside", "parameter_count",
           "quantize_checkpoint", "serialize_modules", "staging_for", "write_config"]

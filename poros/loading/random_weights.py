"""``poros quantize --random-weights``: a bnb-4bit checkpoint of random weights for a config, block by block.

A benchmarking aid. A full-depth start needs the checkpoint on disk, and a bf16 Qwen2.5-72B (145 GB)
does not fit a 64 GB drive where its 4-bit form (about 41 GB) does. This writes that 4-bit form
straight from a ``config.json`` (or a model the registry knows), with no bf16 source anywhere:

* the model is a meta skeleton with transformers' own 4-bit layout (``BitsAndBytesConfig``'s quantizer
  replaces the linears, ``llm_int8_skip_modules`` and the tied head as for a load);
* each decoder block in turn gets values on the quantize device -- zeros, then the model class's own
  init (``_initialize_weights``, children before parents as ``initialize_weights`` goes), seeded from
  ``--seed`` and the block's index -- its 4-bit weights are quantized as transformers quantizes a
  loaded one (``Params4bit(value, **meta.__dict__).to(device)``), it is serialized the way
  ``save_pretrained`` serializes it, handed to the shard writer and freed before the next block;
* the modules outside the blocks (embeddings, final norm, head) come last, the same way.

So the host holds one block, the non-block weights and the shard being filled (``--max-shard-size``),
never the model; the output is what :func:`poros.loading.quantize.quantize_checkpoint` writes for the
bf16 model those seeds make (:func:`random_model` builds that model, for the tests), and it loads in
stock transformers and in Poros like any ``*-bnb-4bit`` checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import time
import zlib
from typing import Any

import torch
from torch import nn

from poros.errors import CheckpointLoadError
from poros.loading.quantize import (DEFAULT_SHARD_BYTES, QuantizeResult, ShardWriter, block_modules,
                                    finish_checkpoint, free_tensors, modules_outside, parameter_count,
                                    serialize_modules, staging_for, writer_settings)

#: the part of the model outside the decoder blocks, for :func:`part_seed`
REST = "rest"


def model_config_of(config_or_model: str | os.PathLike) -> tuple[Any, pathlib.Path | None]:
    """``(text config, directory)`` of a ``config.json`` file, a directory holding one (weights or not), the
    bundled ``poros-tiny-qwen3``, or a model name the registry knows (its record's shape, offline;
    directory None). A multimodal config gives its text tower's.

    Raises:
        CheckpointLoadError: none of those, or a ``config.json`` transformers cannot read.
    """
    import transformers

    from poros import records
    from poros.loading.load import BUNDLED_MODEL, read_config

    name = os.fspath(config_or_model)
    path = pathlib.Path(name).expanduser()
    if name == BUNDLED_MODEL:
        from poros.assets import asset_path

        path = asset_path(name)
    if path.is_file():
        try:
            fields = json.loads(path.read_text())
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointLoadError(f"{path} is not a transformers config.json ({type(exc).__name__}: {exc}). "
                                      "Pass a config.json, the directory holding it, or a known model name.") from exc
        return config.get_text_config(), path.parent
    if path.is_dir():
        return read_config(path)[1], path
    known = records.find_checkpoint(name)
    if known is None:
        raise CheckpointLoadError(
            f"{name!r} is neither a config.json, a directory holding one, nor a model the registry knows "
            "(`poros list-architectures --models`); --random-weights reads only a config. Fetch it first "
            f"(`hf download {name} config.json --local-dir DIR`) and pass DIR.")
    fields = records.config_json(known[1])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return config.get_text_config(), None


def part_seed(seed: int, part: int | str) -> int:
    """The seed of one part of the model: decoder block ``part`` or :data:`REST`."""
    return zlib.crc32(f"{seed}/{part}".encode())


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


def fill_random(model: nn.Module, modules: list[tuple[str, nn.Module]], device: torch.device, seed: int,
                dtype: torch.dtype) -> None:
    """Give every meta tensor that ``modules`` hold themselves a value on ``device`` (see the module docstring):
    zeros, then ``model``'s own init seeded with ``seed``; a meta ``Params4bit`` is drawn in ``dtype`` and
    quantized. Tied tensors stay tied (one value per meta tensor); the global RNG is left as it was."""
    import bitsandbytes as bnb

    values: dict[int, torch.Tensor] = {}
    four_bit = []  # (module, name, the meta Params4bit whose fields the quantized weight takes)
    for _, module in modules:
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or tensor.device.type != "meta":
                continue
            if id(tensor) not in values:
                packed = isinstance(tensor, bnb.nn.Params4bit)
                value = torch.zeros(tensor.shape, dtype=dtype if packed else tensor.dtype, device=device)
                if name in module._parameters:
                    value = nn.Parameter(value, requires_grad=tensor.requires_grad and not packed)
                values[id(tensor)] = value
                if packed:
                    four_bit.append((module, name, tensor))
            (module._parameters if name in module._parameters else module._buffers)[name] = values[id(tensor)]
    part = {id(module) for _, module in modules}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for module in _post_order(model):
            if id(module) in part:
                model._initialize_weights(module)
    for module, name, meta in four_bit:  # transformers' Bnb4bitQuantize, on the quantize device
        value = module._parameters[name].data
        module._parameters[name] = bnb.nn.Params4bit(value, requires_grad=False, **meta.__dict__).to(value.device)


def skeleton(config: Any, dtype: torch.dtype, quantization_config: Any = None) -> nn.Module:
    """The causal LM of ``config`` on the meta device, its linears replaced as a 4-bit load replaces them
    (``quantization_config``; None: unquantized)."""
    import transformers

    from transformers.modeling_utils import local_torch_dtype

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if quantization_config is not None:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
        with torch.device("meta"), local_torch_dtype(dtype, type(model).__name__):  # as from_pretrained does it
            quantizer.preprocess_model(model, dtype=dtype, device_map=None)
        model.config.quantization_config = quantization_config
    return model


def random_model(config: Any, *, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The unquantized model whose 4-bit form :func:`random_checkpoint` writes for ``seed`` (whole, in
    memory: for tests at small shapes)."""
    from poros import registry
    from poros.descriptor import resolve_path

    device = torch.device(device)
    model = skeleton(config, dtype)
    layers_path = registry.for_config(config).decoder_layers
    layers = resolve_path(model, layers_path)
    for index in range(len(layers)):
        fill_random(model, block_modules(layers, layers_path, index), device, part_seed(seed, index), dtype)
    fill_random(model, modules_outside(model, layers), device, part_seed(seed, REST), dtype)
    return model


def random_checkpoint(config_or_model: str | os.PathLike, output: str | os.PathLike, *, seed: int = 0,
                      quantization: str = "nf4", double_quant: bool = False,
                      compute_dtype: str | torch.dtype = "bfloat16", device: str | torch.device | None = None,
                      max_shard_size: int = DEFAULT_SHARD_BYTES, overwrite: bool = False) -> QuantizeResult:
    """Write a bitsandbytes 4-bit checkpoint of random weights for ``config_or_model``'s config to ``output``,
    block by block (see the module docstring). Arguments as :func:`poros.loading.quantize.quantize_checkpoint`;
    ``seed`` picks the weights.

    Raises:
        CheckpointLoadError: no config found (:func:`model_config_of`).
        UnknownArchitectureError: the config's family is not registered.
        ConfigError: ``quantization`` is not nf4/fp4, or ``output`` exists (without ``overwrite``).
    """
    import transformers

    from poros import registry
    from poros.descriptor import resolve_path

    start = time.perf_counter()
    output, dtype, device = writer_settings(quantization, output, overwrite, compute_dtype, device)
    config, directory = model_config_of(config_or_model)
    layers_path = registry.for_config(config).decoder_layers
    quantization_config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=dtype,
        bnb_4bit_use_double_quant=double_quant)
    model = skeleton(config, dtype, quantization_config)
    layers = resolve_path(model, layers_path)
    parameters = 0
    with staging_for(output) as staging:
        writer = ShardWriter(staging, max_shard_size)
        for index in range(len(layers)):
            modules = block_modules(layers, layers_path, index)
            fill_random(model, modules, device, part_seed(seed, index), dtype)
            writer.add(serialize_modules(model, modules))
            parameters += parameter_count(modules)
            free_tensors(layers[index])
        outside = modules_outside(model, layers)
        fill_random(model, outside, device, part_seed(seed, REST), dtype)
        writer.add(serialize_modules(model, outside))
        parameters += parameter_count(outside)
        files = finish_checkpoint(model, writer, parameters, staging, output, side_files_from=directory)
    return QuantizeResult(
        output=str(output), source=os.fspath(config_or_model),
        quant_type=quantization, double_quant=double_quant, device=str(device),
        shards=sum(name.endswith(".safetensors") for name in files), tensors=sum(len(k) for _, k in writer.written),
        bytes_written=writer.total_bytes, seconds=time.perf_counter() - start, blocks=len(layers),
        most_blocks_held=1, files=sorted(files), random_seed=seed)


__all__ = ["REST", "fill_random", "model_config_of", "part_seed", "random_checkpoint", "random_model", "skeleton"]

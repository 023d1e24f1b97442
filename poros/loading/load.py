"""Load a checkpoint for streamed training: NF4 blocks on the host, the rest on the compute device.

The weights go through transformers' own ``from_pretrained`` with a ``BitsAndBytesConfig`` -- the
same renaming, dtype plan and ``bnb.nn.Params4bit(...).to(device)`` quantization call, tensor by
tensor from the memory-mapped safetensors shards -- so the loaded base is bitwise the base the
resident reference loads. Two things differ, both around that machinery, never inside the math:

* **Blocks go to the host as they are loaded.** Each decoder-block tensor is quantized on the
  compute device (so the NF4 bytes are the device's, as in the reference) and moved to host memory
  right after transformers sets it on its module. The device never holds more than the tensor in
  flight plus the non-block modules (embeddings, final norm, head); the host holds the NF4 blocks
  plus the tensor in flight -- never the bf16 model. transformers' allocator warm-up (a device
  allocation the size of the whole model) is skipped. :func:`poros.prepare` then packs each block
  into its pinned buffer, one block at a time.
* **Multimodal checkpoints train their text tower.** Gemma 3 (4B+), Gemma 4 and Qwen 3.5/3.6
  checkpoints hold a vision tower and the text weights under ``model.language_model.*`` (older
  exports: ``language_model.model.*``). ``Gemma3ForCausalLM.from_pretrained`` on such a checkpoint
  silently random-initialises every text weight (``reference/transformers-families.md``). Here the
  text config is loaded into the family's causal LM with the text keys renamed, the vision keys are
  left unread, and a load that leaves any weight uninitialised is an error, not a warning.

* **Pre-quantized checkpoints load as they are.** A ``*-bnb-4bit`` checkpoint (``quantization_config``
  in its ``config.json``, :mod:`poros.loading.prequantized`) holds the packed bytes the store streams:
  transformers unpacks them (no quantize pass, no bf16), each block tensor is read from the shard
  straight into host memory, and nothing is cached (the checkpoint is the packed blocks).

Before any weight is read, the checkpoint is checked: config present and of a registered family,
every shard of the index present, safetensors (pickle ``.bin`` only with ``allow_pickle=True``), and
for a pre-quantized one every tensor its 4-bit weights need.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor
from poros.devices import resolve_device
from poros.errors import CheckpointLoadError
from poros.loading.checkpoint_files import (  # re-exported: this module's names before the split
    BUNDLED_MODEL,
    HUB_PATTERNS,
    MULTIMODAL_KEY_MAPPING,
    PICKLE_INDEX,
    PICKLE_SINGLE,
    SAFE_INDEX,
    SAFE_SINGLE,
    TOKENIZER_FILES,
    CheckpointInfo,
    check_loading_info,
    check_shapes,
    inspect_checkpoint,
    mismatch_message,
    read_config,
    resolve_checkpoint,
)
from poros.loading.host_sweep import blocks_to_host, sweep_blocks_to_host

logger = logging.getLogger("poros")


@dataclass
class LoadedModel:
    """What :func:`load_pretrained` returns.

    Attributes:
        model: the family's HF causal LM (e.g. ``Qwen3ForCausalLM``; the text tower of a multimodal
            checkpoint), NF4 base, no adapters. Decoder blocks on the host when ``device`` is CUDA.
        tokenizer: the checkpoint's tokenizer (``AutoTokenizer``), or None when it has none or it
            was not asked for.
        path: the local checkpoint directory.
        descriptor: the family descriptor that streams it.
        info: the :class:`CheckpointInfo` of the checks before loading.
        device: the compute device.
        unused_keys: checkpoint tensors not read (a multimodal checkpoint's vision tower).
    """

    model: nn.Module
    tokenizer: Any
    path: pathlib.Path
    descriptor: ArchitectureDescriptor
    info: CheckpointInfo
    device: torch.device
    unused_keys: list[str] = field(default_factory=list)


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    quantization: str = "nf4",
    compute_dtype: torch.dtype | str = torch.bfloat16,
    double_quant: bool = False,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    load_tokenizer: bool = True,
    allow_pickle: bool = False,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    _blocks_to_host_on_cpu: bool = False,
) -> LoadedModel:
    """Load a checkpoint as the family's causal LM with a 4-bit base, decoder blocks on the host.

    Args:
        name_or_path: a checkpoint directory, a hub id (through the HF cache), or
            ``"poros-tiny-qwen3"`` (the model shipped in the package).
        quantization: ``"nf4"`` or ``"fp4"`` (``bnb_4bit_quant_type``).
        compute_dtype: ``bnb_4bit_compute_dtype`` and the dtype of the unquantized tensors.
        double_quant: ``bnb_4bit_use_double_quant``.
        device: the compute device; default CUDA when available, else CPU. Blocks are quantized
            there and kept on the host when it is CUDA.
        attn_implementation: ``"sdpa"``/``"eager"``; None keeps transformers' default.
        load_tokenizer: also load the checkpoint's tokenizer (None, with a warning, if it has none).
        allow_pickle: accept ``pytorch_model.bin`` checkpoints (unsafe: pickle runs code).
        revision: hub revision for a hub id.
        cache_dir: the NF4 block cache root (``docs/cache-and-host-memory.md``): the first load writes
            the packed blocks there, later loads map them instead of reading and quantizing the
            checkpoint's block weights. None: no cache (every load quantizes). The blocks of the
            returned model are then views of the mapped entry (``model.poros_block_file``). A
            pre-quantized checkpoint already holds the packed blocks: it is read as it is, never cached.

    A pre-quantized bitsandbytes 4-bit checkpoint (a ``*-bnb-4bit`` repo: ``quantization_config`` in its
    ``config.json``) loads its packed bytes as they are -- no quantize pass, no bf16 copy -- with the
    checkpoint's own quant type, double quantization and skipped modules (``quantization`` and
    ``double_quant`` are then not used; a different ``quantization`` is logged). Its decoder-block tensors
    are read straight into host memory: they never visit the device.

    Raises:
        CheckpointLoadError: see :func:`inspect_checkpoint`; a weight the checkpoint does not provide
            (it would be random-initialised); a tensor whose shape does not match the config.
        UnknownArchitectureError: the checkpoint's family is not registered.
    """
    import transformers

    if quantization not in ("nf4", "fp4"):
        raise CheckpointLoadError(f"quantization={quantization!r}: Poros streams 4-bit bases, 'nf4' or 'fp4'.")
    if isinstance(compute_dtype, str):
        compute_dtype = getattr(torch, compute_dtype)
    device = resolve_device(device or None, with_index=True)
    path = resolve_checkpoint(name_or_path, revision=revision)
    info = inspect_checkpoint(path, allow_pickle=allow_pickle)
    prequantized = info.prequantized
    if prequantized is None:
        quantization_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=double_quant,
        )
    else:  # the checkpoint's own config decides; passing one would only make transformers warn
        quantization_config = None
        _note_checkpoint_quantization(info, quantization)
    extra: dict[str, Any] = {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if info.multimodal:
        extra["key_mapping"] = info.key_mapping
    check_shapes(info)
    blocks_prefix = info.descriptor.decoder_layers + "."
    move = device.type != "cpu" or _blocks_to_host_on_cpu

    def load(skip_blocks=contextlib.nullcontext()):
        # On CPU the blocks are already on the host; tests pass _blocks_to_host_on_cpu=True to run the
        # CUDA path's moves (each tensor replaced by a host copy) where there is no GPU.
        with blocks_to_host(blocks_prefix, move=move, read_to_host=prequantized is not None), skip_blocks:
            try:
                model, loading_info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, config=info.text_config, quantization_config=quantization_config,
                    device_map={"": str(device)}, dtype=compute_dtype,
                    use_safetensors=info.weight_format == "safetensors", output_loading_info=True, **extra,
                )
            except RuntimeError as exc:
                if "mismatch" in str(exc):
                    raise CheckpointLoadError(mismatch_message(info, str(exc))) from exc
                raise
        check_loading_info(info, model, loading_info)
        if device.type != "cpu":
            sweep_blocks_to_host(model, info.descriptor)
        return model, loading_info

    if cache_dir is None or prequantized is not None:
        model, loading_info = load()
    else:
        from poros.loading.cache_blocks import load_through_cache

        model, loading_info = load_through_cache(
            load, cache_dir, model=os.fspath(name_or_path), info=info, revision=revision, device=device,
            quantization_config=quantization_config)
    tokenizer = None
    if load_tokenizer:
        if info.has_tokenizer:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        else:
            logger.warning("poros: %s has no tokenizer files; pass token ids or a tokenizer yourself", path)
    unused = sorted(loading_info.get("unexpected_keys", ()))
    if unused:
        logger.info("poros: %d checkpoint tensors not used (e.g. %s)", len(unused), unused[0])
    return LoadedModel(model, tokenizer, path, info.descriptor, info, device, unused)


@dataclass
class AdapterInfo:
    """What :func:`read_adapter` found in an adapter directory (PEFT layout, as ``PorosTrainer.save`` writes).

    Attributes:
        path: the adapter directory.
        peft_config: ``adapter_config.json`` as a dict.
        base_model: the base checkpoint: the ``base_model`` argument, else ``poros_config.json``'s
            ``base_model_name_or_path``, else ``adapter_config.json``'s.
        poros_config: the training run's :class:`~poros.config.PorosConfig` fields from
            ``poros_config.json`` (empty for an adapter Poros did not train).
        weights: the adapter weights file (``adapter_model.safetensors``).
    """

    path: pathlib.Path
    peft_config: dict[str, Any]
    base_model: str
    poros_config: dict[str, Any]
    weights: pathlib.Path


def read_adapter(adapter: str | os.PathLike, base_model: str | os.PathLike | None = None) -> AdapterInfo:
    """Check an adapter directory and find its base model, before anything is loaded.

    Raises:
        CheckpointLoadError: no directory, no ``adapter_config.json`` or no ``adapter_model.safetensors``,
            or no base model named anywhere (pass ``base_model``).
    """
    path = pathlib.Path(adapter).expanduser()
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise CheckpointLoadError(
            f"{path} is not an adapter directory: expected adapter_config.json and adapter_model.safetensors "
            f"(found {sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else 'no directory'}). Pass the "
            "directory that PorosTrainer.save / PEFT's save_pretrained wrote."
        )
    peft_config = json.loads(config_file.read_text())
    record_file = path / "poros_config.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    base = base_model or record.get("base_model_name_or_path") or peft_config.get("base_model_name_or_path")
    if not base:
        raise CheckpointLoadError(
            f"{path} names no base model (adapter_config.json base_model_name_or_path is empty and there is no "
            "poros_config.json). Pass the base checkpoint with --model / base_model=."
        )
    return AdapterInfo(path, peft_config, os.fspath(base), dict(record.get("config") or {}), weights)


def adapters_to_device(model: nn.Module, device: torch.device | str) -> int:
    """Move every trainable tensor (the adapters PEFT just added) to the compute device; returns how many.

    PEFT creates each adapter on its base layer's device, and a loaded block's base layer is on the
    host. Parameters keep their identity (``.data`` is swapped), so call this before building the
    optimizer. PEFT initialises adapters on the CPU in every case, so values are unchanged.
    """
    device = torch.device(device)
    moved = 0
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.device != device:
            parameter.data = parameter.data.to(device)
            moved += 1
    return moved


def _note_checkpoint_quantization(info: CheckpointInfo, quantization: str) -> None:
    prequantized = info.prequantized
    if quantization != prequantized.quant_type:
        logger.warning("poros: %s is %s; quantization=%r is not used (its packed bytes are loaded as they are)",
                       info.path, prequantized.describe(), quantization)
    else:
        logger.info("poros: %s is %s: its packed bytes are loaded as they are", info.path, prequantized.describe())


__all__ = ["AdapterInfo", "adapters_to_device", "blocks_to_host", "read_adapter", "read_config", "CheckpointInfo",
           "LoadedModel", "MULTIMODAL_KEY_MAPPING", "check_loading_info", "check_shapes", "inspect_checkpoint",
           "load_pretrained", "resolve_checkpoint", "sweep_blocks_to_host", "BUNDLED_MODEL", "HUB_PATTERNS",
           "PICKLE_INDEX", "PICKLE_SINGLE", "SAFE_INDEX", "SAFE_SINGLE", "TOKENIZER_FILES"]

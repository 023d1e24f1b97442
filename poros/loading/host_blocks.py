"""``poros.from_pretrained``: transformers' ``from_pretrained`` for a card smaller than the model.

The drop-in (``poros.prepare``) streams a model that is already loaded. Loaded the plain way,
``AutoModelForCausalLM.from_pretrained(..., device_map={"": 0})``, the whole model is on the card
first -- which is exactly what a card smaller than the model cannot hold. ``poros.from_pretrained``
takes the same arguments and returns the same HF causal LM, with every decoder block's tensors put
on the host as they load (:func:`poros.loading.load.blocks_to_host`): a block quantized on load is
quantized on the device one tensor at a time (the device's NF4 bytes, as the plain load makes them)
and moved off at once; a pre-quantized checkpoint's (``*-bnb-4bit``) and an unquantized base's block
tensors are read straight into host memory and never visit the device. Nothing larger than one
tensor of a block is on the device while it loads; the embeddings, the final norm and the head are
where ``device_map`` puts them. Then the script goes on unchanged::

    model = poros.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...),
                                  dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(...))    # PEFT puts block adapters beside their host base layer
    poros.prepare(model)                              # moves the adapters to the compute device, streams the blocks
    Trainer(model=model, ...).train()                 # or TRL

The returned model carries its compute device as ``model.poros_compute_device`` (HF's ``model.device``
reads the first parameter, which may now be on the host); :func:`poros.prepare` reads it.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from poros.errors import ConfigError

#: the attribute that tells poros.prepare where a model whose blocks are on the host computes
COMPUTE_DEVICE_ATTRIBUTE = "poros_compute_device"


def _compute_device(device_map: Any):
    """The one device a ``device_map`` argument names (None / ``"auto"``: CUDA when available, else CPU)."""
    import torch

    from poros.devices import resolve_device

    if device_map is None or device_map in ("auto", "balanced", "sequential"):
        return resolve_device("auto", with_index=True)
    if isinstance(device_map, dict):
        places = {str(value) for value in device_map.values()}
        if len(places) != 1 or places & {"disk"}:
            raise ConfigError(
                f"device_map={device_map!r} splits the model over {sorted(places)}; poros.from_pretrained keeps the "
                "decoder blocks on the host itself and computes on one device. Pass device_map={'': 0} (or leave it "
                "out).")
        (device_map,) = places
    if isinstance(device_map, int) or (isinstance(device_map, str) and device_map.isdigit()):
        return torch.device("cuda", int(device_map))
    return resolve_device(str(device_map), with_index=True)


def from_pretrained(name_or_path: str | os.PathLike, *args: Any, **from_pretrained_kwargs: Any):
    """``transformers.AutoModelForCausalLM.from_pretrained(name_or_path, ...)`` with every decoder block on
    the host as it loads; returns the HF causal LM (the same class, weights and quantization).

    Args:
        name_or_path: a hub id or a checkpoint directory, as for transformers (a ``*-bnb-4bit`` repo loads
            its packed bytes as they are).
        *args, **from_pretrained_kwargs: transformers' ``from_pretrained`` arguments (``quantization_config``,
            ``dtype``, ``attn_implementation``, ``revision``, ``token``...). ``device_map`` names the compute
            device (``{"": 0}``, ``"cuda:1"``, ``"cpu"``; unset or ``"auto"``: the current CUDA device, else the
            CPU); every module outside the blocks goes there, the blocks to the host.

    Returns:
        The causal LM, with ``model.poros_compute_device`` set. Give it to ``get_peft_model`` and
        :func:`poros.prepare` as you would the plain one; with the blocks on the host it cannot compute
        before ``prepare`` streams them (a forward would mix devices).

    Raises:
        ConfigError: ``device_map`` splits the model over several devices or the disk.
        UnknownArchitectureError: the checkpoint's family is not registered.
        UnsupportedModelError: a multimodal checkpoint (load its text tower with
            ``poros.loading.load.load_pretrained``, or train it with ``PorosTrainer``).
        CheckpointLoadError: a pre-quantized checkpoint Poros does not stream (8-bit, another method or
            quant type) or one missing a tensor its 4-bit weights need.
    """
    import transformers

    from poros import registry
    from poros.errors import UnsupportedModelError
    from poros.loading.load import blocks_to_host, sweep_blocks_to_host
    from poros.loading.prequantized import read_prequantized

    move_on_cpu = bool(from_pretrained_kwargs.pop("_blocks_to_host_on_cpu", False))  # tests: the CUDA path's moves
    device = _compute_device(from_pretrained_kwargs.get("device_map"))
    config_kwargs = {k: from_pretrained_kwargs[k] for k in ("revision", "token", "trust_remote_code", "cache_dir",
                                                            "subfolder", "local_files_only")
                     if k in from_pretrained_kwargs}
    config = from_pretrained_kwargs.get("config")
    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    text_config = config.get_text_config()
    descriptor = registry.for_config(text_config)
    if text_config is not config:
        raise UnsupportedModelError(
            f"{name_or_path} is a multimodal checkpoint ({type(config).__name__}); poros.from_pretrained loads text "
            "causal LMs. Load its text tower with poros.loading.load.load_pretrained(path) (blocks on the host too), "
            "or train it with PorosTrainer / `poros train`.")
    prequantized = read_prequantized(config, name_or_path)
    if prequantized is not None and os.path.isdir(name_or_path):  # a hub id: transformers fetches and checks it
        from poros.loading.load import inspect_checkpoint
        from poros.loading.prequantized import check_tensors

        info = inspect_checkpoint(pathlib.Path(name_or_path))
        if info.weight_format == "safetensors":
            check_tensors(info.weight_files, prequantized, info.path)
    quantized_on_load = prequantized is None and from_pretrained_kwargs.get("quantization_config") is not None
    from_pretrained_kwargs["device_map"] = {"": str(device)}
    move = device.type != "cpu" or move_on_cpu
    with blocks_to_host(descriptor.decoder_layers + ".", move=move, read_to_host=not quantized_on_load):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(name_or_path, *args, **from_pretrained_kwargs)
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
    if device.type != "cpu":
        sweep_blocks_to_host(model, descriptor)
    setattr(model, COMPUTE_DEVICE_ATTRIBUTE, device)
    return loaded


def _quant_state_tensors(state):
    """``(owner, attribute)`` of every tensor of a bitsandbytes QuantState, nested state included."""
    import torch

    while state is not None:
        for name in ("absmax", "code", "offset"):
            if isinstance(getattr(state, name, None), torch.Tensor):
                yield state, name
        state = getattr(state, "state2", None)


def release_stranded_segments(model, layers, device) -> dict[str, int]:
    """Give back the device segments that still hold a few live tensors after the blocks moved off.

    A model loaded onto the device the plain way sits in one segment the size of the model
    (transformers' ``caching_allocator_warmup`` reserves it up front). Once the blocks are in host
    memory, the embeddings, the head and the adapters still live in that segment, so
    ``torch.cuda.empty_cache`` cannot return it: the card stays reserved for the whole model. This moves
    every device tensor the modules hold outside the streamed blocks' frozen tensors (parameters,
    buffers, a 4-bit weight's quantization state; the adapters) to the host, empties the cache -- the
    big segment is free now and goes back to the driver -- and moves them back into segments of their
    own size. Values and ``Parameter`` objects are unchanged (``.data`` is swapped; a buffer is replaced
    by its copy); the block store's slots and resident buffers were allocated on their own and stay.

    Returns:
        ``{"reserved_before": ..., "reserved_after": ..., "moved_bytes": ...}`` (bytes).
    """
    import torch

    in_blocks = {id(p) for layer in layers for p in layer.parameters() if not p.requires_grad}
    in_blocks |= {id(b) for layer in layers for b in layer.buffers()}
    seen: set[int] = set()
    moves = []  # (kind, owner, attribute, host copy)
    for module in model.modules():
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or id(tensor) in seen or id(tensor) in in_blocks or tensor.device != device:
                continue
            seen.add(id(tensor))
            if name in module._parameters:
                moves.append(("param", tensor, None, tensor.data.to("cpu", copy=True)))
                for state, attribute in _quant_state_tensors(getattr(tensor, "quant_state", None)):
                    moves.append(("attribute", state, attribute, getattr(state, attribute).to("cpu", copy=True)))
            else:
                moves.append(("buffer", module, name, tensor.to("cpu", copy=True)))
    reserved_before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    for kind, owner, attribute, host in moves:  # let go of every device copy ...
        if kind == "param":
            owner.data = host
        elif kind == "buffer":
            owner._buffers[attribute] = host
        else:
            setattr(owner, attribute, host)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # ... so the segments they shared with the blocks are free now
    for kind, owner, attribute, host in moves:  # and back, into segments of their own size
        if kind == "param":
            owner.data = host.to(device, copy=True)
        elif kind == "buffer":
            moved = host.to(device, copy=True)
            if hasattr(host, "_is_hf_initialized"):
                moved._is_hf_initialized = host._is_hf_initialized
            owner._buffers[attribute] = moved
        else:
            setattr(owner, attribute, host.to(device, copy=True))
    return {"reserved_before": reserved_before,
            "reserved_after": torch.cuda.memory_reserved(device) if device.type == "cuda" else 0,
            "moved_bytes": sum(host.numel() * host.element_size() for *_, host in moves)}


__all__ = ["COMPUTE_DEVICE_ATTRIBUTE", "from_pretrained", "release_stranded_segments"]

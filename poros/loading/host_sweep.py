"""Decoder blocks to the host as they load (``poros.loading.load``): :func:`blocks_to_host` wraps
transformers' loading so each block tensor moves to host memory right after transformers sets it on its
module (quantized on the compute device first, so the NF4 bytes are the device's), giving the host
heap's freed pages back as it goes; :func:`sweep_blocks_to_host` moves whatever a load left on the
device. The device never holds more than the tensor in flight plus the modules outside the blocks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor
from poros.errors import CheckpointLoadError


@contextlib.contextmanager
def blocks_to_host(prefix: str, *, move: bool, read_to_host: bool = False, on_block_done=None):
    """While transformers loads: move each decoder-block tensor to the host right after it is set.

    transformers quantizes a tensor on its target device, then calls ``set_param_for_module``; the
    wrapper lets that happen unchanged and then (``move``) moves the result (``Params4bit`` with its
    QuantState, or a plain tensor) to the host. Each time a new block starts, freed host memory is
    handed back to the OS (glibc keeps freed bf16/fp32 temporaries in its heap otherwise, and the
    load's RSS would grow with the model instead of staying at NF4 + one tensor). The allocator
    warm-up, which reserves device memory for the whole model up front, is skipped.

    ``read_to_host``: nothing in a block is quantized on load (a pre-quantized checkpoint, or an
    unquantized base), so each block tensor is read from the shard straight into host memory instead of
    to the device (transformers' ``get_device`` answers ``"cpu"`` for it): it never visits the device.

    ``on_block_done(model, block)``: called with the block's index (a string) once every tensor of that
    block is set, i.e. when the next block's first tensor arrives (transformers loads the checkpoint in
    key order, block after block); the last block is the caller's to finish after the load.
    ``poros quantize`` writes and drops each block there (the warm-up is skipped then too).
    """
    import transformers
    from transformers import core_model_loading, modeling_utils

    if not hasattr(core_model_loading, "set_param_for_module"):
        if not move and on_block_done is None:  # on the CPU the blocks are on the host already: load as transformers does
            yield
            return
        raise CheckpointLoadError(
            f"transformers {transformers.__version__} has no core_model_loading.set_param_for_module, where Poros "
            "moves each block to the host as it is loaded (transformers 5.24 has it). Install the tested "
            "version (pip install 'transformers==5.24.*'), or load on the CPU (device='cpu')."
        )
    set_param = core_model_loading.set_param_for_module
    warmup = modeling_utils.caching_allocator_warmup
    current_block = [None]

    def set_param_then_host(model, target_name, param_value, *args, **kwargs):
        set_param(model, target_name, param_value, *args, **kwargs)
        if not target_name.startswith(prefix):
            return
        block = target_name[len(prefix):].split(".", 1)[0]
        if block != current_block[0]:
            finished, current_block[0] = current_block[0], block
            if on_block_done is not None and finished is not None:
                on_block_done(model, finished)
            _trim_host_heap()
        if move:
            module_path, _, name = target_name.rpartition(".")
            _to_host(model.get_submodule(module_path), name)

    get_device = core_model_loading.get_device

    def device_of(device_map, param_name, *args, **kwargs):
        if param_name.startswith(prefix):
            return "cpu"
        return get_device(device_map, param_name, *args, **kwargs)

    core_model_loading.set_param_for_module = set_param_then_host
    if move or on_block_done is not None:
        modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    if move and read_to_host:
        core_model_loading.get_device = device_of
    try:
        yield
    finally:
        core_model_loading.set_param_for_module = set_param
        core_model_loading.get_device = get_device
        modeling_utils.caching_allocator_warmup = warmup
        _trim_host_heap()


def _trim_host_heap() -> None:
    """Return free heap memory to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


_LIBC = None


def _to_host(module: nn.Module, name: str) -> None:
    """Replace ``module.<name>`` by a host copy, keeping what transformers marked on it.

    ``_is_hf_initialized`` must survive: transformers initialises, after loading, every tensor
    without it (a Gemma 4 ``layer_scalar`` buffer would silently become 1.0).
    """
    if name in module._buffers:
        buffer = module._buffers[name]
        if buffer is not None:
            moved = buffer.to("cpu", copy=True)
            _keep_marks(buffer, moved)
            module._buffers[name] = moved
        return
    param = module._parameters.get(name)
    if param is None:
        return
    if hasattr(param, "quant_state"):  # bnb Params4bit: .to moves the QuantState too, keeps the packing
        moved = param.to("cpu") if param.device.type != "cpu" else param
    else:
        moved = nn.Parameter(param.data.to("cpu", copy=True), requires_grad=param.requires_grad)
    _keep_marks(param, moved)
    module._parameters[name] = moved


def _keep_marks(old: torch.Tensor, new: torch.Tensor) -> None:
    if new is not old and hasattr(old, "_is_hf_initialized"):
        new._is_hf_initialized = old._is_hf_initialized


def sweep_blocks_to_host(model: nn.Module, descriptor: ArchitectureDescriptor) -> None:
    """Anything transformers created in a block after loading (non-persistent buffers) goes to the host too."""
    from poros.descriptor import resolve_path

    for layer in resolve_path(model, descriptor.decoder_layers):
        for module in layer.modules():
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and tensor.device.type != "cpu":
                    _to_host(module, name)


__all__ = ["blocks_to_host", "sweep_blocks_to_host"]

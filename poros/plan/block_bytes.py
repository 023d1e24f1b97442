"""Block bytes, computed, not guessed (:func:`block_bytes`). On a meta skeleton (:func:`meta_skeleton`:
``AutoModelForCausalLM.from_config(text_config)``, real module tree, no storage), a linear that
transformers' bitsandbytes integration would quantize (:func:`quantized_linears`: exact ``nn.Linear``,
minus ``get_keys_to_not_convert`` and ``_keep_in_fp32_modules``) counts as the packed 4-bit weight
(``ceil(numel / 2)`` bytes) plus its ``QuantState`` tensors (:func:`quantized_tensor_bytes`): fp32 absmax
per 64 values and the 16-value code table, or with double quantization uint8 absmax, the fp32 offset,
fp32 absmax per 256 absmax values and the 256-value code table. Everything else counts at its dtype.
Every tensor is padded to the block store's alignment, walked exactly as
:class:`~poros.stream.store.BlockStore` walks a block, so the result equals the store's host buffer sizes
(``tests/test_cli_train.py`` checks it on every tiny family).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from poros.stream.store import ALIGN, frozen_tensors, shared_tensor_keys


#: bitsandbytes 4-bit block sizes: values per absmax, and absmax values per nested absmax.
QUANT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
CODE_4BIT_VALUES = 16  # the NF4 / FP4 code table (fp32)
CODE_NESTED_VALUES = 256  # the 8-bit dynamic map of double quantization (fp32)


def padded(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` occupies in a block buffer (every tensor starts ALIGN-aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def quantized_tensor_bytes(numel: int, *, double_quant: bool) -> list[int]:
    """Unpadded byte sizes of the tensors bitsandbytes keeps for a 4-bit weight of ``numel`` values.

    ``[packed weight, absmax, code]``; with double quantization
    ``[packed weight, absmax (uint8), code, offset, nested absmax, nested code]``.
    """
    blocks = math.ceil(numel / QUANT_BLOCKSIZE)
    packed = math.ceil(numel / 2)  # two 4-bit values per uint8
    if not double_quant:
        return [packed, 4 * blocks, 4 * CODE_4BIT_VALUES]
    return [packed, blocks, 4 * CODE_4BIT_VALUES, 4, 4 * math.ceil(blocks / NESTED_BLOCKSIZE),
            4 * CODE_NESTED_VALUES]


def meta_skeleton(text_config: Any, compute_dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``text_config`` on the meta device (module tree and shapes, no storage),
    with every tensor frozen as in a QLoRA base."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text_config, dtype=compute_dtype)
    model.requires_grad_(False)
    return model


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears bitsandbytes would quantize on load, by name: transformers' own rule
    (``replace_with_bnb_linear``: exact ``nn.Linear``, skipping the output embedding, tied weights,
    the last module and ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and should_convert_module(name, keep)}


def block_bytes(blocks: list[nn.Module], quantized_weights: set[int], *, double_quant: bool) -> list[int]:
    """Host-store bytes of each block, as :class:`~poros.stream.store.BlockStore` packs it.

    Args:
        blocks: the decoder layers of a (meta) skeleton, frozen.
        quantized_weights: ``id`` of every weight parameter that is stored 4-bit.
        double_quant: the QuantStates carry nested statistics.
    """
    shared = shared_tensor_keys(blocks)  # stays where it is, as in the store
    sizes = []
    for block in blocks:
        total = 0
        for _, owner, attr, _, tensor in frozen_tensors(block):
            if (id(owner), attr) in shared:
                continue
            if id(owner) in quantized_weights:
                total += sum(padded(n) for n in quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
            else:
                total += padded(tensor.numel() * tensor.element_size())
        sizes.append(total)
    return sizes


def nf4_experts_bytes(shape: tuple[int, ...], blocksize: int = 64) -> int:
    """Padded block bytes of one fused expert tensor ``[E, rows, cols]`` as ``poros.quantize_experts`` packs it:
    the 4-bit codes ``[E, rows * cols / 2]`` and the fp32 block scales ``[E, rows * cols / blocksize]``."""
    experts, numel = shape[0], math.prod(shape[1:])
    return padded(experts * numel // 2) + padded(experts * -(-numel // blocksize) * 4)


def tensor_bytes(tensor: torch.Tensor, quantized_weights: set[int], double_quant: bool) -> int:
    """Unpadded bytes of ``tensor``: its packed 4-bit form and quantization state when its ``id`` is
    in ``quantized_weights``, else its dtype's."""
    if id(tensor) in quantized_weights:
        return sum(quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
    return tensor.numel() * tensor.element_size()


__all__ = ["CODE_4BIT_VALUES", "CODE_NESTED_VALUES", "NESTED_BLOCKSIZE", "QUANT_BLOCKSIZE", "block_bytes", "meta_skeleton", "nf4_experts_bytes", "padded", "quantized_linears", "quantized_tensor_bytes", "tensor_bytes"]

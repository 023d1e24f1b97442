"""How a decoder block's frozen tensors pack into ONE contiguous buffer: the layout that the block
store (``store.py``), the host tiers (``tiers.py``) and the NF4 block cache (``poros.loading.cache_blocks``)
share, so that a buffer, a slot, a mapped file region and a cache entry hold the same bytes at the
same offsets.

What a block holds (everything that does not require grad, found by walking the block):

* parameters with ``requires_grad=False``: bitsandbytes ``Params4bit`` packed NF4 weights, biases,
  norm weights, conv weights, raw MoE expert tensors, ``A_log``/``dt_bias``...;
* buffers (persistent or not), e.g. a per-layer output scale;
* the tensors of each bitsandbytes ``QuantState`` (``absmax``, ``code``, ``offset`` and the nested
  ``state2.absmax``/``state2.code`` of double quantization).

Each tensor starts on an :data:`ALIGN`-byte boundary of the buffer; a tensor slot that several blocks
share stays where it is (:func:`shared_tensor_keys`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ALIGN = 512  # bytes; every tensor starts on a 512-byte boundary of the block buffer
QUANT_STATE_TENSORS = ("absmax", "code", "offset")


@dataclass
class Entry:
    """One tensor of a block: where it lives in the buffer and who points at it."""

    name: str  # e.g. "self_attn.q_proj.base_layer.weight" or "...weight.quant_state.absmax"
    owner: Any  # nn.Parameter (kind "param"), nn.Module (kind "buffer") or QuantState (kind "quant")
    attr: str  # buffer name or QuantState attribute; "" for a parameter (its .data is swapped)
    kind: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  # elements spanned by (shape, stride) from the first element


#: ``(entries, tensors, buffer bytes)`` of one block: where each frozen tensor goes, the tensors as they
#: are now (what packing copies), and the buffer's size.
Layout = tuple[list[Entry], list[torch.Tensor], int]


def frozen_tensors(block: nn.Module):
    """Yield (name, owner, attr, kind, tensor) for every frozen tensor of a block, each once."""
    seen: set[int] = set()
    for module_name, module in block.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            yield f"{prefix}{name}", param, "", "param", param.data
            quant_state = getattr(param, "quant_state", None)
            if quant_state is not None:
                yield from _quant_state_tensors(f"{prefix}{name}.quant_state", quant_state)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            yield f"{prefix}{name}", module, name, "buffer", buffer


def _quant_state_tensors(prefix: str, quant_state):
    for attr in QUANT_STATE_TENSORS:
        value = getattr(quant_state, attr, None)
        if isinstance(value, torch.Tensor):
            yield f"{prefix}.{attr}", quant_state, attr, "quant", value
    nested = getattr(quant_state, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(f"{prefix}.state2", nested)


def shared_tensor_keys(blocks: list[nn.Module]) -> set[tuple[int, str]]:
    """``(id(owner), attr)`` of every tensor slot that several blocks reference (it stays where it is)."""
    seen_in: dict[tuple[int, str], set[int]] = {}
    for i, block in enumerate(blocks):
        for _, owner, attr, _, _ in frozen_tensors(block):
            seen_in.setdefault((id(owner), attr), set()).add(i)
    return {key for key, where in seen_in.items() if len(where) > 1}


def layout_of(block: nn.Module, shared: set[tuple[int, str]]) -> Layout:
    """Where each frozen tensor of ``block`` goes in its buffer: ``(entries, tensors, buffer bytes)``; the tensor
    slots in ``shared`` (:func:`shared_tensor_keys`) stay where they are."""
    entries: list[Entry] = []
    tensors: list[torch.Tensor] = []
    offset = 0
    for name, owner, attr, kind, tensor in frozen_tensors(block):
        if (id(owner), attr) in shared:
            continue
        span = 1 + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
        nbytes = span * tensor.element_size()
        entries.append(Entry(name, owner, attr, kind, offset, nbytes, tensor.dtype, tuple(tensor.shape),
                             tuple(tensor.stride()), span))
        tensors.append(tensor)
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, tensors, offset


def block_layouts(blocks: list[nn.Module]) -> list[Layout]:
    """``(entries, tensors, buffer bytes)`` of each of ``blocks``, as :class:`~poros.stream.store.BlockStore` packs them: the
    layout a host tier (``poros.stream.tiers``) and the NF4 block cache write to a file."""
    shared = shared_tensor_keys(blocks)
    return [layout_of(block, shared) for block in blocks]


def entry_view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
    """The tensor of ``entry`` as a view into ``buffer`` (a uint8 block buffer, slot or mapped file region)."""
    raw = buffer[entry.offset: entry.offset + entry.nbytes]
    return raw.view(entry.dtype).as_strided(entry.shape, entry.stride)


def bind_entry(entry: Entry, tensor: torch.Tensor | None) -> None:
    """Point the module tensor that ``entry`` describes at ``tensor``."""
    if entry.kind == "param":
        entry.owner.data = tensor
    elif entry.kind == "buffer":
        entry.owner._buffers[entry.attr] = tensor
    else:
        setattr(entry.owner, entry.attr, tensor)


def packed_block_bytes(blocks: list[nn.Module]) -> list[int]:
    """The buffer bytes :class:`~poros.stream.store.BlockStore` gives each of ``blocks`` (before packing, nothing moves)."""
    shared = shared_tensor_keys(blocks)
    return [layout_of(block, shared)[2] for block in blocks]


__all__ = ["ALIGN", "Entry", "Layout", "QUANT_STATE_TENSORS", "bind_entry", "block_layouts", "entry_view",
           "frozen_tensors", "layout_of", "packed_block_bytes", "shared_tensor_keys"]

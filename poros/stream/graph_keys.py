"""What a block phase's CUDA graph is keyed by, and what keeps a block from being captured (``graphs.py``).

A key holds plain values only: :func:`plain_key` turns a block's plain attributes (numbers, strings, and
dicts / lists of them such as PEFT's per-adapter ``scaling``) into one, :func:`module_structure` its modules
(:func:`block_structures` counts the structures of a model's blocks, for the planner), :func:`signature` an argument
(a tensor's shape, strides, dtype, device and ``requires_grad``; a plain value by value),
:func:`carried_signature` the carried mappings a block reads and writes, :func:`hashable_autocast` the
autocast state. What makes a block run eagerly instead: a carried mapping the descriptor does not
describe or an entry no earlier block wrote (:func:`carried_reason`), arguments whose elements overlap
(:func:`non_overlapping`), global module hooks (:func:`global_hooks`).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from poros.stream.carried import CarriedAccess

PLAIN = (int, float, str, bool, type(None))
NOT_PLAIN = object()


def plain_key(value: Any) -> Any:
    """``value`` as a hashable key when it is a plain value or a dict / list / tuple of them (PEFT's
    per-adapter ``scaling``, ``r``, ``use_dora``...), else ``NOT_PLAIN``."""
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, dict):
        items = [(k, plain_key(v)) for k, v in value.items()]
        if all(isinstance(k, PLAIN) and v is not NOT_PLAIN for k, v in items):
            return ("dict", tuple(sorted(items, key=lambda item: str(item[0]))))
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [plain_key(v) for v in value]
        if all(v is not NOT_PLAIN for v in items):
            return (type(value).__name__, tuple(sorted(items, key=str) if isinstance(value, (set, frozenset))
                                                else items))
    return NOT_PLAIN


def module_structure(modules: Iterable[tuple[str, nn.Module]]) -> tuple:
    """The key's part for the code a block runs: each of its modules' name, type and plain attributes (but
    the layer index and the training mode, keyed apart). ``modules``: the block's ``named_modules()``."""
    return tuple((name, type(m).__qualname__, tuple(sorted(
        (k, plain_key(v)) for k, v in vars(m).items()
        if k not in ("layer_idx", "training") and plain_key(v) is not NOT_PLAIN)))
        for name, m in modules)


def block_structures(layers: Iterable[nn.Module]) -> int:
    """How many block structures ``layers`` hold (:func:`module_structure`): CUDA graphs key each apart (a model mixing
    linear- and full-attention layers has two; layers that store or read shared K/V add more). What the
    planner counts the graphs by (``placement.graph_reserve_bytes``); a meta skeleton's layers count as loaded ones."""
    return len({module_structure(layer.named_modules()) for layer in layers})


def carried_reason(index: int, mapping: Any, access: CarriedAccess, device: torch.device) -> str | None:
    """Why block ``index`` cannot be captured with this carried mapping, naming what was found, or None."""
    if not access.declared:
        return (f"carried state: {access.kwarg} (layer {index}; the descriptor does not say which entries a "
                "layer reads or writes: CarriedState reader_flag / writer_flag / entry_key)")
    for key in access.reads:
        if key not in mapping:
            return f"carried state: {access.kwarg}[{key!r}] (layer {index} reads it; no earlier layer wrote it)"
        values = pytree.tree_leaves(mapping[key])
        if not all(isinstance(v, torch.Tensor) and v.device == device and non_overlapping(v) for v in values):
            return (f"carried state: {access.kwarg}[{key!r}] (layer {index} reads it; it holds more than "
                    f"tensors on {device} with a layout a static copy can hold)")
    return None


def carried_signature(leaves: list[Any], carried: dict[int, CarriedAccess]) -> tuple:
    """The key's part for carried mappings: what the block reads and writes, and each read tensor's signature."""
    return tuple((position, access.kwarg, access.reads, access.writes,
                  tuple(signature(t) for key in access.reads for t in pytree.tree_leaves(leaves[position][key])))
                 for position, access in carried.items())


def non_overlapping(tensor: torch.Tensor) -> bool:
    """Whether no two of ``tensor``'s elements share memory (no expanded view), gaps allowed: a slice such
    as a per-layer input ``[:, :, i]`` sliced from one tensor is; a static buffer of its shape and strides holds it."""
    reach = 0  # the farthest offset the smaller dimensions reach
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride <= reach:
            return False
        reach += stride * (size - 1)
    return True


def dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory once each, in some order (autograd's
    "non-overlapping and dense": its accumulator gives such a leaf a ``.grad`` of the same strides)."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
    return ("value", type(leaf).__name__, leaf)


def autocast_on(state: Any) -> bool:
    """Whether a recorded autocast state (``replay.autocast_state``) has a kind enabled."""
    return bool(state) and any(kwargs.get("enabled") for _, kwargs in state)


def hashable_autocast(state: Any) -> Any:
    if state is None:
        return None
    return tuple((kind, tuple(sorted(kwargs.items(), key=lambda item: item[0]))) for kind, kwargs in state)


def global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks
                or module._global_backward_hooks or module._global_backward_pre_hooks)


__all__ = ["NOT_PLAIN", "PLAIN", "autocast_on", "block_structures", "carried_reason", "carried_signature", "dense",
           "global_hooks", "hashable_autocast", "module_structure", "non_overlapping", "plain_key", "signature"]

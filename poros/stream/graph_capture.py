"""What a captured block phase holds (``graphs.py``): its static buffers (:class:`Graph`: the arguments,
the LoRA values, the outputs, the further inputs; :meth:`Graph.load` copies a running block's values in,
:meth:`Graph.write_back` puts what it wrote into the live carried mappings), and the pieces a capture is
built from: static copies (:func:`static_copy`), the static LoRA buffers and LoRA gradient buffers every
graph shares (:class:`ParameterStatics`, autograd's gradients copied into the latter: :func:`copied_into`; why
sharing them is sound: ``graphs.py``'s docstring), the trainable parameters pointed at their static buffers
while the graph records (:func:`pointed_at`), a carried mapping of the capture's own (:func:`own_mappings`,
:func:`read_tensors`, :func:`written_entries`), and gradients laid out as autograd's accumulator lays them
out (:func:`as_grad_of`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from poros.errors import StreamingError
from poros.stream.carried import CarriedAccess
from poros.stream.graph_keys import dense


@dataclass
class Graph:
    """One captured block phase: its replay and the static buffers it reads and writes."""

    replay: Callable[[], None]  # reruns the captured kernels on the static buffers
    statics: list[Any]  # per argument leaf: its static tensor, the plain value, or the capture's own carried mapping
    params: list[torch.Tensor]  # static LoRA values: buffers of the graphs' shared ParameterStatics
    outputs: list[torch.Tensor | None]
    # further static inputs, copied in with ``load``'s ``extra``: the output gradient, the read entries'
    # tensors, the gradients later readers sent to the written entries
    inputs: list[torch.Tensor] = field(default_factory=list)
    # each entry the block writes: (leaf position of its mapping, key, pytree spec, first output, count)
    writes: list[tuple[int, Any, Any, int, int]] = field(default_factory=list)
    last: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # leaf -> (source, version) copied

    def load(self, leaves: list[Any], params: list[nn.Parameter], extra: list[torch.Tensor] = ()) -> None:
        """Copy the running block's arguments (leaf 0, the hidden states, always; the others — masks,
        rotary — only when they are not the tensor copied last time), its LoRA values and ``extra``
        (the static inputs beyond the arguments, in :attr:`inputs` order) into the static buffers."""
        targets, sources = [], []
        for position, (static, leaf) in enumerate(zip(self.statics, leaves)):
            if not isinstance(leaf, torch.Tensor):
                continue
            seen = self.last.get(position)
            if position and seen is not None and seen[0] is leaf and seen[1] == leaf._version:
                continue
            if position:
                self.last[position] = (leaf, leaf._version)  # held: its id cannot be reused meanwhile
            targets.append(static)
            sources.append(leaf.detach())
        targets += self.params
        sources += [p.detach() for p in params]
        if len(extra) != len(self.inputs):
            raise StreamingError(f"a graph replay got {len(extra)} further inputs, its capture had {len(self.inputs)}")
        targets += self.inputs
        sources += [t.detach() for t in extra]
        with torch.no_grad():  # the backward graph's static inputs are leaves that require grad
            torch._foreach_copy_(targets, sources)

    def write_back(self, leaves: list[Any]) -> None:
        """Put a copy of each entry the replay wrote into the live mapping (``leaves``' own), as the block would."""
        for position, key, spec, first, count in self.writes:
            leaves[position][key] = pytree.tree_unflatten([t.clone() for t in self.outputs[first:first + count]], spec)


class ParameterStatics:
    """The static buffers of the blocks' trainable (LoRA) tensors, one set shared by every captured graph.

    A buffer is found by the parameter's signature (shape, strides, dtype, device) and its occurrence among
    the block's parameters of that signature: the k-th parameter of a signature in every block reads the
    signature's k-th buffer, made on first need. Two parameters of one block never share a buffer; blocks of
    different structures share every buffer their signatures have in common. What it holds at most is the
    block with the most parameters of each signature, not a copy per graph.

    :attr:`BlockGraphs.statics` holds the values the graphs read (:meth:`for_block`),
    :attr:`BlockGraphs.gradients` the LoRA gradients every backward graph returns (:meth:`buffers_of`; a
    capture copies autograd's gradients into them: :func:`copied_into`).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def signature(parameter: torch.Tensor) -> tuple:
        return tuple(parameter.shape), parameter.stride(), parameter.dtype, parameter.device

    def buffers_of(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers of ``parameters`` (a block's, in order), values as they are."""
        seen: Counter = Counter()
        buffers = []
        for parameter in parameters:
            key = self.signature(parameter)
            held = self.buffers.setdefault(key, [])
            if seen[key] == len(held):
                held.append(torch.empty_strided(parameter.shape, parameter.stride(), dtype=parameter.dtype,
                                                device=parameter.device))
            buffers.append(held[seen[key]])
            seen[key] += 1
        return buffers

    def for_block(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buffers of ``parameters`` (a block's, in order), holding their values now."""
        buffers = self.buffers_of(parameters)
        if buffers:
            with torch.no_grad():
                torch._foreach_copy_(buffers, [p.detach() for p in parameters])
        return buffers

    @property
    def nbytes(self) -> int:
        """Bytes the shared buffers hold."""
        return sum(b.untyped_storage().nbytes() for held in self.buffers.values() for b in held)


def read_tensors(leaves: list[Any], carried: dict[int, CarriedAccess]) -> list[torch.Tensor]:
    """The tensors of the entries the block reads from its live mappings, in capture order."""
    return [t for position, access in carried.items() for key in access.reads
            for t in pytree.tree_leaves(leaves[position][key])]


def own_mappings(statics: list[Any], leaves: list[Any], carried: dict[int, CarriedAccess]) -> list[torch.Tensor]:
    """Give the capture a mapping of its own in place of each live one (a graph must not keep reading or
    writing a live mapping, which is another object every forward): static copies of the entries the block
    reads, requiring grad as the live ones do. Returns those static tensors, in :func:`read_tensors` order."""
    reads = []
    for position, access in carried.items():
        live = leaves[position]
        own = type(live)()
        for key in access.reads:
            values, spec = pytree.tree_flatten(live[key])
            copies = [static_copy(v).requires_grad_(v.requires_grad) for v in values]
            reads += copies
            own[key] = pytree.tree_unflatten(copies, spec)
        statics[position] = own
    return reads


def written_entries(index: int, statics: list[Any], carried: dict[int, CarriedAccess]) -> list[tuple]:
    """What a captured block wrote into its own mappings: ``(position, key, spec, tensors)`` per written
    entry, checked against what it was declared to do.

    Raises:
        StreamingError: the block wrote an entry it was not declared to write, or did not write one it
            was (the descriptor's flags and the layer disagree: its blocks run eagerly).
    """
    written = []
    for position, access in carried.items():
        own = statics[position]
        for key in own.keys():
            if key not in access.writes and key not in access.reads:
                raise StreamingError(f"layer {index} wrote {access.kwarg}[{key!r}], which the descriptor's "
                                     "writer_flag does not say; the block runs eagerly")
        for key in access.writes:
            if key not in own:
                raise StreamingError(f"layer {index} did not write {access.kwarg}[{key!r}], which the "
                                     "descriptor's writer_flag says it does; the block runs eagerly")
            tensors, spec = pytree.tree_flatten(own[key])
            if not all(isinstance(t, torch.Tensor) for t in tensors):
                raise StreamingError(f"layer {index} wrote {access.kwarg}[{key!r}] holding more than tensors")
            written.append((position, key, spec, tensors))
    return written


def numbered(written: list[tuple]):
    """Each written entry with the index of its first tensor among the written tensors."""
    first = 0
    for position, key, spec, tensors in written:
        yield position, key, spec, tensors, first
        first += len(tensors)


def as_grad_of(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``grad`` laid out as autograd's accumulator lays out ``leaf.grad`` (the eager path reads
    ``.grad``): ``leaf``'s strides where ``leaf`` is dense, else contiguous."""
    if grad is None:
        return None
    if dense(leaf):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def copied_into(grads: list[torch.Tensor | None], buffers: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each gradient copied into its (shared, static) buffer, which stands in for it; None stays None. Inside a
    capture the copies are kernels of the graph, and autograd's own gradients its temporaries."""
    shared = []
    with torch.no_grad():
        for grad, buffer in zip(grads, buffers, strict=True):
            if grad is not None and (grad.shape != buffer.shape or grad.dtype != buffer.dtype):
                raise StreamingError(f"a LoRA gradient of shape {tuple(grad.shape)} and {grad.dtype} does not "
                                     f"fit its parameter's {tuple(buffer.shape)} and {buffer.dtype}; the block "
                                     "runs eagerly")
            shared.append(None if grad is None else buffer.copy_(grad))
    return shared


def static_copy(leaf: Any) -> Any:
    """A buffer of ``leaf``'s shape, strides and dtype holding its values (plain values as they are)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    static = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
    return static.copy_(leaf.detach())


def clone(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.clone()


@contextlib.contextmanager
def pointed_at(parameters: list[nn.Parameter], statics: list[torch.Tensor]):
    """Point each parameter at its static buffer for the capture (the graph records those addresses)."""
    originals = [p.data for p in parameters]
    try:
        for parameter, static in zip(parameters, statics):
            parameter.data = static
        yield
    finally:
        for parameter, original in zip(parameters, originals):
            parameter.data = original


__all__ = ["Graph", "ParameterStatics", "as_grad_of", "clone", "copied_into", "numbered", "own_mappings",
           "pointed_at", "read_tensors", "static_copy", "written_entries"]

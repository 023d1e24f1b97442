"""Kept activations: a block that runs its forward with autograd and keeps the saved tensors until its
backward, instead of saving only its input and recomputing (``StreamOptions.recompute``).

The trap is the block's own weights. A streamed block's frozen tensors are views of a device slot that
another block fills once this one is released; whatever the forward's autograd graph saved of them would
then read the other block's bytes in backward. Two kinds of references hold them:

* tensors saved with ``save_for_backward`` (a norm's weight in ``weight * x``, a bias): while a kept forward
  runs, :meth:`KeptBlock.saving` installs ``saved_tensors_hooks`` that pack every saved tensor lying in the
  block's device bytes as a :class:`SlotRef` (its byte offset in the block, dtype, shape, stride), and unpack
  it as a view of the bytes the block has *when its backward runs* (any other saved tensor is packed detached:
  packed with its own ``grad_fn``, a saved output would be a cycle through autograd's C++ node that Python's
  collector cannot see, alive for good where the backward never runs that node);
* tensors a custom ``autograd.Function`` keeps as attributes of its context (bitsandbytes' ``MatMul4Bit``
  keeps its packed weight as ``ctx.tensors = (None, B)``, out of the hooks' sight): after the forward,
  :meth:`KeptBlock.detach_contexts` walks the block's graph and replaces each such tensor by a
  :class:`SlotRef`; :meth:`KeptBlock.bind_contexts`, after the block is fetched again for its backward, puts
  back views of the current bytes. (Its ``QuantState`` is the same object across fetches: the store rebinds
  its tensors in place.)

Unpacking or binding while the block is not on the device raises :class:`~poros.errors.StreamingError`:
no kept block can ever read a slot another block owns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from poros.errors import StreamingError


@dataclass(frozen=True)
class SlotRef:
    """A tensor inside a block's device bytes, by place: resolved against the bytes the block has then."""

    offset: int  # bytes from the start of the block's device buffer
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _ref(tensor: Any, buffer: torch.Tensor) -> SlotRef | None:
    """``tensor`` as a :class:`SlotRef` into ``buffer`` (a uint8 block buffer), or None when it lies elsewhere."""
    if not isinstance(tensor, torch.Tensor) or tensor.device != buffer.device or tensor.numel() == 0:
        return None
    try:
        if tensor.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return None
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a meta tensor)
        return None
    offset = tensor.storage_offset() * tensor.element_size() - buffer.storage_offset()
    if not 0 <= offset < buffer.numel():
        return None
    return SlotRef(offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


class _Bytes:
    """A block's device bytes, for the hot test "does this tensor lie in them" (:meth:`ref`).

    A tensor lies in ``buffer`` exactly when it shares its storage and ``0 <= offset < buffer.numel()``, where
    ``offset`` is ``tensor.data_ptr() - buffer.data_ptr()``: so a data pointer outside that byte range settles it
    with two integer comparisons (almost every saved tensor is an activation), and one inside it gets
    :func:`_ref`'s whole test."""

    __slots__ = ("buffer", "start", "end")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer, self.start = buffer, buffer.data_ptr()
        self.end = self.start + buffer.numel()

    def ref(self, tensor: Any) -> SlotRef | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        try:
            pointer = tensor.data_ptr()
        except (RuntimeError, NotImplementedError):  # no plain data pointer: the whole test decides
            return _ref(tensor, self.buffer)
        if pointer < self.start or pointer >= self.end:
            return None
        return _ref(tensor, self.buffer)


def _view(ref: SlotRef, buffer: torch.Tensor) -> torch.Tensor:
    size = ref.dtype.itemsize
    start = buffer.storage_offset() + ref.offset
    if start % size:
        raise StreamingError(f"a kept block's saved weight at byte {ref.offset} is not aligned to its dtype "
                             f"{ref.dtype}; the store's layout must align every tensor (it does at 512 bytes).")
    return torch.empty(0, dtype=ref.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), start // size, ref.shape, ref.stride)


class KeptBlock:
    """One kept forward of block ``index`` (one micro-batch): its leaves, its output and the references to
    rebind; ``buffer_of(index)`` is the store's device buffer of the block now (None: not on the device)."""

    def __init__(self, index: int, buffer_of: Callable[[int], torch.Tensor | None]) -> None:
        self.index, self.buffer_of = index, buffer_of
        self.contexts: list[tuple[Any, str, Any]] = []  # (graph node, attribute, value with SlotRefs)
        self.leaf_hidden: torch.Tensor | None = None
        self.leaf_inputs: list[torch.Tensor] = []
        self.output: Any = None
        self.saved_bytes = 0  # what the graph keeps besides the block's weights (distinct storages)
        self._seen: set[int] = set()
        self._bytes: _Bytes | None = None  # while the forward runs: the block's bytes

    def _buffer(self) -> torch.Tensor:
        buffer = self.buffer_of(self.index)
        if buffer is None:
            raise StreamingError(f"block {self.index} kept its activations but is not on the device for its backward; "
                                 "the executor must fetch it before back-propagating it.")
        return buffer

    def _pack(self, tensor: torch.Tensor) -> Any:
        ref = self._bytes.ref(tensor)
        if ref is not None:
            return ref
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._seen:
            self._seen.add(pointer)
            self.saved_bytes += storage.nbytes()
        # the same storage without the graph: a saved output packed with its own grad_fn is a cycle through
        # autograd's C++ node that Python's collector cannot see (a node backward never runs would keep it alive)
        return tensor.detach()

    def _unpack(self, value: Any) -> torch.Tensor:
        return _view(value, self._buffer()) if isinstance(value, SlotRef) else value

    @contextlib.contextmanager
    def saving(self):
        """Around the kept forward: saved tensors in the block's bytes are kept by place. (The block is on the device
        for the whole forward, so its bytes are looked up once, here.)"""
        self._bytes = _Bytes(self._buffer())
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._bytes = None

    def detach_contexts(self, roots: list[torch.Tensor]) -> None:
        """After the kept forward: tensors in the block's bytes that graph nodes hold as attributes
        (custom Functions' contexts) are replaced by :class:`SlotRef` s.

        Every node of the block's graph is visited (its leaves end it: the block's input and its adapters); only
        Python-defined nodes (custom Functions' contexts) have attributes to look at."""
        change = _Bytes(self._buffer()).ref
        stack, seen = [], set()
        for root in roots:
            node = root.grad_fn if isinstance(root, torch.Tensor) else None
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                stack.append(node)
        contexts = self.contexts
        while stack:
            node = stack.pop()
            for edge in node.next_functions:
                after = edge[0]
                if after is not None and id(after) not in seen:
                    seen.add(id(after))
                    stack.append(after)
            attributes = getattr(node, "__dict__", None)
            if not attributes:
                continue
            for name, value in list(attributes.items()):
                replaced = _map(value, change)
                if replaced is not value:
                    setattr(node, name, replaced)
                    contexts.append((node, name, replaced))

    def bind_contexts(self) -> None:
        """Before the backward (the block fetched again): the contexts' references become views of its bytes now."""
        buffer = self._buffer()

        def view(value: Any) -> torch.Tensor | None:
            return _view(value, buffer) if isinstance(value, SlotRef) else None

        for node, name, value in self.contexts:
            setattr(node, name, _map(value, view))
        self.contexts = []


def run_kept(layer: torch.nn.Module, call: Any, index: int, hidden: torch.Tensor, grad_tensors,
             buffer_of: Callable[[int], torch.Tensor | None]) -> KeptBlock:
    """Block ``index``'s forward with autograd from leaves of ``hidden`` and ``grad_tensors`` (its
    :class:`~poros.stream.layer_call.LayerCall` ``call`` gives HF's other arguments): the graph is kept, the
    block's weights in it by place. Its backward is ``output``'s, with the block on the device again."""
    kept = KeptBlock(index, buffer_of)
    kept.leaf_hidden = hidden.detach().requires_grad_(index > 0 or hidden.requires_grad)
    kept.leaf_inputs = [t.detach().requires_grad_(True) for t in grad_tensors]
    with torch.enable_grad(), kept.saving():
        args, kwargs = call.build(kept.leaf_hidden, kept.leaf_inputs)
        kept.output = layer(*args, **kwargs)
    kept.detach_contexts([kept.output])
    return kept


def _map(value: Any, change: Callable[[Any], Any]) -> Any:
    """``value`` with each tensor (or SlotRef) ``change`` returns something for replaced (a tuple or list is
    rebuilt only when an item changed); ``value`` itself when nothing changed."""
    if isinstance(value, (torch.Tensor, SlotRef)):
        new = change(value)
        return value if new is None else new
    if isinstance(value, (tuple, list)):
        items = [_map(v, change) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items)
    return value


__all__ = ["KeptBlock", "SlotRef", "run_kept"]

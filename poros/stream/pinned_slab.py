"""``PinnedSlab``: many host tensors carved out of a few large page-locked buffers, at their own size.

::

    torch.empty(..., pin_memory=True)       50.3 MB tensor -> a 64 MiB block (torch rounds up to a power of two)
    PinnedSlab(pin=True).empty(...)          50.3 MB tensor -> 50.3 MB of a registered chunk (512 B aligned)

Notable features:

* **Why.** torch's caching host allocator rounds every pinned allocation up to a power of two. The
  host-side AdamW state (:class:`~poros.stream.host_optimizer.HostAdamW`) and the host LoRA tensors of
  ``lora_placement="host"`` (:class:`~poros.stream.lora_placement.LoraPlacement`) are many tensors of
  awkward sizes: a 122B-A10B expert LoRA factor of 50.3 MB takes 64 MiB, about 6 GiB over the plan's
  host RAM at that size, on a host that has none to spare. Carved from chunks registered with
  ``cudaHostRegister`` (as the pinned block tier's :class:`~poros.stream.block_file.HostArena` is),
  each tensor takes its own bytes, 512-byte aligned.
* **Each tensor is a storage of its own** (``torch.frombuffer`` over a disjoint slice of its chunk), so
  ``torch.save``, safetensors and PEFT's savers see separate tensors, never one shared storage, and a
  saved optimizer holds only its own bytes.
* **Chunks grow as they are used**: 16 MiB, then as large as all the chunks so far, at most
  ``chunk_bytes`` (1 GiB), and no larger than what the owner said it will still ask (``expected``: HostAdamW
  and the LoRA placement know their totals), so a registered tail left unused stays small. A tensor larger
  than a chunk gets a chunk of its own, and the chunk being carved stays open. A tiny model pins 16 MiB.
* **Freed with its last tensor.** The slab keeps only the chunk it carves from; a chunk is unregistered
  (once the device has finished its copies: :func:`poros.stream.host_register.unregister`) and freed when its
  last tensor is (a finalizer on the chunk, run before its pages go).
* **Where the device refuses to register** (or ``pin=False``: CPU runs, tests), the chunk stays
  pageable; with ``pin=True`` the tensors then come from torch's pinned allocator one by one, as before.
  The refusal does not linger as CUDA's last error (:mod:`poros.stream.host_register`).
* **One thread.** The owners carve from the thread that runs the step; the slab takes no lock.

May import: torch, the standard library and :mod:`poros.stream.host_register`.
"""

from __future__ import annotations

import math
import weakref

import torch

from poros.stream import host_register

ALIGN = 512  # bytes: every tensor starts at a multiple (any element size, DMA-friendly)
FIRST_CHUNK = 16 << 20
CHUNK_BYTES = 1 << 30


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def expected_bytes(tensors, copies: int = 1) -> int:
    """What a slab will hand out for ``copies`` host tensors shaped like each of ``tensors``: an owner's
    ``expected`` (each tensor aligned as :meth:`PinnedSlab.empty` carves it)."""
    return sum(copies * _aligned(t.numel() * t.element_size()) for t in tensors)


class PinnedSlab:
    """Host tensors at their own size from a few large (page-locked when ``pin``) chunks.

    Args:
        pin: register the chunks with CUDA (page-locked, for asynchronous copies).
        chunk_bytes: the largest chunk (a larger tensor gets a chunk of its own size).
        expected: the bytes the owner will ask in all, if it knows (a chunk is then no larger than the rest).

    Attributes:
        reserved: bytes of every chunk made so far. ``used``: bytes handed out (aligned).
        registered: False once the device refused a registration (the pinned allocator serves the rest).
    """

    def __init__(self, pin: bool, *, chunk_bytes: int = CHUNK_BYTES, expected: int | None = None) -> None:
        self.pin, self.chunk_bytes, self.expected = bool(pin), int(chunk_bytes), expected
        self.registered = self.pin
        self.reserved = self.used = 0
        self._chunk = None  # the numpy view of the chunk being carved (its tensors keep it alive)
        self._offset = 0

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous host tensor of ``shape`` and ``dtype``, carved from a chunk."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        if self.pin and not self.registered:  # the device refused a chunk: torch's pinned allocator from then on
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        if nbytes > self.chunk_bytes:  # a chunk of its own; the open chunk stays open
            return self._carve(self._make(_aligned(nbytes)), 0, nbytes, shape, dtype)
        if self._chunk is None or self._offset + nbytes > len(self._chunk):
            self._chunk, self._offset = self._make(self._next_size(nbytes)), 0
        tensor = self._carve(self._chunk, self._offset, nbytes, shape, dtype)
        self._offset += _aligned(nbytes)
        return tensor

    def _next_size(self, nbytes: int) -> int:
        size = min(self.chunk_bytes, max(FIRST_CHUNK, self.reserved))
        if self.expected is not None and self.expected - self.used > 0:
            size = min(size, self.expected - self.used)
        return _aligned(max(nbytes, size))

    def _carve(self, chunk, offset: int, nbytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
        if chunk is None:  # the device refused the chunk's registration
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        self.used += _aligned(nbytes)
        return torch.frombuffer(chunk[offset: offset + nbytes], dtype=dtype).view(shape)

    def _make(self, size: int):
        """A new chunk of ``size`` bytes (registered when ``pin``), or None when the device refused it."""
        raw = torch.empty(size + ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % ALIGN
        whole = raw.numpy()  # every slice of it has it as base: it lives as long as a tensor carved from it
        if self.pin:
            pointer = raw.data_ptr()
            if host_register.register(pointer, raw.numel()) != 0:
                self.registered = False
                return None
            weakref.finalize(whole, host_register.unregister, pointer).atexit = False  # at exit the process lets all go
        self.reserved += size
        return whole[start: start + size]


__all__ = ["ALIGN", "CHUNK_BYTES", "FIRST_CHUNK", "PinnedSlab", "expected_bytes"]

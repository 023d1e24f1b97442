"""Host tiers: where the streamed blocks' bytes live on the host. :class:`HostTier` is the contract the
block store (``store.py``) calls; :data:`~poros.config.HOST_TIERS` names the three tiers, one class each
(:data:`TIER_CLASSES`), and the executor does not change with the tier (it asks the store for block i
and waits).

Each block's frozen tensors pack into one buffer (``packing.py``). A *block file* holds those buffers
back to back, each at a 4 KiB-aligned offset, exactly the bytes the store streams (``block_file.py``,
with what the file tiers share). This module holds the contract, the two tiers that keep every block in
host memory and the registry of tiers; the disk tier is ``disk_tier.py``.

* :class:`PinnedTier` -- one buffer per streamed block, page-locked on CUDA: the whole NF4 base in this
  process's RAM. A ``load_state_dict`` into an evicted block writes into its buffer.
* :class:`MappedTier` -- the file mapped shared and read-only: the OS page cache holds one copy that
  every process of the node maps and shares. On CUDA the mapping is registered for DMA
  (``cudaHostRegister``, read-only), so copies run as from pinned memory. Each block's host buffer
  is a view of that mapping.
* :class:`~poros.stream.disk_tier.DiskTier` -- for host RAM smaller than the model: no host buffer per block; a reader
  thread reads the next blocks (in the order the passes visit them: up in forward, down in
  backward, turning at the ends) into a small ring of pinned buffers ahead of use, with
  ``O_DIRECT`` where the file system and the buffer allow it, large sequential reads otherwise. A
  read that guessed wrong only costs a wait: the store asks for block i and gets block i.

Either file tier takes the file it is given (the NF4 block cache entry of ``poros.loading.cache``, when
the model's block tensors are views of it) or, for a model loaded any other way, writes a *spill* file
of the packed blocks into a directory and unlinks it at once (it lives as long as it is open). It never
writes the file: a ``load_state_dict`` into an evicted block writes into a copy-on-write mapping
(``lend``), and the block is served from a pinned buffer of its own from then on (``keep``).

The node's ranks also share the frozen embedding tables Poros keeps on the host
(:func:`~poros.stream.block_file.share_host_table`): a file beside the cache entry holds each table's
bytes, and every rank's table is a copy-on-write mapping of it, the page cache's pages until something
writes.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from poros.settings import HOST_TIERS
from poros.errors import StreamingError
from poros.stream.block_file import (  # re-exported: the tiers' file, as before the disk tier moved out
    CHECKSUMS,
    FILE_ALIGN,
    BlockFile,
    HostArena,
    KeptBlocks,
    checksum_file,
    default_checksum,
    padded,
    register_for_dma,
    release_mapping,
    share_host_table,
    source_for,
    write_block_file,
)
from poros.stream import host_register
from poros.stream.disk_tier import DiskTier
from poros.stream.packing import Layout, entry_view


@runtime_checkable
class HostTier(Protocol):
    """Where a :class:`~poros.stream.store.BlockStore`'s streamed blocks live on the host: all the store knows
    of a tier. Every ``index`` is a streamed block's. The store calls :meth:`attach` once, then
    :meth:`host_buffer` once per block; each fetch calls :meth:`acquire`, queues the copy out of what it
    returned, then :meth:`copied`; a ``state_dict`` / ``load_state_dict`` of an evicted block calls
    :meth:`lend` (and :meth:`keep` after a load wrote its frozen tensors); ``restore`` acquires every block
    a last time, then calls :meth:`close`."""

    name: str  # one of poros.config.HOST_TIERS

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        """Take the streamed blocks (``{index: layout}``, the module tensors still as loaded): pack them,
        map their file or open it. ``device`` is the compute device (CUDA: pin or register for DMA)."""

    def host_buffer(self, index: int) -> torch.Tensor | None:
        """The block's bytes for the run, or None when they are read on demand (:meth:`acquire`)."""

    def acquire(self, index: int) -> torch.Tensor:
        """The block's bytes now (uint8, the layout's size), to be copied to the device."""

    def copied(self, index: int, stream: Any) -> None:
        """The copy out of :meth:`acquire`'s bytes is queued on CUDA ``stream`` (None: it is done)."""

    def lend(self, index: int) -> torch.Tensor:
        """The block's bytes, writable, for a ``state_dict`` / ``load_state_dict`` of the evicted block."""

    def keep(self, index: int, data: torch.Tensor) -> None:
        """A ``load_state_dict`` wrote the block's frozen tensors into ``data`` (what :meth:`lend` gave):
        serve these bytes from now on."""

    def close(self) -> None:
        """Let go of what the tier holds (buffers, mappings, the reader). Called once; nothing streams after."""


class PinnedTier:
    """One host buffer per streamed block (page-locked when the device is CUDA, unless ``pin_memory`` says
    otherwise): every fetch copies from it and a ``load_state_dict`` writes into it. This process's own
    copy of the whole NF4 base; the store's default.

    The buffers are views of one :class:`~poros.stream.block_file.HostArena`, page-locked by registering it:
    torch's pinned allocator rounds each allocation up to a power of two, which gives the 122B-A10B's 1.39 GB
    blocks 2 GiB each (96 GiB for a 64 GB base; the bench of that shape outgrew a 128 GiB GPU host)."""

    name = "pinned"

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = pin_memory
        self.buffers: dict[int, torch.Tensor] = {}
        self.arena: HostArena | None = None

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        pin = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        self.arena = HostArena({index: nbytes for index, (_, _, nbytes) in layouts.items()}, pin,
                               fallback_pinned=False)
        if pin and not self.arena.registered:  # the device refused: torch's pinned allocator, block by block
            self.arena.release()
            self.arena = None
        for index, (entries, tensors, nbytes) in layouts.items():
            buffer = (self.arena.views[index] if self.arena is not None
                      else torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
            for entry, tensor in zip(entries, tensors):
                entry_view(buffer, entry).copy_(tensor)
            self.buffers[index] = buffer

    def host_buffer(self, index: int) -> torch.Tensor:
        return self.buffers[index]

    acquire = lend = host_buffer

    def copied(self, index: int, stream: Any) -> None:
        pass

    def keep(self, index: int, data: torch.Tensor) -> None:
        if data is not self.buffers[index]:
            self.buffers[index].copy_(data)

    def close(self) -> None:
        self.buffers = {}
        if self.arena is not None:
            self.arena.release()
            self.arena = None


class MappedTier(KeptBlocks):
    """Serve every streamed block from a mapping of its block file (see the module docstring).

    Args:
        source: the block file the model's block tensors view (the NF4 block cache entry), or None.
        spill_dir: where to write a spill file when the blocks are not views of ``source``.
        copy_if_refused: where the device refuses to register the mapping for DMA, serve pinned copies
            of the blocks (what the ``pinned`` tier holds) instead of pageable memory: for a tier the
            planner chose rather than one the user asked for.
    """

    name = "mapped"

    def __init__(self, source: BlockFile | None = None, *, spill_dir: str | os.PathLike | None = None,
                 copy_if_refused: bool = False) -> None:
        self.source, self.spill_dir, self.copy_if_refused = source, spill_dir, copy_if_refused
        self.file: BlockFile | None = None
        self.registered: torch.Tensor | None = None
        self.copies: HostArena | None = None  # pinned copies, when registering was refused
        self.kept: dict[int, torch.Tensor] = {}

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        self.pin_kept = device.type == "cuda"
        if not layouts:  # every block is resident: nothing to serve
            return
        self.file, spilled = source_for(self.source, layouts, self.spill_dir, 1 + max(layouts, default=-1))
        mapping = self.file.shared_mapping()
        self.file.mapping()  # for lend, before a spill file's name goes
        if spilled:
            os.unlink(self.file.path)  # the mappings keep the pages; nothing is left behind
        if device.type == "cuda":
            if register_for_dma(mapping, copy_if_refused=self.copy_if_refused):
                self.registered = mapping
            elif self.copy_if_refused:
                self.copies = HostArena({i: self.file.nbytes[i] for i in sorted(layouts)}, pin=True)
                for index, view in self.copies.views.items():
                    view.copy_(self.file.block_view(index, shared=True))

    def host_buffer(self, index: int) -> torch.Tensor:
        """Block ``index``'s bytes in the shared read-only mapping (or its pinned copy): the store streams from it."""
        if index in self.kept:
            return self.kept[index]
        if self.copies is not None:
            return self.copies.views[index]
        return self.file.block_view(index, shared=True)

    acquire = host_buffer  # every block has its bytes in host memory for the run

    def lend(self, index: int) -> torch.Tensor:
        """Block ``index``'s bytes for a ``state_dict`` / ``load_state_dict`` of the evicted block: the
        copy-on-write mapping, which a load may write (``keep`` then gives the block a buffer of its own)."""
        return self.kept[index] if index in self.kept else self.file.block_view(index)

    def copied(self, index: int, stream: Any) -> None:
        pass

    def close(self) -> None:
        if self.registered is not None:
            host_register.unregister(self.registered.data_ptr())
            self.registered = None
        if self.copies is not None:
            self.copies.release()
            self.copies = None
        self.kept = {}


#: tier name -> its class, in the order of :data:`~poros.config.HOST_TIERS` (tests/test_host_tiers.py
#: holds every one to the :class:`HostTier` contract)
TIER_CLASSES: dict[str, type] = {cls.name: cls for cls in (PinnedTier, MappedTier, DiskTier)}


def make_host_tier(name: str, source: Any = None, *, read_ahead: int = 3,
                   spill_dir: str | os.PathLike | None = None, chosen: bool = False, held: int = 0,
                   pin_memory: bool | None = None) -> HostTier:
    """The host tier called ``name`` (:data:`~poros.config.HOST_TIERS`) for
    :class:`~poros.stream.store.BlockStore`, serving the blocks of ``source`` (the NF4 block cache entry the
    block tensors view; a pre-quantized checkpoint's ``CheckpointShards``, which the ``mapped`` tier serves
    from the mapped shards (``shard_tier.py``) and the disk tier ignores; or None: a file tier then writes a
    spill file into ``spill_dir``). ``chosen``: the
    planner picked the tier (not the user): a ``mapped`` tier the device will not register for DMA then
    serves pinned copies rather than pageable memory. ``read_ahead`` and ``held``: the disk tier's ring
    buffers and blocks kept in RAM (:class:`DiskTier`). ``pin_memory``: the pinned tier's buffers
    (default: page-locked on CUDA).

    Raises:
        StreamingError: an unknown tier name.
    """
    from poros.stream.shard_tier import CheckpointShards, ShardMappedTier  # it builds on this module's pieces

    if name not in TIER_CLASSES:
        raise StreamingError(f"host tier {name!r}: expected one of {', '.join(HOST_TIERS)}.")
    if name == DiskTier.name:
        return DiskTier(source if isinstance(source, BlockFile) else None, depth=read_ahead, spill_dir=spill_dir,
                        held=held)
    if name == MappedTier.name and isinstance(source, CheckpointShards):  # a pre-quantized checkpoint's own shards
        return ShardMappedTier(source, copy_if_refused=chosen)
    if name == MappedTier.name:
        return MappedTier(source, spill_dir=spill_dir, copy_if_refused=chosen)
    return PinnedTier(pin_memory)


__all__ = ["BlockFile", "CHECKSUMS", "DiskTier", "FILE_ALIGN", "HostTier", "MappedTier", "PinnedTier", "TIER_CLASSES",
           "checksum_file", "default_checksum", "make_host_tier", "padded", "release_mapping", "share_host_table",
           "write_block_file"]

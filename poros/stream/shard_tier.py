"""The ``mapped`` host tier for a pre-quantized (``*-bnb-4bit``) checkpoint: the blocks stream from the
checkpoint's own safetensors shards, mapped shared and read-only, so the OS page cache holds one copy per
node (every process that maps them shares the pages) and nothing is copied at the start.

A shard lays a block's tensors out in its own order, without the store's 512-byte alignment, and a
block's tensors may span shards: a block's bytes are no one region of a file. So the tier hands the store
:class:`Pieces` -- ``(offset in the block's layout, bytes)`` per tensor -- and the store copies them into
the slot tensor by tensor. Each piece is a tensor of the checkpoint whose bytes :class:`ShardMappedTier`
found equal to the loaded module tensor's at attach (so the streamed bytes are the pinned tier's, bit
for bit); a tensor with no such twin in the file (a double-quantized weight's nested ``offset``, a number
in the JSON quant state; a tensor loaded in another dtype) is served from a small pinned copy beside them.

On CUDA each shard's mapping is registered read-only for DMA (``cudaHostRegister``), so the copies run as
from pinned memory; where the device refuses, pinned copies of the blocks (the planner chose the tier)
or pageable copies (the user asked for it), as :class:`~poros.stream.tiers.MappedTier` does.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from poros.stream import host_register
from poros.stream.packing import Entry, Layout
from poros.stream.block_file import HostArena, KeptBlocks, register_for_dma
from poros.stream.private_pages import drop_pages, private_mappings

#: a quantized weight's tensors as the store's layout names them (``X.weight.quant_state.*``) and as
#: ``save_pretrained`` names them in a bnb-4bit checkpoint (``X.weight.*``)
QUANT_STATE_KEYS = {".quant_state.absmax": ".absmax", ".quant_state.code": ".quant_map",
                    ".quant_state.state2.absmax": ".nested_absmax", ".quant_state.state2.code": ".nested_quant_map"}


@dataclass(frozen=True)
class CheckpointShards:
    """A pre-quantized checkpoint's safetensors shards and where its decoder blocks' keys start.

    Attributes:
        files: the ``*.safetensors`` shards.
        prefix: the blocks' key prefix, e.g. ``"model.layers."`` (block i's keys start ``prefix + "i."``).
    """

    files: tuple[Path, ...]
    prefix: str

    def tensors(self) -> dict[str, tuple[Path, int, int]]:
        """Every tensor of the shards: key -> (file, byte offset in the file, bytes), from the headers alone."""
        found = {}
        for file in self.files:
            with open(file, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for key, meta in header.items():
                if key != "__metadata__":
                    begin, end = meta["data_offsets"]
                    found[key] = (Path(file), 8 + length + begin, end - begin)
        return found


def checkpoint_key(entry_name: str) -> str:
    """The checkpoint key (within the block) of a layout entry: PEFT's ``base_layer.`` dropped, a quant
    state's tensors under their saved names (``X.weight.quant_state.absmax`` -> ``X.weight.absmax``)."""
    name = entry_name.replace("base_layer.", "")
    for ours, theirs in QUANT_STATE_KEYS.items():
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


@dataclass
class Pieces:
    """A block's bytes in pieces: ``(offset in the block's layout, uint8 bytes)`` each, ``nbytes`` in all."""

    nbytes: int
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def copy_into(self, target: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy every piece to its offset in ``target`` (a slot, or a host buffer)."""
        for offset, piece in self.parts:
            target[offset: offset + piece.numel()].copy_(piece, non_blocking=non_blocking)

    def assemble(self, pin: bool = False) -> torch.Tensor:
        """The block's bytes in one buffer of their own (the padding between tensors zero)."""
        buffer = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.copy_into(buffer)
        return buffer


def copy_block(target: torch.Tensor, source: Any, non_blocking: bool = False) -> None:
    """Copy a host tier's bytes of a block into ``target``: one copy of a buffer, or :class:`Pieces` one by one."""
    if isinstance(source, Pieces):
        source.copy_into(target, non_blocking)
    else:
        target.copy_(source, non_blocking=non_blocking)


def whole(source: Any) -> torch.Tensor:
    """A host tier's bytes of a block as one buffer (:class:`Pieces` assembled)."""
    return source.assemble() if isinstance(source, Pieces) else source


def _contiguous(entry: Entry) -> bool:
    expected, stride = 1, []
    for size in reversed(entry.shape):
        stride.insert(0, expected)
        expected *= size
    return entry.span == expected and all(s == e for s, e, size in zip(entry.stride, stride, entry.shape) if size > 1)


def rest_on_twin(entry: Entry, tensor: torch.Tensor, twin: torch.Tensor, private: list[tuple[int, int]] = ()) -> int:
    """Point a loaded block tensor at its twin in the mapped shard (equal bytes, checked by the caller), so
    its own host copy is freed now; the bytes freed (0 where it shares a storage or the twin is not aligned
    for its dtype: it stays as loaded). Where the loaded copy was a view of the loader's private mapping of
    the shard (``private``: :func:`~poros.stream.private_pages.private_mappings`), its pages there are dropped
    (:mod:`poros.stream.private_pages`).

    The loaded tensors are the loader's view of the shards (or a copy), and checking them against the tier's
    mapping pages both in: without this, the host peak at the start counts the blocks twice until the store
    binds them (the H200 record is in docs/results-h200-log.md). Tensor by tensor, it stays at one copy. The model stays
    whole meanwhile (a failure before the store binds leaves it readable); the twin is read-only, as the
    frozen blocks are."""
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if (not nbytes or storage.nbytes() != nbytes or tensor.storage_offset() or not tensor.is_contiguous()
            or storage.data_ptr() == twin.data_ptr()):
        return 0
    try:
        resting = twin.view(tensor.dtype).view(tensor.shape)
    except RuntimeError:  # the shard's offset is not a multiple of the dtype's size
        return 0
    pointer = storage.data_ptr()
    tensor.data = resting  # the layout's own reference (a parameter's is an alias: ``param.data``)
    if entry.kind == "param":
        entry.owner.data = resting
    drop_pages(pointer, nbytes, private)
    return nbytes


class ShardMappedTier(KeptBlocks):
    """Serve every streamed block from the mapped shards of a pre-quantized checkpoint (module docstring).

    Args:
        shards: the checkpoint's shards and block prefix.
        copy_if_refused: as for :class:`~poros.stream.tiers.MappedTier`.
    """

    name = "mapped"

    def __init__(self, shards: CheckpointShards, *, copy_if_refused: bool = False) -> None:
        self.shards, self.copy_if_refused = shards, copy_if_refused
        self.pieces: dict[int, Pieces] = {}
        self.mappings: dict[Path, torch.Tensor] = {}  # each shard, mapped shared read-only
        self.registered: list[torch.Tensor] = []
        self.copies: HostArena | None = None  # pinned copies of the blocks, when registering was refused
        self.kept: dict[int, torch.Tensor] = {}
        #: tensors served from the mapped shards, and from small pinned copies (no twin in the file)
        #: (``handed_over_bytes``: loaded tensors now resting on their twin in the mapping, :func:`rest_on_twin`)
        self.stats = {"mapped_tensors": 0, "mapped_bytes": 0, "pinned_tensors": 0, "pinned_bytes": 0,
                      "handed_over_bytes": 0}

    def _mapping(self, path: Path) -> torch.Tensor:
        if path not in self.mappings:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self.mappings[path] = torch.frombuffer(mapped, dtype=torch.uint8)
        return self.mappings[path]

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        self.pin_kept = pin = device.type == "cuda"
        if not layouts:
            return
        found = self.shards.tensors()
        private = private_mappings(list(self.shards.files))  # the loader's own view of the shards
        for index, (entries, tensors, nbytes) in layouts.items():
            pieces = Pieces(nbytes)
            for entry, tensor in zip(entries, tensors):
                loaded = tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else None
                where = found.get(f"{self.shards.prefix}{index}.{checkpoint_key(entry.name)}")
                piece = None
                if loaded is not None and where is not None and where[2] == entry.nbytes and _contiguous(entry):
                    path, offset, size = where
                    piece = self._mapping(path)[offset: offset + size]
                    if not torch.equal(piece, loaded):  # loaded in another dtype, or another tensor of that name
                        piece = None
                if piece is not None:
                    self.stats["mapped_tensors"] += 1
                    self.stats["mapped_bytes"] += entry.nbytes
                    self.stats["handed_over_bytes"] += rest_on_twin(entry, tensor, piece, private)
                elif loaded is not None:  # the loaded tensor itself, laid out as the slot holds it
                    piece = torch.zeros(entry.nbytes, dtype=torch.uint8, pin_memory=pin)
                    piece.view(entry.dtype).as_strided(entry.shape, entry.stride).copy_(tensor)
                    self.stats["pinned_tensors"] += 1
                    self.stats["pinned_bytes"] += entry.nbytes
                if piece is not None:
                    pieces.parts.append((entry.offset, piece))
            self.pieces[index] = pieces
        if device.type == "cuda":
            refused = False
            for mapping in self.mappings.values():
                if register_for_dma(mapping, copy_if_refused=self.copy_if_refused):
                    self.registered.append(mapping)
                else:
                    refused = True
            if refused and self.copy_if_refused:
                self.copies = HostArena({i: p.nbytes for i, p in self.pieces.items()}, pin=True)
                for index, view in self.copies.views.items():
                    self.pieces[index].copy_into(view)

    def host_buffer(self, index: int) -> torch.Tensor | None:
        """A kept (or, where registering was refused, copied) block's own buffer; None for the others: their
        bytes are :class:`Pieces` of the mapped shards (:meth:`acquire`)."""
        if index in self.kept:
            return self.kept[index]
        return self.copies.views[index] if self.copies is not None else None

    def acquire(self, index: int) -> torch.Tensor | Pieces:
        own = self.host_buffer(index)
        return own if own is not None else self.pieces[index]

    def lend(self, index: int) -> torch.Tensor:
        """Block ``index``'s bytes, writable, for a ``state_dict`` / ``load_state_dict`` of the evicted block: a
        copy of its own (the shards are never written); ``keep`` serves a load's bytes from then on."""
        own = self.host_buffer(index)
        return own if own is not None else self.pieces[index].assemble()

    def copied(self, index: int, stream: Any) -> None:
        pass

    def close(self) -> None:
        for mapping in self.registered:
            host_register.unregister(mapping.data_ptr())
        self.registered = []
        if self.copies is not None:
            self.copies.release()
            self.copies = None
        self.pieces, self.kept, self.mappings = {}, {}, {}


def prequantized_shards(files: list[Path], prefix: str) -> CheckpointShards | None:
    """The shards a pre-quantized checkpoint's blocks can stream from, or None (not safetensors)."""
    files = [Path(f) for f in files]
    if not files or any(f.suffix != ".safetensors" for f in files):
        return None
    return CheckpointShards(tuple(files), prefix)


__all__ = ["CheckpointShards", "Pieces", "ShardMappedTier", "checkpoint_key", "copy_block", "prequantized_shards", "rest_on_twin",
           "whole"]

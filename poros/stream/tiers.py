"""Host tiers: where the streamed blocks' bytes live on the host. :class:`HostTier` is the contract the
block store (``store.py``) calls; :data:`~poros.config.HOST_TIERS` names the three tiers, one class each
(:data:`TIER_CLASSES`), and the executor does not change with the tier (it asks the store for block i
and waits).

Each block's frozen tensors pack into one buffer (``packing.py``). A *block file* holds those buffers
back to back, each at a 4 KiB-aligned offset, exactly the bytes the store streams.

* :class:`PinnedTier` -- one buffer per streamed block, page-locked on CUDA: the whole NF4 base in this
  process's RAM. A ``load_state_dict`` into an evicted block writes into its buffer.
* :class:`MappedTier` -- the file mapped shared and read-only: the OS page cache holds one copy that
  every process of the node maps and shares. On CUDA the mapping is registered for DMA
  (``cudaHostRegister``, read-only), so copies run as from pinned memory. Each block's host buffer
  is a view of that mapping.
* :class:`DiskTier` -- for host RAM smaller than the model: no host buffer per block; a reader
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
(:func:`share_host_table`): a file beside the cache entry holds each table's bytes, and every rank's
table is a copy-on-write mapping of it, the page cache's pages until something writes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
import warnings
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from poros.config import HOST_TIERS
from poros.errors import StreamingError
from poros.stream.packing import Layout, entry_view

FILE_ALIGN = 4096  # every block starts on a 4 KiB boundary of the file (O_DIRECT, page mapping)
READ_CHUNK = 1 << 30  # bytes per read call (Linux caps one read near 2 GiB)
CHECK_CHUNK = 64 << 20  # bytes per read of an entry's check, into each thread's own buffer
CUDA_HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: pin a mapping without write access
#: (path, inode, size, mtime, kind) -> this process's one mapping of that kind ("private", "shared")
_MAPPINGS: dict[tuple[str, int, int, int, str], torch.Tensor] = {}


def padded(nbytes: int) -> int:
    return -(-nbytes // FILE_ALIGN) * FILE_ALIGN


@dataclass
class BlockFile:
    """A file of packed block buffers: block i's ``nbytes[i]`` bytes at ``offsets[i]`` (4 KiB aligned).

    Blocks not in the file (resident ones) have ``offsets[i] = -1``.
    """

    path: Path
    offsets: list[int]
    nbytes: list[int]
    checksums: list[int] = field(default_factory=list)  # of each block's padded region, by ``algorithm``
    mapped: torch.Tensor | None = field(default=None, repr=False, compare=False)  # set by mapping()

    @property
    def size(self) -> int:
        return max((o + padded(n) for o, n in zip(self.offsets, self.nbytes) if o >= 0), default=0)

    shared: torch.Tensor | None = field(default=None, repr=False, compare=False)  # set by shared_mapping()
    algorithm: str = "crc32"  # how ``checksums`` were computed (:data:`CHECKSUMS`)

    def mapping(self) -> torch.Tensor:
        """The whole file as a uint8 CPU tensor, mapped copy-on-write (writable; the file is never
        written): one mapping per process and file. Module tensors loaded from the cache view it."""
        if self.mapped is None:
            self.mapped = self._map("private")
        return self.mapped

    def shared_mapping(self) -> torch.Tensor:
        """The whole file mapped shared and read-only (writing to it would fault): what the mapped tier
        streams from and registers for DMA, the page cache's own pages in every process."""
        if self.shared is None:
            self.shared = self._map("shared")
        return self.shared

    def _map(self, kind: str) -> torch.Tensor:
        stat = os.stat(self.path)
        key = (str(self.path), stat.st_ino, stat.st_size, stat.st_mtime_ns, kind)
        if key not in _MAPPINGS:
            with open(self.path, "rb") as handle:
                if kind == "shared":
                    mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                else:
                    mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                _MAPPINGS[key] = torch.frombuffer(mapped, dtype=torch.uint8)
        return _MAPPINGS[key]

    def block_view(self, index: int, *, shared: bool = False) -> torch.Tensor:
        """Block ``index``'s bytes: a view of :meth:`mapping`, or of :meth:`shared_mapping`."""
        offset = self.offsets[index]
        if offset < 0:
            raise StreamingError(f"block {index} is not in {self.path}; the file holds blocks "
                                 f"{[i for i, o in enumerate(self.offsets) if o >= 0]}.")
        whole = self.shared_mapping() if shared else self.mapping()
        return whole[offset: offset + self.nbytes[index]]

    def holds(self, index: int, layout: Layout) -> bool:
        """Whether the module tensors of block ``index`` are views of this file at the layout's offsets."""
        entries, tensors, nbytes = layout
        if index >= len(self.offsets) or self.offsets[index] < 0 or self.nbytes[index] != nbytes:
            return False
        base = self.mapping().data_ptr() + self.offsets[index]
        return all(t.device.type == "cpu" and t.data_ptr() == base + e.offset for e, t in zip(entries, tensors))


def release_mapping(path: Path) -> None:
    """Forget this process's mapping of ``path`` (module tensors that view it keep it alive)."""
    for key in [k for k in _MAPPINGS if k[0] == str(path)]:
        del _MAPPINGS[key]


def _xxh3_update(data, state):
    """A running xxh3_64 (``state`` None starts one): several times zlib's crc32 a core (docs/cache-and-host-memory.md)."""
    import xxhash

    state = xxhash.xxh3_64() if state is None else state
    state.update(data)
    return state


def _xxh3_final(state) -> int:
    import xxhash

    return (xxhash.xxh3_64() if state is None else state).intdigest()


#: checksum name -> (update(data, state) -> state, starting from None; final(state) -> int).
#: Entries record theirs: xxh3_64, or crc32 where the xxhash package is missing (:func:`default_checksum`).
CHECKSUMS = {
    "xxh3_64": (_xxh3_update, _xxh3_final),
    "crc32": (lambda data, state: zlib.crc32(data, 0 if state is None else state),
              lambda state: 0 if state is None else state),
}


def default_checksum() -> str:
    """``xxh3_64`` where the ``xxhash`` package is installed (``poros-train[train]`` brings it), else ``crc32``."""
    import importlib.util

    return "xxh3_64" if importlib.util.find_spec("xxhash") else "crc32"


def write_block_file(path: Path, layouts: dict[int, Layout],
                     count: int, *, algorithm: str | None = None) -> BlockFile:
    """Pack the blocks of ``layouts`` (``{index: (entries, tensors, nbytes)}``) into ``path``, 4 KiB aligned,
    and return its :class:`BlockFile` with a checksum (``algorithm``, default :func:`default_checksum`)
    per padded block region."""
    algorithm = algorithm or default_checksum()
    update, final = CHECKSUMS[algorithm]
    offsets, sizes, checksums = [-1] * count, [0] * count, [0] * count
    largest = max((padded(layout[2]) for layout in layouts.values()), default=0)
    staging = torch.zeros(largest, dtype=torch.uint8)
    position = 0
    with open(path, "wb") as handle:
        for index in sorted(layouts):
            entries, tensors, nbytes = layouts[index]
            region = staging[: padded(nbytes)]
            region.zero_()
            for entry, tensor in zip(entries, tensors):
                entry_view(region, entry).copy_(tensor)
            data = region.numpy()
            handle.write(memoryview(data))
            offsets[index], sizes[index], checksums[index] = position, nbytes, final(update(data, None))
            position += padded(nbytes)
    return BlockFile(Path(path), offsets, sizes, checksums, algorithm=algorithm)


def _source_for(source: BlockFile | None, layouts: dict, spill_dir: Path | None, count: int) -> tuple[BlockFile, bool]:
    """The block file to serve ``layouts`` from: ``source`` when the block tensors are its views, else a
    spill file written now. Returns ``(file, spilled)``."""
    if source is not None and all(source.holds(i, layout) for i, layout in layouts.items()):
        return source, False
    directory = Path(spill_dir) if spill_dir is not None else Path(os.environ.get("TMPDIR", "/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    return write_block_file(directory / f"spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin", layouts, count), True


def _register_for_dma(mapping: torch.Tensor, *, copy_if_refused: bool = False) -> bool:
    """``cudaHostRegister`` the shared read-only mapping read-only (page-locked for DMA, still the page
    cache's pages, so other processes share them). Where the device refuses, say so: copies then run
    from pageable memory (the same bytes, slower), or from pinned copies with ``copy_if_refused``."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(mapping.data_ptr(), mapping.numel(), CUDA_HOST_REGISTER_READ_ONLY)
    if int(error) == 0:
        return True
    warnings.warn(f"poros: the device refused to register the mapped block file read-only ({error}); " + (
        "the blocks are copied into pinned memory instead, as the pinned tier does (same bytes; each process of "
        "the node then holds its own copy)." if copy_if_refused
        else "copies run from pageable memory (slower, same bytes). The pinned host tier avoids it."), stacklevel=3)
    return False


class _HostArena:
    """One host buffer holding several blocks (each at a 4 KiB-aligned offset), page-locked on CUDA by
    registering it: torch's pinned allocator rounds every allocation up to a power of two (512 MiB for a
    0.46 GB 72B block, 2 GiB for a 1.4 GB ring), which a host budget cannot afford. Where the device
    refuses the registration, torch's pinned allocator it is."""

    def __init__(self, sizes: dict[int, int], pin: bool) -> None:
        total = sum(padded(n) for n in sizes.values())
        self.registered = False
        raw = torch.empty(total + FILE_ALIGN, dtype=torch.uint8)
        if pin and total:
            cudart = torch.cuda.cudart()
            self.registered = int(cudart.cudaHostRegister(raw.data_ptr(), raw.numel(), 0)) == 0
            if not self.registered:
                raw = torch.empty(total + FILE_ALIGN, dtype=torch.uint8, pin_memory=True)
        self.raw = raw
        start, self.views = -raw.data_ptr() % FILE_ALIGN, {}
        for index, nbytes in sizes.items():
            self.views[index] = raw[start: start + nbytes]
            start += padded(nbytes)

    def release(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.raw.data_ptr())
            self.registered = False
        self.views, self.raw = {}, None


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
    copy of the whole NF4 base; the store's default."""

    name = "pinned"

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = pin_memory
        self.buffers: dict[int, torch.Tensor] = {}

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        pin = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        for index, (entries, tensors, nbytes) in layouts.items():
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
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


class _KeptBlocks:
    """What a file tier serves instead of its file for the blocks a ``load_state_dict`` rewrote (``keep``):
    pinned buffers of their own (the file is never written)."""

    kept: dict[int, torch.Tensor]
    pin_kept = False  # set at attach: page-locked on CUDA

    def keep(self, index: int, data: torch.Tensor) -> None:
        if self.kept.get(index) is not data:  # a load into a block kept already wrote its own buffer
            buffer = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=self.pin_kept)
            self.kept[index] = buffer.copy_(data)


class MappedTier(_KeptBlocks):
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
        self.copies: _HostArena | None = None  # pinned copies, when registering was refused
        self.kept: dict[int, torch.Tensor] = {}

    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        self.pin_kept = device.type == "cuda"
        if not layouts:  # every block is resident: nothing to serve
            return
        self.file, spilled = _source_for(self.source, layouts, self.spill_dir, 1 + max(layouts, default=-1))
        mapping = self.file.shared_mapping()
        self.file.mapping()  # for lend, before a spill file's name goes
        if spilled:
            os.unlink(self.file.path)  # the mappings keep the pages; nothing is left behind
        if device.type == "cuda":
            if _register_for_dma(mapping, copy_if_refused=self.copy_if_refused):
                self.registered = mapping
            elif self.copy_if_refused:
                self.copies = _HostArena({i: self.file.nbytes[i] for i in sorted(layouts)}, pin=True)
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
            torch.cuda.cudart().cudaHostUnregister(self.registered.data_ptr())
            self.registered = None
        if self.copies is not None:
            self.copies.release()
            self.copies = None
        self.kept = {}


@dataclass
class _Staged:
    index: int
    ring: int
    read: Future


class DiskTier(_KeptBlocks):
    """Read the streamed blocks from their block file into a ring of ``depth`` pinned buffers ahead of use.

    Args:
        source: as for :class:`MappedTier`.
        depth: ring buffers (>= 2): one being copied to the device, ``depth - 1`` read ahead.
        pin_memory: pin the ring (default: when the device is CUDA).
        spill_dir: as for :class:`MappedTier`.
        direct: try ``O_DIRECT`` reads (bypass the page cache); falls back to buffered reads.
        held: keep the first ``held`` streamed blocks in pinned buffers of their own for the run (read
            once, at attach): a pass then reads only the others. Held at the bottom, they are what the
            executor runs between one backward's last ring block and the next forward's first, so the
            reader fills the ring while they compute, and the predicted order is unchanged.
    """

    name = "disk"

    def __init__(self, source: BlockFile | None = None, *, depth: int = 3, pin_memory: bool | None = None,
                 spill_dir: str | os.PathLike | None = None, direct: bool = True, held: int = 0) -> None:
        if depth < 2:
            raise StreamingError(f"read-ahead depth {depth}: the disk tier needs at least 2 ring buffers (one "
                                 "copying, one reading). Pass depth >= 2.")
        if held < 0:
            raise StreamingError(f"held={held}: the number of blocks kept in RAM cannot be negative.")
        self.source, self.depth, self.pin_memory, self.spill_dir = source, depth, pin_memory, spill_dir
        self.direct, self.held_count = direct, held
        self.held: _HostArena | None = None  # the held blocks' pinned buffers, for the run
        self.kept: dict[int, torch.Tensor] = {}
        # counters for tests and benchmarks: read_seconds is the reader thread's time inside reads
        self.stats = {"reads": 0, "bytes_read": 0, "read_seconds": 0.0, "misses": 0, "direct": False,
                      "held_blocks": 0, "held_bytes": 0}
        self._lock = threading.Lock()

    # -- setup -----------------------------------------------------------------------------
    def attach(self, layouts: dict[int, Layout], device: torch.device) -> None:
        self.reader, self.ahead, self.fd, self.direct_fd, self._arena = None, deque(), None, None, None
        self.lent_mapping: torch.Tensor | None = None  # see lend()
        self.pin_kept = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        if not layouts:  # every block is resident: nothing to read
            return
        self.file, spilled = _source_for(self.source, layouts, self.spill_dir, 1 + max(layouts, default=-1))
        self.order = sorted(layouts)  # the streamed blocks, in forward order
        self.fd = os.open(self.file.path, os.O_RDONLY)
        self.direct_fd = None
        if self.direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(self.file.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # tmpfs and some file systems refuse O_DIRECT
                self.direct_fd = None
        if spilled:
            os.unlink(self.file.path)  # open descriptors keep it; nothing is left behind
        release_mapping(self.file.path)  # blocks come from reads now, not from a mapping
        self.file.mapped = self.file.shared = None
        pin = device.type == "cuda" if self.pin_memory is None else self.pin_memory
        held = self.order[: min(self.held_count, len(self.order) - 1)]  # at least one block streams
        self.order = self.order[len(held):]  # the ring's blocks, in forward order
        size = max((padded(n) for i, n in enumerate(self.file.nbytes) if i in layouts), default=FILE_ALIGN)
        # One allocation, each buffer on a 4 KiB boundary (O_DIRECT needs aligned addresses), of the size
        # the budget gave (registered, not rounded up to a power of two by torch's pinned allocator).
        self._arena = _HostArena(dict.fromkeys(range(self.depth), size), pin)
        self.ring = [self._arena.views[k] for k in range(self.depth)]
        self.copy_done: list[Any] = [None] * self.depth  # CUDA event of the copy that last read ring k
        self.next_ring = 0
        self.ahead: deque[_Staged] = deque()
        self.current: _Staged | None = None
        self.direction = 1
        self.held = _HostArena({i: self.file.nbytes[i] for i in held}, pin) if held else None
        for index in held:  # read once, through the ring's first buffer (aligned for O_DIRECT)
            self._read(index, 0)
            self.held.views[index].copy_(self.ring[0][: self.file.nbytes[index]])
        self.stats.update(held_blocks=len(held), held_bytes=sum(self.file.nbytes[i] for i in held),
                          reads=0, bytes_read=0, read_seconds=0.0)  # the counters are the ring's
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poros-disk-tier")
        for index in self.order[: self.depth - 1]:  # the first forward's blocks, read while the run starts
            self.ahead.append(self._stage(index))

    def host_buffer(self, index: int) -> torch.Tensor | None:
        """A held (or kept) block's pinned buffer (the store streams from it as from the pinned tier's); None
        for the others: acquire() reads them ahead into the ring."""
        if index in self.kept:
            return self.kept[index]
        return None if self.held is None else self.held.views.get(index)

    def lend(self, index: int) -> torch.Tensor:
        """Block ``index``'s bytes for a ``state_dict`` / ``load_state_dict`` of the evicted block: a view of a
        copy-on-write mapping of the file (made on first use), so a save pages in only what it reads, the
        ring and its read-ahead are left alone, and a write never reaches the file."""
        if index in self.kept:
            return self.kept[index]
        if self.lent_mapping is None:
            mapped = mmap.mmap(self.fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.lent_mapping = torch.frombuffer(mapped, dtype=torch.uint8)
        offset = self.file.offsets[index]
        return self.lent_mapping[offset: offset + self.file.nbytes[index]]

    # -- the ring --------------------------------------------------------------------------
    def _read(self, index: int, ring: int) -> None:
        event = self.copy_done[ring]
        if event is not None:
            event.synchronize()  # the copy that last read this ring buffer is done
        buffer = self.ring[ring][: padded(self.file.nbytes[index])].numpy()
        offset, done, start = self.file.offsets[index], 0, time.perf_counter()
        fd = self.direct_fd if self.direct_fd is not None else self.fd
        while done < len(buffer):
            try:
                count = os.preadv(fd, [memoryview(buffer)[done: done + READ_CHUNK]], offset + done)
            except OSError:
                if fd == self.fd:
                    raise
                fd = self.fd  # O_DIRECT refused this buffer or offset: buffered reads from here on
                self.direct_fd = None
                continue
            if count == 0:
                raise StreamingError(f"{self.file.path} ended at byte {offset + done}; block {index} needs "
                                     f"{offset + len(buffer)}. The block file was truncated: delete it (poros "
                                     "cache clear) and load again.")
            done += count
        with self._lock:
            self.stats["read_seconds"] += time.perf_counter() - start
            self.stats["reads"] += 1
            self.stats["bytes_read"] += len(buffer)
            self.stats["direct"] = self.stats["direct"] or fd == self.direct_fd

    def _stage(self, index: int) -> _Staged:
        ring = self.next_ring
        self.next_ring = (ring + 1) % self.depth
        return _Staged(index, ring, self.reader.submit(self._read, index, ring))

    def _predict(self, index: int, count: int) -> list[int]:
        """The next ``count`` blocks after ``index`` in the executor's order: forward runs up and keeps
        its last block for backward (which goes on with the one below it); backward runs down, and the
        next forward fetches the first block again."""
        position, direction, out = self.order.index(index), self.direction, []
        while len(out) < count:
            following = position + direction
            if following >= len(self.order):
                direction, following = -1, max(position - 1, 0)
            elif following < 0:
                direction, following = 1, position
            position = following
            out.append(self.order[position])
        return out

    def acquire(self, index: int) -> torch.Tensor:
        """The ring buffer holding block ``index``'s bytes (waits for its read); a held or kept block's own buffer."""
        own = self.host_buffer(index)
        if own is not None:
            return own
        while self.ahead and self.ahead[0].index != index and any(s.index == index for s in self.ahead):
            self.ahead.popleft().read.result()  # read ahead for nothing: the pass skipped it
        if self.ahead and self.ahead[0].index == index:
            staged = self.ahead.popleft()
        else:
            for stale in self.ahead:
                stale.read.result()
            self.ahead.clear()
            self.stats["misses"] += 1
            staged = self._stage(index)
        staged.read.result()
        if self.current is not None:
            step = self.order.index(index) - self.order.index(self.current.index)
            self.direction = 1 if step > 0 else -1 if step < 0 else 1  # the same block again: forward starts
        self.current = staged
        # keep depth - 1 reads ahead; a ring buffer is rewritten only after its copy (copy_done)
        have = [s.index for s in self.ahead]
        for following in self._predict(index, self.depth - 1)[len(have):]:
            self.ahead.append(self._stage(following))
        return self.ring[staged.ring][: self.file.nbytes[index]]

    def copied(self, index: int, stream: Any) -> None:
        """The copy out of block ``index``'s ring buffer is queued on ``stream`` (None: done already)."""
        if self.current is None or self.current.index != index or self.host_buffer(index) is not None:
            return
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            self.copy_done[self.current.ring] = event

    def close(self) -> None:
        for staged in self.ahead:
            staged.read.result()
        self.ahead.clear()
        if self.reader is not None:
            self.reader.shutdown(wait=True)
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None
        if self.held is not None:  # the store's blocks are back on their modules: nothing streams from it
            self.held.release()
            self.held = None
        if self._arena is not None:
            self._arena.release()
        self.ring, self._arena, self.kept = [], None, {}


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


def share_host_table(tensor: torch.Tensor, path: Path) -> torch.Tensor | None:
    """``tensor``'s values as a copy-on-write mapping of the file ``path`` — the same page-cache pages in
    every process that maps it, until one writes — or None (the caller keeps ``tensor``) with a warning
    when that cannot be had. Under an exclusive ``flock`` on ``<path>.lock`` the first process
    writes the file aside, read-only, and renames it into place (a name that exists is whole), and
    sweeps the aside copies of processes killed while writing; the others wait, then map it. Every
    process checks the mapped bytes against its own ``tensor`` before using them: a file of other bytes
    or size is removed (the next run writes it again) and never used."""
    import fcntl  # (poros.loading.cache.build_lock is the same lock, but the engine does not import the drop-in layer)

    data = tensor.detach().contiguous()
    if data.device.type != "cpu" or not data.numel():
        return None
    raw = data.view(torch.uint8).reshape(-1)
    path = Path(path)
    try:
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not path.exists():
                for stale in path.parent.glob(f".{path.name}.*.tmp"):
                    stale.unlink(missing_ok=True)  # a writer killed before its rename: nobody else writes now
                aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                with open(aside, "wb") as handle:
                    handle.write(memoryview(raw.numpy()))
                    handle.flush()
                    os.fsync(handle.fileno())
                os.chmod(aside, 0o444)  # nothing writes the file in place: the mappings read it again
                os.replace(aside, path)
        with open(path, "rb") as handle:
            same = os.fstat(handle.fileno()).st_size == raw.numel()
            mapped = mmap.mmap(handle.fileno(), 0, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE) if same else None
        view = torch.frombuffer(mapped, dtype=torch.uint8) if mapped is not None else None
        if view is None or not torch.equal(view, raw):
            path.unlink(missing_ok=True)  # the next run writes it again
            raise OSError(f"{path} does not hold this table's {raw.numel()} bytes")
    except OSError as error:
        warnings.warn(f"poros: the host embedding table stays a private copy in this process ({error}).",
                      stacklevel=2)
        return None
    return view.view(data.dtype).view(data.shape)


def checksum_file(file: BlockFile, *, workers: int = 4, stop: threading.Event | None = None) -> list[int]:
    """The checksum (``file.algorithm``) of each block's padded region, read with ``workers`` threads
    (xxhash and zlib let go of the GIL), each into one buffer of its own (no fresh pages per read).
    Once ``stop`` is set, the blocks not finished get -1 (no checksum matches it)."""
    update, final = CHECKSUMS[file.algorithm]
    buffers = threading.local()

    def one(index: int) -> int:
        if not hasattr(buffers, "chunk"):
            buffers.chunk = memoryview(bytearray(CHECK_CHUNK))
        state, offset, end = None, file.offsets[index], file.offsets[index] + padded(file.nbytes[index])
        with open(file.path, "rb", buffering=0) as handle:
            handle.seek(offset)
            while offset < end:
                if stop is not None and stop.is_set():
                    return -1
                got = handle.readinto(buffers.chunk[: min(CHECK_CHUNK, end - offset)])
                if not got:
                    break
                state, offset = update(buffers.chunk[:got], state), offset + got
        return final(state) if offset == end else -1
    indices = [i for i, o in enumerate(file.offsets) if o >= 0]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        found = dict(zip(indices, pool.map(one, indices)))
    return [found.get(i, 0) for i in range(len(file.offsets))]


__all__ = ["BlockFile", "CHECKSUMS", "DiskTier", "FILE_ALIGN", "HostTier", "MappedTier", "PinnedTier", "TIER_CLASSES",
           "checksum_file", "make_host_tier", "padded", "release_mapping", "share_host_table", "write_block_file"]

"""The block file under the file host tiers, and the host memory they serve from.

A *block file* (:class:`BlockFile`) holds the packed block buffers (``packing.py``) back to back, each
at a 4 KiB-aligned offset, exactly the bytes the store streams: written by :func:`write_block_file`
(a spill file, or the NF4 block cache's entry), mapped once per process and kind (copy-on-write for the
module tensors, shared read-only for the mapped tier), checked block by block (:data:`CHECKSUMS`,
:func:`checksum_file`). Beside it, what the file tiers (``tiers.py``, ``disk_tier.py``) share: the file
to serve a model's blocks from (:func:`source_for`: the cache entry they view, or a spill file),
registering a mapping for DMA (:func:`register_for_dma`), one page-locked arena for several blocks
(:class:`HostArena`), the blocks a ``load_state_dict`` rewrote (:class:`KeptBlocks`), and the node's
shared host embedding tables (:func:`share_host_table`).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from poros.errors import StreamingError
from poros.stream import host_register
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


def source_for(source: BlockFile | None, layouts: dict, spill_dir: Path | None, count: int) -> tuple[BlockFile, bool]:
    """The block file to serve ``layouts`` from: ``source`` when the block tensors are its views, else a
    spill file written now. Returns ``(file, spilled)``."""
    if source is not None and all(source.holds(i, layout) for i, layout in layouts.items()):
        return source, False
    directory = Path(spill_dir) if spill_dir is not None else Path(os.environ.get("TMPDIR", "/tmp"))
    directory.mkdir(parents=True, exist_ok=True)
    return write_block_file(directory / f"spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin", layouts, count), True


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


def register_for_dma(mapping: torch.Tensor, *, copy_if_refused: bool = False) -> bool:
    """``cudaHostRegister`` the shared read-only mapping read-only (page-locked for DMA, still the page
    cache's pages, so other processes share them). Where the device refuses, say so: copies then run
    from pageable memory (the same bytes, slower), or from pinned copies with ``copy_if_refused``."""
    error = host_register.register(mapping.data_ptr(), mapping.numel(), CUDA_HOST_REGISTER_READ_ONLY)
    if error == 0:
        return True
    warnings.warn(f"poros: the device refused to register the mapped block file read-only ({error}); " + (
        "the blocks are copied into pinned memory instead, as the pinned tier does (same bytes; each process of "
        "the node then holds its own copy)." if copy_if_refused
        else "copies run from pageable memory (slower, same bytes). The pinned host tier avoids it."), stacklevel=3)
    return False


class HostArena:
    """One host buffer holding several blocks (each at a 4 KiB-aligned offset), page-locked on CUDA by
    registering it: torch's pinned allocator rounds every allocation up to a power of two (512 MiB for a
    0.46 GB 72B block, 2 GiB for a 1.4 GB ring), which a host budget cannot afford. Where the device
    refuses the registration, torch's pinned allocator it is (with ``fallback_pinned=False`` the arena stays
    pageable and unregistered: the caller pins its own way)."""

    def __init__(self, sizes: dict[int, int], pin: bool, *, fallback_pinned: bool = True) -> None:
        total = sum(padded(n) for n in sizes.values())
        self.registered = False
        raw = torch.empty(total + FILE_ALIGN, dtype=torch.uint8)
        if pin and total:
            self.registered = host_register.register(raw.data_ptr(), raw.numel()) == 0
            if not self.registered and fallback_pinned:
                raw = torch.empty(total + FILE_ALIGN, dtype=torch.uint8, pin_memory=True)
        self.raw = raw
        start, self.views = -raw.data_ptr() % FILE_ALIGN, {}
        for index, nbytes in sizes.items():
            self.views[index] = raw[start: start + nbytes]
            start += padded(nbytes)

    def release(self) -> None:
        if self.registered:
            host_register.unregister(self.raw.data_ptr())
            self.registered = False
        self.views, self.raw = {}, None


class KeptBlocks:
    """What a file tier serves instead of its file for the blocks a ``load_state_dict`` rewrote (``keep``):
    pinned buffers of their own (the file is never written)."""

    kept: dict[int, torch.Tensor]
    pin_kept = False  # set at attach: page-locked on CUDA

    def keep(self, index: int, data: torch.Tensor) -> None:
        if self.kept.get(index) is not data:  # a load into a block kept already wrote its own buffer
            buffer = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=self.pin_kept)
            self.kept[index] = buffer.copy_(data)


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


__all__ = ["BlockFile", "CHECKSUMS", "CHECK_CHUNK", "FILE_ALIGN", "HostArena", "KeptBlocks", "READ_CHUNK",
           "checksum_file", "default_checksum", "padded", "register_for_dma", "release_mapping", "share_host_table",
           "source_for", "write_block_file"]

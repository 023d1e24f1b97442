"""The disk host tier: for host RAM smaller than the model, the streamed blocks are read from their block
file (``block_file.py``) into a small ring of pinned buffers ahead of use, by a reader thread, in the order
the passes visit them (up in forward, down in backward, turning at the ends), with ``O_DIRECT`` where the
file system and the buffer allow it, large sequential reads otherwise. A read that guessed wrong only
costs a wait: the store asks for block i and gets block i. The contract it keeps is ``tiers.HostTier``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from poros.errors import StreamingError
from poros.stream.block_file import (FILE_ALIGN, READ_CHUNK, BlockFile, HostArena, KeptBlocks, padded, release_mapping,
                                     source_for)
from poros.stream.packing import Layout

@dataclass
class _Staged:
    index: int
    ring: int
    read: Future


class DiskTier(KeptBlocks):
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
        self.held: HostArena | None = None  # the held blocks' pinned buffers, for the run
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
        self.file, spilled = source_for(self.source, layouts, self.spill_dir, 1 + max(layouts, default=-1))
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
        self._arena = HostArena(dict.fromkeys(range(self.depth), size), pin)
        self.ring = [self._arena.views[k] for k in range(self.depth)]
        self.copy_done: list[Any] = [None] * self.depth  # CUDA event of the copy that last read ring k
        self.next_ring = 0
        self.ahead: deque[_Staged] = deque()
        self.current: _Staged | None = None
        self.direction = 1
        self.held = HostArena({i: self.file.nbytes[i] for i in held}, pin) if held else None
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


__all__ = ["DiskTier"]

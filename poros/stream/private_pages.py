"""Give a loader's private file-mapped pages back to the page cache (Linux ``madvise(MADV_DONTNEED)``).

transformers reads a pre-quantized checkpoint's tensors through safetensors' own private mapping of each
shard, and :class:`~poros.stream.shard_tier.ShardMappedTier` maps the same shards again, shared, to stream
from. Checking the loaded bytes against the shared mapping pages both in: the same page-cache pages, mapped
twice, so the process's RSS counts the blocks twice against one copy of memory, and a machine that enforces RSS (a cgroup, a scheduler) sees twice the run. Once a loaded tensor
rests on its twin in the shared mapping (``rest_on_twin``), its pages in the private mapping are read by
nobody: dropping them takes them out of the count, and a later read (there is none) would fault them in
from the file again. Only whole pages inside the tensor's bytes are dropped, and only inside a private
mapping of the shard itself: never anonymous memory, never a neighbour's bytes.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

MADV_DONTNEED = 4  # Linux
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def private_mappings(files: list[Path]) -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` of this process's private mappings of ``files`` (none off Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    wanted = {os.path.realpath(f) for f in files}
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1][3] == "p" and os.path.realpath(fields[5]) in wanted:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


_LIBC: list = []  # the C library, loaded once


def _libc():
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def drop_pages(pointer: int, nbytes: int, ranges: list[tuple[int, int]]) -> int:
    """Drop the whole pages of ``[pointer, pointer + nbytes)`` where the span lies in one of ``ranges``; the
    bytes dropped (0: not in a private mapping of a shard, or smaller than a page)."""
    for start, end in ranges:
        if start <= pointer and pointer + nbytes <= end:
            first = -(-pointer // PAGE) * PAGE
            last = (pointer + nbytes) // PAGE * PAGE
            if last <= first:
                return 0
            if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED) != 0:
                return 0
            return last - first
    return 0


__all__ = ["drop_pages", "private_mappings"]

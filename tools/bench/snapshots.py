"""Where the bench keeps an arm's exact copies of the LoRA tensors and AdamW state (``snapshot``) for the parity check.

By default they are host tensors. At 122B with LoRA on every expert they are 7 GB of LoRA values and 14 GB of AdamW
state per arm, beside the starting LoRA values and the Poros arm's own pinned blocks and host-kept state (about
93 GB, ``poros plan``'s host RAM table): the 125 GB GPU host killed the process (the fourteenth session's
log). With ``--snapshot-dir DIR`` (:data:`DIRECTORY`) they go to files in ``DIR`` instead, written a chunk of
tensors at a time, and come back memory-mapped (``torch.load(mmap=True)``): the comparison reads them page by page,
and those pages are the file's, which the kernel can drop, not the process's own memory. The bits are the same:
a copy to a file and a mapped read change none.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

#: ``--snapshot-dir``: None keeps snapshots in host memory
DIRECTORY: Path | None = None
#: bytes of tensors per file, so that writing never holds more than this beside the tensors themselves
CHUNK_BYTES = 1 << 30
_numbers = itertools.count()


class DiskSnapshot(Mapping):
    """Name -> tensor, read from the files :func:`to_disk` wrote (memory-mapped, loaded on first use)."""

    def __init__(self, files: list[Path], names: list[str]) -> None:
        self.files, self.names = files, names
        self._loaded: dict[str, torch.Tensor] | None = None

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._loaded is None:
            self._loaded = {}
            for path in self.files:
                self._loaded.update(torch.load(path, mmap=True, weights_only=True))
        return self._loaded

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def to_disk(tensors: Iterator[tuple[str, torch.Tensor]], directory: Path, tag: str) -> DiskSnapshot:
    """Copy each ``(name, tensor)`` to files under ``directory`` (a chunk of :data:`CHUNK_BYTES` at a time)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{tag}-{next(_numbers)}"
    files: list[Path] = []
    names: list[str] = []
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal chunk, size
        if chunk:
            path = directory / f"{stem}-{len(files)}.pt"
            torch.save(chunk, path)
            files.append(path)
        chunk, size = {}, 0

    for name, tensor in tensors:
        chunk[name] = tensor.detach().to("cpu", copy=True).contiguous()
        names.append(name)
        size += tensor.numel() * tensor.element_size()
        if size >= CHUNK_BYTES:
            flush()
    flush()
    return DiskSnapshot(files, names)


def keep(tensors: Iterator[tuple[str, torch.Tensor]], tag: str) -> Mapping[str, torch.Tensor]:
    """Exact copies of ``tensors``: on the host, or in files under :data:`DIRECTORY` when it is set."""
    if DIRECTORY is not None:
        return to_disk(tensors, DIRECTORY, tag)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors}


__all__ = ["CHUNK_BYTES", "DIRECTORY", "DiskSnapshot", "keep", "to_disk"]

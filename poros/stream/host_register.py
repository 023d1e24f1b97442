"""Page-locking host memory torch did not allocate: ``cudaHostRegister`` and ``cudaHostUnregister``, the one place
Poros calls them (the pinned tier's arena, the mapped tiers' file mappings, the slabs of host AdamW state and
host LoRA tensors).

* **A refusal is cleared.** A refused ``cudaHostRegister`` leaves its error as the thread's last CUDA error, and
  torch checks that error after every kernel launch: the next, unrelated kernel would raise it (often as "out of
  memory"), so the callers' fallbacks (torch's pinned allocator, pageable copies) would never run.
  ``torch.cuda.cudart()`` has no ``cudaGetLastError``, so :func:`register` calls the one of each CUDA runtime this
  process mapped (found in ``/proc/self/maps``) to reset it; where none is found it warns that the next CUDA
  call may report the refusal.
* **Unregistering waits for the device** (:func:`unregister`): a copy still running into or out of the memory
  must finish before its pages go back (torch's own pinned allocator records an event per copy for the same
  reason; memory registered here has none).

May import: torch and the standard library.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import torch

_last_error: list[Any] | None = None  # cudaGetLastError of each CUDA runtime loaded (None: not looked for yet)


def _runtimes() -> list[Any]:
    """``cudaGetLastError`` of every CUDA runtime this process mapped (torch's, and another a library brought)."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        return found
    for path in paths:
        try:
            found.append(ctypes.CDLL(path).cudaGetLastError)
        except (OSError, AttributeError):
            continue
    return found


def _clear_last_error() -> None:
    global _last_error
    if _last_error is None:
        _last_error = _runtimes()
    for get_last_error in _last_error:
        get_last_error()
    if not _last_error:
        warnings.warn("poros: cudaHostRegister was refused and the CUDA runtime's last error could not be reset "
                      "(no libcudart in this process's maps); the next CUDA call may report that refusal.",
                      stacklevel=3)


def register(pointer: int, nbytes: int, flags: int = 0) -> int:
    """``cudaHostRegister(pointer, nbytes, flags)``: 0 when the memory is page-locked for DMA, else the CUDA error
    code, with the thread's last error reset (so only the caller sees the refusal)."""
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, flags))
    if error:
        _clear_last_error()
    return error


def unregister(pointer: int) -> None:
    """``cudaHostUnregister(pointer)`` once every copy queued on the device has finished."""
    if torch.cuda.is_initialized():  # (the CPU tests stand in for the runtime: no device to wait for)
        torch.cuda.synchronize()
    if int(torch.cuda.cudart().cudaHostUnregister(pointer)):
        _clear_last_error()


__all__ = ["register", "unregister"]

"""The training step on a CUDA stream of torch's pool, off the legacy default stream, when blocks replay
from CUDA graphs.

Measured on the H200 (2026-12-02, the autocast graph probe traced; docs/results-h200-log.md): every
backward capture of the engine under bf16 autocast, and every micro-major one, failed with "operation would make the legacy
stream depend on a capturing blocking stream" (reported at the capture's end as "operation failed due to
a previous error during capture"): while a block's backward was being captured, work was queued on the
legacy default stream, where torch runs everything unless told otherwise. The same cases run on a stream
of torch's pool (non-blocking) captured every phase and replayed bitwise (``--compute-stream``). No Python
call made it (the trace saw none), so it is the C++ side — the autograd engine's syncs between the stream
a tensor was made on and the capture's stream.

:func:`step_stream` runs a training step (``forward_backward``, a Trainer's ``training_step``) on one
pool stream per device: the stream first waits for everything queued on the caller's stream, and the
caller's stream waits for the step at its end, so the step sees the caller's writes and the caller (the
optimizer, the logging) sees the step's. Memory is safe without ``record_stream``: torch's caching
allocator hands a freed block only to work on the stream it was allocated on, and every later use of this
stream begins by waiting for the caller's stream, so a block freed while the caller still reads it is
reused only after those reads. Off CUDA, or with graphs off, it does nothing.

May import: torch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_STREAMS: dict[Any, Any] = {}


@contextlib.contextmanager
def step_stream(device: torch.device, wanted: bool) -> Iterator[None]:
    """Run the block of code on this device's Poros compute stream (see the module docstring)."""
    if not wanted or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        yield
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    caller = torch.cuda.current_stream(device)
    stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
    if caller == stream:  # nested: already on it
        yield
        return
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        caller.wait_stream(stream)


__all__ = ["step_stream"]

"""One held scratch buffer for the large transients a CUDA graph capture would otherwise take from its pool.

The grouped NF4 experts forward (``poros.loading.experts_grouped``) dequantizes a whole fused expert tensor
``[E, rows, cols]`` per call: 1.0 GiB at the 35B-A3B MoE shape, 3.0 GiB at the 122B-A10B. Captured
(``cuda_graphs``), each such transient comes from the graphs' shared pool: on the H100 (docs/results-h200-log.md,
2026-12-07) the pools held 2.10 and 6.09 GiB, twice the tensor, and both capped runs ran out of memory (likely the pool's later
small allocations split a freed transient's segment, so the next capture asked for a fresh one).

:class:`CaptureScratch` (one per ``graphs.BlockGraphs``, which makes it :func:`active` around each capture) holds
one buffer per device and dtype instead, the largest any capture asked for (a larger request adds a buffer; the
smaller stays, since captured kernels write to it), and :func:`scratch` gives the capture a view of it. The buffer
is allocated once, by the first capture or eager run that asks, and held: no capture allocates and frees such a
transient in the pool again, so no later small allocation can split it. A layer-major step lends the scratch to its
eager block runs too (``active(held, eager=True)``: the warm-ups before each capture, and blocks that run eagerly):
on the H100 the 35B-A3B's eager warm-up of its second block structure allocated its own 1.0 GiB transient beside
the pool's, which is the 1.6 GB the planner's peak missed there. Sound because every captured writer (a
dequantize) and reader (its grouped matmul) of the buffer is queued on the one compute stream the replays run on,
each reader right after its writer and before the next writer, as in the eager order; the buffer carries nothing
from one replay to the next, no graph output or saved tensor is a view of it, and the same kernel writes the same
bits whether its output is new or held; an eager run lent the buffer queues its writes and reads on that stream
too (the one eager run on another stream, the warm-up on the capture's side stream under autocast, waits for the
compute stream and is waited for by it). Outside a capture and a lending step, or with no scratch active, :func:`scratch` gives None and the caller
allocates as before (the caching allocator then lends those bytes to the head's working set). The active scratch
is per process, not per thread (a captured backward's nodes run on autograd's device thread): Poros captures from
one thread at a time. The graphs' ``release`` drops their scratch with them. Torch is imported on first use.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

#: the scratch of the capture (or lending step) running now (``active``) and whether eager runs use it, innermost last
_ACTIVE: list[tuple["CaptureScratch", bool]] = []


class CaptureScratch:
    """The buffers one set of graphs' captures write their large transients to, per (device, dtype)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, Any], list[Any]] = {}

    def view(self, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        import torch

        numel = math.prod(shape)
        held = self.buffers.setdefault((str(device), dtype), [])
        if not held or held[-1].numel() < numel:
            held.append(torch.empty(numel, dtype=dtype, device=device))
        return held[-1][:numel].view(shape)


@contextlib.contextmanager
def active(held: CaptureScratch | None, *, eager: bool = False):
    """``held`` is what :func:`scratch` gives from inside this block: to captures, and with ``eager`` to every run
    (a layer-major step of blocks under CUDA graphs lends it to its eager ones). ``held`` None: nothing changes."""
    if held is None:
        yield None
        return
    _ACTIVE.append((held, eager))
    try:
        yield held
    finally:
        _ACTIVE.pop()


def capturing(device: Any) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (never on another device type)."""
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def scratch(shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
    """A ``shape`` view of the active scratch's buffer of ``device`` and ``dtype`` while a capture runs there (or
    in a lending step), else None (the caller allocates)."""
    if not _ACTIVE:
        return None
    held, eager = _ACTIVE[-1]
    return held.view(shape, dtype, device) if eager or capturing(device) else None


__all__ = ["CaptureScratch", "active", "capturing", "scratch"]

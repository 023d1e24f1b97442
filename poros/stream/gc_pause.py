"""Python's cyclic garbage collector paused while a layer-major step runs (``StreamOptions.pause_gc``).

A step whose blocks keep their activations holds, until each block's backward, the Python objects of every kept
graph: the packed saved tensors and the wrappers of the autograd nodes ``kept.py`` visits. In layer-major
accumulation all M x L of them are alive at the turn, and the collector's automatic passes, started by
allocation counts, scan them again and again; a full pass scans every object of the process. Each pass stops the
thread that queues the GPU's work, and the GPU goes idle behind it (``tools/bench/host_overhead.py`` counts the
passes and their time; docs/benchmarking.md). The cycles a step leaves are torch's own (the nested helper of
``torch.utils._pytree.tree_flatten``) and hold no tensor, so collecting them after the step instead of during it
frees no device memory later.

:func:`paused` turns automatic collection off for the step and restores the collector's state after, also when
the step fails; it never collects by itself (the next automatic pass after the step finds what the step left).
The collector decides no value: the bits are the same either way. Torchtitan (``training.gc_freq``) and
Megatron-LM (``--manual-gc``) pause it for the same reason.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused(on: bool = True) -> Iterator[None]:
    """Automatic garbage collection off inside (when ``on`` and it was enabled), restored after."""
    if not on or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


__all__ = ["paused"]

"""Trace what a CUDA-graph capture calls: the stream and event calls made while a capture is open, and the
full traceback of each failed capture of the engine (``BlockGraphs._record``).

The minimal pieces of ``tools/capture_probe.py`` all capture (2026-12-02: 108 of 108 cases on the H200,
autocast on and off, inside an outer backward and in a thread), while the engine's backward captures under
autocast, and its micro-major ones, fail with "operation failed due to a previous error during capture".
That message is CUDA's for a capture an earlier call invalidated; the usual earlier call is a wait on an
event recorded outside the capture (a dependency across the capture's boundary) or a synchronizing call.
:func:`tracing` wraps torch's Python-level stream and event calls and, while any capture is open, records
each one with a short stack; it also turns on ``torch.cuda.set_sync_debug_mode("error")`` during the
capture, so the first synchronizing call raises where it is made, and keeps each failed capture's whole
traceback. The autograd engine's own C++ stream syncs are not seen (only their effect).

    with tracing() as log:
        ...  # run the engine with cuda_graphs
    log.to_dict()  # {"calls": [...], "failures": [...]}
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

#: (owner, method) pairs wrapped while tracing
WRAPPED = (("Stream", "wait_event"), ("Stream", "wait_stream"), ("Stream", "record_event"), ("Stream", "synchronize"),
           ("Stream", "query"), ("Event", "record"), ("Event", "wait"), ("Event", "synchronize"), ("Event", "query"))
MAX_CALLS = 400


@dataclass
class CaptureLog:
    """What :func:`tracing` saw: calls made during captures, and the failed captures' tracebacks."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    captures: int = 0
    open: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, name: str) -> None:
        if self.open and len(self.calls) < MAX_CALLS:
            stack = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-8:-2]]
            with self.lock:
                self.calls.append({"call": name, "capture": self.captures, "thread": threading.current_thread().name,
                                   "stack": stack})

    def to_dict(self) -> dict[str, Any]:
        return {"captures": self.captures, "calls": self.calls, "failures": self.failures}


def _wrap(log: CaptureLog, owner: type, method: str):
    original = getattr(owner, method)

    def traced(self, *args, **kwargs):
        log.note(f"{owner.__name__}.{method}")
        return original(self, *args, **kwargs)

    setattr(owner, method, traced)
    return lambda: setattr(owner, method, original)


@contextlib.contextmanager
def tracing() -> Iterator[CaptureLog]:
    """Trace captures in this process until the block ends (see the module docstring)."""
    from poros.stream import graphs as graphs_module

    log = CaptureLog()
    undo = [_wrap(log, getattr(torch.cuda, owner), method) for owner, method in WRAPPED]
    graph_class = torch.cuda.graph
    enter, leave = graph_class.__enter__, graph_class.__exit__

    def entered(self):
        log.captures += 1
        log.open += 1
        result = enter(self)
        torch.cuda.set_sync_debug_mode("error")
        return result

    def left(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        log.open -= 1
        return leave(self, *exc)

    graph_class.__enter__, graph_class.__exit__ = entered, left
    record = graphs_module.BlockGraphs._record

    def recorded(self, index, body, autocast=None):
        try:
            return record(self, index, body, autocast)
        except Exception as exc:  # noqa: BLE001 - kept whole, then raised as before
            chain, cause = [], exc
            while cause is not None and len(chain) < 6:
                chain.append(f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}")
                cause = cause.__cause__ or cause.__context__
            log.failures.append({"block": index, "capture": log.captures, "chain": chain,
                                 "traceback": traceback.format_exc()[-4000:]})
            raise

    graphs_module.BlockGraphs._record = recorded
    try:
        yield log
    finally:
        graphs_module.BlockGraphs._record = record
        graph_class.__enter__, graph_class.__exit__ = enter, leave
        for restore in undo:
            restore()
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")

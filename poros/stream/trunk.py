"""The streamed trunk's parts (``executor.py``): how HF's own layer calls are captured -- recorders in the
decoder layers' place (:class:`LayerRecorder`; the last raises :class:`CaptureDone` to unwind HF's
forward), swapped in for one call (:func:`swapped`) -- the one switch of what the trunk does when the
model calls it (:class:`Phase`, :class:`TrunkState`, :data:`STREAMING`), the stand-in for a layer in a
forward without grad (:class:`StreamingLayer`), what the trunk returns (:class:`TrunkOutput`), and one
forward's state (:class:`Step`: its captured calls, carried-mapping versions, pending gradients, RNG and
autocast states).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poros.stream.layer_call import LayerCall


# ---------------------------------------------------------------------------------------------
# Capturing HF's own calls: recorders in place of the layers; what the streamed trunk returns.
# ---------------------------------------------------------------------------------------------
class CaptureDone(Exception):
    """Raised by the last recorder; carries nothing (the calls are in the recorders' list): it unwinds
    HF's forward, the trunk's in a capture, the whole model's in layer-major's prelude phase."""


class Phase(enum.Enum):
    """What the streamed trunk does when the model calls it."""

    STREAM = "stream"  # every call but layer-major's: stream the blocks (HF's own loop without grad)
    PRELUDE = "prelude"  # layer-major's first call per micro-batch: record HF's layer calls, run nothing else
    HEAD = "head"  # layer-major's second call: the blocks already ran; return the final norm of their output


@dataclass(frozen=True)
class TrunkState:
    """The streamed trunk's phase and what it carries: the executor's one switch (``forward_backward``
    sets it for one call of the model, then it is :data:`STREAMING` again)."""

    phase: Phase
    calls: list | None = None  # PRELUDE: where the recorders put HF's layer calls
    hidden: torch.Tensor | None = None  # HEAD: the last block's output, a leaf the head's backward fills
    router_logits: tuple | None = None  # HEAD: every block's router logits, leaves (output_router_logits)
    asked: dict = field(default_factory=dict)  # PRELUDE: what HF asked the trunk for ("router": its logits)
    autocast: list | None = None  # PRELUDE: where the trunk notes the autocast state the model's forward set


STREAMING = TrunkState(Phase.STREAM)


class LayerRecorder(nn.Module):
    def __init__(self, calls: list, last: bool) -> None:
        super().__init__()
        self.calls, self.last = calls, last

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.last:
            raise CaptureDone
        return args[0]


class StreamingLayer(nn.Module):
    """Stands for decoder layer ``index`` in a forward without grad: fetch, run with HF's arguments, release.

    Attributes HF reads from a layer (e.g. ``attention_type``) are the real layer's.
    """

    def __init__(self, executor: "StreamingExecutor", index: int) -> None:
        super().__init__()
        self.executor, self.index = executor, index

    def forward(self, *args, **kwargs):
        self.executor._make_resident(self.index)
        self.executor._prefetch(self.index + 1)
        try:
            return self.executor.layers[self.index](*args, **kwargs)
        finally:
            self.executor.store.release(self.index)

    def __getattr__(self, name: str):
        if name in ("executor", "index") or name.startswith("_"):
            return super().__getattr__(name)
        return getattr(self.executor.layers[self.index], name)


class TrunkOutput:
    """What callers read from the text model: ``last_hidden_state`` (and ``router_logits`` when asked for);
    anything else is None."""

    def __init__(self, last_hidden_state: torch.Tensor, router_logits: tuple | None = None) -> None:
        self.last_hidden_state, self.router_logits = last_hidden_state, router_logits

    def __getattr__(self, name: str) -> None:
        return None

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):  # ``outputs[1:]``: Liger's fused forward with return_dict=False
            return (self.last_hidden_state,)[index]
        if index != 0:
            raise IndexError(index)
        return self.last_hidden_state


@contextlib.contextmanager
def swapped(parent: nn.Module, name: str, replacement: nn.Module):
    original = parent._modules[name]
    parent._modules[name] = replacement
    try:
        yield
    finally:
        parent._modules[name] = original


# ---------------------------------------------------------------------------------------------
# Per-forward state: captured calls, carried-mapping versions, pending gradients, RNG.
# ---------------------------------------------------------------------------------------------
@dataclass
class Step:
    calls: list[LayerCall]
    # carried mappings: (kwarg, key) -> (writer index, value) as seen when each block started
    seen_at_entry: list[dict[tuple[str, Any], tuple[int, Any]]] = field(default_factory=list)
    written_by: dict[int, list[tuple[str, Any]]] = field(default_factory=dict)
    pending: dict[tuple[str, Any, int], list[torch.Tensor | None]] = field(default_factory=dict)
    rng_states: dict[int, Any] = field(default_factory=dict)
    # block index -> the autocast state its forward ran under (replayed by its recompute)
    autocast_states: dict[int, Any] = field(default_factory=dict)
    router: bool = False  # output_router_logits: each block's router logits are outputs of its node
    router_logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # block -> its forward's logits
    # layer-major: the autocast state the model's forward set around its trunk call (the blocks run under it)
    autocast: Any = None
    # micro-major with boundary_every > 1: segment start -> its kept input; block -> its recomputed input
    boundaries: dict[int, torch.Tensor] = field(default_factory=dict)
    recomputed: dict[int, torch.Tensor] = field(default_factory=dict)
    kept_blocks: frozenset = frozenset()  # blocks whose forward keeps its saved tensors (no recompute)
    kept: dict[int, Any] = field(default_factory=dict)  # block -> its KeptBlock (poros.stream.kept), until its backward


__all__ = ["CaptureDone", "LayerRecorder", "Phase", "STREAMING", "Step", "StreamingLayer", "TrunkOutput", "TrunkState", "swapped"]

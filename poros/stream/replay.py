"""What a block's recompute replays of its forward: the RNG state (dropout draws the same masks)
and the autocast state (mixed precision runs the same ops in the same dtypes), as
``torch.utils.checkpoint`` records them. The executor (``executor.py``) captures them in forward
and replays them in backward, whatever thread runs it. A CUDA graph replays the autocast state with
the cast cache off (:func:`uncached`); :class:`CastCacheWatch` finds the one case where that changes
the bits (an autocast region that outlived an optimizer step)."""

from __future__ import annotations

import contextlib

import torch


def rng_state(device: torch.device):
    """The CPU's and (on CUDA) ``device``'s RNG state before a block's forward."""
    cpu = torch.get_rng_state()
    accel = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, accel


def autocast_state(device: torch.device):
    """The thread-local autocast state a block's forward runs under, as ``torch.utils.checkpoint`` records
    it (``_get_autocast_kwargs``): the compute device's and the CPU's, and the cache flag."""
    cache = torch.is_autocast_cache_enabled()
    kinds = [device.type] if device.type != "cpu" and torch.amp.is_autocast_available(device.type) else []
    return [(kind, {"enabled": torch.is_autocast_enabled(kind), "dtype": torch.get_autocast_dtype(kind),
                    "cache_enabled": cache}) for kind in [*kinds, "cpu"]]


@contextlib.contextmanager
def replayed_autocast(state, device: torch.device):
    """Recompute under the forward's autocast state (mixed precision: the same ops in the same dtypes),
    whatever the state of the thread that runs backward (CUDA runs it on an engine thread, autocast off)."""
    if state is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        for kind, kwargs in state:
            stack.enter_context(torch.amp.autocast(kind, **kwargs))
        yield


@contextlib.contextmanager
def outside_autocast(device: torch.device):
    """Autocast off (the compute device's and the CPU's) for a backward the executor drives itself
    (layer-major): HF Trainer's ``loss.backward()`` runs outside its autocast region, and a backward under
    autocast casts the fp32 matmuls of some backward formulas down (seen on CPU: a gated delta-rule linear attention;
    the CPU engine runs backward on the caller's thread). The recompute before it replays the forward's
    state explicitly (:func:`replayed_autocast`)."""
    kinds = [device.type] if device.type != "cpu" and torch.amp.is_autocast_available(device.type) else []
    active = [kind for kind in [*kinds, "cpu"] if torch.is_autocast_enabled(kind)]
    with contextlib.ExitStack() as stack:
        for kind in active:
            stack.enter_context(torch.amp.autocast(kind, enabled=False))
        yield


def uncached(state):
    """``state`` with the cast cache off: what a CUDA graph captures under (a cached cast would be baked
    into the graph as a stale tensor; an uncached one is an op the replay reruns). The cast of an fp32
    LoRA weight gives the same bits either way, and autograd the same gradient (each backward call sums
    its own use of the cast; tests/test_graphs_autocast.py), while the weight is what it was when cached."""
    if state is None:
        return None
    return [(kind, {**kwargs, "cache_enabled": False}) for kind, kwargs in state]


class CastCacheWatch:
    """Whether the caller's autocast region has lived since the previous :meth:`persisted` call.

    torch caches the low-precision cast of each fp32 leaf that requires grad (the LoRA weights) until the
    outermost autocast region exits, whatever happens to the weight in between: a region around several
    optimizer steps computes every later step with the first step's casts (stale; HF Trainer enters
    autocast per forward, so its casts are fresh). Eager mode reproduces that, an uncached capture cannot.
    The watch casts a one-element sentinel through the cache, with a new value each call: reading back an
    earlier value means the cache (the region) survived since then. One host sync per call.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sentinel: torch.Tensor | None = None
        self.count = 0

    def persisted(self) -> bool:
        kind = self.device.type
        if not (torch.is_autocast_enabled(kind) and torch.is_autocast_cache_enabled()):
            return False
        if self.sentinel is None:  # an fp32 leaf that requires grad: what the cache keeps
            self.sentinel = torch.zeros(1, 1, device=self.device, requires_grad=True)
        self.count = self.count % 15 + 1  # squares up to 225: exact in bf16 and fp16
        with torch.no_grad():
            self.sentinel.fill_(self.count)
            cast = torch.mm(self.sentinel, self.sentinel)  # an autocast op: the cached cast of the sentinel
        return cast.item() != self.count * self.count


@contextlib.contextmanager
def restored_rng(state, device: torch.device):
    """Replay the forward's RNG state during recompute (dropout), leaving the caller's RNG untouched."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


__all__ = ["CastCacheWatch", "autocast_state", "outside_autocast", "replayed_autocast", "restored_rng", "rng_state",
           "uncached"]

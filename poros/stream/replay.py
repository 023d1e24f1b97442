"""What a block's recompute replays of its forward: the RNG state (dropout draws the same masks)
and the autocast state (mixed precision runs the same ops in the same dtypes), as
``torch.utils.checkpoint`` records them. The executor (``executor.py``) captures them in forward
and replays them in backward, whatever thread runs it."""

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


__all__ = ["autocast_state", "replayed_autocast", "restored_rng", "rng_state"]

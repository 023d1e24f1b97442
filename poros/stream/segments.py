"""Boundary states kept every k-th block (``boundary_every``): the executor keeps the input of blocks
0, k, 2k, ... (on the device, the host or disk, as ``boundary_states`` says) and drops the k - 1 between;
backward recomputes them from the kept one, one forward without grad through the segment's blocks
(streamed again), before it goes down that segment.

The recompute replays each block's forward exactly as the first forward ran it: the same input, the
RNG and autocast state recorded then (``replay.py``), the carried mappings as the block saw them on
entry (``StreamingExecutor._recompute_mappings``). So every recomputed state is bit for bit the one
the forward made, and training is bitwise the same for any k (``tests/test_boundary_every.py``); what
it costs is one more forward over ``(k - 1) / k`` of the blocks and their copies per step.

Torch-free but for the recompute itself; :func:`resolve_every` is the one rule for the option's value.
"""

from __future__ import annotations

from typing import Any

from poros.errors import ConfigError

#: the values ``boundary_every`` takes beside a positive integer
EVERY_CHOICES = ("auto",)


def check_every(value: Any) -> None:
    """Raise unless ``value`` is a ``boundary_every`` setting: None, ``"auto"`` or an integer >= 1."""
    if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise ConfigError(f"boundary_every={value!r}: expected 'auto' or an integer >= 1 (1 keeps every block's input; "
                      "k keeps every k-th and recomputes the others in backward). Fix: e.g. boundary_every: 8.")


def resolve_every(value: Any, planned: int | None = None) -> int:
    """The k a run uses: an integer as given; ``"auto"`` or None the planner's choice, else 1."""
    check_every(value)
    return value if isinstance(value, int) else (planned or 1)


def kept(index: int, every: int) -> bool:
    """Whether block ``index``'s input is a kept boundary state."""
    return index % every == 0


def segment_start(index: int, every: int) -> int:
    """The block whose kept input block ``index``'s is recomputed from."""
    return index - index % every


def segment_top(index: int, every: int, count: int) -> int:
    """The segment's last block (the first backward visits), of a model of ``count`` blocks."""
    return min(segment_start(index, every) + every - 1, count - 1)


def recompute_inputs(executor: Any, steps: list, start: int, stop: int, bases: list) -> list[dict]:
    """The inputs of blocks ``start..stop`` of each step, by one forward without grad of blocks
    ``start..stop - 1`` from ``bases`` (each step's input of block ``start``, itself the first entry).

    Block-major: each block is fetched once for every step (layer-major's micro-batches), released
    after the last. ``executor`` is the :class:`~poros.stream.executor.StreamingExecutor`.
    """
    import torch

    from poros.stream.replay import replayed_autocast, restored_rng

    found = [{start: base} for base in bases]
    device = executor.store.device
    with torch.no_grad():
        for index in range(start, stop):
            executor._make_resident(index)
            executor._prefetch(index + 1)
            with executor.dequantize.holding(index):  # layer-major: dequantized once for the M micro-batches
                for inputs, step in zip(found, steps):
                    call = step.calls[index]
                    mappings, _ = executor._recompute_mappings(step, index, call)
                    with restored_rng(step.rng_states.get(index), device), \
                            replayed_autocast(step.autocast_states.get(index), device):
                        args, kwargs = call.build(inputs[index], call.grad_tensors(), mappings)
                        inputs[index + 1] = executor.layers[index](*args, **kwargs)
            executor.store.release(index)
    return found


__all__ = ["EVERY_CHOICES", "check_every", "kept", "recompute_inputs", "resolve_every", "segment_start",
           "segment_top"]

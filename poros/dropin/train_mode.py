"""``model.train()`` once per accumulation window, for the window driver (:mod:`poros.dropin.trainer_window`).

HF ``Trainer.training_step`` begins with ``model.train()``: ``nn.Module.train`` sets ``training`` on every module
of the tree (about 6,000 at 64 decoder layers with LoRA on seven projections, 15 to 25 ms of Python). The plain
run pays it once per micro-batch while the device still computes the one before, so it costs nothing there. A
layer-major window calls the step twice per micro-batch -- its trunk calls, one after another, before the first
block runs, and its head calls between the forward and the backward -- with no device work queued behind the
host: a traced 32B step at 2048 tokens and accumulation 4 showed a 24 ms idle gap before each trunk call.

Inside one window nothing but those calls sets a mode (the Trainer calls no callback between a window's
micro-batches: the driver runs them all inside its first ``training_step``), so every call after the first,
asking the same mode, finds the tree already in it. :func:`once_per_window` lets the first call of each mode walk
and answers the rest without walking: every module's ``training`` is what the plain run's calls would leave.
That holds for the ``train`` methods that only set modes (``nn.Module``'s, and transformers' ``PreTrainedModel``
one, which also notes its kernels' mode): a tree with any other override (a module whose ``train`` does more
per call, e.g. PEFT's DoRA layer, which clears its weight-norm cache at every ``train(True)``) is walked at every
call, as in the plain run.

May import: torch, transformers (optional) and the core.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_MISSING = object()


def _mode_only_methods() -> tuple:
    """The ``train`` implementations known to do nothing a second call with the same mode would change."""
    from torch import nn

    known = [nn.Module.train]
    try:
        from transformers.modeling_utils import PreTrainedModel

        known.append(PreTrainedModel.train)
    except ImportError:  # transformers is optional here
        pass
    return tuple(known)


def only_sets_modes(model: Any) -> bool:
    """Whether every module of ``model``'s tree has a ``train`` from :func:`_mode_only_methods`."""
    known = _mode_only_methods()
    return all(type(module).train in known and "train" not in vars(module) for module in model.modules())


@contextlib.contextmanager
def once_per_window(model: Any) -> Iterator[None]:
    """While inside, ``model.train(mode)`` walks the module tree only when ``mode`` is not what the last walk
    inside set; outside, ``model.train`` is what it was (the class's, or an instance attribute of the caller's)."""
    own = vars(model).get("train", _MISSING)
    walk = model.train
    skippable = own is _MISSING and only_sets_modes(model)  # one pass over the tree, before the stand-in is set
    last: bool | None = None  # the mode the last walk inside set

    def train(mode: bool = True):
        nonlocal last
        if not skippable or last is not bool(mode):
            walk(mode)
            last = bool(mode)
        return model

    object.__setattr__(model, "train", train)
    try:
        yield
    finally:
        if own is _MISSING:
            object.__delattr__(model, "train")
        else:
            object.__setattr__(model, "train", own)


__all__ = ["once_per_window", "only_sets_modes"]

"""HF's ``num_parameters`` for a prepared model: the plain run's count, and asked once per accumulation window
by the Trainer's flops count.

* **The plain run's count.** A streamed block's modules hold empty placeholders while it is evicted, so
  :func:`count` adds what they held at ``prepare`` (:func:`parameter_counts` before less after). HF ``Trainer``
  reckons ``total_flos`` (saved in ``trainer_state.json``) from it.
* **Once per window.** After every micro-batch HF ``Trainer`` adds ``floating_point_ops(inputs)``, which calls
  ``model.num_parameters(exclude_embeddings=True)``: a walk over every module and parameter (about 20 ms at 64
  decoder layers with LoRA), made right after the loop's ``isnan`` check has drained the device, so the device
  waits that long per micro-batch. In a layer-major window the device has finished the whole window by then, so
  each micro-batch's walk is idle device time (a traced 32B step at 2048 tokens and accumulation 4 showed four
  such gaps of 28 to 44 ms). Inside one window nothing changes the model's modules, so the window driver
  (:mod:`poros.dropin.trainer_window`) answers the window's flops counts from one walk (:func:`memoized`): the
  same integer, so the same ``total_flos``.

May import: torch and the core.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


def parameter_counts(causal_lm: nn.Module) -> tuple[int, int]:
    """HF's ``num_parameters()`` with and without the embeddings (0, 0 for a model without the method)."""
    count_of = getattr(causal_lm, "num_parameters", None)
    return (count_of(), count_of(exclude_embeddings=True)) if callable(count_of) else (0, 0)


def count(model: Any, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """``PorosModel.num_parameters``: HF's count of the model's own class, the streamed blocks' frozen tensors
    added; from the memo of :func:`memoized` while one is active."""
    memo = model.__dict__.get("_count_memo")
    key = (bool(only_trainable), bool(exclude_embeddings))
    if memo is not None and key in memo:
        return memo[key]
    owner = model.causal_lm
    method = (model._poros_class if owner is model else type(owner)).num_parameters
    counted = method(owner, only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
    counted += 0 if only_trainable else model._streamed_counts[bool(exclude_embeddings)]
    if memo is not None:
        memo[key] = counted
    return counted


@contextlib.contextmanager
def memoized(model: Any, memo: dict) -> Iterator[None]:
    """While inside, ``model.num_parameters`` answers from ``memo`` (filled by the first call of each kind):
    for a stretch in which the model's modules do not change (one accumulation window)."""
    previous = model.__dict__.get("_count_memo")
    object.__setattr__(model, "_count_memo", memo)
    try:
        yield
    finally:
        object.__setattr__(model, "_count_memo", previous)


__all__ = ["count", "memoized", "parameter_counts"]

"""``dequantize_once`` for a budget plan (:func:`choose_dequantize_once`): whether layer-major's block phases hold
a block's dequantized NF4 weights (``poros.stream.dequantize_once``), and the plan's note saying why. Torch-free.

The copy is one block's 4-bit linear weights in the compute dtype (``Footprint.held_weight_bytes``, what
``poros plan`` prints), priced in the peak's backward phase (:func:`poros.plan.peak.predict_peak`).
``"auto"`` turns it on in layer-major accumulation over more than one micro-batch when what the plan leaves
after the slot ring and the resident blocks holds the copy (it never raises the minimum and never costs a
resident block, whose saved copies are measured; kept activations take what is left after it). Micro-major and
one micro-batch have nothing to share. ``True`` counts the copy from the start: in the minimum, the ring and the
resident blocks.
"""

from __future__ import annotations

from typing import Callable

from poros.spellings import format_gb
from poros.stream.options import Workload


def choose_dequantize_once(mode: bool | str, workload: Workload, held_bytes: int,
                           fits: Callable[[], bool]) -> tuple[bool, str]:
    """``(on, note)``: ``mode`` is ``StreamOptions.dequantize_once``; ``fits()`` whether the plan's ring and
    resident blocks fit the budget with one block's held copy (``held_bytes``) too. The note is empty where
    nothing needs saying."""
    layer_major = workload.schedule == "layer-major"
    held = format_gb(held_bytes)
    if mode is False or held_bytes <= 0:
        return False, ""
    if not layer_major:
        return False, ("dequantize_once: off in micro-major accumulation (each micro-batch streams every block "
                       "itself: no phase to share a dequantization)" if mode is True else "")
    if mode == "auto" and workload.grad_accum < 2:
        return False, "dequantize_once=auto: off at one micro-batch (nothing to share across micro-batches)"
    if mode == "auto" and not fits():
        return False, (f"dequantize_once=auto: off, the budget cannot hold one block's dequantized weights "
                       f"({held}) beside the slot ring and the resident blocks")
    why = "asked" if mode is True else "the budget holds it"
    return True, (f"dequantize_once: each block's NF4 weights dequantized once for its "
                  f"{workload.grad_accum} forwards and once for its recomputes and backwards, the copy held while "
                  f"the phase runs ({held}, {why})")


__all__ = ["choose_dequantize_once"]

"""``dequantize_once`` for a budget plan (:func:`choose_dequantize_once`): whether layer-major's block phases hold
a block's dequantized NF4 weights (``poros.stream.dequantize_once``), and the plan's note saying why. Torch-free.

The copy is one block's 4-bit linear weights in the compute dtype (``Footprint.held_weight_bytes``, about 1 GB a
block at Qwen2.5-32B's shape in bf16), priced in the peak's backward phase (:func:`poros.plan.peak.predict_peak`).
``"auto"`` turns it on in layer-major accumulation over more than one micro-batch when the plan with the ring
asked for, nothing resident and the boundary states where the budget put them fits with the copy (after the
minimum, which it never raises; before resident blocks and kept activations: it saves a dequantization per 4-bit
linear and micro-batch, and, where the compute dtype is the weights', the recompute's against its backward's);
micro-major and one micro-batch have nothing to share. ``True`` counts the copy in the minimum too.
"""

from __future__ import annotations

from typing import Callable

from poros.spellings import format_gb
from poros.stream.options import Workload


def choose_dequantize_once(mode: bool | str, workload: Workload, held_bytes: int,
                           fits: Callable[[], bool]) -> tuple[bool, str]:
    """``(on, note)``: ``mode`` is ``StreamOptions.dequantize_once``; ``fits()`` whether the plan with one block's
    held copy (``held_bytes``), the ring and nothing resident fits the budget. The note is empty where nothing
    needs saying."""
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
                       f"({held}) beside the ring and the boundary states")
    why = "asked" if mode is True else "the budget holds it"
    return True, (f"dequantize_once: each block's NF4 weights dequantized once for its "
                  f"{workload.grad_accum} forwards and once for its recomputes and backwards, the copy held while "
                  f"the phase runs ({held}, {why})")


__all__ = ["choose_dequantize_once"]

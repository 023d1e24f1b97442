"""The footprint's one-block recompute working set against the bytes a real block keeps alive.

A tiny Qwen2 block (72B's ratios: intermediate 3.6x hidden, 8 query heads per KV head) with NF4 linears and
PEFT LoRA (fp32 LoRA weights, PEFT's default) on the seven projections, its forward with grad and its
backward counted tensor by tensor (``tools/saved_bytes.py``: the live storages after every op). The count
includes the block's output and its input gradient, which the planner prices with the boundary states;
less those, the estimate (``poros.plan.footprint.activation_parts(...).recompute``) is within 5 %, with
the MLP whole and tiled (``mlp_chunks`` tiles the norms and attention projections with it): at these lengths the LoRA input copies, the norms and the norm's backward are most
of it (issue 32: the H200's 72B at 32K measured 20.87 GB against a 16.68 GB prediction without them).
"""

from __future__ import annotations

import pytest

from tools import saved_bytes


@pytest.mark.parametrize("mlp_chunks", [1, 8])
def test_the_recompute_estimate_is_what_a_block_keeps_alive(mlp_chunks):
    hidden, seq = 256, 2048
    count, model = saved_bytes.block_live_bytes(hidden, 924, 8, 1, seq, mlp_chunks)
    measured = count.peak - 2 * seq * hidden * 2  # less the block's output and its input gradient (bf16)
    estimate = saved_bytes.estimated_recompute(model, seq, mlp_chunks)
    assert abs(estimate / measured - 1) < 0.05, (estimate, measured)
    # fp32 [seq, hidden] tensors made by a cast: whole, the LoRA input copies (one per attention projection)
    # and the norms' inputs; tiled (the norms and projections with the MLP), one chunk's copies at a time
    casts = [what for what in count.at_peak if what[0] == "_to_copy.default" and what[2] == "float32"
             and what[1][-1] == hidden]
    whole = [what for what in casts if what[1][-2] == seq]
    if mlp_chunks == 1:
        assert len(whole) >= 6  # q, k, v, o, the two norms' inputs (and gate, up when the MLP is whole)
    else:
        assert not whole and casts and all(what[1][-2] <= seq // mlp_chunks for what in casts)


def test_tiling_the_norms_and_projections_halves_the_recompute():
    """Issue 32: with mlp_chunks the norms and attention projections are tiled too, so the block keeps about
    half of what the MLP's tiling alone left (measured on the same real block: 55 -> 28 bytes per token
    and hidden unit at 4,096 tokens)."""
    hidden, seq = 256, 2048
    whole, _ = saved_bytes.block_live_bytes(hidden, 924, 8, 1, seq, 1)
    tiled, _ = saved_bytes.block_live_bytes(hidden, 924, 8, 1, seq, 8)
    assert tiled.peak < 0.6 * whole.peak, (tiled.peak, whole.peak)

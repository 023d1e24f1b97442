"""MoE experts in a run plan (:mod:`poros.plan.run_plan`): the fused expert tensors of a meta skeleton's
blocks priced in NF4 as the run packs them (``quantize_experts`` not false) with the plan's line on them
(:func:`expert_sizes`), the largest expert count (:func:`largest_fused_experts`) and the LoRA parameters
``lora_on_experts`` adds (:func:`expert_lora_parameters`, per block :func:`expert_lora_shapes`); with them, each
block's LoRA tensors, the linears' (:func:`lora_shapes`) and the experts', priced as the static LoRA buffers all
CUDA graphs share (:func:`lora_statics_bytes`).
"""

from __future__ import annotations

import math
from typing import Any

from poros.plan.block_bytes import nf4_experts_bytes, padded
from poros.plan.budget import LORA_VALUE_BYTES
from poros.stream.placement import shared_statics_bytes
from poros.spellings import format_gb


def largest_fused_experts(blocks: list) -> int:
    """Values of the largest fused expert tensor ``[E, rows, cols]`` of any block (what the grouped NF4
    experts forward dequantizes at once)."""
    from poros.loading.experts import FUSED_EXPERT_TENSORS, experts_modules

    return max((getattr(m, t).numel() for b in blocks for _, m in experts_modules(b) for t in FUSED_EXPERT_TENSORS),
               default=0)


def expert_lora_parameters(blocks: list, config: Any) -> int:
    """LoRA parameters on the fused experts with ``lora_on_experts`` (:func:`expert_lora_shapes`), else 0."""
    return sum(math.prod(shape) for block in blocks for shape in expert_lora_shapes(block, config))


def expert_lora_shapes(block: Any, config: Any) -> list[tuple[int, int]]:
    """The shapes of a block's LoRA tensors on its fused experts with ``lora_on_experts`` (PEFT's
    ``target_parameters``: rank r per expert, ``lora_A [E * r, in]`` and ``lora_B [out, E * r]`` per fused
    tensor ``[E, out, in]``), else none."""
    from poros.loading.experts import FUSED_EXPERT_TENSORS, experts_modules

    if not getattr(config, "lora_on_experts", True):
        return []
    shapes = []
    for _, module in experts_modules(block):
        for name in FUSED_EXPERT_TENSORS:
            experts, rows, columns = getattr(module, name).shape
            shapes += [(config.lora_rank * experts, columns), (rows, config.lora_rank * experts)]
    return shapes


def lora_shapes(linear: Any, config: Any) -> list[tuple[int, ...]]:
    """The shapes of PEFT's LoRA tensors on ``linear`` at ``config.lora_rank``: ``lora_A [r, in]``, ``lora_B
    [out, r]`` and with ``config.use_dora`` the magnitude ``[out]``."""
    shapes = [(config.lora_rank, linear.in_features), (linear.out_features, config.lora_rank)]
    return shapes + ([(linear.out_features,)] if config.use_dora else [])


def lora_statics_bytes(blocks: list, targets: dict, config: Any) -> int:
    """The static LoRA buffers all CUDA graphs share (``placement.shared_statics_bytes``) for a meta skeleton's
    ``blocks``: each block's LoRA tensors, on the linears of ``targets`` (``poros.adapters.lora_targets``) in it
    and on its experts, in fp32."""
    targeted = {id(m) for m in targets.values()}
    return shared_statics_bytes([[(shape, math.prod(shape) * LORA_VALUE_BYTES) for shape in
                                  [s for m in block.modules() if id(m) in targeted for s in lora_shapes(m, config)]
                                  + expert_lora_shapes(block, config)] for block in blocks])


def expert_sizes(blocks: list, sizes: list[int], quantize: bool | None) -> tuple[list[int], str | None]:
    """The block sizes with the fused MoE experts in NF4 (``quantize_experts`` not false: what the run packs)
    and the plan's line on the experts (count, bf16 and NF4 bytes); ``(sizes, None)`` without experts."""
    from poros.loading.experts import FUSED_EXPERT_TENSORS, experts_modules

    per_block = []  # (bf16 bytes, NF4 bytes, experts) of each block
    for block in blocks:
        modules = [m for _, m in experts_modules(block)]
        tensors = [getattr(m, t) for m in modules for t in FUSED_EXPERT_TENSORS]
        per_block.append((sum(padded(t.numel() * t.element_size()) for t in tensors),
                          sum(nf4_experts_bytes(tuple(t.shape)) for t in tensors) + len(modules) * padded(16 * 4),
                          max((t.shape[0] for t in tensors), default=0)))
    if not any(count for _, _, count in per_block):
        return sizes, None
    bf16, nf4 = sum(b for b, _, _ in per_block), sum(n for _, n, _ in per_block)
    on = quantize is not False
    if on:
        sizes = [size - b + n for size, (b, n, _) in zip(sizes, per_block)]
    moe_blocks = sum(1 for _, _, count in per_block if count)
    line = (f"{max(c for _, _, c in per_block)} experts in each of {moe_blocks} blocks: {format_gb(bf16)} in bf16, "
            f"{format_gb(nf4)} in NF4 ({'quantize_experts: the run packs them' if on else 'quantize_experts=false'})")
    return sizes, line


__all__ = ["expert_lora_parameters", "expert_lora_shapes", "expert_sizes", "largest_fused_experts", "lora_shapes",
           "lora_statics_bytes"]

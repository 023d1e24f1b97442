"""The chunk counts of a long step: how many token chunks the head and loss run in (``loss_chunks``) and
how many sequence chunks each block's MLP runs in (``mlp_chunks``), for a VRAM budget.

The rule (:func:`choose_chunks`): the counts asked for stand when the budget holds the step with them.
When it does not, the planner doubles one of the two, each time the one whose doubling shrinks the
budget the step needs the most, until the step fits (first with the ring of slots asked for, else
with one slot), no doubling helps any more, or both reach their caps (a chunk of at least one token;
:data:`MAX_LOSS_CHUNKS`, :data:`MAX_MLP_CHUNKS`). Fewer chunks are never worse for speed, so the
smallest counts that fit are the ones taken. Pure arithmetic, torch-free: the prices come from the
caller (``footprint_for``, ``needed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: the most token chunks the head and loss are split into, and sequence chunks for the MLP
MAX_LOSS_CHUNKS = 1024
MAX_MLP_CHUNKS = 256


@dataclass(frozen=True)
class ChunkChoice:
    """The counts chosen, the footprint priced with them, and whether the planner raised them."""

    loss_chunks: int
    mlp_chunks: int
    footprint: Any  # poros.plan.budget.Footprint
    raised: bool  # above what was asked, because the budget needed it
    fits: bool  # the step fits the budget with them (else: the counts that came closest)


def choose_chunks(footprint_for: Callable[[int, int], Any], needed: Callable[[Any, int, int], int], *,
                  loss_chunks: int, mlp_chunks: int, tokens: int, seq_len: int, budget_bytes: int,
                  ring: int, fused_loss: bool = False) -> ChunkChoice:
    """The smallest chunk counts at or above ``loss_chunks`` / ``mlp_chunks`` whose step fits ``budget_bytes``.

    Args:
        footprint_for: ``(loss_chunks, mlp_chunks) -> Footprint``, the activations priced for them.
        needed: ``(footprint, loss_chunks, slots) -> bytes``: the smallest budget a plan with that footprint
            and that many slots needs (nothing resident, the placements the options allow).
        tokens, seq_len: tokens per micro-batch and per example (the caps: a chunk holds one at least).
        ring: the slots asked for; one slot is tried when the ring cannot fit at any count.
        fused_loss: the head is Liger's fused linear cross-entropy: ``loss_chunks`` stays 1 (it does not apply).
    """
    asked = (loss_chunks, mlp_chunks)
    caps = (1 if fused_loss else min(MAX_LOSS_CHUNKS, max(tokens, 1)), min(MAX_MLP_CHUNKS, max(seq_len, 1)))
    best = None
    for slots in dict.fromkeys((ring, 1)):
        counts = asked
        need = needed(footprint_for(*counts), counts[0], slots)
        while need > budget_bytes:
            candidates = [(2 * counts[0], counts[1])] if counts[0] < caps[0] else []
            candidates += [(counts[0], 2 * counts[1])] if counts[1] < caps[1] else []
            priced = [(needed(footprint_for(*c), c[0], slots), c) for c in
                      ((min(a, caps[0]), min(m, caps[1])) for a, m in candidates)]
            if not priced or min(priced)[0] >= need:
                break  # no doubling shrinks what the step needs: the rest is not in the chunks
            need, counts = min(priced, key=lambda item: item[0])
        if best is None or need < best[0]:
            best = (need, counts)
        if need <= budget_bytes:
            break
    need, counts = best
    return ChunkChoice(counts[0], counts[1], footprint_for(*counts), counts != asked, need <= budget_bytes)


def fused_loss_note(loss_chunks: int) -> str:
    """What a plan says when Liger's fused linear cross-entropy computes the head (``kernels: liger``)."""
    asked = f"; it replaces loss_chunks={loss_chunks}" if loss_chunks > 1 else ""
    return ("the head and loss run as Liger's fused linear cross-entropy (kernels: liger): one chunk of logits at a "
            f"time, the whole logits never exist{asked}")


__all__ = ["MAX_LOSS_CHUNKS", "MAX_MLP_CHUNKS", "ChunkChoice", "choose_chunks", "fused_loss_note"]

"""Which blocks keep their activations this step (``StreamOptions.recompute``; the mechanism is ``kept.py``).

* ``"all"``: none (every block saves its input only and is recomputed in backward);
* ``"none"``: every block;
* ``"auto"``: none with CUDA graphs at micro-batches under :data:`GRAPHS_MIN_TOKENS` tokens; else with a VRAM plan, the last ``BudgetPlan.kept_activation_blocks`` (the planner priced them for its
  workload). Without one, on CUDA, the last K blocks, K = the bytes free for kept activations // one block's
  kept bytes at this step's shape (micro-batches x tokens): what is free on the device at the first training
  step less what the rest of the step will still allocate (boundary states, a recompute's and the head's
  working sets, LoRA gradients and AdamW state, ``dequantize_once``'s held copy) and a margin; one block's
  bytes are the footprint's estimate (``ActivationParts.kept``) with a factor until a block of that shape has
  kept its tensors, then the measured bytes, larger or smaller (fused kernels keep less). On a CPU without a plan, none.
  Once, at the second step, the allotment grows by what the first step left unused: the device's peak reserved
  bytes then are a measurement where the first allotment was an estimate (:meth:`RecomputeChoice.refit`; it
  never shrinks, so a run keeps at least what its first step kept). The allotment is for the first step's shape:
  a step whose other needs are larger (longer sequences, more micro-batches: boundary states, a recompute's and
  the head's working sets) gets that much less (:meth:`RecomputeChoice.step_needs`).

The last blocks, because the last of forward are the first of backward: their tensors are held the shortest.
"""

from __future__ import annotations

from typing import Any, Callable

#: with CUDA graphs, auto keeps no block when a micro-batch has fewer tokens: a kept block runs eagerly (its
#: forward keeps an autograd graph, which no replay graph holds), and a short micro-batch's step is bound by
#: launching kernels, not by computing them (docs/results-h200.md, the recompute rows)
GRAPHS_MIN_TOKENS = 2048
#: before a block of the step's shape was measured, its estimate is taken this much larger
UNMEASURED_FACTOR = 1.25
#: what auto leaves free of the device beside the step's own needs, as a fraction of its memory
FREE_MARGIN = 0.08
#: and in bytes, for the allocator's fragmentation and the library workspaces
FREE_MARGIN_BYTES = 2 << 30
#: what the refit leaves free beside the first step's measured peak, as a fraction of the device's memory (with
#: :data:`FREE_MARGIN_BYTES`): smaller than :data:`FREE_MARGIN`, which also covers the estimates' error
REFIT_MARGIN = 0.04


class RecomputeChoice:
    """Decides :meth:`blocks` per step for one executor; ``planned`` is the plan's count (None: no plan);
    ``estimate(hidden)`` the activation parts of one micro-batch shaped like ``hidden`` (``prepare`` passes
    ``poros.plan.footprint.activation_estimate``; None: auto without a plan keeps nothing)."""

    def __init__(self, executor: Any, mode: str, planned: int | None = None,
                 estimate: Callable[[Any], Any] | None = None) -> None:
        self.executor, self.mode, self.planned, self.estimate = executor, mode, planned, estimate
        self.allotted_bytes: int | None = None  # without a plan: decided at the first step
        self.measured: dict[tuple[int, ...], int] = {}  # hidden shape -> largest kept bytes of one block, one micro-batch
        self._parts: dict[tuple[int, ...], Any] = {}
        self.last: frozenset[int] = frozenset()  # the last step's choice (reports)
        self._previous: tuple[tuple[int, ...], int] | None = None  # the last auto step's (hidden shape, micro-batches)
        self._first_needs: int | None = None  # step_needs of the step the allotment was made at
        self.refitted = False

    def blocks(self, hidden: torch.Tensor, micro_batches: int) -> frozenset[int]:
        """The blocks whose forward keeps its saved tensors in a step of ``micro_batches`` micro-batches whose
        block inputs are shaped like ``hidden``."""
        count = len(self.executor.layers)
        if self.mode == "all" or not count or self.executor.options.lora_placement == "host":
            # (host-kept LoRA tensors move with their block: a kept graph would hold stale ones)
            kept = 0
        elif self.mode == "none":
            kept = count
        elif self.executor.graphs is not None and hidden.shape[:-1].numel() < GRAPHS_MIN_TOKENS:
            kept = 0  # launch-bound: an eager kept block costs more than its replayed recompute
        elif self.planned is not None:
            kept = min(count, self.planned)
        elif self.estimate is None:
            kept = 0
        else:
            allotted = self._allotted(hidden, micro_batches)
            if self._first_needs is not None:  # a step that needs more beside its kept blocks keeps fewer
                allotted -= max(0, self.step_needs(hidden, micro_batches) - self._first_needs)
            per_block = micro_batches * self.block_bytes(hidden)
            kept = count if per_block <= 0 else max(0, min(count, allotted // per_block))
            self._previous = (tuple(hidden.shape), micro_batches)
        self.last = frozenset(range(count - kept, count))
        return self.last

    def block_bytes(self, hidden: torch.Tensor) -> int:
        """One block's kept bytes for one micro-batch of this shape: the measured bytes once a block of this shape
        kept its tensors, before that the estimate with :data:`UNMEASURED_FACTOR`.

        The measurement wins in both directions: it counts the storages the block's autograd graph really holds,
        and fused kernels (``kernels: liger``: its RMSNorm and SwiGLU save fewer tensors than the modules they
        replace) hold less than the estimate, which prices transformers' own modules."""
        shape = tuple(hidden.shape)
        if shape in self.measured:
            return self.measured[shape]
        return int(self._activation_parts(hidden).kept * UNMEASURED_FACTOR)

    def note(self, hidden_shape: tuple[int, ...], saved_bytes: int) -> None:
        """A kept block's measured saved bytes (one micro-batch)."""
        self.measured[hidden_shape] = max(self.measured.get(hidden_shape, 0), saved_bytes)

    def _activation_parts(self, hidden: torch.Tensor):
        shape = (tuple(hidden.shape), hidden.dtype)
        if shape not in self._parts:
            self._parts[shape] = self.estimate(hidden)
        return self._parts[shape]

    def _allotted(self, hidden: torch.Tensor, micro_batches: int) -> int:
        if self.allotted_bytes is None:
            self.allotted_bytes = self.free_beside_step(hidden, micro_batches)
            self._first_needs = self.step_needs(hidden, micro_batches)
        elif not self.refitted and self._previous is not None and hidden.device.type == "cuda":
            self.refitted = True
            self.allotted_bytes = max(self.allotted_bytes, self.refit(hidden.device))
        return self.allotted_bytes

    def refit(self, device: Any) -> int:
        """After the first step: the bytes kept blocks may take, measured. What the first step's kept blocks held
        (their count x its micro-batches x one block's measured bytes) plus what its peak left of the memory this
        process may use, less :data:`REFIT_MARGIN` and :data:`FREE_MARGIN_BYTES`, less three LoRA-sized tensors
        (AdamW's two moments, made at the optimizer's first step, and the gradients: micro-major refits at the
        second micro-batch, before either). The memory this process may use is the card's (or the emulated card's)
        less what lies outside its allocator now (the CUDA context, NCCL's buffers, another process). The peak is
        ``max_memory_reserved``: whatever ran before the step (loading the model on the device) only makes it
        larger, and the refit smaller; :meth:`_allotted` never lets it shrink the first allotment."""
        import torch

        capped, free = _capped_memory(device)
        reserved = torch.cuda.memory_reserved(device)
        usable = free + reserved  # the (emulated) card less what lies outside this allocator
        shape, micro_batches = self._previous
        kept_bytes = len(self.last) * micro_batches * self.measured.get(shape, 0)
        # (the reserved bytes now too: a peak reset since, by a memory tracker, leaves the allocator's cache)
        peak = max(torch.cuda.max_memory_reserved(device), reserved)
        room = usable - peak - int(REFIT_MARGIN * capped) - FREE_MARGIN_BYTES
        return max(0, kept_bytes + room - 3 * self.lora_bytes())

    def lora_bytes(self) -> int:
        """The trainable (LoRA) tensors' bytes: one of the three the step allocates beside them (gradients,
        AdamW's two moments)."""
        return sum(p.numel() * p.element_size() for p in self.executor.causal_lm.parameters() if p.requires_grad)

    def step_needs(self, hidden: torch.Tensor, micro_batches: int) -> int:
        """A step's device bytes beside its kept blocks that grow with its shape: the boundary states of its
        micro-batches, a recompute's and the head's working sets (the footprint's estimates)."""
        parts = self._activation_parts(hidden)
        return micro_batches * (len(self.executor.layers) + 2) * parts.boundary + parts.recompute + parts.head

    def free_beside_step(self, hidden: torch.Tensor, micro_batches: int) -> int:
        """Without a plan: the device's free memory now less the rest of the step's needs and a margin (CPU: 0);
        what kept activations get, and what ``dequantize_once`` asks its copy of."""
        import torch

        device = hidden.device
        if device.type != "cuda":
            return 0
        total, free = _capped_memory(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        still_needed = (self.step_needs(hidden, micro_batches) + 3 * self.lora_bytes() + int(FREE_MARGIN * total)
                        + FREE_MARGIN_BYTES)
        held = getattr(self.executor, "dequantize", None)  # dequantize_once's copies, decided before
        still_needed += held.held_bytes() if held is not None and held.on else 0
        return max(0, free + cached - still_needed)


def _capped_memory(device: Any) -> tuple[int, int]:
    """``(total, free)`` bytes of a CUDA device as this process's allocator sees them: under
    ``set_per_process_memory_fraction`` (a smaller card emulated) it stops at that fraction, whatever
    ``mem_get_info`` says is free."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1:
        total = int(fraction * total)
        free = max(0, min(free, total - torch.cuda.memory_reserved(device)))
    return total, free


def kept_activations(footprint: Any, workload: Any, recompute: str, blocks: int, *, headroom: int,
                     slack: float) -> tuple[int, int]:
    """``(blocks, bytes)`` that keep their activations instead of being recomputed (``StreamOptions.recompute``):
    ``"all"`` none, ``"none"`` every block, ``"auto"`` as many as ``headroom`` (the budget less what the plan
    needs) holds with the allocator's slack. A kept block holds ``footprint.kept_bytes`` per micro-batch: M of
    them in layer-major (all M forwards run before its backward), one in micro-major."""
    per_block = footprint.kept_bytes * (workload.grad_accum if workload.schedule == "layer-major" else 1)
    if recompute == "all" or not blocks:
        count = 0
    elif recompute == "none" or per_block <= 0:
        count = blocks
    else:
        count = max(0, min(blocks, int(headroom // (per_block * (1 + slack)))))
    return count, count * per_block


__all__ = ["FREE_MARGIN", "FREE_MARGIN_BYTES", "GRAPHS_MIN_TOKENS", "REFIT_MARGIN", "RecomputeChoice",
           "kept_activations"]

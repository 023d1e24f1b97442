"""How long a step takes: the executor's copies and compute, stage by stage, simulated -- torch-free.

:class:`ComputeTimes` (per-block seconds, from :func:`poros.doctor.probe.probe_compute` or given)
and the link bandwidth give :func:`predict_step`: each stage (a block's forward, for all M
micro-batches layer-major; the head and loss; a block's recompute and backward) starts when the
stage before it is done and its block is in, and a block's copy when the executor issues it, the
copy engine is free and a slot is. :func:`copy_bytes_per_step` is the link's share. The budget
planner (:mod:`poros.plan.budget`, which re-exports all of it) prices its plans with them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from poros.errors import ConfigError
from poros.stream.options import Workload


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of compute for one micro-batch.

    Attributes:
        forward_s: per block, the no-grad forward.
        backward_s: per block, the recompute with grad plus its backward.
        head_s: final norm, head and loss, forward and backward.
        optimizer_s: the optimizer step (once per step).
        source: where the numbers come from, for the plan (``"probe on ..."``, ``"given"``...).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    head_s: float = 0.0
    optimizer_s: float = 0.0
    source: str = "given"

    @classmethod
    def uniform(cls, num_blocks: int, forward_s: float, backward_s: float, head_s: float = 0.0,
                optimizer_s: float = 0.0, source: str = "given") -> "ComputeTimes":
        return cls((forward_s,) * num_blocks, (backward_s,) * num_blocks, head_s, optimizer_s, source)


def copy_bytes_per_step(block_bytes: tuple[int, ...], workload: Workload, resident: Iterable[int] = ()) -> int:
    """Host-to-device bytes of one optimizer step: each streamed block twice per pass (forward,
    backward), the last block once when it streams (it stays on the device across the turn); M
    passes micro-major, one layer-major."""
    return sum(block_bytes[stage.block] for stage in _stages(len(block_bytes), workload, set(resident))
               if stage.copy)


@dataclass(frozen=True)
class _Stage:
    block: int | None  # None: the head and loss
    forward: bool
    copy: bool  # the block must be copied in before this stage computes
    prefetched: bool  # the stage before it issues the copy (the executor prefetches one block ahead)
    pass_start: bool  # the first block of a forward pass: nothing runs before it to hide its copy
    keep: bool  # the block stays in its slot after this stage (the last block, across the turn)


def _stages(num_blocks: int, workload: Workload, resident: set[int]) -> list[_Stage]:
    """The executor's order of work in one optimizer step."""
    last, every = num_blocks - 1, workload.boundary_every
    recomputed_last = every > 1 and last % every > 0  # the last block's segment is recomputed first: it is evicted
    stages: list[_Stage] = []
    for _ in range(workload.grad_accum if workload.schedule == "micro-major" else 1):
        for i in range(num_blocks):
            stages.append(_Stage(i, True, i not in resident, i > 0, i == 0,
                                 i == last and i not in resident and not recomputed_last))
        stages.append(_Stage(None, True, False, False, False, False))
        for top in range(last, -1, -1):
            start = top - top % every
            if top != min(start + every - 1, last):
                continue
            # boundary_every > 1: the segment's inputs first, one forward from its kept one (segments.py)
            for i in range(start, top):
                stages.append(_Stage(i, True, i not in resident, i > start, False, False))
            for i in range(top, start - 1, -1):
                first = i == top and top == start  # no recompute before it: the block above prefetched it
                stages.append(_Stage(i, False, i not in resident and (i != last or recomputed_last),
                                     i != last or recomputed_last if first else True, False, False))
    return stages


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one optimizer step (a per-block pipeline model, see :func:`predict_step`)."""

    step_s: float
    compute_s: float  # every block's forward and backward, the head, the optimizer: M micro-batches
    exposed_copy_s: float  # compute waiting for a copy, pass starts included
    pass_start_copy_s: float  # the part at the start of a forward pass, which no resident set but
    # the first block's can hide
    copy_bound_stages: int  # stages (other than pass starts) that wait for their copy
    copy_s: float  # the link busy time: copy bytes / link
    forward_s: float
    head_s: float
    backward_s: float
    optimizer_s: float
    source: str

    @property
    def copy_hidden(self) -> bool:
        """No stage but the pass starts waits for a copy: the copy is off the critical path."""
        return self.copy_bound_stages == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "copy_hidden": self.copy_hidden}


def predict_step(block_bytes: tuple[int, ...], workload: Workload, compute: ComputeTimes, link_bytes_per_s: float,
                 *, resident: Iterable[int] = (), num_slots: int = 2) -> StepPrediction:
    """Simulate one step's copies and compute, stage by stage, as the executor issues them.

    A stage is one block's forward (layer-major: for all M micro-batches), the head and loss, or
    one block's recompute and backward. A streamed block's copy starts when three things hold:
    the executor has issued it (at the start of the stage before, which prefetches one block
    ahead; at the stage itself at the start of a forward pass), the copy engine is free (one copy
    at a time), and a slot is free (its previous block's compute is done; the last block keeps its
    slot across the turn). A stage computes when the stage before it is done and its block is in.
    With uniform blocks each stage is ``max(copy, compute)``: the copy is on the critical path
    wherever it is the larger.

    Raises:
        ConfigError: compute times for another number of blocks, or a link that is not positive.
    """
    num_blocks = len(block_bytes)
    if len(compute.forward_s) != num_blocks or len(compute.backward_s) != num_blocks:
        raise ConfigError(f"compute times cover {len(compute.forward_s)} forward / {len(compute.backward_s)} backward "
                          f"blocks; the model has {num_blocks}. Give one time per block (or ComputeTimes.uniform).")
    if link_bytes_per_s <= 0:
        raise ConfigError(f"link bandwidth {link_bytes_per_s!r} bytes/s: expected a positive number, e.g. "
                          "--link-gb-per-s 25.")
    resident = set(resident)
    scale = workload.grad_accum if workload.schedule == "layer-major" else 1
    slots = max(1, min(num_slots, num_blocks - len(resident)))
    slot_free = [0.0] * slots
    kept_slot: int | None = None
    clock = copy_engine_free = previous_start = 0.0
    waits = pass_start_waits = 0.0
    copy_bound = 0
    totals = {"forward": 0.0, "head": 0.0, "backward": 0.0}
    for stage in _stages(num_blocks, workload, resident):
        if stage.block is None:
            seconds, kind = compute.head_s * scale, "head"
        elif stage.forward:
            seconds, kind = compute.forward_s[stage.block] * scale, "forward"
        else:
            seconds, kind = compute.backward_s[stage.block] * scale, "backward"
        ready = clock
        slot = None
        if stage.copy:
            slot = min(range(slots), key=slot_free.__getitem__)
            issued = previous_start if stage.prefetched else clock
            copy_start = max(issued, copy_engine_free, slot_free[slot])
            copy_engine_free = ready = copy_start + block_bytes[stage.block] / link_bytes_per_s
        start = max(clock, ready)
        wait = start - clock
        if wait > 1e-12:
            if stage.pass_start:
                pass_start_waits += wait
            else:
                copy_bound += 1
            waits += wait
        clock = start + seconds
        totals[kind] += clock - start + wait
        previous_start = start
        if slot is not None:
            if stage.keep:
                slot_free[slot], kept_slot = math.inf, slot
            else:
                slot_free[slot] = clock
        if kept_slot is not None and stage.block == num_blocks - 1 and not stage.forward:
            slot_free[kept_slot], kept_slot = clock, None
    compute_s = clock - waits + compute.optimizer_s
    copy_s = copy_bytes_per_step(block_bytes, workload, resident) / link_bytes_per_s
    return StepPrediction(step_s=clock + compute.optimizer_s, compute_s=compute_s, exposed_copy_s=waits,
                          pass_start_copy_s=pass_start_waits, copy_bound_stages=copy_bound, copy_s=copy_s,
                          forward_s=totals["forward"], head_s=totals["head"], backward_s=totals["backward"],
                          optimizer_s=compute.optimizer_s, source=compute.source)


def parse_block_ms(text: str) -> tuple[float, float]:
    """``"6,12"`` -> ``(0.006, 0.012)`` seconds; ``"18"`` -> ``(0.006, 0.012)`` (split 1:2).

    Raises:
        ConfigError: not one or two positive numbers.
    """
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v <= 0 for v in values):
        raise ConfigError(f"--block-ms {text!r}: expected FWD,BWD milliseconds per block and micro-batch (e.g. 6,12) "
                          "or one total (split 1:2 between forward and recompute+backward).")
    if len(values) == 1:
        return values[0] / 3000, 2 * values[0] / 3000
    return values[0] / 1000, values[1] / 1000


__all__ = ["parse_block_ms", "ComputeTimes", "StepPrediction", "copy_bytes_per_step", "predict_step"]

"""What the budget planner decided (:class:`BudgetPlan`, :func:`poros.plan.budget.plan_budget`'s answer):
the slots, the resident blocks, where the embedding tables, the boundary states, AdamW's state and the LoRA
tensors go, the chunk counts, the predicted peak and step, the budget that would take the copy off the
critical path, and the notes that say why, in words (:meth:`BudgetPlan.summary`, what ``prepare`` logs and
``poros plan`` prints). Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from poros.stream.options import Workload
from poros.plan.step_time import StepPrediction, copy_bytes_per_step
from poros.spellings import format_gb
from poros.plan.peak import Footprint, PeakBreakdown


@dataclass(frozen=True)
class BudgetPlan:
    """What the planner decided for a VRAM budget, and what it predicts.

    Attributes:
        budget_bytes: the budget as given (device memory the process may use).
        context_bytes, slack: what the budget must also hold: the CUDA context outside PyTorch's
            allocator, and the allocator's reserved-over-allocated slack (a fraction of the peak).
        num_slots: slots in the ring (``requested_slots`` unless the budget cannot hold them, and
            never more than the streamed blocks).
        resident_blocks: blocks kept on the device for good, the last ones first.
        embeddings_on_host: embedding tables looked up on the host.
        peak: the predicted peak allocated bytes and its parts.
        needed_bytes: what this plan needs of the budget: context + peak x (1 + slack).
        copy_bytes_per_step: host-to-device bytes per optimizer step.
        step: the predicted step time, or None without compute times and a link bandwidth.
        boundary_states: where layer-major keeps its M x L boundary states: ``"device"``, or
            ``"host"`` when the budget cannot hold them (or when asked), or ``"disk"`` when the host
            budget cannot hold them beside the streamed blocks either (or when asked).
        minimum_bytes: the smallest budget any plan fits in (1 slot, nothing resident, embeddings
            on the host when they may be, boundary states where this plan keeps them);
            ``pipelined_minimum_bytes`` with the requested slots.
        boundary_offload_minimum_bytes: the minimum with the boundary states on the host
            (layer-major; the same as ``minimum_bytes`` otherwise).
        hide_copy_resident: the fewest resident blocks (the last ones) for which no stage but the
            pass starts waits for a copy; None when unknown (no compute times).
        hide_copy_bytes, hide_copy_peak_bytes: the budget that plan needs, and its peak allocated.
        hide_copy_step: that plan's step prediction.
        notes: the decisions, in words.
        optimizer_states: where AdamW's state lives: ``"device"``, or ``"host"`` (``HostAdamW``; asked, or no ring fit).
        footprint: the footprint the plan was made for (its chunk counts: those asked for, raised when the
            budget cannot hold the step otherwise, :mod:`poros.plan.chunk_choice`); ``workload`` carries the
            same ``loss_chunks``. ``block_bytes``, ``num_blocks``, ``mlp_chunks``, ``parts`` (the
            sequence-proportional activations by name, per micro-batch) and ``attention`` (the kernel the
            estimate assumes, and why) are read from it, ``loss_chunks`` from ``workload``.
        kept_activation_blocks, kept_activation_bytes: how many blocks (the last ones) keep their activations
            instead of being recomputed, and the bytes they hold at once
            (:func:`poros.stream.recompute_choice.kept_activations`; beside ``peak``, in the budget it leaves).
    """

    budget_bytes: int
    context_bytes: int
    slack: float
    workload: Workload
    footprint: Footprint
    requested_slots: int
    num_slots: int
    resident_blocks: tuple[int, ...]
    embeddings_on_host: bool
    boundary_states: str
    peak: PeakBreakdown
    needed_bytes: int
    copy_bytes_per_step: int
    link_bytes_per_s: float | None
    step: StepPrediction | None
    minimum_bytes: int
    pipelined_minimum_bytes: int
    boundary_bytes: int
    boundary_offload_minimum_bytes: int
    hide_copy_resident: int | None
    hide_copy_bytes: int | None
    hide_copy_peak_bytes: int | None
    hide_copy_step: StepPrediction | None
    notes: tuple[str, ...]
    optimizer_states: str = "device"
    lora_placement: str = "device"
    kept_activation_blocks: int = 0
    kept_activation_bytes: int = 0
    boundary_every: int = 1

    @property
    def block_bytes(self) -> tuple[int, ...]:
        return self.footprint.block_bytes

    @property
    def num_blocks(self) -> int:
        return self.footprint.num_blocks

    @property
    def loss_chunks(self) -> int:
        return self.workload.loss_chunks

    @property
    def mlp_chunks(self) -> int:
        return self.footprint.mlp_chunks

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        return self.footprint.parts

    @property
    def attention(self) -> str:
        return self.footprint.attention

    def summary(self) -> str:
        """The decision in one line, for the ``poros`` logger."""
        resident = (f"{len(self.resident_blocks)} of {self.num_blocks} blocks resident "
                    f"({self.resident_blocks[0]}..{self.resident_blocks[-1]})" if self.resident_blocks
                    else f"no resident block of {self.num_blocks}")
        step = f", predicted step {self.step.step_s:.3f} s" if self.step else ""
        boundary = f", boundary states on the {self.boundary_states}" if self.boundary_states != "device" else ""
        boundary += (f", loss_chunks={self.loss_chunks}" if self.loss_chunks > 1 else "") + (
            f", mlp_chunks={self.mlp_chunks}" if self.mlp_chunks > 1 else "")
        boundary += ", AdamW state on the host" if self.optimizer_states == "host" else ""
        boundary += ", LoRA tensors on the host" if self.lora_placement == "host" else ""
        boundary += f", {self.kept_activation_blocks} blocks keep their activations" if self.kept_activation_blocks else ""
        return (f"poros: VRAM budget {format_gb(self.budget_bytes)}: {resident}, {self.num_slots} device slot"
                f"{'s' if self.num_slots != 1 else ''}, embeddings on the {'host' if self.embeddings_on_host else 'device'}"
                f"{boundary}"
                f"; predicted peak {format_gb(self.peak.total)} allocated ({format_gb(self.needed_bytes)} with the "
                f"context and allocator slack), {format_gb(self.copy_bytes_per_step)} copied per step{step}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("peak", "step", "hide_copy_step", "workload", "footprint")}
        out.update(num_blocks=self.num_blocks, loss_chunks=self.loss_chunks, mlp_chunks=self.mlp_chunks,
                   parts=self.parts, attention=self.attention, workload=asdict(self.workload), peak=self.peak.to_dict(),
                   step=self.step.to_dict() if self.step else None,
                   hide_copy_step=self.hide_copy_step.to_dict() if self.hide_copy_step else None,
                   resident_blocks=list(self.resident_blocks), notes=list(self.notes))
        return out


__all__ = ["BudgetPlan"]

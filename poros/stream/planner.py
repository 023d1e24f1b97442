"""The budget model: pure arithmetic on bytes and seconds, torch-free (no tensor is touched).

A run's device bytes by kind (:class:`Footprint`, measured by :mod:`poros.stream.footprint` from a
loaded model or a meta skeleton) and the shape of its step (:class:`Workload`) give:

* **the peak** (:func:`predict_peak`), the one peak model: the largest of a step's phases -- the
  forward-backward turn (all boundary states + the head's working set), a block's recompute and
  backward (its working set + the LoRA gradients + the boundary states still held), the optimizer
  step -- on top of the slots, the resident blocks, the modules outside the blocks and the LoRA
  parameters with their AdamW state. Checked against the H200 bench records (docs/results-h200.md;
  ``tests/test_planner.py`` holds them to 15 %). :func:`peak_upper_bound` adds the same parts
  all at once (the dry run's estimate).
* **the step** (:func:`predict_step`, from :mod:`poros.stream.step_time`): with per-block compute
  times (:class:`ComputeTimes`) and the link bandwidth, a simulation of the executor's copies and
  compute stage by stage.
* **the budget plan** (:func:`plan_budget`): embedding tables to the host, the slot ring, then as
  many resident blocks as fit, the last ones first; and the budget that takes the copy off the
  critical path.

``prepare(vram_budget=...)`` asks it through :func:`poros.stream.footprint.plan_for_model`;
``poros plan`` through the dry-run plan (:mod:`poros.training.plan`) and prints it with
:mod:`poros.cli.report`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from poros.config import parse_budget
from poros.errors import ConfigError
from poros.stream import optimizer_states as adamw_states
from poros.stream.chunk_choice import ChunkChoice, choose_chunks
from poros.stream.options import SCHEDULES, StreamOptions, Workload
from poros.stream.step_time import ComputeTimes, StepPrediction, copy_bytes_per_step, predict_step
from poros.stream.units import format_gb, human_bytes

#: LoRA tensors are fp32 (PEFT upcasts adapters of a 4-bit base): parameter + gradient + AdamW exp_avg
#: and exp_avg_sq, 4 bytes each.
LORA_VALUE_BYTES = 4
LORA_BYTES_PER_PARAMETER = 4 * LORA_VALUE_BYTES
#: cuBLAS / cuBLASLt workspaces, allocated through PyTorch's caching allocator on CUDA (estimate).
CUDA_WORKSPACE_BYTES = 64 * 2**20
#: what the CUDA context and the libraries' own allocations take outside PyTorch's allocator
#: (estimate; `nvidia-smi` shows it as the process's memory before the first tensor).
CUDA_CONTEXT_BYTES = 512 * 2**20
#: reserved minus allocated: the caching allocator's slack over the peak it serves, above what the H200
#: runs with expandable_segments measured (docs/results-h200.md).
ALLOCATOR_SLACK = 0.20


@dataclass(frozen=True)
class Footprint:
    """Device bytes of one run, by kind; activations per micro-batch (see :func:`activation_bytes`).

    Attributes:
        block_bytes: each decoder block's packed bytes (exact).
        device_non_block_bytes: frozen tensors outside the blocks that stay on the device (head,
            norms, rotary...), the embedding tables counted in ``host_embedding_bytes`` excluded.
        host_embedding_bytes: embedding tables that may live on the host (``embeddings_on_host``).
        lora_parameter_bytes: the trainable (LoRA) parameters; their gradients are as large, their
            AdamW state twice, AdamW's step one more copy for a moment.
        boundary_bytes, recompute_bytes, head_bytes: per micro-batch.
        workspace_bytes: library workspaces inside the allocator (cuBLAS on CUDA).
        parts: the sequence-proportional activations by name (per micro-batch; what ``poros plan``
            tabulates: attention, MLP, head and loss...), or empty where unknown.
        attention: the attention kernel the estimate assumes and why, in words.
        loss_chunks, mlp_chunks: the chunk counts the activations are estimated for.
        attention_sms: the SM count the flash backward's deterministic dQ accumulator is split by (0: not
            split; :func:`poros.stream.footprint.attention_sms`), a fact of the device and the run's mode.
    """

    block_bytes: tuple[int, ...]
    device_non_block_bytes: int
    host_embedding_bytes: int
    lora_parameter_bytes: int
    boundary_bytes: int
    recompute_bytes: int
    head_bytes: int
    workspace_bytes: int = 0
    parts: tuple[tuple[str, int], ...] = ()
    attention: str = ""
    loss_chunks: int = 1
    mlp_chunks: int = 1
    attention_sms: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)


@dataclass(frozen=True)
class PeakBreakdown:
    """The predicted peak of allocated device memory and what it is made of.

    ``persistent`` parts live through the whole step; ``phase`` names the moment the peak falls in
    and ``transient`` its parts (boundary states, working sets, gradients at that moment).
    """

    persistent: tuple[tuple[str, int], ...]
    phase: str
    transient: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.persistent) + sum(n for _, n in self.transient)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "phase": self.phase, "persistent": dict(self.persistent),
                "transient": dict(self.transient)}


def predict_peak(footprint: Footprint, workload: Workload, *, resident: Iterable[int] = (), num_slots: int = 2,
                 embeddings_on_host: bool = True, boundary_on_host: bool = False,
                 optimizer_on_host: bool = False, lora_on_host: bool = False) -> PeakBreakdown:
    """The peak allocated device bytes of a step: the largest of its three phases.

    Persistent: the slot ring (``min(num_slots, streamed blocks)`` x the largest streamed block),
    resident blocks, the modules outside the blocks, LoRA parameters and AdamW state (from the
    first step on), workspaces. On top, per phase (M micro-batches, L blocks, B one boundary, G
    the LoRA gradients):

    * **turn** (head and loss of a micro-batch): the boundary states saved so far (L x B;
      layer-major M x L x B plus each micro-batch's output and gradient) + the head's working set
      (+ G in micro-major from the second micro-batch on, as gradients accumulate);
    * **backward** (one block recomputed): its working set + G + the boundary states still held
      (micro-major frees each as its block is done, so the larger of L x B at the first backward
      block and G at the last; layer-major keeps all M x L until the step's backward is over);
    * **optimizer**: G + AdamW's temporary (one more copy of the LoRA parameters).

    ``optimizer_on_host``: AdamW's state in host memory (``HostAdamW``), only chunks in flight on the device.
    ``lora_on_host`` (with it): the streamed blocks' LoRA tensors on the host, those of the slots' blocks on the device.

    ``boundary_on_host`` (layer-major): the boundary states wait in host memory; on the device
    only the M prelude outputs (HF's graph holds them) and those in flight: at the turn each
    micro-batch's output and its gradient (3 x M x B with the prelude's), in backward the block's
    M inputs, the next block's M arriving and the M gradients (4 x M x B).
    Micro-major keeps its boundary states on the device (autograd saves them): ignored there.
    """
    resident = set(resident)
    streamed = [n for i, n in enumerate(footprint.block_bytes) if i not in resident]
    slots = min(num_slots, len(streamed))
    lora = footprint.lora_parameter_bytes
    staying, lora_persistent = adamw_states.lora_parts(lora, footprint.num_blocks, len(streamed), slots,
                                                       states_on_host=optimizer_on_host, lora_on_host=lora_on_host)
    persistent = [
        (f"device slots ({slots} x largest streamed block)", slots * max(streamed, default=0)),
        (f"resident blocks ({len(resident)})", sum(footprint.block_bytes[i] for i in resident)),
        ("modules outside the blocks (head, norms)", footprint.device_non_block_bytes),
        ("embedding tables", 0 if embeddings_on_host else footprint.host_embedding_bytes),
        *lora_persistent,
        ("library workspaces", footprint.workspace_bytes),
    ]
    micro, blocks = workload.grad_accum, footprint.num_blocks
    boundary = footprint.boundary_bytes
    if workload.schedule == "layer-major" and boundary_on_host:
        turn = [("boundary states on the device (M prelude outputs, M outputs, their gradients; the rest on "
                 "the host)", 3 * micro * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states on the device (M prelude outputs, this block's M inputs, the next block's, "
                     "M gradients)", 4 * micro * boundary),
                    ("LoRA gradients", staying), ("one block's recompute working set", footprint.recompute_bytes)]
    elif workload.schedule == "layer-major":
        turn = [("boundary states (M x L) + outputs and their gradients", micro * (blocks + 2) * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states (M x L, kept until backward ends)", micro * (blocks + 1) * boundary),
                    ("LoRA gradients", staying), ("one block's recompute working set", footprint.recompute_bytes)]
    else:
        accumulated = lora if micro > 1 else 0  # gradients of the earlier micro-batches
        turn = [("boundary states (L)", blocks * boundary), ("head and loss working set", footprint.head_bytes),
                ("LoRA gradients (earlier micro-batches)", accumulated)]
        first_block = blocks * boundary + max(accumulated, lora // max(blocks, 1))
        last_block = 2 * boundary + lora
        backward = [("boundary states and LoRA gradients still held", max(first_block, last_block)),
                    ("one block's recompute working set", footprint.recompute_bytes)]
    optimizer = adamw_states.step_bytes(lora, states_on_host=optimizer_on_host,
                                        staying=staying if lora_on_host else None)
    phases = {"head and loss (forward-backward turn)": turn, "block recompute and backward": backward,
              "optimizer step": optimizer}
    phase = max(phases, key=lambda name: sum(n for _, n in phases[name]))
    return PeakBreakdown(tuple(persistent), phase, tuple(phases[phase]))


def peak_upper_bound(footprint: Footprint, workload: Workload, *, num_slots: int = 2,
                     embeddings_on_host: bool = True) -> int:
    """The same parts as :func:`predict_peak`, all at once: an upper bound (the head's and a block's
    working sets never coincide), what ``poros train --dry-run`` prints as its peak estimate. The
    ring (``num_slots`` x the largest block), the modules outside the blocks (and the embedding
    tables unless on the host), the LoRA parameters with their gradients and AdamW state (4 x),
    every boundary state (M x L layer-major), one block's recompute and the head's working set;
    no workspace."""
    micro = workload.grad_accum if workload.schedule == "layer-major" else 1
    return (num_slots * max(footprint.block_bytes, default=0) + footprint.device_non_block_bytes
            + (0 if embeddings_on_host else footprint.host_embedding_bytes)
            + (LORA_BYTES_PER_PARAMETER // LORA_VALUE_BYTES) * footprint.lora_parameter_bytes
            + micro * footprint.num_blocks * footprint.boundary_bytes
            + footprint.recompute_bytes + footprint.head_bytes)


def budget_for_peak(peak_bytes: int, *, context_bytes: int, slack: float) -> int:
    """The device memory a peak of ``peak_bytes`` allocated needs: context + peak x (1 + slack)."""
    return context_bytes + math.ceil(peak_bytes * (1 + slack))


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
        loss_chunks, mlp_chunks: the chunk counts the plan runs with: those asked for, raised when the
            budget cannot hold the step otherwise (:mod:`poros.stream.chunk_choice`).
        parts: the footprint's sequence-proportional activations by name (per micro-batch).
        attention: the attention kernel the estimate assumes, and why.
    """

    budget_bytes: int
    context_bytes: int
    slack: float
    workload: Workload
    num_blocks: int
    block_bytes: tuple[int, ...]
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
    loss_chunks: int = 1
    mlp_chunks: int = 1
    parts: tuple[tuple[str, int], ...] = ()
    attention: str = ""

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
        return (f"poros: VRAM budget {format_gb(self.budget_bytes)}: {resident}, {self.num_slots} device slot"
                f"{'s' if self.num_slots != 1 else ''}, embeddings on the {'host' if self.embeddings_on_host else 'device'}"
                f"{boundary}"
                f"; predicted peak {format_gb(self.peak.total)} allocated ({format_gb(self.needed_bytes)} with the "
                f"context and allocator slack), {format_gb(self.copy_bytes_per_step)} copied per step{step}")

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("peak", "step", "hide_copy_step", "workload",
                                                                   "block_bytes")}
        out.update(workload=asdict(self.workload), peak=self.peak.to_dict(),
                   step=self.step.to_dict() if self.step else None,
                   hide_copy_step=self.hide_copy_step.to_dict() if self.hide_copy_step else None,
                   resident_blocks=list(self.resident_blocks), notes=list(self.notes))
        return out


def _fits_plan(footprint: Footprint, workload: Workload, resident: int, slots: int, on_host: bool,
               context_bytes: int, slack: float, boundary_on_host: bool = False,
               optimizer_on_host: bool = False, lora_on_host: bool = False) -> tuple[PeakBreakdown, int]:
    last = footprint.num_blocks
    peak = predict_peak(footprint, workload, resident=range(last - resident, last), num_slots=slots,
                        embeddings_on_host=on_host, boundary_on_host=boundary_on_host,
                        optimizer_on_host=optimizer_on_host, lora_on_host=lora_on_host)
    return peak, budget_for_peak(peak.total, context_bytes=context_bytes, slack=slack)


@dataclass(frozen=True)
class _Sizing:
    """What a plan needs of the budget, with the embedding, AdamW-state and LoRA placements fixed."""

    footprint: Footprint
    workload: Workload
    on_host: bool  # the embedding tables
    context_bytes: int
    slack: float
    optimizer_on_host: bool = False
    lora_on_host: bool = False

    @property
    def layer_major(self) -> bool:
        return self.workload.schedule == "layer-major"

    def peak(self, resident: int, slots: int, boundary_on_host: bool) -> tuple[PeakBreakdown, int]:
        """The peak, and the budget it needs, with the last ``resident`` blocks resident and ``slots`` slots."""
        return _fits_plan(self.footprint, self.workload, resident, slots, self.on_host, self.context_bytes,
                          self.slack, boundary_on_host, self.optimizer_on_host, self.lora_on_host)

    def needed(self, resident: int, slots: int, boundary_on_host: bool) -> int:
        return self.peak(resident, slots, boundary_on_host)[1]


@dataclass(frozen=True)
class _Boundary:
    """Where layer-major's boundary states wait, and the minimum budgets of either place."""

    offload: bool  # on the host
    automatic: bool  # the planner put them there (the budget cannot hold them beside the ring)
    device_minimum: int
    offload_minimum: int
    accepted_minimum: int  # the smallest budget this plan accepts


def _choose_states(sizing: _Sizing, options: StreamOptions, budget_bytes: int) -> tuple[_Sizing, str]:
    """AdamW's state and the streamed blocks' LoRA tensors: where ``options`` say; under ``"auto"`` the
    host only when the ring asked for does not fit with them on the device, nothing resident and the
    boundary states wherever they may go (see ``adamw_states.choose``)."""
    places = {"device": (False,), "host": (True,), "disk": (True,)}.get(options.boundary_states,
                                                                       (False, sizing.layer_major))
    states = adamw_states.choose(options.optimizer_states, lambda: any(
        sizing.needed(0, options.num_slots, boundary) <= budget_bytes for boundary in places))
    sizing = dataclasses.replace(sizing, optimizer_on_host=states == "host")
    lora = adamw_states.choose_lora(options.lora_placement, states, sizing.layer_major, lambda: any(
        sizing.needed(0, options.num_slots, boundary) <= budget_bytes for boundary in places))
    return dataclasses.replace(sizing, lora_on_host=lora == "host"), states


def _choose_boundary(sizing: _Sizing, options: StreamOptions, budget_bytes: int) -> _Boundary:
    """To the host only when no plan with the ring asked for fits with them on the device, and the
    host plan does fit -- with the ring, or at all where the device cannot hold even one slot -- and
    then with no resident block (so a bigger budget never keeps fewer blocks resident); or when asked."""
    layer_major, asked, ring = sizing.layer_major, options.boundary_states, options.num_slots
    device_minimum = sizing.needed(0, 1, False)
    offload_minimum = sizing.needed(0, 1, True) if layer_major else device_minimum
    automatic = asked is None and layer_major and offload_minimum <= budget_bytes and not any(
        sizing.needed(k, ring, False) <= budget_bytes for k in range(sizing.footprint.num_blocks + 1)) and (
        sizing.needed(0, ring, True) <= budget_bytes or device_minimum > budget_bytes)
    return _Boundary(offload=layer_major and (automatic or asked in ("host", "disk")), automatic=automatic,
                     device_minimum=device_minimum, offload_minimum=offload_minimum,
                     accepted_minimum=_accepted_minimum(device_minimum, offload_minimum, layer_major, asked))


def _refuse_below_minimum(sizing: _Sizing, options: StreamOptions, budget_bytes: int, boundary: _Boundary) -> None:
    """Raise when no plan fits, naming the placement that reaches the smallest budget.

    Raises:
        ConfigError: the budget, the minimum, and what the minimum's peak is made of.
    """
    if budget_bytes >= boundary.accepted_minimum:
        return
    workload, asked = sizing.workload, options.boundary_states
    host = sizing.layer_major and (asked in ("host", "disk") or (asked is None
                                                       and boundary.offload_minimum < boundary.device_minimum))
    minimum_peak, minimum = sizing.peak(0, 1, host)
    pipelined = sizing.needed(0, options.num_slots, host)
    where = " (boundary states on the host)" if host else ""
    other = (f" With the boundary states on the host it would need {format_gb(boundary.offload_minimum)}."
             if asked == "device" and sizing.layer_major and boundary.offload_minimum < boundary.device_minimum
             else "")
    fp = sizing.footprint
    chunks = (f" (with loss_chunks={fp.loss_chunks}, mlp_chunks={fp.mlp_chunks})"
              if fp.loss_chunks > 1 or fp.mlp_chunks > 1 else "")
    raise ConfigError(  # one line: the parts of the peak are `poros plan`'s table at the minimum
        f"VRAM budget {format_gb(budget_bytes)} does not fit this run{chunks}: its biggest part is "
        f"{biggest_part(minimum_peak, fp)}; the budget is below the minimum for this run, {format_gb(minimum)} "
        f"({human_bytes(minimum)}; 1 device slot, no resident block{', embeddings on the host' if sizing.on_host else ''}"
        f"{where}; {format_gb(pipelined)} with {options.num_slots} slots).{other} Fix: --vram-budget "
        f"{format_gb(minimum).replace(' ', '')} or more (poros plan then prints the parts of the peak), or shrink "
        f"the activations (seq_len, batch_size{', or micro-major accumulation' if sizing.layer_major and workload.grad_accum > 1 else ''})."
    )


def biggest_part(peak: PeakBreakdown, footprint: Footprint) -> str:
    """The largest part of ``peak``, ``"name (size)"``; a working set of several parts (a block's recompute,
    the head and loss) with its own largest part named beside it."""
    name, size = max((*peak.persistent, *peak.transient), key=lambda part: part[1])
    within = {"one block's recompute working set": "block recompute", "head and loss working set": ("head", "loss")}
    prefix = within.get(name)
    inner = [part for part in footprint.parts if prefix and part[0].startswith(prefix)]
    if inner:
        inner_name, inner_size = max(inner, key=lambda part: part[1])
        return f"{name} ({format_gb(size)}; most of it {inner_name}, {format_gb(inner_size)})"
    return f"{name} ({format_gb(size)})"


def _ring_and_resident(sizing: _Sizing, options: StreamOptions, budget_bytes: int,
                       boundary: _Boundary) -> tuple[int, int]:
    """``(slots, resident blocks)``. The ring first: a second slot overlaps every copy, a resident block
    saves one. So resident blocks only with the ring asked for (as many slots as blocks still stream,
    at most); without room for it, fewer slots and nothing resident. A bigger budget never means fewer
    resident blocks (so an automatic host placement, boundary or AdamW state, keeps none). The budget
    is filled: a block resident beyond the ones that hide the copy still saves its copies (and a
    smaller choice could need more memory: a resident block can take less than a slot)."""
    automatic_host = boundary.automatic or (sizing.optimizer_on_host and options.optimizer_states == "auto") or (
        sizing.lora_on_host and options.lora_placement == "auto")
    fitting = [k for k in range(sizing.footprint.num_blocks + 1)
               if sizing.needed(k, options.num_slots, boundary.offload) <= budget_bytes and not (automatic_host and k)]
    slots = options.num_slots
    while not fitting and slots > 1 and sizing.needed(0, slots, boundary.offload) > budget_bytes:
        slots -= 1
    return slots, max(fitting, default=0)


def _hiding_copy(sizing: _Sizing, options: StreamOptions, boundary: _Boundary, compute: ComputeTimes,
                 link_bytes_per_s: float) -> tuple[int, int, int, StepPrediction]:
    """``(resident, budget, peak, step)`` of the fewest resident blocks (the last ones) that take the
    copy off the critical path with the ring asked for, whatever this budget holds. Resident blocks
    come with the states on the device unless asked otherwise (an automatic host placement keeps
    none), so that is the placement the hiding budget is priced in."""
    blocks = sizing.footprint.num_blocks

    def step_for(resident: int) -> StepPrediction:
        return predict_step(sizing.footprint.block_bytes, sizing.workload, compute, link_bytes_per_s,
                            resident=range(blocks - resident, blocks), num_slots=options.num_slots)

    resident = next(k for k in range(blocks + 1) if step_for(k).copy_hidden)
    peak, needed = sizing.peak(resident, options.num_slots, boundary.offload and not boundary.automatic)
    return resident, needed, peak.total, step_for(resident)


def plan_budget(footprint: Footprint, workload: Workload, options: StreamOptions, *,
                compute: ComputeTimes | None = None, link_bytes_per_s: float | None = None, context_bytes: int = 0,
                slack: float = ALLOCATOR_SLACK,
                footprint_for: Callable[[int, int], Footprint] | None = None) -> BudgetPlan:
    """Decide slots, resident blocks, embedding and boundary-state placement for ``options.vram_budget``;
    predict peak and step.

    Rules: embedding tables go to the host (only the looked-up rows cross the link) unless
    ``options.embeddings_on_host`` is False; layer-major's M x L boundary states go to the host when the
    budget cannot hold them beside the ring asked for (``options.boundary_states`` forces either); the
    ring gets ``options.num_slots`` slots, fewer only when the budget cannot hold them (with 1 slot
    every copy waits); the rest of the budget makes blocks resident, the last ones first (the last of
    forward are the first of backward). AdamW's state and the LoRA tensors go where
    ``options.optimizer_states`` / ``options.lora_placement`` say (``"auto"``: the host only when the
    ring does not fit with them on the device). With compute times it also finds the fewest resident
    blocks that take the copy off the critical path, and the budget they need.

    Args:
        footprint: the model's bytes and the run's activations.
        workload: the step's shape.
        options: the run's :class:`~poros.stream.options.StreamOptions`; ``vram_budget`` (``"7GiB"``,
            ``"24GB"``, an int of bytes) is the device memory the process may use.
        compute, link_bytes_per_s: for the step-time prediction (both, or neither).
        context_bytes: memory outside PyTorch's allocator (:data:`CUDA_CONTEXT_BYTES` on CUDA, 0 on CPU).
        slack: allocator slack, a fraction of the peak.
        footprint_for: ``(loss_chunks, mlp_chunks) -> Footprint`` (``footprint.chunked_footprints``): with
            it the plan may raise the chunk counts when the budget cannot hold the step with those asked
            for (:func:`poros.stream.chunk_choice.choose_chunks`); without, they stand.

    Layer-major's boundary states, once off the device, go to disk instead of pinned host memory when
    ``options.boundary_states`` says ``"disk"``, or when ``options.host_budget`` cannot hold them beside
    the streamed blocks.

    Raises:
        ConfigError: no budget, or a budget below the minimum (the message names the minimum and what
            the peak is made of); ``lora_placement="host"`` without AdamW's state on the host and
            layer-major.
    """
    if options.vram_budget is None:
        raise ConfigError("plan_budget got options without a vram_budget; expected the device memory to plan for. "
                          "Pass e.g. StreamOptions(vram_budget='12GiB').")
    budget_bytes = parse_budget(options.vram_budget)
    on_host = options.embeddings_on_host is not False and footprint.host_embedding_bytes > 0
    chosen, asked_chunks = None, (workload.loss_chunks, options.mlp_chunks)
    if footprint_for is not None:
        chosen = _choose_chunks(footprint_for, workload, options, budget_bytes, on_host, context_bytes, slack)
        footprint, workload = chosen.footprint, dataclasses.replace(workload, loss_chunks=chosen.loss_chunks)
    sizing, states = _choose_states(_Sizing(footprint, workload, on_host, context_bytes, slack), options,
                                    budget_bytes)
    boundary = _choose_boundary(sizing, options, budget_bytes)
    _refuse_below_minimum(sizing, options, budget_bytes, boundary)
    slots, resident = _ring_and_resident(sizing, options, budget_bytes, boundary)
    timed = compute is not None and link_bytes_per_s is not None
    hiding = _hiding_copy(sizing, options, boundary, compute, link_bytes_per_s) if timed else (None,) * 4
    blocks = footprint.num_blocks
    resident_blocks = tuple(range(blocks - resident, blocks))
    peak, needed = sizing.peak(resident, slots, boundary.offload)
    step = predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s, resident=resident_blocks,
                        num_slots=slots) if timed else None
    boundary_total = footprint.boundary_bytes * blocks * (workload.grad_accum if sizing.layer_major else 1)
    notes = _notes(sizing, options, budget_bytes, boundary, slots, resident, hiding[0], compute, link_bytes_per_s)
    place = _boundary_place(boundary, options, footprint, resident_blocks, boundary_total)
    if place == "disk":
        notes = [n if not n.startswith("boundary states on the host") else n.replace(
            "boundary states on the host", "boundary states on disk (files under the cache's spill/ directory)", 1)
            .replace("in pinned memory", "written and read back") for n in notes]
        notes.append(f"boundary states on disk because {'it was asked' if options.boundary_states == 'disk' else ''}"
                     + ("" if options.boundary_states == "disk" else
                        f"the host budget ({format_gb(parse_budget(options.host_budget, 'host_budget'))}) cannot hold "
                        f"them ({format_gb(boundary_total)}) beside the streamed blocks "
                        f"({format_gb(_streamed_bytes(footprint, resident_blocks))})"))
    if chosen is not None and chosen.raised:
        notes.insert(0, f"loss_chunks={chosen.loss_chunks}, mlp_chunks={chosen.mlp_chunks} (asked "
                        f"{asked_chunks[0]} and {asked_chunks[1]}): "
                        "the budget cannot hold the step with fewer chunks; the head and loss run "
                        f"{chosen.loss_chunks} token chunks at a time and each block's MLP {chosen.mlp_chunks} "
                        "sequence chunks")
    return BudgetPlan(
        budget_bytes=budget_bytes, context_bytes=context_bytes, slack=slack, workload=workload, num_blocks=blocks,
        block_bytes=footprint.block_bytes, requested_slots=options.num_slots, num_slots=min(slots, blocks - resident),
        resident_blocks=resident_blocks, embeddings_on_host=on_host,
        boundary_states=place, peak=peak, needed_bytes=needed,
        copy_bytes_per_step=copy_bytes_per_step(footprint.block_bytes, workload, resident_blocks),
        link_bytes_per_s=link_bytes_per_s, step=step, minimum_bytes=boundary.accepted_minimum,
        pipelined_minimum_bytes=sizing.needed(0, options.num_slots, boundary.offload), boundary_bytes=boundary_total,
        boundary_offload_minimum_bytes=boundary.offload_minimum, hide_copy_resident=hiding[0],
        hide_copy_bytes=hiding[1], hide_copy_peak_bytes=hiding[2], hide_copy_step=hiding[3], notes=tuple(notes),
        optimizer_states=states, lora_placement="host" if sizing.lora_on_host and blocks - resident else "device",
        loss_chunks=workload.loss_chunks, mlp_chunks=footprint.mlp_chunks, parts=footprint.parts,
        attention=footprint.attention)


def _choose_chunks(footprint_for: Callable[[int, int], Footprint], workload: Workload, options: StreamOptions,
                   budget_bytes: int, on_host: bool, context_bytes: int, slack: float) -> ChunkChoice:
    """The chunk counts for this budget (:func:`~poros.stream.chunk_choice.choose_chunks`), each priced as the
    smallest budget its step needs with the placements ``options`` allow and nothing resident."""
    def needed(footprint: Footprint, loss_chunks: int, slots: int) -> int:
        sized = dataclasses.replace(workload, loss_chunks=loss_chunks)
        sizing, _ = _choose_states(_Sizing(footprint, sized, on_host, context_bytes, slack), options, budget_bytes)
        places = {"device": (False,), "host": (True,), "disk": (True,)}.get(options.boundary_states,
                                                                           (False, sizing.layer_major))
        return min(sizing.needed(0, slots, boundary) for boundary in places)

    return choose_chunks(footprint_for, needed, loss_chunks=workload.loss_chunks, mlp_chunks=options.mlp_chunks,
                         tokens=workload.batch_size * workload.seq_len, seq_len=workload.seq_len,
                         budget_bytes=budget_bytes, ring=options.num_slots)


def _streamed_bytes(footprint: Footprint, resident_blocks: tuple[int, ...]) -> int:
    return sum(n for i, n in enumerate(footprint.block_bytes) if i not in resident_blocks)


def _boundary_place(boundary: _Boundary, options: StreamOptions, footprint: Footprint,
                    resident_blocks: tuple[int, ...], boundary_total: int) -> str:
    """``"device"``, ``"host"`` or ``"disk"``: off the device, on disk when asked, or when the host budget cannot
    hold the boundary states beside the streamed blocks (the blocks keep the host: they cross every pass)."""
    if not boundary.offload:
        return "device"
    if options.boundary_states in ("host", "disk"):
        return options.boundary_states
    if options.host_budget is None:
        return "host"
    host = parse_budget(options.host_budget, "host_budget")
    return "disk" if _streamed_bytes(footprint, resident_blocks) + boundary_total > host else "host"


def _notes(sizing: _Sizing, options: StreamOptions, budget_bytes: int, boundary: _Boundary, slots: int,
           resident: int, hide_resident: int | None, compute: ComputeTimes | None,
           link_bytes_per_s: float | None) -> list[str]:
    """The plan's decisions, in words."""
    footprint, workload, num_slots = sizing.footprint, sizing.workload, options.num_slots
    blocks, streamed = footprint.num_blocks, footprint.num_blocks - resident
    boundary_total = footprint.boundary_bytes * blocks * (workload.grad_accum if sizing.layer_major else 1)
    notes = []
    if slots < num_slots:
        notes.append(f"{slots} device slot instead of {num_slots}: {format_gb(budget_bytes)} cannot hold a second "
                     f"one ({format_gb(sizing.needed(0, num_slots, boundary.offload))} needed), so every copy waits "
                     "for the compute before it.")
    if resident:
        hidden = ("" if hide_resident is None else
                  f"; {hide_resident} already take the copy off the critical path" if hide_resident <= resident else
                  f"; {hide_resident} would take the copy off the critical path")
        notes.append(f"{resident} of {blocks} blocks resident (blocks {blocks - resident}..{blocks - 1}): as many as "
                     f"the budget holds{hidden}.")
    else:
        notes.append(f"no resident block: the budget has no room for one ({format_gb(footprint.block_bytes[-1])} each)"
                     if hide_resident != 0 else "no resident block: the copy is already off the critical path.")
    if footprint.host_embedding_bytes:
        notes.append(f"embedding tables on the host ({format_gb(footprint.host_embedding_bytes)} not on the device; "
                     "only the looked-up rows cross the link)" if sizing.on_host else
                     f"embedding tables on the device ({format_gb(footprint.host_embedding_bytes)}): "
                     "embeddings_on_host is off (its default off CUDA)")
    if boundary.offload:
        notes.append(f"boundary states on the host ({format_gb(boundary_total)} in pinned memory; on the device only "
                     "the prelude's and the ones in flight) " + (
                         f"because the budget cannot hold them beside {num_slots} slots "
                         f"({format_gb(sizing.needed(0, num_slots, False))} needed), so no block is resident"
                         if boundary.automatic else "as asked")
                     + f"; their copies (2 x {format_gb(boundary_total)} per step, half each way) are not in the step "
                       "prediction")
    elif sizing.layer_major:
        notes.append(f"boundary states on the device ({format_gb(boundary_total)})"
                     + (f"; with them on the host the minimum budget is {format_gb(boundary.offload_minimum)}"
                        if boundary.offload_minimum < boundary.device_minimum else ""))
    else:
        notes.append(f"boundary states on the device ({format_gb(boundary_total)}, saved by autograd)")
    if hide_resident:
        hint = _layer_major_hint(footprint, workload, compute, link_bytes_per_s, num_slots, sizing.on_host,
                                 sizing.context_bytes, sizing.slack)
        if hint:
            notes.append(hint)
    if sizing.optimizer_on_host:
        notes.append(adamw_states.host_note(format_gb(2 * footprint.lora_parameter_bytes),
                                            asked=options.optimizer_states == "host", num_slots=num_slots))
    if sizing.lora_on_host and streamed:  # nothing streams: nothing travels
        notes.append(adamw_states.lora_note(format_gb(footprint.lora_parameter_bytes // blocks * streamed),
                                            asked=options.lora_placement == "host"))
    notes.append("the head stays on the device (streaming the head is not implemented)")
    if streamed == 0:
        notes.append("every block is resident: nothing streams")
    return notes


def _layer_major_hint(footprint: Footprint, workload: Workload, compute: ComputeTimes, link_bytes_per_s: float,
                      num_slots: int, on_host: bool, context_bytes: int, slack: float, most: int = 64) -> str | None:
    """The fewest micro-batches layer-major accumulation needs to hide the copy with no resident block."""
    for micro in range(1, most + 1):
        candidate = dataclasses.replace(workload, grad_accum=micro, schedule="layer-major")
        if predict_step(footprint.block_bytes, candidate, compute, link_bytes_per_s, num_slots=num_slots).copy_hidden:
            if candidate == workload:
                return None
            needed = _fits_plan(footprint, candidate, 0, num_slots, on_host, context_bytes, slack)[1]
            return (f"layer-major accumulation over {micro} or more micro-batches of this size would hide the copy "
                    f"with no resident block (each block crosses the link twice per step; its {micro} x "
                    f"{footprint.num_blocks} boundary states need a budget of {format_gb(needed)})")
    return None


def minimum_budget(footprint: Footprint, workload: Workload, *, embeddings_on_host: bool | None = None,
                   context_bytes: int = 0, slack: float = ALLOCATOR_SLACK, boundary_states: str | None = None,
                   optimizer_states: str = "device", lora_placement: str = "device") -> int:
    """The smallest budget :func:`plan_budget` accepts for this run with the same options (1 slot,
    nothing resident; layer-major's boundary states where that is smaller unless forced; AdamW's state on
    the device unless ``optimizer_states`` is ``"host"`` or ``"auto"``)."""
    on_host = embeddings_on_host is not False and footprint.host_embedding_bytes > 0
    layer_major = workload.schedule == "layer-major"
    optimizer_on_host = optimizer_states != "device"  # 'auto' falls back to the host, which is never larger
    lora_on_host = optimizer_on_host and layer_major and lora_placement != "device"  # as is the LoRA's
    device, host = (_fits_plan(footprint, workload, 0, 1, on_host, context_bytes, slack, boundary, optimizer_on_host,
                               lora_on_host)[1] for boundary in (False, layer_major))
    return _accepted_minimum(device, host, layer_major, boundary_states)


def _accepted_minimum(device: int, host: int, layer_major: bool, boundary_states: str | None) -> int:
    if not layer_major or boundary_states == "device":
        return device
    return host if boundary_states in ("host", "disk") else min(device, host)


__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT_BYTES", "CUDA_WORKSPACE_BYTES", "LORA_BYTES_PER_PARAMETER", "LORA_VALUE_BYTES", "SCHEDULES", "BudgetPlan", "ComputeTimes", "Footprint", "PeakBreakdown", "StepPrediction", "Workload", "budget_for_peak", "copy_bytes_per_step", "format_gb", "human_bytes", "minimum_budget", "parse_budget", "peak_upper_bound", "plan_budget", "predict_peak", "predict_step"]

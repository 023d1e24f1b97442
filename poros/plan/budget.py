"""The budget model: pure arithmetic on bytes and seconds, torch-free (no tensor is touched).

A run's device bytes by kind (:class:`Footprint`, measured by :mod:`poros.plan.footprint` from a
loaded model or a meta skeleton) and the shape of its step (:class:`Workload`) give:

* **the peak** (:func:`predict_peak`), the one peak model: the largest of a step's phases -- the
  forward-backward turn (all boundary states + the head's working set), a block's recompute and
  backward (its working set + the LoRA gradients + the boundary states still held), the optimizer
  step -- on top of the slots, the resident blocks, the modules outside the blocks and the LoRA
  parameters with their AdamW state. Checked against the H200 bench records (:mod:`poros.plan.calibration`;
  ``tests/test_planner.py`` holds every one to its tolerance, the README quotes the spread). :func:`peak_upper_bound` adds the same parts
  all at once (the dry run's estimate).
* **the step** (:func:`predict_step`, from :mod:`poros.plan.step_time`): with per-block compute
  times (:class:`ComputeTimes`) and the link bandwidth, a simulation of the executor's copies and
  compute stage by stage.
* **the budget plan** (:func:`plan_budget`): embedding tables to the host, the slot ring, then as
  many resident blocks as fit, the last ones first; and the budget that takes the copy off the
  critical path.

``prepare(vram_budget=...)`` asks it through :func:`poros.plan.footprint.plan_for_model`;
``poros plan`` through the dry-run plan (:mod:`poros.plan.run_plan`) and prints it with
:mod:`poros.cli.report`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from poros.config import parse_budget
from poros.errors import ConfigError
from poros.stream import optimizer_states as adamw_states
from poros.plan.chunk_choice import ChunkChoice, choose_chunks, fused_loss_note
from poros.plan.dequantize import choose_dequantize_once
from poros.stream.options import SCHEDULES, StreamOptions, Workload
from poros.plan.step_time import ComputeTimes, StepPrediction, copy_bytes_per_step, predict_step
from poros.stream.recompute_choice import kept_activations
from poros.spellings import format_gb, human_bytes
from poros.plan.peak import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    CUDA_WORKSPACE_BYTES,
    Footprint,
    LORA_BYTES_PER_PARAMETER,
    LORA_VALUE_BYTES,
    PeakBreakdown,
    biggest_part,
    budget_for_peak,
    kept_states,
    peak_upper_bound,
    predict_peak,
)
from poros.plan.budget_plan import BudgetPlan


def _fits_plan(footprint: Footprint, workload: Workload, resident: int, slots: int, on_host: bool,
               context_bytes: int, slack: float, boundary_on_host: bool = False,
               optimizer_on_host: bool = False, lora_on_host: bool = False,
               dequantize_once: bool = False) -> tuple[PeakBreakdown, int]:
    last = footprint.num_blocks
    peak = predict_peak(footprint, workload, resident=range(last - resident, last), num_slots=slots,
                        embeddings_on_host=on_host, boundary_on_host=boundary_on_host,
                        optimizer_on_host=optimizer_on_host, lora_on_host=lora_on_host,
                        dequantize_once=dequantize_once)
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
    dequantize_once: bool = False  # a block phase holds the block's dequantized weights

    @property
    def layer_major(self) -> bool:
        return self.workload.schedule == "layer-major"

    def peak(self, resident: int, slots: int, boundary_on_host: bool) -> tuple[PeakBreakdown, int]:
        """The peak, and the budget it needs, with the last ``resident`` blocks resident and ``slots`` slots."""
        return _fits_plan(self.footprint, self.workload, resident, slots, self.on_host, self.context_bytes,
                          self.slack, boundary_on_host, self.optimizer_on_host, self.lora_on_host,
                          self.dequantize_once)

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
    places = _places(options, sizing.layer_major)
    states = adamw_states.choose(options.optimizer_states, lambda: any(
        sizing.needed(0, options.num_slots, boundary) <= budget_bytes for boundary in places))
    sizing = dataclasses.replace(sizing, optimizer_on_host=states == "host")
    lora = adamw_states.choose_lora(options.lora_placement, states, sizing.layer_major, lambda: any(
        sizing.needed(0, options.num_slots, boundary) <= budget_bytes for boundary in places))
    return dataclasses.replace(sizing, lora_on_host=lora == "host"), states


def _places(options: StreamOptions, layer_major: bool) -> tuple[bool, ...]:
    """Where the boundary states may wait under ``options``: on the host (True) or the device (False)."""
    return {"device": (False,), "host": (True,), "disk": (True,)}.get(options.boundary_states, (False, layer_major))


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
        f"{biggest_part(minimum_peak, fp)}; it is below the minimum for this run: it needs at least "
        f"{format_gb(minimum)} ({human_bytes(minimum)}; 1 device slot, no resident block{', embeddings on the host' if sizing.on_host else ''}"
        f"{where}; {format_gb(pipelined)} with {options.num_slots} slots).{other} Fix: --vram-budget "
        f"{format_gb(minimum).replace(' ', '')} or more (poros plan then prints the parts of the peak), or shrink "
        f"the activations (seq_len, batch_size{', or micro-major accumulation' if sizing.layer_major and workload.grad_accum > 1 else ''})."
    )


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
            for (:func:`poros.plan.chunk_choice.choose_chunks`); without, they stand.

    Layer-major's boundary states, once off the device, go to disk instead of pinned host memory when
    ``options.boundary_states`` says ``"disk"``, or when ``options.host_budget`` cannot hold them beside
    the streamed blocks.

    ``options.boundary_every``: an int is taken as given (None: 1); ``"auto"`` picks the smallest k of
    1, 2, 4, 8, ... whose plan fits the budget and keeps the boundary states off the disk (the host
    budget holds the streamed blocks and the L / k kept states); where every k sends them to disk, the
    largest that fits (the fewest bytes written and read back). Its extra
    forward and copies are in the peak and the step prediction (:func:`predict_step`).

    Raises:
        ConfigError: no budget, or a budget below the minimum (the message names the minimum and what
            the peak is made of); ``lora_placement="host"`` without AdamW's state on the host and
            layer-major.
    """
    every = 1 if options.boundary_every is None else options.boundary_every
    if isinstance(every, int):
        return _plan_budget(footprint, dataclasses.replace(workload, boundary_every=every), options, compute,
                            link_bytes_per_s, context_bytes, slack, footprint_for)
    fitting, on_disk, refused = None, None, None
    for every in every_candidates(footprint.num_blocks):
        try:
            plan = _plan_budget(footprint, dataclasses.replace(workload, boundary_every=every), options, compute,
                                link_bytes_per_s, context_bytes, slack, footprint_for)
        except ConfigError as error:
            refused = refused or error
            continue
        if plan.boundary_states != "disk":
            return plan if every == 1 else _chosen_every(plan, fitting)
        fitting = plan if fitting is None else fitting
        on_disk = plan  # the largest k that fits: the fewest states written and read back per step
    if fitting is not None:
        if on_disk.boundary_every == 1:
            return on_disk
        note = (f"boundary_every={on_disk.boundary_every}: the boundary states go to disk whatever k, so the planner "
                f"keeps the fewest that fit the VRAM budget ({format_gb(on_disk.boundary_bytes)} written and read "
                f"back per step instead of {format_gb(fitting.boundary_bytes)}), recomputing the others")
        return dataclasses.replace(on_disk, notes=(*on_disk.notes, note))
    raise refused


def every_candidates(num_blocks: int) -> list[int]:
    """The ``boundary_every`` values ``"auto"`` tries, fewest recomputes first: 1, 2, 4, ... below ``num_blocks``."""
    found, every = [], 1
    while every == 1 or every < num_blocks:
        found.append(every)
        every *= 2
    return found


def _chosen_every(plan: BudgetPlan, on_disk: BudgetPlan | None) -> BudgetPlan:
    """``plan`` (boundary_every > 1) with a note of why: the states on the host instead of the disk, or a
    step the budget holds at all."""
    why = (f"with boundary_every={on_disk.boundary_every} the host budget cannot hold the boundary states "
           f"({format_gb(on_disk.boundary_bytes)}) beside the streamed blocks and they would go to disk"
           if on_disk is not None else "with fewer recomputes the VRAM budget cannot hold the boundary states")
    note = (f"boundary_every={plan.boundary_every}: the input of every {plan.boundary_every}th block is kept "
            f"({format_gb(plan.boundary_bytes)} on the {plan.boundary_states}) and the others recomputed in backward "
            f"(one more forward through their segment, in the step prediction), because {why}")
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _plan_budget(footprint: Footprint, workload: Workload, options: StreamOptions, compute: ComputeTimes | None,
                 link_bytes_per_s: float | None, context_bytes: int, slack: float,
                 footprint_for: Callable[[int, int], Footprint] | None) -> BudgetPlan:
    """:func:`plan_budget` for the ``workload.boundary_every`` given."""
    if options.vram_budget is None:
        raise ConfigError("plan_budget got options without a vram_budget; expected the device memory to plan for. "
                          "Pass e.g. StreamOptions(vram_budget='12GiB').")
    budget_bytes = options.vram_budget_bytes
    on_host = options.embeddings_on_host is not False and footprint.host_embedding_bytes > 0
    chosen, asked_chunks = None, (workload.loss_chunks, options.mlp_chunks)
    workload = dataclasses.replace(workload, loss_chunks=1) if workload.fused_loss else workload  # Liger's head
    if footprint_for is not None:
        chosen = _choose_chunks(footprint_for, workload, options, budget_bytes, on_host, context_bytes, slack)
        footprint, workload = chosen.footprint, dataclasses.replace(workload, loss_chunks=chosen.loss_chunks)
    sizing, states = _choose_states(_Sizing(footprint, workload, on_host, context_bytes, slack), options,
                                    budget_bytes)
    held = dataclasses.replace(sizing, dequantize_once=True)  # dequantize_once: its copy in the peak where on
    sizing = held if options.dequantize_once is True and sizing.layer_major else sizing  # asked: in the minimum
    boundary = _choose_boundary(sizing, options, budget_bytes)
    _refuse_below_minimum(sizing, options, budget_bytes, boundary)
    slots, resident = _ring_and_resident(sizing, options, budget_bytes, boundary)
    on, dequantize_note = choose_dequantize_once(  # auto: in what the ring and the resident blocks leave
        options.dequantize_once, workload, footprint.held_weight_bytes,
        lambda: held.needed(resident, slots, boundary.offload) <= budget_bytes)
    sizing, minimal = (held if on else sizing), sizing  # auto's copy never raises the minimums
    timed = compute is not None and link_bytes_per_s is not None
    hiding = _hiding_copy(sizing, options, boundary, compute, link_bytes_per_s) if timed else (None,) * 4
    blocks = footprint.num_blocks
    resident_blocks = tuple(range(blocks - resident, blocks))
    peak, needed = sizing.peak(resident, slots, boundary.offload)
    step = predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s, resident=resident_blocks,
                        num_slots=slots) if timed else None
    boundary_total = footprint.boundary_bytes * kept_states(blocks, workload.boundary_every) * (
        workload.grad_accum if sizing.layer_major else 1)
    notes = _notes(sizing, options, budget_bytes, boundary, slots, resident, hiding[0], compute, link_bytes_per_s)
    place = _boundary_place(boundary, options, footprint, resident_blocks, boundary_total)
    if place == "disk":
        notes = [n if not n.startswith("boundary states on the host") else n.replace(
            "boundary states on the host", "boundary states on disk (files under the cache's spill/ directory)", 1)
            .replace("in pinned memory", "written and read back") for n in notes]
        notes.append(f"boundary states on disk because {'it was asked' if options.boundary_states == 'disk' else ''}"
                     + ("" if options.boundary_states == "disk" else
                        f"the host budget ({format_gb(options.host_budget_bytes)}) cannot hold "
                        f"them ({format_gb(boundary_total)}) beside the streamed blocks "
                        f"({format_gb(_streamed_bytes(footprint, resident_blocks))})"))
    kept, kept_bytes = kept_activations(footprint, workload, options.recompute, blocks,
                                        headroom=budget_bytes - needed, slack=slack)
    notes += [dequantize_note] if dequantize_note else []
    if kept:
        notes.append(f"{kept} of {blocks} blocks keep their activations (recompute={options.recompute}: "
                     f"{format_gb(kept_bytes)}, {'the budget left after the plan' if options.recompute == 'auto' else 'asked'}"
                     "); the others are recomputed in backward")
    if workload.fused_loss:
        notes.insert(0, fused_loss_note(asked_chunks[0]))
    if chosen is not None and chosen.raised:
        notes.insert(0, f"loss_chunks={chosen.loss_chunks}, mlp_chunks={chosen.mlp_chunks} (asked "
                        f"{asked_chunks[0]} and {asked_chunks[1]}): "
                        "the budget cannot hold the step with fewer chunks; the head and loss run "
                        f"{chosen.loss_chunks} token chunks at a time and each block's MLP {chosen.mlp_chunks} "
                        "sequence chunks")
    return BudgetPlan(
        budget_bytes=budget_bytes, context_bytes=context_bytes, slack=slack, workload=workload, footprint=footprint,
        requested_slots=options.num_slots, num_slots=min(slots, blocks - resident),
        resident_blocks=resident_blocks, embeddings_on_host=on_host,
        boundary_states=place, peak=peak, needed_bytes=needed,
        copy_bytes_per_step=copy_bytes_per_step(footprint.block_bytes, workload, resident_blocks),
        link_bytes_per_s=link_bytes_per_s, step=step, minimum_bytes=boundary.accepted_minimum,
        pipelined_minimum_bytes=minimal.needed(0, options.num_slots, boundary.offload), boundary_bytes=boundary_total,
        boundary_offload_minimum_bytes=boundary.offload_minimum, hide_copy_resident=hiding[0],
        hide_copy_bytes=hiding[1], hide_copy_peak_bytes=hiding[2], hide_copy_step=hiding[3], notes=tuple(notes),
        optimizer_states=states, lora_placement="host" if sizing.lora_on_host and blocks - resident else "device",
        kept_activation_blocks=kept, kept_activation_bytes=kept_bytes,
        boundary_every=workload.boundary_every, dequantize_once=sizing.dequantize_once,
        dequantize_once_bytes=footprint.held_weight_bytes if sizing.dequantize_once else 0)


def _choose_chunks(footprint_for: Callable[[int, int], Footprint], workload: Workload, options: StreamOptions,
                   budget_bytes: int, on_host: bool, context_bytes: int, slack: float) -> ChunkChoice:
    """The chunk counts for this budget (:func:`~poros.plan.chunk_choice.choose_chunks`), each priced as the
    smallest budget its step needs with the placements ``options`` allow and nothing resident."""
    def needed(footprint: Footprint, loss_chunks: int, slots: int) -> int:
        sized = dataclasses.replace(workload, loss_chunks=loss_chunks)
        sizing, _ = _choose_states(_Sizing(footprint, sized, on_host, context_bytes, slack), options, budget_bytes)
        places = _places(options, sizing.layer_major)
        return min(sizing.needed(0, slots, boundary) for boundary in places)

    return choose_chunks(footprint_for, needed, loss_chunks=workload.loss_chunks, mlp_chunks=options.mlp_chunks,
                         tokens=workload.batch_size * workload.seq_len, seq_len=workload.seq_len,
                         budget_bytes=budget_bytes, ring=options.num_slots, fused_loss=workload.fused_loss)



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
    host = options.host_budget_bytes
    return "disk" if _streamed_bytes(footprint, resident_blocks) + boundary_total > host else "host"


def _notes(sizing: _Sizing, options: StreamOptions, budget_bytes: int, boundary: _Boundary, slots: int,
           resident: int, hide_resident: int | None, compute: ComputeTimes | None,
           link_bytes_per_s: float | None) -> list[str]:
    """The plan's decisions, in words."""
    footprint, workload, num_slots = sizing.footprint, sizing.workload, options.num_slots
    blocks, streamed = footprint.num_blocks, footprint.num_blocks - resident
    boundary_total = footprint.boundary_bytes * kept_states(blocks, workload.boundary_every) * (
        workload.grad_accum if sizing.layer_major else 1)
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


__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT_BYTES", "CUDA_WORKSPACE_BYTES", "LORA_BYTES_PER_PARAMETER", "LORA_VALUE_BYTES", "SCHEDULES", "BudgetPlan", "ComputeTimes", "Footprint", "PeakBreakdown", "StepPrediction", "Workload", "budget_for_peak", "copy_bytes_per_step", "every_candidates", "format_gb", "human_bytes", "kept_states", "minimum_budget", "parse_budget", "peak_upper_bound", "plan_budget", "predict_peak", "predict_step"]

"""The plans as text: :func:`format_plan` (``poros train --dry-run``: the memory plan as host and
device tables), :func:`format_budget_plan` (``poros plan``: the decisions, the predicted peak
and its parts against the budget, the copies and the step time) and :func:`format_budget_report`
(all of ``poros plan``'s text, with the host tier and the node's host RAM; :func:`budget_report_json`
its ``--json``). Formatting only: the numbers come from :mod:`poros.plan.run_plan` and
:mod:`poros.plan.budget`."""

from __future__ import annotations

from dataclasses import asdict

from poros.cli.output import table
from poros.plan.run_plan import Plan
from poros.plan.budget import BudgetPlan, format_gb, human_bytes, kept_states, predict_peak

def _runs(sizes: tuple[int, ...]) -> str:
    """``(5, 5, 7)`` -> ``"5 B x 2, 7 B x 1"``: block sizes in order, consecutive equal ones grouped."""
    groups: list[list[int]] = []
    for size in sizes:
        if groups and groups[-1][0] == size:
            groups[-1][1] += 1
        else:
            groups.append([size, 1])
    return ", ".join(f"{size:,} B x {count}" for size, count in groups)


def _header(plan: Plan) -> list[str]:
    tower = f", text tower of {plan.text_tower_of}" if plan.text_tower_of else ""
    quant = f"{plan.quantization}{' + double quant' if plan.double_quant else ''}"
    adapter = (f"LoRA r{plan.lora_rank}{' + DoRA' if plan.use_dora else ''} on {plan.lora_modules} linears "
               f"({plan.target_modules}): {plan.lora_parameters:,} trainable parameters")
    return [
        f"model       {plan.model} ({plan.found_in}: {plan.checkpoint})",
        f"family      {plan.family} (model_type {plan.model_type}{tower}): {plan.num_blocks} decoder blocks, "
        f"hidden {plan.hidden_size}, vocab {plan.vocab_size}",
        f"base        {quant}, compute {plan.compute_dtype}",
        *([f"experts     {plan.experts}"] if plan.experts else []),
        f"adapters    {adapter}",
    ]


def _byte_rows(items):
    return [(label, f"{nbytes:,}", human_bytes(nbytes)) for label, nbytes in items]


def format_plan(plan: Plan) -> str:
    """The plan as text: a header and two fixed-width tables (host, device), estimates labelled."""
    header = [
        *_header(plan),
        f"run         batch {plan.batch_size} x seq {plan.seq_len}, {plan.num_slots} device slots, device "
        f"{plan.device}",
        f"blocks      {_runs(plan.block_bytes)} (host store, exact)",
    ]
    host_rows = [
        (f"block store ({plan.num_blocks} blocks)", plan.host_store_bytes),
        ("embedding tables kept on host", plan.host_embedding_bytes),
    ]
    if plan.device == "cpu":
        host_rows.append(("device share (device is cpu: see below)",
                          plan.host_ram_bytes_estimate - plan.host_store_bytes - plan.host_embedding_bytes))
    host_rows.append(("expected host RAM (estimate, without the runtime)", plan.host_ram_bytes_estimate))
    workload = plan.workload
    layer_major = f"{plan.grad_accum} x " if plan.stream_schedule == "layer-major" and plan.grad_accum > 1 else ""
    predicted = predict_peak(plan.footprint(), workload, num_slots=plan.num_slots,
                             embeddings_on_host=plan.host_embedding_bytes > 0)
    device_rows = [
        (f"device slots ({plan.num_slots} x largest block)", plan.slot_bytes),
        ("modules outside the blocks", plan.device_non_block_bytes),
        ("LoRA params + grads + AdamW state (fp32)", plan.lora_state_bytes),
        (f"boundary activations ({layer_major}{plan.num_blocks} x {plan.batch_size} x {plan.seq_len} x "
         f"{plan.hidden_size} x {plan.activation_bytes_per_value} B)", plan.boundary_activation_bytes),
        ("one block's recompute working set (estimate)", plan.recompute_bytes),
        ("logits and loss (estimate)", plan.logits_bytes),
        ("peak device memory (estimate): all of the above at once", plan.peak_device_bytes_estimate),
        (f"predicted peak allocated (at the {predicted.phase}; as poros plan)", predicted.total),
    ]
    return "\n".join([
        *header, "",
        table(("host memory", "bytes", "size"), _byte_rows(host_rows)), "",
        table(("device memory", "bytes", "size"), _byte_rows(device_rows)), "",
        "Estimates: block bytes are exact; the device peak leaves out the CUDA context and allocator "
        "fragmentation. `poros plan --vram-budget 8GiB` plans slots and resident blocks for a budget.",
    ])


def format_budget_plan(plan: Plan, budget_plan: BudgetPlan, *, link_source: str | None = None) -> str:
    """``poros plan``'s report: the decisions, the predicted peak and its parts against the budget,
    the copies and the step time, and the budget that takes the copy off the critical path."""
    bp, workload = budget_plan, budget_plan.workload
    gb = format_gb
    accumulation = (f"{workload.grad_accum} micro-batches per step, {workload.schedule}" if workload.grad_accum > 1
                    else "1 micro-batch per step")
    header = [
        *_header(plan),
        f"run         batch {workload.batch_size} x seq {workload.seq_len}, {accumulation}, device {plan.device}",
        f"blocks      {_runs(plan.block_bytes)} (packed, exact)",
        f"budget      {gb(bp.budget_bytes)} ({human_bytes(bp.budget_bytes)})",
    ]
    resident = bp.resident_blocks
    streamed = bp.num_blocks - len(resident)
    decisions = [
        ("device slots", f"{bp.num_slots}" + (f" (asked {bp.requested_slots})"
                                              if bp.num_slots < min(bp.requested_slots, streamed) else "")),
        ("resident blocks", f"{len(resident)} of {bp.num_blocks}" + (f" ({resident[0]}..{resident[-1]})"
                                                                     if resident else "")),
        ("embedding tables", "host" if bp.embeddings_on_host else "device"),
        ("boundary states", f"{bp.boundary_states} ({gb(bp.boundary_bytes)}"
                            + {"host": "; pinned, in flight on the device",
                               "disk": "; files under the cache's spill/, in flight on the device"}.get(
                                   bp.boundary_states, "") + ")"),
        ("boundary_every", f"{bp.boundary_every}" + (f" (every {bp.boundary_every}th block's input kept, the others "
                                                     "recomputed in backward)" if bp.boundary_every > 1 else "")),
        ("AdamW state", bp.optimizer_states + ("; pinned, stepped a chunk at a time" if bp.optimizer_states == "host"
                                               else "")),
        ("LoRA tensors", bp.lora_placement + ("; pinned, each block's with its block" if bp.lora_placement == "host"
                                             else "")),
        ("head", "device (head streaming not implemented)"),
        ("loss_chunks", str(bp.loss_chunks)),
        ("mlp_chunks", str(bp.mlp_chunks)),
        ("kept activations", f"{bp.kept_activation_blocks} of {bp.num_blocks} blocks ({gb(bp.kept_activation_bytes)}; "
                             "the others recomputed in backward)"),
        ("dequantize once", f"on ({gb(bp.dequantize_once_bytes)} held per block phase: one block's NF4 weights "
                            "dequantized)" if bp.dequantize_once else "off"),
        ("attention kernel", bp.attention.split(":")[0] if bp.attention else "unknown"),
    ]
    memory = [(name, n) for name, n in (*bp.peak.persistent, *bp.peak.transient) if n]
    slack_bytes = bp.needed_bytes - bp.context_bytes - bp.peak.total
    memory += [("predicted peak allocated", bp.peak.total),
               (f"allocator slack ({bp.slack:.0%} of the peak)", slack_bytes)]
    if bp.context_bytes:
        memory.append(("CUDA context (outside the allocator)", bp.context_bytes))
    memory += [("needed", bp.needed_bytes),
               (f"budget ({'fits' if bp.needed_bytes <= bp.budget_bytes else 'does not fit'})", bp.budget_bytes)]
    per = "per step for all micro-batches" if workload.schedule == "layer-major" else "per micro-batch"
    copies = (f"copies      {gb(bp.copy_bytes_per_step)} host-to-device per step (each streamed block twice {per}, "
              "the last block once)")
    lines = [*header, "", table(("decision", "value"), decisions), "",
             table((f"device memory (peak: {bp.peak.phase})", "bytes", "size"), _byte_rows(memory)), ""]
    if bp.parts:
        lines += [table(("part (sequence-proportional, per micro-batch)", "bytes", "size"),
                        _byte_rows(sequence_parts(bp))), ""]
    lines.append(copies)
    if bp.step is None:
        lines.append("step time   unknown: no compute times (run on CUDA with --probe, or give --block-ms and "
                     "--link-gb-per-s)")
    else:
        step = bp.step
        link = f"{bp.link_bytes_per_s / 1e9:.1f} GB/s ({link_source or 'given'})"
        lines += ["", table(("predicted step", "seconds"), [
            ("forward (blocks, with copy waits)", f"{step.forward_s:.4f}"),
            ("head and loss", f"{step.head_s:.4f}"),
            ("recompute + backward (blocks, with copy waits)", f"{step.backward_s:.4f}"),
            ("optimizer", f"{step.optimizer_s:.4f}"),
            ("step", f"{step.step_s:.4f}"),
            ("  of which waiting for copies", f"{step.exposed_copy_s:.4f}"),
            ("  link busy (copy bytes / link)", f"{step.copy_s:.4f}"),
        ]), f"compute     {step.source}", f"link        {link}"]
    if bp.hide_copy_resident is None:
        lines.append("hide copy   unknown without compute times")
    elif bp.hide_copy_resident == 0:
        lines.append("hide copy   the copy is already off the critical path (every stage waits on compute)")
    else:
        lines.append(f"hide copy   needs {bp.hide_copy_resident} of {bp.num_blocks} blocks resident: a budget of "
                     f"{gb(bp.hide_copy_bytes)} (predicted peak {gb(bp.hide_copy_peak_bytes)} allocated, step "
                     f"{bp.hide_copy_step.step_s:.4f} s)"
                     + (": this budget has it" if bp.hide_copy_bytes <= bp.budget_bytes else ""))
    lines += ["", "Decisions:", *(f"  - {note}" for note in bp.notes),
              f"Minimum budget for this run: {gb(bp.minimum_bytes)} (1 slot, nothing resident), "
              f"{gb(bp.pipelined_minimum_bytes)} with {bp.requested_slots} slots.",
              "Block bytes are exact; the peak's parts are estimates, checked against every H200 record in "
              "registry/results from 512 tokens to long context (how close: the README and "
              "docs/consumer-gpus.md); step times are a pipeline model of the measured or given GPU times, a "
              "lower bound where the host cannot keep the GPU busy (how far below the H200's steps: "
              "docs/results-h200.md)."]
    return "\n".join(lines)


def sequence_parts(bp: BudgetPlan) -> list[tuple[str, int]]:
    """What ``poros plan`` tabulates as the run's parts: the activations by part, the boundary states of the
    whole step (where they wait), and the LoRA tensors with AdamW's state (wherever they are)."""
    micro = bp.workload.grad_accum if bp.workload.schedule == "layer-major" else 1
    return [*bp.parts,
            (f"boundary states, all ({micro} x {kept_states(bp.num_blocks, bp.boundary_every)} x batch x seq x hidden; "
             f"{bp.boundary_states})",
             bp.boundary_bytes),
            *((name, n) for name, n in bp.peak.persistent if name.startswith(("LoRA", "AdamW", "embedding")) and n)]


def format_budget_report(plan: Plan) -> str:
    """``poros plan``'s text for a :func:`~poros.plan.run_plan.plan_run` made with options: the budget plan
    (:func:`format_budget_plan`), the host tier and, with several ranks per node, the node's host RAM."""
    report = plan.budget
    host = report.host
    lines = [format_budget_plan(plan, report.budget_plan, link_source=report.link_source),
             f"host: {host.reason}; {human_bytes(host.host_bytes)} of host RAM for the blocks"]
    if report.host_ram:
        lines += ["", table(("host RAM (one rank)", "bytes", "size"),
                            _byte_rows([*report.host_ram, ("host RAM needed", report.host_ram_bytes)]))]
    if report.ranks_per_node > 1:
        how = ("one copy shared by the ranks (mapped tier)" if host.tier == "mapped" else
               f"one {host.tier} copy per rank" + ("" if host.tier != "pinned" or report.host_tier_requested else
                                                   "; with the block cache on they would share one"))
        lines.append(f"data parallel: {report.ranks_per_node} ranks per node, batch {report.per_rank_batch} per GPU = "
                     f"{report.per_rank_batch * report.ranks_per_node} on the node; the peak above is per GPU. Host RAM of the node for the "
                     f"frozen base: {format_gb(report.data_parallel['host_bytes_per_node'])}, {how} "
                     "(docs/multi-gpu.md)")
    return "\n".join(lines)


def budget_report_json(plan: Plan) -> dict:
    """``poros plan --json``: the model, the footprint, the times, the budget plan, the host tier and the node."""
    report = plan.budget
    return {"model": plan.model, "checkpoint": plan.checkpoint, "family": plan.family,
            "device": plan.device, "link_source": report.link_source,
            "footprint": asdict(plan.footprint()),
            "compute": asdict(report.compute) if report.compute else None, "plan": report.budget_plan.to_dict(),
            "host": report.host.to_dict(), "data_parallel": report.data_parallel,
            "host_ram": {"parts": dict(report.host_ram), "total": report.host_ram_bytes}}


__all__ = ["budget_report_json", "format_budget_plan", "format_budget_report", "format_plan"]

"""The arm runner: resident QLoRA (the reference) and Poros streaming, run one after the other on ONE
model object from the same LoRA state, and compared bit for bit.

1. **Arm ``resident``** (the reference): HF forward with gradient checkpointing (non-reentrant),
   AdamW, ``warmup + steps`` steps. Arm ``control`` (optional) runs it once more from the same
   initial LoRA state: the reference against itself, i.e. whether this configuration is
   run-to-run deterministic at all.
2. **Arm ``poros``**: LoRA restored to its initial values, a new AdamW, HF checkpointing off,
   ``poros.prepare(model)``, the same steps on the same batches (``poros-device``: the same with
   torch's AdamW on the device and no cap).
3. **Compare** (:func:`compare`): step-time and peak-memory ratios, and the max abs difference of
   every step's loss, every LoRA tensor and every AdamW state tensor (0.0 expected: the arms run
   the same kernels in the same order).

Per arm (:meth:`ArmResult.summary`): peak ``max_memory_allocated`` and ``max_memory_reserved`` over
the arm's steps (reset after the arm's setup), the allocated memory before its first step (the
weights), every step's time and the median over the timed steps (after warm-up), the loss
trajectory; for ``poros`` also bytes copied host->device per step, the achieved GB/s over the timed
steps and the planner's prediction for the setup ``prepare`` made. GB = 1e9 bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import resource
import statistics
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from poros.devices import resolve_device
from poros.doctor.probe import measure_link
from poros.stream.chunked_loss import use_chunked_loss
from tools.bench import snapshots
from tools.bench.timeline import (CopyTimeline, allocator_delta, private_pool_bytes, profile_step, sync_check,
                                 synchronize)

#: the unit of every ``*_gb`` and ``*_gb_per_s`` field of a report
GB = 1e9
#: ``control`` is the resident arm again from the same initial state: the reference against itself;
#: ``poros-device`` is Poros with torch's AdamW on the device and no cap (today's step, the small-card
#: arm's yardstick: ``--optimizer-states host`` and ``--vram-budget`` apply to ``poros`` only).
ARMS = ("resident", "control", "poros-device", "poros")


def checkpointing_on(model) -> bool:
    """Whether HF's gradient checkpointing is on (transformers 5.x names it activation checkpointing)."""
    return bool(getattr(model, "is_activation_checkpointing", None)
                or getattr(model, "is_gradient_checkpointing", False))


def cap_process(device: torch.device, gb: float | None) -> None:
    """Cap this process at ``gb`` GB of ``device`` (a smaller card, emulated: ``set_per_process_memory_fraction``);
    None: the whole card again."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if gb is None else min(1.0, gb * GB / total), device)


def free_memory(device: torch.device) -> None:
    """On CUDA: collect cycles (bitsandbytes' Params4bit <-> Linear4bit hold each other, so a dropped
    model stays allocated until ``gc.collect()``), then give cached blocks back. Nothing is measured
    on CPU, where a full collection per call would dominate a smoke test's run time."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def snapshot(named: list[tuple[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
    """Exact copies off the device (they must not count towards the next arm's device memory): host tensors, or
    files with ``--snapshot-dir`` (``tools.bench.snapshots``)."""
    return snapshots.keep(iter(named), "lora")


def optimizer_snapshot(optimizer, named) -> Mapping[str, torch.Tensor]:
    return snapshots.keep(((f"{name}::{key}", value) for name, param in named
                           for key, value in optimizer.state.get(param, {}).items() if isinstance(value, torch.Tensor)),
                          "adamw")


@dataclass
class ArmResult:
    name: str
    status: str = "ok"  # ok | oom | error | skipped
    error: str | None = None
    losses: list[torch.Tensor] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    adapter: Mapping[str, torch.Tensor] = field(default_factory=dict)
    optimizer: Mapping[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, warmup: int) -> dict[str, Any]:
        timed = self.step_times[warmup:]
        out = {"status": self.status, "error": self.error,
               "losses": [_json_float(float(x)) for x in self.losses],
               "step_times_s": [round(t, 6) for t in self.step_times],
               "median_step_s": round(statistics.median(timed), 6) if timed else None,
               "timed_steps": len(timed)}
        out.update(self.extra)
        host = self.extra.get("host_times_s", [])[warmup:]
        if host:  # how long the host took to queue a step, beside how long the step took
            out["median_host_s"] = round(statistics.median(host), 6)
        return out


def _steps(batches: list[dict], grad_accum: int) -> list[list[dict]]:
    return [batches[i:i + grad_accum] for i in range(0, len(batches) - grad_accum + 1, grad_accum)]


def run_arm(name: str, call, named_params, batches: list[dict], *, device: torch.device, warmup: int, lr: float,
            vram_limit_gb: float | None = None, on_timed_start=None, grad_accum: int = 1,
            forward_backward=None, profile: bool = False, timed_stats=None, step_hooks=None,
            optimizer_states: str = "device", placement=None, autocast=None) -> ArmResult:
    """AdamW steps of ``call`` over ``batches`` in groups of ``grad_accum`` micro-batches (the first
    ``warmup`` steps untimed); peak memory over the steps. ``forward_backward(micro_batches)``, when
    given, runs a step's forwards and backwards (Poros layer-major) instead of one call per micro-batch.
    ``step_hooks``: ``(begin, end)`` called with the step index around each step, outside its timing.
    ``optimizer_states="host"``: ``poros.HostAdamW`` (the state in pinned host memory) instead of
    ``torch.optim.AdamW``; ``placement``: the model's ``LoraPlacement`` (``lora_placement="host"``), which
    HostAdamW steps with the LoRA tensors. ``autocast``: a context factory entered around each micro-batch's
    forward (its backward outside, as HF Trainer's ``bf16=True`` does) or around a layer-major
    ``forward_backward``; each entry is a region of its own, so torch's cast cache never outlives a step."""
    from poros.stream.host_optimizer import adamw

    mixed = autocast or contextlib.nullcontext

    result = ArmResult(name)
    params = [p for _, p in named_params]
    optimizer = adamw(params, optimizer_states=optimizer_states, lr=lr, placement=placement)
    free_memory(device)
    if device.type == "cuda":
        if vram_limit_gb is not None:
            cap_process(device, vram_limit_gb)
        torch.cuda.reset_peak_memory_stats(device)
        result.extra["allocated_before_gb"] = round(torch.cuda.memory_allocated(device) / GB, 4)
    steps = _steps(batches, grad_accum)

    def one_step(group: list[dict]) -> list[torch.Tensor]:
        group = [{k: v.to(device) for k, v in batch.items()} for batch in group]
        if grad_accum > 1:  # HF accumulation semantics: each loss is a sum over the step's loss terms
            items = torch.tensor(sum(int((b["labels"][..., 1:] != -100).sum()) for b in group), device=device)
            group = [{**b, "num_items_in_batch": items} for b in group]
        if forward_backward is not None:  # layer-major: the executor drives all micro-batches
            with mixed():
                losses = forward_backward(group)
        else:
            losses = []
            for batch in group:
                with mixed():
                    output = call(**batch, use_cache=False)
                output.loss.backward()
                losses.append(output.loss.detach())
                del output
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return losses

    allocator_before = None
    host_times = result.extra.setdefault("host_times_s", [])
    try:
        for index, group in enumerate(steps):
            if index == warmup:
                if on_timed_start is not None:
                    on_timed_start()
                if device.type == "cuda":
                    allocator_before = torch.cuda.memory_stats(device)
            synchronize(device)
            if step_hooks is not None:
                step_hooks[0](index)
            start = time.perf_counter()
            losses = one_step(group)
            host_times.append(round(time.perf_counter() - start, 6))  # the host is done queueing the step
            synchronize(device)
            result.step_times.append(time.perf_counter() - start)
            if step_hooks is not None:
                step_hooks[1](index)
            result.losses.extend(loss.to("cpu", copy=True) for loss in losses)
            del losses
        if timed_stats is not None:
            result.extra["timed_stats"] = timed_stats()
        if allocator_before is not None:
            result.extra["allocator_per_step"] = allocator_delta(allocator_before, device, len(steps) - warmup)
        if profile and device.type == "cuda" and steps:  # two more steps, not timed: traced, then sync-checked
            result.extra["profile"] = profile_step(lambda: one_step(steps[-1]), device)
            result.extra["host_syncs"] = sync_check(lambda: one_step(steps[-1]), device)
    except torch.OutOfMemoryError as exc:
        result.status, result.error = "oom", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next arm still runs
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    if device.type == "cuda":
        result.extra["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / GB, 4)
        result.extra["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / GB, 4)
        pools = private_pool_bytes(device)  # the CUDA graphs' pools, still held (the graphs live until unpatch)
        result.extra["graph_pool_gb"] = {key: round(value / GB, 4) for key, value in pools.items()}
        if vram_limit_gb is not None:
            cap_process(device, None)
    if result.status == "ok":
        result.adapter = snapshot(named_params)
        result.optimizer = optimizer_snapshot(optimizer, named_params)
    for p in params:
        p.grad = None
    optimizer = None  # its state goes before the next arm measures
    free_memory(device)
    return result


def link_gb_per_s(device: torch.device) -> float | None:
    """Pinned host->device GB/s of one 1 GiB copy (best of 5, :func:`poros.doctor.probe.measure_link`): the link
    the poros arm streams over; None off CUDA."""
    if device.type != "cuda":
        return None
    bytes_per_s = measure_link(device, nbytes=1 << 30, repeats=5)
    free_memory(device)
    return round(bytes_per_s / GB, 3)


def restore(named_params, initial: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in named_params:
            param.copy_(initial[name])


def compare_runs(peft_model, batches: list[dict], *, arms=("resident", "poros"), device: torch.device, warmup: int, lr: float = 1e-3,
                 vram_limit_gb: float | None = None, num_slots: int = 2, grad_accum: int = 1,
                 schedule: str = "micro-major", profile: bool = False, vram_budget: str | None = None,
                 compute=None, link_bytes_per_s: float | None = None, timeline: bool = False,
                 optimizer_states: str = "device", capped_arms: tuple[str, ...] | None = None,
                 loss_chunks: int = 1, cuda_graphs: bool = False, lora_placement: str = "device",
                 autocast=None, mlp_chunks: int = 1, boundary_states: str | None = None,
                 host_budget: str | None = None) -> dict[str, Any]:
    """Run the arms on one model, one after the other, from the same LoRA state; compare them.

    ``mlp_chunks`` > 1: every arm runs the tiled MLP (``poros.stream.tiling.tile_mlp`` on the model,
    ``prepare(mlp_chunks=...)`` for the Poros arms), so the parity check compares like with like.
    ``boundary_states`` and ``host_budget``: the Poros arm's prepare options of those names.

    ``optimizer_states`` is the Poros arm's (the reference keeps torch's AdamW on the device);
    ``capped_arms``: the arms ``vram_limit_gb`` applies to (default: all). ``autocast``: every arm's
    per-forward autocast context factory (:func:`run_arm`).

    ``vram_budget`` goes to ``poros.prepare`` (the planner picks slots and resident blocks); the
    poros arm records the planner's prediction for the setup prepare made (``prediction``: peak,
    copy bytes, and the step when ``compute`` times and the link are given) next to what it measures.

    Returns:
        ``{"arms": {name: ArmResult}, "comparison": compare(...)}``.
    """
    device = resolve_device(device, with_index=True)
    named = trainable(peft_model)
    initial = snapshot(named)

    def limit(arm: str) -> float | None:
        return vram_limit_gb if capped_arms is None or arm in capped_arms else None

    results: dict[str, ArmResult] = {}
    # Capped arms first, on an allocator no earlier arm has fragmented: a live tensor left inside a
    # big segment of an uncapped arm keeps that segment reserved, and the cap counts reserved bytes
    # (seen at 72B under an 8 GB cap: docs/results-h200.md).
    # With a budget, then the Poros arm first: its plan may raise the loss chunks, and the arms after it compute the
    # loss in as many chunks (a chunked loss sums in another order: bitwise only against the same chunks).
    order = sorted((a for a in ARMS if a in arms),
                   key=lambda a: (limit(a) is None, vram_budget is not None and a != "poros"))
    chunks_after = loss_chunks
    # a Poros arm turns HF's gradient checkpointing off (its own recompute replaces it) and unpatch gives back the
    # flags it found: a resident arm after it turns it on again, as the model was built (models.add_lora)
    base = peft_model.get_base_model()
    checkpointing = checkpointing_on(base)
    for name in order:
        restore(named, initial)
        if name in ("resident", "control"):
            if checkpointing and not checkpointing_on(base):
                base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            chunked = use_chunked_loss(peft_model, chunks_after) if chunks_after > 1 else None
            try:
                results[name] = run_arm(name, peft_model, named, batches, device=device, warmup=warmup, lr=lr,
                                        vram_limit_gb=limit(name), grad_accum=grad_accum, profile=profile,
                                        autocast=autocast)
            finally:
                if chunked is not None:
                    chunked.remove()
            results[name].extra["loss_chunks"] = chunks_after
            results[name].extra["gradient_checkpointing"] = checkpointing_on(base)
            continue
        results[name], handle = run_poros_arm(
            peft_model, batches, device=device, warmup=warmup, lr=lr, vram_limit_gb=limit(name),
            num_slots=num_slots, grad_accum=grad_accum, schedule=schedule, profile=profile,
            vram_budget=vram_budget if name == "poros" else None, compute=compute,
            link_bytes_per_s=link_bytes_per_s, timeline=timeline,
            optimizer_states=optimizer_states if name == "poros" else "device",
            loss_chunks=loss_chunks if name == "poros" else chunks_after,
            cuda_graphs=cuda_graphs and name == "poros",
            lora_placement=lora_placement if name == "poros" else "device", autocast=autocast,
            mlp_chunks=mlp_chunks, boundary_states=boundary_states if name == "poros" else None,
            host_budget=host_budget if name == "poros" else None)
        results[name].name = name
        if name == "poros":  # what its prepare applied (a budget plan may raise it): the later arms' chunks
            chunks_after = results[name].extra.get("loss_chunks") or loss_chunks
        if handle is not None and name != order[-1]:
            handle.unpatch()  # the next arm runs the model as it was
            if mlp_chunks > 1:  # unpatch took the tiling away with the rest: the next arm tiles the same
                from poros.stream.tiling import tile_mlp

                tile_mlp(peft_model, mlp_chunks)
        handle = None
        free_memory(device)
    if "poros" in arms and results["poros"].status == "error" and "poros.prepare" in (results["poros"].error or ""):
        return {"arms": results, "comparison": None}
    return {"arms": results, "comparison": compare(results, warmup)}


def run_poros_arm(peft_model, batches: list[dict], *, device: torch.device, warmup: int, lr: float,
                  vram_limit_gb: float | None = None, num_slots: int = 2, grad_accum: int = 1,
                  schedule: str = "micro-major", profile: bool = False, vram_budget: str | None = None,
                  compute=None, link_bytes_per_s: float | None = None, timeline: bool = False,
                  optimizer_states: str = "device", loss_chunks: int = 1, cuda_graphs: bool = False,
                  lora_placement: str = "device", autocast=None, mlp_chunks: int = 1,
                  boundary_states: str | None = None, host_budget: str | None = None):
    """``poros.prepare`` the model (HF checkpointing off) and run the Poros arm; returns ``(ArmResult, handle)``.

    The arm records the planner's prediction for the setup prepare made (``prediction``: peak, copy
    bytes, and the step when ``compute`` times and the link are given) next to what it measures;
    with ``timeline`` the copy stalls of each timed step (:class:`CopyTimeline`). ``handle`` is the
    ``PorosModel`` (``unpatch()`` it to run another arm), or None when ``prepare`` failed.
    """
    import poros
    from poros.plan.entry import workload_of
    from poros.plan.footprint import predict_prepared

    peft_model.get_base_model().activation_checkpointing_disable()
    batch, seq = batches[0]["input_ids"].shape
    workload = workload_of(batch_size=batch, seq_len=seq, grad_accum=grad_accum, schedule=schedule,
                           loss_chunks=loss_chunks)
    try:
        extra = {"host_budget": host_budget} if host_budget is not None else {}
        streamed = poros.prepare(peft_model, num_slots=num_slots, vram_budget=vram_budget,
                                 workload=workload if vram_budget is not None else None,
                                 optimizer_states=optimizer_states, cuda_graphs=cuda_graphs,
                                 lora_placement=lora_placement, loss_chunks=loss_chunks, mlp_chunks=mlp_chunks,
                                 boundary_states=boundary_states, **extra)
        # the chunk counts prepare applied (a budget plan may raise them): the prediction is for those
        workload = dataclasses.replace(workload, loss_chunks=streamed.stream_options.loss_chunks)
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON like an arm failure
        return ArmResult("poros", status="error",
                         error=f"poros.prepare: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"), None
    try:  # the planner's prediction for this setup, recorded next to the measurement
        prediction = predict_prepared(streamed, workload, compute=compute, link_bytes_per_s=link_bytes_per_s,
                                      optimizer_states=optimizer_states)
    except Exception as exc:  # noqa: BLE001 - a planner bug must not cost the measurement
        prediction = {"error": f"{type(exc).__name__}: {exc}"}
    store = streamed.store
    copies = CopyTimeline(store) if timeline and store.on_cuda else None
    result = run_arm("poros", streamed, trainable(streamed), batches, device=device, warmup=warmup, lr=lr,
                     vram_limit_gb=vram_limit_gb, on_timed_start=store.stats.reset, grad_accum=grad_accum,
                     forward_backward=streamed.forward_backward if schedule == "layer-major" else None,
                     profile=profile, step_hooks=copies.hooks(warmup) if copies else None,
                     timed_stats=lambda: {"bytes": store.stats.bytes_copied, "fetches": sum(store.stats.fetches)},
                     optimizer_states=optimizer_states, placement=streamed.lora_placement, autocast=autocast)
    if copies is not None:
        copies.detach()
        result.extra["copy_timeline"] = copies.summary()
    timed_steps = len(result.step_times[warmup:])
    timed_time = sum(result.step_times[warmup:])
    counted = result.extra.pop("timed_stats", None) or {"bytes": store.stats.bytes_copied,
                                                         "fetches": sum(store.stats.fetches)}
    copied = counted["bytes"]
    result.extra.update({
        "lora_placement": "host" if streamed.lora_placement is not None else "device",  # what prepare applied
        "host_bytes": store.host_bytes,
        "slot_bytes": store.slot_bytes,
        "num_slots": store.num_slots,
        "resident_blocks": list(store.resident_blocks),
        "resident_bytes": store.resident_bytes,
        "blocks": len(store.blocks),
        "bytes_copied_per_step": copied // timed_steps if timed_steps else None,
        "fetches_per_step": counted["fetches"] / timed_steps if timed_steps else None,
        "h2d_gb_per_s": round(copied / timed_time / GB, 3) if timed_time else None,
        "prediction": prediction,
        "budget_plan": streamed.budget_plan.to_dict() if streamed.budget_plan is not None else None,
        # long context: what ran, and the process's peak host RSS (Linux ru_maxrss, KiB), beside the prediction
        "loss_chunks": streamed.stream_options.loss_chunks, "mlp_chunks": streamed.stream_options.mlp_chunks,
        "boundary_states": streamed.executor.boundary_states,
        "host_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3),
        "cuda_graphs": streamed.executor.graphs.report.to_dict() if streamed.executor.graphs is not None else None,
    })
    return result, streamed


def _max_abs_diff(a: dict[str, torch.Tensor] | list, b) -> tuple[float | None, bool]:
    pairs = list(zip(a, b)) if isinstance(a, list) else [(a[k], b.get(k)) for k in a]
    if isinstance(a, dict) and set(a) != set(b):
        return None, False
    worst, equal = 0.0, True
    for x, y in pairs:
        if y is None or x.shape != y.shape or x.dtype != y.dtype:
            return None, False
        equal = equal and torch.equal(x, y)
        if x.numel():
            diff = (x.double() - y.double()).abs().max().item()
            worst = math.nan if math.isnan(diff) or math.isnan(worst) else max(worst, diff)
    return worst, equal


def parity(reference: ArmResult, other: ArmResult) -> dict[str, Any]:
    """Max abs diffs and ``torch.equal`` of every step's loss, every LoRA tensor, every AdamW state tensor."""
    loss, loss_equal = _max_abs_diff(reference.losses, other.losses)
    loss_equal = loss_equal and len(reference.losses) == len(other.losses)
    adapter, adapter_equal = _max_abs_diff(reference.adapter, other.adapter)
    optim, optim_equal = _max_abs_diff(reference.optimizer, other.optimizer)
    return {
        "max_diff_loss": _json_float(loss), "max_diff_adapter": _json_float(adapter),
        "max_diff_optimizer": _json_float(optim),
        "equal_loss": loss_equal, "equal_adapter": adapter_equal, "equal_optimizer": optim_equal,
        "bitwise": bool(loss_equal and adapter_equal and optim_equal),
        "adapter_tensors": len(reference.adapter), "optimizer_tensors": len(reference.optimizer),
    }


def compare(results: dict[str, ArmResult], warmup: int = 0) -> dict[str, Any] | None:
    """Poros against resident: parity and the ratios poros/resident (``None`` when either did not finish).

    With a ``control`` arm (resident run again), ``"control"`` holds its parity against the first
    resident run: whether the reference is run-to-run deterministic in this configuration.
    """
    finished = {name: r for name, r in results.items() if r.status == "ok"}
    resident = finished.get("resident")
    out = None
    if resident is not None and "poros" in finished:
        streamed = finished["poros"]
        out = parity(resident, streamed)
        for key in ("median_step_s", "peak_allocated_gb", "peak_reserved_gb"):
            a, b = resident.summary(warmup).get(key), streamed.summary(warmup).get(key)
            if a and b is not None:
                out[f"ratio_{key}"] = round(b / a, 4)
    if resident is not None and "control" in finished:
        out = out or {}
        out["control"] = parity(resident, finished["control"])
    if "poros-device" in finished and "poros" in finished:  # the poros arm against today's step (poros-device)
        out = out or {}
        base, small = finished["poros-device"], finished["poros"]
        out["poros_device"] = {"parity": parity(base, small)}  # poros-device vs poros (resident vs poros: above)
        for key in ("median_step_s", "peak_allocated_gb"):
            a, b = base.summary(warmup).get(key), small.summary(warmup).get(key)
            if a and b is not None:
                out["poros_device"][f"ratio_{key}"] = round(b / a, 4)
    return out


def _json_float(value):
    if value is None or not isinstance(value, float) or math.isfinite(value):
        return value
    return str(value)  # "nan" / "inf": JSON has no literal for them

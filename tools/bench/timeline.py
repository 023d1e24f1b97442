"""What an arm measures beside its step time: the profiler's copy/compute timeline of one step, the
copy stalls of every timed step (CUDA events on the block store, no profiler), the host syncs of one
step, and the caching allocator's device calls per step.

* :func:`profile_step` -- one step under ``torch.profiler``: kernel-busy and copy-busy time, copy
  time not overlapped by any kernel, idle time, the longest gaps, the CUDA runtime calls.
* :class:`CopyTimeline` -- a store observer: how long the compute stream waited for block copies,
  and how far the GPU trailed the host at each wait.
* :func:`sync_check` -- one step under CUDA sync debugging: which lines made the host wait.
* :func:`allocator_delta` -- ``cudaMalloc`` / ``cudaFree`` / retries per timed step.
* :func:`private_pool_bytes` -- what the CUDA graphs' private pools hold, beside the allocator's own pool.
"""

from __future__ import annotations

import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

from tools.bench.trainer_common import ALLOCATOR_COUNTERS


def synchronize(device: torch.device) -> None:
    """Wait for the device's work (CUDA); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator_delta(before: dict[str, Any], device: torch.device, steps: int) -> dict[str, float]:
    """Per timed step: the CUDA caching allocator's counters since ``before`` (retries and device
    allocations/frees mean cudaMalloc/cudaFree in the loop, which synchronise the host)."""
    after = torch.cuda.memory_stats(device)
    return {key: round((after.get(key, 0) - before.get(key, 0)) / max(steps, 1), 2) for key in ALLOCATOR_COUNTERS}


def private_pool_bytes(device: torch.device) -> dict[str, int]:
    """The caching allocator's segments in private pools (CUDA graphs'), reserved and in use, in bytes, from
    ``torch.cuda.memory_snapshot``: what ``cuda_graphs`` holds apart from the pool every eager op allocates from, so
    the planner's graph reserve (``poros.stream.placement.graph_reserve_bytes``) can be set against it."""
    reserved = allocated = 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != index or tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0):
            continue
        reserved += segment.get("total_size", 0)
        allocated += segment.get("allocated_size", 0)
    return {"reserved": reserved, "allocated": allocated}


def sync_check(step, device: torch.device, top: int = 8) -> dict[str, Any]:
    """Run ``step`` with CUDA sync debugging on: how many operations made the host wait for the
    device, and where (the innermost frames outside torch). Not timed."""
    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]
        site = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-3:]))
        sites[site] = sites.get(site, 0) + 1

    synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # restores showwarning on the way out
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    synchronize(device)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])[:top]
    return {"syncs": sum(sites.values()), "sites": [{"calls": n, "where": where} for where, n in ranked]}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def profile_step(step, device: torch.device) -> dict[str, Any]:
    """The copy/compute timeline of one step (torch.profiler, CUDA activity), in milliseconds.

    ``kernel_busy``: union of kernel intervals; ``h2d_busy``: union of host->device copies;
    ``h2d_exposed``: copying while no kernel runs (the copy not hidden under compute);
    ``idle``: neither (launch overhead, host synchronisation, Python); the longest gaps are listed
    with the kernel before them.
    """
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        step()
        synchronize(device)
    kernels, copies, named, small_copies = [], [], [], []
    host_waits: dict[str, list[float]] = {}
    runtime: dict[str, list[float]] = {}  # CUDA runtime calls made by the host: count and time
    kernel_time: dict[str, list[float]] = {}  # kernel name -> [calls, ms]
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            took = (event.time_range.end - event.time_range.start) / 1000.0
            if event.name.startswith("cuda"):
                entry = runtime.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += took
                # CUDA runtime calls on the host that wait for the device
                if "Synchronize" in event.name or event.name == "cudaMemcpy":
                    host_waits.setdefault(event.name, []).append(took)
            continue
        interval = (event.time_range.start / 1000.0, event.time_range.end / 1000.0)
        if "Memcpy HtoD" in event.name:
            # block fetches take milliseconds; anything under 0.1 ms is a small copy (batch, scalars)
            (copies if interval[1] - interval[0] >= 0.1 else small_copies).append(interval)
        elif "Memcpy" not in event.name and "Memset" not in event.name:
            kernels.append(interval)
            named.append((interval, event.name))
            entry = kernel_time.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += interval[1] - interval[0]
    if not kernels:
        return {"error": "no CUDA kernels traced"}
    begin = min(a for a, _ in kernels + copies)
    end = max(b for _, b in kernels + copies)
    busy_kernels, busy_copies = _union(kernels), _union(copies)
    overlap = _length(_intersect(busy_kernels, busy_copies))
    active = _union(busy_kernels + busy_copies)
    gaps = sorted(((b[0] - a[1], a[1]) for a, b in zip(active, active[1:])), reverse=True)[:5]
    durations = sorted(b - a for a, b in copies)
    named.sort()
    def before(t):
        return next((name for (s, e), name in reversed(named) if e <= t + 1e-6), None)
    ops = sorted(trace.key_averages(), key=lambda a: -a.self_cpu_time_total)
    return {
        "span_ms": round(end - begin, 3),
        "kernels": len(kernels), "kernel_sum_ms": round(sum(b - a for a, b in kernels), 3),
        "top_kernels": [{"name": name[:90], "calls": n, "ms": round(ms, 3)}
                        for name, (n, ms) in sorted(kernel_time.items(), key=lambda kv: -kv[1][1])[:12]],
        "runtime_calls": {name: {"calls": n, "ms": round(ms, 3)}
                          for name, (n, ms) in sorted(runtime.items(), key=lambda kv: -kv[1][1])},
        "top_host_ops": [{"name": a.key[:60], "calls": a.count, "self_ms": round(a.self_cpu_time_total / 1000.0, 3)}
                         for a in ops if not a.key.startswith("cuda")][:25],
        "kernel_busy_ms": round(_length(busy_kernels), 3),
        "h2d_busy_ms": round(_length(busy_copies), 3),
        "h2d_exposed_ms": round(_length(busy_copies) - overlap, 3),
        "idle_ms": round((end - begin) - _length(active), 3),
        "host_waits": {name: {"calls": len(times), "ms": round(sum(times), 3)} for name, times in host_waits.items()},
        "h2d_copies": len(copies), "h2d_copy_ms_median": round(durations[len(durations) // 2], 3) if durations else None,
        "h2d_small_copies": len(small_copies), "h2d_small_copy_ms": round(_length(_union(small_copies)), 3),
        "longest_gaps": [{"ms": round(ms, 3), "at_ms": round(at - begin, 3), "after": (before(at) or "")[:80]}
                         for ms, at in gaps],
    }


class CopyTimeline:
    """How long the compute stream waited for block copies in each timed step: CUDA events, no profiler.

    Observes the store (``store.observers``): after each copy an event on the copy stream (*copy
    done*); before each wait an event on the compute stream (*wanted*: the compute reached the
    block) and the host clock. A wait stalls the compute by ``max(0, done - wanted)`` -- time
    the GPU lost to the link, unlike the profiler's *exposed copy*, which also counts copies that
    run while the GPU waits for the host. ``gpu_lag``: how long after the host issued a wait the
    compute stream reached it -- near zero the GPU is starved by the host (launch-bound), large
    the host runs ahead of the GPU.
    """

    def __init__(self, store) -> None:
        self.store = store
        self._copy_done: dict[int, Any] = {}
        self._waits: list[tuple[int, Any, float, Any]] = []
        self._origin = None
        self._host_origin = 0.0
        self.steps: list[dict[str, Any]] = []
        store.observers.append(self)

    def detach(self) -> None:
        """Stop observing the store."""
        self.store.observers.remove(self)

    def on_fetch(self, index: int) -> None:
        """The store issued block ``index``'s copy (it is called only when a copy happened)."""
        if self._origin is not None:
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.store.copy_stream)
            self._copy_done[index] = done

    def on_wait(self, index: int) -> None:
        """The compute stream is about to wait for block ``index``'s copy."""
        if self._origin is not None and not self.store.blocks[index].resident:
            wanted = torch.cuda.Event(enable_timing=True)
            wanted.record(torch.cuda.current_stream(self.store.device))
            self._waits.append((index, wanted, time.perf_counter(), self._copy_done.get(index)))

    def hooks(self, warmup: int):
        """``(begin, end)`` for :func:`run_arm`: trace the steps from index ``warmup`` on."""
        def begin(step: int) -> None:
            if step >= warmup:
                self._copy_done, self._waits = {}, []
                self._origin = torch.cuda.Event(enable_timing=True)
                self._origin.record(torch.cuda.current_stream(self.store.device))
                self._host_origin = time.perf_counter()

        def end(step: int) -> None:
            if step >= warmup and self._origin is not None:
                torch.cuda.synchronize(self.store.device)
                try:  # a diagnostic must not cost the arm
                    self.steps.append(self._step_summary())
                except Exception as exc:  # noqa: BLE001
                    self.steps.append({"error": f"{type(exc).__name__}: {exc}"})
                self._origin = None
        return begin, end

    def _step_summary(self) -> dict[str, Any]:
        stalls = {"forward": 0.0, "backward": 0.0}
        lags, worst, phase, previous = [], [], "forward", -1
        for index, wanted, host_time, done in self._waits:
            if index < previous:
                phase = "backward"
            previous = index
            at = self._origin.elapsed_time(wanted)
            lags.append(at - (host_time - self._host_origin) * 1000.0)
            stall = max(0.0, self._origin.elapsed_time(done) - at) if done is not None else 0.0
            stalls[phase] += stall
            worst.append((stall, index, phase))
        lags.sort()
        worst.sort(reverse=True)
        return {
            "waits": len(self._waits), "copies": len(self._copy_done),
            "stall_forward_ms": round(stalls["forward"], 3), "stall_backward_ms": round(stalls["backward"], 3),
            "stalled_waits": sum(1 for s, _, _ in worst if s > 0.05),
            "gpu_lag_ms_median": round(lags[len(lags) // 2], 3) if lags else None,
            "gpu_lag_ms_p10": round(lags[len(lags) // 10], 3) if lags else None,
            "waits_gpu_starved": sum(1 for lag in lags if lag < 0.1),
            "largest_stalls": [{"ms": round(s, 3), "block": i, "phase": p} for s, i, p in worst[:3] if s > 0],
        }

    def summary(self) -> dict[str, Any]:
        """Per-step records and their medians (milliseconds)."""
        def median(key):
            values = sorted(step[key] for step in self.steps if step.get(key) is not None)
            return values[len(values) // 2] if values else None
        return {"steps": self.steps,
                **{f"median_{k}": median(k) for k in ("stall_forward_ms", "stall_backward_ms", "gpu_lag_ms_median",
                                                       "waits_gpu_starved", "waits")}}

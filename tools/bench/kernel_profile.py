"""One Trainer step under ``torch.profiler``, its GPU time by kernel category (``python -m tools.bench --profile`` on the
Trainer arms): GEMM, dequantize, attention, elementwise/norm, LoRA, optimizer, copies, host-to-device copies and
idle, in milliseconds.

Categories come from the kernel names (first match wins, :data:`CATEGORIES`): bitsandbytes' dequantize kernels;
attention kernels (flash / memory-efficient / cuDNN SDPA); fp32 GEMMs (``sgemm``, FFMA kernels, ``gemv``: PEFT's
fp32 LoRA matmuls run there, the bf16 base's GEMMs do not) as LoRA; every other GEMM (cuBLAS/CUTLASS/nvjet);
AdamW's fused and foreach kernels (and gradient clipping's) as optimizer; host-to-device copies (Poros' block
fetches, on their own stream, under the compute) as h2d; other copies (memcpy, memset, dtype casts, ``copy_``);
the rest elementwise/norm. ``idle`` is the step's span less the union of every kernel and copy interval; ``gaps``
splits it by the length of each idle interval and names the longest ones' neighbouring kernels.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import TrainerCallback


#: (category, regex on the kernel name), first match wins
CATEGORIES = (
    ("h2d", r"Memcpy HtoD"),
    ("dequantize", r"dequant|kDequantize|kgemm_4bit|gemm_4bit"),
    ("attention", r"flash|fmha|attention|sdpa|mha_|cudnn.*(sdpa|attn)"),
    ("optimizer", r"multi_tensor|adam|Adam|foreach|fused_adam"),
    ("lora", r"sgemm|ffma|gemv|f32f32|s1688|_s16816gemm.*f32"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|Gemm"),
    ("copies", r"Memcpy|Memset|copy|Copy|cast|convert|CatArray|to_copy"),
    ("elementwise_norm", r"."),
)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in CATEGORIES)


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


#: idle gaps by length, upper bounds in ms: many short gaps are a host that launches kernels one by one just
#: behind the GPU; a few long ones are the host stopped (a sync, a garbage-collector pass, Python work between calls)
GAP_BOUNDS_MS = (0.01, 0.1, 1.0, 10.0, float("inf"))


def gaps(events: list[tuple[str, float, float]], largest: int = 10) -> dict[str, Any]:
    """The step's idle intervals (no kernel or copy on any stream): counted and summed by length
    (:data:`GAP_BOUNDS_MS`), and the ``largest`` of them with their offset in the step and the kernels on either
    side (what the GPU finished before it waited, and what the host queued next)."""
    ordered = sorted(events, key=lambda event: event[1])
    begin = ordered[0][1]
    found: list[tuple[float, float, str, str]] = []  # (length, offset, before, after)
    end, last = ordered[0][2], ordered[0][0]
    for name, start, stop in ordered[1:]:
        if start > end:
            found.append((start - end, end - begin, last, name))
        if stop > end:
            end, last = stop, name
    buckets = []
    low = 0.0
    for high in GAP_BOUNDS_MS:
        inside = [length for length, *_ in found if low < length <= high]
        buckets.append({"up_to_ms": None if high == float("inf") else high, "count": len(inside),
                        "ms": round(sum(inside), 3)})
        low = high
    return {"by_length": buckets,
            "largest": [{"offset_ms": round(offset, 3), "ms": round(length, 3), "after": before[:80], "before": after[:80]}
                        for length, offset, before, after in sorted(found, reverse=True)[:largest]]}


def category(kernel: str) -> str:
    return next(name for name, pattern in _COMPILED if pattern.search(kernel))


def breakdown(events: list[tuple[str, float, float]]) -> dict[str, Any]:
    """``events``: (name, start ms, end ms) of every GPU kernel, copy and memset of the step."""
    if not events:
        return {"error": "no CUDA kernels traced"}
    by: dict[str, float] = {name: 0.0 for name, _ in CATEGORIES}
    calls: dict[str, int] = {name: 0 for name, _ in CATEGORIES}
    top: dict[str, list] = {}
    for name, start, end in events:
        kind = category(name)
        by[kind] += end - start
        calls[kind] += 1
        entry = top.setdefault(name, [kind, 0, 0.0])
        entry[1] += 1
        entry[2] += end - start
    begin, finish = min(s for _, s, _ in events), max(e for _, _, e in events)
    busy = busy_ms([(s, e) for _, s, e in events])
    return {"span_ms": round(finish - begin, 3), "busy_ms": round(busy, 3), "idle_ms": round(finish - begin - busy, 3),
            "category_ms": {k: round(v, 3) for k, v in by.items()}, "category_calls": calls, "gaps": gaps(events),
            "top_kernels": [{"name": n[:100], "category": k, "calls": c, "ms": round(ms, 3)}
                            for n, (k, c, ms) in sorted(top.items(), key=lambda kv: -kv[1][2])[:25]]}


class KernelProfile(TrainerCallback):
    """Traces optimizer step ``step`` (1-based) of a Trainer run; :attr:`result` is its :func:`breakdown`."""

    def __init__(self, step: int, device: torch.device) -> None:
        self.step, self.device = step, torch.device(device)
        self.result: dict[str, Any] | None = None
        self._profiler = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize(self.device)
            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is None:
            return
        torch.cuda.synchronize(self.device)
        self._profiler.__exit__(None, None, None)
        events = [(e.name, e.time_range.start / 1000.0, e.time_range.end / 1000.0) for e in self._profiler.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA]
        self.result = {"step": self.step, **breakdown(events)}
        self._profiler = None


__all__ = ["CATEGORIES", "GAP_BOUNDS_MS", "KernelProfile", "breakdown", "busy_ms", "category", "gaps"]

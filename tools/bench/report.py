"""The lines a tool prints from its report: the bench's table, the copy stalls of a timeline, what an
arm measured beside its step time, and the parity of two arms. Printing only: the numbers are the
report's (:mod:`tools.bench.arms`, :mod:`tools.bench.timeline`)."""

from __future__ import annotations

from typing import Any

from tools.bench.provenance import environment_line


def format_value(value, digits: int = 3) -> str:
    """A table cell: ``-`` for None, a float with ``digits`` decimals, anything else as ``str``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(report: dict[str, Any]) -> None:
    """The bench's table: one row per arm, then the link, the copy stalls and the parity lines."""
    env, cfg = report["environment"], report["config"]
    print(f"\n{cfg['model']} ({cfg['model_info']['num_hidden_layers']} layers) seq {cfg['seq']} batch {cfg['batch']}"
          f" on {environment_line(env)}")
    header = f"{'arm':<14}{'status':<8}{'peak alloc GB':>14}{'peak resv GB':>14}{'median step s':>15}" \
             f"{'H2D GB/s':>10}{'MB/step':>10}  losses"
    print(header)
    print("-" * len(header))
    for name, arm in report["arms"].items():
        per_step = arm.get("bytes_copied_per_step")
        losses = " ".join(f"{x:.6f}" if isinstance(x, float) else str(x) for x in arm["losses"])
        print(f"{name:<14}{arm['status']:<8}{format_value(arm.get('peak_allocated_gb')):>14}"
              f"{format_value(arm.get('peak_reserved_gb')):>14}{format_value(arm.get('median_step_s'), 4):>15}"
              f"{format_value(arm.get('h2d_gb_per_s')):>10}{format_value(per_step / 1e6 if per_step else None, 1):>10}  {losses}")
        if arm.get("error"):
            print(f"          {arm['error'].splitlines()[0]}")
    link, fraction = report["build"].get("link_h2d_gb_per_s"), report["arms"].get("poros", {}).get("h2d_fraction_of_link")
    if link:
        print(f"pinned host->device link: {link} GB/s; poros achieved {format_value(fraction, 3)} of it over its timed steps")
    timeline = report["arms"].get("poros", {}).get("copy_timeline")
    if timeline:
        print(timeline_line(timeline))
    prediction_lines(report["arms"].get("poros", {}))
    comparison = report.get("comparison") or {}
    if "bitwise" in comparison:
        print(f"poros/resident: step time x{format_value(comparison.get('ratio_median_step_s'))}, "
              f"peak allocated x{format_value(comparison.get('ratio_peak_allocated_gb'))}")
        print(parity_line("parity poros vs resident", comparison))
    if "control" in comparison:
        print(parity_line("control resident vs resident", comparison["control"]))
    for flow, diffs in (report.get("trainer") or {}).items():
        print(f"{flow}-poros/{flow}-resident: step time x{format_value(diffs.get('ratio_median_step_s'))}, "
              f"peak allocated x{format_value(diffs.get('ratio_peak_allocated_gb'))}")
        print(parity_line(f"parity {flow}-poros vs {flow}-resident", diffs))
    for name, arm in report["arms"].items():
        if arm.get("tokens_per_s") is not None:
            print(f"{name}: {arm['tokens_per_s']} tokens/s ({arm['tokens_per_step']} tokens per optimizer step)")
    print_unsloth(report)


def print_unsloth(report: dict[str, Any]) -> None:
    """The Unsloth arm's depth and its ratios against the other arms (tools.bench.unsloth_arm.compare)."""
    arm, ratios = report["arms"].get("unsloth"), report.get("unsloth")
    if arm is None:
        return
    if arm.get("depth_reason"):
        print(f"unsloth: {arm['depth_reason']}")
    if not ratios:
        return
    if not ratios.get("comparable"):
        print(f"unsloth: not compared with the other arms ({ratios.get('reason')})")
        return
    for name, values in ratios.items():
        if name != "comparable":
            print(f"unsloth/{name}: step time x{format_value(values.get('ratio_median_step_s'))}, peak allocated "
                  f"x{format_value(values.get('ratio_peak_allocated_gb'))}, tokens/s "
                  f"x{format_value(values.get('ratio_tokens_per_s'))}")


def prediction_lines(arm: dict[str, Any]) -> None:
    """The planner's predicted peak by part beside the measured peak (the poros arm's ``prediction``), and the
    host RAM: what the long-context runs compare (issue 32)."""
    prediction = arm.get("prediction") or {}
    peak = prediction.get("peak")
    if not peak or arm.get("peak_allocated_gb") is None:
        return
    measured = arm["peak_allocated_gb"] * 1e9
    print(f"planner: predicted peak {peak['total'] / 1e9:.2f} GB at the {peak['phase']}, measured "
          f"{arm['peak_allocated_gb']:.2f} GB ({peak['total'] / measured - 1:+.1%}); loss_chunks "
          f"{arm.get('loss_chunks')}, mlp_chunks {arm.get('mlp_chunks')}, boundary states {arm.get('boundary_states')}, "
          f"host peak RSS {format_value(arm.get('host_peak_rss_gb'))} GB")
    for name, size in (*peak["persistent"].items(), *peak["transient"].items()):
        if size:
            print(f"  {size / 1e9:9.3f} GB  {name}")


def timeline_line(timeline: dict[str, Any]) -> str:
    """One line from :meth:`CopyTimeline.summary`."""
    return (f"copy stalls per step (median): forward {format_value(timeline.get('median_stall_forward_ms'), 1)} ms, "
            f"backward {format_value(timeline.get('median_stall_backward_ms'), 1)} ms; the GPU reached a block "
            f"{format_value(timeline.get('median_gpu_lag_ms_median'), 2)} ms after the host asked for it (median); "
            f"{timeline.get('median_waits_gpu_starved')} of {timeline.get('median_waits')} waits found the GPU "
            "starved by the host (< 0.1 ms)")


def diagnostics_line(summary: dict[str, Any]) -> str:
    """One line of what an arm measured beside its step time: how long the host took to queue a step,
    the caching allocator's device calls, and (with ``--profile``) kernels, idle GPU and host syncs."""
    parts = []
    if summary.get("median_host_s") is not None:
        parts.append(f"host queued a step in {summary['median_host_s']:.3f} s of {summary.get('median_step_s')} s")
    allocator = summary.get("allocator_per_step")
    if allocator:
        parts.append(f"allocator per step: {allocator['num_device_alloc']} cudaMalloc, {allocator['num_device_free']} "
                     f"cudaFree, {allocator['num_alloc_retries']} retries, {allocator['allocation.all.allocated']} allocations")
    profile = summary.get("profile") or {}
    if "kernels" in profile:
        parts.append(f"traced step: {profile['kernels']} kernels, {profile['kernel_sum_ms']:.0f} ms of kernels, GPU idle "
                     f"{profile['idle_ms']:.0f} of {profile['span_ms']:.0f} ms")
    syncs = summary.get("host_syncs")
    if syncs is not None:
        where = f" (most at {syncs['sites'][0]['where']})" if syncs["sites"] else ""
        parts.append(f"{syncs['syncs']} host syncs{where}")
    return "; ".join(parts)


def parity_line(title: str, diffs: dict[str, Any]) -> str:
    """One line of :func:`tools.bench.arms.parity`: the max abs diffs and whether the arms are bitwise equal."""
    return (f"{title}: max|dloss| {diffs['max_diff_loss']}  max|dadapter| {diffs['max_diff_adapter']}  "
            f"max|doptimizer| {diffs['max_diff_optimizer']}  ({'bitwise' if diffs['bitwise'] else 'NOT bitwise'}, "
            f"{diffs['adapter_tensors']} LoRA tensors, {diffs['optimizer_tensors']} AdamW state tensors)")

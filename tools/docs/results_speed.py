"""The results page's issue-41 tables (``tools.docs.gen_results_docs`` fills them): each Trainer / Unsloth arm's
machine numbers (tokens/s, model and hardware TFLOP/s, MFU against the dense bf16 rate its run measured, kept
blocks) and the kernel-category profile of the traced step (``python -m tools.bench --profile``); and the records
the speed plot draws (:func:`sweep_points`, ``tools.docs.speed_plot``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from tools.docs import docgen

#: the arms the machine table lists, in this order
ARMS = ("trl-resident", "trl-poros", "hf-resident", "hf-poros", "unsloth")
#: the profile's categories, in the table's order (tools.bench.kernel_profile.CATEGORIES)
CATEGORIES = ("gemm", "dequantize", "attention", "elementwise_norm", "lora", "optimizer", "copies", "h2d")


def _cell(value, pattern: str = "{}") -> str:
    return "-" if value is None else pattern.format(value)


def _dequantize_once(name: str, arm: dict) -> str:
    """A Poros arm's ``dequantize_once`` as it ran: on, or off (runs from before the option had bitsandbytes
    dequantize once per linear per call); ``-`` for the arms without Poros."""
    if not name.endswith("-poros"):
        return "-"
    return "on" if arm.get("dequantize_once") else "off"


def _link(path: Path, root: Path) -> str:
    return f"[{path.name}](../{path.relative_to(root)})"


def machine_reports(reports: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The bench reports with the machine's numbers: those whose run measured its dense bf16 rate (issue 41's
    runs on)."""
    return [(path, report) for path, report in reports if report.get("dense_bf16_tflops") is not None]


#: the arms the speed plot draws, in its legend's order (the sweep's arms, ``tools.bench.sweep.SWEEP_ARMS``)
PLOT_ARMS = ("trl-resident", "trl-poros", "unsloth")
#: the shape the speed plot draws (issue 41's sweep)
PLOT_SHAPE = "qwen2.5-32b"
#: config fields that make a run a variant of the sweep's configuration (a memory cap, Liger's kernels): not plotted
VARIANT_FIELDS = ("vram_limit_gb", "liger", "use_liger_kernel", "kernels")
_SESSION = re.compile(r"-s(\d+)$")


def _newness(path: Path, report: dict) -> tuple:
    """A record's place in time: its run's date, the session of that day (``h200-<date>-s<N>``; the day's first
    directory has no suffix) and its file name."""
    session = _SESSION.search(path.parent.name)
    return report["environment"].get("date", ""), int(session.group(1)) if session else 1, path.name


def sweep_points(reports: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """The records the speed plot draws, one per (seq, accumulation), sorted by them: the newest run of
    ``PLOT_SHAPE`` at full depth with deterministic algorithms off and the machine's numbers, uncapped and without a
    variant (``VARIANT_FIELDS``), that ran at least one of ``PLOT_ARMS``. The per-seq bench runs and a ``--sweep``'s
    per-configuration reports are both bench reports (``gen_results_docs.bench_reports``)."""
    newest: dict[tuple[int, int], tuple[Path, dict]] = {}
    for path, report in machine_reports(reports):
        config = report["config"]
        info = config.get("model_info") or {}
        if (config["model"] != PLOT_SHAPE or config["deterministic"] or info.get("num_hidden_layers") != info.get("full_depth")
                or any(config.get(field) for field in VARIANT_FIELDS)
                or not any(name in report["arms"] for name in PLOT_ARMS)):
            continue
        key = (config["seq"], config.get("grad_accum", 1))
        if key not in newest or _newness(path, report) > _newness(*newest[key]):
            newest[key] = (path, report)
    return [newest[key] for key in sorted(newest)]


def render_machine(reports: list[tuple[Path, dict]], root: Path) -> str:
    """One row per arm of every bench report with a dense bf16 rate (issue 41's runs on)."""
    rows = ["| shape | seq | accum | det. | arm | step s | tokens/s | model TFLOP/s | hardware TFLOP/s | MFU | "
            "dense bf16 TFLOP/s | kept blocks | dequantize once | peak GB | JSON |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in machine_reports(reports):
        dense, config = report["dense_bf16_tflops"], report["config"]
        for name in (n for n in ARMS if n in report["arms"]):
            arm = report["arms"][name]
            kept = arm.get("kept_activation_blocks")
            depth = config["model_info"]
            shape = config["model"] + ("" if depth["num_hidden_layers"] == depth.get("full_depth", depth["num_hidden_layers"])
                                       else f" ({depth['num_hidden_layers']} of {depth['full_depth']} layers)")
            rows.append(f"| {shape} | {config['seq']} | {config.get('grad_accum', 1)} | "
                        f"{'on' if config['deterministic'] else 'off'} | {docgen.arm_label(name, arm)} | "
                        f"{_cell(arm.get('median_step_s'), '{:.3f}')}{docgen.shared_mark(config)} | "
                        f"{_cell(arm.get('tokens_per_s'))} | {_cell(arm.get('model_tflops'))} | "
                        f"{_cell(arm.get('hardware_tflops'))} | {_cell(arm.get('mfu'), '{:.1%}')} | {dense} | "
                        f"{_cell(kept) if name.endswith('-poros') else '-'} | {_dequantize_once(name, arm)} | "
                        f"{_cell(arm.get('peak_allocated_gb'), '{:.2f}')} | "
                        f"{_link(path, root)} |")
    return docgen.rows_or_pending(rows)


def render_kernel_profile(reports: list[tuple[Path, dict]], root: Path) -> str:
    """One row per traced arm: the step's span, its GPU time by category and its idle time, in ms (h2d: copies
    from the host, which Poros runs on a side stream under the compute)."""
    rows = ["| shape | seq | accum | arm | span | " + " | ".join(c.replace("_", "/") for c in CATEGORIES)
            + " | idle | JSON |", "|---|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|"]
    for path, report in reports:
        config = report["config"]
        for name, arm in report["arms"].items():
            profile = arm.get("kernel_profile")
            if not profile or "category_ms" not in profile:
                continue
            cells = " | ".join(f"{ms:.0f}" for ms in _categories(profile).values())
            rows.append(f"| {config['model']} | {config['seq']} | {config.get('grad_accum', 1)} | {docgen.arm_label(name, arm)} | "
                        f"{profile['span_ms']:.0f} | {cells} | {profile['idle_ms']:.0f} | {_link(path, root)} |")
    return docgen.rows_or_pending(rows)


def _categories(profile: dict) -> dict[str, float]:
    """The profile's milliseconds per category; a profile from before ``h2d`` was its own category has its
    host-to-device copies moved out of ``copies`` from its top kernels."""
    ms = {c: profile["category_ms"].get(c, 0.0) for c in CATEGORIES}
    if "h2d" not in profile["category_ms"]:
        ms["h2d"] = sum(k["ms"] for k in profile.get("top_kernels", []) if "Memcpy HtoD" in k["name"])
        ms["copies"] -= ms["h2d"]
    return ms


def blocks(reports: Callable[[], list[tuple[Path, dict]]], root: Path) -> dict[str, Callable[[], str]]:
    """The generated blocks this module fills, by name."""
    return {"machine": lambda: render_machine(reports(), root),
            "kernel-profile": lambda: render_kernel_profile(reports(), root)}


__all__ = ["ARMS", "CATEGORIES", "PLOT_ARMS", "PLOT_SHAPE", "VARIANT_FIELDS", "blocks", "machine_reports",
           "render_kernel_profile", "render_machine", "sweep_points"]

"""Render docs/results-h200.md from the JSON that tools/bench/harness.py and tools/checks/parity_gate.py wrote.

    python -m tools.docs.gen_results_docs            # rewrite the generated blocks of docs/results-h200.md
    python -m tools.docs.gen_results_docs --check    # exit 1 if the page (or the speed plot) is stale

Only the text between ``<!-- BEGIN GENERATED: name -->`` and ``<!-- END GENERATED: name -->`` is
rewritten; the analysis around it is prose kept in the page. Every number in the generated
blocks comes from a JSON file under ``registry/results/h200-*/``, named in the table. The speed plot,
``docs/img/speed-h200.png`` (``tools/docs/speed_plot.py``), is written with the page.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tools.docs import docgen, results_speed, speed_plot  # write or --check

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results-h200.md"
RESULTS = sorted(ROOT.glob("registry/results/h200-*"))
#: runs on another card (the GPU tool lends an H100 at times): their own table, never mixed with the H200's
OTHER_CARDS = sorted(d for d in ROOT.glob("registry/results/*-20*")
                     if d.is_dir() and not d.name.startswith(("h200-", "cpu-")))


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _gb(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


_parity = docgen.parity_label


def bench_reports(directories: list[Path] = RESULTS) -> list[tuple[Path, dict]]:
    """Every H200 bench report: ``bench-*.json``, and the per-configuration reports ``--sweep`` writes beside its merged
    JSON (``sweep-<seq>-<accum>.json``, ``tools/bench/sweep.py``; the merged file, rows without a ``config``, only
    repeats them and is not read)."""
    paths = (p for d in directories for p in sorted([*d.glob("bench-*.json"), *d.glob("sweep-*.json")]))
    return [(p, report) for p, report in ((p, _load(p)) for p in paths) if "config" in report and "arms" in report]


def render_environment() -> str:
    reports = bench_reports() + curve_reports()
    envs = {json.dumps({k: r["environment"].get(k) for k in ("platform", "torch_build", "transformers", "peft",
                                                              "bitsandbytes", "python")}, sort_keys=True)
            for _, r in reports}
    lines = []
    for env in sorted(envs):
        e = json.loads(env)
        lines.append(f"- {e['platform']}, torch {e['torch_build']}, transformers {e['transformers']}, "
                     f"PEFT {e['peft']}, bitsandbytes {e['bitsandbytes']}, Python {e['python']}")
    dates = sorted({(r["environment"]["date"], r["environment"]["commit"]) for _, r in reports})
    lines.append("- runs: " + ", ".join(f"{d} at commit `{c}`" for d, c in dates))
    return "\n".join(lines)


def render_profile() -> str:
    """One traced step per arm (``tools/bench/harness.py --profile``): where the step's time goes, in ms."""
    rows = ["| shape | seq | accum | det. | arm | traced span ms | kernels busy ms | H2D busy ms "
            "| H2D exposed ms | idle ms | JSON |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in bench_reports():
        config = report["config"]
        for arm, result in report["arms"].items():
            profile = result.get("profile")
            if not profile or "span_ms" not in profile:
                continue
            rows.append(
                f"| {config['model']} | {config['seq']} | {docgen.accum_label(config)} | "
                f"{'on' if config['deterministic'] else 'off'} | {arm} | {profile['span_ms']:.0f} | "
                f"{profile['kernel_busy_ms']:.0f} | {profile['h2d_busy_ms']:.0f} | {profile['h2d_exposed_ms']:.0f} | "
                f"{profile['idle_ms']:.0f} | [{path.name}](../{path.relative_to(ROOT)}) |")
    return "\n".join(rows)


def render_bench(capped: bool) -> str:
    head = ("| shape | layers | seq | accum | det. | resident peak GB | resident step s | Poros peak GB | Poros reserved GB "
            "| Poros step s | step ratio | memory ratio | H2D GB/s (of link) | parity | JSON |")
    if capped:
        head = ("| shape | layers | seq | accum | cap GB | budget (boundary states) | status | Poros peak GB "
                "| Poros reserved GB | Poros step s | H2D GB/s (of link) | JSON |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for path, report in bench_reports():
        config, arms = report["config"], report["arms"]
        if bool(config.get("vram_limit_gb")) != capped:
            continue
        if "poros" not in arms:
            continue  # resident-only runs (the determinism control) have their own table
        poros = arms["poros"]
        resident = arms.get("resident", {})
        link = report["build"].get("link_h2d_gb_per_s")
        h2d = "-" if not poros.get("h2d_gb_per_s") else \
            f"{poros['h2d_gb_per_s']:.1f} ({poros.get('h2d_fraction_of_link') or 0:.0%} of {link:.1f})"
        rel = path.relative_to(ROOT)
        layers = config["model_info"]["num_hidden_layers"]
        if capped:
            plan = poros.get("budget_plan") or {}
            budget = "-" if not config.get("vram_budget") else \
                f"{config['vram_budget']} ({plan.get('boundary_states', '-')})"
            rows.append(f"| {config['model']} | {layers} | {config['seq']} | {docgen.accum_label(config)} | "
                        f"{config['vram_limit_gb']:g} | {budget} | "
                        f"{poros.get('status')} | {_gb(poros.get('peak_allocated_gb'))} | "
                        f"{_gb(poros.get('peak_reserved_gb'))} | {_s(poros.get('median_step_s'))} | {h2d} | "
                        f"[{path.name}](../{rel}) |")
            continue
        comparison = report.get("comparison") or {}
        rows.append(
            f"| {config['model']} | {layers} | {config['seq']} | {docgen.accum_label(config)} | "
            f"{'on' if config['deterministic'] else 'off'} | "
            f"{_gb(resident.get('peak_allocated_gb'))} | {_s(resident.get('median_step_s'))} | "
            f"{_gb(poros.get('peak_allocated_gb'))} | {_gb(poros.get('peak_reserved_gb'))} | "
            f"{_s(poros.get('median_step_s'))}{docgen.shared_mark(config)} | {_x(comparison.get('ratio_median_step_s'))} | "
            f"{_x(comparison.get('ratio_peak_allocated_gb'))} | {h2d} | {_parity(comparison)} | "
            f"[{path.name}](../{rel}) |")
    return "\n".join(rows)


def render_control() -> str:
    rows = ["| shape | layers | seq | det. | resident step s | control step s | resident vs control | JSON |",
            "|---|---|---|---|---|---|---|---|"]
    for path, report in bench_reports():
        control = (report.get("comparison") or {}).get("control")
        if not control:
            continue
        config, arms = report["config"], report["arms"]
        rows.append(f"| {config['model']} | {config['model_info']['num_hidden_layers']} | {config['seq']} | "
                    f"{'on' if config['deterministic'] else 'off'} | {_s(arms['resident'].get('median_step_s'))} | "
                    f"{_s(arms['control'].get('median_step_s'))} | {_parity(control)} | "
                    f"[{path.name}](../{path.relative_to(ROOT)}) |")
    return "\n".join(rows)


def curve_reports() -> list[tuple[Path, dict]]:
    return [(p, _load(p)) for d in RESULTS for p in sorted(d.glob("curve-*.json"))]


def _err(value) -> str:
    return "-" if value is None else f"{value:+.0%}"


def _shape(config: dict) -> str:
    info = config.get("model_info") or {}
    layers, full = info.get("num_hidden_layers"), info.get("full_depth")
    return config["model"] if layers == full else f"{config['model']} ({layers} layers)"


def render_curve() -> str:
    """``tools/bench/vram_curve.py``: Poros at budgets from the minimum to all-resident, predictions beside.
    Runs with a control or ``--rounds`` also give each row its ratio to the resident runs around it."""
    rows = ["| shape | accum | budget | resident blocks | slots | boundary states | peak GB (predicted, error) "
            "| step s (predicted, error) | x first resident | x resident runs around it | copy stall ms/step "
            "| waits GPU-starved | parity | JSON |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in curve_reports():
        config, resident = report["config"], report.get("resident") or {}
        link = f"[JSON](../{path.relative_to(ROOT)})"
        accum, shape = docgen.accum_label(config), _shape(config)
        runs = [r["median_step_s"] for r in report.get("residents", [])]
        if not runs and report.get("control"):
            runs = [resident.get("median_step_s"), report["control"].get("median_step_s")]
        again = "" if len(runs) < 2 else " (again: " + ", ".join(_s(t) for t in runs[1:]) + ")"
        rows.append(f"| {shape} | {accum} | resident reference (HF checkpointing) | all | - | - | "
                    f"{_gb(resident.get('peak_allocated_gb'))} | {_s(resident.get('median_step_s'))}{again} | 1.00x "
                    f"| - | - | - | - | {link} |")
        for row in report["rows"]:
            timeline = row.get("copy_timeline") or {}
            stall = timeline.get("median_stall_forward_ms")
            stall = "-" if stall is None else f"{stall + (timeline.get('median_stall_backward_ms') or 0):.0f}"
            starved = "-" if not timeline.get("median_waits") else \
                f"{timeline['median_waits_gpu_starved']} of {timeline['median_waits']}"
            bracketed = row.get("ratio_step_bracketed")
            if bracketed is None and len(runs) == 2 and row.get("median_step_s") and all(runs):
                bracketed = row["median_step_s"] / (sum(runs) / 2)  # one round: the reference and the control
            budget = row["budget"] if row.get("round") in (None, 0) else f"{row['budget']} (round {row['round'] + 1})"
            rows.append(
                f"| {shape} | {accum} | {budget} | {row['resident_blocks']} of {row['blocks']} | "
                f"{row['num_slots']} | {_states(row, report)} | {_gb(row['peak_allocated_gb'])} "
                f"({_gb(row['predicted_peak_gb'])}, {_err(row['peak_error'])}) | {_s(row['median_step_s'])} "
                f"({_s(row['predicted_step_s'])}, {_err(row['step_error'])}) | {_x(row.get('ratio_step'))} | "
                f"{_x(bracketed)} | {stall} | {starved} | {_parity(row.get('parity'))} | {link} |")
    return "\n".join(rows)


def _states(row: dict, report: dict) -> str:
    """Where layer-major's boundary states waited. Rows from before vram_curve recorded the plan's choice:
    below the smallest budget that holds them on the device beside a two-slot ring, the planner can
    only have put them on the host (``prepare`` fails otherwise); at or above it, on the device."""
    if report["config"].get("schedule") != "layer-major" or report["config"].get("grad_accum", 1) < 2:
        return "-"
    if row.get("boundary_states"):
        return row["boundary_states"]
    from poros.config import parse_budget

    return "host" if parse_budget(row["budget"]) < report["range"]["minimum_budget_bytes"] else "device"


def render_host() -> str:
    """``vram_curve.py --profile``: per arm, how long the host took to queue a step against the step,
    the traced step's kernels and idle GPU, the host syncs and the caching allocator's device calls."""
    rows = ["| shape | accum | arm | step s | host queued s | kernels (traced) | kernel ms | GPU idle ms of traced "
            "| host syncs | cudaMalloc / step | JSON |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in curve_reports():
        arms = [("resident", report.get("resident") or {})]
        arms += [(f"Poros {r['budget']} ({r['resident_blocks']} of {r['blocks']} resident)", r) for r in report["rows"]]
        arms += [("resident again (control)", report["control"])] if report.get("control") else []
        if not any((arm.get("profile") or {}).get("kernels") for _, arm in arms):
            continue
        config = report["config"]
        for name, arm in arms:
            profile, syncs = arm.get("profile") or {}, arm.get("host_syncs") or {}
            allocator = arm.get("allocator_per_step") or {}
            rows.append(
                f"| {_shape(config)} | {docgen.accum_label(config)} | {name} | {_s(arm.get('median_step_s'))} | "
                f"{_s(arm.get('median_host_s'))} | {profile.get('kernels', '-')} | "
                f"{_ms(profile.get('kernel_sum_ms'))} | {_ms(profile.get('idle_ms'))} of {_ms(profile.get('span_ms'))} | "
                f"{syncs.get('syncs', '-')} | "
                f"{allocator.get('num_device_alloc', '-')} | [JSON](../{path.relative_to(ROOT)}) |")
    return "\n".join(rows)


def render_timeline() -> str:
    """``tools/bench/harness.py --timeline``: how long the compute waited for block copies, per step."""
    rows = ["| shape | seq | accum | det. | step ratio | copy stall forward ms | copy stall backward ms "
            "| GPU behind host ms (median) | waits GPU-starved | JSON |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in bench_reports():
        timeline = (report["arms"].get("poros") or {}).get("copy_timeline")
        if not timeline:
            continue
        config = report["config"]
        rows.append(
            f"| {config['model']} | {config['seq']} | {docgen.accum_label(config)} | {'on' if config['deterministic'] else 'off'} "
            f"| {_x((report.get('comparison') or {}).get('ratio_median_step_s'))} | "
            f"{timeline['median_stall_forward_ms']:.1f} | {timeline['median_stall_backward_ms']:.1f} | "
            f"{timeline['median_gpu_lag_ms_median']:.2f} | {timeline['median_waits_gpu_starved']} of "
            f"{timeline['median_waits']} | [{path.name}](../{path.relative_to(ROOT)}) |")
    return "\n".join(rows)


TRAINER_ARM_ORDER = ("trl-resident", "trl-poros", "hf-resident", "hf-poros", "unsloth")


def render_trainer() -> str:
    """``tools/bench/harness.py --arms trl-*,hf-*,unsloth``: TRL SFTTrainer / HF Trainer plain and with the one line,
    and Unsloth, side by side; a row saying so while no such run exists."""
    rows = ["| shape | layers | seq | accum | det. | arm | peak GB | reserved GB | step s | tokens/s | vs resident "
            "| parity | JSON |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, report in bench_reports():
        arms = report["arms"]
        if not any(name in arms for name in TRAINER_ARM_ORDER):
            continue
        config, trainer, unsloth = report["config"], report.get("trainer") or {}, report.get("unsloth") or {}
        for name in (n for n in TRAINER_ARM_ORDER if n in arms):
            arm, flow = arms[name], name.split("-")[0]
            layers = arm.get("layers") or config["model_info"]["num_hidden_layers"]
            if name == "unsloth":
                reference = next((unsloth[r] for r in ("trl-resident", "hf-resident") if r in unsloth), {})
                ratio, parity = _x(reference.get("ratio_median_step_s")), "- (other kernels)"
            elif name.endswith("-poros"):
                ratio, parity = _x((trainer.get(flow) or {}).get("ratio_median_step_s")), _parity(trainer.get(flow))
            else:
                ratio, parity = "1.00x" if arm.get("status") == "ok" else "-", "reference"
            status = "" if arm.get("status") == "ok" else f" ({arm.get('status')})"
            status += ", dequantize once" if arm.get("dequantize_once") else ""
            rows.append(f"| {config['model']} | {layers} | {config['seq']} | {config.get('grad_accum', 1)} | "
                        f"{'on' if config['deterministic'] else 'off'} | {docgen.arm_label(name, arm)}{status} | "
                        f"{_gb(arm.get('peak_allocated_gb'))} | {_gb(arm.get('peak_reserved_gb'))} | "
                        f"{_s(arm.get('median_step_s'))}{docgen.shared_mark(config)} | {arm.get('tokens_per_s') or '-'} | "
                        f"{ratio} | {parity} | "
                        f"[{path.name}](../{path.relative_to(ROOT)}) |")
    return docgen.rows_or_pending(rows)


def _reference_step(arms: dict) -> float | None:
    """The step the other arms of one report are set against: the resident arm's (TRL's, HF's or the bench's own)."""
    for name in ("trl-resident", "hf-resident", "resident"):
        if (arms.get(name) or {}).get("status") == "ok":
            return arms[name].get("median_step_s")
    return None


def render_other_cards() -> str:
    """Every bench arm of the runs on another card (``OTHER_CARDS``), with the card, the cap where it applied to the
    arm, MFU against the dense rate measured in that run (dense shapes), and the step against the same report's
    resident arm and Unsloth's."""
    rows = ["| card | shape | layers | seq | accum | det. | cap GB | arm | status | peak GB | reserved GB | step s "
            "| tokens/s | MFU | vs resident | vs Unsloth | parity | JSON |", "|" + "---|" * 18]
    for path, report in bench_reports(OTHER_CARDS):
        config, arms = report["config"], report["arms"]
        reference, unsloth = _reference_step(arms), (arms.get("unsloth") or {}).get("median_step_s")
        capped = config.get("capped_arms")
        for name, arm in arms.items():
            # MFU's FLOPs count dense linears (docs/benchmarking.md): none for an MoE run
            step, mfu = arm.get("median_step_s"), None if config.get("experts_implementation") else arm.get("mfu")
            flow, cap = name.split("-")[0], config.get("vram_limit_gb") if capped is None or name in capped else None
            applied = {key: arm[key] for key in ("loss_chunks", "boundary_states") if arm.get(key)}  # what ran
            accum = config.get("grad_accum", 1) if "-" in name or name == "unsloth" else \
                docgen.accum_label({**config, **applied})
            parity = (_parity(report.get("comparison")) if name == "poros" else
                      _parity((report.get("trainer") or {}).get(flow)) if name.endswith("-poros") else "-")
            rows.append(
                f"| {report['environment']['platform']} | {config['model']} | "
                f"{arm.get('layers') or config['model_info']['num_hidden_layers']} | {config['seq']} | "
                f"{accum} | {'on' if config['deterministic'] else 'off'} | "
                f"{cap or '-'} | {docgen.arm_label(name, arm)} | {arm.get('status')} | "
                f"{_gb(arm.get('peak_allocated_gb'))} | {_gb(arm.get('peak_reserved_gb'))} | {_s(step)} | "
                f"{arm.get('tokens_per_s') or '-'} | {'-' if mfu is None else f'{mfu:.1%}'} | "
                f"{_x(step / reference) if step and reference else '-'} | "
                f"{_x(step / unsloth) if step and unsloth and name != 'unsloth' else '-'} | {parity} | "
                f"[{path.name}](../{path.relative_to(ROOT)}) |")
    return docgen.rows_or_pending(rows)


def render_gate() -> str:
    rows = ["| variant | family | shape | label | max diff loss / LoRA / AdamW | JSON |", "|---|---|---|---|---|---|"]
    for directory in RESULTS:
        gate = directory / "gate.json"
        if not gate.exists():
            continue
        for record in _load(gate)["records"]:
            rows.append(f"| {record['variant']} | {record['family']} | {record['shape']} | {record['label']} | "
                        f"{record['max_diff_loss']:.1e} / {record['max_diff_adapter']:.1e} / "
                        f"{record['max_diff_optimizer']:.1e} | [gate.json](../{gate.relative_to(ROOT)}) |")
    return "\n".join(rows)


BLOCKS = {
    "environment": render_environment,
    "bench": lambda: render_bench(capped=False),
    "capped": lambda: render_bench(capped=True),
    "control": render_control,
    "gate": render_gate,
    "profile": render_profile,
    "host": render_host,
    "curve": render_curve,
    "timeline": render_timeline,
    "trainer": render_trainer,
    "other-cards": render_other_cards,
    **results_speed.blocks(bench_reports, ROOT),
    "speed-plot": lambda: speed_plot.render_block(results_speed.sweep_points(bench_reports()), PAGE),
}
#: the generated files beside the page: the speed plot its block and the README's show
FILES = {speed_plot.PLOT: lambda: speed_plot.render_png(results_speed.sweep_points(bench_reports()))}


def main(argv=None) -> int:
    return docgen.main_for_blocks(__doc__, PAGE, BLOCKS, argv, files=FILES)


if __name__ == "__main__":
    sys.exit(main())

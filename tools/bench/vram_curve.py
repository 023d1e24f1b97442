"""VRAM budget against step time: one model, the resident reference, then Poros at several budgets.

    python -m tools.bench.vram_curve --model qwen2.5-32b --grad-accum 8 --schedule layer-major \\
        --points 5 --deterministic --json out/curve-qwen2.5-32b.json
    python -m tools.bench.vram_curve --model tiny-qwen2 --device cpu --points 3 --steps 1 --warmup 1   # CI smoke

The model is built once (``tools/bench/models.py``'s random weights at the real shape). The resident arm
(HF + bnb NF4 + PEFT, gradient checkpointing) runs first; then, for each budget, the LoRA state
is reset, ``poros.prepare(vram_budget=...)`` lets the planner pick slots and resident blocks,
the arm runs, and ``unpatch()`` puts the weights back for the next budget. Budgets run from the
smallest one the planner accepts with a two-slot ring up to the one that keeps every block
resident, evenly spaced (``--points``), or as listed (``--budgets 9GiB,12GiB``). Each row holds
what the planner predicted (peak, step time from the compute probe and the measured link) beside
what was measured, and parity against the resident arm. JSON out; the curve in
``docs/results-h200.md`` is generated from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tools.bench.arms import ArmResult, GB, compare, free_memory, link_gb_per_s, parity, restore, run_arm, run_poros_arm, snapshot, trainable
from tools.bench.models import SEVEN_PROJECTIONS, add_lora, build_model, make_batches
from tools.bench.provenance import start_tool
from tools.bench.report import diagnostics_line, timeline_line
from tools.bench.shapes import SHAPES, model_config

GIB = 2**30
#: what an arm measures beside its step time (run_arm), copied into each row as is
DIAGNOSTICS = ("median_host_s", "host_times_s", "allocator_per_step", "profile", "host_syncs")


def budget_range(peft_model, workload, device: torch.device, num_slots: int = 2) -> tuple[int, int]:
    """(smallest budget with ``num_slots`` slots and nothing resident, budget that keeps every block
    resident) in bytes, as the planner computes them for this loaded model."""
    from poros import registry
    from poros.descriptor import resolve_path
    from poros.plan.footprint import plan_for_model
    from poros.stream.options import StreamOptions
    from poros.stream.placement import embeddings_on_host, host_embedding_tables

    causal_lm = peft_model.get_base_model()
    descriptor = registry.for_config(causal_lm.config)
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    options = StreamOptions(vram_budget=1 << 50, workload=workload, num_slots=num_slots,
                            embeddings_on_host=embeddings_on_host(None, device))
    everything = plan_for_model(causal_lm, layers, host_embedding_tables(causal_lm, descriptor), options,
                                device=device, compute_dtype=torch.bfloat16)
    return everything.pipelined_minimum_bytes, everything.needed_bytes


def budgets_for(points: int, low: int, high: int) -> list[str]:
    """``points`` budgets from ``low`` to ``high`` bytes, evenly spaced, as GiB (MiB below 1 GiB)
    strings rounded up to the hundredth."""
    values = [low] if points < 2 else [low + (high - low) * i / (points - 1) for i in range(points)]
    unit, size = ("GiB", GIB) if low >= GIB else ("MiB", 2**20)
    return [f"{-(-int(v) * 100 // size) / 100:.2f}{unit}" for v in values]


def resolve_budgets(listed: str | None, points: int, low: int, high: int) -> list[str]:
    """``--budgets`` in its order ('min' and 'all' named by the planner's range), else ``points`` budgets
    from ``low`` to ``high``."""
    if not listed:
        return budgets_for(points, low, high)
    ends = {"min": budgets_for(1, low, low)[0], "all": budgets_for(1, high, high)[0]}
    return [ends.get(budget, budget) for budget in listed.split(",")]


def bracketed_ratios(rows: list[dict[str, Any]], resident_steps: list[float | None]) -> dict[str, dict[str, Any]]:
    """Per budget: each round's step over the mean of the resident runs just before and just after that
    round (``resident_steps[k]`` and ``[k + 1]``), and their median. A machine that drifts during the
    run moves both sides of each ratio alike."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        k = row.get("round", 0)
        around = [t for t in resident_steps[k:k + 2] if t]
        if row.get("median_step_s") is None or len(around) < 2:
            continue
        row["ratio_step_bracketed"] = round(row["median_step_s"] / (sum(around) / 2), 4)
        out.setdefault(row["budget"], {"ratios": []})["ratios"].append(row["ratio_step_bracketed"])
    for entry in out.values():
        entry["median"] = round(statistics.median(entry["ratios"]), 4)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1, metavar="M")
    parser.add_argument("--schedule", default="layer-major", choices=("micro-major", "layer-major"),
                        help="the Poros schedule when M > 1")
    parser.add_argument("--points", type=int, default=5, help="budgets from the minimum to all-resident")
    parser.add_argument("--budgets", help="comma list of budgets instead of --points, in the order given (e.g. "
                        "all,min,6GiB: 'min' is the smallest with a two-slot ring and the states on the device, "
                        "'all' keeps every block resident)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--timeline", action="store_true", help="record copy stalls per step (CUDA events)")
    parser.add_argument("--profile", action="store_true",
                        help="two more steps per arm, not timed: one traced (kernels, CUDA runtime calls, host ops), "
                             "one with CUDA sync debugging (where the host waited for the device)")
    parser.add_argument("--no-resident", action="store_true", help="skip the resident reference arm")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the resident arm and every budget this many times, interleaved (the resident "
                             "again at the end); each budget's ratio is taken against the resident runs around it")
    parser.add_argument("--control", action="store_true",
                        help="run the resident arm again after the budgets: how much the machine drifted meanwhile")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--commit")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.model.startswith("tiny") else 512
    if args.threads is None and args.model.startswith("tiny") and args.device == "cpu":
        args.threads = 1
    return args


def row_for(budget: str, result: ArmResult, reference: ArmResult | None, warmup: int) -> dict[str, Any]:
    summary = result.summary(warmup)
    prediction = summary.get("prediction") or {}
    step = prediction.get("step") or {}
    plan = summary.get("budget_plan") or {}
    row = {
        "budget": budget, "status": result.status, "error": result.error,
        "resident_blocks": len(summary.get("resident_blocks") or []), "blocks": summary.get("blocks"),
        "num_slots": summary.get("num_slots"), "boundary_states": plan.get("boundary_states"),
        "predicted_peak_gb": round(prediction["peak_allocated_bytes"] / 1e9, 4)
        if "peak_allocated_bytes" in prediction else None,
        "predicted_step_s": step.get("step_s"),
        "planner_needed_gb": round(plan["needed_bytes"] / 1e9, 4) if plan.get("needed_bytes") else None,
        "peak_allocated_gb": summary.get("peak_allocated_gb"), "peak_reserved_gb": summary.get("peak_reserved_gb"),
        "median_step_s": summary.get("median_step_s"), "step_times_s": summary.get("step_times_s"),
        "bytes_copied_per_step": summary.get("bytes_copied_per_step"),
        "predicted_copy_bytes_per_step": prediction.get("copy_bytes_per_step"),
        "copy_timeline": summary.get("copy_timeline"),
        **{key: summary[key] for key in DIAGNOSTICS if key in summary},
    }
    for key, measured, predicted in (("peak", row["peak_allocated_gb"], row["predicted_peak_gb"]),
                                     ("step", row["median_step_s"], row["predicted_step_s"])):
        row[f"{key}_error"] = round(predicted / measured - 1, 4) if measured and predicted is not None else None
    comparison = compare({"resident": reference, "poros": result}, warmup) if reference is not None else None
    if comparison:
        row["parity"] = comparison
        row["ratio_step"] = comparison.get("ratio_median_step_s")
    return row


def run_config(args, info: dict[str, Any], budgets: list[str]) -> dict[str, Any]:
    """The report's ``config``: the run's settings as given, the shape's facts and the budgets run."""
    return {"model": args.model, "model_info": info, "seq": args.seq, "batch": args.batch,
            "grad_accum": args.grad_accum, "schedule": args.schedule, "steps": args.steps,
            "warmup": args.warmup, "deterministic": args.deterministic, "lora": {"rank": 16, "alpha": 32,
            "targets": list(SEVEN_PROJECTIONS)}, "optimizer": {"name": "AdamW", "lr": args.lr},
            "seed": args.seed, "budgets": budgets}


def print_row(row: dict[str, Any], error: str | None) -> None:
    """A budget's row as it is measured: the planner's decision and prediction beside the measurement."""
    print(f"budget {row['budget']}: {row['status']} {row['resident_blocks']}/{row['blocks']} resident, "
          f"{row['num_slots']} slots; peak {row['peak_allocated_gb']} GB (predicted {row['predicted_peak_gb']}), "
          f"step {row['median_step_s']} s (predicted {row['predicted_step_s']}), "
          f"x{row.get('ratio_step')} of resident, "
          f"{'bitwise' if (row.get('parity') or {}).get('bitwise') else 'parity: ' + str(row.get('parity'))}",
          flush=True)
    if row["copy_timeline"]:
        print("  " + timeline_line(row["copy_timeline"]), flush=True)
    print("  " + diagnostics_line(row), flush=True)
    if error:
        print("  " + error.splitlines()[0], flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, env = start_tool(args)
    config, info = model_config(args.model, layers=args.layers)
    from poros.doctor import probe
    from poros.plan import budget as planner
    from poros.plan.entry import workload_of

    workload = workload_of(batch_size=args.batch, seq_len=args.seq, grad_accum=args.grad_accum,
                           schedule=args.schedule)
    link = link_gb_per_s(device)
    compute = None
    if device.type == "cuda":
        compute = probe.probe_compute(config, workload, device, compute_dtype=torch.bfloat16, double_quant=True,
                                        attn_implementation="sdpa", target_modules=list(SEVEN_PROJECTIONS))
        free_memory(device)
    start = time.perf_counter()
    model = build_model(config, device, seed=args.seed)
    peft_model = add_lora(model)
    free_memory(device)
    build_s = time.perf_counter() - start
    batches = make_batches(config, count=(args.warmup + args.steps) * args.grad_accum, batch=args.batch,
                                 seq=args.seq, seed=args.seed + 1)
    named = trainable(peft_model)
    initial = snapshot(named)

    def resident_arm(label: str) -> ArmResult:
        restore(named, initial)
        peft_model.get_base_model().activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        result = run_arm(label, peft_model, named, batches, device=device, warmup=args.warmup, lr=args.lr,
                               grad_accum=args.grad_accum, profile=args.profile)
        summary = result.summary(args.warmup)
        print(f"{label}: {result.status} peak {summary.get('peak_allocated_gb')} GB, "
              f"median step {summary.get('median_step_s')} s", flush=True)
        print("  " + diagnostics_line(summary), flush=True)
        return result

    reference = None if args.no_resident else resident_arm("resident")
    low, high = budget_range(peft_model, workload, device)
    budgets = resolve_budgets(args.budgets, args.points, low, high)
    rows = []
    report = {
        "tool": "tools/bench/vram_curve.py", "environment": env,
        "config": run_config(args, info, budgets),
        "build": {"seconds": round(build_s, 2), "link_h2d_gb_per_s": link,
                  "compute_probe": None if compute is None else dataclasses.asdict(compute)},
        "range": {"minimum_budget_bytes": low, "all_resident_budget_bytes": high},
        "resident": None if reference is None else reference.summary(args.warmup),
        "rows": rows,
    }

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    def budget_arm(budget: str, round_index: int) -> None:
        restore(named, initial)
        result, handle = run_poros_arm(
            peft_model, batches, device=device, warmup=args.warmup, lr=args.lr, grad_accum=args.grad_accum,
            schedule=args.schedule, vram_budget=budget, compute=compute,
            link_bytes_per_s=link * GB if link else None, timeline=args.timeline, profile=args.profile)
        if handle is not None:
            handle.unpatch()
        handle = None  # this arm's store must not live on into the next arm's peak
        free_memory(device)
        row = row_for(budget, result, reference, args.warmup)
        row["round"] = round_index
        rows.append(row)
        print_row(row, result.error)
        save()  # after every row: a run cut short keeps what it measured

    # every resident run, in order (drift is measured): its step times and parity with the first, not
    # its adapter and optimizer snapshots (host copies of the whole LoRA state each)
    residents: list[dict[str, Any]] = []

    def remember(summary: dict[str, Any], bitwise: bool | None) -> None:
        residents.append({"median_step_s": summary.get("median_step_s"), "step_times_s": summary.get("step_times_s"),
                          "bitwise_with_first": bitwise})

    def again(label: str) -> ArmResult:
        result = resident_arm(label)
        remember(result.summary(args.warmup), parity(reference, result)["bitwise"] if reference else None)
        return result

    if reference is not None:
        remember(report["resident"], True)
    for round_index in range(args.rounds):
        if round_index > 0 and reference is not None:
            again(f"resident (round {round_index + 1})")
        for budget in budgets:
            budget_arm(budget, round_index)

    if args.control or (reference is not None and args.rounds > 1):
        control = again("control (resident again)")
        report["control"] = control.summary(args.warmup)
        if reference is not None:
            report["control"]["parity"] = parity(reference, control)
        control = None
    if len(residents) > 1 and reference is not None:
        report["residents"] = residents
        report["bracketed"] = bracketed_ratios(rows, [r["median_step_s"] for r in residents])
        for budget, entry in report["bracketed"].items():
            print(f"budget {budget}: x{entry['median']} of the resident runs around it (rounds: {entry['ratios']})",
                  flush=True)
    save()
    if args.json:
        print(f"wrote {args.json}")
    failed = any(r["status"] != "ok" for r in rows) or (reference is not None and reference.status != "ok")
    mismatch = any(not (r.get("parity") or {"bitwise": True})["bitwise"] for r in rows) and args.deterministic
    return 1 if failed or mismatch else 0


if __name__ == "__main__":
    sys.exit(main())

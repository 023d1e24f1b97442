"""Bench harness, the command line: resident QLoRA (the reference) against Poros streaming, one
process, one model; prints a table and writes the JSON report.

::

    python -m tools.bench --model qwen2.5-32b --seq 512 --batch 1 --steps 5 --warmup 2 \\
        --arms resident,poros --json out.json
    python -m tools.bench --model qwen2.5-72b --layers 20          # truncated depth, same width
    python -m tools.bench --model qwen2.5-32b --arms poros --vram-limit 8   # an 8 GB card
    python -m tools.bench --model qwen2.5-32b --arms poros --vram-budget 12GiB  # planner: resident blocks
    python -m tools.bench --model qwen2.5-72b --arms resident,control,poros # + reference vs itself
    python -m tools.bench --model tiny --device cpu --steps 2 --warmup 1    # CPU smoke test
    python -m tools.bench --model qwen2.5-32b --grad-accum 8 --deterministic \\
        --arms trl-resident,trl-poros,unsloth                               # SFTTrainer +- the one line, Unsloth

The pieces are modules of the ``tools`` package, which the other tools import too:

* :mod:`tools.bench.shapes` -- the shapes (``--model``), their facts from ``registry/*.toml``;
* :mod:`tools.bench.models` -- the model (random NF4 weights at the shape, built the way
  ``from_pretrained`` builds one), LoRA (PEFT, r16 / alpha 32 / dropout 0 on q,k,v,o,gate,up,down)
  and the batches;
* :mod:`tools.bench.arms` -- the arms (``resident``, ``control``, ``poros-device``, ``poros``) on ONE
  model object from the same LoRA state, and their parity;
* :mod:`tools.bench.trainer_arms` -- the Trainer arms (``trl-resident``, ``trl-poros``, ``hf-resident``,
  ``hf-poros``): TRL's ``SFTTrainer`` and HF's ``Trainer`` plain and with ``poros.prepare_trainer``;
* :mod:`tools.bench.unsloth_arm` -- the ``unsloth`` arm: the model saved as a bnb-4bit checkpoint, trained
  by Unsloth's ``FastLanguageModel`` + ``SFTTrainer`` in a child process with its own packages;
* :mod:`tools.bench.timeline` -- ``--profile`` (one traced step) and ``--timeline`` (copy stalls);
* :mod:`tools.bench.provenance` -- device, versions, date and commit in every report;
* :mod:`tools.bench.report` -- the table printed here.

Run the tools from the repository root as ``python -m tools.<job>.<name>`` (``tools/gpu_run.sh`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from tools.bench import unsloth_arm
from tools.bench.arms import ARMS, GB, compare_runs, free_memory, link_gb_per_s, trainable
from tools.bench.models import SEVEN_PROJECTIONS, add_lora, build_model, make_batches
from tools.bench.provenance import start_tool
from tools.bench.report import print_table
from tools.bench.shapes import SHAPES, model_config
from tools.bench.throughput import add_machine_numbers, dense_bf16_tflops
from tools.bench.trainer_arms import TRAINER_ARMS, compare_trainer_runs, run_trainer_arms, summaries, token_rows
from tools.bench.trainer_common import TrainerSetup

#: every ``--arms`` name: the step arms, the Trainer arms, then Unsloth's (in its own process, last)
ALL_ARMS = (*ARMS, *TRAINER_ARMS, unsloth_arm.ARM)


def _shape_and_steps(parser: argparse.ArgumentParser) -> None:
    """The shape a run measures and how many steps it times."""
    parser.add_argument("--model", default="qwen2.5-32b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int, help="truncate to N decoder layers (same width)")
    parser.add_argument("--seq", type=int, help="tokens per row (default 512; 64 for the tiny-* shapes)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps after warm-up (median over these)")
    parser.add_argument("--warmup", type=int, default=2)


def _outputs(parser: argparse.ArgumentParser) -> None:
    """What a run writes and where it keeps its copies: the sweep, the snapshots, the report."""
    parser.add_argument("--sweep", action="store_true",
                        help="seq 512/2048/4096/8192 x --grad-accum 1/4/8, one process each (tools/bench/sweep.py); "
                             "default arms trl-resident,trl-poros,unsloth; --json gets the merged rows")
    parser.add_argument("--snapshot-dir", type=Path, metavar="DIR",
                        help="keep each arm's copies of the LoRA tensors and AdamW state for the parity check in files "
                             "under DIR, memory-mapped, not in host memory (tools/bench/snapshots.py: 122B with expert "
                             "LoRA needs it on a 125 GB host)")
    parser.add_argument("--commit", help="commit to record (default: git, or $POROS_COMMIT)")
    parser.add_argument("--json", type=Path, help="write the report here")


def _kernels(parser: argparse.ArgumentParser) -> None:
    """Whose kernels the Trainer arms run."""
    parser.add_argument("--liger", action="store_true", help="the Trainer arms (trl-*, hf-*) train with "
                        "use_liger_kernel=True (TRL keeps its fused head); the step and Unsloth arms do not")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Resident QLoRA vs Poros streaming on random weights at real shapes; prints a table, writes JSON.",
        epilog="shapes: " + ", ".join(SHAPES),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _shape_and_steps(parser)
    _kernels(parser)
    parser.add_argument("--arms", default="resident,poros",
                        help="comma list of: " + ", ".join(ALL_ARMS) + " (control: resident again, the reference "
                             "against itself; trl-*/hf-*: SFTTrainer / HF Trainer plain and with poros.prepare_trainer; "
                             "unsloth: FastLanguageModel QLoRA in a child process); they run in that order")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deterministic", action="store_true",
                        help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8")
    parser.add_argument("--vram-limit", type=float, metavar="GB",
                        help="cap the process (set_per_process_memory_fraction) during each arm's steps")
    parser.add_argument("--cap-arms", type=lambda value: tuple(value.split(",")),
                        help="comma list of the arms --vram-limit caps (default: every arm), e.g. poros: the "
                             "reference runs uncapped for the parity check")
    parser.add_argument("--loss-chunks", type=int, default=1, metavar="N",
                        help="both arms compute the loss over N token chunks (poros.stream.chunked_loss; bitwise "
                             "between the arms, numerically HF's default loss); 1: HF's loss")
    parser.add_argument("--mlp-chunks", type=int, default=1, metavar="N",
                        help="every arm runs each block's MLP over N sequence chunks (poros.stream.tiling.tile_mlp, "
                             "prepare(mlp_chunks=N); bitwise between the arms, numerically the whole MLP); 1: whole")
    parser.add_argument("--boundary-states", choices=("device", "host", "disk"),
                        help="Poros arm, layer-major: where the M x L block inputs wait for backward "
                             "(prepare(boundary_states=...)); default: the planner's choice under --vram-budget, "
                             "else the device")
    parser.add_argument("--host-budget", metavar="SIZE",
                        help="Poros arm: prepare(host_budget=SIZE): the blocks' host tier, and with --vram-budget "
                             "the boundary states go to disk when it cannot hold them beside the blocks")
    parser.add_argument("--optimizer-states", default="device", choices=("device", "host"),
                        help="Poros arm: AdamW's state on the device (torch.optim.AdamW) or in pinned host memory "
                             "(poros.HostAdamW, stepped a chunk at a time); the reference keeps torch's AdamW")
    parser.add_argument("--lora-placement", default="device", choices=("device", "host", "auto"),
                        help="Poros arm: the streamed blocks' LoRA parameters and gradients on the device, or in "
                             "pinned host memory travelling with their block (poros.prepare(lora_placement=...); "
                             "needs --optimizer-states host and --schedule layer-major); auto: the --vram-budget "
                             "planner decides")
    parser.add_argument("--cuda-graphs", action="store_true", help="the poros arm replays its block phases from "
                        "CUDA graphs (prepare(cuda_graphs=True))")
    parser.add_argument("--recompute", choices=("auto", "all", "none"),
                        help="the -poros Trainer arms: prepare_trainer(recompute=...) (default: prepare's, auto)")
    parser.add_argument("--dequantize-once", choices=("auto", "true", "false"),
                        help="the -poros Trainer arms: prepare_trainer(dequantize_once=...) (default: prepare's, auto)")
    parser.add_argument("--slots", type=int, default=2, help="device slots of the Poros block ring")
    parser.add_argument("--vram-budget", metavar="SIZE",
                        help="poros.prepare(vram_budget=SIZE), e.g. 8GiB: the planner picks slots and resident blocks "
                             "(the poros arm and the -poros Trainer arms)")
    parser.add_argument("--resident-blocks", type=int, metavar="N",
                        help="the -poros Trainer arms: prepare_trainer(resident_blocks=N), the last N blocks stay on "
                             "the device (excludes --vram-budget, whose planner picks them)")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                        help="time one block with the planner's compute probe before building, so the JSON holds "
                             "the planner's step prediction (default: on CUDA when the poros arm runs)")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="M",
                        help="micro-batches per optimizer step (HF num_items_in_batch semantics when M > 1)")
    parser.add_argument("--profile", action="store_true",
                        help="trace one extra step per arm (CUDA): copy/compute busy, exposed copy, idle gaps")
    parser.add_argument("--timeline", action="store_true",
                        help="Poros arm on CUDA: per timed step, how long compute waited for block copies (CUDA "
                             "events) and how far the GPU trails the host")
    parser.add_argument("--schedule", default="micro-major", choices=("micro-major", "layer-major"),
                        help="Poros arm with --grad-accum: one model call per micro-batch, or layer-major")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--experts", choices=("grouped_mm", "eager", "batched_mm", "poros_nf4_grouped", "poros_nf4"),
                        help="MoE experts implementation: transformers' for bf16 experts (default: its grouped_mm "
                        "where it computes); with --quantize-experts Poros' NF4 forward, poros_nf4_grouped (the "
                        "default where grouped_mm computes) or the poros_nf4 loop. The JSON records the one that ran")
    parser.add_argument("--quantize-experts", action="store_true",
                        help="MoE experts in NF4 (poros.quantize_experts) in every arm: the resident NF4-expert model "
                        "is the reference")
    parser.add_argument("--lora-on-experts", action="store_true",
                        help="LoRA on the fused MoE experts too (PEFT target_parameters experts.gate_up_proj / "
                        "experts.down_proj, rank --rank per expert), on NF4 experts with --quantize-experts")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--targets", default=",".join(SEVEN_PROJECTIONS), help="comma list, or all-linear")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-double-quant", action="store_true", help="bnb_4bit_use_double_quant=False")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for tiny shapes on CPU)")
    unsloth_arm.add_arguments(parser)
    _outputs(parser)
    args = parser.parse_args(argv)
    if args.threads is None and args.model.startswith("tiny") and args.device == "cpu":
        args.threads = 1
    if args.seq is None:
        args.seq = 64 if args.model.startswith("tiny") else 512
    if (args.experts or "").startswith("poros_nf4") != bool(args.experts and args.quantize_experts):
        parser.error(f"--experts {args.experts}: poros_nf4* are the NF4 experts' forwards (with --quantize-experts); "
                     "with --quantize-experts pick poros_nf4_grouped or poros_nf4, or leave --experts out")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = set(args.arms) - set(ALL_ARMS)
    if unknown or not args.arms:
        parser.error(f"--arms {','.join(args.arms)}: expected a comma list of {', '.join(ALL_ARMS)}")
    return args


def experts_implementation(model) -> str | None:
    """The experts forward the model ran (``config._experts_implementation``), None for a model without experts."""
    from poros.loading.experts import experts_modules

    return model.config.get_text_config()._experts_implementation if experts_modules(model) else None


def write_report(report: dict, path: Path | None) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {path}")


def trainer_setup(args, device) -> TrainerSetup:
    """The Trainer arms' settings (the Unsloth child's too); ``output_dir`` is not created here."""
    import tempfile

    return TrainerSetup(device=str(device), warmup=args.warmup, steps=args.steps, grad_accum=args.grad_accum,
                        batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed, cuda_graphs=args.cuda_graphs,
                        vram_budget=args.vram_budget, resident_blocks=args.resident_blocks, recompute=args.recompute,
                        dequantize_once={"true": True, "false": False}.get(args.dequantize_once, args.dequantize_once),
                        profile=args.profile, liger=args.liger, vram_limit_gb=args.vram_limit,
                        capped_arms=args.cap_arms,
                        output_dir=os.path.join(tempfile.gettempdir(), f"poros-bench-trainer-{os.getpid()}"))


def trainer_arms_report(args, peft_model, batches, setup: TrainerSetup, arms: dict) -> dict:
    """The Trainer arms on ``peft_model`` (their summaries go into ``arms``); returns each flow's parity."""
    import shutil

    from poros import PorosModel

    if not any(arm in TRAINER_ARMS for arm in args.arms):
        return {}
    if isinstance(peft_model, PorosModel):
        peft_model.unpatch()  # the last step arm left it streamed; the Trainer arms start from the plain model
    results = run_trainer_arms(peft_model, batches, args.arms, setup)
    arms.update(summaries(results, setup))
    shutil.rmtree(setup.output_dir, ignore_errors=True)
    return compare_trainer_runs(results, setup)


def compute_probe(args, config, targets, device):
    """The planner's compute probe of one block (``--probe``; default on CUDA with the poros arm), before the
    model takes the memory; None when it does not run."""
    if "poros" not in args.arms or not (args.probe or (args.probe is None and device.type == "cuda")):
        return None
    from poros.doctor import probe
    from poros.plan.entry import workload_of

    compute = probe.probe_compute(
        config, workload_of(batch_size=args.batch, seq_len=args.seq, grad_accum=args.grad_accum,
                            schedule=args.schedule, loss_chunks=args.loss_chunks), device,
        compute_dtype=torch.bfloat16, double_quant=not args.no_double_quant, attn_implementation=args.attn,
        lora_rank=args.rank, lora_alpha=args.alpha, target_modules=list(targets) if not isinstance(targets, str)
        else targets)
    free_memory(device)
    return compute


def expert_parameters(on: bool) -> list[str] | None:
    """PEFT's ``target_parameters`` for ``--lora-on-experts`` (LoRA on the fused MoE experts), else None."""
    from poros.loading.experts import EXPERT_PARAMETERS

    return list(EXPERT_PARAMETERS) if on else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sweep:
        from tools.bench import sweep

        return sweep.run(list(sys.argv[1:] if argv is None else argv), args.json)
    if args.vram_limit and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        # Under a cap the allocator's reserved bytes count: without expandable segments, segments left
        # partly used by building the model stay reserved (they OOM-ed a 72B run under an 8 GB cap:
        # docs/results-h200.md). Set before the first CUDA allocation; recorded in the environment.
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.snapshot_dir is not None:
        from tools.bench import snapshots

        snapshots.DIRECTORY = args.snapshot_dir
    device, env = start_tool(args)
    dense = dense_bf16_tflops(device)  # the machine's dense bf16 rate, before anything else holds the device
    targets = "all-linear" if args.targets == "all-linear" else tuple(args.targets.split(","))
    config, info = model_config(args.model, layers=args.layers)
    link = link_gb_per_s(device) if "poros" in args.arms else None
    compute = compute_probe(args, config, targets, device)

    start = time.perf_counter()
    model = build_model(config, device, seed=args.seed, double_quant=not args.no_double_quant,
                        attn_implementation=args.attn, experts_implementation=args.experts,
                        quantize_experts=args.quantize_experts)
    # Unsloth loads a checkpoint: these very weights, written before LoRA goes in (tools.bench.unsloth_arm)
    checkpoint = unsloth_arm.save_checkpoint(model, args, device) if unsloth_arm.ARM in args.arms else None
    peft_model = add_lora(model, rank=args.rank, alpha=args.alpha, targets=targets,
                          target_parameters=expert_parameters(args.lora_on_experts))
    if args.loss_chunks > 1:  # on the model both arms run, so the parity check compares like with like
        from poros.stream.chunked_loss import use_chunked_loss

        use_chunked_loss(peft_model, args.loss_chunks)
    if args.mlp_chunks > 1:  # likewise the tiled MLP: the resident arms run it from here, the Poros arm's prepare too
        from poros.stream.tiling import tile_mlp

        tile_mlp(peft_model, args.mlp_chunks)
    free_memory(device)
    build_s = time.perf_counter() - start
    allocated = torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else None
    batches = make_batches(config, count=(args.warmup + args.steps) * args.grad_accum, batch=args.batch, seq=args.seq,
                           seed=args.seed + 1)

    step_arms = [arm for arm in args.arms if arm in ARMS]
    outcome = {"arms": {}, "comparison": None} if not step_arms else compare_runs(
                           peft_model, batches, arms=step_arms, device=device, warmup=args.warmup, lr=args.lr,
                           vram_limit_gb=args.vram_limit, num_slots=args.slots, grad_accum=args.grad_accum,
                           schedule=args.schedule, profile=args.profile, vram_budget=args.vram_budget, compute=compute,
                           timeline=args.timeline, optimizer_states=args.optimizer_states,
                           capped_arms=args.cap_arms,
                           loss_chunks=args.loss_chunks, cuda_graphs=args.cuda_graphs, lora_placement=args.lora_placement,
                           mlp_chunks=args.mlp_chunks, boundary_states=args.boundary_states,
                           host_budget=args.host_budget, link_bytes_per_s=link * GB if link else None)
    report = {
        "tool": "tools/bench/harness.py",
        "environment": env,
        "config": {
            "model": args.model, "model_info": info, "seq": args.seq, "batch": args.batch, "steps": args.steps,
            "warmup": args.warmup, "arms": args.arms, "deterministic": args.deterministic,
            "vram_limit_gb": args.vram_limit, "vram_budget": args.vram_budget, "num_slots": args.slots,
            "resident_blocks": args.resident_blocks,
            "capped_arms": list(args.cap_arms) if args.cap_arms else None,
            "optimizer_states": args.optimizer_states, "loss_chunks": args.loss_chunks, "cuda_graphs": args.cuda_graphs,
            "lora_placement": args.lora_placement,
            "mlp_chunks": args.mlp_chunks, "boundary_states": args.boundary_states, "host_budget": args.host_budget,
            "snapshot_dir": str(args.snapshot_dir) if args.snapshot_dir else None,
            "timeline": args.timeline, "grad_accum": args.grad_accum, "liger": args.liger,
            "schedule": args.schedule, "attn_implementation": args.attn,
            "experts_implementation": experts_implementation(model), "quantize_experts": args.quantize_experts,
            "lora": {"rank": args.rank, "alpha": args.alpha, "dropout": 0.0, "targets": targets, "on_experts": args.lora_on_experts},
            "optimizer": {"name": "AdamW", "lr": args.lr}, "gradient_checkpointing": "non-reentrant (resident)",
            "quantization": {"quant_type": "nf4", "double_quant": not args.no_double_quant,
                             "compute_dtype": "bfloat16"},
            "seed": args.seed, "cpu_threads": torch.get_num_threads(),
            "unsloth": None if unsloth_arm.ARM not in args.arms else {
                "site": args.unsloth_site, "layers": args.unsloth_layers,
                "gradient_checkpointing": args.unsloth_checkpointing},
        },
        "build": {"seconds": round(build_s, 2), "link_h2d_gb_per_s": link,
                  "allocated_after_build_gb": None if allocated is None else round(allocated, 4),
                  "trainable_parameters": sum(p.numel() for _, p in trainable(peft_model))},
        "arms": {name: result.summary(args.warmup) for name, result in outcome["arms"].items()},
        "comparison": outcome["comparison"],
    }
    for arm in report["arms"].values():  # tokens trained per second: batch x seq x grad_accum per step
        if arm.get("median_step_s"):
            arm["tokens_per_step"] = args.batch * args.seq * args.grad_accum
            arm["tokens_per_s"] = round(arm["tokens_per_step"] / arm["median_step_s"], 1)
    setup = trainer_setup(args, device)
    report["trainer_setup"] = {**setup.to_dict(), "tokens_per_step": setup.tokens_per_step}
    report["trainer"] = trainer_arms_report(args, peft_model, batches, setup, report["arms"])
    report["unsloth"] = None
    if checkpoint is not None:  # the child's turn: the device is freed of this process's model first
        write_report({**report, "partial": "the unsloth arm was running"}, args.json)  # kept if the step is killed
        del model, peft_model
        free_memory(device)
        parent = round(torch.cuda.memory_allocated(device) / GB, 4) if device.type == "cuda" else None
        report["arms"][unsloth_arm.ARM] = unsloth_arm.run(args, checkpoint, token_rows(batches), setup)
        report["arms"][unsloth_arm.ARM]["parent_allocated_gb"] = parent  # what this process still held meanwhile
        report["unsloth"] = unsloth_arm.compare(report["arms"], config.num_hidden_layers)
    add_machine_numbers(report["arms"], config.get_text_config(), args.seq, report.setdefault("dense_bf16_tflops", dense))
    achieved = report["arms"].get("poros", {}).get("h2d_gb_per_s")
    if link and achieved is not None:
        report["arms"]["poros"]["h2d_fraction_of_link"] = round(achieved / link, 4)
    print_table(report)
    write_report(report, args.json)
    failed = any(arm["status"] == "error" for arm in report["arms"].values())
    mismatch = not all(c.get("bitwise", True) for c in (report["comparison"] or {}, *report["trainer"].values()))
    return 1 if failed or mismatch or liger_missing(args, report["arms"]) else 0


def liger_missing(args, arms: dict) -> bool:
    """``--liger`` whose Trainer arm trained without Liger's kernels (nothing patched): said loudly, a failure."""
    missing = [name for name, arm in arms.items() if args.liger and name in TRAINER_ARMS
               and arm.get("status") == "ok" and not arm.get("kernels")]
    if missing:
        print(f"--liger: {', '.join(missing)} trained without Liger's kernels (nothing patched)", file=sys.stderr)
    return bool(missing)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Pre-quantized checkpoints at real shapes: ``poros quantize``, the start from a bnb-4bit checkpoint, and
the HF Trainer drop-in through ``poros.from_pretrained`` under a small memory cap.

For one shape (``tools.bench.shapes.SHAPES``, truncated to ``--layers`` decoder layers), the source of the
bnb-4bit checkpoint is ``--source``: ``bf16`` writes a random bf16 checkpoint tensor by tensor
(``tools.checks.cache_bench.write_checkpoint``) and ``poros quantize`` quantizes it; ``random`` writes only the
shape's ``config.json`` and ``poros quantize --random-weights`` builds the bnb-4bit checkpoint from it a
block at a time, so the full depth fits a disk that cannot hold the bf16 form (Qwen2.5-72B: about 41
GB against 145 GB; the tool refuses a bf16 source the disk cannot hold). Then it runs the arms of ``--arms``:

* ``quantize``: ``poros quantize`` (``--double-quant``, ``--max-shard-size``) in a child process: its
  time, the bytes written, the child's own peak RSS (the model is never whole in RAM) and its device
  peak. The later arms start from its output (it runs anyway when there is none).
* ``starts``: time to the first step in fresh processes, the page cache dropped before each (every
  start reads from the drive), the same LoRA and step, those of ``--starts``: ``bf16``
  (``load_pretrained`` of the bf16 checkpoint, every block read and quantized), ``cache_cold`` (the same
  through the NF4 block cache, which writes the entry), ``cached`` (from the entry), ``prequantized``
  (``load_pretrained`` of the bnb-4bit checkpoint: its packed bytes read straight to the host, no
  quantize pass) and ``prequantized_warm`` (again, its pages still cached). The first three need the
  bf16 checkpoint (``--source bf16``, at a depth the disk holds). Each row: ``load_s``, ``lora_s``,
  ``prepare_s``, ``start_s``, ``first_step_s``, ``through_first_step_s``, the launch-relative ones,
  and the device's peak from the load through ``prepare`` (``start_max_allocated_bytes``: the blocks of
  a bnb-4bit load never visit the device).
* ``dropin``: ``poros.from_pretrained(BNB, dtype=bf16, device_map={"": 0})`` + ``get_peft_model`` (LoRA
  r16 on the seven projections) + ``poros.prepare`` (``--vram-budget``, ``--loss-chunks``,
  ``--optimizer-states``) + HF ``Trainer`` (``--steps`` steps, batch 1 x ``--seq`` tokens,
  ``--grad-accum``), the process capped at ``--cap-gib`` (``torch.cuda.set_per_process_memory_fraction``,
  ``expandable_segments:True``): ``max_memory_allocated`` / ``max_memory_reserved`` after the load, after
  ``prepare`` and over the run, the step times and losses; ``fits`` is False with the error when it did
  not; ``reserved_within_acceptance``: the run's peak reserved <= ``--accept-reserved-gib`` (7.5).
* ``stranded``: the whole bnb-4bit model loaded onto the device the plain way (uncapped), then
  ``prepare``: ``memory_reserved`` minus ``memory_allocated`` after it (segments left reserved by the
  blocks moved off; ``prepare`` calls ``torch.cuda.empty_cache``) next to the slot ring's bytes.
* ``train``: ``poros train --model BNB --cuda-graphs true`` (layer-major, ``--train-steps`` steps,
  ``--grad-accum`` micro-batches of 1 x ``--seq``, synthetic data, logging every step) in a fresh
  process: the wall from its launch to the first step's line, each step's time (from ``metrics.jsonl``:
  tokens / tokens per second), its device peak, the detection line and the CUDA graphs line.

    python -m tools.checks.prequant_bench --model qwen2.5-72b --layers 8 --cap-gib 8 --json out/prequant-72b.json
    python -m tools.checks.prequant_bench --model qwen2.5-72b --layers 80 --source random --arms quantize --dir /tmp/pq
    DEVICE=cpu tools/gpu_run.sh prequant:tiny:steps=1:grad-accum=1:seq=16       # dry run without a GPU

At full depth on the H200 host (64 GB disk, 10 minutes a command) the arms go in separate steps that share
``--dir`` on one warm machine; docs/cache-and-host-memory.md lists them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tools.checks import cache_bench
from tools.bench.models import SEVEN_PROJECTIONS, make_batches
from tools.bench.provenance import add_run_arguments, start_tool
from tools.bench.shapes import SHAPES, model_config

REPO = Path(__file__).resolve().parents[2]
ARMS = ("quantize", "starts", "dropin", "stranded", "train")
STARTS = ("bf16", "cache_cold", "cached", "prequantized", "prequantized_warm")
#: the starts that read the bf16 checkpoint
BF16_STARTS = ("bf16", "cache_cold", "cached")
SOURCES = ("bf16", "random")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-72b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int, default=8,
                        help="decoder layers (bf16 + bnb-4bit + the cache entry go to the host's disk)")
    parser.add_argument("--arms", default="quantize,starts,dropin,stranded", help=f"which of {', '.join(ARMS)} to run")
    parser.add_argument("--source", default="bf16", choices=SOURCES,
                        help="bf16: a random bf16 checkpoint, then poros quantize; random: poros quantize "
                             "--random-weights from the shape's config.json (no bf16 anywhere: full depth)")
    parser.add_argument("--starts", default=",".join(STARTS), help=f"which of {', '.join(STARTS)} the starts arm runs")
    parser.add_argument("--max-shard-size", default="2GB", help="poros quantize's shards (the host holds one)")
    parser.add_argument("--vram-budget", default=None, help="the drop-in's prepare(vram_budget=...), e.g. 7GiB")
    parser.add_argument("--loss-chunks", type=int, default=1, help="the drop-in's prepare(loss_chunks=...)")
    parser.add_argument("--optimizer-states", default="auto", help="the drop-in's prepare(optimizer_states=...)")
    parser.add_argument("--accept-reserved-gib", type=float, default=7.5,
                        help="the drop-in's acceptance: peak reserved at most this")
    parser.add_argument("--train-steps", type=int, default=4, help="steps of the train arm")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (starts: layer-major)")
    parser.add_argument("--steps", type=int, default=3, help="HF Trainer steps of the drop-in arm")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="the drop-in arm's device memory cap")
    add_run_arguments(parser, "the checkpoints and the cache")
    parser.add_argument("--child", default=None, choices=(*STARTS, "dropin", "stranded", "quantize"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def memory(device: torch.device) -> dict[str, int | None]:
    """The caching allocator's counters now (None on the CPU)."""
    if device.type != "cuda":
        return {"allocated": None, "reserved": None, "max_allocated": None, "max_reserved": None}
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "max_reserved": torch.cuda.max_memory_reserved(device)}


def in_fresh_process(name: str, args, work: Path) -> dict:
    """One ``--child NAME`` run in a new Python process; its row (the last stdout line), with the
    launch-relative times."""
    launched = time.time()
    command = [sys.executable, "-m", "tools.checks.prequant_bench", "--child", name, "--launched-at", repr(launched),
               "--dir", str(work), "--model", args.model, "--layers", str(args.layers), "--seq", str(args.seq),
               "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--cap-gib", str(args.cap_gib),
               "--device", args.device, "--source", args.source, "--max-shard-size", args.max_shard_size,
               "--loss-chunks", str(args.loss_chunks), "--optimizer-states", args.optimizer_states,
               "--accept-reserved-gib", str(args.accept_reserved_gib),
               *(["--vram-budget", args.vram_budget] if args.vram_budget else []),
               *(["--deterministic"] if args.deterministic else []),
               *(["--threads", str(args.threads)] if args.threads else [])]
    env = {**os.environ, **({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if name == "dropin" else {})}
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env)
    if done.returncode != 0:
        return {"failed": True, "stderr": done.stderr[-3000:]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    if "first_step_began_at" in row:
        row["process_start_s"] = row.pop("first_step_began_at") - launched
        row["process_through_first_step_s"] = row.pop("first_step_done_at") - launched
    return row


def start_child(args, device: torch.device, config, work: Path) -> dict:
    """One start: load (bf16, through the cache, or pre-quantized) + LoRA + prepare, then one step."""
    name = args.child
    checkpoint = work / ("bnb-4bit" if name.startswith("prequantized") else "checkpoint")
    cache_dir = work / "cache" if name in ("cache_cold", "cached") else None
    micro_batches = make_batches(config, count=args.grad_accum, batch=1, seq=args.seq)
    cache_bench.sync(device)
    began = time.perf_counter()
    streamed, optimizer, phases = cache_bench.start(checkpoint, config, device, args, cache_dir=cache_dir, tier=None)
    started, began_at = time.perf_counter() - began, time.time()
    start_peak = memory(device)
    first = cache_bench.step(streamed, optimizer, micro_batches, device)
    row = {"tier": streamed.host_plan.tier,
           "imports_s": args.imported_at - args.launched_at if args.launched_at else None,
           **phases, "start_s": started, "first_step_s": first,
           "through_first_step_s": started + first, "first_step_began_at": began_at, "first_step_done_at": time.time(),
           "start_max_allocated_bytes": start_peak["max_allocated"], "detection": streamed.detection.summary()}
    cache_bench.close_tier(streamed)
    return row


def dropin_child(args, device: torch.device, config, work: Path) -> dict:
    """HF Trainer through poros.from_pretrained, the process capped at ``--cap-gib``."""
    import peft
    import transformers

    import poros
    from poros.testing.models import Rows

    row: dict[str, Any] = {"cap_bytes": None}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        row["cap_bytes"] = int(args.cap_gib * 2**30)
        torch.cuda.set_per_process_memory_fraction(min(1.0, row["cap_bytes"] / total), device)
    marks = {"began": time.perf_counter()}
    try:
        model = poros.from_pretrained(work / "bnb-4bit", dtype=torch.bfloat16, device_map={"": str(device)},
                                      attn_implementation="sdpa")
        marks["loaded"], row["after_load"] = time.perf_counter(), memory(device)
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=list(SEVEN_PROJECTIONS)))
        options = {"loss_chunks": args.loss_chunks, "optimizer_states": args.optimizer_states,
                   **({"vram_budget": args.vram_budget,  # the step it plans for: the Trainer's, micro-major
                       "workload": {"seq_len": args.seq, "batch_size": 1, "grad_accum": args.grad_accum,
                                    "schedule": "micro-major", "loss_chunks": args.loss_chunks}} if args.vram_budget else {})}
        row["prepare_options"] = options
        poros.prepare(model, **options)
        marks["prepared"], row["after_prepare"] = time.perf_counter(), memory(device)
        row["detection"] = model.detection.summary()
        rows = Rows([{k: v[0] for k, v in b.items()} for b in make_batches(
            config, count=args.steps * args.grad_accum, batch=1, seq=args.seq)])
        step_ends: list[float] = []

        class Clock(transformers.TrainerCallback):
            def on_step_end(self, *_, **__):
                cache_bench.sync(device)
                step_ends.append(time.perf_counter())

        training = transformers.TrainingArguments(
            output_dir=str(work / "dropin-run"), max_steps=args.steps, per_device_train_batch_size=1,
            gradient_accumulation_steps=args.grad_accum, learning_rate=1e-4, lr_scheduler_type="constant",
            optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[], bf16=device.type == "cuda",
            use_cpu=device.type == "cpu", dataloader_num_workers=0, disable_tqdm=True, seed=0)
        states = args.optimizer_states
        if states == "auto":  # the plan's choice with a vram_budget, else the Trainer's own AdamW
            states = model.budget_plan.optimizer_states if model.budget_plan is not None else "device"
        row["optimizer_states"] = states
        optimizers = (None, None)
        if states == "host":  # what a small-card script passes: AdamW's state in host memory
            optimizers = (poros.HostAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0),
                          None)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=rows, callbacks=[Clock()],
                                       optimizers=optimizers)
        marks["train_began"] = time.perf_counter()
        trainer.train()
        row["losses"] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        row["step_s"] = [b - a for a, b in zip([marks["train_began"], *step_ends], step_ends)]
        row["fits"] = True
    except torch.OutOfMemoryError as error:
        row["fits"], row["error"] = False, str(error).splitlines()[0]
    row["run"] = memory(device)
    row["accept_reserved_bytes"] = int(args.accept_reserved_gib * 2**30)
    row["reserved_within_acceptance"] = (None if row["run"]["max_reserved"] is None else
                                         bool(row.get("fits")) and row["run"]["max_reserved"] <= row["accept_reserved_bytes"])
    row["phases_s"] = {f"{b}_s": marks[b] - marks[a] for a, b in zip(marks, list(marks)[1:])}
    return row


def stranded_child(args, device: torch.device, config, work: Path) -> dict:
    """The plain load (every block on the device), then prepare: what stays reserved."""
    import peft
    import transformers

    import poros

    model = transformers.AutoModelForCausalLM.from_pretrained(work / "bnb-4bit", dtype=torch.bfloat16,
                                                              device_map={"": str(device)}, attn_implementation="sdpa")
    before = memory(device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                       target_modules=list(SEVEN_PROJECTIONS)))
    poros.prepare(model)
    after = memory(device)
    slots = sum(slot.numel() for slot in model.store.slots)
    return {"loaded": before, "prepared": after, "slot_bytes": slots,
            "stranded_bytes": None if after["reserved"] is None else after["reserved"] - after["allocated"]}


def quantize_child(args, device: torch.device, config, work: Path) -> dict:
    """``poros quantize`` (the CLI, in this process): its JSON, this process's peak RSS and device peak."""
    import contextlib
    import io

    from poros.cli.main import main as poros_main

    source = work / ("config" if args.source == "random" else "checkpoint")
    command = ["quantize", str(source), str(work / "bnb-4bit"), "--double-quant", "--device", str(device),
               "--max-shard-size", args.max_shard_size, "--json",
               *(["--random-weights", "--seed", "0"] if args.source == "random" else [])]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = poros_main(command)
    if status != 0:
        return {"failed": True, "status": status, "command": ["poros", *command]}
    text = printed.getvalue()
    return {**json.loads(text[text.index("{"):]), "command": ["poros", *command],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device_max_allocated_bytes": memory(device)["max_allocated"]}


def train_arm(args, work: Path) -> dict:
    """``poros train`` from the bnb-4bit checkpoint with CUDA graphs, in a fresh process: the wall from its
    launch to each step's line, the steps' times from ``metrics.jsonl``, the detection and graphs lines."""
    output = work / "train-run"
    shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "poros", "train", "--model", str(work / "bnb-4bit"), "--device", args.device,
               "--dataset", "synthetic", "--steps", str(args.train_steps), "--seq-len", str(args.seq),
               "--batch-size", "1", "--grad-accum", str(args.grad_accum), "--lora-rank", "16", "--lora-alpha", "32",
               "--stream-schedule", "layer-major", "--cuda-graphs", "true" if args.device != "cpu" else "false",
               "--no-cache", "true", "--logging-steps", "1", "--save-steps", "0", "--output-dir", str(output),
               *(["--deterministic", "true"] if args.deterministic else [])]
    launched = time.perf_counter()
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                          env={**os.environ, "POROS_LOAD_PLUGINS": ""}) as child_process:
        for line in child_process.stdout:
            lines.append((time.perf_counter() - launched, line.rstrip()))
    row: dict[str, Any] = {"command": command[2:], "returncode": child_process.returncode,
                           "wall_s": time.perf_counter() - launched}
    steps = [(at, line) for at, line in lines if line.startswith("step ") and " | loss " in line]
    row["launch_to_first_step_s"] = steps[0][0] if steps else None
    row["launch_to_step_lines_s"] = [at for at, _ in steps]
    row["detection"] = next((line for _, line in lines if "pre-quantized" in line), None)
    row["graphs"] = next((line for _, line in lines if "graph" in line.lower() and line.startswith("poros:")), None)
    metrics = output / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    tokens = args.seq * args.grad_accum
    row["step_s"] = [tokens / entry["tokens_per_second"] for entry in rows if entry.get("tokens_per_second")]
    row["losses"] = [entry["loss"] for entry in rows if "loss" in entry]
    row["peak_memory_gb"] = max((entry.get("peak_memory_gb") or 0 for entry in rows), default=None)
    if child_process.returncode != 0:
        row["failed"], row["output_tail"] = True, "\n".join(line for _, line in lines[-40:])
    return row


def child(args) -> int:
    args.imported_at = time.time()  # the interpreter, torch and transformers are imported by now
    device, _ = start_tool(args)
    config, _ = model_config(args.model, layers=args.layers)
    work = Path(args.dir)
    run = {"dropin": dropin_child, "stranded": stranded_child, "quantize": quantize_child}.get(args.child, start_child)
    print(json.dumps(run(args, device, config, work), default=str), flush=True)
    return 0


def bf16_bytes(config) -> int:
    """The bf16 checkpoint's bytes for ``config`` (a meta model's parameters, two bytes each)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in skeleton.parameters()) * 2


def prepare_source(args, config, device: torch.device, work: Path, report: dict, progress) -> None:
    """What the arms start from: the shape's config.json (``--source random``) or the random bf16 checkpoint,
    then the bnb-4bit checkpoint (the ``quantize`` arm, or when there is none yet)."""
    arms, starts = args.arms.split(","), args.starts.split(",")
    bnb = work / "bnb-4bit"
    quantize = "quantize" in arms or not bnb.exists()
    needs_bf16 = (args.source == "bf16" and quantize) or ("starts" in arms and set(starts) & set(BF16_STARTS))
    if args.source == "random" and "starts" in arms and set(starts) & set(BF16_STARTS):
        raise SystemExit(f"prequant_bench: the starts {', '.join(sorted(set(starts) & set(BF16_STARTS)))} read the "
                         "bf16 checkpoint; with --source random pass --starts prequantized,prequantized_warm, or "
                         "measure them with --source bf16 at a depth the disk holds.")
    config.save_pretrained(work / "config")
    checkpoint = work / "checkpoint"
    if needs_bf16 and not checkpoint.exists():
        needed, free = bf16_bytes(config), shutil.disk_usage(work).free
        if needed > 0.9 * free:
            raise SystemExit(f"prequant_bench: the bf16 checkpoint ({needed / 1e9:.0f} GB) does not fit the "
                             f"{free / 1e9:.0f} GB free under {work}; pass --source random (poros quantize "
                             "--random-weights) or fewer --layers.")
        report["checkpoint_bytes"] = cache_bench.write_checkpoint(config, checkpoint, device)
        progress(f"bf16 checkpoint written ({report['checkpoint_bytes'] / 1e9:.1f} GB)")
    if quantize:
        shutil.rmtree(bnb, ignore_errors=True)
        began = time.perf_counter()
        report["quantize"] = {**in_fresh_process("quantize", args, work), "wall_s": time.perf_counter() - began}
        progress(f"poros quantize: {report['quantize']['wall_s']:.1f} s")


def starts_arm(args, work: Path, report: dict, progress) -> None:
    starts = {}
    for name in args.starts.split(","):
        if not name.endswith("_warm"):
            cache_bench.drop_from_page_cache(*[p for p in (work / "checkpoint", work / "bnb-4bit", work / "cache")
                                               if p.exists()])
        starts[name] = in_fresh_process(name, args, work)
        report["starts"] = starts
        progress(f"start {name}: {starts[name].get('through_first_step_s', float('nan')):.1f} s through the first step")
    base = starts.get("bf16", {}).get("through_first_step_s")
    report["speedup_over_bf16"] = {name: base / row["through_first_step_s"] for name, row in starts.items()
                                   if base and row.get("through_first_step_s")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    device, env = start_tool(args)
    config, info = model_config(args.model, layers=args.layers)
    work = Path(args.dir) if args.dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"poros-prequant-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS] + [s for s in args.starts.split(",") if s not in STARTS]
    if unknown:
        raise SystemExit(f"prequant_bench: unknown arm or start {unknown}; arms: {', '.join(ARMS)}; starts: "
                         f"{', '.join(STARTS)}")
    report: dict[str, Any] = {"tool": "prequant_bench", "environment": env, "model": info, "seq": args.seq,
                              "grad_accum": args.grad_accum, "arms": arms, "source": args.source}
    t0 = time.perf_counter()

    def write(partial: bool) -> str:
        """The report so far as JSON, also to ``--json`` (a run stopped at its limit keeps what it measured)."""
        text = json.dumps({**report, "partial": True} if partial else report, indent=1, default=str)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
        return text

    def progress(what: str) -> None:
        print(f"prequant_bench: {time.perf_counter() - t0:7.1f} s  {what}", file=sys.stderr, flush=True)
        write(partial=True)

    try:
        prepare_source(args, config, device, work, report, progress)
        if "starts" in arms:
            starts_arm(args, work, report, progress)
        for arm in ("dropin", "stranded"):
            if arm in arms:
                report[arm] = in_fresh_process(arm, args, work)
                progress(f"{arm}: {json.dumps(report[arm], default=str)[:300]}")
        if "train" in arms:
            report["train"] = train_arm(args, work)
            progress(f"train: {json.dumps(report['train'], default=str)[:300]}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(write(partial=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

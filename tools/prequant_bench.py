#!/usr/bin/env python3
"""Pre-quantized checkpoints at real shapes: ``poros quantize``, the start from a bnb-4bit checkpoint, and
the HF Trainer drop-in through ``poros.from_pretrained`` under a small memory cap.

For one shape (``tools.shapes.SHAPES``, truncated to ``--layers`` decoder layers: the GPU host's disk
holds a 72B-shape bf16 checkpoint only in part) this writes a random bf16 checkpoint tensor by tensor
(``tools.cache_bench.write_checkpoint``), then runs the arms of ``--arms``:

* ``quantize``: ``poros quantize CKPT BNB --double-quant`` in a child process: its time, the bytes
  written, the child's peak RSS (the model is never whole in RAM) and its device peak. The later
  arms start from its output.
* ``starts``: time to the first step in fresh processes, the page cache dropped before each (every
  start reads from the drive), the same LoRA and step: ``bf16`` (``load_pretrained`` of the bf16
  checkpoint, every block read and quantized), ``cache_cold`` (the same through the NF4 block cache,
  which writes the entry), ``cached`` (from the entry), ``prequantized`` (``load_pretrained`` of the
  bnb-4bit checkpoint: its packed bytes read straight to the host, no quantize pass) and
  ``prequantized_warm`` (again, its pages still cached). Each row: ``load_s``, ``lora_s``,
  ``prepare_s``, ``start_s``, ``first_step_s``, ``through_first_step_s``, the launch-relative ones,
  and the device's peak from the load through ``prepare`` (``start_max_allocated_bytes``: the blocks of
  a bnb-4bit load never visit the device).
* ``dropin``: ``poros.from_pretrained(BNB, dtype=bf16, device_map={"": 0})`` + ``get_peft_model`` (LoRA
  r16 on the seven projections) + ``poros.prepare`` + HF ``Trainer`` (``--steps`` steps, batch 1 x
  ``--seq`` tokens, ``--grad-accum``) with ``torch.cuda.set_per_process_memory_fraction`` capping the
  process at ``--cap-gib``: ``max_memory_allocated`` / ``max_memory_reserved`` after the load, after
  ``prepare`` and over the run, the step times and losses; ``fits`` is False with the error when it did
  not.
* ``stranded``: the whole bnb-4bit model loaded onto the device the plain way (uncapped), then
  ``prepare``: ``memory_reserved`` minus ``memory_allocated`` after it (segments left reserved by the
  blocks moved off; ``prepare`` calls ``torch.cuda.empty_cache``) next to the slot ring's bytes.

    python -m tools.prequant_bench --model qwen2.5-72b --layers 8 --cap-gib 8 --json out/prequant-72b.json
    DEVICE=cpu tools/gpu_run.sh prequant:tiny:steps=1:grad-accum=1:seq=16       # dry run without a GPU
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

from tools import cache_bench
from tools.models import SEVEN_PROJECTIONS, make_batches
from tools.provenance import start_tool
from tools.shapes import SHAPES, model_config

ARMS = ("quantize", "starts", "dropin", "stranded")
STARTS = ("bf16", "cache_cold", "cached", "prequantized", "prequantized_warm")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-72b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int, default=8,
                        help="decoder layers (bf16 + bnb-4bit + the cache entry go to the host's disk)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which of {', '.join(ARMS)} to run")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step (starts: layer-major)")
    parser.add_argument("--steps", type=int, default=3, help="HF Trainer steps of the drop-in arm")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="the drop-in arm's device memory cap")
    parser.add_argument("--dir", default=None, help="where the checkpoints and the cache go (default: a temp dir, "
                                                    "removed at the end)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, choices=(*STARTS, "dropin", "stranded"), help=argparse.SUPPRESS)
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
    command = [sys.executable, "-m", "tools.prequant_bench", "--child", name, "--launched-at", repr(launched),
               "--dir", str(work), "--model", args.model, "--layers", str(args.layers), "--seq", str(args.seq),
               "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--cap-gib", str(args.cap_gib),
               "--device", args.device, *(["--deterministic"] if args.deterministic else []),
               *(["--threads", str(args.threads)] if args.threads else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
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
        poros.prepare(model)
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
        trainer = transformers.Trainer(model=model, args=training, train_dataset=rows, callbacks=[Clock()])
        marks["train_began"] = time.perf_counter()
        trainer.train()
        row["losses"] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        row["step_s"] = [b - a for a, b in zip([marks["train_began"], *step_ends], step_ends)]
        row["fits"] = True
    except torch.OutOfMemoryError as error:
        row["fits"], row["error"] = False, str(error).splitlines()[0]
    row["run"] = memory(device)
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


def quantize_arm(work: Path, device: torch.device) -> dict:
    """``poros quantize`` in a child process: time, bytes, the child's peak RSS."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "poros", "quantize", str(work / "checkpoint"), str(work / "bnb-4bit"),
                           "--double-quant", "--device", str(device), "--json"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        return {"failed": True, "stderr": done.stderr[-3000:]}
    result = json.loads(done.stdout[done.stdout.index("{"):])
    return {**result, "wall_s": seconds, "child_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
            * 1024}


def child(args) -> int:
    args.imported_at = time.time()  # the interpreter, torch and transformers are imported by now
    device, _ = start_tool(args)
    config, _ = model_config(args.model, layers=args.layers)
    work = Path(args.dir)
    run = {"dropin": dropin_child, "stranded": stranded_child}.get(args.child, start_child)
    print(json.dumps(run(args, device, config, work), default=str), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    device, env = start_tool(args)
    config, info = model_config(args.model, layers=args.layers)
    work = Path(args.dir) if args.dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"poros-prequant-{os.getpid()}"
    checkpoint, bnb, root = work / "checkpoint", work / "bnb-4bit", work / "cache"
    arms = args.arms.split(",")
    report: dict[str, Any] = {"tool": "prequant_bench", "environment": env, "model": info, "seq": args.seq,
                              "grad_accum": args.grad_accum, "arms": arms}
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
        if not checkpoint.exists():
            report["checkpoint_bytes"] = cache_bench.write_checkpoint(config, checkpoint, device)
            progress(f"bf16 checkpoint written ({report['checkpoint_bytes'] / 1e9:.1f} GB)")
        if "quantize" in arms or not bnb.exists():
            shutil.rmtree(bnb, ignore_errors=True)
            report["quantize"] = quantize_arm(work, device)
            progress(f"poros quantize: {report['quantize'].get('wall_s', 0):.1f} s")
        if "starts" in arms:
            starts = {}
            for name in STARTS:
                if not name.endswith("_warm"):
                    cache_bench.drop_from_page_cache(*[p for p in (checkpoint, bnb, root) if p.exists()])
                starts[name] = in_fresh_process(name, args, work)
                report["starts"] = starts
                progress(f"start {name}: {starts[name].get('through_first_step_s', float('nan')):.1f} s through the "
                         "first step")
            base = starts.get("bf16", {}).get("through_first_step_s")
            report["speedup_over_bf16"] = {name: base / row["through_first_step_s"] for name, row in starts.items()
                                           if base and row.get("through_first_step_s")}
        for arm in ("dropin", "stranded"):
            if arm in arms:
                report[arm] = in_fresh_process(arm, args, work)
                progress(f"{arm}: {json.dumps(report[arm], default=str)[:300]}")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(write(partial=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())

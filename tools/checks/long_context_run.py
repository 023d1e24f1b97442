"""One long-context training run from a pre-quantized checkpoint, measured against the planner (issue 43).

``PorosTrainer`` from a bnb-4bit checkpoint (``poros quantize ... --random-weights`` writes one; its blocks
stream from the mapped shards), ``--steps`` optimizer steps of synthetic data at ``--seq`` tokens, the process
capped at ``--cap-gib`` (``torch.cuda.set_per_process_memory_fraction``), with the run's ``vram_budget``,
``host_budget`` and ``boundary_every``. Reported beside the planner's prediction of each:

* peak allocated / reserved device bytes (``budget_plan.peak`` / ``needed_bytes``);
* host peak RSS (``VmHWM``) and the RSS sampled every 0.5 s (``poros plan``'s host RAM, ``plan_run``);
* disk used: the boundary-state spill directory's largest size and the drive's largest drop in free space;
* step time and tokens/s (``budget_plan.step`` where the plan has compute times).

Run on the GPU host through ``tools/gpu_run.sh long:CHECKPOINT_DIR:seq=131072:...``; the JSON is written as
the run goes (``partial``: true until it ends), so a run collected by a second command keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the bnb-4bit checkpoint directory")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--schedule", default="layer-major", choices=("layer-major", "micro-major"))
    parser.add_argument("--vram-budget", default=None, help="PorosConfig.vram_budget, e.g. 76GiB")
    parser.add_argument("--host-budget", default=None, help="PorosConfig.host_budget, e.g. 100GiB")
    parser.add_argument("--boundary-every", default="auto", help="'auto' or an integer")
    parser.add_argument("--cap-gib", type=float, default=None, help="cap the process's device memory")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--embeddings-on-host", choices=("true", "false"), default=None,
                        help="PorosConfig.embeddings_on_host (default: on CUDA, on): false keeps the tables' 2.5 GB "
                             "(72B) off the host")
    parser.add_argument("--work", default="/tmp/poros-long", help="output and cache (spill) directory")
    parser.add_argument("--json", type=Path, help="write the report here")
    return parser.parse_args(argv)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _tree_bytes(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # a state file read back and deleted while we walked
    return total


class Sampler(threading.Thread):
    """RSS, the spill directory's size and the drive's free space, every ``period`` seconds."""

    def __init__(self, spill: Path, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.spill, self.period, self.stop = spill, period, threading.Event()
        self.free0 = shutil.disk_usage(spill.parent if spill.parent.exists() else "/").free
        self.peak = {"rss": 0, "spill": 0, "disk_drop": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak["rss"] = max(self.peak["rss"], _rss())
            if self.spill.exists():
                self.peak["spill"] = max(self.peak["spill"], _tree_bytes(self.spill))
            free = shutil.disk_usage(self.spill.parent if self.spill.parent.exists() else "/").free
            self.peak["disk_drop"] = max(self.peak["disk_drop"], self.free0 - free)
            self.stop.wait(self.period)


def _model_of(checkpoint: Path) -> dict[str, Any]:
    """What the checkpoint's ``config.json`` says of its shape (the docs' tables name the row by it)."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    config = config.get("text_config", config)
    return {key: config.get(key) for key in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                             "vocab_size")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cap_gib and args.device.startswith("cuda"):  # before anything initialises CUDA's allocator
        # as docs/consumer-gpus.md recommends on a capped card (and tools/bench/harness.py runs): without it a
        # 128K step's varying activation sizes strand reserved segments (23 GiB at 72B) under the cap
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from poros.config import PorosConfig
    from poros.plan.run_plan import PlanOptions, plan_run
    from poros.training.trainer import PorosTrainer

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "cache").mkdir(parents=True)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # set_per_process_memory_fraction needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    every = args.boundary_every if args.boundary_every == "auto" else int(args.boundary_every)
    config = PorosConfig(model=args.checkpoint, dataset="synthetic", device=args.device, steps=args.steps,
                         seq_len=args.seq, batch_size=1, grad_accum=args.grad_accum, stream_schedule=args.schedule,
                         vram_budget=args.vram_budget, host_budget=args.host_budget, boundary_every=every,
                         deterministic=args.deterministic, cache_dir=str(work / "cache"),
                         embeddings_on_host=None if args.embeddings_on_host is None else args.embeddings_on_host == "true",
                         output_dir=str(work / "run"), save_steps=0, logging_steps=1)
    report: dict[str, Any] = {"tool": "long_context_run", "args": vars(args) | {"json": str(args.json)},
                              "partial": True, "model": _model_of(Path(args.checkpoint))}

    def write() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")

    if args.vram_budget is not None:  # the plan poros plan makes for it (host RAM by part)
        planned = plan_run(config, PlanOptions()).budget
        report["planned"] = {"host_ram_bytes": planned.host_ram_bytes, "host_ram": dict(planned.host_ram),
                             "host_tier": planned.host.tier, "notices": list(planned.notices)}
    write()
    if device.type == "cuda" and args.cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    sampler = Sampler(work / "cache" / "spill")
    sampler.start()
    began = time.perf_counter()
    try:
        trainer = PorosTrainer.from_config(config)
        report["loaded_s"] = time.perf_counter() - began
        plan = trainer.model.budget_plan
        report["budget_plan"] = plan.to_dict() if plan is not None else None
        report["host_plan"] = trainer.model.host_plan.to_dict()
        report["boundary_every"] = trainer.model.executor.boundary_every
        report["boundary_states"] = trainer.model.executor.boundary_states
        write()
        trainer.train()
    except Exception as error:  # the report says what failed, with what was measured before
        report["failed"] = f"{type(error).__name__}: {error}"
    finally:
        sampler.stop.set()
        sampler.join()
    metrics = work / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    tokens = args.seq * args.grad_accum
    report.update(
        wall_s=time.perf_counter() - began,
        step_s=[tokens / r["tokens_per_second"] for r in rows if r.get("tokens_per_second")],
        tokens_per_second=[r["tokens_per_second"] for r in rows if r.get("tokens_per_second")],
        losses=[r["loss"] for r in rows if "loss" in r],
        peak_allocated_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        peak_reserved_bytes=torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        host_peak_rss_bytes=_hwm(), host_rss_sampled_peak_bytes=sampler.peak["rss"],
        spill_peak_bytes=sampler.peak["spill"], disk_free_drop_peak_bytes=sampler.peak["disk_drop"],
        cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), partial=False)
    write()
    print(json.dumps(report, default=str))
    return 1 if "failed" in report else 0


if __name__ == "__main__":
    sys.exit(main())

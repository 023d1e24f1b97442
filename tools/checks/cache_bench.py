#!/usr/bin/env python3
"""NF4 block cache and host tiers at real shapes: start time cold vs cached, step time per tier.

For one shape (``tools/bench/shapes.py`` SHAPES, truncated to ``--layers`` decoder layers so that the
checkpoint fits the GPU host's disk) this writes a random bf16 checkpoint, then:

1. ``nocache``: ``load_pretrained`` without the cache (read + quantize every block) + LoRA +
   ``prepare`` + the first optimizer step;
2. ``cold``: the same through the cache, which also writes the entry;
3. ``cached``: the same again: the entry is mapped, no block weight is read or quantized (its checksum
   pass runs while transformers reads the non-block weights). The checkpoint's and the entry's pages
   are dropped from the page cache (``posix_fadvise``) before each of these starts, so every start
   reads from the drive; ``cached_warm``: once more without dropping them (the pages still in the page
   cache, as after a run). These take the host tier a user gets with ``host_tier`` unset (``mapped``
   for a model loaded through the cache, since 078d9cf); ``--start-tiers auto,pinned`` adds
   ``cached_pinned`` and ``cached_pinned_warm``, the cached starts with that tier asked for (``pinned``
   copies every block into page-locked memory at the start).
   Each start runs in a fresh process, as a user's run does, and reports its phases: ``imports_s``
   (launch to the child's first line: interpreter, torch, transformers), ``load_s``, ``lora_s``,
   ``prepare_s`` (the host tier: the pinned copy, the mapping's registration), ``start_s`` (load
   to the first step's start: what the cache changes), ``first_step_s`` and ``through_first_step_s``;
   ``process_start_s`` / ``process_through_first_step_s`` count from the launch. ``speedups`` holds
   ``nocache`` over each cached start for each of these four measures. (Before this commit the JSON's
   ``to_first_step_s`` was ``through_first_step_s``.) ``--starts-only`` stops here;
4. per host tier (``pinned``, ``mapped``, ``disk`` with ``--host-budget-gib`` of ring), the median
   step time of layer-major accumulation (``--grad-accum`` micro-batches of ``--seq`` tokens), the
   host bytes the tier holds, whether torch sees the tier's copy source as pinned, and for ``disk``
   the read rate while reading and over the step. ``--rounds N`` runs the tiers in turn N times
   (pinned, mapped, disk, pinned, ...), so that the order in the process is not mistaken for a tier's
   cost; the median is over every timed step of every round;
5. the drive's sequential read rate (``poros.plan.host_tiers.measure_disk_read``, O_DIRECT where possible).

Targets (issue 14): cached start >= 10x faster than quantizing; ``mapped`` within 3 % of ``pinned``;
``disk`` at >= 90 % of the drive's rate while streaming and within 1.2x of ``pinned``.

The full-depth checkpoints (65 GB at 32B, 145 GB at 72B) do not fit the GPU host's disk. A start is a
fixed part (imports, model build, the non-block weights) and a part per decoder layer (the blocks
read, quantized, checked, pinned); ``--project A.json B.json`` fits ``t = fixed + per_layer * layers``
through two runs of one shape at different depths, for each start's phases, and gives each at the
shape's full depth (a projection, and labelled one; see :func:`project`).

    python -m tools.checks.cache_bench --model qwen2.5-32b --layers 4 --json out/cache-32b.json
    python -m tools.checks.cache_bench --project out/cache-32b-8.json out/cache-32b-24.json --json out/projected.json
    DEVICE=cpu tools/gpu_run.sh cache:tiny:steps=1:warmup=0:grad-accum=2:seq=16      # dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from poros.spellings import format_gb
from tools.bench.models import add_lora, make_batches
from tools.bench.provenance import add_run_arguments, start_tool
from tools.bench.shapes import SHAPES, model_config

TIERS = ("pinned", "disk", "mapped")
STARTS = ("nocache", "cold", "cached", "cached_warm", *(f"cached_{tier}{warm}" for tier in ("pinned", "mapped", "disk")
                                                        for warm in ("", "_warm")))
MEASURES = ("start_s", "through_first_step_s", "process_start_s", "process_through_first_step_s")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b", choices=sorted(SHAPES), metavar="SHAPE")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (the checkpoint is written to disk)")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grad-accum", type=int, default=8, help="micro-batches per step, layer-major")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per tier")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--host-budget-gib", type=float, default=None,
                        help="host budget of the disk tier (default: 3 blocks' ring, well below the model)")
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--rounds", type=int, default=1, help="run the tiers in turn this many times")
    add_run_arguments(parser, "the checkpoint and the cache")
    parser.add_argument("--start-tiers", default="auto",
                        help="host tiers of the cached starts: auto (the default choice: cached, cached_warm), "
                             "and pinned / mapped / disk (cached_TIER, cached_TIER_warm)")
    parser.add_argument("--starts-only", action="store_true", help="measure the starts only, not the tiers' steps")
    parser.add_argument("--project", nargs=2, default=None, metavar="JSON",
                        help="two reports of one shape at different --layers: project every start to full depth")
    parser.add_argument("--profile-warm", action="store_true",
                        help="one more cached_warm start under cProfile: its 40 costliest calls (cumulative) in the "
                             "report, to see where a cached start's time goes (not a timing: cProfile slows it)")
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # the child: under cProfile
    parser.add_argument("--start-child", default=None, choices=STARTS, help=argparse.SUPPRESS)
    parser.add_argument("--start-tier", default="auto", help=argparse.SUPPRESS)  # the child's host tier
    parser.add_argument("--launched-at", type=float, default=None, help=argparse.SUPPRESS)  # the parent's clock
    return parser.parse_args(argv)


def write_checkpoint(config, path: Path, device: torch.device, shard_bytes: int = 4 << 30) -> int:
    """A random bf16 checkpoint of ``config`` at ``path`` (safetensors shards + index); returns its bytes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = set(getattr(skeleton, "all_tied_weights_keys", {}) or {})
    generator = torch.Generator(device=device).manual_seed(0)
    weight_map, shard, shard_size, index, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(path / name), metadata={"format": "pt"})
            weight_map.update({key: name for key in shard})
            shard, shard_size, index = {}, 0, index + 1

    persistent = {name for name, _ in skeleton.named_parameters()} | {
        f"{prefix}{'.' if prefix else ''}{name}" for prefix, module in skeleton.named_modules()
        for name in module._buffers if name not in module._non_persistent_buffers_set}
    for name, tensor in skeleton.state_dict().items():
        if name in tied or name not in persistent:
            continue
        if tensor.ndim == 1:
            value = torch.ones(tensor.shape, dtype=tensor.dtype, device=device)
        else:
            value = torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
        shard[name] = value.to(tensor.dtype).cpu()
        shard_size += shard[name].numel() * shard[name].element_size()
        total += shard[name].numel() * shard[name].element_size()
        if shard_size >= shard_bytes:
            flush()
    flush()
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    config.save_pretrained(path)
    return total


def drop_from_page_cache(*paths: Path) -> None:
    """Evict the files' clean pages (posix_fadvise DONTNEED), so the next read comes from the drive."""
    for root in paths:
        for file in ([root] if root.is_file() else root.rglob("*")):
            if file.is_file():
                fd = os.open(file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start(checkpoint: Path, config, device, args, *, cache_dir, tier: str | None = "pinned", host_budget=None):
    """load + LoRA + prepare: ``(streamed model, optimizer, phases)`` with ``load_s``, ``lora_s``, ``prepare_s``."""
    from poros.loading.load import adapters_to_device, load_pretrained
    from poros.dropin.model import prepare

    marks = [time.perf_counter()]
    loaded = load_pretrained(checkpoint, device=device, load_tokenizer=False, cache_dir=cache_dir, double_quant=True,
                             attn_implementation="sdpa")
    marks.append(time.perf_counter())
    peft_model = add_lora(loaded.model, rank=16, alpha=32, gradient_checkpointing=False)
    adapters_to_device(peft_model, device)
    marks.append(time.perf_counter())
    streamed = prepare(peft_model, host_tier=tier, host_budget=host_budget, cache_dir=str(cache_dir) if cache_dir
                       else None)
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-4)
    sync(device)
    marks.append(time.perf_counter())
    phases = {f"{name}_s": b - a for name, a, b in zip(("load", "lora", "prepare"), marks, marks[1:])}
    return streamed, optimizer, phases


def step(streamed, optimizer, micro_batches, device) -> float:
    began = time.perf_counter()
    streamed.forward_backward([{k: v.to(device) for k, v in mb.items()} for mb in micro_batches])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - began


def close_tier(streamed) -> None:
    """Stop a run's host tier (the disk reader, the DMA registration) before the next run starts."""
    streamed.store.host_tier.close()


def forget(root: Path) -> None:
    """After the caller dropped its run: unmap the entries (so the next start maps them afresh), free memory."""
    from poros.stream.tiers import release_mapping

    gc.collect()
    for blocks in root.glob("*/blocks.bin"):
        release_mapping(blocks)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_tier(tier, checkpoint, config, device, args, root, entry, micro_batches, drive) -> dict:
    """One run of ``tier``: start from the cache, ``warmup + steps`` steps; the row of the report."""
    from poros.loading import cache

    budget = None
    if tier == "disk":
        largest = max(b["nbytes"] for b in cache.read_manifest(root / entry.name)["blocks"])
        budget = int(args.host_budget_gib * 2**30) if args.host_budget_gib else 3 * largest
    streamed, optimizer, _ = start(checkpoint, config, device, args, cache_dir=root, tier=tier, host_budget=budget)
    times = [step(streamed, optimizer, micro_batches, device) for _ in range(args.warmup + args.steps)]
    store = streamed.store
    sources = [b.buffer for b in store.blocks if not b.resident and b.buffer is not None]
    row = {"step_s": statistics.median(times[args.warmup:]), "steps_s": times, "timed_s": times[args.warmup:],
           "host_budget_bytes": budget, "host_plan": streamed.host_plan.to_dict(),
           "h2d_bytes_per_step": store.stats.bytes_copied / len(times),
           # torch copies non_blocking only from memory it sees as page-locked (else the copy blocks)
           "source_pinned": bool(sources[0].is_pinned()) if sources and device.type == "cuda" else None}
    disk = getattr(store.host_tier, "stats", None)
    if disk is not None:
        row["disk"] = dict(disk)
        row["disk"]["gb_per_s_while_reading"] = (disk["bytes_read"] / disk["read_seconds"] / 1e9
                                                 if disk["read_seconds"] else None)
        row["disk"]["gb_per_s_over_steps"] = disk["bytes_read"] / sum(times) / 1e9
        rate = drive["gb_per_s"]
        row["disk"]["fraction_of_drive"] = (row["disk"]["gb_per_s_while_reading"] / rate
                                            if rate and row["disk"]["gb_per_s_while_reading"] else None)
    close_tier(streamed)
    del streamed, optimizer, store, sources
    return row


def start_in_fresh_process(name: str, work: Path, args, *, profile: bool = False) -> dict:
    """One start (:data:`STARTS`) in a new Python process, as a user's run starts: its phases (the
    child's clock) and ``process_start_s`` / ``process_through_first_step_s`` from the process's launch."""
    tier = name.split("_")[1] if name.count("_") >= 1 and name.split("_")[1] in TIERS else "auto"
    launched = time.time()
    command = [sys.executable, "-m", "tools.checks.cache_bench", "--start-child", name, "--start-tier", tier,
               "--launched-at", repr(launched), "--dir", str(work), "--model", args.model, "--layers", str(args.layers),
               "--seq", str(args.seq), "--grad-accum", str(args.grad_accum), "--device", args.device,
               *(["--deterministic"] if args.deterministic else []), *(["--profile"] if profile else []),
               *(["--threads", str(args.threads)] if args.threads else [])]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if done.returncode != 0:
        raise RuntimeError(f"start {name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["process_start_s"] = row.pop("first_step_began_at") - launched
    row["process_through_first_step_s"] = row.pop("first_step_done_at") - launched
    return row


def start_child(args) -> int:
    """``--start-child NAME``: one start in this process; prints its row as the last line of stdout."""
    imported = time.time()
    device, _ = start_tool(args)
    config, _ = model_config(args.model, layers=args.layers)
    work = Path(args.dir)
    micro_batches = make_batches(config, count=args.grad_accum, batch=1, seq=args.seq)
    sync(device)
    began = time.perf_counter()
    tier = None if args.start_tier == "auto" else args.start_tier
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    streamed, optimizer, phases = start(work / "checkpoint", config, device, args, tier=tier,
                                        cache_dir=None if args.start_child == "nocache" else work / "cache")
    started, began_at = time.perf_counter() - began, time.time()
    if args.profile:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("cumulative")
        phases["profile"] = [{"function": f"{'/'.join(path.rsplit('/', 2)[-2:])}:{line}({name})", "calls": calls,
                              "own_s": own, "cumulative_s": cumulative}
                             for (path, line, name), (_, calls, own, cumulative, _) in
                             sorted(stats.stats.items(), key=lambda item: -item[1][3])[:40]]
    first = step(streamed, optimizer, micro_batches, device)
    row = {"tier": streamed.host_plan.tier, "imports_s": imported - args.launched_at if args.launched_at else None,
           **phases, "start_s": started, "first_step_s": first, "through_first_step_s": started + first,
           "first_step_began_at": began_at, "first_step_done_at": time.time()}
    print(json.dumps(row), flush=True)
    close_tier(streamed)
    return 0


def speedups(starts: dict[str, dict]) -> dict[str, dict[str, float]]:
    """``nocache`` over each cached start, for each of :data:`MEASURES`."""
    base = starts["nocache"]
    return {name: {measure: base[measure] / row[measure] for measure in MEASURES}
            for name, row in starts.items() if name.startswith("cached")}


PROJECTED = ("load_s", "lora_s", "prepare_s", "start_s")  # the phases that grow with the layers


def project(first: dict, second: dict) -> dict:
    """Two reports of one shape at different depths, projected to the shape's full depth: a straight line
    ``fixed + per_layer * layers`` through each start's load, LoRA, prepare and start; the first step
    (the same step for every start, whose warm-up varies from process to process) as the deeper run's
    mean over the starts, scaled by layers; the launch (imports, CUDA context: no layer in it) as each
    start's mean over both runs. ``through_first_step_s`` and ``process_*`` follow from those, so the
    measures stay consistent with one another."""
    (low, high) = sorted((first, second), key=lambda r: r["model"]["num_hidden_layers"])
    if low["model"]["shape"] != high["model"]["shape"]:
        raise SystemExit(f"--project: two shapes ({low['model']['shape']}, {high['model']['shape']}); give one")
    a, b, full = low["model"]["num_hidden_layers"], high["model"]["num_hidden_layers"], high["model"]["full_depth"]
    if a == b:
        raise SystemExit(f"--project: both reports have {a} layers; give two depths")
    names = [name for name in high["start"] if name in low["start"]]
    first_step = statistics.mean(high["start"][n]["first_step_s"] for n in names) * full / b
    starts = {}
    for name in names:
        y0, y1 = low["start"][name], high["start"][name]
        row = {}
        for key in PROJECTED:
            per_layer = (y1[key] - y0[key]) / (b - a)
            row[key] = {"fixed_s": y0[key] - per_layer * a, "per_layer_s": per_layer,
                        "at_full_depth_s": y0[key] + per_layer * (full - a), "measured": {str(a): y0[key], str(b): y1[key]}}
        launch = statistics.mean(y["process_start_s"] - y["start_s"] for y in (y0, y1))
        at = row["start_s"]["at_full_depth_s"]
        row["first_step_s"] = {"at_full_depth_s": first_step, "from": f"the {b}-layer run's first steps, x {full}/{b}"}
        row["through_first_step_s"] = {"at_full_depth_s": at + first_step}
        row["process_start_s"] = {"at_full_depth_s": at + launch, "launch_s": launch}
        row["process_through_first_step_s"] = {"at_full_depth_s": at + first_step + launch}
        starts[name] = row
    at_full = {name: {k: v["at_full_depth_s"] for k, v in row.items()} for name, row in starts.items()}
    return {"tool": "cache_bench", "projection": True, "shape": low["model"]["shape"], "from_layers": [a, b],
            "full_depth": full, "reports": [low["environment"], high["environment"]], "start": starts,
            "speedups_at_full_depth": speedups(at_full) if "nocache" in at_full else {},
            "method": "per start, a straight line through the two depths for load, LoRA, prepare and start, read at "
                      "full depth; the first step from the deeper run scaled by layers; the launch measured; each "
                      "start a fresh process; see docs/cache-and-host-memory.md"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.start_child:
        return start_child(args)
    if args.project:
        text = json.dumps(project(*(json.loads(Path(p).read_text()) for p in args.project)), indent=1)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
        print(text)
        return 0
    import faulthandler

    # A step that hangs (the mapped tier did on the H200, inside the step limit) prints every
    # thread's stack once a minute: the log then says where, not only that it stopped.
    faulthandler.dump_traceback_later(60, repeat=True, file=sys.stderr)
    from poros.loading import cache
    from poros.plan.host_tiers import measure_disk_read

    device, env = start_tool(args)
    config, info = model_config(args.model, layers=args.layers)
    work = Path(args.dir) if args.dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"poros-cache-bench-{os.getpid()}"
    checkpoint, root = work / "checkpoint", work / "cache"
    report: dict[str, Any] = {"tool": "cache_bench", "environment": env, "model": info, "seq": args.seq,
                              "grad_accum": args.grad_accum, "steps": args.steps}
    micro_batches = make_batches(config, count=args.grad_accum, batch=1, seq=args.seq)
    t0 = time.perf_counter()

    def progress(what: str) -> None:
        """A line per phase on stderr and the report so far on disk: a run stopped at its limit still
        says where its time went and keeps what it measured."""
        print(f"cache_bench: {time.perf_counter() - t0:7.1f} s  {what}", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({**report, "partial": True}, indent=1, default=str) + "\n")

    try:
        began = time.perf_counter()
        report["checkpoint_bytes"] = write_checkpoint(config, checkpoint, device)
        report["checkpoint_write_s"] = time.perf_counter() - began
        progress(f"checkpoint written ({format_gb(report['checkpoint_bytes'])})")
        starts = {}
        names = ["nocache", "cold", "cached", "cached_warm"]
        for tier in args.start_tiers.split(","):
            if tier != "auto":
                names += [f"cached_{tier}", f"cached_{tier}_warm"]
        for name in names:
            if not name.endswith("_warm"):
                drop_from_page_cache(checkpoint, *([root] if root.exists() else []))
            starts[name] = start_in_fresh_process(name, work, args)
            report["start"] = starts
            progress(f"start {name}: {starts[name]['start_s']:.1f} s to the first step, "
                     f"{starts[name]['through_first_step_s']:.1f} s through it "
                     f"({starts[name]['process_through_first_step_s']:.1f} s from the process's launch)")
        report["start"] = starts
        report["speedups"] = speedups(starts)
        if args.profile_warm:
            report["profile_cached_warm"] = start_in_fresh_process("cached_warm", work, args, profile=True)
            progress("profiled cached_warm start")
        # The drive's rate, measured once the starts fsynced the checkpoint (right after writing it,
        # its writeback shared the drive and the rate read low: docs/results-h200.md).
        report["drive"] = measure_disk_read(work, size=2 << 30)
        progress(f"drive read rate measured ({report['drive'].get('gb_per_s')} GB/s)")
        [entry] = cache.list_entries(root)
        report["entry_bytes"] = entry.size
        tiers: dict[str, dict] = {}
        for round_index in range(0 if args.starts_only else args.rounds):
            for tier in args.tiers.split(","):
                row = run_tier(tier, checkpoint, config, device, args, root, entry, micro_batches, report["drive"])
                if tier in tiers:  # a later round: its steps join the earlier ones
                    tiers[tier]["rounds"].append(row["step_s"])
                    tiers[tier]["steps_s"] += row["steps_s"]
                    tiers[tier]["timed_s"] += row["timed_s"]
                    tiers[tier]["step_s"] = statistics.median(tiers[tier]["timed_s"])
                else:  # the first round's row; "disk", "h2d_bytes_per_step", "source_pinned" stay round 1's
                    tiers[tier] = {**row, "rounds": [row["step_s"]]}
                if "disk" in row:  # every round's read statistics
                    tiers[tier].setdefault("disk_rounds", []).append(row["disk"])
                forget(root)
                report["tiers"] = tiers
                progress(f"round {round_index + 1} tier {tier}: {row['step_s']:.3f} s/step")
        if "pinned" in tiers:
            for tier, row in tiers.items():
                row["vs_pinned"] = row["step_s"] / tiers["pinned"]["step_s"]
        report["tiers"] = tiers
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

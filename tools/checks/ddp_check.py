"""Data parallel on GPUs: parity of Poros-DDP vs resident-DDP, and scaling of 1 vs N ranks. JSON out.

    # one H200 (issue 20): two gloo ranks share the device
    python -m tools.checks.ddp_check --parity --backend gloo --share-device --json parity-gloo.json
    python -m tools.checks.ddp_check --scale qwen2.5-32b --layers 8 --share-device --json scale-32b.json
    # the node's host copy through the block cache: mapped (shared, the default) vs pinned (one per rank)
    python -m tools.checks.ddp_check --scale qwen2.5-32b --layers 4 --share-device --cache --json scale-32b-mapped.json
    python -m tools.checks.ddp_check --scale qwen2.5-32b --layers 4 --share-device --cache --host-tier pinned --json x.json
    # two GPUs (issue 21): NCCL, one GPU per rank
    python -m tools.checks.ddp_check --parity --backend nccl --deterministic --json parity-nccl.json
    python -m tools.checks.ddp_check --scale qwen2.5-72b --layers 8 --json scale-72b.json
    python -m tools.checks.ddp_check --train-cli --json train-cli.json
    DEVICE=cpu tools/gpu_run.sh ddp:parity:cases=qwen3 ddp:scale=tiny:ranks=1,2     # dry run here

``--parity`` starts ``torchrun -m poros.testing.distributed`` (every family's tiny variants, or
``--cases``; micro-major DDP with and without ``find_unused_parameters``, ``no_sync`` and layer-major
accumulation, the HF Trainer drop-in with ``patch_hf_model`` and with ``prepare``) and gathers each
rank's verdict. ``--scale SHAPE`` runs this module as a torchrun worker on 1 rank, then on
``--ranks`` ranks: random NF4 weights at the real widths (``tools/bench/shapes.py`` shapes, ``--layers``
decoder layers), ``prepare``, layer-major accumulation (``--accum``) of micro-batch 1 at ``--seq``,
and reports per rank the median step, tokens/s, peak allocated memory, H2D GB/s while streaming,
the host RSS and PSS (the node's PSS sum is the host RAM of the node: pages the ranks share, like the
mapped tier's cache entry, count once), and a pinned 1 GiB copy's GB/s with each rank alone and all together (a shared PCIe switch
shows as a lower "together" rate). ``--train-cli`` runs ``poros train --nproc-per-node N`` on the
bundled tiny model and keeps its metrics rows.

``--cache`` writes a random bf16 checkpoint of the shape (``tools/checks/cache_bench.py``) and the ranks load it
through the NF4 block cache inside ``shared_host_copy`` as ``PorosTrainer`` does: local rank 0 builds the
entry, the others map it, and with several ranks the host tier is ``mapped`` unless ``--host-tier`` names
one (``pinned``: one copy per rank, the comparison). Without ``--cache`` the random model is built in
memory and each rank pins its own copy (no entry to share).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from tools.bench.models import add_lora, build_model, make_batches
from tools.bench.provenance import configure_determinism, environment
from tools.bench.shapes import model_config
from poros.config import HOST_TIERS

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
GIB = 1 << 30


def checkout_env() -> dict[str, str]:
    """PYTHONPATH with this checkout first: the ranks import its poros and tools (``-m tools.checks.ddp_check --worker``)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def torchrun(nproc: int, arguments: list[str], *, timeout: int, env: dict[str, str] | None = None):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               *arguments]
    print("$", " ".join(command), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, **checkout_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT)
    return done, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# Parity (every rank runs poros.testing.distributed)
# ---------------------------------------------------------------------------------------------
def parity(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        extra = ["--deterministic"] if args.deterministic else []
        device = "cuda:0" if args.share_device else ("cuda" if args.device == "cuda" else "cpu")
        done, seconds = torchrun(args.ranks_parity, [
            "-m", "poros.testing.distributed", "--out", out, "--cases", args.cases, "--modes", args.modes,
            "--device", device, "--backend", args.backend, *extra], timeout=args.timeout)
        ranks = []
        for rank in range(args.ranks_parity):
            path = pathlib.Path(out) / f"rank{rank}.json"
            ranks.append(json.loads(path.read_text()) if path.exists() else {"missing": True})
    results = {key: [r.get("results", {}).get(key, {}) for r in ranks] for key in ranks[0].get("results", {})}
    verdict = {key: all(v.get("equal") for v in values) for key, values in results.items()}
    for key, ok in verdict.items():
        print(f"  {key:<32} {'bitwise' if ok else 'DIFFERS'}")
    return {"backend": args.backend, "device": device, "ranks": args.ranks_parity, "returncode": done.returncode,
            "seconds": round(seconds, 1), "all_bitwise": bool(verdict) and all(verdict.values()), "verdict": verdict,
            "per_rank": ranks, "stderr_tail": done.stderr[-4000:] if done.returncode else ""}


# ---------------------------------------------------------------------------------------------
# Scaling: this module is the worker of each rank
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_memory() -> dict[str, float]:
    """This process's resident set now and at its peak (GB), from /proc (pinned pages count)."""
    fields = {}
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) * 1024 / 1e9
    except OSError:
        pass
    pss = None
    try:  # proportional set size: pages shared with other processes (a mapped cache entry) count in part
        for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return {"rss_gb": fields.get("VmRSS"), "peak_rss_gb": fields.get("VmHWM"), "pss_gb": pss}


def copy_rates(device: torch.device, world: int, rank: int, nbytes: int = GIB, repeats: int = 3) -> dict[str, Any]:
    """Pinned host->device GB/s of this rank: alone (ranks take turns), then all ranks at once."""
    import torch.distributed as dist

    if device.type != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed() -> float:
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            target.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return nbytes / best / 1e9

    alone = None
    for turn in range(world):
        dist.barrier()
        if turn == rank:
            alone = timed()
    dist.barrier()
    together = timed()
    dist.barrier()
    del host, target
    torch.cuda.empty_cache()
    return {"h2d_alone_gb_per_s": round(alone, 2), "h2d_together_gb_per_s": round(together, 2)}


def scale_worker(args) -> int:
    import torch.distributed as dist

    import poros
    from poros import distributed

    configure_determinism(args.deterministic)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.device == "cpu" else \
        torch.device("cuda", 0 if args.share_device else local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    here = distributed.init_process_group(device, backend=args.backend)
    config, info = model_config(args.scale, layers=args.layers)
    # The process's own footprint before any weight: the libraries imported, the device context made.
    # Node host RAM above these baselines is what the model costs the node (one host copy, or N).
    import bitsandbytes  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    torch.ones(1, device=device).sum().item()
    dist.barrier()
    host_baseline = host_memory()
    with distributed.shared_host_copy():  # local rank 0 first: with --cache it builds the entry the others map
        if args.checkpoint:
            from poros.loading.load import adapters_to_device, load_pretrained

            model = load_pretrained(args.checkpoint, device=device, load_tokenizer=False, cache_dir=args.cache_dir,
                                    double_quant=True, attn_implementation="sdpa").model
        else:
            model = build_model(config, device, seed=args.seed)
    peft_model = add_lora(model, gradient_checkpointing=False)
    if args.checkpoint:
        adapters_to_device(peft_model, device)
    streamed = poros.prepare(peft_model, host_tier=args.host_tier)
    host_after_load = host_memory()
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-4)
    batches = make_batches(config, count=(args.warmup + args.steps) * args.accum, batch=1, seq=args.seq,
                                 seed=1000 + here.rank)
    times, copied = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        micro = [{k: v.to(device) for k, v in b.items()} for b in batches[step * args.accum:(step + 1) * args.accum]]
        total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        micro = [{**b, "num_items_in_batch": torch.tensor(total, device=device)} for b in micro]
        dist.barrier()
        sync(device)
        before, start = streamed.store.stats.bytes_copied, time.perf_counter()
        streamed.forward_backward(micro)  # all-reduced across the ranks as DDP would
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            copied.append(streamed.store.stats.bytes_copied - before)
    median = statistics.median(times)
    mine = {
        "rank": here.rank, "device": str(device), "median_step_s": round(median, 4),
        "tokens_per_s": round(args.accum * args.seq / median, 1),
        "stream_h2d_gb_per_s": round(statistics.median(copied) / median / 1e9, 2),
        "peak_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 3) if device.type == "cuda" else None,
        "host_tier": streamed.host_plan.tier, "host_reason": streamed.host_plan.reason,
        "host_baseline": host_baseline, "host_after_load": host_after_load, "host_end": host_memory(),
        **copy_rates(device, here.size, here.rank),
    }
    gathered: list[Any] = [None] * here.size
    dist.all_gather_object(gathered, mine)
    if here.rank == 0:
        pathlib.Path(args.worker_out).write_text(json.dumps({
            "ranks": here.size, "model_info": info, "layers": config.num_hidden_layers, "seq": args.seq,
            "accum": args.accum, "per_rank": gathered,
            "tokens_per_s_total": round(sum(r["tokens_per_s"] for r in gathered), 1),
            "host_rss_node_gb": round(sum(r["host_end"]["rss_gb"] or 0 for r in gathered), 3),
            "host_pss_node_gb": round(sum(r["host_end"]["pss_gb"] or 0 for r in gathered), 3),
            "host_pss_node_above_baseline_gb": round(sum((r["host_end"]["pss_gb"] or 0) - (r["host_baseline"]["pss_gb"] or 0)
                                                         for r in gathered), 3),
        }, indent=1))
    distributed.leave_process_group()  # drains gloo's workers first (see there)
    return 0


def scale(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=args.cache_work) as work:
        cached = {}
        if args.cache:  # a checkpoint on disk, loaded through the block cache by every run
            from tools.checks.cache_bench import write_checkpoint

            config, _ = model_config(args.scale, layers=args.layers)
            checkpoint = pathlib.Path(work) / "checkpoint"
            cached["checkpoint_bytes"] = write_checkpoint(config, checkpoint, torch.device(args.device))
            cached["forwarded"] = ["--checkpoint", str(checkpoint), "--cache-dir", str(pathlib.Path(work) / "cache")]
        return _scale_runs(args, cached)


def _scale_runs(args, cached: dict[str, Any]) -> dict[str, Any]:
    runs = {}
    for nproc in [int(n) for n in args.ranks.split(",")]:
        with tempfile.TemporaryDirectory() as out:
            worker_out = pathlib.Path(out) / "scale.json"
            forwarded = ["--scale", args.scale, "--seq", str(args.seq), "--accum", str(args.accum), "--steps",
                         str(args.steps), "--warmup", str(args.warmup), "--device", args.device, "--backend",
                         args.backend, "--seed", str(args.seed), "--worker-out", str(worker_out)]
            forwarded += ["--layers", str(args.layers)] if args.layers else []
            forwarded += ["--share-device"] if args.share_device else []
            forwarded += ["--deterministic"] if args.deterministic else []
            forwarded += cached.get("forwarded", []) + (["--host-tier", args.host_tier] if args.host_tier else [])
            done, seconds = torchrun(nproc, ["-m", "tools.checks.ddp_check", "--worker", *forwarded], timeout=args.timeout)
            run = json.loads(worker_out.read_text()) if worker_out.exists() else {}
            run.update(returncode=done.returncode, seconds=round(seconds, 1),
                       stderr_tail=done.stderr[-3000:] if done.returncode else "")
            runs[str(nproc)] = run
            if run.get("per_rank"):
                print(f"  {nproc} rank(s): {run['tokens_per_s_total']} tok/s, node host RSS {run['host_rss_node_gb']} "
                      f"GB, PSS {run['host_pss_node_gb']} GB, tier {run['per_rank'][0]['host_tier']}, per rank: " + "; ".join(
                          f"r{r['rank']} {r['median_step_s']} s peak {r['peak_allocated_gb']} GB "
                          f"h2d {r.get('h2d_alone_gb_per_s')}/{r.get('h2d_together_gb_per_s')} GB/s"
                          for r in run["per_rank"]))
    one, many = runs.get("1", {}), runs.get(str(max(int(n) for n in args.ranks.split(","))), {})
    summary = {}
    if one.get("tokens_per_s_total") and many.get("tokens_per_s_total"):
        summary = {"speedup": round(many["tokens_per_s_total"] / one["tokens_per_s_total"], 3),
                   "host_rss_ratio": round(many["host_rss_node_gb"] / one["host_rss_node_gb"], 3)
                   if one.get("host_rss_node_gb") else None,
                   "host_pss_ratio": round(many["host_pss_node_gb"] / one["host_pss_node_gb"], 3)
                   if one.get("host_pss_node_gb") else None,
                   # the target's measure: what the model costs the node above the processes' own baselines
                   "host_pss_above_baseline_ratio": round(many["host_pss_node_above_baseline_gb"]
                                                          / one["host_pss_node_above_baseline_gb"], 3)
                   if one.get("host_pss_node_above_baseline_gb") else None}
    return {"shape": args.scale, "share_device": args.share_device, "backend": args.backend, "runs": runs,
            "cache": bool(cached), "host_tier_requested": args.host_tier,
            "checkpoint_bytes": cached.get("checkpoint_bytes"), "summary": summary}


def train_cli(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "poros", "train", "--nproc-per-node", str(args.ranks_parity), "--steps", "3",
                   "--batch-size", str(2 * args.ranks_parity), "--seq-len", "128", "--logging-steps", "1",
                   "--device", "cpu" if args.device == "cpu" else "cuda", "--output-dir", out]
        print("$", " ".join(command), flush=True)
        done = subprocess.run(command, env={**os.environ, **checkout_env()}, capture_output=True, text=True,
                              timeout=args.timeout, cwd=REPO_ROOT)
        metrics = pathlib.Path(out) / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        saved = (pathlib.Path(out) / "adapter_model.safetensors").exists()
    return {"returncode": done.returncode, "adapter_saved": saved, "metrics": rows,
            "stdout_tail": done.stdout[-2000:], "stderr_tail": done.stderr[-3000:] if done.returncode else ""}


# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: NCCL on CUDA, gloo on CPU)")
    parser.add_argument("--share-device", action="store_true", help="every rank on cuda:0 (gloo only)")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--parity", action="store_true")
    parser.add_argument("--cases", default="all")
    parser.add_argument("--modes", default="micro,accum,hf_patch,hf_prepare")
    parser.add_argument("--ranks-parity", type=int, default=2)
    parser.add_argument("--scale", default=None, metavar="SHAPE", help="a tools/bench/shapes.py shape, e.g. qwen2.5-32b")
    parser.add_argument("--ranks", default="1,2", help="rank counts of the scaling runs")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", action="store_true", help="--scale: load a written checkpoint through the block "
                        "cache (the node's ranks share its entry: the mapped tier)")
    parser.add_argument("--host-tier", default=None, choices=HOST_TIERS,
                        help="--scale: the host tier (default: the chooser's; mapped for several ranks with --cache)")
    parser.add_argument("--cache-work", default=None, help="--cache: directory for the checkpoint and the cache")
    parser.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train-cli", action="store_true")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per torchrun job")
    parser.add_argument("--json", default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" and not args.share_device else "gloo")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        import faulthandler

        # Each rank prints every thread's stack once a minute: a rank that stops answering (the mapped
        # host tier did, on the H200) says where.
        faulthandler.dump_traceback_later(60, repeat=True, file=sys.stderr)
        return scale_worker(args)
    report: dict[str, Any] = {"tool": "ddp_check", "environment": environment(
        torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu"), args.commit),
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0}
    ok = True
    if args.parity:
        report["parity"] = parity(args)
        ok &= report["parity"]["all_bitwise"]
    if args.scale:
        report["scale"] = scale(args)
        ok &= all(run.get("returncode") == 0 for run in report["scale"]["runs"].values())
    if args.train_cli:
        report["train_cli"] = train_cli(args)
        ok &= report["train_cli"]["returncode"] == 0
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

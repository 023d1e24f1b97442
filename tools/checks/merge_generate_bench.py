#!/usr/bin/env python3
"""Host RAM and time of ``poros merge``, and tokens/s of ``poros generate`` streamed vs resident, at a
real model shape with few decoder layers (random weights).

Merge: a random bf16 checkpoint of the shape is written to disk first (HF layout, ``--shard-size``
shards, one shard in memory at a time), with a random LoRA adapter (rank ``--rank`` on the seven
projections). ``poros merge`` then runs in a child process (``python -m poros.cli.main merge``) so
that its peak RSS is the merge's own; the report gives it beside the largest shard, and the bytes
``merge_and_unload`` would hold (the whole bf16 model at full depth). The merge reads and writes
tensor by tensor, so its working memory (peak minus the imports' baseline) should be a small
multiple of the largest tensor (the embedding), not of the shard or the model. Time and bytes scale with
depth: ``full_depth_estimate`` multiplies the measured GB/s by the full model's bytes (an estimate,
labelled so).

Generate: the shape's NF4 model with LoRA (``tools/bench/harness.py build_model``/``add_lora``) generates
``--new-tokens`` greedy tokens after a ``--prompt-tokens`` prompt, resident, then streamed
(``poros.prepare``: blocks on the host, one fetch per block per token); tokens must be equal. The
per-token time of the streamed arm is dominated by the blocks crossing the link, so its full-depth
estimate scales the measured per-token time by ``full_layers / layers`` (labelled an estimate).

    python -m tools.checks.merge_generate_bench --model qwen2.5-72b --layers 2 --json out/merge-72b.json
    DEVICE=cpu tools/gpu_run.sh merge:tiny:layers=2        # dry run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

GiB = 2**30
IMPORTS_ONLY = ("import resource, peft, safetensors.torch, torch, transformers, poros.cli.main, poros.export.merge; "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")  # KiB on Linux
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-32b", help="a tools/bench/harness.py shape")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers built (the full depth is reported)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shard-size", default="5GB", help="shard size of the random base (HF's default 5GB)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-merge", action="store_true")
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--workdir", type=pathlib.Path, help="where the random checkpoint goes (default: a temp dir)")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--commit")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--deterministic", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tools.bench.provenance import start_tool
    from tools.bench.shapes import model_config

    device, env = start_tool(args)
    config, shape = model_config(args.model, layers=args.layers)
    report: dict[str, Any] = {"tool": "merge_generate_bench", "environment": env, "shape": shape,
                              "layers": args.layers, "full_layers": shape["full_depth"] or args.layers}
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="poros-merge-bench-"))
    try:
        if not args.skip_merge:
            report["merge"] = bench_merge(config, workdir, args, report["full_layers"])
            print(json.dumps(report["merge"], indent=1))
        if not args.skip_generate:
            report["generate"] = bench_generate(config, device, args, report["full_layers"])
            print(json.dumps(report["generate"], indent=1))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    ok = report.get("generate", {}).get("tokens_equal", True) and report.get("merge", {}).get("returncode", 0) == 0
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
# Merge
# ---------------------------------------------------------------------------------------------
def bench_merge(config, workdir: pathlib.Path, args: argparse.Namespace, full_layers: int) -> dict[str, Any]:
    base, adapter, output = workdir / "base", workdir / "adapter", workdir / "merged"
    start = time.perf_counter()
    written = write_random_checkpoint(config, base, _bytes(args.shard_size), torch.device(args.device))
    write_random_adapter(config, base, adapter, args.rank)
    setup_s = time.perf_counter() - start
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "poros.cli.main", "merge", "--adapter", str(adapter), "--output", str(output),
               "--json"]
    # the child's RSS before any shard: the same imports, nothing merged
    baseline = subprocess.run([sys.executable, "-c", IMPORTS_ONLY], capture_output=True, text=True, env=env)
    baseline_rss = int(baseline.stdout.strip()) * 1024 if baseline.returncode == 0 else None
    start = time.perf_counter()
    child = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    sys.stderr.write(child.stderr)
    result = json.loads(child.stdout) if child.returncode == 0 else {}
    block_bytes = written["total_bytes"] - written["non_block_bytes"]
    full_bytes = written["non_block_bytes"] + block_bytes / max(args.layers, 1) * full_layers
    gb_per_s = written["total_bytes"] / 1e9 / result["seconds"] if result.get("seconds") else None
    shutil.rmtree(output, ignore_errors=True)
    return {
        "returncode": child.returncode, "error": child.stderr[-2000:] if child.returncode else None,
        "checkpoint_bytes": written["total_bytes"], "shards": written["shards"],
        "largest_shard_bytes": written["largest_shard_bytes"], "shard_size": args.shard_size,
        "largest_tensor_bytes": written["largest_tensor_bytes"],
        "merged_modules": result.get("merged_modules"), "merge_seconds": result.get("seconds"),
        "child_wall_seconds": wall, "peak_rss_bytes": result.get("peak_rss_bytes"),
        "baseline_rss_bytes": baseline_rss,
        "peak_rss_over_largest_shard": (result["peak_rss_bytes"] / written["largest_shard_bytes"]
                                        if result.get("peak_rss_bytes") else None),
        "working_rss_over_largest_shard": ((result["peak_rss_bytes"] - baseline_rss) / written["largest_shard_bytes"]
                                           if result.get("peak_rss_bytes") and baseline_rss else None),
        "working_rss_over_largest_tensor": ((result["peak_rss_bytes"] - baseline_rss) / written["largest_tensor_bytes"]
                                            if result.get("peak_rss_bytes") and baseline_rss else None),
        "merge_gb_per_s": gb_per_s, "setup_seconds": setup_s,
        "full_depth_estimate": {
            "note": "estimate: measured GB/s x full-depth bytes; peak RSS does not grow with depth "
                    "(one tensor at a time)",
            "checkpoint_bytes": full_bytes,
            "merge_seconds": full_bytes / 1e9 / gb_per_s if gb_per_s else None,
            "merge_and_unload_needs_bytes": full_bytes,
        },
    }


def write_random_checkpoint(config, path: pathlib.Path, shard_bytes: int, device: torch.device) -> dict[str, Any]:
    """The shape's bf16 checkpoint with random values, written shard by shard as save_pretrained lays it out."""
    import transformers
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    entries = [(name, tuple(t.shape), t.dtype) for name, t in model.state_dict().items() if name not in tied]
    generator = torch.Generator(device=device).manual_seed(0)  # random values made on the device: fast on CUDA
    path.mkdir(parents=True, exist_ok=True)
    groups, current, size = [], [], 0
    for entry in entries:
        nbytes = _numel(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if current and size + nbytes > shard_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    groups.append(current)
    weight_map, total, largest, non_block = {}, 0, 0, 0
    largest_tensor = max(_numel(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in entries)
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {key: (torch.randn(shape, generator=generator, device=device, dtype=dtype) * 0.02).cpu()
                   if len(shape) > 1 and dtype.is_floating_point else torch.ones(shape, dtype=dtype)
                   for key, shape, dtype in group}
        save_file(tensors, path / name, metadata={"format": "pt"})
        shard = sum(t.numel() * t.element_size() for t in tensors.values())
        non_block += sum(t.numel() * t.element_size() for k, t in tensors.items() if ".layers." not in k)
        total, largest = total + shard, max(largest, shard)
        weight_map.update({key: name for key in tensors})
        del tensors
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.save_pretrained(path)
    return {"total_bytes": total, "largest_shard_bytes": largest, "shards": len(groups), "non_block_bytes": non_block,
            "largest_tensor_bytes": largest_tensor}


def write_random_adapter(config, base: pathlib.Path, path: pathlib.Path, rank: int) -> None:
    """A PEFT LoRA adapter (rank ``rank`` on the seven projections of every layer) with random A and B."""
    import peft
    from safetensors.torch import save_file

    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS and isinstance(module, torch.nn.Linear):
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM",
                    base_model_name_or_path=str(base)).save_pretrained(path)


# ---------------------------------------------------------------------------------------------
# Generate
# ---------------------------------------------------------------------------------------------
def bench_generate(config, device: torch.device, args: argparse.Namespace, full_layers: int) -> dict[str, Any]:
    import poros
    from tools.bench.arms import free_memory
    from tools.bench.models import add_lora, build_model
    from poros.export.generate import generate

    model = add_lora(build_model(config, device), rank=args.rank, gradient_checkpointing=False)
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    options = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    arms: dict[str, dict[str, Any]] = {}
    resident_ids, arms["resident"] = _timed_generate(lambda: generate(model, prompt, **options), device)
    streamed = poros.prepare(model)
    free_memory(device)
    streamed_ids, arms["streamed"] = _timed_generate(lambda: streamed.generate(prompt, **options), device)
    block_bytes = sum(block.nbytes for block in streamed.store.blocks)
    for arm in arms.values():  # prefill included: what a user of `poros generate` sees
        arm["tokens_per_s"] = args.new_tokens / arm["seconds"]
    per_token = arms["streamed"]["seconds"] / args.new_tokens
    return {
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "arms": arms,
        "tokens_equal": bool(torch.equal(resident_ids.cpu(), streamed_ids.cpu())),
        "streamed_over_resident_time": arms["streamed"]["seconds"] / arms["resident"]["seconds"],
        "block_bytes_per_token": block_bytes,
        "full_depth_estimate": {
            "note": "estimate: streamed time per token x full_layers / layers (the blocks crossing the link "
                    "dominate; the head is scaled too, so this errs slow)",
            "streamed_tokens_per_s": 1 / (per_token * full_layers / max(args.layers, 1)),
            "block_bytes_per_token": block_bytes / max(args.layers, 1) * full_layers,
        },
    }


def _timed_generate(call, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    ids = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return ids, {"seconds": seconds, "sequence": ids.shape[1], "peak_allocated_bytes": peak}


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _bytes(text: str) -> int:
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": GiB, "MIB": 2**20, "KIB": 2**10}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


if __name__ == "__main__":
    sys.exit(main())

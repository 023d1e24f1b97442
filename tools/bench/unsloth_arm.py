"""The ``unsloth`` arm of :mod:`tools.bench`: the bench's model trained by Unsloth (``FastLanguageModel``
QLoRA + TRL's ``SFTTrainer``) in a child process with its own packages, beside the Poros arms.

Unsloth 2026.10.9 pins transformers <= 5.17 and trl <= 1.15, while the Poros arms run transformers
5.24, so the arm is a child process (:mod:`tools.bench.unsloth_child`) whose ``PYTHONPATH`` starts with
``--unsloth-site`` (``tools/gpu_run.sh`` installs ``.whl-unsloth/``, built by ``tools/bench/unsloth-wheelhouse``,
into ``/tmp/site-unsloth`` and exports ``POROS_UNSLOTH_SITE``), then the repository (for
:mod:`tools.bench.trainer_common`), then the host's own packages. The parent's wheel directory is not on it.

The checkpoint. ``FastLanguageModel.from_pretrained`` loads a checkpoint directory. A bf16 checkpoint
of a 32B/72B shape does not fit the GPU host's 64 GB disk, so the parent writes the bench's own model
-- the random NF4 weights every other arm trains -- as a **pre-quantized bnb-4bit checkpoint**
(:func:`save_checkpoint`: the model's ``state_dict``, i.e. the packed 4-bit weights and their quant
states as transformers serialises them, in safetensors shards, with the config and its
``quantization_config``, and the bundled tokenizer), written before LoRA goes in. Unsloth loads it as
it loads its own ``*-bnb-4bit`` repositories: no quantize pass, the same weights as the Poros arms.
Where the checkpoint does not fit the disk's free space (with a 10 % margin), or ``--unsloth-layers``
asks for fewer, the first N decoder layers are written instead (the same width) and the arm's JSON
says so (``layers``, ``full_depth``, ``depth_reason``); ratios against the other arms are given only
at the same depth.

The data are the bench's rows, in the same order (the same ``seed``/``data_seed``), with the same
``SFTConfig`` (:func:`tools.bench.trainer_common.sft_config_arguments`); LoRA r/alpha on the same targets,
dropout 0, Unsloth's own gradient checkpointing (``use_gradient_checkpointing="unsloth"``, its default,
``--unsloth-checkpointing``). No parity is expected: Unsloth's kernels differ from the HF forward.

On a CPU the arm is skipped (Unsloth's kernels are Triton/CUDA) unless ``--unsloth-command`` names a
child command, which the CPU tests use to check the plumbing with a stand-in child.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tools.bench.trainer_common import TrainerSetup, throughput

ARM = "unsloth"
REPO_ROOT = Path(__file__).resolve().parents[2]
#: the child's environment: no hub, no statistics ping (the GPU host has no internet)
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "UNSLOTH_DISABLE_STATISTICS": "1", "TOKENIZERS_PARALLELISM": "false"}
SHARD_BYTES = 4 << 30
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def add_arguments(parser) -> None:
    """The bench's ``--unsloth-*`` options."""
    parser.add_argument("--unsloth-site", default=os.environ.get("POROS_UNSLOTH_SITE"), metavar="DIR",
                        help="packages put first on the Unsloth child's PYTHONPATH (default $POROS_UNSLOTH_SITE; "
                             "tools/gpu_run.sh installs .whl-unsloth there)")
    parser.add_argument("--unsloth-command", metavar="CMD",
                        help="the child command, SPEC.json and OUT.json appended (default: this python -m "
                             "tools.bench.unsloth_child); given, the arm also runs on a CPU (the tests' stand-in child)")
    parser.add_argument("--unsloth-layers", type=int, metavar="N",
                        help="decoder layers of Unsloth's checkpoint (default: the bench's, fewer if it does not "
                             "fit the disk)")
    parser.add_argument("--unsloth-dir", metavar="DIR",
                        help="where the bnb-4bit checkpoint goes (default: a temporary directory, removed after)")
    parser.add_argument("--unsloth-checkpointing", default="unsloth", choices=("unsloth", "true", "false"),
                        help="FastLanguageModel.get_peft_model(use_gradient_checkpointing=...)")
    parser.add_argument("--unsloth-timeout", type=float, metavar="S", help="seconds the child may run")


def skip_reason(args, device: torch.device) -> str | None:
    if device.type != "cuda" and not args.unsloth_command:
        return (f"Unsloth needs a CUDA GPU (its kernels are Triton/CUDA; FastLanguageModel loads onto cuda); "
                f"device is {device.type}")
    return None


def layer_bytes(state: dict[str, torch.Tensor]) -> tuple[int, dict[int, int]]:
    """Bytes of the tensors outside the decoder layers, and of each layer's."""
    outside, per_layer = 0, {}
    for key, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        match = _LAYER.search(key)
        if match is None:
            outside += size
        else:
            per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + size
    return outside, per_layer


def plan_depth(outside: int, per_layer: dict[int, int], wanted: int, free: int) -> tuple[int, str | None]:
    """The most layers (at most ``wanted``) whose checkpoint fits 90 % of ``free`` bytes; why fewer, if so."""
    layers = wanted
    while layers > 1 and outside + sum(per_layer.get(i, 0) for i in range(layers)) > 0.9 * free:
        layers -= 1
    if layers == wanted:
        return layers, None
    need = outside + sum(per_layer.get(i, 0) for i in range(wanted))
    return layers, (f"a {wanted}-layer bnb-4bit checkpoint ({need / 1e9:.1f} GB) does not fit 90 % of the "
                    f"{free / 1e9:.1f} GB free on the checkpoint's disk: Unsloth ran the first {layers} layers")


def save_checkpoint(model, args, device: torch.device) -> dict[str, Any]:
    """The bench's NF4 model (before LoRA) as a bnb-4bit checkpoint directory Unsloth can load; returns
    where, how deep and why (``{"skipped": reason}`` when the arm does not run here)."""
    from safetensors.torch import save_file

    from tools.bench.trainer_arms import bundled_tokenizer

    reason = skip_reason(args, device)
    if reason is not None:
        return {"skipped": reason}
    started = time.perf_counter()
    directory = Path(args.unsloth_dir or tempfile.mkdtemp(prefix="poros-unsloth-", dir=os.environ.get("TMPDIR")))
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()  # the packed 4-bit weights and their quant states, as save_pretrained writes them
    outside, per_layer = layer_bytes(state)
    full = model.config.num_hidden_layers
    layers, depth_reason = plan_depth(outside, per_layer, min(args.unsloth_layers or full, full),
                                      shutil.disk_usage(directory).free)
    if depth_reason is None and layers < full:
        depth_reason = f"--unsloth-layers {layers}: Unsloth ran the first {layers} of {full} layers"
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # written once, tied again on load
    kept = {key: tensor for key, tensor in state.items() if key not in tied
            and not ((match := _LAYER.search(key)) is not None and int(match.group(1)) >= layers)}
    weight_map, shard, shard_bytes, files, total = {}, {}, 0, [], 0

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in shard.items()}, str(directory / name),
                  metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(name)

    for key, tensor in kept.items():
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
            shard, shard_bytes = {}, 0
        shard[key], shard_bytes, total = tensor, shard_bytes + size, total + size
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    config.architectures = [type(model).__name__]  # from_pretrained and Unsloth dispatch on it
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    config.save_pretrained(directory)
    bundled_tokenizer().save_pretrained(directory)
    return {"dir": str(directory), "layers": layers, "full_depth": full, "depth_reason": depth_reason, "bytes": total,
            "files": len(files), "seconds": round(time.perf_counter() - started, 2), "temporary": not args.unsloth_dir}


def child_command(args) -> list[str]:
    return shlex.split(args.unsloth_command) if args.unsloth_command else [sys.executable, "-m", "tools.bench.unsloth_child"]


def child_environment(site: str | None) -> dict[str, str]:
    """The parent's environment with the child's own ``PYTHONPATH`` (``site``, then the repository) and
    no hub access."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*([site] if site else []), str(REPO_ROOT)])
    env.update(OFFLINE)
    return env


def run(args, checkpoint: dict[str, Any], token_rows: list[list[int]], setup: TrainerSetup) -> dict[str, Any]:
    """Run the child on ``checkpoint`` and return the arm's summary (status, step times, median, peaks,
    tokens/s, losses, depth, the child's versions)."""
    if "skipped" in checkpoint:
        return {"status": "skipped", "error": checkpoint["skipped"], "losses": [], "step_times_s": [],
                "median_step_s": None, "timed_steps": 0}
    work = Path(tempfile.mkdtemp(prefix="poros-unsloth-run-"))
    spec = {"checkpoint": checkpoint["dir"], "setup": {**setup.to_dict(), "output_dir": str(work / "trainer")},
            "rows": token_rows,
            "lora": {"rank": args.rank, "alpha": args.alpha, "targets": args.targets.split(",")},
            "gradient_checkpointing": args.unsloth_checkpointing, "deterministic": args.deterministic}
    (work / "spec.json").write_text(json.dumps(spec))
    command = [*child_command(args), str(work / "spec.json"), str(work / "out.json")]
    started = time.perf_counter()
    try:  # in `work`: Unsloth writes its compiled cache into the working directory
        done = subprocess.run(command, cwd=work, env=child_environment(args.unsloth_site), capture_output=True,
                              text=True, timeout=args.unsloth_timeout)
        returncode, tail = done.returncode, (done.stdout[-2000:] + done.stderr[-4000:])
    except subprocess.TimeoutExpired as exc:
        returncode, tail = None, f"timed out after {exc.timeout} s"
    wall = round(time.perf_counter() - started, 2)
    out = work / "out.json"
    child = json.loads(out.read_text()) if out.exists() else {
        "status": "error", "error": f"{shlex.join(command)} exited {returncode} without writing its JSON:\n{tail}"}
    if returncode not in (0, None) and child.get("status") == "ok":
        child["status"], child["error"] = "error", f"exited {returncode}:\n{tail}"
    shutil.rmtree(work, ignore_errors=True)
    if checkpoint.get("temporary"):
        shutil.rmtree(checkpoint["dir"], ignore_errors=True)
    return summary(child, checkpoint, setup, command=command, wall_s=wall, returncode=returncode)


def summary(child: dict[str, Any], checkpoint: dict[str, Any], setup: TrainerSetup, **launch: Any) -> dict[str, Any]:
    """The child's JSON with the median over the timed steps, tokens/s and the depth it ran at."""
    times = child.get("step_times_s") or []
    timed = times[setup.warmup:]
    median = round(statistics.median(timed), 6) if timed else None
    out = {"status": child.get("status", "error"), "error": child.get("error"), "losses": child.get("losses", []),
           "step_times_s": times, "median_step_s": median, "timed_steps": len(timed)}
    out.update(throughput(median, setup))
    out.update({key: value for key, value in child.items() if key not in out})
    out.update({"layers": checkpoint.get("layers"), "full_depth": checkpoint.get("full_depth"),
                "depth_reason": checkpoint.get("depth_reason"),
                "checkpoint": {k: checkpoint.get(k) for k in ("bytes", "files", "seconds")},
                "child": {"command": shlex.join(launch["command"]), "returncode": launch["returncode"],
                          "wall_s": launch["wall_s"]}})
    return out


def compare(arms: dict[str, dict[str, Any]], layers: int) -> dict[str, Any] | None:
    """Unsloth against each finished arm of the same depth: ratios unsloth/arm of the median step, the peaks
    and tokens/s; ``None`` when the Unsloth arm did not finish."""
    mine = arms.get(ARM)
    if not mine or mine.get("status") != "ok":
        return None
    if mine.get("layers") != layers:
        return {"comparable": False, "reason": mine.get("depth_reason") or f"Unsloth ran {mine.get('layers')} layers"}
    out: dict[str, Any] = {"comparable": True}
    for name, arm in arms.items():
        if name == ARM or arm.get("status") != "ok":
            continue
        ratios = {}
        for key in ("median_step_s", "peak_allocated_gb", "peak_reserved_gb", "tokens_per_s"):
            theirs, ours = arm.get(key), mine.get(key)
            if theirs and ours is not None:
                ratios[f"ratio_{key}"] = round(ours / theirs, 4)
        out[name] = ratios
    return out

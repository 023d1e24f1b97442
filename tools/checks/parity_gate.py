"""Parity gate: every family trains N steps resident and streamed; 0.00e+00 or it says why.

::

    python -m tools.checks.parity_gate --device cuda --json gate.json            # the GPU gate
    python -m tools.checks.parity_gate --device cuda --append-registry           # ... and record it
    python -m tools.checks.parity_gate --device cpu --tiny                       # CPU smoke test
    python -m tools.checks.parity_gate --only gemma4,gemma4-moe --attn eager     # a subset, another kernel

With deterministic algorithms on (``torch.use_deterministic_algorithms(True)``,
``CUBLAS_WORKSPACE_CONFIG=:4096:8``), each variant below is built by ``tools/bench/models.py``'s builder (NF4
random weights at a real width, 4 layers), wrapped with PEFT LoRA (all-linear, plus the experts
through ``target_parameters`` for the MoE variant), and trained ``--steps`` AdamW steps on
batches of 2 rows with left padding in one row: first resident (HF, gradient checkpointing), then
streamed (``poros.prepare``) from the same initial LoRA state. Every step's loss, every LoRA
tensor and every AdamW state tensor must be ``torch.equal``.

Labels (``poros/records.py``): ``bitwise`` when everything is equal and no non-deterministic
kernel ran; ``numerical`` otherwise. A ``numerical`` variant is rerun with the other attention
implementation (eager / sdpa) and, for MoE, the other experts implementation (eager /
grouped_mm), and the report names the kernel whose swap makes it bitwise. Kernels that torch
reports as non-deterministic are listed by torch's own message.

``--liger`` applies liger-kernel's kernels to each variant's model before either arm (the call HF's Trainer makes
for ``use_liger_kernel=True``): the resident arm trains Liger's modules, the streamed arm streams the same
patched modules, and its loss is Liger's fused linear cross-entropy in both; the record says ``kernels = "liger"``.

``--autocast bf16`` (or ``fp16``) runs both arms under ``torch.autocast`` (as ``TrainingArguments(bf16=True)``
does; PEFT keeps the LoRA weights in fp32, so autocast changes their ops and Poros's recompute must replay
the forward's autocast state), entered around each forward as HF Trainer does (``--autocast-region
run``: one region around everything, whose cast cache keeps step 1's casts of the LoRA weights). ``--save-load`` then checks, on the trained streamed model (double quant,
the builder's default), that ``state_dict``, PEFT's ``save_pretrained`` and the base model's
``save_pretrained`` hold the resident model's bytes, and that a ``load_state_dict`` gives the resident
logits; any difference labels the variant ``numerical``.

Writes JSON (``--json``) and, with ``--append-registry``, one ``[[validation]]`` table per variant
appended to ``registry/<family>.toml`` (text appended, the file is not rewritten; the result is
re-parsed and the append undone if it does not parse).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


import torch

from tools.bench.arms import compare_runs, free_memory
from tools.bench.models import add_lora, build_model, make_batches
from tools.bench.provenance import REPO_ROOT, environment_line, start_tool
from tools.bench.shapes import model_config

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Variant:
    """One gate configuration.

    Args:
        name: the variant's name in reports (``--only``).
        shape: ``shapes.SHAPES`` entry whose width is used (truncated to ``--layers``).
        tiny: the ``shapes.SHAPES`` entry used with ``--tiny``.
        overrides: config overrides for the truncated shape (layer pattern, sharing, window).
        target_parameters: PEFT ``target_parameters`` (LoRA on raw parameters, e.g. MoE experts).
        moe: rerun with the other experts implementation when not bitwise.
    """

    name: str
    shape: str
    tiny: str
    overrides: dict[str, Any] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()
    moe: bool = False


# Windows of 128 < seq 256 so that the sliding masks differ from the causal ones.
VARIANTS = (
    Variant("qwen2", "qwen2.5-7b", "tiny-qwen2"),
    Variant("qwen3", "qwen3-8b", "tiny-qwen3"),
    Variant("qwen3_5", "qwen3.5-9b", "tiny-qwen3_5"),  # 3 Gated DeltaNet + 1 gated attention
    Variant("gemma3", "gemma3-12b", "tiny-gemma3",
            overrides=dict(layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=128)),
    # KV sharing (layers 2, 3 read the K/V stored by 0, 1) + per-layer inputs + double-wide MLP
    Variant("gemma4", "gemma4-e4b", "tiny-gemma4",
            overrides=dict(layer_types=[SLIDING, FULL, SLIDING, FULL], num_kv_shared_layers=2, sliding_window=128)),
    # MoE block beside the dense MLP, K = V on full layers; LoRA on the experts too
    Variant("gemma4-moe", "gemma4-26b-a4b", "tiny-gemma4-moe",
            overrides=dict(layer_types=[SLIDING, FULL, SLIDING, FULL], sliding_window=128),
            target_parameters=("experts.gate_up_proj", "experts.down_proj"), moe=True),
)

NONDETERMINISTIC_MARK = "does not have a deterministic implementation"


def run_variant(variant: Variant, args, device: torch.device, *, attn: str, experts: str | None) -> dict[str, Any]:
    """Build, train resident then streamed, compare. Returns the variant's report (no label yet)."""
    overrides = {} if args.tiny else variant.overrides
    config, info = model_config(variant.tiny if args.tiny else variant.shape,
                                      layers=None if args.tiny else args.layers, **overrides)
    model = build_model(config, device, seed=args.seed, attn_implementation=attn,
                              experts_implementation=experts)
    peft_model = add_lora(model, rank=args.rank, alpha=args.alpha, targets=args.targets,
                                target_parameters=list(variant.target_parameters) or None)
    liger = None
    if getattr(args, "liger", False):  # both arms: the resident model patched, prepare streams what it finds
        from poros.dropin.kernels import apply_liger

        liger = apply_liger(peft_model).to_dict()
    batches = make_batches(config, count=args.steps, batch=args.batch, seq=args.seq, seed=args.seed + 1,
                                 left_pad=args.pad)
    autocast = getattr(args, "autocast", "none")  # callers building their own Namespace may leave it out
    region = getattr(args, "autocast_region", "forward")

    def mixed():
        return torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[autocast])

    per_forward = mixed if autocast != "none" and region == "forward" else None
    whole_run = mixed() if autocast != "none" and region == "run" else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as caught, whole_run:
        warnings.simplefilter("always")
        outcome = compare_runs(peft_model, batches, device=device, warmup=0, lr=args.lr,
                                     cuda_graphs=getattr(args, "cuda_graphs", False),
                                     grad_accum=getattr(args, "grad_accum", 1),
                                     schedule=getattr(args, "schedule", "micro-major"), autocast=per_forward)
    checked = getattr(args, "save_load", False) and outcome["comparison"]
    save_load = save_load_check(peft_model, batches[0], device) if checked else None
    kernels = sorted({_kernel_name(str(w.message)) for w in caught if NONDETERMINISTIC_MARK in str(w.message)})
    arms = {name: result.summary(0) for name, result in outcome["arms"].items()}
    for arm in arms.values():
        arm.pop("step_times_s", None)
        arm.pop("median_step_s", None)
        arm.pop("timed_steps", None)
    report = {
        "variant": variant.name, "family": info["family"], "width_of": info["hf_id"] or info["shape"],
        "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "layer_types": list(getattr(config, "layer_types", None) or []),
        "attn_implementation": attn, "experts_implementation": experts if variant.moe else None,
        "target_parameters": list(variant.target_parameters),
        "arms": arms, "comparison": outcome["comparison"], "nondeterministic_kernels": kernels,
        "model_info": info, "autocast": autocast, "autocast_region": region if autocast != "none" else None,
        "save_load": save_load, "liger": liger,
        "cuda_graphs": (outcome["arms"]["poros"].extra.get("cuda_graphs") if "poros" in outcome["arms"] else None),
    }
    del outcome, peft_model, model
    free_memory(device)
    return report


def _host_state(model) -> dict[str, torch.Tensor]:
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


def _same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    def raw(t):
        return t.contiguous().view(torch.uint8) if t.numel() else t
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(raw(a[k]), raw(b[k])) for k in a)


def _saved(model, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(directory / "adapter")
    model.get_base_model().save_pretrained(directory / "base")
    files = sorted((directory / "adapter").glob("*.safetensors")) + sorted((directory / "base").glob("*.safetensors"))
    return {f"{path.parent.name}/{key}": value for path in files for key, value in load_file(path).items()}


def save_load_check(peft_model, batch: dict, device: torch.device) -> dict[str, Any]:
    """The trained streamed model's state_dict and saved files against the same model resident (unpatched), and
    a load_state_dict into each (LoRA A doubled, a block norm halved) followed by a no-grad forward.

    ``batch`` is one of ``make_batches``'s, on the host: it goes to ``device`` here, as ``run_arm`` moves
    each batch (the resident arm's embedding table is on the device; only the streamed one may look up on the
    host)."""
    import tempfile

    import poros

    batch = {key: value.to(device) for key, value in batch.items()}
    if not isinstance(peft_model, poros.PorosModel):
        return {"error": "the poros arm did not leave a prepared model"}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        tmp = Path(tmp)
        streamed_state, streamed_files = _host_state(peft_model), _saved(peft_model, tmp / "poros")
        peft_model.unpatch()
        resident_state, resident_files = _host_state(peft_model), _saved(peft_model, tmp / "resident")
        edited = {key: (value * 2 if ".lora_A." in key else value / 2 if key.endswith("layers.0.input_layernorm.weight")
                        else value) for key, value in resident_state.items()}
        logits = {}
        for arm in ("resident", "poros"):
            if arm == "poros":
                peft_model.load_state_dict(resident_state, strict=False)  # back to the trained state first
                poros.prepare(peft_model)
            peft_model.load_state_dict(edited, strict=False)
            logits[arm] = peft_model(**batch).logits.float().cpu()
            peft_model.load_state_dict(resident_state, strict=False)
        peft_model.unpatch()
    return {"state_dict_equal": _same_bytes(resident_state, streamed_state),
            "files_equal": _same_bytes(resident_files, streamed_files), "tensors": len(resident_state),
            "load_state_dict_logits_equal": torch.equal(logits["resident"], logits["poros"])}


def _kernel_name(message: str) -> str:
    """``"cumsum_cuda_kernel does not have a deterministic implementation, but ..."`` -> ``cumsum_cuda_kernel``."""
    line = next(line for line in message.splitlines() if NONDETERMINISTIC_MARK in line)
    return line.split(NONDETERMINISTIC_MARK)[0].strip().removeprefix("RuntimeError:").strip()


def _error_text(report: dict[str, Any]) -> str:
    return "\n".join(arm.get("error") or "" for arm in report["arms"].values())


def gate_variant(variant: Variant, args, device: torch.device) -> dict[str, Any]:
    """Run one variant, label it, and diagnose a non-bitwise result."""
    experts = args.experts if variant.moe else None
    report = run_variant(variant, args, device, attn=args.attn, experts=experts)
    if args.deterministic and NONDETERMINISTIC_MARK in _error_text(report):
        # A kernel without a deterministic implementation: name it, then measure with warn_only.
        refused = _kernel_name(_error_text(report))
        with _warn_only():
            report = run_variant(variant, args, device, attn=args.attn, experts=experts)
        report["nondeterministic_kernels"] = sorted(set(report["nondeterministic_kernels"]) | {refused})
        report["warn_only"] = True
    comparison = report["comparison"]
    if comparison is None:
        report["label"] = "error"
        return report
    save_load = report.get("save_load")
    saves_equal = save_load is None or (save_load.get("state_dict_equal") and save_load.get("files_equal")
                                        and save_load.get("load_state_dict_logits_equal"))
    bitwise = comparison["bitwise"] and not report["nondeterministic_kernels"] and bool(saves_equal)
    report["label"] = "bitwise" if bitwise else "numerical"
    if not bitwise and not args.no_diagnose:
        with _warn_only() if report.get("warn_only") else contextlib.nullcontext():
            report["diagnosis"] = diagnose(variant, args, device, report)
    return report


@contextlib.contextmanager
def _warn_only():
    """Deterministic algorithms stay on, but a kernel without a deterministic version only warns."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True)


def diagnose(variant: Variant, args, device: torch.device, report: dict[str, Any]) -> dict[str, Any]:
    """Swap one kernel family at a time; the swap that makes the run bitwise names the culprit."""
    trials = []
    for attn in ("eager", "sdpa"):
        if attn != report["attn_implementation"]:
            trials.append(("attention", attn, dict(attn=attn, experts=report["experts_implementation"])))
    if variant.moe:
        current = report["experts_implementation"] or "grouped_mm"
        for experts in ("eager", "grouped_mm"):
            if experts != current:
                trials.append(("experts", experts, dict(attn=report["attn_implementation"], experts=experts)))
    results, culprit = [], []
    for kind, value, kwargs in trials:
        trial = run_variant(variant, args, device, **kwargs)
        comparison = trial["comparison"] or {}
        equal = bool(comparison.get("bitwise")) and not trial["nondeterministic_kernels"]
        error = _error_text(trial).strip()
        results.append({"swap": f"{kind}={value}", "bitwise": equal,
                        "max_diff_loss": comparison.get("max_diff_loss"),
                        "max_diff_adapter": comparison.get("max_diff_adapter"),
                        "nondeterministic_kernels": trial["nondeterministic_kernels"],
                        "error": error.splitlines()[0] if error else None})
        if equal:
            current = report["attn_implementation"] if kind == "attention" else report["experts_implementation"]
            culprit.append(f"{kind} implementation {current or 'default'} (bitwise with {value})")
    named = culprit or report["nondeterministic_kernels"] or ["not isolated by the attention/experts swaps"]
    return {"trials": results, "kernel": "; ".join(named)}


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------
def validation_record(report: dict[str, Any], env: dict[str, Any], args) -> dict[str, Any] | None:
    """The registry record (``poros/records.py`` schema) of a labelled variant; ``None`` for an error."""
    if report["label"] not in ("bitwise", "numerical"):
        return None
    comparison = report["comparison"]
    record = {
        "platform": env["platform"], "platform_class": env["platform_class"],
        "torch": env["torch"], "transformers": env["transformers"], "peft": env["peft"],
        "bitsandbytes": env["bitsandbytes"], "date": env["date"], "commit": env["commit"],
        "label": report["label"], "adapter": "lora",
        "max_diff_loss": comparison["max_diff_loss"], "max_diff_adapter": comparison["max_diff_adapter"],
        "max_diff_optimizer": comparison["max_diff_optimizer"],
        "source": "tools/checks/parity_gate.py",
        "variant": report["variant"],
        "shape": (f"{report['layers']} layers at {report['width_of']} width ({report['hidden_size']}), "
                  f"seq {args.seq}, batch {args.batch} (one row left-padded by {args.pad}), {args.steps} AdamW steps"),
        "deterministic": args.deterministic,
        "attn_implementation": report["attn_implementation"],
    }
    if getattr(args, "autocast", "none") != "none":
        record["autocast"] = getattr(args, "autocast", "none")
    if getattr(args, "save_load", False):
        record["save_load"] = "checked"
    if report.get("liger"):
        record["kernels"] = "liger"
    if report["experts_implementation"]:
        record["experts_implementation"] = report["experts_implementation"]
    if report["label"] == "numerical":
        record["kernel"] = (report.get("diagnosis") or {}).get("kernel") or "; ".join(report["nondeterministic_kernels"])
        if comparison["bitwise"]:
            record["note"] = ("equal in this run, but torch has no deterministic implementation of "
                              + ", ".join(report["nondeterministic_kernels"]))
    return record


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return value  # floats that JSON carried as strings
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


def toml_table(record: dict[str, Any]) -> str:
    lines = ["[[validation]]"]
    lines += [f"{key} = {toml_value(value)}" for key, value in record.items() if value is not None]
    return "\n".join(lines) + "\n"


def append_records(registry_dir: Path, records: list[tuple[str, dict[str, Any]]]) -> list[Path]:
    """Append each ``(family, record)`` as a ``[[validation]]`` table to ``<family>.toml``.

    Raises:
        RuntimeError: the family file is missing, or would not parse after the append (undone).
    """
    written = []
    for family, record in records:
        path = registry_dir / f"{family}.toml"
        if not path.exists():
            raise RuntimeError(f"{path} does not exist; the registry has no file for family {family!r}. "
                               "Pass --registry-dir pointing at the folder with the family TOML files.")
        before = path.read_text()
        separator = "" if before.endswith("\n") else "\n"
        path.write_text(before + separator + "\n" + toml_table(record))
        try:
            tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            path.write_text(before)
            raise RuntimeError(f"appending to {path} gave invalid TOML ({exc}); the file was restored.") from exc
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    names = [v.name for v in VARIANTS]
    parser = argparse.ArgumentParser(
        description="GPU parity gate: resident vs streamed, torch.equal on losses, LoRA and AdamW state.",
        epilog="variants: " + ", ".join(f"{v.name} ({v.shape} width)" for v in VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="width-64 shapes (CPU smoke test)")
    parser.add_argument("--only", help="comma list of variants: " + ", ".join(names))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, help="default 256 (72 with --tiny: past Gated DeltaNet's 64-token chunk)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--pad", type=int, help="left padding of the last row (default seq // 8)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument("--targets", default="all-linear", help="LoRA target_modules: all-linear or a comma list")
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--experts", default="grouped_mm", choices=("grouped_mm", "eager"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--autocast", default="none", choices=("none", "bf16", "fp16"),
                        help="run both arms under torch.autocast with this dtype (TrainingArguments(bf16=True))")
    parser.add_argument("--autocast-region", default="forward", choices=("forward", "run"),
                        help="forward: autocast around each forward (a layer-major step's forward_backward), "
                             "backward outside, as HF Trainer does; run: one region around both arms and "
                             "every step (torch then reuses step 1's casts of the LoRA weights in later "
                             "steps: the stale reference the 2026-12-01 autocast graphs gate compared with)")
    parser.add_argument("--save-load", action="store_true",
                        help="also check state_dict / save_pretrained / load_state_dict of the streamed model")
    parser.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                        help="leave deterministic algorithms off (the result can then only be 'numerical' evidence)")
    parser.add_argument("--no-diagnose", action="store_true", help="skip the kernel-swap reruns")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--schedule", default="micro-major", choices=("micro-major", "layer-major"))
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the streamed arm replays its block phases from CUDA graphs (issue 18's gate)")
    parser.add_argument("--liger", action="store_true",
                        help="apply liger-kernel's kernels to the model before both arms (poros.dropin.kernels."
                             "apply_liger: RMSNorm, RoPE, SwiGLU/GeGLU, fused linear cross-entropy); CUDA only")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: 1 with --tiny on CPU)")
    parser.add_argument("--commit", help="commit to record (default: git, or $POROS_COMMIT)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--append-registry", action="store_true",
                        help="append one [[validation]] table per labelled variant to <registry-dir>/<family>.toml")
    parser.add_argument("--registry-dir", type=Path, default=REPO_ROOT / "registry")
    args = parser.parse_args(argv)
    args.variants = [v for v in VARIANTS if args.only is None or v.name in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(names) if args.only else set()
    if unknown or not args.variants:
        parser.error(f"--only {args.only}: unknown {sorted(unknown)}; variants are {', '.join(names)}")
    if args.threads is None and args.tiny and args.device == "cpu":
        args.threads = 1
    if args.seq is None:
        args.seq = 72 if args.tiny else 256
    if args.pad is None:
        args.pad = args.seq // 8
    if args.targets != "all-linear":
        args.targets = tuple(args.targets.split(","))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device, env = start_tool(args)
    print(f"parity gate on {environment_line(env)} | deterministic {args.deterministic}")
    header = f"{'variant':<12}{'family':<9}{'width':>7}{'label':>11}{'max|dloss|':>12}{'max|dLoRA|':>12}" \
             f"{'max|dAdamW|':>13}{'LoRA':>6}  note"
    print(header)
    print("-" * len(header))
    reports, records = [], []
    for variant in args.variants:
        report = gate_variant(variant, args, device)
        reports.append(report)
        comparison = report["comparison"] or {}
        note = (report.get("diagnosis") or {}).get("kernel") or "; ".join(report["nondeterministic_kernels"])
        if report["label"] == "error":
            note = _error_text(report).strip().splitlines()[0] if _error_text(report).strip() else "an arm failed"
        print(f"{variant.name:<12}{report['family']:<9}{report['hidden_size']:>7}{report['label']:>11}"
              f"{str(comparison.get('max_diff_loss', '-')):>12}{str(comparison.get('max_diff_adapter', '-')):>12}"
              f"{str(comparison.get('max_diff_optimizer', '-')):>13}{comparison.get('adapter_tensors', '-'):>6}  {note}")
        record = validation_record(report, env, args)
        if record is not None:
            records.append((report["family"], record))
    output = {
        "tool": "tools/checks/parity_gate.py", "environment": env,
        "config": {"tiny": args.tiny, "layers": args.layers, "seq": args.seq, "batch": args.batch, "pad": args.pad,
                   "steps": args.steps, "lr": args.lr, "lora": {"rank": args.rank, "alpha": args.alpha,
                                                                "targets": args.targets},
                   "attn_implementation": args.attn, "experts_implementation": args.experts,
                   "deterministic": args.deterministic, "seed": args.seed, "autocast": args.autocast,
                   "autocast_region": args.autocast_region,
                   "save_load": args.save_load},
        "variants": reports,
        "records": [{"family": family, **record} for family, record in records],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(output, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.append_registry:
        for path in append_records(args.registry_dir, records):
            print(f"appended a [[validation]] record to {path}")
    return 0 if all(r["label"] == "bitwise" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

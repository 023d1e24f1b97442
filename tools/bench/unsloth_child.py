"""The Unsloth arm's child process (started by :mod:`tools.bench.unsloth_arm`, under Unsloth's own packages):
``FastLanguageModel`` QLoRA on the bench's bnb-4bit checkpoint, trained by TRL's ``SFTTrainer`` on the
bench's rows with the bench's ``SFTConfig``; writes its JSON (always, an error included).

    python -m tools.bench.unsloth_child SPEC.json OUT.json

SPEC (written by the parent): ``checkpoint`` (the directory), ``setup``
(:class:`tools.bench.trainer_common.TrainerSetup` fields), ``rows`` (token id lists, in order), ``lora``
(``rank``, ``alpha``, ``targets``), ``gradient_checkpointing`` (``"unsloth"``, ``"true"`` or
``"false"``) and ``deterministic`` (``torch.use_deterministic_algorithms(True, warn_only=True)``). OUT: ``status`` (``ok`` / ``oom`` / ``error``), ``error``,
``losses`` and ``grad_norms`` (as the Trainer logged them), ``step_times_s`` (per optimizer step,
:class:`tools.bench.trainer_common.StepClock`), ``peak_allocated_gb`` / ``peak_reserved_gb`` over the steps,
``allocated_before_gb``, ``load_s`` / ``peft_s`` / ``trainer_s``, ``trainable_parameters``, the
``device`` and the ``versions`` of the packages that ran.

Imports Unsloth first (it patches transformers, TRL and PEFT on import, and asks to be first), then
only torch, transformers, TRL, datasets and :mod:`tools.bench.trainer_common`: never Poros.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

PACKAGES = ("unsloth", "unsloth_zoo", "torch", "transformers", "trl", "peft", "bitsandbytes", "datasets",
            "accelerate", "triton", "xformers", "torchao")


def versions() -> dict[str, str | None]:
    """Installed version of each of :data:`PACKAGES` (None: not installed) and where transformers came from."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    transformers = sys.modules.get("transformers")
    out["transformers_path"] = getattr(transformers, "__file__", None)
    return out


def train(spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Load, add LoRA, train; fills ``out`` as it goes (a failure keeps what was measured)."""
    if spec.get("deterministic"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    began = time.perf_counter()
    from unsloth import FastLanguageModel  # first: Unsloth patches the libraries below on import

    import torch
    import trl

    from tools.bench.trainer_common import (StepClock, TrainerSetup, logged_grad_norms, logged_losses, sft_config_arguments,
                                      sft_dataset)

    out["import_s"] = round(time.perf_counter() - began, 2)
    if spec.get("deterministic"):  # warn_only: an op of Unsloth's without a deterministic kernel must not end the arm
        torch.use_deterministic_algorithms(True, warn_only=True)
    setup = TrainerSetup(**spec["setup"])
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    model, tokenizer = FastLanguageModel.from_pretrained(
        spec["checkpoint"], max_seq_length=setup.seq, dtype=torch.bfloat16, load_in_4bit=True)
    out["load_s"] = round(time.perf_counter() - started, 2)
    if torch.cuda.is_available():
        out["allocated_after_load_gb"] = round(torch.cuda.memory_allocated() / 1e9, 4)
    started = time.perf_counter()
    checkpointing = {"unsloth": "unsloth", "true": True, "false": False}[spec["gradient_checkpointing"]]
    lora = spec["lora"]
    model = FastLanguageModel.get_peft_model(
        model, r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0, bias="none",
        target_modules=list(lora["targets"]), use_gradient_checkpointing=checkpointing, random_state=setup.seed,
        max_seq_length=setup.seq)
    out["peft_s"] = round(time.perf_counter() - started, 2)
    out["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    clock = StepClock(torch.device("cuda", 0) if torch.cuda.is_available() else setup.device)
    started = time.perf_counter()
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**sft_config_arguments(setup)),
                             train_dataset=sft_dataset(spec["rows"]), processing_class=tokenizer, callbacks=[clock])
    out["trainer_s"] = round(time.perf_counter() - started, 2)
    try:
        trainer.train()
    finally:
        out["step_times_s"] = [round(t, 6) for t in clock.step_times]
        out.update(clock.memory())
        out["allocator_per_step"] = clock.allocator(setup.warmup)
    out["losses"] = logged_losses(trainer)
    out["grad_norms"] = logged_grad_norms(trainer)
    out["status"] = "ok"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tools.bench.unsloth_child SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec, target = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    out: dict[str, Any] = {"status": "error", "error": None}
    try:
        train(spec, out)
    except Exception as exc:  # noqa: BLE001 - the parent reads the reason from the JSON
        oom = type(exc).__name__ == "OutOfMemoryError"
        out["status"] = "oom" if oom else "error"
        out["error"] = f"{type(exc).__name__}: {exc}" + ("" if oom else f"\n{traceback.format_exc()}")
    out["versions"] = versions()
    target.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if out["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())

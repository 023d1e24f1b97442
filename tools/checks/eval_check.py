#!/usr/bin/env python3
"""Evaluation on the device: a run with evaluation is bit for bit the run without, and eval_loss is the
resident PEFT model's on the same batches.

    python3 -m tools.checks.eval_check --device cuda --json out/eval.json              # every family
    tools/gpu_run.sh eval                                                        # the same, from gpu_run
    DEVICE=cpu tools/gpu_run.sh eval:families=qwen3                              # a dry run here

Per family (a tiny sharded checkpoint with the bundled tokenizer, the bundled chat data):

* ``trajectory``: PorosTrainer trained 3 steps (batch 2, grad_accum 2) twice, once evaluating after
  every step on 8 batches of the chat data, once not; losses, every LoRA tensor, every AdamW state
  tensor and the torch RNG states (CPU and device) compared with ``torch.equal``; with
  ``lora_dropout`` 0 (layer-major) and 0.1 (micro-major, masks drawn from the device RNG).
* ``resident``: the trained adapter copied into a resident HF + bitsandbytes + PEFT model on the
  same device; its eval loss over the same batches (the formula of ``poros.training.evaluation``) against
  ``PorosTrainer.evaluate`` with ``torch.equal``.

Exit status 1 when any comparison differs. The JSON carries the device, versions, date and commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tools.bench.provenance import start_tool

FAMILIES = ("qwen2", "qwen3", "qwen3_5", "gemma3", "gemma4")
SETTINGS = dict(steps=3, seq_len=64, batch_size=2, grad_accum=2, lr=2e-2, logging_steps=1, seed=11)


def training_state(trainer, result) -> dict[str, Any]:
    named = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    device = next(iter(named.values())).device
    return {
        "losses": result.losses,
        "adapters": {name: p.detach().clone() for name, p in named.items()},
        "optimizer": {name: {k: v.clone() for k, v in trainer.optimizer.state[p].items()} for name, p in named.items()},
        "rng": [torch.get_rng_state()] + ([torch.cuda.get_rng_state(device)] if device.type == "cuda" else []),
    }


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    found = [] if actual["losses"] == expected["losses"] else ["losses"]
    for name, tensor in actual["adapters"].items():
        if not torch.equal(tensor, expected["adapters"][name]):
            found.append(name)
        found += [f"AdamW {key} of {name}" for key, value in actual["optimizer"][name].items()
                  if not torch.equal(value, expected["optimizer"][name][key])]
    found += [f"rng {index}" for index, (a, b) in enumerate(zip(actual["rng"], expected["rng"])) if not torch.equal(a, b)]
    return found


def check_family(family: str, device: torch.device, work: Path) -> dict[str, Any]:
    import peft
    import transformers

    from poros.assets import asset_path
    from poros.testing import all_linear_targets, save_tiny_checkpoint
    from poros.training.trainer import PorosTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(asset_path("poros-tiny-qwen3"))
    checkpoint = save_tiny_checkpoint(work / family, family, seed=5, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(checkpoint)
    chat = str(asset_path("poros-tiny-chat"))
    report: dict[str, Any] = {"trajectory": {}}
    trained = None
    for dropout in (0.0, 0.1):
        states = {}
        for arm, extra in {"plain": {}, "eval": {"eval_dataset": chat, "eval_steps": 1, "eval_batches": 8}}.items():
            trainer = PorosTrainer.from_pretrained(checkpoint, lora_rank=4, lora_alpha=8, lora_dropout=dropout, seed=11,
                                                   device=str(device), output_dir=str(work / f"{family}-{dropout}-{arm}"))
            result = trainer.train(chat, **SETTINGS, **extra)
            states[arm] = training_state(trainer, result)
            if arm == "eval" and dropout == 0.0:
                trained = trainer
        different = differences(states["plain"], states["eval"])
        report["trajectory"][f"lora_dropout={dropout}"] = {"bitwise": not different, "differs": different[:5]}

    # the resident reference, with the trained adapter copied in
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=quantization,
                                                             device_map={"": str(device)}, dtype=torch.bfloat16)
    torch.manual_seed(11)
    reference = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                          target_modules=all_linear_targets(base)))
    reference.train()  # dropout 0; bitsandbytes' 4-bit linears in training mode, as poros.training.evaluation runs them
    poros_adapters = {name: p for name, p in trained.model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(poros_adapters[name])
        batches = [{k: v.to(device) for k, v in b.items()} for b in trained.eval_set.batches[:8]]
        items = sum((b["labels"][..., 1:] != -100).sum() for b in batches)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for b in batches:
            total = total + reference(**b, num_items_in_batch=items, use_cache=False).loss
    expected = float(total)
    actual = trained.evaluate(max_batches=8)["eval_loss"]
    report["resident"] = {"eval_loss_poros": actual, "eval_loss_resident": expected, "bitwise": actual == expected}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all five)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--commit", help="commit to record (default: git, or $POROS_COMMIT)")
    args = parser.parse_args(argv)
    args.deterministic = args.device.startswith("cuda")  # as PorosTrainer (deterministic=True) sets it on CUDA
    device, environment = start_tool(args)
    report: dict[str, Any] = {"tool": "eval_check", "environment": environment, "settings": SETTINGS, "families": {}}
    with tempfile.TemporaryDirectory() as work:
        for family in args.families.split(","):
            report["families"][family] = check_family(family, device, Path(work))
            print(family, json.dumps(report["families"][family]), flush=True)
    ok = all(arm["bitwise"] for family in report["families"].values()
             for arm in [*family["trajectory"].values(), family["resident"]])
    report["all_bitwise"] = ok
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print("eval_check:", "every comparison bitwise" if ok else "DIFFERENCES (see the report)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""NF4 experts against bf16 experts on the same random-weight MoE model: what quantizing the experts costs.

Per MoE family, one checkpoint (random weights, the tiny shape widened to 16 experts; real widths do not fit a
CPU run) loaded twice as the trainer loads it (NF4 linears, LoRA on every linear and on the experts), once with
bf16 experts and once with :func:`poros.quantize_experts`; reported: the mean per-token KL divergence of the NF4
model's next-token distribution from the bf16 one's, their top-1 agreement, and the loss of each after N AdamW
steps on the same batches. Writes one JSON (``--json``); the table in docs/architecture-support.md is its rows.

    python -m tools.moe_quant_error --json registry/results/cpu-2026-12-03/moe-quant-error.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import peft
import torch

FAMILIES = (("qwen3_5_moe", "default"), ("gemma4", "moe"))
SHAPE = {"num_experts": 16, "moe_intermediate_size": 128, "num_layers": 4}


def load(path, nf4: bool):
    import transformers

    import poros
    from poros.loading.experts import EXPERT_PARAMETERS
    from poros.testing import all_linear_targets

    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization,
                                                              device_map={"": "cpu"}, dtype=torch.bfloat16)
    if nf4:
        poros.quantize_experts(model)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=all_linear_targets(model),
                             target_parameters=EXPERT_PARAMETERS)
    return peft.get_peft_model(model, config).train()


def measure(family: str, variant: str, steps: int, seed: int) -> dict:
    from poros.testing import save_tiny_checkpoint

    with tempfile.TemporaryDirectory() as directory:
        path = save_tiny_checkpoint(pathlib.Path(directory) / "ckpt", family, variant, seed=seed, **SHAPE)
        models = {"bf16": load(path, False), "nf4": load(path, True)}
        vocab = models["bf16"].config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(seed)
        batches = [torch.randint(0, vocab, (2, 32), generator=generator) for _ in range(steps + 1)]
        with torch.no_grad():
            logits = {k: m(input_ids=batches[-1], use_cache=False).logits.float() for k, m in models.items()}
        reference, quantized = logits["bf16"].log_softmax(-1), logits["nf4"].log_softmax(-1)
        kl = (reference.exp() * (reference - quantized)).sum(-1).mean()
        top1 = (logits["bf16"].argmax(-1) == logits["nf4"].argmax(-1)).float().mean()
        losses = {}
        for name, model in models.items():
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
            for ids in batches[:-1]:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses[name] = float(loss.detach())
    config = models["bf16"].config.get_text_config()
    return {"family": family, "variant": variant, "shape": {**SHAPE, "hidden_size": config.hidden_size},
            "weights": "random", "logit_kl": float(kl), "top1_agreement": float(top1), "steps": steps,
            "loss_bf16_experts": losses["bf16"], "loss_nf4_experts": losses["nf4"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = [measure(family, variant, args.steps, args.seed) for family, variant in FAMILIES]
    out = pathlib.Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"tool": "tools/moe_quant_error.py", "device": "cpu", "rows": rows}, indent=2) + "\n")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

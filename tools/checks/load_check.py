#!/usr/bin/env python3
"""Check poros.loading.load's device path: NF4 quantized on the device, blocks on the host, bitwise training.

Writes a sharded checkpoint (random weights, real transformers class), then in one process:

* reference: ``from_pretrained(..., BitsAndBytesConfig(nf4), device_map={"": device})`` + PEFT LoRA,
  trained resident for ``--steps`` AdamW steps;
* poros: ``poros.loading.load.load_pretrained(..., device=device)`` + the same PEFT LoRA +
  ``adapters_to_device`` + ``poros.prepare``, trained on the same batches.

Reports peak device memory of each load, where the loaded tensors live, whether every block tensor
is byte-identical to the reference's (quantized on the same device), and the parity of losses,
LoRA tensors and AdamW state. JSON with ``--json``.

    python -m tools.checks.load_check --family qwen3 --layers 8 --hidden 2048 --json out/load.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch


GB = 1024**3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--commit")
    args = parser.parse_args(argv)

    import peft
    import transformers

    import poros
    from tools.bench.arms import ArmResult, optimizer_snapshot, parity, snapshot, trainable
    from tools.bench.models import make_batches
    from tools.bench.provenance import configure_determinism, environment
    from poros.loading.load import adapters_to_device, load_pretrained
    from poros.testing import save_tiny_checkpoint

    configure_determinism(True)
    device = torch.device(args.device)
    heads = max(2, args.hidden // 128)
    directory = pathlib.Path(tempfile.mkdtemp())
    path = save_tiny_checkpoint(directory / "ckpt", args.family, seed=0, num_layers=args.layers,
                                hidden_size=args.hidden, num_heads=heads, num_kv_heads=max(1, heads // 4),
                                head_dim=128, intermediate_size=args.hidden * 3, max_shard_size="200MB")
    config = transformers.AutoConfig.from_pretrained(path)
    batches = make_batches(config.get_text_config(), count=args.steps, batch=1, seq=args.seq, seed=1)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def peak_load(load):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        model = load()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
        return model, seconds, peak

    def train(model, call):
        named = trainable(model)
        optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-3)
        result = ArmResult("arm")
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            loss = call(**batch, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            result.losses.append(loss.detach().cpu())
        result.adapter, result.optimizer = snapshot(named), optimizer_snapshot(optimizer, named)
        return result

    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_compute_dtype=torch.bfloat16)
    reference, ref_seconds, ref_peak = peak_load(lambda: transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, device_map={"": str(device)}, dtype=torch.bfloat16))
    loaded, load_seconds, load_peak = peak_load(lambda: load_pretrained(path, device=device, load_tokenizer=False))
    model = loaded.model
    layers = model.get_submodule(loaded.descriptor.decoder_layers)
    block_devices = sorted({t.device.type for layer in layers for t in [*layer.parameters(), *layer.buffers()]})
    other_devices = sorted({p.device.type for name, p in model.named_parameters()
                            if not name.startswith(loaded.descriptor.decoder_layers + ".")})
    ref_state = reference.state_dict()
    block_keys = [k for k in model.state_dict() if k.startswith(loaded.descriptor.decoder_layers + ".")]
    same_bytes = all(torch.equal(model.state_dict()[k].cpu(), ref_state[k].cpu()) for k in block_keys)

    torch.manual_seed(0)
    reference = peft.get_peft_model(reference, lora)
    ref_result = train(reference, reference)
    del reference
    torch.cuda.empty_cache() if device.type == "cuda" else None

    torch.manual_seed(0)
    peft_model = peft.get_peft_model(model, lora)
    moved = adapters_to_device(peft_model, device)
    streamed = poros.prepare(peft_model)
    poros_result = train(peft_model, streamed)

    report = {
        "tool": "tools/checks/load_check.py",
        "environment": environment(device, args.commit),
        "config": {"family": args.family, "layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                   "steps": args.steps, "deterministic": True},
        "checkpoint_bytes": sum(f.stat().st_size for f in path.glob("*.safetensors")),
        "reference_load": {"seconds": round(ref_seconds, 3), "peak_allocated_gb": ref_peak},
        "poros_load": {"seconds": round(load_seconds, 3), "peak_allocated_gb": load_peak,
                       "block_tensor_devices": block_devices, "other_parameter_devices": other_devices,
                       "block_tensors_equal_reference": same_bytes, "adapters_moved_to_device": moved},
        "parity": parity(ref_result, poros_result),
    }
    print(json.dumps(report, indent=2, default=str))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    ok = same_bytes and block_devices == ["cpu"] and report["parity"]["bitwise"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

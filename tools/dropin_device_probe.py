"""Where each tensor of a ``poros.from_pretrained`` drop-in sits, step by step, on a real device.

The HF Trainer drop-in through ``poros.from_pretrained`` failed on CUDA with the embedding's input ids
on the host (registry/results/h200-2026-12-01/prequant-*-dropin-*.json) while the CPU tests pass (on
the CPU every device is the host). This probe builds a tiny Qwen2, saves it as a bnb-4bit checkpoint
the way transformers does, loads it through ``poros.from_pretrained``, and reports the devices of the
modules outside the blocks after each stage (loaded, PEFT, prepared, Trainer built, first forward),
then trains two Trainer steps (bf16 on CUDA) and says whether they ran::

    python3 -m tools.dropin_device_probe --device cuda --json out/dropin-device-probe.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import traceback
from pathlib import Path

import torch


def where(model: torch.nn.Module, layers_prefix: str) -> dict[str, list[str]]:
    """Device of every parameter and buffer outside the decoder blocks, grouped by device."""
    places: dict[str, list[str]] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if f"{layers_prefix}." in name:
            continue
        places.setdefault(str(tensor.device), []).append(name)
    return places


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import peft
    import transformers

    import poros
    from poros.testing.models import Rows

    device = torch.device(args.device)
    report: dict = {"device": str(device), "stages": {}}
    work = Path(tempfile.mkdtemp(prefix="poros-probe-"))
    config = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(work / "bf16")
    bnb = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    transformers.AutoModelForCausalLM.from_pretrained(work / "bf16", quantization_config=bnb, dtype=torch.bfloat16,
                                                      device_map={"": str(device)}).save_pretrained(work / "bnb")
    stage = report["stages"]
    try:
        model = poros.from_pretrained(work / "bnb", dtype=torch.bfloat16, device_map={"": str(device)})
        stage["loaded"] = where(model, "model.layers")
        report["hf_device_map"] = getattr(model, "hf_device_map", None)
        report["is_loaded_in_4bit"] = getattr(model, "is_loaded_in_4bit", None)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                                                           target_modules=["q_proj", "v_proj"]))
        stage["peft"] = where(model, "model.layers")
        poros.prepare(model)
        stage["prepared"] = where(model, "model.layers")
        report["model_device"] = str(model.device)
        report["store_device"] = str(model.store.device)
        report["host_tables"] = len(model.host_tables)
        table = model.get_input_embeddings()
        seen: list[dict] = []
        table.register_forward_pre_hook(lambda module, inputs: seen.append(
            {"ids": str(inputs[0].device), "weight": str(module.weight.device)}) or None, prepend=True)
        rows = Rows([{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, 512, (8, 64))])
        training = transformers.TrainingArguments(
            output_dir=str(work / "run"), max_steps=2, per_device_train_batch_size=1, gradient_accumulation_steps=2,
            learning_rate=1e-4, report_to=[], save_strategy="no", logging_steps=1, bf16=device.type == "cuda",
            use_cpu=device.type == "cpu", dataloader_num_workers=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=training, train_dataset=rows)
        stage["trainer_built"] = where(model, "model.layers")
        report["args_device"] = str(training.device)
        report["place_model_on_device"] = trainer.place_model_on_device
        try:
            trainer.train()
            report["trained"] = True
            report["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        except Exception:  # noqa: BLE001 - the probe reports what failed
            report["trained"] = False
            report["error"] = traceback.format_exc()[-4000:]
        stage["after_train"] = where(model, "model.layers")
        report["first_lookups"] = seen[:4]
    except Exception:  # noqa: BLE001
        report["error"] = traceback.format_exc()[-4000:]
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

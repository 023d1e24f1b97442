"""LoRA on MoE experts out of training: ``poros merge`` merges it into the fused expert tensors (as the checkpoint
lays them out: fused on disk for Gemma 4, one matrix per expert for Qwen3.5 MoE), equal to merging by hand in
fp32 then casting; ``poros merge --format gguf`` writes the experts as llama.cpp's converter lays them out, read
back tensor by tensor with gguf's ``GGUFReader``."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from poros.export.merge import merge_adapter
from poros.loading.experts import EXPERT_PARAMETERS, experts_modules
from poros.testing import save_tiny_checkpoint

MOE = [("qwen3_5_moe", "default"), ("gemma4", "moe")]
IDS = [f"{f}-{v}" for f, v in MOE]


def expert_adapter(path, directory):
    """A bf16 model with LoRA on q_proj and on both fused expert tensors, every LoRA tensor random, saved; returns
    ``{experts path: {tensor: (A [E, r, in], B [E, out, r], scaling)}}`` in fp32 (PEFT's layout read by hand)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):
            if parameter.requires_grad:  # the LoRA tensors
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    factors = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            experts = module.num_experts
            a = module.lora_A["default"].weight.detach().float()
            b = module.lora_B["default"].weight.detach().float()
            path = name.removeprefix("base_model.model.").replace(".base_layer", "")
            factors.setdefault(path, {})[module.parameter_name] = (
                a.view(experts, -1, a.shape[1]), b.view(b.shape[0], -1, experts).permute(2, 0, 1),
                module.scaling["default"])
    model.save_pretrained(directory)
    return factors


@pytest.mark.parametrize(("family", "variant"), MOE, ids=IDS)
def test_merge_puts_expert_lora_into_the_fused_experts_as_fp32_then_cast(family, variant, tmp_path):
    path = save_tiny_checkpoint(tmp_path / "ckpt", family, variant, seed=2, num_layers=2)
    factors = expert_adapter(path, tmp_path / "adapter")
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", model=path, progress=None)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    merged_experts = dict(experts_modules(merged))
    assert len(factors) == 2 and set(factors) == {name for name, _ in experts_modules(base)}
    for name, module in experts_modules(base):
        for tensor, (a, b, scaling) in factors[name].items():
            weight = getattr(module, tensor).detach()
            by_hand = torch.stack([weight[e].float() + scaling * (b[e] @ a[e]) for e in range(weight.shape[0])])
            got = getattr(merged_experts[name], tensor).detach()
            assert not torch.equal(got, weight)
            assert torch.equal(got, by_hand.to(torch.bfloat16)), (name, tensor)


def test_an_adapter_trained_on_nf4_experts_is_peft_s_bf16_layout_and_merges(tmp_path):
    """LoRA on NF4 experts saves what PEFT saves for LoRA on bf16 experts (the same keys and shapes), so the
    adapter loads on the bf16 model and poros merge writes it into the experts."""
    from safetensors.torch import load_file
    from test_moe import FIXED, load

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_moe", seed=2, num_layers=2)
    trained = load(path, FIXED, "nf4+lora")  # quantize_experts, then PEFT's target_parameters; lora_B random
    trained.save_pretrained(tmp_path / "nf4-adapter")
    bf16 = load(path, FIXED, "lora")
    bf16.save_pretrained(tmp_path / "bf16-adapter")
    saved = load_file(tmp_path / "nf4-adapter" / "adapter_model.safetensors")
    reference = load_file(tmp_path / "bf16-adapter" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in reference.items()}
    assert any(".experts." in key for key in saved)
    merge_adapter(tmp_path / "nf4-adapter", tmp_path / "merged", model=path, progress=None)
    base = dict(experts_modules(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)))
    merged = dict(experts_modules(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                                    dtype=torch.bfloat16)))
    assert all(not torch.equal(getattr(merged[n], t), getattr(base[n], t)) for n in base for t in
               ("gate_up_proj", "down_proj"))

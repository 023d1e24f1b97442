"""The model and the batches every arm runs: random weights at a real shape, LoRA, random tokens.

:func:`build_model` builds the way ``from_pretrained(..., quantization_config=BitsAndBytesConfig(nf4))``
builds a model, minus the checkpoint: the skeleton on the meta device under the model's own dtype
context, ``replace_with_bnb_linear`` through transformers' bitsandbytes quantizer (so exactly the
modules transformers would quantize become ``Linear4bit``; ``lm_head`` does not), then module by
module on the device: a seeded random bf16 weight -> ``bnb.nn.Params4bit(...).to(device)`` (that call
quantizes, as in transformers' ``Bnb4bitQuantize``); every other tensor is allocated NaN-filled and
initialised by the model's own ``initialize_weights`` (norms, embeddings, and the non-persistent
buffers: rotary ``inv_freq``, Gemma's ``embed_scale``). The bf16 model never exists on the host, and
nothing is ``.to(bfloat16)``-ed afterwards (that would round the fp32 rotary buffers). A NaN left
anywhere fails the build. 1-D weights (norms, scalars) get a small seeded perturbation so that a
wrong norm offset cannot hide behind weights of exactly 1 or 0. The builder is
:func:`poros.doctor.probe.random_nf4_model`, shared with the planner's compute probe.
"""

from __future__ import annotations

from typing import Any

import torch

from poros.devices import resolve_device
from poros.doctor.probe import random_nf4_model

SEVEN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(config, device: str | torch.device, *, seed: int = 0, double_quant: bool = True,
                attn_implementation: str = "sdpa", experts_implementation: str | None = None,
                weight_std: float = 0.02, perturb: float = 0.05, quantize_experts: bool = False):
    """:func:`poros.doctor.probe.random_nf4_model` with the bench's defaults (bf16 compute, NF4, double
    quantization, SDPA): an HF ``*ForCausalLM`` with NF4 ``Linear4bit`` layers and random weights,
    built on ``device`` the way ``from_pretrained`` builds one; ``quantize_experts``: MoE experts in NF4
    (:func:`poros.quantize_experts`), built one experts module at a time, ``experts_implementation`` then
    ``"poros_nf4_grouped"`` / ``"poros_nf4"`` / None (grouped where grouped_mm computes)."""
    return random_nf4_model(config, resolve_device(device, with_index=True), seed=seed, double_quant=double_quant,
                            attn_implementation=attn_implementation, experts_implementation=experts_implementation,
                            weight_std=weight_std, perturb=perturb, quantize_experts=quantize_experts)


def add_lora(model, *, rank: int = 16, alpha: int = 32, targets: Any = SEVEN_PROJECTIONS,
             target_parameters: list[str] | None = None, gradient_checkpointing: bool = True):
    """PEFT LoRA on ``targets`` (dropout 0), HF gradient checkpointing (non-reentrant) on; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model

    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                      target_modules=list(targets) if not isinstance(targets, str) else targets,
                      target_parameters=target_parameters)
    peft_model = get_peft_model(model, lora)
    peft_model.train()  # never eval: bitsandbytes repacks weights in place in eval mode on CPU
    return peft_model


def make_batches(config, *, count: int, batch: int, seq: int, seed: int = 1, left_pad: int = 0) -> list[dict]:
    """``count`` random batches on the host; with ``left_pad`` the last row starts with that many pad tokens."""
    generator = torch.Generator().manual_seed(seed)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    batches = []
    for _ in range(count):
        input_ids = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        if left_pad:
            input_ids[-1, :left_pad] = pad
            attention_mask[-1, :left_pad] = 0
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches

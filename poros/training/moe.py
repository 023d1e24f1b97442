"""What a training run does and says about a MoE model (:mod:`poros.training.trainer`): the LoRA targets
``lora_on_experts`` adds on the fused experts (:func:`expert_lora_targets`) and the run's line about them
(:func:`expert_lora_line`), and the line about the router's aux loss (:func:`router_aux_line`).
"""

from __future__ import annotations

from typing import Any

from poros.config import PorosConfig
from poros.errors import ConfigError


def expert_lora_targets(model: Any, config: PorosConfig) -> list[str] | None:
    """PEFT's ``target_parameters`` for the run: the fused expert tensors of an MoE model with ``lora_on_experts``
    (NF4 or bf16 experts), else None.

    Raises:
        ConfigError: ``lora_on_experts`` with ``lora_dropout`` > 0 or ``use_dora`` (PEFT's LoRA on a parameter
            takes neither).
    """
    from poros.loading.experts import EXPERT_PARAMETERS, experts_modules

    if not config.lora_on_experts or not experts_modules(model):
        return None
    odd = [f"{name}={value}" for name, value in (("lora_dropout", config.lora_dropout),
                                                  ("use_dora", config.use_dora)) if value]
    if odd:
        raise ConfigError(f"lora_on_experts with {', '.join(odd)}: LoRA on the fused MoE experts (PEFT "
                          "target_parameters) takes no dropout and no DoRA; set lora_dropout: 0 and use_dora: false, "
                          "or lora_on_experts: false (--no-lora-on-experts).")
    return list(EXPERT_PARAMETERS)


def expert_lora_line(model: Any, config: PorosConfig) -> str:
    """The summary line of LoRA on an MoE model's experts: the rank per expert and the trainable values."""
    from poros.loading.experts import experts_modules

    modules = [m for _, m in experts_modules(model)]
    if not config.lora_on_experts:
        return (f"poros: MoE experts without LoRA (lora_on_experts=false): LoRA on the linears only; "
                f"{len(modules)} experts modules frozen")
    values = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name and ".lora_" in name)
    return (f"poros: LoRA on the MoE experts (lora_on_experts=true): rank {config.lora_rank} per expert on "
            f"experts.gate_up_proj and experts.down_proj, {modules[0].num_experts} experts x {len(modules)} "
            f"modules, {values / 1e6:.2f} M trainable values")


def router_aux_line(model_config: Any, requested: bool | None) -> str | None:
    """The line that says whether the loss adds an MoE router aux loss (``output_router_logits``); None for a
    model whose config has no ``router_aux_loss_coef`` (its causal LM adds none)."""
    coef = getattr(model_config, "router_aux_loss_coef", None)
    if coef is None:
        return None
    on = bool(getattr(model_config, "output_router_logits", False))
    source = "the model config's" if requested is None else "set"
    added = (f"the loss adds router_aux_loss_coef={coef} x the load-balancing loss" if on
             else "the loss is the LM loss alone")
    return (f"poros: MoE router aux loss {'on' if on else 'off'} (output_router_logits={str(on).lower()}, {source}): "
            f"{added}")


__all__ = ["expert_lora_line", "expert_lora_targets", "router_aux_line"]

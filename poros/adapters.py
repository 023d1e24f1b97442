"""PEFT adapters around an HF model: unwrapping the PEFT model (:func:`causal_lm_of`) and the LoRA
target names (:func:`lora_target_modules`, resolved through the family descriptor; :func:`lora_targets`,
the linears PEFT's name rule matches). The one home of PEFT's all-linear rule: the trainer, the
planner, the probe and :mod:`poros.testing` ask here."""

from __future__ import annotations

from torch import nn

from poros.descriptor import resolve_path
from poros.errors import ConfigError, DescriptorError


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The HF ``*ForCausalLM`` inside ``model``: a PEFT model's base model, else ``model`` itself."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def lora_target_modules(model: nn.Module, target_modules: str | list[str] | tuple[str, ...] = "all-linear"
                        ) -> list[str]:
    """PEFT ``target_modules`` for a Poros target spec, resolved through the family descriptor.

    Args:
        model: the HF causal LM (or a PEFT model around it).
        target_modules: ``"all-linear"``: the descriptor's ``lora_targets_all_linear`` plus the
            ``model_level_linears`` present on the model (PEFT's all-linear minus what the family
            excludes, e.g. Gemma 4's router); ``"default"``: ``lora_targets_default`` (the
            attention projections); or a list of leaf module names.

    Raises:
        UnknownArchitectureError: the model's family is not registered.
        ConfigError: a listed name matches no ``nn.Linear`` of the model; the message lists the
            linear leaf names the model has.
    """
    from poros import registry

    base = causal_lm_of(model)
    descriptor = registry.for_config(base.config)
    if target_modules == "all-linear":
        present = []
        for path in descriptor.model_level_linears:
            try:
                resolve_path(base, path)
            except DescriptorError:
                continue
            present.append(path)
        return [*descriptor.lora_targets_all_linear, *present]
    if target_modules == "default":
        return list(descriptor.lora_targets_default)
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    linear_names = [name for name, module in base.named_modules() if isinstance(module, nn.Linear)]
    unknown = [target for target in target_modules
               if not any(name == target or name.endswith(f".{target}") for name in linear_names)]
    if unknown:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in linear_names} - {"base_layer"})
        raise ConfigError(
            f"target_modules {unknown} match no nn.Linear of this {descriptor.name} model; expected leaf names "
            f"such as {leaves} (or 'all-linear' / 'default'). Fix the names in target_modules."
        )
    return list(target_modules)


def lora_targets(model: nn.Module, target_modules: str | list[str]) -> dict[str, nn.Linear]:
    """The linears a LoRA config would wrap, by name: the names :func:`lora_target_modules`
    gives PEFT, matched by PEFT's rule (a name equal to the module path or to its last components).

    Raises:
        ConfigError: a listed name matches no linear of the model.
    """
    names = lora_target_modules(model, target_modules)
    return {path: module for path, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(path == name or path.endswith("." + name) for name in names)}


__all__ = ["causal_lm_of", "lora_target_modules", "lora_targets"]

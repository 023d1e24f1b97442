"""The descriptor contract: :func:`check_descriptor` compares an
:class:`~poros.descriptor.ArchitectureDescriptor` with a real model of its family (every path
resolves, every layer kind and carried state is present, what the descriptor says is never
quantized is not, LoRA targets are linears...) and returns the problems;
:func:`assert_descriptor_matches` raises on any. Re-exported by :mod:`poros.testing`, the entry
point for plugin authors."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from poros.adapters import causal_lm_of
from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import DescriptorError

_PEFT_INTERNALS = frozenset({
    "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_dropout", "lora_magnitude_vector",
})


def _resolves(root: Any, path: str) -> bool:
    try:
        resolve_path(root, path)
    except DescriptorError:
        return False
    return True


def _layer_entries(layer: nn.Module) -> tuple[dict[str, nn.Module], set[str]]:
    """``(linears, paths)`` of one decoder layer, with PEFT wrapping taken out.

    ``linears``: layer-relative path -> ``nn.Linear`` (bitsandbytes ``Linear4bit`` is one);
    ``paths``: every module, parameter and buffer path. ``.base_layer`` is dropped from paths and
    LoRA's own modules (``lora_A``...) are skipped, so a PEFT-wrapped layer reads like the plain one.
    """
    linears: dict[str, nn.Module] = {}
    paths: set[str] = set()
    for name, module in layer.named_modules():
        parts = name.split(".") if name else []
        if _PEFT_INTERNALS.intersection(parts):
            continue
        clean = ".".join(p for p in parts if p != "base_layer")
        if clean:
            paths.add(clean)
        if isinstance(module, nn.Linear):
            linears[clean] = module
        for attribute, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            paths.add(f"{clean}.{attribute}" if clean else attribute)
    return linears, paths


def _is_linear(module: Any) -> bool:
    """An ``nn.Linear`` (bitsandbytes ``Linear4bit`` included), or a PEFT layer wrapping one."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)


def _matches(path: str, name: str) -> bool:
    """PEFT's rule: a target name matches a module path equal to it or ending in ``.name``."""
    return path == name or path.endswith("." + name)


def _is_quantized(obj: Any) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover - bitsandbytes is a [train] dependency
        return False
    return isinstance(obj, (bnb.nn.Linear4bit, bnb.nn.Params4bit))


def check_descriptor(descriptor: ArchitectureDescriptor, model: nn.Module) -> list[str]:
    """The descriptor contract: does ``descriptor`` describe ``model``? Returns the problems (empty: yes).

    ``model`` is the real ``*ForCausalLM``, plain or NF4-quantized, optionally PEFT-wrapped
    (unwrapped with ``get_base_model()``). Names that ``descriptor.optional_features`` switches
    off on this config must be absent; all other names must be present. Checks:

    * identity: ``type(model).__name__`` in ``causal_lm_classes``, ``config.model_type`` in
      ``model_types``, the config class is ``config_class`` (when set);
    * module paths (``text_model``, ``decoder_layers``, ``embeddings``, ``final_norm``, ``head``,
      ``rotary``, ``prelude_modules``, ``model_level_linears``) resolve; ``decoder_layers`` holds
      ``num_hidden_layers`` layers; ``embeddings`` is an ``nn.Embedding``, ``head`` and every
      model-level linear an ``nn.Linear``; every ``nn.Linear`` outside the layers other than the
      head is listed in ``model_level_linears``;
    * layer kinds: every value of ``config.<layer_kinds_attr>`` is in ``layer_kinds`` and has a
      ``mask_kinds`` entry naming a function of ``transformers.masking_utils``; a rotary module
      with per-kind buffers (``<kind>_inv_freq``) is described per kind, one with a single
      ``inv_freq`` by one ``rotary_kinds`` entry;
    * adapters: every name in ``lora_targets_all_linear``/``lora_targets_default``/``lora_excluded``
      is an ``nn.Linear``/``Linear4bit`` in at least one decoder layer; every such linear in a
      layer is a target or excluded (offenders reported by full name);
    * ``never_quantized`` entries exist in some layer (module, parameter or buffer path) and are
      not bitsandbytes 4-bit;
    * each ``CarriedState.kwarg`` is a parameter of the decoder layers' ``forward``;
    * config attributes named by ``final_logit_softcapping``, ``tied_embeddings`` and each
      ``CarriedState.enabled_by``/``optional_features`` entry exist on the config.

    Run it on a model that has every layer kind of the family and every optional feature on
    (:func:`tiny_config` builds such configs whenever ``num_layers`` allows): a name that only
    some layer kind has (Qwen3.5's ``in_proj_qkv`` lives in linear-attention layers) is reported
    missing on a model without that kind. A kind named in ``mask_kinds``/``rotary_kinds`` may be
    unused by one model (Qwen2 slides only with ``use_sliding_window``); that every kind is used by
    *some* configuration is a family-level check (see ``tests/test_descriptors.py``).
    """
    base = causal_lm_of(model)
    config = base.config
    disabled = descriptor.disabled_names(config)
    problems = _identity_problems(descriptor, base)
    problems += _config_attribute_problems(descriptor, config)
    resolved, unresolved = _resolve_module_paths(descriptor, base)
    problems += unresolved
    problems += _listed_path_problems(descriptor, base, disabled)
    problems += _module_type_problems(descriptor, config, resolved)
    layers = list(resolved["decoder_layers"]) if resolved.get("decoder_layers") is not None else []
    problems += _unlisted_linear_problems(descriptor, base)
    problems += _layer_kind_problems(descriptor, config)
    problems += _rotary_problems(descriptor, resolved.get("rotary"))
    problems += _carried_state_problems(descriptor, layers)
    absent_kinds = _absent_kinds_note(descriptor, config)
    layer_entries = [_layer_entries(layer) for layer in layers]
    problems += _untargeted_linear_problems(descriptor, layer_entries)
    problems += _lora_name_problems(descriptor, layer_entries, disabled, absent_kinds)
    problems += _never_quantized_problems(descriptor, layers, layer_entries, disabled, absent_kinds)
    return problems


def _present_although_disabled(field_name: str, name: str) -> str:
    return f"{field_name} entry {name!r} exists although optional_features marks it absent for this config"


def _identity_problems(descriptor: ArchitectureDescriptor, base: nn.Module) -> list[str]:
    """The model class, ``config.model_type`` and the config class are the descriptor's."""
    problems: list[str] = []
    config = base.config
    if type(base).__name__ not in descriptor.causal_lm_classes:
        problems.append(f"model class {type(base).__name__} is not in causal_lm_classes {list(descriptor.causal_lm_classes)}")
    if config.model_type not in descriptor.model_types:
        problems.append(f"config.model_type {config.model_type!r} is not in model_types {list(descriptor.model_types)}")
    if descriptor.config_class and type(config).__name__ != descriptor.config_class:
        problems.append(f"config class {type(config).__name__} is not config_class {descriptor.config_class!r}")
    return problems


def _config_attribute_problems(descriptor: ArchitectureDescriptor, config: Any) -> list[str]:
    """Every config attribute the descriptor names exists on ``config``."""
    named_attributes = [("final_logit_softcapping", descriptor.final_logit_softcapping),
                        ("tied_embeddings", descriptor.tied_embeddings),
                        ("layer_kinds_attr", descriptor.layer_kinds_attr)]
    named_attributes += [(f"carried_state[{c.kwarg!r}].enabled_by", c.enabled_by) for c in descriptor.carried_state]
    named_attributes += [("optional_features", attribute) for attribute, _ in descriptor.optional_features]
    return [f"{field_name} names config attribute {attribute!r}, which {type(config).__name__} lacks"
            for field_name, attribute in named_attributes if attribute and not hasattr(config, attribute)]


def _resolve_module_paths(descriptor: ArchitectureDescriptor, base: nn.Module) -> tuple[dict[str, Any], list[str]]:
    """``(resolved, problems)``: the single-module fields resolved on ``base`` (field name -> module), and
    one problem per path that does not resolve."""
    resolved: dict[str, Any] = {}
    problems: list[str] = []
    for field_name in ("text_model", "decoder_layers", "embeddings", "final_norm", "head", "rotary"):
        path = getattr(descriptor, field_name)
        try:
            resolved[field_name] = resolve_path(base, path)
        except DescriptorError as error:
            problems.append(f"{field_name}: {error}")
    return resolved, problems


def _listed_path_problems(descriptor: ArchitectureDescriptor, base: nn.Module, disabled: Any) -> list[str]:
    """Every ``prelude_modules``/``model_level_linears`` entry resolves unless switched off (then it must be
    absent); a model-level linear is an ``nn.Linear``."""
    problems: list[str] = []
    for field_name in ("prelude_modules", "model_level_linears"):
        for path in getattr(descriptor, field_name):
            present = _resolves(base, path)
            if path in disabled:
                if present:
                    problems.append(_present_although_disabled(field_name, path))
                continue
            try:
                target = resolve_path(base, path)
            except DescriptorError as error:
                problems.append(f"{field_name}: {error}")
                continue
            if field_name == "model_level_linears" and not _is_linear(target):
                problems.append(f"model_level_linears entry {path!r} is a {type(target).__name__}, not an nn.Linear")
    return problems


def _module_type_problems(descriptor: ArchitectureDescriptor, config: Any, resolved: dict[str, Any]) -> list[str]:
    """The embeddings are an ``nn.Embedding``, the head an ``nn.Linear``, the decoder layers as many as the
    config's (each checked only where its path resolved)."""
    problems: list[str] = []
    if "embeddings" in resolved and not isinstance(resolved["embeddings"], nn.Embedding):
        problems.append(f"embeddings {descriptor.embeddings!r} is a {type(resolved['embeddings']).__name__}, "
                        "not an nn.Embedding")
    head = resolved.get("head")
    if head is not None and not _is_linear(head):
        problems.append(f"head {descriptor.head!r} is a {type(head).__name__}, not an nn.Linear")
    layers = resolved.get("decoder_layers")
    if layers is not None and len(layers) != config.num_hidden_layers:
        problems.append(f"decoder_layers {descriptor.decoder_layers!r} holds {len(layers)} layers, "
                        f"config.num_hidden_layers is {config.num_hidden_layers}")
    return problems


def _unlisted_linear_problems(descriptor: ArchitectureDescriptor, base: nn.Module) -> list[str]:
    """Every ``nn.Linear`` outside the decoder layers but the head is in ``model_level_linears``
    (bitsandbytes quantizes them)."""
    problems: list[str] = []
    layers_prefix = descriptor.decoder_layers + "."
    for name, module in base.named_modules():
        parts = name.split(".")
        if (isinstance(module, nn.Linear) and not _PEFT_INTERNALS.intersection(parts)
                and not name.startswith(layers_prefix)):
            clean = ".".join(p for p in parts if p != "base_layer")
            if clean != descriptor.head and clean not in descriptor.model_level_linears:
                problems.append(f"nn.Linear {clean!r} outside the decoder layers is not in model_level_linears")
    return problems


def _layer_kinds(descriptor: ArchitectureDescriptor, config: Any) -> Any:
    """``config.<layer_kinds_attr>``, one kind per layer; None when the config has none."""
    return getattr(config, descriptor.layer_kinds_attr, None)


def _absent_kinds_note(descriptor: ArchitectureDescriptor, config: Any) -> str:
    """The note a missing-name problem ends with when this model lacks some of the family's layer kinds."""
    kinds = _layer_kinds(descriptor, config) or []
    missing_kinds = [kind for kind in descriptor.layer_kinds if kinds and kind not in kinds]
    return (f" (this model has no {'/'.join(missing_kinds)} layers: check a config with every layer kind)"
            if missing_kinds else "")


def _layer_kind_problems(descriptor: ArchitectureDescriptor, config: Any) -> list[str]:
    """One kind per layer, each in ``layer_kinds`` with a ``mask_kinds`` entry; every ``mask_kinds`` entry
    names a function of ``transformers.masking_utils``."""
    problems: list[str] = []
    kinds = _layer_kinds(descriptor, config)
    if kinds is None:
        kinds = []
    elif len(kinds) != config.num_hidden_layers:
        problems.append(f"config.{descriptor.layer_kinds_attr} has {len(kinds)} entries for "
                        f"{config.num_hidden_layers} layers")
    used_kinds = list(dict.fromkeys(kinds))
    for kind in used_kinds:
        if kind not in descriptor.layer_kinds:
            problems.append(f"config.{descriptor.layer_kinds_attr} uses layer kind {kind!r}, not in layer_kinds "
                            f"{list(descriptor.layer_kinds)}")
    mask_functions = dict(descriptor.mask_kinds)
    from transformers import masking_utils

    for kind in used_kinds:
        if kind not in mask_functions:
            problems.append(f"layer kind {kind!r} is used but has no mask_kinds entry")
    for kind, function_name in descriptor.mask_kinds:
        if not callable(getattr(masking_utils, function_name, None)):
            problems.append(f"mask_kinds[{kind!r}] names {function_name!r}, not a function of transformers.masking_utils")
    return problems


def _rotary_problems(descriptor: ArchitectureDescriptor, rotary: nn.Module | None) -> list[str]:
    """A rotary module with per-kind buffers (``<kind>_inv_freq``) is described per kind, one with a single
    ``inv_freq`` by one ``rotary_kinds`` entry."""
    if rotary is None:
        return []
    problems: list[str] = []
    buffers = {name for name, _ in rotary.named_buffers(recurse=False)}
    per_kind = sorted(k for k in descriptor.layer_kinds if f"{k}_inv_freq" in buffers)
    described = sorted(k for k, _ in descriptor.rotary_kinds)
    if per_kind and not set(per_kind) <= set(described):
        problems.append(f"rotary module has per-kind buffers for {per_kind}, rotary_kinds describes {described}")
    if not per_kind and len(descriptor.rotary_kinds) != 1:
        problems.append(f"rotary module has one inv_freq, rotary_kinds describes {described}")
    return problems


def _carried_state_problems(descriptor: ArchitectureDescriptor, layers: list[nn.Module]) -> list[str]:
    """Each carried state reaches the layers as a keyword of their ``forward``, and the flags that say which
    layers read and write it (what ``cuda_graphs`` relies on) resolve on every layer."""
    problems: list[str] = []
    for layer_class in dict.fromkeys(type(layer) for layer in layers):
        parameters = inspect.signature(layer_class.forward).parameters
        for carried in descriptor.carried_state:
            if carried.kwarg not in parameters:
                problems.append(f"carried_state kwarg {carried.kwarg!r} is not a parameter of "
                                f"{layer_class.__name__}.forward {list(parameters)[1:]}")
    for carried in descriptor.carried_state:  # what cuda_graphs relies on to capture the mapping's blocks
        for field_name in ("reader_flag", "writer_flag", "entry_key"):
            path = getattr(carried, field_name)
            missing = [i for i, layer in enumerate(layers) if path and not _resolves(layer, path)]
            if missing:
                problems.append(f"carried_state[{carried.kwarg!r}].{field_name} {path!r} is missing on "
                                f"layers {missing}")
    return problems


def _untargeted_linear_problems(descriptor: ArchitectureDescriptor,
                                layer_entries: list[tuple[dict[str, nn.Module], set[str]]]) -> list[str]:
    """Every linear of every decoder layer is a LoRA target or excluded (offenders by full name)."""
    listed = (*descriptor.lora_targets_all_linear, *descriptor.lora_excluded)
    return [f"nn.Linear {descriptor.decoder_layers}.{index}.{path} is neither in lora_targets_all_linear "
            "nor in lora_excluded"
            for index, (linears, _) in enumerate(layer_entries) for path in linears
            if not any(_matches(path, n) for n in listed)]


def _lora_name_problems(descriptor: ArchitectureDescriptor, layer_entries: list[tuple[dict[str, nn.Module], set[str]]],
                        disabled: Any, absent_kinds: str) -> list[str]:
    """Every ``lora_targets_all_linear``/``lora_targets_default``/``lora_excluded`` name is a linear of some
    decoder layer, unless switched off (then it must be absent)."""
    linear_paths = {path for linears, _ in layer_entries for path in linears}
    problems: list[str] = []
    for field_name in ("lora_targets_all_linear", "lora_targets_default", "lora_excluded"):
        for name in getattr(descriptor, field_name):
            found = any(_matches(path, name) for path in linear_paths)
            if name in disabled:
                if found:
                    problems.append(_present_although_disabled(field_name, name))
            elif not found:
                problems.append(f"{field_name} entry {name!r} is not an nn.Linear in any decoder layer{absent_kinds}")
    return problems


def _never_quantized_problems(descriptor: ArchitectureDescriptor, layers: list[nn.Module],
                              layer_entries: list[tuple[dict[str, nn.Module], set[str]]], disabled: Any,
                              absent_kinds: str) -> list[str]:
    """Every ``never_quantized`` name is a module, parameter or buffer of some decoder layer, unless switched
    off (then it must be absent), and is not bitsandbytes 4-bit in any layer."""
    all_paths = set().union(*(paths for _, paths in layer_entries))
    problems: list[str] = []
    for name in descriptor.never_quantized:
        found = sorted(path for path in all_paths if _matches(path, name))
        if name in disabled:
            if found:
                problems.append(_present_although_disabled("never_quantized", name))
            continue
        if not found:
            problems.append(f"never_quantized entry {name!r} is not a module, parameter or buffer of any decoder "
                            f"layer{absent_kinds}")
            continue
        for index, layer in enumerate(layers):
            for path in found:
                try:
                    obj = resolve_path(layer, path)
                except DescriptorError:
                    continue
                if _is_quantized(obj) or _is_quantized(getattr(obj, "weight", None)):
                    problems.append(f"never_quantized entry {name!r} is 4-bit quantized at "
                                    f"{descriptor.decoder_layers}.{index}.{path}")
    return problems


def assert_descriptor_matches(descriptor: ArchitectureDescriptor, model: nn.Module) -> None:
    """Raise ``AssertionError`` listing every :func:`check_descriptor` problem."""
    problems = check_descriptor(descriptor, model)
    if problems:
        raise AssertionError(
            f"descriptor {descriptor.name!r} does not match {type(causal_lm_of(model)).__name__} "
            f"({len(problems)} problems):\n  - " + "\n  - ".join(problems)
        )


__all__ = ["assert_descriptor_matches", "check_descriptor"]

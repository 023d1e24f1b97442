"""LoRA on fused MoE experts in ``poros merge`` (:mod:`poros.export.merge`): the experts' adapter tensors of
an adapter (:func:`expert_loras`, :class:`ExpertLoRA`: ``lora_on_experts``), which expert and which half of
a fused tensor a checkpoint key names (:func:`expert_slice`), and one expert's weight merged with its LoRA
(:func:`merge_expert_weight`), as PEFT computes the delta.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from poros.errors import UnsupportedAdapterError
from poros.export.adapter_fit import PEFT_PREFIX


@dataclass
class ExpertLoRA:
    """LoRA on one fused expert tensor (PEFT's ``target_parameters``): ``a [E, r, in]``, ``b [E, out, r]`` in fp32,
    ``scaling``; ``modules``: the adapter's module paths it came from (nested wrappers: ``...experts.base_layer``)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    modules: tuple[str, ...]

    def delta(self, expert: int) -> torch.Tensor:
        """Expert ``expert``'s ``[out, in]`` update, fp32: ``scaling * B_e @ A_e``."""
        return self.b[expert].matmul(self.a[expert]) * self.scaling


def is_experts_path(module: str) -> bool:
    return re.search(r"\.experts(\.base_layer)*$", module) is not None


def expert_loras(adapter_tensors: dict[str, torch.Tensor], modules: list[str], lora_config: Any,
                 text_config: Any) -> dict[str, dict[str, ExpertLoRA]]:
    """``{experts path: {"gate_up_proj" | "down_proj": ExpertLoRA}}`` from the adapter's LoRA on fused experts.
    Which fused tensor a wrapper adapts is read from its shapes (``gate_up_proj``: hidden in, 2 x
    moe_intermediate out; ``down_proj``: moe_intermediate in, hidden out), not from PEFT's nesting order."""
    import math

    found: dict[str, dict[str, ExpertLoRA]] = {}
    hidden = getattr(text_config, "hidden_size", None)
    experts = getattr(text_config, "num_experts", None)
    inner = getattr(text_config, "moe_intermediate_size", None)
    for module in modules:
        weight_a = adapter_tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"].float()
        weight_b = adapter_tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].float()
        rank = weight_a.shape[0] // experts
        features = (weight_a.shape[1], weight_b.shape[0])
        parameter = {(hidden, 2 * inner): "gate_up_proj", (inner, hidden): "down_proj"}.get(features)
        if parameter is None:
            raise UnsupportedAdapterError(
                f"the adapter's LoRA on {module} maps {features[0]} -> {features[1]} features; this base's experts "
                f"map {hidden} -> {2 * inner} (gate_up_proj) and {inner} -> {hidden} (down_proj). Is --model the "
                "base this adapter was trained on?")
        path = re.sub(r"(\.base_layer)+$", "", module)
        alpha = pattern_value(getattr(lora_config, "alpha_pattern", None) or {}, f"{path}.{parameter}",
                               lora_config.lora_alpha)
        scaling = alpha / (math.sqrt(rank) if lora_config.use_rslora else rank)
        a = weight_a.view(experts, rank, weight_a.shape[1])  # PEFT's layout: [E * r, in] -> [E, r, in]
        b = weight_b.view(weight_b.shape[0], rank, experts).permute(2, 0, 1)  # [out, r, E] -> [E, out, r]
        entry = found.setdefault(path, {})
        if parameter in entry:
            raise UnsupportedAdapterError(f"the adapter has two LoRA pairs that fit {path}.{parameter} ({module}); "
                                          "expected one per fused expert tensor.")
        entry[parameter] = ExpertLoRA(a, b, scaling, (module,))
    return found


def pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    for pattern, value in patterns.items():  # PEFT's matching of rank/alpha patterns
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def expert_slice(name: str) -> tuple[str, str, int | None, slice | None] | None:
    """``(experts path, fused tensor, expert or None, rows or None)`` of a checkpoint tensor that holds fused
    experts: ``<path>.experts.gate_up_proj`` / ``.down_proj`` (fused on disk, as Gemma 4 saves them) or
    ``<path>.experts.<e>.gate_proj|up_proj|down_proj.weight`` (one expert's matrix, as Qwen3.5 MoE checkpoints
    hold them; transformers fuses ``gate_proj`` then ``up_proj`` into ``gate_up_proj``'s rows). Rows: ``"gate"``
    / ``"up"`` halves as a slice marker resolved against the matrix."""
    fused = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
    if fused:
        return fused.group(1), fused.group(2), None, None
    one = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
    if one:
        path, index, projection = one.group(1), int(one.group(2)), one.group(3)
        half = {"gate_proj": slice(0, 1), "up_proj": slice(1, 2), "down_proj": None}[projection]
        return path, "down_proj" if projection == "down_proj" else "gate_up_proj", index, half
    return None


def merge_expert_weight(weight: torch.Tensor, lora: ExpertLoRA, expert: int | None, half: slice | None) -> torch.Tensor:
    """``weight`` with the expert LoRA merged: in fp32, then cast to ``weight``'s dtype (``(W + s B_e A_e)``).
    ``expert`` None: the fused ``[E, out, in]`` tensor; else one expert's matrix, ``half`` its gate or up rows of
    the fused ``gate_up_proj``."""
    if expert is None:
        delta = torch.stack([lora.delta(e) for e in range(lora.a.shape[0])])
    else:
        delta = lora.delta(expert)
        if half is not None:
            rows = delta.shape[0] // 2
            delta = delta[half.start * rows:half.stop * rows]
    if delta.shape != weight.shape:
        raise UnsupportedAdapterError(f"the expert LoRA gives a {tuple(delta.shape)} update for a {tuple(weight.shape)} "
                                      "expert tensor; is --model the base this adapter was trained on?")
    return (weight.float() + delta).to(weight.dtype)


__all__ = ["ExpertLoRA", "expert_loras", "expert_slice", "is_experts_path", "merge_expert_weight", "pattern_value"]

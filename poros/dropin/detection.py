"""What :func:`poros.prepare` finds and refuses before anything moves: the family, the quantization, the
adapters and the platform (:class:`Detection`), the guarantee label they earn (:func:`guarantee_label`,
docs/parity-modes.md) and the gates that refuse a model Poros cannot stream bit for bit -- an adapter
type outside :data:`SUPPORTED_ADAPTERS`, an accelerate-offloaded or ``torch.compile``-d model, a
trainable tensor inside a block, HF's own gradient checkpointing -- each one
:class:`~poros.errors.PorosError` naming what was found and the fix (:func:`detect`); and the gates run
on every call (:func:`runtime_gates`). :mod:`poros.dropin.model` streams what passes.
"""

from __future__ import annotations

import logging
import platform as _platform
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from poros import records, registry
from poros.descriptor import resolve_path
from poros.devices import compute_device
from poros.errors import (
    BaseNotFrozenError,
    CacheDuringTrainingError,
    CheckpointingError,
    GuaranteeError,
    OffloadedModelError,
    QuantizationError,
    TorchCompileError,
    TrainableInBlockError,
    UnsupportedAdapterError,
    UnsupportedModelError,
)
from poros.dropin import banner
from poros.stream import graphs
from poros.stream.lora_placement import LoraPlacement

logger = logging.getLogger("poros")

#: PEFT adapter types Poros streams (``docs/adapters.md`` has the measured matrix).
SUPPORTED_ADAPTERS = ("LORA",)
LABEL_STRENGTH = {"unverified": 0, "numerical": 1, "bitwise": 2}


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Detection:
    """What :func:`prepare` found, and the guarantee label that applies."""

    family: str
    provider: str
    quantization: str  # "nf4" | "fp4" | "none"
    double_quant: bool
    compute_dtype: str
    adapters: tuple[str, ...]  # "lora" | "rslora" | "dora", one per adapter type present
    targets: tuple[str, ...]
    platform: str
    platform_class: str
    deterministic: bool
    guarantee: str
    reason: str
    prequantized: bool = False  # the base was loaded from a pre-quantized (bnb-4bit) checkpoint
    kernels: str | None = None  # Liger's kernels on the model (poros.dropin.kernels.KernelReport.summary), if asked or found

    def summary(self) -> str:
        base = (f"pre-quantized ({self.quantization}{', double quant' if self.double_quant else ''})"
                if self.prequantized else f"{self.quantization}{' + double quant' if self.double_quant else ''}")
        return "\n".join([
            f"poros: family {self.family} ({self.provider})",
            f"poros: base {base}, "
            f"compute {self.compute_dtype}; adapters {', '.join(self.adapters) or 'none'} on "
            f"{', '.join(self.targets) or '-'}",
            f"poros: platform {self.platform} ({self.platform_class}), "
            f"{banner.determinism(self.platform_class, self.deterministic)}",
            f"poros: guarantee {self.guarantee}: {self.reason}",
            *([f"poros: kernels {self.kernels}"] if self.kernels else []),
        ])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def platform_of(device: torch.device) -> tuple[str, str]:
    """``(platform, platform_class)`` as validation records name them."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"cuda-sm{major}{minor}"
    machine = _platform.machine() or "unknown"
    return f"cpu-{machine}", f"cpu-{machine}"


def _quantization(causal_lm: nn.Module) -> tuple[str, bool, str]:
    import bitsandbytes as bnb

    four_bit = [m for m in causal_lm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    eight_bit = [name for name, m in causal_lm.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    if eight_bit:
        raise QuantizationError(
            f"the base is quantized to 8 bits with bitsandbytes ({len(eight_bit)} Linear8bitLt modules, e.g. "
            f"{eight_bit[0]}); Poros streams 4-bit (NF4/FP4) or unquantized bases. Load it with "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') instead."
        )
    if not four_bit:
        dtype = next(causal_lm.parameters()).dtype
        return "none", False, str(dtype).removeprefix("torch.")
    state = four_bit[0].weight.quant_state
    compute = four_bit[0].compute_dtype or next(causal_lm.parameters()).dtype
    return state.quant_type if state else "nf4", bool(state and state.nested), str(compute).removeprefix("torch.")


def _adapters(model: nn.Module, causal_lm: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    configs = getattr(model, "peft_config", None) or getattr(causal_lm, "peft_config", None) or {}
    kinds, targets = [], []
    for name, config in configs.items():
        peft_type = str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1].upper()
        if peft_type not in SUPPORTED_ADAPTERS:
            raise UnsupportedAdapterError(
                f"adapter {name!r} is PEFT {peft_type}; Poros streams {', '.join(SUPPORTED_ADAPTERS)} "
                "(with rsLoRA and DoRA) — see docs/adapters.md for the measured matrix. Use a LoraConfig."
            )
        kinds.append("dora" if getattr(config, "use_dora", False) else
                     "rslora" if getattr(config, "use_rslora", False) else "lora")
        found = getattr(config, "target_modules", None) or ()
        targets.extend([found] if isinstance(found, str) else sorted(found))
    return tuple(dict.fromkeys(kinds)), tuple(dict.fromkeys(targets))


def guarantee_label(family: str, adapters: tuple[str, ...], quantization: str, platform_class: str,
                    deterministic: bool, kernels: str | None = None) -> tuple[str, str]:
    """The label a run earns from the validation records, and why (see docs/parity-modes.md). ``kernels``
    (``"liger"``: Liger's kernels on the model) counts only the records gated with those kernels."""
    records_here = [r for r in records.validations(family) if r.get("platform_class") == platform_class]
    if not records_here:
        return "unverified", f"no validation record for {family} on {platform_class}"
    if kernels is not None:
        records_here = [r for r in records_here if r.get("kernels") == kernels]
        if not records_here:
            return "numerical", (f"same modules and math, but {kernels}'s kernels are not gated for {family} on "
                                 f"{platform_class} (tools/checks/parity_gate.py --{kernels} records them)")
    gated = {r.get("adapter", "lora") for r in records_here if r.get("label") == "bitwise"}
    missing = [a for a in adapters if a not in gated]
    if missing:
        return "numerical", (f"same modules and math, but {', '.join(missing)} is not gated for {family} on "
                             f"{platform_class} (gated: {', '.join(sorted(gated)) or 'nothing'})")
    if quantization != "nf4":
        return "numerical", f"records gate NF4 bases; this base is {quantization}"
    if platform_class.startswith("cuda") and not deterministic:
        return "numerical", ("deterministic algorithms are off, so fast non-deterministic kernels may run; "
                             "torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                             "gives the gated bitwise mode")
    dates = sorted({str(r.get("date")) for r in records_here if r.get("label") == "bitwise"})
    return "bitwise", f"gated 0.00e+00 for {family} on {platform_class} ({', '.join(dates)})"


# ---------------------------------------------------------------------------------------------
# Gates: every one runs before any weight moves
# ---------------------------------------------------------------------------------------------
_ADAPTER_MARKERS = (".lora_", "lora_magnitude_vector")


def _check_offload(model: nn.Module, causal_lm: nn.Module) -> None:
    device_map = getattr(causal_lm, "hf_device_map", None) or getattr(model, "hf_device_map", None) or {}
    places = {str(v) for v in device_map.values()}
    offloaded = places & {"cpu", "disk"}
    hooked = [name for name, m in causal_lm.named_modules()
              if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    if (offloaded and len(places) > 1) or hooked:
        where = hooked[0] if hooked else next(k for k, v in device_map.items() if str(v) in offloaded)
        raise OffloadedModelError(
            f"the model was dispatched by accelerate with offload (e.g. {where!r} -> "
            f"{device_map.get(where, 'offloaded')}); Poros does its own offloading and needs every module on one "
            "device. Load with device_map={'': 0} (or one device) and let poros.prepare move the blocks."
        )


#: what the refusal of torch.compile says to do (prepare, prepare_trainer and PorosCallback use it)
COMPILE_WORKAROUND = ("Poros streams the blocks through eager PyTorch: drop torch.compile (TrainingArguments("
                      "torch_compile=False), no torch.compile(model)) for the streamed run; docs/prepare.md says why.")


def check_not_compiled(model: nn.Module) -> None:
    compiled = hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
    if compiled:
        raise TorchCompileError(
            f"the model was compiled with torch.compile ({type(model).__name__}); compiled graphs capture each "
            "decoder block's tensors and strides, which streaming swaps between calls (inductor then fails with "
            f"assert_size_stride or wrong dimensions). {COMPILE_WORKAROUND}"
        )


def _check_frozen(model: nn.Module, layers: list[nn.Module]) -> None:
    in_blocks = {id(p) for layer in layers for p in layer.parameters()}
    for name, param in model.named_parameters():
        if not param.requires_grad or any(marker in name for marker in _ADAPTER_MARKERS):
            continue
        if id(param) in in_blocks:
            raise TrainableInBlockError(
                f"{name} requires grad but is not an adapter parameter; a decoder block may only train adapter "
                "parameters (its frozen tensors live on the host). Freeze it (param.requires_grad_(False)) or "
                "train it with a LoRA adapter instead."
            )
        if "modules_to_save" not in name:
            raise BaseNotFrozenError(
                f"base weight {name} requires grad; Poros trains frozen-base adapters only. Freeze the base "
                "(PEFT's get_peft_model does) or list the module in LoraConfig(modules_to_save=[...])."
            )


def _check_checkpointing(layers: list[nn.Module]) -> None:
    for index, layer in enumerate(layers):
        function = getattr(layer, "_gradient_checkpointing_func", None)
        keywords = getattr(function, "keywords", {}) or {}
        if getattr(layer, "gradient_checkpointing", False) and keywords.get("use_reentrant", False):
            raise CheckpointingError(
                f"decoder layer {index} has reentrant gradient checkpointing, which drops gradients that flow "
                "through keyword arguments (e.g. K/V shared across layers): the resident run would be wrong and "
                "differ from Poros. Poros recomputes each block itself: call model.gradient_checkpointing_disable(), "
                "or enable it with gradient_checkpointing_kwargs={'use_reentrant': False}."
            )


def runtime_gates(causal_lm: nn.Module, layers: list[nn.Module], placement: LoraPlacement | None = None,
                  tiled: Any = None):
    """Checks run before every streamed forward (they see what HF passes the trunk); ``tiled``: the
    ``mlp_chunks`` tiling, re-tiled over forwards rebound since (the Trainer's second Liger call)."""

    def check(kwargs: dict) -> None:
        if tiled is not None:
            tiled.retile()
        if placement is not None:
            placement.check_forward()
        if kwargs.get("use_cache") and torch.is_grad_enabled() and causal_lm.training:
            raise CacheDuringTrainingError(
                "use_cache=True in a training forward: a KV cache only costs memory when training and Poros "
                "streams without one. Pass use_cache=False (or leave it out)."
            )
        # HF Trainer(gradient_checkpointing=True) enables HF checkpointing after prepare: refuse the
        # reentrant kind (it changes the math), switch the other off (Poros recomputes blocks itself).
        _check_checkpointing(layers)
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False):
                layer.gradient_checkpointing = False

    return check


def detect(model: nn.Module, causal_lm: nn.Module, require: str | None):
    """``(descriptor, decoder layers, Detection)``: the family, quantization, adapters and platform, every
    gate that can refuse the model (nothing has moved yet), and the guarantee label ``require`` asks for."""
    descriptor = registry.for_config(causal_lm.config)
    registration = registry.registration(descriptor.name)
    if type(causal_lm).__name__ not in descriptor.causal_lm_classes:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} is not a causal-LM class of family {descriptor.name!r} "
            f"(expected {', '.join(descriptor.causal_lm_classes)}). Load the text model with "
            "AutoModelForCausalLM / the family's *ForCausalLM class."
        )
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    _check_offload(model, causal_lm)
    quantization, double_quant, compute_dtype = _quantization(causal_lm)
    adapters, targets = _adapters(model, causal_lm)
    _check_frozen(model, layers)
    _check_checkpointing(layers)
    # poros.from_pretrained keeps the blocks (and so PEFT their adapters) on the host and names the device
    device = compute_device(causal_lm)
    platform, platform_class = platform_of(device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    label, reason = guarantee_label(descriptor.name, adapters, quantization, platform_class, deterministic)
    detection = Detection(descriptor.name, f"{registration.plugin} ({registration.provider})", quantization,
                          double_quant, compute_dtype, adapters, targets, platform, platform_class,
                          deterministic, label, reason,
                          prequantized=bool(getattr(getattr(causal_lm, "hf_quantizer", None), "pre_quantized", False)))
    check_required(require, label, reason)
    logger.info(detection.summary())
    return descriptor, layers, detection


def check_required(require: str | None, label: str, reason: str) -> None:
    """Raise :class:`GuaranteeError` when ``label`` is weaker than ``require`` asks."""
    if require is not None and LABEL_STRENGTH[label] < LABEL_STRENGTH[require]:
        raise GuaranteeError(
            f"prepare(require={require!r}) but this run is {label!r}: {reason}. Meet the condition, or "
            f"pass require={label!r} (or None) to accept it."
        )


def with_kernels(detection: Detection, summary: str, require: str | None) -> Detection:
    """``detection`` with Liger's kernels on the model (``summary``: what Liger patched): the label the records
    gated with Liger earn (:func:`guarantee_label`), checked against ``require`` again."""
    label, reason = guarantee_label(detection.family, detection.adapters, detection.quantization,
                                    detection.platform_class, detection.deterministic, kernels="liger")
    if LABEL_STRENGTH[label] > LABEL_STRENGTH[detection.guarantee]:  # never stronger than without Liger
        label, reason = detection.guarantee, detection.reason
    check_required(require, label, reason)
    return dataclasses.replace(detection, guarantee=label, reason=reason, kernels=summary)


__all__ = ["COMPILE_WORKAROUND", "Detection", "LABEL_STRENGTH", "SUPPORTED_ADAPTERS", "check_not_compiled",
           "check_required", "detect", "guarantee_label", "platform_of", "runtime_gates", "with_kernels"]

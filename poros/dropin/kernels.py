"""Users' fused kernels, streamed: liger-kernel's RMSNorm, RoPE, SwiGLU/GeGLU and fused linear cross-entropy.

HF's ``TrainingArguments(use_liger_kernel=True)`` (and TRL's ``SFTConfig``, which turns Liger's fused linear
cross-entropy off for its own fused head) make the ``Trainer`` patch the model *instance* when training starts
(``transformers.integrations.liger.apply_liger_kernel``): each RMSNorm's and MLP's ``forward`` is rebound to
Liger's on the same module object, the family's ``apply_rotary_pos_emb`` becomes Liger's in the modeling module,
and the causal LM's ``forward`` becomes Liger's ``lce_forward`` (the loss straight from the hidden states, the
logits never whole). Poros streams what those modules hold, not what they run, so the patched modules stream
as they are: the streamed trunk calls the very layer objects, recompute reruns their (patched) forward, a CUDA
graph captures the Triton launches with the rest of a block (compiled in the eager warm-up; a capture that fails
runs eagerly, counted by reason), and ``dequantize_once`` still serves ``self.gate_proj(x)`` inside Liger's MLP.
What Poros has to know is what changed (:func:`liger_report`):

* the head: Liger's fused linear cross-entropy replaces ``loss_chunks`` (Poros installs no chunked head under
  it) and the planner prices its working set (``poros.plan.activations.fused_loss_bytes``);
* the banner names what Liger patched, or why it patched nothing (a family it has no kernels for), and the
  guarantee label counts only the validation records gated with Liger (``kernels = "liger"``).

:func:`apply_liger` is the Trainer's own call, made before streaming: by ``prepare(kernels="liger")``
(``PorosConfig.kernels``, so ``PorosTrainer`` / ``poros train``) and by ``prepare_trainer`` when the trainer's
``args.use_liger_kernel`` is set, with the trainer's ``liger_kernel_config`` -- the Trainer then applies it
again when ``train()`` starts, which rebinds the same functions (Poros re-tiles an ``mlp_chunks`` MLP over them).

liger-kernel is imported only here, only when asked for: ``import poros`` stays torch- and liger-free.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from poros.errors import MissingDependencyError

#: the package whose functions mark a module or forward as Liger's
LIGER_PACKAGE = "liger_kernel"
#: the causal LM attribute :func:`apply_liger` leaves (the config it applied): ``prepare(kernels="liger")`` does not
#: apply Liger again over a trainer's own application (TRL's config turns the fused cross-entropy off)
APPLIED_MARK = "_poros_liger_config"


@dataclass(frozen=True)
class KernelReport:
    """What Liger patched on one causal LM (:func:`liger_report`).

    Attributes:
        modules: Liger's module kinds found and how many of each, e.g. ``(("LigerRMSNorm", 113),
            ("LigerSwiGLUMLP", 28))``.
        rope: the family's ``apply_rotary_pos_emb`` is Liger's.
        fused_loss: the causal LM's forward is Liger's fused linear cross-entropy forward.
        unpatched: why Liger patched nothing of this model (None: it patched something).
        notes: what of the model Liger's kernels were left off, and why.
    """

    modules: tuple[tuple[str, int], ...] = ()
    rope: bool = False
    fused_loss: bool = False
    unpatched: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def applied(self) -> bool:
        return bool(self.modules or self.rope or self.fused_loss)

    def summary(self) -> str:
        """``liger (rms_norm x113, swiglu x28, rope, fused linear cross-entropy)``, or why not."""
        if not self.applied:
            return f"liger not applied: {self.unpatched or 'no module of this model runs a Liger kernel'}"
        parts = [f"{_kind(name)} x{count}" for name, count in self.modules]
        parts += ["rope"] if self.rope else []
        parts += ["fused linear cross-entropy"] if self.fused_loss else []
        own = "" if self.rope else "; rope: the model's own (liger-kernel has none for this family)"
        return f"liger ({', '.join(parts)}{own}{''.join(f'; {note}' for note in self.notes)})"

    def to_dict(self) -> dict[str, Any]:
        return {"modules": dict(self.modules), "rope": self.rope, "fused_loss": self.fused_loss,
                "unpatched": self.unpatched, "notes": list(self.notes)}


def _kind(name: str) -> str:
    """``LigerRMSNormForGemma3`` -> ``rms_norm``; ``LigerSwiGLUMLP`` -> ``swiglu``."""
    lowered = name.lower()
    for key, kind in (("rmsnorm", "rms_norm"), ("swiglu", "swiglu"), ("geglu", "geglu"), ("experts", "experts"),
                      ("layernorm", "layer_norm")):
        if key in lowered:
            return kind
    return name


def _liger_function(function: Any) -> Any:
    """The Liger function behind ``function`` (a bound method or plain function), else None."""
    inner = getattr(function, "__func__", function)
    module = getattr(inner, "__module__", None) or ""
    return inner if module.split(".")[0] == LIGER_PACKAGE else None


def liger_report(causal_lm: Any) -> KernelReport | None:
    """What Liger patched on ``causal_lm`` (an HF ``*ForCausalLM``), read off the instance: each module whose
    ``forward`` is Liger's (rebound on the instance, or a Liger class), the modeling module's
    ``apply_rotary_pos_emb``, the causal LM's own ``forward``. None when nothing of it is Liger's and Liger was
    not imported (a run without Liger)."""
    if LIGER_PACKAGE not in sys.modules:
        return None
    counts: dict[str, int] = {}
    for module in causal_lm.modules():
        forward = module.__dict__.get("forward")
        function = _liger_function(forward) if forward is not None else _liger_function(type(module).forward)
        if function is not None and module is not causal_lm:
            owner = function.__qualname__.split(".")[0]
            counts[owner] = counts.get(owner, 0) + 1
    rope = getattr(sys.modules.get(type(causal_lm).__module__), "apply_rotary_pos_emb", None)
    forward = causal_lm.__dict__.get("forward", type(causal_lm).forward)
    fused = _liger_function(forward) is not None
    order = ("rms_norm", "layer_norm", "swiglu", "geglu", "experts")
    modules = tuple(sorted(counts.items(), key=lambda item: (order.index(_kind(item[0])) if _kind(item[0]) in order
                                                             else len(order), item[0])))
    report = KernelReport(modules, _liger_function(rope) is not None, fused)
    if not report.applied:
        report = KernelReport(unpatched=unpatched_reason(causal_lm))
    return report


def check_packed_experts(causal_lm: Any) -> None:
    """Refuse Liger's experts kernel over experts ``poros.quantize_experts`` packed to NF4: ``LigerExperts``
    reads the fused bf16 ``gate_up_proj`` / ``down_proj`` those modules no longer hold (the plain Trainer with
    Liger would fail the same way).

    Raises:
        ConfigError: a packed experts module runs Liger's forward.
    """
    from poros.errors import ConfigError

    for name, module in _packed_liger_experts(causal_lm):
        raise ConfigError(
            f"Liger's experts kernel ({_liger_function(module.forward).__qualname__}) was applied to {name}, whose "
            "experts poros.quantize_experts packed to NF4: it reads bf16 gate_up_proj/down_proj tensors those "
            "experts no longer hold; expected Liger without its experts kernel on packed experts. Fix: "
            "liger_kernel_config={'swiglu': False} (TrainingArguments/SFTConfig), or quantize_experts: false.")


def _packed_liger_experts(causal_lm: Any) -> list[tuple[str, Any]]:
    """The experts modules ``poros.quantize_experts`` packed to NF4 whose forward Liger rebound."""
    from poros.loading.experts import is_quantized

    return [(name, module) for name, module in causal_lm.named_modules()
            if is_quantized(module) and _liger_function(module.__dict__.get("forward")) is not None]


#: what the report says of packed experts ``kernels: liger`` leaves to Poros's NF4 experts forward
PACKED_EXPERTS_NOTE = ("experts: Poros's NF4 forward (poros.quantize_experts packed them; Liger's experts kernel "
                       "reads bf16 experts)")


def _leave_packed_experts(causal_lm: Any) -> bool:
    """``kernels: liger`` (Poros's own application): Liger's forward taken off NF4-packed experts again, so they
    run Poros's NF4 experts forward (Liger's reads the bf16 tensors they no longer hold). Whether any was."""
    packed = _packed_liger_experts(causal_lm)
    for _, module in packed:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_get_name", None)
    return bool(packed)


def patched_instance(causal_lm: Any) -> bool:
    """Whether Liger was applied to this very instance: :func:`apply_liger` marked it, or a module of it (the
    causal LM included) has Liger's ``forward`` bound on the instance. Modules merely built of Liger's classes
    (a class swap that an earlier application left in the modeling module) do not count."""
    return APPLIED_MARK in causal_lm.__dict__ or any(
        "forward" in module.__dict__ and _liger_function(module.__dict__["forward"]) is not None
        for module in causal_lm.modules())


def unpatched_reason(causal_lm: Any) -> str:
    """Why Liger leaves ``causal_lm`` as it is: the model type liger-kernel has no kernels for, or the class its
    patch for that type does not take."""
    from importlib.metadata import version

    model_type = getattr(causal_lm.config, "model_type", None)
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return "liger-kernel is not installed"
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return (f"liger-kernel {version('liger-kernel')} has no kernels for model type {model_type!r} "
                f"({type(causal_lm).__name__}); its blocks run the model's own modules")
    return (f"liger-kernel {version('liger-kernel')}'s patch for model type {model_type!r} changed nothing of "
            f"{type(causal_lm).__name__}")


def apply_liger(model: Any, kernel_config: dict | None = None) -> KernelReport:
    """Apply liger-kernel's kernels to ``model`` (an HF causal LM or a PEFT model around one) in place: the call
    HF's ``Trainer`` makes for ``use_liger_kernel=True`` (``apply_liger_kernel(model, liger_kernel_config)``),
    so a Poros run and the plain Trainer patch the same way. A model type liger-kernel has no kernels for is left
    as it is (the report says why).

    Raises:
        MissingDependencyError: liger-kernel (or the Triton it needs) is not installed.
    """
    from poros.adapters import causal_lm_of

    try:
        from transformers.integrations.liger import apply_liger_kernel

        import liger_kernel.transformers  # noqa: F401 (the import HF's call makes; fails here, in one line)
    except ImportError as exc:
        raise MissingDependencyError(
            f"kernels='liger' (or use_liger_kernel=True) needs liger-kernel and Triton ({exc}); expected them "
            "installed. Fix: pip install 'poros-train[liger]' (CUDA machines: Triton comes with torch).") from None
    apply_liger_kernel(model, kernel_config or {})
    causal_lm = causal_lm_of(model)
    causal_lm.__dict__[APPLIED_MARK] = dict(kernel_config or {})  # kernel_report: applied, with this config
    return liger_report(causal_lm) or KernelReport(unpatched="liger-kernel was not imported")


def kernel_report(model: Any, causal_lm: Any, kernels: str) -> KernelReport | None:
    """The report ``prepare`` keeps for ``kernels`` (its option): with ``"liger"``, Liger applied to the instance
    unless it already is (:func:`patched_instance`: ``prepare_trainer``'s application, or the Trainer's own when
    ``PorosCallback`` prepares at ``on_train_begin`` -- the trainer's ``liger_kernel_config`` stands); otherwise
    what Liger already patched, or None (no Liger on this model). Experts ``poros.quantize_experts`` packed to NF4
    keep Poros's forward under Poros's own application (the report says so); a trainer's Liger experts kernel
    over them is refused (:func:`check_packed_experts`: the Trainer would bind it again at ``train()``)."""
    if kernels == "liger" and not patched_instance(causal_lm):
        found = apply_liger(model)
        if _leave_packed_experts(causal_lm):
            found = dataclasses.replace(liger_report(causal_lm), notes=(PACKED_EXPERTS_NOTE,))
    else:
        found = liger_report(causal_lm)
    if found is not None and found.applied:
        check_packed_experts(causal_lm)
    return found if found is not None and (found.applied or kernels == "liger") else None


__all__ = ["APPLIED_MARK", "KernelReport", "LIGER_PACKAGE", "PACKED_EXPERTS_NOTE", "apply_liger", "check_packed_experts", "kernel_report", "liger_report", "patched_instance", "unpatched_reason"]

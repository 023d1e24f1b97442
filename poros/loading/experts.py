"""``poros.quantize_experts``: a mixture-of-experts model's fused 3-D expert tensors packed to NF4 in place.

transformers stores the experts of an MoE block (Qwen3.5/3.6 MoE, Gemma 4 26B-A4B) as fused
``nn.Parameter``s, ``gate_up_proj [E, 2 * I, H]`` and ``down_proj [E, H, I]``, which bitsandbytes'
``Linear4bit`` replacement skips: under an ordinary QLoRA load they stay bf16 and are most of the
model's bytes. :func:`quantize_experts` packs each expert's matrix with bitsandbytes' blockwise NF4
(``bitsandbytes.functional.quantize_4bit``, one call per expert) and replaces the parameter by two
buffers the block store streams like any other frozen tensor:

* ``<name>_nf4``: uint8 ``[E, rows * cols / 2]``, the packed 4-bit codes of each expert;
* ``<name>_absmax``: float32 ``[E, rows * cols / blocksize]``, each expert's block scales;

and one ``nf4_code`` buffer (the 16 NF4 levels) per experts module. The experts' forward becomes one
of two, registered in transformers' ``ExpertsInterface`` and selected through the config's
``_experts_implementation``:

* ``poros_nf4_grouped`` (:mod:`poros.loading.experts_grouped`), the default wherever transformers'
  ``grouped_mm`` computes on the experts' device: transformers' grouped experts forward with all E
  experts of a fused tensor dequantized in one bitsandbytes call, forward and again in backward. No
  host sync, static shapes: ``cuda_graphs`` captures these blocks.
* ``poros_nf4`` (:data:`EXPERTS_IMPLEMENTATION`, :func:`nf4_experts_forward`; ``grouped=False``, and
  where grouped_mm does not compute): a loop over the experts the tokens were routed to, as
  transformers' eager loop does, dequantizing each one when it is used (:class:`DequantizedLinear`,
  again in backward). It holds one expert's bf16 matrix at a time, but syncs with the host (the experts
  hit), so ``cuda_graphs`` keeps its blocks eager and names why (the families' ``graph_unsafe``).

LoRA on the experts is PEFT's own call, in either order with :func:`quantize_experts`:
``get_peft_model(model, LoraConfig(..., target_parameters=["experts.gate_up_proj", "experts.down_proj"]))``.
A packed module keeps a placeholder ``nn.Parameter`` per fused tensor (its full shape, a zero-stride view of
one element: no bytes) so PEFT finds and wraps it; PEFT's ``ParamWrapper`` would add its delta to a dense
weight, so :func:`adopt_expert_lora` turns each wrapper over NF4 experts into :class:`NF4ExpertsLoRA` (the
same module, state-dict keys and factors; its forward leaves the LoRA to the experts forward) and drops the
placeholders. Both forwards add each expert's LoRA to its rows: the grouped one with two more
``grouped_mm`` per fused tensor over the same offsets (``x A_g^T`` then ``B_g^T``), the loop per expert.
:func:`adopt_expert_lora` runs from a forward pre-hook on the experts' parent (the resident model), from
``poros.prepare`` and from :func:`quantize_experts` itself (LoRA applied first).

Neither keeps a bf16 expert weight for backward. The model stays an ordinary resident HF model that
trains (the parity reference); ``poros.prepare`` streams it like any other, and the streamed run is
bitwise the resident one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from peft.tuners.lora.layer import ParamWrapper

from poros.errors import PorosError
from poros.loading.experts_grouped import (GROUPED_EXPERTS_IMPLEMENTATION, dequantize_nf4, expert_lora_factors,
                                           grouped_mm_works, nf4_grouped_experts_forward)

#: the name of the NF4 experts forward in transformers' ``ExpertsInterface`` (``config._experts_implementation``)
EXPERTS_IMPLEMENTATION = "poros_nf4"
#: the fused expert tensors transformers' experts modules hold
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")
#: PEFT's ``target_parameters`` for the fused experts (the same leaf names in every MoE family Poros knows)
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]
NF4_BLOCKSIZE = 64


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module: one that owns the fused ``gate_up_proj`` and ``down_proj``
    parameters (3-D, or the store's placeholders while streamed) and says ``num_experts``, or their NF4
    buffers once quantized. PEFT's ``ParamWrapper`` around one is not listed (its base layer is)."""
    found = []
    for name, module in model.named_modules():
        owned = all(t in module._parameters for t in FUSED_EXPERT_TENSORS) and hasattr(module, "num_experts")
        if owned or is_quantized(module):
            found.append((name, module))
    return found


def is_quantized(module: nn.Module) -> bool:
    """True when :func:`quantize_experts` packed this experts module."""
    return isinstance(getattr(module, "poros_nf4", None), dict)


def quantize_experts(model: nn.Module, *, blocksize: int = NF4_BLOCKSIZE, grouped: bool | None = None) -> nn.Module:
    """Quantize every fused expert tensor of ``model`` to NF4 in place, per expert; returns ``model``.

    Call it before or after ``get_peft_model``: LoRA on the linears is unaffected, and LoRA on the experts
    (``target_parameters=["experts.gate_up_proj", "experts.down_proj"]``) trains on the NF4 experts in either
    order. Quantizing twice is a no-op for the modules already packed (an explicit ``grouped`` still
    switches their forward).

    Args:
        model: a transformers MoE model (``*ForCausalLM``, or a PEFT model around one).
        blocksize: NF4 block size (bitsandbytes' default 64).
        grouped: the experts' forward. None (default): ``poros_nf4_grouped`` where transformers'
            ``grouped_mm`` computes on the experts' current device (torch >= 2.9 on CPU, SM80+ on CUDA),
            else the ``poros_nf4`` loop; True / False: that one. The choice is written to the config
            (``_experts_implementation``), where ``set_experts_implementation`` can change it later.

    Raises:
        PorosError: the model has no fused experts; the experts layout is one this forward does not compute
            (transposed, biased or ungated experts); a PEFT ``target_parameters`` entry matches no parameter
            (:func:`adopt_expert_lora`).
    """
    import bitsandbytes.functional as bnb_functional

    modules = experts_modules(model)
    if not modules:
        raise PorosError(
            f"{type(model).__name__} has no fused MoE experts (3-D gate_up_proj / down_proj parameters); "
            "quantize_experts is for mixture-of-experts models (qwen3_5_moe, gemma4 with enable_moe_block)."
        )
    chosen = grouped if grouped is not None else grouped_mm_works(_experts_device(modules[0][1]))
    implementation = GROUPED_EXPERTS_IMPLEMENTATION if chosen else EXPERTS_IMPLEMENTATION
    for name, module in modules:
        if is_quantized(module):
            if grouped is not None:
                module.config._experts_implementation_internal = implementation
            continue
        _check_layout(name, module)
        module.poros_nf4 = {}
        code = None
        for tensor_name in FUSED_EXPERT_TENSORS:
            parameter = getattr(module, tensor_name)
            packed, absmax = [], []
            with torch.no_grad():
                for expert in parameter.detach():
                    codes, state = bnb_functional.quantize_4bit(
                        expert.contiguous(), blocksize=blocksize, quant_type="nf4")
                    packed.append(codes.view(-1))
                    absmax.append(state.absmax.view(-1))
                    code = state.code
            module.register_buffer(f"{tensor_name}_nf4", torch.stack(packed), persistent=False)
            module.register_buffer(f"{tensor_name}_absmax", torch.stack(absmax), persistent=False)
            module.poros_nf4[tensor_name] = (tuple(parameter.shape[1:]), parameter.dtype, blocksize)
            module._parameters[tensor_name] = placeholder(module, tensor_name)  # what PEFT's target_parameters finds
        module.register_buffer("nf4_code", code.clone(), persistent=False)
        module.config._experts_implementation_internal = implementation
    _register_forward()
    for name, module in modules:
        _hook_parent(model, name, module)
    adopt_expert_lora(model)
    return model


def placeholder(module: nn.Module, tensor_name: str) -> nn.Parameter:
    """A frozen stand-in for a packed fused tensor: its shape and dtype, on its device, as a zero-stride view of
    one element (no bytes). PEFT reads shape, dtype and device from it to build the expert LoRA."""
    shape, dtype, _ = module.poros_nf4[tensor_name]
    one = torch.zeros((), dtype=dtype, device=getattr(module, f"{tensor_name}_nf4").device)
    return nn.Parameter(one.expand(module.num_experts, *shape), requires_grad=False)


def _hook_parent(model: nn.Module, name: str, module: nn.Module) -> None:
    """A forward pre-hook on the experts' parent (the MoE block or decoder layer): before the experts' wrapper
    runs, PEFT wrappers added since (``get_peft_model`` after :func:`quantize_experts`) are adopted."""
    if "poros_nf4_hook" in module.__dict__ or not name:  # the module quantized on its own: its parent is not here
        return
    owner = _unwrapped([name])[0].rpartition(".")[0]  # above PEFT's wrappers, which take the experts' place
    parent = model.get_submodule(owner) if owner else model
    module.__dict__["poros_nf4_hook"] = parent.register_forward_pre_hook(_adopt_before_forward)


def _adopt_before_forward(owner: nn.Module, args: tuple) -> None:
    adopt_expert_lora(owner)  # returns None: the forward's arguments stay as they are


def _wrappers_of(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """``(name, wrapper, experts)`` of every PEFT ``ParamWrapper`` whose innermost base is NF4 experts."""
    found = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "parameter_name", None), str) and hasattr(module, "base_layer"):
            base = module.get_base_layer()
            if is_quantized(base):
                found.append((name, module, base))
    return found


def adopt_expert_lora(model: nn.Module, *, drop_placeholders: bool = False) -> int:
    """Turn PEFT's ``ParamWrapper`` over NF4 experts into :class:`NF4ExpertsLoRA` (the experts forward adds the
    LoRA) and drop the placeholders of the tensors so wrapped, and check every PEFT ``target_parameters`` entry
    matched; returns how many wrappers are on NF4 experts. Idempotent; cheap when there is nothing to do.
    ``drop_placeholders`` (``poros.prepare``) drops every placeholder (the store streams real tensors only) and
    the forward pre-hooks (a streamed block with a hook is not captured in a CUDA graph).

    Raises:
        UnsupportedAdapterError: a ``target_parameters`` entry of a PEFT config on ``model`` matches no parameter
            (the message names the fused expert parameters that exist).
    """
    wrappers = _wrappers_of(model)
    for _, wrapper, experts in wrappers:
        if type(wrapper) is not NF4ExpertsLoRA:
            wrapper.__class__ = NF4ExpertsLoRA
        lora = experts.__dict__.setdefault("poros_expert_lora", {})  # a plain dict: not a submodule
        lora[wrapper.parameter_name] = wrapper
        experts._parameters.pop(wrapper.parameter_name, None)  # the wrapper's get_param makes one when asked
    if drop_placeholders:  # and the pre-hooks: a hooked block is not captured in a CUDA graph ("module hooks")
        for _, module in experts_modules(model):
            if is_quantized(module):
                for tensor_name in FUSED_EXPERT_TENSORS:
                    module._parameters.pop(tensor_name, None)
                hook = module.__dict__.pop("poros_nf4_hook", None)
                if hook is not None:
                    hook.remove()
    _check_target_parameters(model)
    return len(wrappers)


def _check_target_parameters(model: nn.Module) -> None:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    wanted = {entry for config in configs.values() for entry in (getattr(config, "target_parameters", None) or [])}
    if not wanted:
        return
    adapted = [f"{name}.{module.parameter_name}" for name, module in model.named_modules()
               if isinstance(getattr(module, "parameter_name", None), str) and hasattr(module, "base_layer")]
    missing = sorted(entry for entry in wanted
                     if not any(key == entry or key.endswith(f".{entry}") for key in _unwrapped(adapted)))
    if missing:
        from poros.errors import UnsupportedAdapterError

        existing = list(dict.fromkeys(f"{name.rpartition('.')[2]}.{t}" for name in _unwrapped(
            [n for n, _ in experts_modules(model)]) for t in FUSED_EXPERT_TENSORS))
        raise UnsupportedAdapterError(
            f"LoraConfig(target_parameters=...) entries {missing} match no parameter of this model; its fused expert "
            f"parameters are {existing or 'none'}: name those, e.g. target_parameters={existing or EXPERT_PARAMETERS}.")


def _unwrapped(names: list[str]) -> list[str]:
    """PEFT's names without its ``base_layer.`` hops (nested wrappers), as ``target_parameters`` are matched."""
    return [name.replace(".base_layer", "") for name in names]


def _experts_device(module: nn.Module) -> torch.device:
    return (module.gate_up_proj_nf4 if is_quantized(module) else module.gate_up_proj).device


def _check_layout(name: str, module: nn.Module) -> None:
    expected = (("is_transposed", False), ("has_bias", False), ("has_gate", True), ("is_concatenated", True),
                ("has_post_expert_norm", False))
    odd = [flag for flag, wanted in expected if getattr(module, flag, wanted) != wanted]
    if odd or not hasattr(module, "config"):
        raise PorosError(
            f"{name} ({type(module).__name__}) has an experts layout Poros' NF4 forward does not compute "
            f"({', '.join(odd) or 'no config'}); keep its experts in bf16 (quantize_experts=False)."
        )


def _register_forward() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, nf4_experts_forward)
    ExpertsInterface.register(GROUPED_EXPERTS_IMPLEMENTATION, nf4_grouped_experts_forward)


class NF4ExpertsLoRA(ParamWrapper):
    """PEFT's ``ParamWrapper`` (LoRA on one fused expert tensor, ``target_parameters``) over NF4 experts: the same
    ``lora_A`` / ``lora_B`` (PEFT's layout: ``lora_A [E * r, in]``, ``lora_B [out, E * r]``, expert ``e``'s
    delta ``B[:, :, e] @ A[e]`` once viewed ``[E, r, in]`` / ``[out, r, E]``), saved under the same keys; its
    forward calls the experts as they are, and the NF4 experts forward adds ``x A_e^T B_e^T * scaling`` to each
    expert's rows (:func:`expert_lora_factors`). PEFT's own forward would add the delta to a dense weight."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        return self.base_layer(x, *args, **kwargs)

    def get_param(self) -> torch.Tensor:
        """The packed tensor's placeholder (its shape, dtype and device; no bytes)."""
        return placeholder(self.get_base_layer(), self.parameter_name)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise PorosError(
            f"LoRA on NF4 experts ({self.parameter_name}) cannot merge into 4-bit codes; merge the saved adapter "
            "into the bf16 checkpoint: poros merge --adapter DIR (or PEFT's merge_and_unload on the bf16 model).")


def dequantized_expert(module: nn.Module, tensor_name: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s matrix of ``tensor_name``, dequantized from its NF4 buffers (the original dtype)."""
    shape, dtype, blocksize = module.poros_nf4[tensor_name]
    return dequantize_nf4(getattr(module, f"{tensor_name}_nf4")[expert],
                          getattr(module, f"{tensor_name}_absmax")[expert], module.nf4_code, shape, dtype, blocksize)


class DequantizedLinear(torch.autograd.Function):
    """``F.linear(x, W)`` with ``W`` one expert's NF4 matrix, dequantized in forward and again in backward
    (only the packed bytes are saved: no bf16 expert weight waits for backward)."""

    @staticmethod
    def forward(ctx, x, packed, absmax, code, meta: tuple):
        ctx.save_for_backward(packed, absmax, code)
        ctx.meta = meta
        return nn.functional.linear(x, dequantize_nf4(packed, absmax, code, *meta))

    @staticmethod
    def backward(ctx, grad_output):
        packed, absmax, code = ctx.saved_tensors
        weight = dequantize_nf4(packed, absmax, code, *ctx.meta)
        return grad_output.matmul(weight), None, None, None, None


def _expert_linear(module: nn.Module, tensor_name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    return DequantizedLinear.apply(
        x, getattr(module, f"{tensor_name}_nf4")[expert], getattr(module, f"{tensor_name}_absmax")[expert],
        module.nf4_code, module.poros_nf4[tensor_name])


def nf4_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' eager experts loop over NF4 experts: for each expert a token was routed to, its
    ``gate_up_proj`` and ``down_proj`` dequantized as they are used (:class:`DequantizedLinear`).

    ``hidden_states [T, H]``, ``top_k_index`` / ``top_k_weights [T, k]``; returns ``[T, H]``.
    """
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
    for expert in expert_hit:
        if expert == self.num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        current = hidden_states[token_idx]
        for tensor_name in FUSED_EXPERT_TENSORS:
            out = _expert_linear(self, tensor_name, expert, current)
            for a, b, scaling in expert_lora_factors(self, tensor_name, current.dtype):
                out = out + current.matmul(a[expert]).matmul(b[expert]) * scaling
            current = self._apply_gate(out) if tensor_name == "gate_up_proj" else out
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def quantize_experts_for_run(model: nn.Module, requested: bool | None) -> str | None:
    """The trainer's choice (config ``quantize_experts``): ``None`` on a model without fused experts, else the
    line that says what was done. ``requested`` None or True quantizes (a model loaded through the NF4 block
    cache then streams its blocks from pinned buffers: the cache entry holds the bf16 experts), False keeps bf16.
    """
    modules = experts_modules(model)
    if not modules:
        return None
    stored = sum(expert_bytes(m)["bytes"] for _, m in modules)
    if requested is False:
        return (f"poros: MoE experts kept in bf16 (quantize_experts=false): {len(modules)} experts modules, "
                f"{stored / 1e9:.2f} GB")
    quantize_experts(model)
    if getattr(model, "poros_block_file", None) is not None:
        del model.poros_block_file  # the entry's layout is the bf16 experts': pack the blocks anew
    packed = sum(expert_bytes(m)["bytes"] for _, m in modules)
    return (f"poros: MoE experts in NF4 (quantize_experts={'true' if requested else 'auto'}): {len(modules)} experts "
            f"modules, {stored / 1e9:.2f} GB bf16 -> {packed / 1e9:.2f} GB, forward "
            f"{modules[0][1].config._experts_implementation}")


def expert_bytes(module: nn.Module) -> dict[str, Any]:
    """What one experts module holds: ``experts``, ``dtype`` (``"nf4"`` once quantized) and ``bytes``."""
    if is_quantized(module):
        nbytes = sum(getattr(module, f"{t}_{part}").nbytes for t in FUSED_EXPERT_TENSORS for part in ("nf4", "absmax"))
        return {"experts": module.num_experts, "dtype": "nf4", "bytes": nbytes + module.nf4_code.nbytes}
    tensors = [getattr(module, t) for t in FUSED_EXPERT_TENSORS]
    return {"experts": tensors[0].shape[0], "dtype": str(tensors[0].dtype).removeprefix("torch."),
            "bytes": sum(t.nbytes for t in tensors)}


__all__ = ["DequantizedLinear", "EXPERTS_IMPLEMENTATION", "EXPERT_PARAMETERS", "FUSED_EXPERT_TENSORS",
           "NF4ExpertsLoRA", "NF4_BLOCKSIZE", "adopt_expert_lora", "dequantized_expert", "expert_bytes",
           "expert_lora_factors", "experts_modules", "is_quantized", "nf4_experts_forward", "placeholder",
           "quantize_experts", "quantize_experts_for_run"]

"""The grouped NF4 experts forward: every expert dequantized in one call, one grouped matmul per fused tensor.

:func:`nf4_grouped_experts_forward` (``ExpertsInterface`` name :data:`GROUPED_EXPERTS_IMPLEMENTATION`) is
transformers' ``grouped_mm_experts_forward`` over :func:`poros.quantize_experts`' buffers: the routed
(token, expert) pairs sorted by expert, tokens per expert counted with ``torch.histc``, their int32
cumulative sum the group offsets, one ``grouped_mm`` through ``gate_up_proj`` and one through
``down_proj``, routing weights, the inverse permutation and a reshape+sum. Nothing reads a value back
to the host and every shape is static, so CUDA graphs capture the block (the loop,
:func:`~poros.loading.experts.nf4_experts_forward`, syncs on the experts hit and stays eager).

The weights of all E experts come from ONE bitsandbytes dequantize per fused tensor (up to
:data:`MAX_VALUES_PER_CALL` values; larger ones take a few calls): the buffers are
``[E, rows * cols / 2]`` codes and ``[E, rows * cols / blocksize]`` scales, and when
``rows * cols % blocksize == 0`` no NF4 block straddles two experts, so the per-expert blocks laid end to
end are the blockwise NF4 of the concatenation (tests/test_moe.py checks the bytes). Other shapes
dequantize expert by expert and stack (still no host sync). :class:`GroupedDequantizedLinear` dequantizes
in forward and again in backward: only the packed bytes, the scales, the code and the int32 offsets are
saved, never the ``[E, rows, cols]`` bf16 weight (grad flows to the input only; the experts are frozen).
The transient is that weight, ``E * rows * cols`` values of the compute dtype, while the matmul runs; inside a
CUDA graph capture it is written to one buffer the graphs hold instead of a fresh allocation from their pool
(:mod:`poros.stream.capture_scratch`).

:func:`dequantize_nf4` (one tensor from its codes and scales) is shared with the loop.
"""

from __future__ import annotations

import torch
from torch import nn

from poros.stream.capture_scratch import scratch

#: the name of the grouped NF4 experts forward in transformers' ``ExpertsInterface``
GROUPED_EXPERTS_IMPLEMENTATION = "poros_nf4_grouped"


def grouped_mm_works(device: torch.device | str) -> bool:
    """Whether transformers' ``grouped_mm`` (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``)
    computes on ``device`` rather than its host-syncing fallback (``_can_use_grouped_mm``: torch >= 2.9 on
    CPU, SM80+ on CUDA)."""
    from transformers.integrations.moe import _can_use_grouped_mm

    device = torch.device(device)
    if device.type == "meta":
        device = torch.device("cpu")
    probe = torch.empty(16, 16, dtype=torch.bfloat16, device=device)
    return bool(_can_use_grouped_mm(probe, probe.view(1, 16, 16), torch.zeros(1, dtype=torch.int32, device=device)))


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, ...],
                dtype: torch.dtype, blocksize: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``shape`` tensor from its NF4 codes and block scales. The codes are handed to bitsandbytes as rows of one
    block each (then reshaped): its CPU kernel (0.50) reads a row's scales as if blocks started at each row, which
    is wrong for a ``[H, I]`` matrix with ``I < blocksize`` (e.g. a tiny ``down_proj``); the CUDA kernel is flat."""
    import math

    import bitsandbytes.functional as bnb_functional

    numel = math.prod(shape)
    rows_of_blocks = (numel // blocksize, blocksize) if numel % blocksize == 0 else tuple(shape)
    state = bnb_functional.QuantState(absmax=absmax, shape=torch.Size(rows_of_blocks), code=code, blocksize=blocksize,
                                      quant_type="nf4", dtype=dtype)
    if out is not None and packed.device.type == "cuda":  # the same kernel, writing where it is told (a capture's
        # held scratch, poros.stream.capture_scratch); bitsandbytes has no such variant on the CPU, which copies
        return bnb_functional.dequantize_4bit(packed.reshape(-1, 1), state, out=out.view(rows_of_blocks)).view(shape)
    result = bnb_functional.dequantize_4bit(packed.reshape(-1, 1), state).view(shape)
    return result if out is None else out.copy_(result)


#: values one bitsandbytes dequantize call covers at most: its CUDA kernel counts them in an ``int``
#: (Qwen3.5-397B-A17B's ``gate_up_proj`` holds 512 x 2048 x 4096, over 2**31: it takes three calls)
MAX_VALUES_PER_CALL = 2 ** 31 - 1


def dequantize_all(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, shape: tuple[int, int],
                   dtype: torch.dtype, blocksize: int) -> torch.Tensor:
    """Every expert's ``[rows, cols]`` matrix, ``[E, rows, cols]``, from ``[E, rows * cols / 2]`` codes and
    ``[E, rows * cols / blocksize]`` scales: one dequantize when no block straddles two experts (and the E
    experts hold at most :data:`MAX_VALUES_PER_CALL` values; else runs of experts that do, concatenated)."""
    experts, (rows, cols) = packed.shape[0], shape
    if rows * cols % blocksize:
        return torch.stack([dequantize_nf4(packed[e], absmax[e], code, shape, dtype, blocksize)
                            for e in range(experts)])
    per_call = max(1, MAX_VALUES_PER_CALL // (rows * cols))
    held = scratch((experts, rows, cols), dtype, packed.device)  # inside a CUDA graph capture: its held buffer
    runs = [dequantize_nf4(packed[first:first + per_call].reshape(-1), absmax[first:first + per_call].reshape(-1), code,
                           (min(per_call, experts - first), rows, cols), dtype, blocksize,
                           out=None if held is None else held[first:first + per_call])
            for first in range(0, experts, per_call)]
    return held if held is not None else runs[0] if len(runs) == 1 else torch.cat(runs)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.moe import _grouped_mm as transformers_grouped_mm

    return transformers_grouped_mm(x, weight, offsets)


class GroupedDequantizedLinear(torch.autograd.Function):
    """Row block ``g`` of ``x`` (rows ``offsets[g-1]:offsets[g]``) through expert ``g``'s NF4 matrix
    ``W_g [out, in]``: ``x [S, in] -> [S, out]``, all E matrices dequantized at once in forward and again in
    backward (only codes, scales, code and offsets are saved). Returns the gradient of ``x`` only."""

    @staticmethod
    def forward(ctx, x, offsets, packed, absmax, code, meta: tuple):
        ctx.save_for_backward(offsets, packed, absmax, code)
        ctx.meta, ctx.input_dtype = meta, x.dtype
        weight = dequantize_all(packed, absmax, code, *meta)  # [E, out, in]
        return _grouped_mm(x, weight.transpose(-2, -1), offsets)

    @staticmethod
    def backward(ctx, grad_output):
        offsets, packed, absmax, code = ctx.saved_tensors
        weight = dequantize_all(packed, absmax, code, *ctx.meta)
        grad_input = _grouped_mm(grad_output.contiguous(), weight, offsets)  # [S, out] @ W_g -> [S, in]
        return grad_input.to(ctx.input_dtype), None, None, None, None, None


def expert_lora_factors(module: nn.Module, tensor_name: str, dtype: torch.dtype) -> list[tuple]:
    """``(A [E, in, r], B [E, r, out], scaling)`` per active adapter of the LoRA on ``module.<tensor_name>`` (NF4
    experts adopted by :func:`poros.loading.experts.adopt_expert_lora`), in ``dtype``; ``[]`` without one or with adapters disabled.
    ``r`` is padded with zeros to a multiple of 8: CUDA's grouped_mm wants 16-byte strides."""
    wrapper = getattr(module, "poros_expert_lora", {}).get(tensor_name)
    if wrapper is None or wrapper.disable_adapters:
        return []
    factors = []
    for adapter in wrapper.active_adapters:
        if adapter not in wrapper.lora_A:
            continue
        weight_a, weight_b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        experts = wrapper.num_experts
        a = weight_a.to(dtype).view(experts, -1, weight_a.shape[-1])  # [E, r, in]
        b = weight_b.to(dtype).view(weight_b.shape[0], -1, experts).permute(2, 1, 0)  # [E, r, out]
        pad = -a.shape[1] % 8
        if pad:
            a, b = nn.functional.pad(a, (0, 0, 0, pad)), nn.functional.pad(b, (0, 0, 0, pad))
        factors.append((a.transpose(-2, -1).contiguous(), b.contiguous(), wrapper.scaling[adapter]))
    return factors


def _grouped_linear(module: nn.Module, tensor_name: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row block through its expert's NF4 matrix, plus its expert's LoRA where the experts carry one: two
    grouped matmuls over the same offsets, ``(x A_g^T) B_g^T * scaling`` (no per-expert loop, no host sync)."""
    out = GroupedDequantizedLinear.apply(
        x, offsets, getattr(module, f"{tensor_name}_nf4"), getattr(module, f"{tensor_name}_absmax"),
        module.nf4_code, module.poros_nf4[tensor_name])
    for a, b, scaling in expert_lora_factors(module, tensor_name, x.dtype):
        out = out + _grouped_mm(_grouped_mm(x, a, offsets), b, offsets) * scaling
    return out


def nf4_grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm_experts_forward`` over NF4 experts (no bias, not transposed, gated:
    what :func:`~poros.loading.experts.quantize_experts` accepts). ``hidden_states [T, H]``,
    ``top_k_index`` / ``top_k_weights [T, k]``; returns ``[T, H]``."""
    num_tokens, hidden_dim = hidden_states.shape
    num_top_k = top_k_index.size(-1)
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # S = T * k (token, expert) pairs, by expert
    selected = hidden_states[perm // num_top_k]
    sample_weights = top_k_weights.reshape(-1)[perm]
    # histc, not bincount (CUDA graphs); CPU's histc takes floats only
    counted = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    tokens_per_expert = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    out = self._apply_gate(_grouped_linear(self, "gate_up_proj", selected, offsets))  # [S, I]
    out = _grouped_linear(self, "down_proj", out, offsets)  # [S, H]
    weighted = out * sample_weights.unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.size(0), device=perm.device)
    # reshape+sum, not index_add_ (deterministic on CUDA), as transformers' grouped forward
    final = weighted[inverse].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return final.to(hidden_states.dtype)


__all__ = ["GROUPED_EXPERTS_IMPLEMENTATION", "GroupedDequantizedLinear", "MAX_VALUES_PER_CALL", "dequantize_all",
           "dequantize_nf4", "expert_lora_factors", "grouped_mm_works", "nf4_grouped_experts_forward"]

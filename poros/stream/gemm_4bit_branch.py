"""Which of bitsandbytes' ``matmul_4bit`` branches a 4-bit product takes (0.50.2), in one place.

``bitsandbytes.matmul_4bit(A, B, quant_state, out, bias)`` computes through ``gemm_4bit`` / ``MatMul4Bit`` unless
the input is empty, the weight is stored ``[K, N]`` (its deprecated branch), the state is the CPU inference
packing, or a nested state has a blocksize it refuses. :mod:`poros.stream.dequantize_once` holds a block's
dequantized weights only on that branch, and :mod:`poros.stream.recompute_tail` leaves a product out only there;
both ask :func:`takes_gemm_4bit`, and :func:`through_matmul4bit` for whether it runs as ``MatMul4Bit``.
:func:`unread_output` is the left-out product's stand-in. Imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch


def takes_gemm_4bit(A: torch.Tensor, quant_state: Any) -> bool:  # noqa: N803 (bitsandbytes' names)
    """Whether ``matmul_4bit`` computes ``A`` by ``quant_state``'s weight through ``gemm_4bit`` / ``MatMul4Bit``."""
    shape = getattr(quant_state, "shape", ())
    if A.numel() == 0 or len(shape) != 2 or getattr(quant_state, "packing_format_for_cpu", False):
        return False
    if A.shape[-1] == shape[0] and A.shape[-1] != shape[1]:  # [K, N] weights: bitsandbytes' deprecated branch
        return False
    return not (quant_state.nested and quant_state.state2.blocksize != 256)  # bitsandbytes raises there; let it


def through_matmul4bit(A: torch.Tensor, bias: Any) -> bool:  # noqa: N803
    """Whether ``matmul_4bit`` runs the product as the autograd Function ``MatMul4Bit`` (its output has a gradient)
    rather than as a bare ``gemm_4bit``."""
    return torch.is_grad_enabled() and (A.requires_grad or (bias is not None and bias.requires_grad))


def unread_output(A: torch.Tensor, quant_state: Any) -> torch.Tensor:  # noqa: N803
    """An uninitialized tensor shaped like the product of ``A`` by ``quant_state``'s ``[N, K]`` weight: a product
    whose output nothing reads, left out."""
    return A.new_empty((*A.shape[:-1], quant_state.shape[0]))


__all__ = ["takes_gemm_4bit", "through_matmul4bit", "unread_output"]

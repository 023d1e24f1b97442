"""A recompute without its unread last product (:class:`RecomputeTail`).

A recomputed block runs its forward again only for the tensors its backward saves: the recompute's output is a root
of the backward, and its value is thrown away. In a pre-norm decoder block the last 4-bit linear (``mlp.down_proj``)
feeds only adds -- PEFT's ``result + lora_B(lora_A(x)) * scaling`` and the residual add -- and an add saves nothing;
the linear's own backward reads its weight and the output gradient, never its output. So that product (at 32B, 2 x
tokens x 27,648 x 5,120 FLOPs, a third of the MLP's) is work no one reads: without it the recompute saves the same
tensors and the backward computes the same gradients, bit for bit. Its output is left uninitialized.

Whether a block's last product is such a product is found, not declared. The first recompute of each block runs
whole under a probe that records bitsandbytes' 4-bit products in call order and every tensor autograd saves
(``saved_tensors_hooks``). The last product is skipped in later recomputes when it was its weight's only product in
the block and no tensor saved after it is derived from its output: its output's autograd node is not an ancestor of
any saved tensor, and no saved tensor shares its storage. A norm of the MLP's output (a post-feedforward norm) saves
it: such blocks fail the probe and recompute whole.

The probe holds for later calls because a dense block runs the same products in the same order every time; a block
with a router (its experts' products depend on the tokens) is never probed and recomputes whole. The skip applies to
a block recomputed eagerly (a replayed graph recomputes whole) with no carried mapping, in either schedule: in a held
phase of ``dequantize_once`` :class:`~poros.stream.dequantize_once.DequantizeOnce`'s own autograd Function leaves the
product out; otherwise bitsandbytes' ``matmul_4bit`` is stood in for during the recompute and the product becomes
:class:`_SkippedMatMul4Bit`, bitsandbytes' ``MatMul4Bit`` context and backward without the product. Which calls
take that branch is :mod:`poros.stream.gemm_4bit_branch`'s. Imports torch, that module, and bitsandbytes when a
recompute runs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from poros.stream.gemm_4bit_branch import takes_gemm_4bit, through_matmul4bit, unread_output


class RecomputeTail:
    """One executor's probes (block index -> the ``QuantState`` of its skippable last product, or None) and the
    context its eager recomputes run in. ``dequantize`` is the executor's ``DequantizeOnce``."""

    def __init__(self, dequantize: Any) -> None:
        self.dequantize = dequantize
        self.targets: dict[int, Any] = {}
        self.skipped = 0  # products left out so far, and their FLOPs (reports, tests)
        self.skipped_flops = 0

    @contextlib.contextmanager
    def recompute(self, index: int, eligible: bool):
        """Around the forward of block ``index``'s eager recompute (``eligible``: no carried mapping, no router
        logits): the first one is probed, later ones skip the probed product."""
        if not eligible:
            yield
            return
        if index not in self.targets and self._routed(index):
            self.targets[index] = None  # its products depend on the routing: the probe's order may not hold
        if index not in self.targets:
            probe = _Probe()
            with probe.recording():
                yield
            self.targets[index] = probe.target()
            return
        target = self.targets[index]
        if target is None:
            yield
        elif self.dequantize.held is not None:  # a held phase: DequantizeOnce's own Function skips it
            self.dequantize.skipping = target
            try:
                yield
            finally:
                self.dequantize.skipping = None
        else:
            with self._skipping(target):
                yield

    @contextlib.contextmanager
    def _skipping(self, target: Any):
        """bitsandbytes' ``matmul_4bit`` with ``target``'s product (once) left out: :class:`_SkippedMatMul4Bit`,
        where bitsandbytes would take ``MatMul4Bit``; every other call unchanged."""
        import bitsandbytes

        original, pending = bitsandbytes.matmul_4bit, [target]

        def matmul_4bit(A, B, quant_state, out=None, bias=None):  # noqa: N803 (bitsandbytes' names)
            if pending and quant_state is target and _takes_matmul4bit(A, quant_state, out, bias):
                pending.clear()
                self._count(A, quant_state)
                return _SkippedMatMul4Bit.apply(A, B.view(-1, 1), None, bias, quant_state)
            return original(A, B, quant_state, out=out, bias=bias)

        bitsandbytes.matmul_4bit = matmul_4bit
        try:
            yield
        finally:
            bitsandbytes.matmul_4bit = original

    def leave_out(self, A: torch.Tensor, quant_state: Any) -> torch.Tensor:  # noqa: N803
        """The product of ``A`` by ``quant_state``'s ``[N, K]`` weight, left out: counted, and an uninitialized
        output of its shape in its place."""
        self._count(A, quant_state)
        return unread_output(A, quant_state)

    def _count(self, A: torch.Tensor, quant_state: Any) -> None:  # noqa: N803
        self.skipped += 1
        self.skipped_flops += 2 * A.numel() * quant_state.shape[0]  # 2 x rows x K x N

    def _routed(self, index: int) -> bool:
        """Whether block ``index`` holds a router (the module class transformers records router logits from)."""
        executor = self.dequantize.executor
        router = executor.routers.target
        return router is not None and any(isinstance(m, router) for m in executor.layers[index].modules())


class _Probe:
    """What one whole recompute did: its 4-bit products in call order, and each saved tensor with the number of
    products run before it was saved."""

    def __init__(self) -> None:
        self.products: list[tuple[Any, torch.Tensor]] = []
        self.saved: list[tuple[int, torch.Tensor]] = []

    @contextlib.contextmanager
    def recording(self):
        import bitsandbytes

        original = bitsandbytes.matmul_4bit

        def matmul_4bit(A, B, quant_state, out=None, bias=None):  # noqa: N803 (bitsandbytes' names)
            output = original(A, B, quant_state, out=out, bias=bias)
            self.products.append((quant_state, output))
            return output

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            self.saved.append((len(self.products), tensor))
            # what autograd keeps: the same storage without the graph (a saved output kept with its grad_fn would
            # make a reference cycle, its tensors freed only by the cyclic collector)
            return tensor.detach()

        bitsandbytes.matmul_4bit = matmul_4bit
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                yield
        finally:
            bitsandbytes.matmul_4bit = original

    def target(self) -> Any:
        """The last product's ``QuantState`` when no saved tensor reads its output, else None."""
        products, saved, self.products, self.saved = self.products, self.saved, [], []
        if not products:
            return None
        state, output = products[-1]
        if sum(s is state for s, _ in products) != 1 or output.grad_fn is None:
            return None
        node, storage = output.grad_fn, output.untyped_storage().data_ptr()
        after = [tensor for count, tensor in saved if count == len(products)]
        if any(tensor.untyped_storage().data_ptr() == storage or _reaches(tensor.grad_fn, node) for tensor in after):
            return None
        return state


class _SkippedMatMul4Bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` (0.50.2) without its product: the same context, an uninitialized output of
    the product's shape, and ``MatMul4Bit``'s own backward."""

    @staticmethod
    def forward(ctx, A, B, out, bias, quant_state):  # noqa: N803 (bitsandbytes' names)
        ctx.is_empty, ctx.state = False, quant_state
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (None, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return unread_output(A, quant_state)

    @staticmethod
    def backward(ctx, grad_output):
        from bitsandbytes.autograd._functions import MatMul4Bit

        return MatMul4Bit.backward(ctx, grad_output)


def _takes_matmul4bit(A: torch.Tensor, quant_state: Any, out: Any, bias: Any) -> bool:  # noqa: N803
    """Whether bitsandbytes' ``matmul_4bit`` would compute this call with ``MatMul4Bit`` (and no ``out``)."""
    return out is None and takes_gemm_4bit(A, quant_state) and through_matmul4bit(A, bias)


def _reaches(start: Any, node: Any) -> bool:
    """Whether autograd node ``node`` is ``start`` or one of its ancestors."""
    stack, seen = [start], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        if current is node:
            return True
        seen.add(id(current))
        stack.extend(edge[0] for edge in current.next_functions)
    return False


__all__ = ["RecomputeTail"]

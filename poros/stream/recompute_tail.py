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
any saved tensor, and no saved tensor shares its storage. Gemma's post-feedforward norm saves its input and a MoE
block's routing weights multiply the experts' outputs: such blocks fail the probe and recompute whole.

The probe holds for later calls because a dense block runs the same products in the same order every time; a block
with a router (its experts' products depend on the tokens) is never probed and recomputes whole. Where: the held path
of ``dequantize_once`` (:class:`~poros.stream.dequantize_once.DequantizeOnce`, whose autograd Function is Poros's own
and skips the product), a block recomputed eagerly (a replayed graph recomputes whole), with no carried mapping.
Imports torch only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class RecomputeTail:
    """One executor's probes (block index -> the ``QuantState`` of its skippable last product, or None) and the
    context its eager recomputes run in. ``dequantize`` is the executor's ``DequantizeOnce``."""

    def __init__(self, dequantize: Any) -> None:
        self.dequantize = dequantize
        self.targets: dict[int, Any] = {}

    @contextlib.contextmanager
    def recompute(self, index: int, eligible: bool):
        """Around the forward of block ``index``'s eager recompute (``eligible``: no carried mapping, no router
        logits): the first one is probed, later ones skip the probed product. A no-op outside a held phase."""
        if not eligible or self.dequantize.held is None:
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
        self.dequantize.skipping = self.targets[index]
        try:
            yield
        finally:
            self.dequantize.skipping = None

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
            return tensor

        bitsandbytes.matmul_4bit = matmul_4bit
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                yield
        finally:
            bitsandbytes.matmul_4bit = original

    def target(self) -> Any:
        """The last product's ``QuantState`` when no saved tensor reads its output, else None."""
        if not self.products:
            return None
        state, output = self.products[-1]
        if sum(s is state for s, _ in self.products) != 1 or output.grad_fn is None:
            return None
        node, storage = output.grad_fn, output.untyped_storage().data_ptr()
        after = [tensor for count, tensor in self.saved if count == len(self.products)]
        self.products, self.saved = [], []
        if any(tensor.untyped_storage().data_ptr() == storage or _reaches(tensor.grad_fn, node) for tensor in after):
            return None
        return state


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

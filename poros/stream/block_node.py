"""One streamed decoder block as one autograd node (:class:`StreamedBlock`), and the order in which a
block's forward uses its trainable parameters (:func:`recording_use`): the executor's pieces that
autograd and DDP see. The node calls back into the executor (``_backward_block``) to fetch,
recompute and back-propagate the block.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


class StreamedBlock(torch.autograd.Function):
    """One decoder block as one autograd node: saves its input, recomputes in backward.

    The block's trainable parameters are inputs of the node and their gradients its outputs, so
    the graph the forward built reaches each parameter's accumulator exactly once, as in the
    resident graph: DDP's reducer (``find_unused_parameters`` searches that graph; its hooks sit
    on the accumulators) sees every adapter used, and ready once per backward.
    """

    @staticmethod
    def forward(ctx, executor: Any, step: Any, index: int, used: list, anchor, hidden, output,
                input_count: int, *inputs_and_parameters):
        # ``output`` was computed (without grad) by the caller: it had to see the use order first.
        grad_inputs = inputs_and_parameters[:input_count]
        ctx.executor, ctx.step, ctx.index, ctx.used = executor, step, index, used
        # an input not kept (boundary_every > 1) is recomputed from its segment's kept one in backward
        ctx.save_for_backward(hidden if executor.keeps_input(index) else None, *grad_inputs)
        # with output_router_logits the block's router logits are outputs too (the aux loss reads them)
        return (output, *step.router_logits.get(index, ())) if step.router else (output,)

    @staticmethod
    def backward(ctx, grad_output, *router_grads):
        hidden, *grad_inputs = ctx.saved_tensors
        if hidden is None:
            hidden = ctx.executor.segment_input(ctx.step, ctx.index)
        parameters = ctx.executor.block_parameters(ctx.index)  # found once for both (a walk of the block's modules)
        hidden_grad, input_grads, parameter_grads = ctx.executor._backward_block(
            ctx.step, ctx.index, hidden, grad_inputs, grad_output, ctx.needs_input_grad[5],
            return_parameter_grads=True, router_grads=list(router_grads) if ctx.step.router else None,
            parameters=parameters,
        )
        by_parameter = dict(zip(map(id, parameters), parameter_grads))
        in_use_order = [by_parameter[id(p)] for p in ctx.used]
        return (None, None, None, None, None, hidden_grad, None, None, *input_grads, *in_use_order)


@contextlib.contextmanager
def recording_use(layer: nn.Module, parameters: list[nn.Parameter], known: list[nn.Parameter] | None):
    """Yields ``parameters`` in the order ``layer``'s forward uses them (forward pre-hooks on their
    owning modules; parameters no hook saw follow in registration order). Once ``known`` holds the
    same parameters, it is yielded as it is and nothing is hooked."""
    if known is not None and {id(p) for p in known} == {id(p) for p in parameters}:
        yield known
        return
    wanted = {id(p) for p in parameters}
    order: list[nn.Parameter] = []
    seen: set[int] = set()

    def note(module, _args):
        for parameter in module.parameters(recurse=False):
            if id(parameter) in wanted and id(parameter) not in seen:
                seen.add(id(parameter))
                order.append(parameter)

    handles = [module.register_forward_pre_hook(note) for module in layer.modules()
               if any(id(p) in wanted for p in module.parameters(recurse=False))]
    try:
        yield order
    finally:
        for handle in handles:
            handle.remove()
        order.extend(p for p in parameters if id(p) not in seen)

"""The layer-major schedule (``StreamingExecutor.forward_backward``): gradient accumulation over M
micro-batches with every block fetched once for the M forwards and once for the M backwards of an
optimizer step, so it crosses the link twice instead of 2·M times.

::

    1. prelude   per micro-batch: HF's first call of the model, stopped after the capture (``Phase.PRELUDE``)
    2. forward   for block i = 0..L-1: fetch, run micro-batch 0..M-1, release; keep the boundary states
    3. head      per micro-batch: HF's second call (``Phase.HEAD``), its loss and backward to the trunk output
    4. backward  for block i = L-1..0: fetch, recompute and back-propagate micro-batch 0..M-1, release
    5. prelude   per micro-batch: the gradients of its outputs into its own graph

Micro-batch 0 goes first in both directions, so every LoRA gradient accumulates in the order of ordinary
accumulation -- bitwise the same. The boundary states wait on the device, in pinned host memory or on
disk (``stash.py``); with ``boundary_every`` > 1 the states between kept ones are recomputed
(``segments.py``). The blocks themselves run through the executor (``executor.py``): its forward of one
block, its backward of one block, its trunk switch; these functions take the executor as their first
argument.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from poros.errors import StreamingError
from poros.stream import capture_scratch, gc_pause
from poros.stream.dropout import check_no_dropout
from poros.stream.replay import autocast_state, outside_autocast, replayed_autocast
from poros.stream.segments import recompute_inputs, segment_start, segment_top
from poros.stream.stash import DiskStash, HostStash
from poros.stream.trunk import CaptureDone, Phase, Step, TrunkState


def forward_backward(executor: Any, model_call: Callable[..., Any], micro_batches: list[dict], *,
                     own_backward: bool = False) -> list[torch.Tensor]:
    """Forward and backward of M micro-batches, block by block; returns their losses (detached).

    ``model_call(**micro_batch)`` is the full model (e.g. the PEFT wrapper) and must return an
    output with ``.loss`` (or the loss tensor); pass ``num_items_in_batch`` in each micro-batch for
    HF's accumulation semantics. Gradients accumulate into ``.grad`` exactly as
    ``for mb: model(**mb).loss.backward()`` would leave them; under autocast, as HF Trainer's loop does (autocast around each forward, every
    backward outside it). With ``own_backward``, ``model_call`` is a
    whole training step of one micro-batch (a trainer's loss, its scaling and its backward call) and
    returns the loss; it is called twice per micro-batch (the first call is unwound at the trunk), so
    nothing before its model call may have effects a second run would repeat. The blocks run under the
    autocast state the model's forward set around its trunk call (recorded in the first call), as they
    would inside that forward. Boundary states: the M x L block inputs stay on the device, or with
    ``boundary_states == "host"`` wait in pinned host memory (copied out as they are made, back
    one block ahead of backward, on their own stream; exact copies, so bitwise the same), or with
    ``"disk"`` in files under :attr:`spill_dir` (one per state, deleted as it is read back; the
    directory is removed after the step and when it fails).

    Raises:
        StreamingError: a dropout with p > 0 is active (its random draws would come in another
            order than in ordinary accumulation; use the micro-major schedule).
    """
    lent = None if executor.graphs is None else executor.graphs.scratch  # eager blocks' transients too
    with gc_pause.paused(executor.options.pause_gc), capture_scratch.active(lent, eager=True):
        return _paused_step(executor, model_call, micro_batches, own_backward)


def _paused_step(executor: Any, model_call: Callable[..., Any], micro_batches: list[dict],
                 own_backward: bool) -> list[torch.Tensor]:
    check_no_dropout(executor.causal_lm)
    if not micro_batches:
        return []
    if executor.graphs is not None:  # an autocast region that outlived the last step keeps its blocks eager
        executor.graphs.begin_step()
    # 1. the prelude of every micro-batch, built by HF (first call, stopped after the capture)
    steps = [prelude(executor, model_call, batch) for batch in micro_batches]
    stash = _stash(executor)
    try:
        return _layer_major(executor, model_call, micro_batches, steps, stash, own_backward)
    finally:
        executor.dequantize.end_step()
        if isinstance(stash, DiskStash):
            stash.close()  # after the step and when it fails: no state file is left behind


def _stash(executor: Any) -> HostStash | DiskStash | None:
    """Where this step's boundary states wait: None (the device), pinned host memory or files."""
    if executor.boundary_states not in ("host", "disk"):
        return None
    device = executor.store.device
    if device.type == "cuda" and executor._stash_stream is None:
        executor._stash_stream = torch.cuda.Stream(device)
    if executor.boundary_states == "disk":
        return DiskStash(device, executor._stash_stream, executor.spill_dir)
    return HostStash(device, executor._stash_stream)


def _layer_major(executor: Any, model_call: Callable[..., Any], micro_batches: list[dict], steps: list[Step],
                 stash: HostStash | DiskStash | None, own_backward: bool = False) -> list[torch.Tensor]:
    """:meth:`forward_backward` after the preludes: blocks forward, heads, blocks backward, preludes' backward."""
    count, last = len(executor.layers), len(executor.layers) - 1
    # 2. forward, block-major: each block fetched once for all micro-batches
    hidden = [step.calls[0].leaves[0] for step in steps]
    inputs: list[list[torch.Tensor | None]] = [[] for _ in steps]
    executor.dequantize.decide(hidden[0], len(steps))  # before the kept blocks: they get what it leaves
    kept_blocks = executor.recompute.blocks(hidden[0], len(steps))
    for step in steps:
        step.kept_blocks = kept_blocks
    # the forward's autocast state where it differs from this thread's (None: run as the caller runs)
    outer = autocast_state(executor.store.device)
    autocasts = [None if step.autocast is None or step.autocast == outer else step.autocast for step in steps]
    with torch.no_grad():
        for index in range(count):
            with executor.dequantize.holding(index):  # dequantized once for the M forwards
                _forward_block(executor, steps, index, hidden, inputs, stash, autocasts)
    # 3. head and loss of each micro-batch, by HF (second call), and their backward to the trunk output
    losses, grad_hidden, router_grads = [], [], []
    for batch, output, step in zip(micro_batches, hidden, steps):
        leaf = output.detach().requires_grad_(True)
        routers = {i: [t.detach().requires_grad_(True) for t in step.router_logits.get(i, [])] for i in range(count)}
        leaves = tuple(t for i in range(count) for t in routers[i]) if step.router else None
        with executor._switched(TrunkState(Phase.HEAD, hidden=leaf, router_logits=leaves)):
            loss = model_call(**batch)  # with own_backward, the loss's backward ran inside
        loss = loss if isinstance(loss, torch.Tensor) else loss.loss
        if not own_backward:
            with outside_autocast(leaf.device):  # every backward here runs outside autocast, as HF Trainer's
                loss.backward()
        losses.append(loss.detach())
        grad_hidden.append(leaf.grad)
        router_grads.append({i: [t.grad for t in ts] for i, ts in routers.items()})
    hidden = output = leaf = loss = None  # the last block's outputs are done with: backward needs their gradients
    # 4. backward, block-major, micro-batch 0 first: the accumulation order of ordinary accumulation
    input_grads: list[list[list]] = [[[] for _ in range(count)] for _ in steps]
    every = executor.boundary_every
    recomputed: list[dict[int, torch.Tensor]] = [{} for _ in steps]  # boundary_every > 1: this segment's inputs

    def kept_input(m: int, index: int) -> torch.Tensor:
        return stash.take((m, index)) if stash is not None and index > 0 else inputs[m][index]

    for index in range(last, -1, -1):
        start = segment_start(index, every)
        if stash is not None and index == segment_top(index, every, count):
            # this segment's kept inputs (already on their way), the next segment's start now
            for ahead in (start, start - every):
                for m in range(len(steps)):
                    if ahead > 0:
                        stash.fetch((m, ahead))
        if index != start and index not in recomputed[0]:  # the segment's top: its inputs from its start
            recomputed = recompute_inputs(executor, steps, start, index, [kept_input(m, start) for m in range(len(steps))])
        with executor.dequantize.holding(index):  # dequantized once for the M recomputes and backwards
            for m, step in enumerate(steps):
                needs_grad = index > 0 or step.calls[0].leaves[0].requires_grad
                keep = m < len(steps) - 1
                block_input = recomputed[m].pop(index) if index in recomputed[m] else kept_input(m, index)
                grad_hidden[m], input_grads[m][index], _ = executor._backward_block(
                    step, index, block_input, step.calls[index].grad_tensors(), grad_hidden[m], needs_grad,
                    keep=keep, router_grads=router_grads[m][index] if step.router else None)
                del block_input
    # 5. the prelude of each micro-batch: its outputs' gradients into its own graph
    for m, step in enumerate(steps):
        roots, grads = [], []
        if step.calls[0].leaves[0].requires_grad:
            roots.append(step.calls[0].leaves[0])
            grads.append(grad_hidden[m])
        for index in range(count):
            for tensor, grad in zip(step.calls[index].grad_tensors(), input_grads[m][index]):
                if grad is not None:
                    roots.append(tensor)
                    grads.append(grad)
        if roots:
            with outside_autocast(executor.store.device):
                torch.autograd.backward(roots, grads)
    return losses


def prelude(executor: Any, model_call: Callable[..., Any], batch: dict) -> Step:
    """Layer-major's first call of the model for one micro-batch: HF builds its context and the trunk
    records the layer calls; the last recorder's :class:`CaptureDone` unwinds the model's forward, so
    no block, head or loss runs."""
    state = TrunkState(Phase.PRELUDE, calls=[], autocast=[])
    with executor._switched(state), contextlib.suppress(CaptureDone):
        model_call(**batch)
        raise StreamingError("the model returned without calling its trunk; it cannot be streamed.")
    step = executor._step_of(state.calls)
    step.router = state.asked.get("router", False)
    step.autocast = state.autocast[0] if state.autocast else None
    return step


def _forward_block(executor: Any, steps: list[Step], index: int, hidden: list[torch.Tensor],
                   inputs: list[list[torch.Tensor | None]], stash: HostStash | DiskStash | None,
                   autocasts: list) -> None:
    """Block ``index``'s forward for the M micro-batches, micro-batch 0 first: each one's input kept (on the device,
    in the stash, or not at all where ``boundary_every`` recomputes it), ``hidden`` advanced to its output."""
    last = len(executor.layers) - 1
    for m, step in enumerate(steps):
        executor._note_mapping_entry(step, index)
        if not executor.keeps_input(index):  # boundary_every > 1: recomputed in backward
            inputs[m].append(None)
        elif stash is not None and index > 0:  # block 0's input is the prelude's: HF holds it anyway
            stash.put((m, index), hidden[m])
            inputs[m].append(None)
        else:
            inputs[m].append(hidden[m])
        keep = m < len(steps) - 1 or index == last
        with replayed_autocast(autocasts[m], executor.store.device):
            hidden[m] = executor._run_block(step, index, hidden[m], step.calls[index].grad_tensors(), keep=keep)

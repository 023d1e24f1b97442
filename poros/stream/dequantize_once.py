"""Dequantize once per block phase (``StreamOptions.dequantize_once``): in layer-major accumulation a streamed
block's NF4 weights are dequantized once for its M forwards and once for its M recomputes and backwards, not
once a call.

bitsandbytes (0.50.2, ``bitsandbytes/autograd/_functions.py``) computes a 4-bit linear as
``Linear4bit.forward`` -> ``bnb.matmul_4bit(x, weight, bias, quant_state)``:

* without grad, ``torch.ops.bitsandbytes.gemm_4bit(A, B, ...)``; with grad, ``MatMul4Bit`` whose forward is the
  same op and whose backward is ``torch.matmul(grad_output, F.dequantize_4bit(B, state).to(grad_output.dtype))``
  (and ``grad_output.sum(0, dtype=bias dtype)`` for a bias that requires grad);
* the op on a device without its own kernel (the CPU: bitsandbytes registers only ``gemv_4bit`` there) is the
  default one: the nested absmax ``dequantize_blockwise(absmax_8bit, absmax, code, 256, float32) + offset``,
  ``B_dq = dequantize_4bit(B, absmax, blocksize, quant_type, shape, A.dtype)``, ``F.linear(A, B_dq, bias)``;
* on CUDA its kernel takes a fused 4-bit GEMM for small row counts (``_gemm_4bit_use_custom_fn``, up to
  ``_gemm_4bit_custom_max_m`` rows) and otherwise the same dequantize-then-``F.linear`` fallback, through the very
  kernels the public ops call.

:class:`DequantizeOnce` holds the dequantized weights of one block while a phase of it runs (:meth:`holding`)
and, inside it, stands in for ``bitsandbytes.matmul_4bit``: the held block's linears compute exactly those ops
with the held tensor (``F.linear(A, B_dq, bias)`` forward, ``torch.matmul(grad, dequantize_4bit(...).to(...))``
backward), everything else goes to bitsandbytes unchanged. A held copy is keyed by the weight's ``QuantState``
(the same object across fetches), the dtype it is dequantized to and the dtype it is cast to: the forward's
``(A.dtype, A.dtype)``, the backward's ``(state.dtype, grad.dtype)``; when those agree (the compute dtype is the
weights'), one tensor serves both, made by the same dequantize op from the same bytes. Where the CUDA kernel
would take its fused GEMM, the forward calls it as bitsandbytes does (no copy); a shape bitsandbytes routes
elsewhere (an empty input, ``[K, N]`` weights, the CPU inference packing, a device whose kernel this does not
follow) goes to bitsandbytes too. So every product is bitwise bitsandbytes' own.

A held block runs eagerly under CUDA graphs (a replay would hold its own dequantization). The decision per
step (:meth:`DequantizeOnce.decide`): ``True`` on, ``False`` off; ``"auto"``: off in micro-major and at one
micro-batch (nothing to share), under CUDA graphs at micro-batches under
:data:`~poros.stream.recompute_choice.GRAPHS_MIN_TOKENS` tokens (launch-bound: the replay wins), else the plan's
decision (``BudgetPlan.dequantize_once``); without a plan, on CUDA, whether the free memory holds the copy
beside what the rest of the step allocates and the margin :mod:`~poros.stream.recompute_choice` leaves (kept
activations get what remains); on a CPU without a plan, off.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from poros.stream.gemm_4bit_branch import takes_gemm_4bit, through_matmul4bit
from poros.stream.recompute_choice import GRAPHS_MIN_TOKENS
from poros.stream.recompute_tail import RecomputeTail


class _HeldMatMul4Bit(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` with the held dequantized weight: its forward, backward and context
    (``ctx.tensors = (None, B)``, ``ctx.state``: what ``poros.stream.kept`` rebinds for a kept block)."""

    @staticmethod
    def forward(ctx, A, B, out, bias, quant_state, held):  # noqa: N803 (bitsandbytes' names)
        output = held.forward_product(A, B, quant_state, bias)
        ctx.state, ctx.held = quant_state, held
        ctx.dtype_A, ctx.dtype_B, ctx.dtype_bias = A.dtype, B.dtype, None if bias is None else bias.dtype
        ctx.tensors = (None, B) if any(ctx.needs_input_grad[:2]) else (None, None)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        req_grad_a, _, _, req_grad_bias, _, _ = ctx.needs_input_grad
        _, B = ctx.tensors  # noqa: N806
        grad_a = grad_bias = None
        if req_grad_bias:  # before grad_output's dtype changes, as bitsandbytes
            grad_bias = grad_output.sum(0, dtype=ctx.dtype_bias)
        if req_grad_a:
            grad_a = torch.matmul(grad_output, ctx.held.backward_weight(B, ctx.state, grad_output.dtype))
        return grad_a, None, None, grad_bias, None, None


class DequantizeOnce:
    """One executor's held NF4 weights: :meth:`decide` per layer-major step, :meth:`holding` per block phase.

    ``mode`` is ``StreamOptions.dequantize_once``; ``planned`` the plan's decision for ``"auto"`` (None: no plan).
    """

    def __init__(self, executor: Any, mode: bool | str, planned: bool | None = None) -> None:
        self.executor, self.mode, self.planned = executor, mode, planned
        self.on = False  # this step holds its blocks' weights
        self.last = False  # the last layer-major step's decision (reports, tests)
        self.reason = ""  # why the last decision was off, in words
        self.held: dict[tuple, torch.Tensor] | None = None  # the block phase's copies (None: no phase)
        self._states: frozenset[int] = frozenset()  # ids of the held block's QuantStates
        self._block_states: dict[int, frozenset[int]] = {}  # block index -> its QuantStates' ids, found once
        self._original = None  # bitsandbytes.matmul_4bit while a phase runs
        self._free: bool | None = None  # without a plan: decided at the first step
        #: a recompute's product no one reads (``poros.stream.recompute_tail``): its QuantState, while one runs
        self.skipping: Any = None
        self.tail = RecomputeTail(self)  # which recomputes skip which product (held or not)

    # -- the decision ----------------------------------------------------------------------------
    def decide(self, hidden: torch.Tensor, micro_batches: int) -> bool:
        """Whether this layer-major step of ``micro_batches`` micro-batches shaped like ``hidden`` holds its
        blocks' weights (sets :attr:`on` until :meth:`end_step`)."""
        self.on, self.reason = self.mode is True, "" if self.mode is True else "dequantize_once=false"
        if self.mode == "auto":
            graphs = self.executor.graphs
            if micro_batches < 2:
                self.reason = "one micro-batch: the phases have nothing to share"
            elif graphs is not None and hidden.shape[:-1].numel() < GRAPHS_MIN_TOKENS:
                self.reason = f"CUDA graphs at micro-batches under {GRAPHS_MIN_TOKENS} tokens (the replay wins)"
            elif self.planned is not None:
                self.on, self.reason = self.planned, "" if self.planned else "the VRAM budget cannot hold the copy"
            else:
                self.on = self._fits_free(hidden, micro_batches)
                self.reason = "" if self.on else ("no VRAM budget on the CPU" if hidden.device.type != "cuda"
                                                  else "the free device memory cannot hold the copy")
        self.last = self.on
        return self.on

    def end_step(self) -> None:
        self.on = False

    def held_bytes(self) -> int:
        """The largest block's held copies: its 4-bit linears' weights in the compute dtype, twice where the
        weights' dtype differs from it (the backward's copy is theirs, cast)."""
        return max((_block_held_bytes(layer) for layer in self.executor.layers), default=0)

    def _fits_free(self, hidden: torch.Tensor, micro_batches: int) -> bool:
        """Without a plan, at the first step: on CUDA, whether the free memory beside the rest of the step and
        the margin (:meth:`~poros.stream.recompute_choice.RecomputeChoice.free_beside_step`) holds the copy."""
        if self._free is None:
            choice = getattr(self.executor, "recompute", None) if hidden.device.type == "cuda" else None
            self._free = (choice is not None and choice.estimate is not None
                          and choice.free_beside_step(hidden, micro_batches) >= self.held_bytes())
        return self._free

    # -- one block phase ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, index: int):
        """Around one phase of block ``index`` (its M forwards, or its M recomputes and backwards): its 4-bit
        linears compute with weights dequantized once, dropped at the end. A no-op when the step is off."""
        if not self.on:
            yield
            return
        import bitsandbytes

        if index not in self._block_states:  # the same QuantState objects across fetches (the store restores them)
            self._block_states[index] = frozenset(id(p.quant_state) for p in self.executor.layers[index].parameters()
                                                  if getattr(p, "quant_state", None) is not None)
        self._states = self._block_states[index]
        self.held, self._original = {}, bitsandbytes.matmul_4bit
        bitsandbytes.matmul_4bit = self.matmul_4bit
        try:
            yield
        finally:
            bitsandbytes.matmul_4bit = self._original
            self.held, self._states = None, frozenset()

    def matmul_4bit(self, A, B, quant_state, out=None, bias=None):  # noqa: N803
        """``bitsandbytes.matmul_4bit`` while a phase runs: the held block's products with its held weights."""
        if self.held is None or out is not None or id(quant_state) not in self._states or not _follows(A, quant_state):
            return self._original(A, B, quant_state, out=out, bias=bias)
        B = B.view(-1, 1)  # noqa: N806 (bitsandbytes' canonical [(N*K+1)//2, 1])
        if through_matmul4bit(A, bias):
            return _HeldMatMul4Bit.apply(A, B, None, bias, quant_state, self)
        return self.product(A, B, quant_state, bias)

    def forward_product(self, A, B, quant_state, bias):  # noqa: N803
        """:meth:`product`, or for the product :attr:`skipping` names (once) an uninitialized output of its shape:
        a recompute's last product, whose output no saved tensor reads (``poros.stream.recompute_tail``)."""
        if quant_state is not self.skipping:
            return self.product(A, B, quant_state, bias)
        self.skipping = None
        return self.tail.leave_out(A, quant_state)

    def product(self, A, B, quant_state, bias):  # noqa: N803
        """``torch.ops.bitsandbytes.gemm_4bit`` on ``A``'s device, its dequantization held."""
        if A.device.type == "cuda" and _cuda_takes_fused(A, quant_state):
            return _gemm_4bit(A, B, quant_state, bias)
        weight = self._weight(quant_state, A.dtype, A.dtype, lambda: _dequantize(B, quant_state, A.dtype))
        return torch.nn.functional.linear(A, weight, bias)

    def backward_weight(self, B, quant_state, dtype: torch.dtype) -> torch.Tensor:  # noqa: N803
        """``F.dequantize_4bit(B, state).to(dtype)``, held while the block's phase runs."""
        from bitsandbytes import functional

        return self._weight(quant_state, quant_state.dtype, dtype,
                            lambda: functional.dequantize_4bit(B, quant_state).to(dtype))

    def _weight(self, quant_state: Any, dequantized: torch.dtype, dtype: torch.dtype, make) -> torch.Tensor:
        """The held copy of ``quant_state``'s weight dequantized to ``dequantized`` and cast to ``dtype``; the
        first asker of the phase makes it as bitsandbytes would (``make``). Outside a phase, made each time."""
        held = self.held if id(quant_state) in self._states else None
        if held is None:
            return make()
        key = (id(quant_state), dequantized, dtype)
        if key not in held:
            held[key] = make()
        return held[key]


def _follows(A: torch.Tensor, quant_state: Any) -> bool:  # noqa: N803
    """Whether ``matmul_4bit`` would take the path this module follows for ``A`` (else bitsandbytes runs it)."""
    if not takes_gemm_4bit(A, quant_state):
        return False
    if A.device.type == "cuda":
        return _cuda_ops() is not None
    key = {"cpu": "CPU"}.get(A.device.type)  # the default kernel where the device registers none
    return key is not None and not torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::gemm_4bit", key)


@functools.cache
def _cuda_ops() -> Any:
    """bitsandbytes' CUDA backend module with the dispatch this module follows, or None (found once: every
    4-bit product of a held phase asks)."""
    try:
        from bitsandbytes.backends.cuda import ops
    except ImportError:
        return None
    needed = ("_gemm_4bit_use_custom_fn", "_gemm_4bit_custom_max_m")
    return ops if all(hasattr(ops, name) for name in needed) else None


def _cuda_takes_fused(A: torch.Tensor, quant_state: Any) -> bool:  # noqa: N803
    """bitsandbytes' CUDA ``gemm_4bit`` choice: its fused kernel (True), or dequantize and ``F.linear``.
    A K not a multiple of the blocksize counts as fused: bitsandbytes warns and falls back itself."""
    ops = _cuda_ops()
    K = A.shape[-1]  # noqa: N806
    M, N = A.numel() // K, quant_state.shape[0]  # noqa: N806
    if M > ops._gemm_4bit_custom_max_m:
        return False
    return K % quant_state.blocksize != 0 or bool(ops._gemm_4bit_use_custom_fn(A.device.index, A.dtype, M, N, K))


def _absmax(quant_state: Any) -> torch.Tensor:
    """The block scales as ``gemm_4bit`` reconstructs them (nested: the 8-bit absmax dequantized, plus the offset)."""
    if not quant_state.nested:
        return quant_state.absmax
    state2 = quant_state.state2
    return torch.ops.bitsandbytes.dequantize_blockwise.default(
        quant_state.absmax, state2.absmax, state2.code, 256, torch.float32) + quant_state.offset


def _dequantize(B: torch.Tensor, quant_state: Any, dtype: torch.dtype) -> torch.Tensor:  # noqa: N803
    """``gemm_4bit``'s ``B_dq``: the weight ``[N, K]`` dequantized straight to ``dtype``."""
    return torch.ops.bitsandbytes.dequantize_4bit.default(B, _absmax(quant_state), quant_state.blocksize,
                                                          quant_state.quant_type, quant_state.shape, dtype)


def _gemm_4bit(A: torch.Tensor, B: torch.Tensor, quant_state: Any,  # noqa: N803
               bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.bitsandbytes.gemm_4bit`` called as ``matmul_4bit`` calls it."""
    op = torch.ops.bitsandbytes.gemm_4bit.default
    if not quant_state.nested:
        return op(A, B, quant_state.shape, quant_state.absmax, quant_state.blocksize, quant_state.quant_type,
                  bias=bias)
    return op(A, B, quant_state.shape, quant_state.state2.absmax, quant_state.blocksize, quant_state.quant_type,
              bias=bias, absmax_8bit=quant_state.absmax, absmax_code=quant_state.state2.code,
              absmax_offset=quant_state.offset)


def _block_held_bytes(layer: torch.nn.Module) -> int:
    total = 0
    for module in layer.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is None or len(getattr(state, "shape", ())) != 2:
            continue
        compute = getattr(module, "compute_dtype", None) or state.dtype
        size = torch.empty((), dtype=compute).element_size()
        total += state.shape[0] * state.shape[1] * size * (1 if compute == state.dtype else 2)
    return total


__all__ = ["DequantizeOnce"]

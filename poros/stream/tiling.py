"""``mlp_chunks``: each decoder block's per-token parts over N chunks of the sequence ("tiled MLP"), both ways.

A decoder block's MLP is per token: ``down(act(gate(x)) * up(x))`` on every position alone. Its
intermediate activations are ``batch x seq x intermediate_size`` (3.4x to 8x the hidden size),
and resident autograd keeps several of them for backward: at long sequences they are the largest
part of one block's working set. With ``mlp_chunks=N`` the MLP runs over ``N`` contiguous
sequence chunks (:func:`~poros.stream.chunked_head.chunk_bounds`), in one autograd node that saves
only its input::

    forward   x ─▶ [chunk 0: mlp] [chunk 1: mlp] ... ─▶ out      (no grad inside; nothing kept but x)
    backward  for each chunk in order: recompute mlp(x[c]) with grad, back-propagate grad_out[c]
              -> grad_x[c]; each trainable parameter's gradient summed over the chunks in order

so only one chunk's intermediates is ever alive, in the streamed forward, in its recompute and in
backward.

The block's other per-token modules (``descriptor.per_token``: its norms and its attention or
linear-attention projections) are tiled the same way with the same N, each in a node of its own: at
long sequences their fp32 temporaries are most of what is left -- an RMSNorm saves its input upcast to
fp32 and its backward holds five more fp32 copies, and PEFT casts each LoRA'd projection's input to the
fp32 LoRA dtype and keeps that copy for lora_A's gradient (q, k and v one copy each). Tiled, a node
keeps only its compute-dtype input (q, k and v the same tensor) and makes one chunk's fp32 copies at a
time in backward. Each is recomputed once more in backward (a projection's forward again, a fraction
of the block's compute). A tiled module's trainable parameters (the LoRA adapters on the MLP's and the
attention's projections) are inputs of its node and their gradients its outputs (a parameter's
accumulator runs once per backward, as resident).

Labelled honestly:

* **Bitwise** against a resident run with the same ``mlp_chunks``: the node is the same and its
  inputs are bitwise the same (``tests/test_tiling.py`` checks every family with ``torch.equal``).
* **Not bitwise** against the untiled MLP: the matmuls see ``tokens / N`` rows, and a weight's
  gradient is a sum of N chunk products instead of one product over all tokens (another
  summation order), so its last bits may differ.

Where the MLP is (``descriptor.mlp``, relative to a decoder layer) is a descriptor fact; what else
in a block is sequence-proportional and not tiled is too (``descriptor.mlp_untiled``, e.g. a block's
MoE experts, which route all tokens of the block together). Install it with :func:`tile_mlp` on any
model (HF, PEFT or Poros; resident or streamed): it sets each MLP instance's ``forward`` and
:meth:`TiledMlp.remove` takes it away again. Dropout inside the MLP (LoRA dropout) draws the same
masks in the recompute (the forward's RNG state is replayed, as for a block's recompute), and the
recompute runs under the forward's autocast state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from poros.adapters import causal_lm_of
from poros.descriptor import resolve_path
from poros.errors import ConfigError, DescriptorError
from poros.stream.chunked_head import chunk_bounds
from poros.stream.dropout import dropout_modules
from poros.stream.replay import autocast_state, replayed_autocast, restored_rng, rng_state


def _run_chunks(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                bounds: list[tuple[int, int]]) -> torch.Tensor:
    """``run`` on each sequence chunk of ``x`` (``[..., seq, hidden]``, sequence at dim -2), written into one output."""
    out = None
    for start, end in bounds:
        part = run(x[..., start:end, :].contiguous())
        if out is None:
            out = part.new_empty((*x.shape[:-2], x.shape[-2], part.shape[-1]))
        out[..., start:end, :] = part
    return out


class _TiledMlpFunction(torch.autograd.Function):
    """``cat_c run(x[c])`` with only ``x`` saved; each chunk recomputed and back-propagated in backward."""

    @staticmethod
    def forward(ctx, run, bounds, replay, x: torch.Tensor, *parameters: nn.Parameter):
        ctx.run, ctx.bounds, ctx.replay, ctx.parameters = run, bounds, replay, parameters
        ctx.save_for_backward(x)
        return _run_chunks(run, x, bounds)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        x_needs_grad = ctx.needs_input_grad[3]
        wanted = [p for p, needs in zip(ctx.parameters, ctx.needs_input_grad[4:]) if needs]
        totals: dict[int, torch.Tensor] = {}
        grad_x = torch.empty_like(x) if x_needs_grad else None
        rng, autocast = ctx.replay
        with torch.enable_grad(), restored_rng(rng, x.device), replayed_autocast(autocast, x.device):
            for start, end in ctx.bounds:
                piece = x[..., start:end, :].detach().contiguous().requires_grad_(x_needs_grad)
                part = ctx.run(piece)
                targets = ([piece] if x_needs_grad else []) + wanted
                grads = torch.autograd.grad(part, targets, grad_out[..., start:end, :], allow_unused=True)
                if x_needs_grad:
                    grad_x[..., start:end, :] = grads[0]
                    grads = grads[1:]
                for parameter, grad in zip(wanted, grads):  # summed over the chunks in chunk order
                    if grad is not None:
                        known = totals.get(id(parameter))
                        totals[id(parameter)] = grad if known is None else known + grad
        parameter_grads = [totals.get(id(p)) for p in ctx.parameters]
        return (None, None, None, grad_x, *parameter_grads)


def tiled_forward(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], chunks: int,
                  x: torch.Tensor) -> torch.Tensor:
    """``run(x)`` (``module``'s own forward) over ``chunks`` sequence chunks of ``x``, saving only ``x``
    for backward when anything needs a gradient."""
    bounds = chunk_bounds(x.shape[-2], chunks)
    parameters = [p for p in module.parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or parameters):
        return _run_chunks(run, x, bounds)
    draws = module.training and dropout_modules(module)  # RNG replayed only where something draws
    replay = (rng_state(x.device) if draws else None, autocast_state(x.device))
    return _TiledMlpFunction.apply(run, bounds, replay, x, *parameters)


@dataclass
class TiledMlp:
    """The tiled MLPs of one causal LM; :meth:`remove` gives each its own forward back."""

    causal_lm: nn.Module
    chunks: int
    modules: list[nn.Module]
    untiled: str | None  # what in a block is sequence-proportional and not tiled, with the reason (or None)

    def remove(self) -> None:
        for module in self.modules:
            _untile(module)

    def retile(self) -> int:
        """Tile again each module whose forward was rebound over the tiled one since (HF's ``Trainer`` applies
        Liger's kernels again when ``train()`` starts): the new forward, tiled. Returns how many were."""
        replaced = [m for m in self.modules if getattr(m.__dict__.get("forward"), "_poros_tiled", None) is not m]
        for module in replaced:
            _tile(module, self.chunks)
        return len(replaced)


def _untile(module: nn.Module) -> None:
    """``module``'s forward before :func:`tile_mlp`: its own instance forward (e.g. Liger's), else its class's."""
    forward = module.__dict__.get("forward")
    if getattr(forward, "_poros_tiled", None) is module:
        if forward._poros_inner is None:
            module.__dict__.pop("forward")
        else:
            module.__dict__["forward"] = forward._poros_inner
    module.__dict__.pop("_poros_mlp_chunks", None)


def _tile(module: nn.Module, chunks: int) -> None:
    """Tile ``module``'s current forward (an instance forward such as Liger's stays what runs, per chunk)."""
    inner = module.__dict__.get("forward")
    tiled = _bound_tiled(module, module.forward, chunks)
    tiled._poros_tiled, tiled._poros_inner = module, inner
    module.forward = tiled
    module._poros_mlp_chunks = chunks


def _resolve_or_none(layer: nn.Module, path: str) -> nn.Module | None:
    try:
        found = resolve_path(layer, path)
    except DescriptorError:  # another layer kind's module
        return None
    return found if isinstance(found, nn.Module) else None  # a projection a layer sets to None


def per_token_modules(causal_lm: nn.Module, descriptor: Any) -> list[nn.Module]:
    """Each decoder layer's per-token modules beside its MLP (``descriptor.per_token``), those the layer has
    (another layer kind's projections, or one a layer sets to None, are skipped)."""
    found = []
    for layer in resolve_path(causal_lm, descriptor.decoder_layers):
        found.extend(m for m in (_resolve_or_none(layer, path) for path in descriptor.per_token) if m is not None)
    return found


def mlp_modules(causal_lm: nn.Module, descriptor: Any) -> list[nn.Module]:
    """Each decoder layer's MLP module (``descriptor.mlp`` resolved on every layer of ``descriptor.decoder_layers``).

    Raises:
        ConfigError: the family names no MLP (``descriptor.mlp`` is empty).
        DescriptorError: a layer lacks the path.
    """
    if not descriptor.mlp:
        raise ConfigError(f"mlp_chunks: the {descriptor.name} descriptor names no per-token MLP (its mlp field is "
                          "empty), so there is nothing to tile. Fix: mlp_chunks: 1 for this model.")
    return [resolve_path(layer, descriptor.mlp) for layer in resolve_path(causal_lm, descriptor.decoder_layers)]


def tile_mlp(model: nn.Module, chunks: int) -> TiledMlp:
    """Run every decoder block's MLP and other per-token modules of ``model`` over ``chunks`` sequence chunks (see the
    module docstring).

    Args:
        model: an HF causal LM of a registered family, a PEFT model around one, either prepared or not.
        chunks: sequence chunks (>= 1; with 1 the MLPs keep their own forward: nothing is installed).

    Returns:
        The :class:`TiledMlp` handle (``remove()`` undoes it); installing again replaces the chunk count.

    Raises:
        ConfigError: ``chunks`` < 1, or the family names no MLP.
        UnknownArchitectureError: the model's family is not registered.
    """
    from poros import registry

    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(f"mlp_chunks={chunks!r}: expected an integer >= 1 (1: the MLP over the whole sequence). "
                          "Fix: e.g. mlp_chunks: 8.")
    causal_lm = getattr(model, "causal_lm", None) or causal_lm_of(model)  # a prepared model knows its own
    descriptor = getattr(model, "descriptor", None) or registry.for_config(causal_lm.config)
    modules = mlp_modules(causal_lm, descriptor) + per_token_modules(causal_lm, descriptor)
    for module in modules:
        _untile(module)  # the module's own forward again (an earlier tiling undone), then tiled over it
        if chunks > 1:
            _tile(module, chunks)
    return TiledMlp(causal_lm, chunks, modules if chunks > 1 else [],
                    descriptor.mlp_untiled_reason(causal_lm.config.get_text_config()))


def _bound_tiled(module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], chunks: int):
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:  # not the one-tensor call the descriptor promises: run it whole
            return run(x, *args, **kwargs)
        return tiled_forward(module, run, chunks, x)
    return forward


__all__ = ["TiledMlp", "mlp_modules", "per_token_modules", "tile_mlp", "tiled_forward"]

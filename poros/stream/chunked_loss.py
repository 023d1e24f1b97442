"""``loss_chunks``: the causal-LM head and loss over N chunks of tokens, each chunk recomputed in backward.

With labels, the causal LM's forward runs its head one token chunk at a time
(:mod:`poros.stream.chunked_head`): ``lm_head``, the soft-capping and the fp32 cross-entropy of one chunk,
recomputed in backward, so neither the whole logits nor their gradient ever exist, and the forward's
output carries ``loss`` and ``logits=None``. The loss function installed beside it (below) serves the
calls that run the model's own forward (``logits_to_keep``, a family's own router aux loss): there

HF's ``ForCausalLMLoss`` upcasts all ``tokens x vocab`` logits to fp32 at once and
``cross_entropy`` keeps an fp32 log-softmax of all of them for backward; its backward holds
that, the fp32 gradient it receives and the fp32 gradient it makes. With ``loss_chunks=N`` the
loss is the sum of N chunk losses (tokens in order), each computed in forward without keeping
anything and recomputed in backward one chunk at a time, so only ``1/N`` of that fp32 working set
is ever alive (the logits in the compute dtype and their gradient remain on that path).

Labelled honestly:

* **Bitwise** against a resident run with the same ``loss_chunks`` (the function is the same and
  its inputs are bitwise the same; ``tests/test_chunked_loss.py`` checks every family with
  ``torch.equal``).
* **Numerical** against HF's default loss: the per-token losses are the same kernels, but they
  are summed chunk by chunk instead of in one reduction, so the last bits of the loss and of the
  gradients may differ (the test states the tolerance it sees).

Install it with :func:`use_chunked_loss` on the model (HF, PEFT or Poros; resident or streamed);
it installs the chunked-head ``forward`` on the causal LM instance, replaces its ``loss_function``
(HF's own hook), and :meth:`ChunkedLoss.remove` puts the previous ones back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poros.adapters import causal_lm_of
from poros.errors import ConfigError
from poros.stream.chunked_head import chunk_bounds, install_chunked_head, reduce_loss

_UNSET = object()


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """``sum_c cross_entropy(logits[c].float(), labels[c], reduction="sum")``, chunk by chunk both ways."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunks: int, ignore_index: int):
        bounds = chunk_bounds(logits.shape[0], chunks)
        total = None
        for start, end in bounds:
            part = nn.functional.cross_entropy(logits[start:end].float(), labels[start:end],
                                               ignore_index=ignore_index, reduction="sum")
            total = part if total is None else total + part
        ctx.save_for_backward(logits, labels)
        ctx.bounds, ctx.ignore_index = bounds, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start, end in ctx.bounds:
            with torch.enable_grad():
                piece = logits[start:end].detach().requires_grad_()
                part = nn.functional.cross_entropy(piece.float(), labels[start:end], ignore_index=ctx.ignore_index,
                                                   reduction="sum")
                (grad_piece,) = torch.autograd.grad(part, piece, grad_total)
            grad_logits[start:end] = grad_piece
        return grad_logits, None, None, None


def chunked_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
                           num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                           shift_labels: torch.Tensor | None = None, *, chunks: int, **kwargs: Any) -> torch.Tensor:
    """HF ``ForCausalLMLoss``'s signature and meaning (shifted labels, sum over ``num_items_in_batch``
    or the mean over the labelled tokens), computed over ``chunks`` chunks of tokens."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    total = _ChunkedCrossEntropySum.apply(logits, shift_labels, chunks, ignore_index)
    return reduce_loss(total, shift_labels, num_items_in_batch, ignore_index)


@dataclass
class ChunkedLoss:
    """The installed chunked head and loss of one causal LM; :meth:`remove` restores the previous ``forward``
    and ``loss_function``."""

    causal_lm: nn.Module
    chunks: int
    previous: Any
    head: Any = None  # the ChunkedHead, when chunks > 1

    def remove(self) -> None:
        if self.head is not None:
            self.head.remove()
        if self.previous is _UNSET:
            self.causal_lm.__dict__.pop("_loss_function", None)
        else:
            self.causal_lm._loss_function = self.previous


def use_chunked_loss(model: nn.Module, chunks: int) -> ChunkedLoss:
    """Compute ``model``'s head and loss over ``chunks`` chunks of tokens (see the module docstring).

    Args:
        model: an HF causal LM, a PEFT model around one, either prepared or not.
        chunks: token chunks (>= 2; the loss is HF's own with 1, so nothing is installed then).

    Raises:
        ConfigError: ``chunks`` < 1, or the model's loss is not HF's causal-LM loss (another loss
            would be silently replaced).
    """
    from transformers.loss.loss_utils import LOSS_MAPPING

    if not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"loss_chunks={chunks!r}: expected an integer >= 1 (1: HF's own loss). Fix: e.g. "
                          "loss_chunks: 8.")
    causal_lm = getattr(model, "causal_lm", None) or causal_lm_of(model)  # a prepared model knows its own
    current = getattr(causal_lm, "loss_function", None)
    already_chunked = getattr(current, "func", None) is chunked_causal_lm_loss
    if current is not LOSS_MAPPING["ForCausalLM"] and not already_chunked:
        raise ConfigError(f"loss_chunks={chunks}: {type(causal_lm).__name__}'s loss is {current!r}, not HF's "
                          "ForCausalLMLoss, so a chunked causal-LM loss would replace a different loss. Fix: "
                          "loss_chunks: 1 for this model.")
    previous = causal_lm.__dict__.get("_loss_function", _UNSET)
    if chunks == 1:
        return ChunkedLoss(causal_lm, chunks, previous)
    causal_lm.loss_function = functools.partial(chunked_causal_lm_loss, chunks=chunks)
    return ChunkedLoss(causal_lm, chunks, previous, install_chunked_head(causal_lm, chunks))

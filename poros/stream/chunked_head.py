"""``loss_chunks`` > 1 with labels: the causal LM's head runs one token chunk at a time, so the whole logits never exist.

HF's forward projects every token through ``lm_head`` before its ``loss_function`` sees them: at 32K tokens
and a 152K vocabulary that is ~10 GB of bf16 logits, and as much again for their gradient. The forward
installed here (an instance-level ``forward`` on the causal LM, so a resident HF / PEFT model and a
prepared one run the same code) runs the backbone (``getattr(causal_lm, causal_lm.base_model_prefix)``),
then for each of ``chunks`` token chunks: ``lm_head(hidden[chunk])``, the family's final-logit soft-capping
when its text config has ``final_logit_softcapping`` (HF's op order: ``/ cap``, ``tanh``, ``* cap``, in the
logits dtype), and the fp32 cross-entropy sum of the chunk. Each chunk is a non-reentrant
``torch.utils.checkpoint``: forward keeps only its inputs, backward recomputes it, so one chunk's logits and
their gradient are alive at a time; whatever ``lm_head`` is (a plain linear, PEFT's ``modules_to_save`` copy,
a LoRA layer) gets its gradients from the recomputation as it would from HF's forward.

The loss keeps HF's ``ForCausalLMLoss`` meaning (shifted ``labels`` or given ``shift_labels``,
``ignore_index``, the sum over ``num_items_in_batch`` or the mean over the labelled tokens). The output is
the family's own output class with ``loss`` and ``logits=None`` (as TRL's fused head and Liger's fused
linear cross-entropy do). Without labels (generation, eval without labels), with ``logits_to_keep``, with
``return_dict=False`` handled as HF does, and with TRL's ``fused_lm_head=True`` the previous forward runs
unchanged. A MoE model asked for router logits gets HF's load-balancing ``aux_loss`` added as its own forward
adds it; a family whose forward computes it otherwise falls back to its own forward (whole logits), once
warned.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import types
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_UNSET = object()


def chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous token ranges covering ``0..tokens`` (sizes differ by at most one; none empty)."""
    chunks = max(1, min(chunks, tokens))
    size, extra = divmod(tokens, chunks)
    bounds, start = [], 0
    for index in range(chunks):
        end = start + size + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def reduce_loss(total: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None,
                ignore_index: int) -> torch.Tensor:
    """HF's reduction of a summed loss: ``/ num_items_in_batch``, or the mean over the labelled tokens."""
    if num_items_in_batch is None:  # HF's reduction="mean": over the tokens that carry a label
        return total / (shift_labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _chunk_loss(lm_head: nn.Module, rows: torch.Tensor, labels: torch.Tensor, softcap: float | None,
                ignore_index: int) -> torch.Tensor:
    """One chunk: its logits (soft-capped as HF does), the fp32 cross-entropy sum of its labelled tokens."""
    logits = lm_head(rows)
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return nn.functional.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked_head_sum(lm_head: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor, chunks: int,
                     softcap: float | None, ignore_index: int = -100) -> torch.Tensor:
    """``sum_c cross_entropy(softcap(lm_head(hidden[c])).float(), labels[c], reduction="sum")`` over ``chunks``
    token chunks of ``hidden`` (``[..., hidden_size]``, rows aligned with ``shift_labels``), each chunk
    recomputed in backward."""
    from torch.utils.checkpoint import checkpoint

    rows = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(rows.device)
    total = None
    for start, end in chunk_bounds(rows.shape[0], chunks):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss, lm_head, rows[start:end], labels[start:end], softcap, ignore_index,
                              use_reentrant=False)
        else:
            part = _chunk_loss(lm_head, rows[start:end], labels[start:end], softcap, ignore_index)
        total = part if total is None else total + part
    return total


@dataclass
class ChunkedHead:
    """The installed chunked-head forward of one causal LM; :meth:`remove` puts the previous ``forward`` back
    (or, when something patched ``forward`` over it since, turns it into a pass-through)."""

    causal_lm: nn.Module
    chunks: int
    previous: Any
    installed: Callable
    active: bool = True

    def remove(self) -> None:
        self.active = False
        if self.causal_lm.__dict__.get("forward") is not self.installed:
            return  # patched over since (e.g. TRL's fused head): ours stays in its chain, passing through
        if self.previous is _UNSET:
            del self.causal_lm.__dict__["forward"]
        else:
            self.causal_lm.forward = self.previous


def _output_class(cls_forward: Callable) -> type:
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    returned = inspect.signature(cls_forward).return_annotation
    return returned if isinstance(returned, type) and issubclass(returned, ModelOutput) else CausalLMOutputWithPast


def _aux_loss_function(causal_lm: nn.Module) -> Callable | None:
    """HF's ``load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` of the family's
    modeling module, when the causal LM has what its forward passes it (else None: not computed here)."""
    function = getattr(sys.modules.get(type(causal_lm).__module__), "load_balancing_loss_func", None)
    needed = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    return function if function is not None and all(hasattr(causal_lm, name) for name in needed) else None


def install_chunked_head(causal_lm: nn.Module, chunks: int) -> ChunkedHead:
    """Make ``causal_lm``'s forward run its head and loss over ``chunks`` token chunks when it gets labels
    (see the module docstring); the returned handle's :meth:`ChunkedHead.remove` undoes it."""
    cls_forward = type(causal_lm).forward
    names = list(inspect.signature(cls_forward).parameters)[1:]
    output_class = _output_class(cls_forward)
    text_config = causal_lm.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    previous = causal_lm.__dict__.get("forward", _UNSET)
    call_previous = causal_lm.forward  # TRL's fused head, when it patched first; else the class's
    warned: list[str] = []

    def fall_back(why: str, args: tuple, kwargs: dict) -> Any:
        if why and why not in warned:
            warned.append(why)
            logger.warning("poros: loss_chunks=%d: %s, so %s's own forward runs (whole logits)", chunks, why,
                           type(causal_lm).__name__)
        return call_previous(*args, **kwargs)

    @functools.wraps(cls_forward)  # the class's signature: generate and the Trainer inspect it
    def forward(self, *args, **kwargs):
        if not handle.active or kwargs.get("fused_lm_head") or (kwargs.get("labels") is None
                                                                and kwargs.get("shift_labels") is None):
            return call_previous(*args, **kwargs)
        if len(args) > len(names):
            return fall_back("", args, kwargs)
        if kwargs.get("logits_to_keep") not in (None, 0):
            return fall_back("logits_to_keep is set", args, kwargs)
        named = {**dict(zip(names, args)), **kwargs}
        named.pop("fused_lm_head", None)
        router = named.get("output_router_logits")
        router = getattr(text_config, "output_router_logits", False) if router is None else router
        aux_function = _aux_loss_function(self) if router else None
        if router and aux_function is None:
            return fall_back("router logits are asked for and this family's aux loss is not HF's "
                             "load_balancing_loss_func", args, kwargs)
        return _chunked_forward(self, named, router, aux_function)

    def _chunked_forward(self, named: dict, router: bool, aux_function: Callable | None) -> Any:
        labels, shift_labels = named.pop("labels", None), named.pop("shift_labels", None)
        num_items, ignore_index = named.pop("num_items_in_batch", None), named.pop("ignore_index", -100)
        return_dict = named.pop("return_dict", None)
        named.pop("logits_to_keep", None)
        if router:
            named["output_router_logits"] = True
        outputs = getattr(self, self.base_model_prefix)(**named)
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        hidden = outputs.last_hidden_state
        total = chunked_head_sum(self.get_output_embeddings(), hidden, shift_labels, chunks, softcap, ignore_index)
        loss = reduce_loss(total, shift_labels.reshape(-1).to(total.device), num_items, ignore_index)
        values = {"loss": loss, "logits": None}
        if aux_function is not None:
            aux_loss = aux_function(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                    named.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
            values.update(loss=loss, aux_loss=aux_loss)
        for field in fields(output_class):
            if field.name not in values:
                values[field.name] = getattr(outputs, field.name, None)
        result = output_class(**{name: value for name, value in values.items()
                                 if name in {f.name for f in fields(output_class)}})
        return result.to_tuple() if return_dict is False else result

    handle = ChunkedHead(causal_lm, chunks, previous, None)
    causal_lm.forward = types.MethodType(forward, causal_lm)
    handle.installed = causal_lm.__dict__["forward"]
    return handle

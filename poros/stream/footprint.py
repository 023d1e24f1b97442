"""What a model puts on the device, in bytes, and the plan for a loaded model.

* **Block bytes are computed, not guessed** (:func:`block_bytes`). On a meta skeleton
  (:func:`meta_skeleton`: ``AutoModelForCausalLM.from_config(text_config)``, real module tree, no
  storage), a linear that transformers' bitsandbytes integration would quantize
  (:func:`quantized_linears`: exact ``nn.Linear``, minus ``get_keys_to_not_convert`` and
  ``_keep_in_fp32_modules``) counts as the packed 4-bit weight (``ceil(numel / 2)`` bytes) plus its
  ``QuantState`` tensors (:func:`quantized_tensor_bytes`): fp32 absmax per 64 values and the
  16-value code table, or with double quantization uint8 absmax, the fp32 offset, fp32 absmax per
  256 absmax values and the 256-value code table. Everything else counts at its dtype. Every
  tensor is padded to the block store's alignment, walked exactly as
  :class:`~poros.stream.store.BlockStore` walks a block, so the result equals the store's host
  buffer sizes (``tests/test_cli_train.py`` checks it on every tiny family).
* **Activations are estimates** (:func:`activation_bytes`): the saved block inputs (exact), one
  block's recompute working set, and the head's logits and loss working set.
* :func:`footprint_of_model` measures a loaded model as a :class:`~poros.stream.planner.Footprint`;
  :func:`plan_for_model` is what ``prepare(vram_budget=...)`` asks; :func:`predict_prepared`
  what the bench records next to its measurements.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import nn

from poros.stream.options import StreamOptions
from poros.stream.placement import graph_reserve_bytes
from poros.stream.planner import (
    CUDA_CONTEXT_BYTES,
    CUDA_WORKSPACE_BYTES,
    BudgetPlan,
    ComputeTimes,
    Footprint,
    Workload,
    copy_bytes_per_step,
    plan_budget,
    predict_peak,
    predict_step,
)
from poros.stream.store import ALIGN, frozen_tensors, packed_block_bytes, shared_tensor_keys

#: bitsandbytes 4-bit block sizes: values per absmax, and absmax values per nested absmax.
QUANT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
CODE_4BIT_VALUES = 16  # the NF4 / FP4 code table (fp32)
CODE_NESTED_VALUES = 256  # the 8-bit dynamic map of double quantization (fp32)


def padded(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` occupies in a block buffer (every tensor starts ALIGN-aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def quantized_tensor_bytes(numel: int, *, double_quant: bool) -> list[int]:
    """Unpadded byte sizes of the tensors bitsandbytes keeps for a 4-bit weight of ``numel`` values.

    ``[packed weight, absmax, code]``; with double quantization
    ``[packed weight, absmax (uint8), code, offset, nested absmax, nested code]``.
    """
    blocks = math.ceil(numel / QUANT_BLOCKSIZE)
    packed = math.ceil(numel / 2)  # two 4-bit values per uint8
    if not double_quant:
        return [packed, 4 * blocks, 4 * CODE_4BIT_VALUES]
    return [packed, blocks, 4 * CODE_4BIT_VALUES, 4, 4 * math.ceil(blocks / NESTED_BLOCKSIZE),
            4 * CODE_NESTED_VALUES]


def meta_skeleton(text_config: Any, compute_dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``text_config`` on the meta device (module tree and shapes, no storage),
    with every tensor frozen as in a QLoRA base."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(text_config, dtype=compute_dtype)
    model.requires_grad_(False)
    return model


def quantized_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears bitsandbytes would quantize on load, by name: transformers' own rule
    (``replace_with_bnb_linear``: exact ``nn.Linear``, skipping the output embedding, tied weights,
    the last module and ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    keep = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and should_convert_module(name, keep)}


def block_bytes(blocks: list[nn.Module], quantized_weights: set[int], *, double_quant: bool) -> list[int]:
    """Host-store bytes of each block, as :class:`~poros.stream.store.BlockStore` packs it.

    Args:
        blocks: the decoder layers of a (meta) skeleton, frozen.
        quantized_weights: ``id`` of every weight parameter that is stored 4-bit.
        double_quant: the QuantStates carry nested statistics.
    """
    shared = shared_tensor_keys(blocks)  # stays where it is, as in the store
    sizes = []
    for block in blocks:
        total = 0
        for _, owner, attr, _, tensor in frozen_tensors(block):
            if (id(owner), attr) in shared:
                continue
            if id(owner) in quantized_weights:
                total += sum(padded(n) for n in quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
            else:
                total += padded(tensor.numel() * tensor.element_size())
        sizes.append(total)
    return sizes


def tensor_bytes(tensor: torch.Tensor, quantized_weights: set[int], double_quant: bool) -> int:
    """Unpadded bytes of ``tensor``: its packed 4-bit form and quantization state when its ``id`` is
    in ``quantized_weights``, else its dtype's."""
    if id(tensor) in quantized_weights:
        return sum(quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
    return tensor.numel() * tensor.element_size()


#: bytes per value of the loss head beyond the logits themselves: HF's ForCausalLMLoss upcasts the
#: logits to fp32 and cross_entropy saves its fp32 log-softmax; its backward holds that, the fp32
#: gradient it receives and the fp32 gradient it makes (4 + 4 + 4) before the cast back.
LOSS_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class BlockShapes:
    """What the activation estimates read from a model's decoder blocks (base linears, not LoRA's)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    linear_outputs: int  # sum of the out_features of the largest block's base linears
    largest_linear: int  # in_features x out_features of the largest base linear in any block
    logit_softcapping: bool  # final logits soft-capped (final_logit_softcapping): two more logit-sized tensors

    @classmethod
    def of(cls, blocks: list[nn.Module], text_config: Any) -> "BlockShapes":
        """From decoder layers (a meta skeleton or a loaded PEFT + bitsandbytes model) and their config."""
        def base_linears(block):
            return [m for name, m in block.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name]

        config = text_config.to_dict()  # a plain read: some configs are per-layer
        return cls(
            hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
            num_attention_heads=config.get("num_attention_heads") or 1,
            linear_outputs=max((sum(m.out_features for m in base_linears(b)) for b in blocks), default=0),
            largest_linear=max((m.in_features * m.out_features for b in blocks for m in base_linears(b)), default=0),
            logit_softcapping=bool(config.get("final_logit_softcapping")),
        )


def activation_bytes(shapes: BlockShapes, *, batch_size: int, seq_len: int, value_bytes: int,
                     attn_implementation: str | None, loss_chunks: int = 1) -> tuple[int, int, int]:
    """``(boundary, recompute, head)`` bytes of one micro-batch (estimates, except the boundary).

    * boundary: one block's input hidden states, ``batch x seq x hidden`` values (exact).
    * recompute: what recomputing one block with grad and back-propagating it holds at once: per
      token the two RMSNorms' fp32 input and normalised copies and their cast (``2 x (8 + v) x
      hidden`` bytes), every base linear's output and what the next op derives from it (rotary,
      activation, gate product: ``2 x v x sum(out_features)``); plus the largest 4-bit weight
      dequantized to the compute dtype (bitsandbytes dequantizes one weight at a time, in forward
      and again in backward); plus, for eager attention, scores, probabilities and their gradient.
    * head: the logits in the compute dtype plus the fp32 loss working set
      (:data:`LOSS_BYTES_PER_LOGIT`); soft-capped logits keep two more logit-sized tensors. With
      ``loss_chunks`` N > 1 (:mod:`poros.stream.chunked_loss`): the logits and their gradient in
      the compute dtype, and the fp32 working set of one chunk.
    """
    tokens = batch_size * seq_len
    boundary = tokens * shapes.hidden_size * value_bytes
    recompute = (tokens * (2 * (8 + value_bytes) * shapes.hidden_size + 2 * value_bytes * shapes.linear_outputs)
                 + shapes.largest_linear * value_bytes)
    if attn_implementation == "eager":
        recompute += 3 * batch_size * shapes.num_attention_heads * seq_len * seq_len * value_bytes
    logits = tokens * shapes.vocab_size
    loss = (logits * LOSS_BYTES_PER_LOGIT if loss_chunks == 1
            else logits * value_bytes + -(-logits // loss_chunks) * LOSS_BYTES_PER_LOGIT)
    head = logits * value_bytes + loss + (2 * logits * value_bytes if shapes.logit_softcapping else 0)
    return boundary, recompute, head


def footprint_of_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module],
                       workload: Workload, *, device: torch.device, compute_dtype: torch.dtype,
                       block_bytes: Iterable[int] | None = None) -> Footprint:
    """The :class:`Footprint` of a loaded HF + bitsandbytes + PEFT model.

    Block bytes are the block store's (exact; computed from the modules unless ``block_bytes``
    gives them, as after packing); the frozen tensors outside the blocks at their allocated size,
    ``host_tables``' among them as the embedding tables that may live on the host; the LoRA bytes
    are the trainable parameters'.
    """
    in_blocks = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    outside = {id(t): t for t in [*causal_lm.parameters(), *causal_lm.buffers()]
               if id(t) not in in_blocks and not t.requires_grad}
    tables = {id(t) for table in host_tables for t in [*table.parameters(), *table.buffers()]}
    config = causal_lm.config.get_text_config()
    boundary, recompute, head = activation_bytes(
        BlockShapes.of(layers, config), batch_size=workload.batch_size, seq_len=workload.seq_len,
        value_bytes=torch.empty((), dtype=compute_dtype, device="meta").element_size(),
        attn_implementation=getattr(config, "_attn_implementation", None), loss_chunks=workload.loss_chunks)
    return Footprint(
        block_bytes=tuple(packed_block_bytes(layers) if block_bytes is None else block_bytes),
        device_non_block_bytes=sum(t.numel() * t.element_size() for k, t in outside.items() if k not in tables),
        host_embedding_bytes=sum(t.numel() * t.element_size() for k, t in outside.items() if k in tables),
        lora_parameter_bytes=sum(p.numel() * p.element_size() for p in causal_lm.parameters() if p.requires_grad),
        boundary_bytes=boundary, recompute_bytes=recompute, head_bytes=head,
        workspace_bytes=CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0,
    )

def predict_prepared(model: Any, workload: Workload, *, compute: ComputeTimes | None = None,
                     link_bytes_per_s: float | None = None, optimizer_states: str = "device") -> dict[str, Any]:
    """What the planner predicts for a :class:`~poros.dropin.model.PorosModel` as :func:`poros.prepare` set it
    up (its slots, resident blocks and embedding placement; AdamW's state where the run keeps it): the peak and its parts, the copy bytes
    per step, and with compute times and a link the step. ``tools/bench.py`` records it next to
    what it measures."""
    store = model.store
    device = store.device
    compute_dtype = getattr(torch, model.detection.compute_dtype, torch.float32) if model.detection else torch.float32
    footprint = footprint_of_model(model.causal_lm, list(model.executor.layers),
                                   [table.module for table in model.host_tables], workload, device=device,
                                   compute_dtype=compute_dtype, block_bytes=[b.nbytes for b in store.blocks])
    resident = store.resident_blocks
    slots = max(store.num_slots, 1)
    peak = predict_peak(footprint, workload, resident=resident, num_slots=slots,
                        embeddings_on_host=bool(model.host_tables),
                        boundary_on_host=model.executor.boundary_states in ("host", "disk"),
                        optimizer_on_host=optimizer_states == "host",
                        lora_on_host=getattr(model, "lora_placement", None) is not None)
    step = None
    if compute is not None and link_bytes_per_s:
        step = predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s, resident=resident,
                            num_slots=slots).to_dict()
    return {"peak_allocated_bytes": peak.total, "peak": peak.to_dict(), "resident_blocks": list(resident),
            "num_slots": store.num_slots, "copy_bytes_per_step": copy_bytes_per_step(footprint.block_bytes, workload,
                                                                                     resident),
            "link_bytes_per_s": link_bytes_per_s, "step": step,
            "compute": asdict(compute) if compute is not None else None}


def device_context_bytes(footprint: Footprint, device: Any, *, cuda_graphs: bool, num_slots: int) -> int:
    """Device memory a plan counts outside the allocated peak: the CUDA context on a CUDA ``device`` (a
    ``torch.device`` or its string) and, with ``cuda_graphs`` (on for this run: ``graphs.enabled``), the
    graphs' pool and static buffers (``placement.graph_reserve_bytes``). What ``prepare(vram_budget=...)``
    and ``poros plan`` both reserve."""
    context = CUDA_CONTEXT_BYTES if str(getattr(device, "type", device)).startswith("cuda") else 0
    return context + (graph_reserve_bytes(footprint, num_slots) if cuda_graphs else 0)


def plan_for_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module],
                   options: StreamOptions, *, device: torch.device, compute_dtype: torch.dtype) -> BudgetPlan:
    """:func:`plan_budget` for a loaded model and ``options`` (its ``vram_budget`` and ``workload``): what
    ``prepare(vram_budget=...)`` asks; no compute times, so the plan fills the budget with resident
    blocks. With ``options.cuda_graphs`` (prepare passes whether graphs run on its device) the budget also
    holds the graphs' pool and static buffers (``placement.graph_reserve_bytes``), beside the context.

    Raises:
        ConfigError: no workload, an unparsable budget, or one below the minimum.
    """
    workload = options.budget_workload()
    footprint = footprint_of_model(causal_lm, layers, host_tables, workload, device=device,
                                   compute_dtype=compute_dtype)
    context = device_context_bytes(footprint, device, cuda_graphs=options.cuda_graphs is not False,
                                   num_slots=options.num_slots)
    return plan_budget(footprint, workload, options, context_bytes=context)


__all__ = ["LOSS_BYTES_PER_LOGIT", "BlockShapes", "activation_bytes", "block_bytes", "device_context_bytes", "footprint_of_model", "meta_skeleton", "padded", "plan_for_model", "predict_prepared", "quantized_linears", "quantized_tensor_bytes", "tensor_bytes"]

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
* :func:`footprint_of_model` measures a loaded model as a :class:`~poros.plan.budget.Footprint`;
  :func:`plan_for_model` is what ``prepare(vram_budget=...)`` asks; :func:`predict_prepared`
  what the bench records next to its measurements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from typing import Any, Callable, Iterable

import torch
from torch import nn

from poros.plan.entry import cuda_graphs_on, device_context_bytes
from poros.stream.graph_capture import ParameterStatics
from poros.stream.graph_keys import block_structures
from poros.stream.placement import shared_statics_bytes
from poros.stream.options import StreamOptions
from poros.plan.budget import (
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
from poros.stream.store import packed_block_bytes
from poros.plan.block_bytes import (
    block_bytes,
    meta_skeleton,
    padded,
    quantized_linears,
    quantized_tensor_bytes,
    tensor_bytes,
)
from poros.plan.activations import (
    ActivationParts,
    AttentionEstimate,
    BlockShapes,
    GROUPED_NF4_EXPERTS,
    LOSS_BYTES_PER_LOGIT,
    NORM_BACKWARD_FP32_VALUES,
    activation_bytes,
    activation_parts,
    attention_sms,
    attention_working_set,
    deterministic_now,
    grouped_experts_values,
)


def footprint_of_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module],
                       workload: Workload, *, device: torch.device, compute_dtype: torch.dtype,
                       block_bytes: Iterable[int] | None = None, mlp_chunks: int = 1) -> Footprint:
    """The :class:`Footprint` of a loaded HF + bitsandbytes + PEFT model.

    Block bytes are the block store's (exact; computed from the modules unless ``block_bytes``
    gives them, as after packing); the frozen tensors outside the blocks at their allocated size,
    ``host_tables``' among them as the embedding tables that may live on the host; the LoRA bytes
    are the trainable parameters', and the CUDA graphs' shared LoRA buffers the blocks' (by
    ``graph_capture.ParameterStatics``' rule); the block structures those the graphs key apart.
    """
    in_blocks = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    outside = {id(t): t for t in [*causal_lm.parameters(), *causal_lm.buffers()]
               if id(t) not in in_blocks and not t.requires_grad}
    tables = {id(t) for table in host_tables for t in [*table.parameters(), *table.buffers()]}
    shapes, value_bytes, attention = model_shapes(causal_lm, layers, compute_dtype)
    trainable = [[(ParameterStatics.signature(p), p.numel() * p.element_size()) for p in layer.parameters()
                  if p.requires_grad] for layer in layers]
    base = Footprint(
        block_bytes=tuple(packed_block_bytes(layers) if block_bytes is None else block_bytes),
        device_non_block_bytes=sum(t.numel() * t.element_size() for k, t in outside.items() if k not in tables),
        host_embedding_bytes=sum(t.numel() * t.element_size() for k, t in outside.items() if k in tables),
        lora_parameter_bytes=sum(p.numel() * p.element_size() for p in causal_lm.parameters() if p.requires_grad),
        boundary_bytes=0, recompute_bytes=0, head_bytes=0,
        workspace_bytes=CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0,
        attention_sms=attention_sms(device, deterministic_now()),
        block_structures=block_structures(layers),
        lora_statics_bytes=shared_statics_bytes(trainable),
    )
    return with_activations(base, shapes, workload, value_bytes=value_bytes, attn_implementation=attention,
                            mlp_chunks=mlp_chunks)


def model_shapes(causal_lm: nn.Module, layers: list[nn.Module], compute_dtype: torch.dtype) -> tuple[BlockShapes, int, str | None]:
    """``(shapes, bytes per activation value, attn_implementation)`` of a loaded model: what its activations are priced from."""
    config = causal_lm.config.get_text_config()
    return (BlockShapes.of(layers, config, compute_dtype=compute_dtype), torch.empty((), dtype=compute_dtype, device="meta").element_size(),
            getattr(config, "_attn_implementation", None))


def activation_estimate(causal_lm: nn.Module, layers: list[nn.Module]) -> Callable[[torch.Tensor], ActivationParts]:
    """``estimate(hidden)``: the activation parts of one micro-batch whose block inputs are shaped like ``hidden``
    (batch x seq x hidden, its dtype the activations'): what ``recompute="auto"`` prices a kept block with when
    there is no plan (``poros.stream.recompute_choice``)."""
    def estimate(hidden: torch.Tensor) -> ActivationParts:
        shapes, value_bytes, attention = model_shapes(causal_lm, layers, hidden.dtype)
        batch, seq = (hidden.shape[0], hidden.shape[1]) if hidden.dim() >= 3 else (1, hidden.shape[0])
        return activation_parts(shapes, batch_size=batch, seq_len=seq, value_bytes=value_bytes,
                                attn_implementation=attention)
    return estimate


def with_activations(footprint: Footprint, shapes: BlockShapes, workload: Workload, *, value_bytes: int,
                     attn_implementation: str | None, mlp_chunks: int = 1,
                     loss_chunks: int | None = None) -> Footprint:
    """``footprint`` with the activations of ``workload`` (its ``loss_chunks`` unless given) and
    ``mlp_chunks``: what the planner re-prices when it picks chunk counts (:func:`chunked_footprints`)."""
    loss_chunks = workload.loss_chunks if loss_chunks is None else loss_chunks
    parts = activation_parts(shapes, batch_size=workload.batch_size, seq_len=workload.seq_len, value_bytes=value_bytes,
                             attn_implementation=attn_implementation, loss_chunks=loss_chunks, mlp_chunks=mlp_chunks,
                             attention_sms=footprint.attention_sms, packed=workload.packed,
                             fused_loss=workload.fused_loss)
    return dataclasses.replace(footprint, boundary_bytes=parts.boundary, recompute_bytes=parts.recompute,
                               head_bytes=parts.head, kept_bytes=parts.kept, parts=parts.named(),
                               held_weight_bytes=shapes.dequantized_block * value_bytes,
                               expert_scratch_bytes=shapes.dequantized_experts * value_bytes,
                               captured_recompute_bytes=parts.captured_recompute,
                               attention=f"{parts.attention.kernel} ({parts.attention.reason})",
                               loss_chunks=parts.loss_chunks, mlp_chunks=mlp_chunks)


def chunked_footprints(footprint: Footprint, shapes: BlockShapes, workload: Workload, *, value_bytes: int,
                       attn_implementation: str | None):
    """``(loss_chunks, mlp_chunks) -> Footprint``: the planner's ``footprint_for`` (see
    :func:`~poros.plan.budget.plan_budget`)."""
    def footprint_for(loss_chunks: int, mlp_chunks: int) -> Footprint:
        return with_activations(footprint, shapes, workload, value_bytes=value_bytes,
                                attn_implementation=attn_implementation, mlp_chunks=mlp_chunks,
                                loss_chunks=loss_chunks)
    return footprint_for

def predict_prepared(model: Any, workload: Workload, *, compute: ComputeTimes | None = None,
                     link_bytes_per_s: float | None = None, optimizer_states: str = "device") -> dict[str, Any]:
    """What the planner predicts for a :class:`~poros.dropin.model.PorosModel` as :func:`poros.prepare` set it
    up (its slots, resident blocks and embedding placement; AdamW's state where the run keeps it): the peak and its parts, the copy bytes
    per step, and with compute times and a link the step. ``tools/bench/harness.py`` records it next to
    what it measures."""
    store = model.store
    device = store.device
    compute_dtype = getattr(torch, model.detection.compute_dtype, torch.float32) if model.detection else torch.float32
    footprint = footprint_of_model(model.causal_lm, list(model.executor.layers),
                                   [table.module for table in model.host_tables], workload, device=device,
                                   compute_dtype=compute_dtype, block_bytes=[b.nbytes for b in store.blocks],
                                   mlp_chunks=model.executor.options.mlp_chunks)
    resident = store.resident_blocks
    slots = max(store.num_slots, 1)
    footprint = dataclasses.replace(footprint, cuda_graphs=model.executor.graphs is not None)
    peak = predict_peak(footprint, workload, resident=resident, num_slots=slots,
                        embeddings_on_host=bool(model.host_tables),
                        boundary_on_host=model.executor.boundary_states in ("host", "disk"),
                        optimizer_on_host=optimizer_states == "host",
                        lora_on_host=getattr(model, "lora_placement", None) is not None,
                        dequantize_once=model.executor.dequantize.last)
    step = None
    if compute is not None and link_bytes_per_s:
        step = predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s, resident=resident,
                            num_slots=slots).to_dict()
    return {"peak_allocated_bytes": peak.total, "peak": peak.to_dict(), "resident_blocks": list(resident),
            "num_slots": store.num_slots, "copy_bytes_per_step": copy_bytes_per_step(footprint.block_bytes, workload,
                                                                                     resident),
            "link_bytes_per_s": link_bytes_per_s, "step": step,
            "compute": asdict(compute) if compute is not None else None,
            # the sequence-proportional parts per micro-batch, for long-context runs' comparison
            "activation_parts": dict(footprint.parts), "attention": footprint.attention,
            "boundary_states": model.executor.boundary_states,
            "loss_chunks": workload.loss_chunks, "mlp_chunks": footprint.mlp_chunks}


def plan_for_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module],
                   options: StreamOptions, *, device: torch.device, compute_dtype: torch.dtype,
                   cuda_graphs: bool | None = None) -> BudgetPlan:
    """:func:`plan_budget` for a loaded model and ``options`` (its ``vram_budget`` and ``workload``): what
    ``prepare(vram_budget=...)`` asks; no compute times, so the plan fills the budget with resident
    blocks. With CUDA graphs on (``cuda_graphs``, prepare's decision; None: :func:`~poros.plan.entry.cuda_graphs_on`
    of ``options.cuda_graphs`` on ``device``) the budget also holds the graphs' pool and static buffers
    (``placement.graph_reserve_bytes``), beside the context.

    Raises:
        ConfigError: no workload, an unparsable budget, or one below the minimum.
    """
    workload = options.budget_workload()
    footprint = footprint_of_model(causal_lm, layers, host_tables, workload, device=device,
                                   compute_dtype=compute_dtype, mlp_chunks=options.mlp_chunks)
    graphs_on = cuda_graphs_on(options.cuda_graphs, device) if cuda_graphs is None else cuda_graphs
    footprint = dataclasses.replace(footprint, cuda_graphs=graphs_on)  # the chunked ones inherit it
    context = device_context_bytes(footprint, device, cuda_graphs=graphs_on)
    shapes, value_bytes, attention = model_shapes(causal_lm, layers, compute_dtype)
    return plan_budget(footprint, workload, options, context_bytes=context,
                       footprint_for=chunked_footprints(footprint, shapes, workload, value_bytes=value_bytes,
                                                        attn_implementation=attention))


__all__ = ["GROUPED_NF4_EXPERTS", "activation_estimate", "LOSS_BYTES_PER_LOGIT", "NORM_BACKWARD_FP32_VALUES", "ActivationParts", "AttentionEstimate", "BlockShapes", "activation_bytes",
           "activation_parts", "attention_working_set", "chunked_footprints", "model_shapes", "with_activations", "block_bytes", "device_context_bytes", "footprint_of_model", "grouped_experts_values", "meta_skeleton", "padded", "plan_for_model", "predict_prepared", "quantized_linears", "quantized_tensor_bytes", "tensor_bytes"]

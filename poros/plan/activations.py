"""Activations, estimated: one micro-batch's sequence-proportional device bytes by part
(:class:`ActivationParts`, :func:`activation_parts`, :func:`activation_bytes`) from a block's shapes
(:class:`BlockShapes`): the saved block inputs (exact), one block's recompute working set -- the MLP,
the norms, the LoRA inputs and the attention working set of the kernel it takes
(:func:`attention_working_set`; the flash backward's deterministic split, :func:`attention_sms`) -- and
the head's logits and loss working set (:data:`LOSS_BYTES_PER_LOGIT`), each over the chunk counts asked
(``loss_chunks``, ``mlp_chunks``). :mod:`poros.plan.footprint` puts them into a model's footprint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from poros.plan.attention import seq_by_seq_mask_bytes
from poros.plan.budget import Workload


@dataclass(frozen=True)
class BlockShapes:
    """What the activation estimates read from a model's decoder blocks (base linears, not LoRA's)."""

    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    linear_outputs: int  # sum of the out_features of the largest block's base linears
    largest_linear: int  # in_features x out_features of the largest base linear in any block
    logit_softcapping: bool  # final logits soft-capped (final_logit_softcapping): two more logit-sized tensors
    mlp_outputs: int = 0  # the part of linear_outputs under the block's ``mlp`` (what mlp_chunks tiles)
    attention_width: int = 0  # num_attention_heads x head_dim: the attention kernel's output per token
    kv_width: int = 0  # num_key_value_heads x head_dim: one of k, v per token (0: as attention_width)
    # PEFT's LoRA Linear casts its input to the LoRA weights' dtype (``_cast_input_dtype``) when that is not
    # the input's, each wrapped linear its own copy, which lora_A's backward keeps: the in_features of the
    # LoRA'd linears outside and under the MLP, and the LoRA weights' bytes per value (0: no cast)
    lora_attention_inputs: int = 0
    lora_mlp_inputs: int = 0
    lora_value_bytes: int = 0
    # the values of the largest fused MoE expert tensor ``[E, rows, cols]`` that the experts' forward
    # dequantizes whole (``poros_nf4_grouped``: in forward, recompute and backward); 0: none does
    dequantized_experts: int = 0
    # the values of the largest block's 4-bit linear weights, counted twice where the weights' dtype is not the
    # compute dtype: what ``dequantize_once`` holds dequantized for a block phase (``poros.stream.dequantize_once``)
    dequantized_block: int = 0

    @classmethod
    def of(cls, blocks: list[nn.Module], text_config: Any, *, lora_targets: Iterable[str] | None = None,
           lora_value_bytes: int | None = None, compute_dtype: torch.dtype | None = None) -> "BlockShapes":
        """From decoder layers (a meta skeleton or a loaded PEFT + bitsandbytes model) and their config.

        A loaded model's LoRA layers (PEFT's ``lora_A``) and grouped NF4 experts (``poros_nf4`` buffers, the
        config's ``_experts_implementation``) are read from the modules; a skeleton's from ``lora_targets``
        (module names relative to a block) and ``lora_value_bytes``. With ``compute_dtype`` the LoRA input
        cast counts only when the LoRA weights' dtype differs from it."""
        def base_linears(block):
            return [(name, m) for name, m in block.named_modules() if isinstance(m, nn.Linear) and "lora_" not in name]

        def outputs(block, mlp_only: bool) -> int:
            return sum(m.out_features for name, m in base_linears(block) if not mlp_only or "mlp" in name.split("."))

        config = text_config.to_dict()  # a plain read: some configs are per-layer
        heads = config.get("num_attention_heads") or 1
        head_dim = config.get("head_dim") or text_config.hidden_size // heads
        largest = max(blocks, key=lambda b: outputs(b, False), default=None)
        return cls(
            hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
            num_attention_heads=heads,
            linear_outputs=outputs(largest, False) if largest is not None else 0,
            largest_linear=max((m.in_features * m.out_features for b in blocks for _, m in base_linears(b)), default=0),
            logit_softcapping=bool(config.get("final_logit_softcapping")),
            mlp_outputs=outputs(largest, True) if largest is not None else 0,
            attention_width=heads * head_dim,
            kv_width=(config.get("num_key_value_heads") or heads) * head_dim,
            **lora_inputs(largest, lora_targets, lora_value_bytes, compute_dtype),
            dequantized_experts=max((grouped_experts_values(b) for b in blocks), default=0),
            dequantized_block=max((held_values(b, compute_dtype) for b in blocks), default=0),
        )


#: the experts forward (``config._experts_implementation``) that dequantizes each fused expert tensor whole
#: (``poros.loading.experts_grouped``); the ``poros_nf4`` loop dequantizes one expert at a time
GROUPED_NF4_EXPERTS = "poros_nf4_grouped"


def grouped_experts_values(block: nn.Module) -> int:
    """Values of the largest fused expert tensor of ``block`` that its experts' forward dequantizes whole: the
    NF4-packed experts (``poros.quantize_experts``: a ``poros_nf4`` mapping ``name -> (shape[1:], dtype,
    blocksize)`` beside ``{name}_nf4`` codes ``[E, ...]``) whose config names :data:`GROUPED_NF4_EXPERTS`."""
    largest = 0
    for module in block.modules():
        packed = getattr(module, "poros_nf4", None)
        config = getattr(module, "config", None)
        if not isinstance(packed, dict) or getattr(config, "_experts_implementation", None) != GROUPED_NF4_EXPERTS:
            continue
        # the expert count from the module, not the codes' shape: once streamed, the store leaves an empty
        # placeholder in the block (what predict_prepared reads after prepare)
        experts = getattr(module, "num_experts", 0)
        for name, (shape, _, _) in packed.items():
            largest = max(largest, (experts or getattr(module, f"{name}_nf4").shape[0]) * math.prod(shape))
    return largest


def held_values(block: nn.Module, compute_dtype: torch.dtype | None) -> int:
    """Values ``dequantize_once`` holds for one phase of ``block``: each 4-bit base linear's weight (a loaded
    ``Linear4bit``, its ``QuantState``; a meta skeleton's linears, which the load quantizes) in the compute dtype,
    twice where the weights were quantized from another dtype (the backward's copy is dequantized to theirs, then
    cast)."""
    total = 0
    for name, module in block.named_modules():
        if not isinstance(module, nn.Linear) or "lora_" in name:
            continue
        state = getattr(module.weight, "quant_state", None)
        if state is not None:
            total += module.in_features * module.out_features * (1 if compute_dtype in (None, state.dtype) else 2)
        elif module.weight.is_meta:
            total += module.in_features * module.out_features
    return total


def lora_inputs(block: nn.Module | None, targets: Iterable[str] | None, value_bytes: int | None,
                 compute_dtype: torch.dtype | None) -> dict[str, int]:
    """``lora_attention_inputs``, ``lora_mlp_inputs`` and ``lora_value_bytes`` of ``block``: its LoRA'd base
    linears (PEFT's ``lora_A`` beside a ``base_layer``, or the linears whose names end in one of ``targets``)."""
    if block is None:
        return {}
    if targets is None:  # a loaded PEFT model: its LoRA layers
        # linears only (LoRA on fused experts wraps tensors without in_features); AdaLoRA's lora_A are tensors
        wrapped = [(name, m.base_layer, getattr(first, "weight", first).dtype) for name, m in block.named_modules()
                   if hasattr(m, "lora_A") and hasattr(m, "base_layer") and len(m.lora_A)
                   and hasattr(m.base_layer, "in_features") and (first := next(iter(m.lora_A.values()))) is not None]
        value_bytes = max((torch.empty((), dtype=d, device="meta").element_size() for _, _, d in wrapped), default=0)
        casts = any(d != compute_dtype for _, _, d in wrapped) if compute_dtype is not None else bool(wrapped)
    else:
        targets = tuple(targets)
        wrapped = [(name, m, None) for name, m in block.named_modules()
                   if isinstance(m, nn.Linear) and name.split(".")[-1] in targets]
        value_bytes = value_bytes or 0
        casts = bool(wrapped) and (compute_dtype is None or torch.empty((), dtype=compute_dtype, device="meta")
                                   .element_size() != value_bytes)
    if not casts:
        return {}
    inputs = [(name, m.in_features) for name, m, _ in wrapped]
    return {"lora_attention_inputs": sum(n for name, n in inputs if "mlp" not in name.split(".")),
            "lora_mlp_inputs": sum(n for name, n in inputs if "mlp" in name.split(".")),
            "lora_value_bytes": value_bytes}


@dataclass(frozen=True)
class AttentionEstimate:
    """One block's attention working set in recompute and backward, and the kernel it assumes."""

    bytes: int
    kernel: str  # "memory-efficient / flash (no seq x seq tensor)" or "math (eager): seq x seq scores"
    reason: str  # why that kernel, in words
    backward: int = 0  # the flash kernel's backward buffers, alive at once for the one kernel call (0: math)


#: the streaming multiprocessors assumed where a CUDA run is planned without its device (an H100's or
#: H200's 132): FA2's deterministic backward splits its dQ accumulator by them (:func:`attention_sms`)
ASSUMED_SMS = 132


def attention_sms(device: Any, deterministic: bool) -> int:
    """The SM count the flash backward's deterministic dQ accumulator is split by, or 0 where it is not
    split: deterministic algorithms off (``torch.use_deterministic_algorithms(True)`` without
    ``warn_only`` turns PyTorch's flash backward deterministic) or a device other than CUDA. A CUDA device
    this process sees gives its own count, else :data:`ASSUMED_SMS`."""
    device = torch.device(device)
    if not deterministic or device.type != "cuda":
        return 0
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(device.index or 0).multi_processor_count
    return ASSUMED_SMS


def deterministic_now() -> bool:
    """Whether this process runs deterministic algorithms in the mode that makes the flash backward split
    its dQ accumulator (on, not ``warn_only``)."""
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flash_backward_bytes(shapes: BlockShapes, *, batch_size: int, seq_len: int, value_bytes: int, sms: int) -> int:
    """The buffers PyTorch's flash attention backward (FA2's ``mha_bwd``) allocates for one call, all alive
    while its kernel runs: the fp32 dQ accumulator ``[splits, batch, seq rounded to 128, heads, head_dim
    rounded]`` (``splits`` = ``ceil(sms / (batch x heads))`` when deterministic, else 1), with grouped KV
    heads the dK and dV expanded to every query head, dQ, dK, dV themselves, and the fp32 ``softmax_d``.
    At long sequences with many sequence chunks this, not the MLP's chunk, is a block backward's peak (the
    H200's long-context records showed the estimate short by about this much without it:
    docs/results-h200-log.md, the tenth session)."""
    heads = shapes.num_attention_heads
    width = shapes.attention_width or shapes.hidden_size
    head_dim = width // heads
    kv_width = shapes.kv_width or width
    rows = batch_size * round_up(seq_len, 128)
    splits = -(-sms // (batch_size * heads)) if sms else 1
    dq_accum = splits * rows * heads * round_up(head_dim, 32 if head_dim <= 128 else 64) * 4
    tokens = batch_size * seq_len
    expanded = 2 * tokens * width * value_bytes if kv_width != width else 0
    gradients = tokens * (width + 2 * kv_width) * value_bytes
    return dq_accum + expanded + gradients + rows * heads * 4


def attention_working_set(shapes: BlockShapes, *, batch_size: int, seq_len: int, value_bytes: int,
                          attn_implementation: str | None, sms: int = 0, packed: bool = False) -> AttentionEstimate:
    """The attention kernel's own working set for one block (beyond the q/k/v/o projections' outputs,
    counted with the linears). An estimate, replaceable by the engine's own (issue 32: the attention
    kernels expose their working set, kernel name and reason; this is the planner's stand-in):

    * ``eager``: the math kernel keeps the scores, the probabilities and their gradient,
      ``3 x batch x heads x seq x seq`` values.
    * otherwise (``sdpa``, flash): the memory-efficient / flash kernel, no ``seq x seq`` tensor: its
      fp32 logsumexp (``batch x seq x heads``). Its inputs and output (``batch x seq x heads x
      head_dim`` each, and their gradients) are the projections' outputs and inputs, already priced
      with the linears (``2 x v x out_features`` each, calibrated on the H200 records); its backward's
      own buffers are :func:`flash_backward_bytes` (``sms``: :func:`attention_sms`).
    * ``packed`` rows (``poros.data.packing``): transformers' boolean ``batch x 1 x seq x seq`` mask and
      SDPA's copy of it in the compute dtype while a layer runs; SDPA then takes the memory-efficient
      kernel (its backward's buffers are priced as the flash kernel's, an estimate).
    """
    tokens = batch_size * seq_len
    if attn_implementation == "eager":
        return AttentionEstimate(3 * batch_size * shapes.num_attention_heads * seq_len * seq_len * value_bytes,
                                 "math (eager): seq x seq scores, probabilities and their gradient",
                                 "attn_implementation='eager'")
    backward = flash_backward_bytes(shapes, batch_size=batch_size, seq_len=seq_len, value_bytes=value_bytes, sms=sms)
    if packed:
        mask = sum(seq_by_seq_mask_bytes(batch_size, seq_len, value_bytes))
        return AttentionEstimate(tokens * shapes.num_attention_heads * 4 + mask,
                                 "memory-efficient: packed rows' batch x 1 x seq x seq mask (bool, and SDPA's copy in the "
                                 "compute dtype)", "packing: transformers builds the mask from the position_ids restarts",
                                 backward=backward)
    return AttentionEstimate(tokens * shapes.num_attention_heads * 4,
                             "memory-efficient / flash: an fp32 logsumexp, no seq x seq tensor",
                             f"attn_implementation={attn_implementation or 'sdpa'!r}, assumed to keep the efficient kernel",
                             backward=backward)


#: bytes per value of the loss head beyond the logits themselves: HF's ForCausalLMLoss upcasts the
#: logits to fp32 and cross_entropy saves its fp32 log-softmax; its backward holds that, the fp32
#: gradient it receives and the fp32 gradient it makes (4 + 4 + 4) before the cast back.
LOSS_BYTES_PER_LOGIT = 12
#: fp32 values per hidden value an RMSNorm's backward holds beside its saved fp32 input (HF's norm is
#: decomposed: ``x.float()``, ``pow``, ``mean``, ``rsqrt``, ``mul``, ``.to()``; its autograd graph's backward
#: keeps the fp32 incoming gradient, ``grad * rsqrt``, ``grad * x``, the mean's expanded gradient and
#: ``pow``'s ``2 * x * grad`` alive at once: 5, counted with a dispatch-level tracker of live tensors
#: on a real decoder block, poros.testing.live_bytes)
NORM_BACKWARD_FP32_VALUES = 5


@dataclass(frozen=True)
class ActivationParts:
    """One micro-batch's sequence-proportional device bytes, by part (estimates, except the boundary)."""

    boundary: int  # one block's input hidden states
    norms: int  # the two RMSNorms' saved fp32 inputs
    projections: int  # what the attention kernel keeps of the projections' outputs (q, k after rotary; v; out)
    attention: AttentionEstimate
    mlp: int  # the MLP's working set (with its LoRA input casts), one of mlp_chunks sequence chunks
    dequantized_weight: int  # the largest 4-bit weight (or fused NF4 expert tensor) dequantized to the compute dtype
    logits: int  # the head's logits (and their gradient), whole or one of loss_chunks chunks
    loss: int  # the loss's fp32 working set, whole or one chunk
    softcap: int  # soft-capped logits: two more logit-sized tensors
    loss_chunks: int = 1
    mlp_chunks: int = 1
    lora_inputs: int = 0  # the attention linears' inputs cast to the LoRA dtype, one copy per LoRA'd linear
    norm_backward: int = 0  # an RMSNorm's backward: its fp32 temporaries and the MLP's input gradient
    tiled_buffers: int = 0  # tiled (mlp_chunks > 1): a tiled node's whole input gradient and the block's output
    post_attention_norm: int = 0  # the part of norms the post-attention norm keeps, freed before attention's backward
    fused_loss: bool = False  # the head is Liger's fused linear cross-entropy (fused_loss_bytes)
    dequantized_linear: int = 0  # the largest 4-bit linear alone (0: none): captured, the fused experts go to the scratch

    @property
    def recompute(self) -> int:
        """What recomputing one block with grad and back-propagating it holds at once: what the attention
        half keeps (norms, LoRA input copies, the kernel's tensors) and the largest of the post-attention
        norm's backward, the MLP's working set with a dequantized weight and the attention kernel's
        backward buffers (never alive together; by the attention kernel's backward the post-attention norm's
        saved tensors are freed).
        Tiled, the norms and the LoRA input copies are the per-token nodes' compute-dtype inputs and outputs
        and one chunk's fp32 copies, and a tiled node's input gradient and the block's output count beside."""
        return self._recompute(self.dequantized_weight)

    @property
    def captured_recompute(self) -> int:
        """:attr:`recompute` under CUDA graphs: the fused NF4 experts are dequantized into the graphs' held scratch
        (``poros.stream.capture_scratch``, counted beside the peak), so the transient is the largest linear's."""
        return self._recompute(min(self.dequantized_weight, self.dequantized_linear))

    def _recompute(self, dequantized: int) -> int:
        return (self.norms + self.lora_inputs + self.projections + self.attention.bytes + self.tiled_buffers
                + max(self.norm_backward, self.mlp + dequantized, self.attention.backward - self.post_attention_norm))

    @property
    def head(self) -> int:
        return self.logits + self.loss + self.softcap

    @property
    def kept(self) -> int:
        """What one block's forward keeps for its backward when it is not recomputed
        (``StreamOptions.recompute``): its input and the tensors its recompute's forward half holds (norms, LoRA
        input copies, projections, the attention kernel's, the MLP's working set); an estimate, and the
        executor takes the measured bytes where they are larger (``poros.stream.recompute_choice``)."""
        return (self.boundary + self.norms + self.lora_inputs + self.projections + self.attention.bytes
                + self.mlp + self.tiled_buffers)

    def named(self) -> tuple[tuple[str, int], ...]:
        """The parts by name, for ``poros plan``'s table."""
        loss = "" if self.loss_chunks == 1 else f", one of {self.loss_chunks} chunks"
        mlp = "" if self.mlp_chunks == 1 else f", one of {self.mlp_chunks} sequence chunks"
        tiled = self.mlp_chunks > 1  # the norms and projections tiled with the MLP (poros.stream.tiling)
        return (("one block's input (a boundary state)", self.boundary),
                ("block recompute: norms' inputs and outputs (compute dtype, tiled)" if tiled
                 else "block recompute: norms (saved fp32 inputs)", self.norms),
                (f"block recompute: attention LoRA inputs (cast to the LoRA dtype){mlp}", self.lora_inputs),
                *((("block recompute: a tiled node's input gradient and the block's output", self.tiled_buffers),)
                  if tiled else ()),
                ("block recompute: attention projections", self.projections),
                (f"block recompute: attention kernel ({self.attention.kernel.split(':')[0]})", self.attention.bytes),
                *((("block recompute: attention kernel's backward buffers (or a norm's backward or the MLP, "
                    "the largest)", self.attention.backward),) if self.attention.backward else ()),
                (f"block recompute: a norm's backward{mlp} (or the MLP below, the larger)", self.norm_backward),
                (f"block recompute: MLP working set{mlp}", self.mlp),
                ("block recompute: one dequantized weight", self.dequantized_weight),
                *((("head: Liger's fused linear cross-entropy (the input gradient and one chunk of logits)",
                    self.logits), ("loss: fp32 per-token losses", self.loss)) if self.fused_loss else
                  ((f"head: logits and their gradient{loss}", self.logits + self.softcap),
                   (f"loss: fp32 working set{loss}", self.loss))))


def activation_parts(shapes: BlockShapes, *, batch_size: int, seq_len: int, value_bytes: int,
                     attn_implementation: str | None, loss_chunks: int = 1, mlp_chunks: int = 1,
                     attention_sms: int = 0, packed: bool = False, fused_loss: bool = False) -> ActivationParts:
    """One micro-batch's activations, by part (see :func:`activation_bytes` for what each counts;
    ``attention_sms``: :func:`attention_sms`; ``packed``: :attr:`~poros.plan.budget.Workload.packed`;
    ``fused_loss``: the head is Liger's fused linear cross-entropy, :func:`fused_loss_bytes`, and
    ``loss_chunks`` does not apply)."""
    tokens = batch_size * seq_len
    hidden = shapes.hidden_size
    attention_linears = shapes.linear_outputs - shapes.mlp_outputs
    mlp_tokens = -(-tokens // mlp_chunks) if mlp_chunks > 1 else tokens
    logits = tokens * shapes.vocab_size
    if fused_loss:  # Liger's fused linear cross-entropy: the input gradient, one chunk of logits, fp32 losses
        head_logits, loss, softcap = fused_loss_bytes(tokens, hidden, shapes.vocab_size, value_bytes), tokens * 4, 0
        loss_chunks = 1
    elif loss_chunks == 1:
        head_logits, loss = logits * value_bytes, logits * LOSS_BYTES_PER_LOGIT
        softcap = 2 * logits * value_bytes if shapes.logit_softcapping else 0
    else:  # the head and the loss run chunk by chunk: one chunk's logits, their gradient, the fp32 loss
        chunk = -(-tokens // loss_chunks) * shapes.vocab_size
        head_logits, loss = 2 * chunk * value_bytes, chunk * LOSS_BYTES_PER_LOGIT
        softcap = 2 * chunk * value_bytes if shapes.logit_softcapping else 0
    lora = shapes.lora_value_bytes
    # the MLP: its linears' outputs and their products, its LoRA'd linears' input copies, and the last one's
    # fp32 lora_B output and its scaled copy (block-output wide) before the cast back
    mlp_per_token = 2 * value_bytes * shapes.mlp_outputs + lora * shapes.lora_mlp_inputs + 2 * lora * hidden
    return ActivationParts(
        boundary=tokens * hidden * value_bytes,
        projections=tokens * value_bytes * attention_linears,
        attention=attention_working_set(shapes, batch_size=batch_size, seq_len=seq_len, value_bytes=value_bytes,
                                        attn_implementation=attn_implementation, sms=attention_sms, packed=packed),
        mlp=mlp_tokens * mlp_per_token,
        dequantized_weight=max(shapes.largest_linear, shapes.dequantized_experts) * value_bytes,
        dequantized_linear=shapes.largest_linear * value_bytes,
        logits=head_logits, loss=loss, softcap=softcap, loss_chunks=loss_chunks, mlp_chunks=mlp_chunks,
        fused_loss=fused_loss, **per_token_parts(tokens, mlp_tokens, hidden, value_bytes, lora * shapes.lora_attention_inputs, mlp_chunks))


def fused_loss_bytes(tokens: int, hidden: int, vocab: int, value_bytes: int) -> int:
    """The head's device bytes under Liger's fused linear cross-entropy (``kernels: liger``): it never makes the
    whole logits. Its forward computes the loss and the hidden states' gradient together, ``chunk`` tokens at a
    time, ``chunk`` the power of two at or above ``tokens / ceil(vocab / hidden)`` (at most ``tokens``): one
    chunk's logits in the compute dtype (the cross-entropy kernel writes their gradient in place) and the whole
    ``tokens x hidden`` input gradient, kept for backward (``liger_kernel.ops.fused_linear_cross_entropy``)."""
    factor = -(-vocab // hidden)
    chunk = min(1 << max(0, (-(-tokens // factor) - 1).bit_length()), tokens)
    return tokens * hidden * value_bytes + chunk * vocab * value_bytes


def per_token_parts(tokens: int, chunk_tokens: int, hidden: int, value_bytes: int, lora_input_bytes: int,
                     chunks: int) -> dict[str, int]:
    """The norms, the attention LoRA input copies and a norm's backward, whole or tiled (``mlp_chunks``:
    ``poros.stream.tiling`` tiles the norms and projections with the MLP). Tiled, the per-token nodes keep
    their compute-dtype tensors -- the attention norm's output (q, k and v's one saved input), the
    post-attention norm's input and output -- and make one chunk's fp32 copies at a time; the tiled
    node's whole input gradient and the recomputed block's output are alive beside them (counted on a
    real block, ``poros.testing.live_bytes``)."""
    norm_backward = hidden * (4 * NORM_BACKWARD_FP32_VALUES + value_bytes)
    if chunks == 1:
        return dict(norms=tokens * 2 * 4 * hidden, lora_inputs=tokens * lora_input_bytes,
                    norm_backward=tokens * norm_backward, post_attention_norm=tokens * 4 * hidden)
    return dict(norms=tokens * 3 * value_bytes * hidden, lora_inputs=chunk_tokens * lora_input_bytes,
                norm_backward=chunk_tokens * norm_backward, tiled_buffers=tokens * 2 * value_bytes * hidden,
                post_attention_norm=tokens * 2 * value_bytes * hidden)


def activation_bytes(shapes: BlockShapes, *, batch_size: int, seq_len: int, value_bytes: int,
                     attn_implementation: str | None, loss_chunks: int = 1,
                     mlp_chunks: int = 1, attention_sms: int = 0, packed: bool = False,
                     fused_loss: bool = False) -> tuple[int, int, int]:
    """``(boundary, recompute, head)`` bytes of one micro-batch (estimates, except the boundary).

    * boundary: one block's input hidden states, ``batch x seq x hidden`` values (exact).
    * recompute: what recomputing one block with grad and back-propagating it holds at once
      (:attr:`ActivationParts.recompute`), per token: the two RMSNorms' saved fp32 inputs (``2 x 4 x
      hidden``); PEFT's copies of the LoRA'd attention linears' inputs in the LoRA dtype (``_cast_input_dtype``,
      one per linear, kept by lora_A's backward: ``lora_bytes x sum(in_features)``); what the attention
      kernel keeps of the projections (q and k after rotary, v, its output: ``v x sum(out_features)``); and
      the larger of the post-attention norm's backward (:data:`NORM_BACKWARD_FP32_VALUES` fp32
      temporaries and the MLP's input gradient) and the MLP's working set (every MLP linear's output and
      its products, ``2 x v x sum(out_features)``, its LoRA'd linears' input copies, and the last one's
      fp32 LoRA output and its scaled copy; for one of ``mlp_chunks`` sequence chunks: the tiled MLP
      saves only its input) with the largest 4-bit weight dequantized to the compute dtype (bitsandbytes
      dequantizes one weight at a time, in forward and again in backward; grouped NF4 experts a whole
      fused expert tensor); plus the attention kernel's working set (:func:`attention_working_set`:
      ``seq x seq`` only for the math kernel). Counted against a real decoder block's live tensors on the
      CPU (``poros.testing.live_bytes``, ``tests/test_footprint_live_bytes.py``) and the H200 records.
    * head: the logits in the compute dtype plus the fp32 loss working set
      (:data:`LOSS_BYTES_PER_LOGIT`); soft-capped logits keep two more logit-sized tensors. With
      ``loss_chunks`` N > 1 the head and the loss run one token chunk at a time: one chunk's
      logits and their gradient in the compute dtype and its fp32 working set (the chunked head
      of issue 32: the logits are never whole). With ``fused_loss`` (``kernels: liger``) the head is
      Liger's fused linear cross-entropy instead (:func:`fused_loss_bytes`).
    """
    parts = activation_parts(shapes, batch_size=batch_size, seq_len=seq_len, value_bytes=value_bytes,
                             attn_implementation=attn_implementation, loss_chunks=loss_chunks, mlp_chunks=mlp_chunks,
                             attention_sms=attention_sms, packed=packed, fused_loss=fused_loss)
    return parts.boundary, parts.recompute, parts.head


__all__ = ["ASSUMED_SMS", "ActivationParts", "AttentionEstimate", "BlockShapes", "GROUPED_NF4_EXPERTS", "LOSS_BYTES_PER_LOGIT", "NORM_BACKWARD_FP32_VALUES", "activation_bytes", "activation_parts", "attention_sms", "attention_working_set", "deterministic_now", "flash_backward_bytes", "fused_loss_bytes", "grouped_experts_values", "held_values", "lora_inputs", "per_token_parts", "round_up"]

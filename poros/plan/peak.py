"""The one peak model, torch-free: a run's device bytes by kind (:class:`Footprint`, measured by
:mod:`poros.plan.footprint` from a loaded model or a meta skeleton) and the shape of its step
(:class:`~poros.stream.options.Workload`) give the peak (:func:`predict_peak`): the largest of a step's
phases -- the forward-backward turn (all boundary states + the head's working set), a block's recompute
and backward (its working set + the LoRA gradients + the boundary states still held), the optimizer
step -- on top of the slots, the resident blocks, the modules outside the blocks and the LoRA parameters
with their AdamW state (:class:`PeakBreakdown`). :func:`peak_upper_bound` adds the same parts all at
once (the dry run's estimate); :func:`budget_for_peak` the budget a peak needs with the context and the
allocator's slack. The budget plan (:mod:`poros.plan.budget`) is built on it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable

from poros.stream import optimizer_states as adamw_states
from poros.stream.placement import graph_statics_bytes
from poros.stream.options import Workload
from poros.spellings import format_gb


#: LoRA tensors are fp32 (PEFT upcasts adapters of a 4-bit base): parameter + gradient + AdamW exp_avg
#: and exp_avg_sq, 4 bytes each.
LORA_VALUE_BYTES = 4
LORA_BYTES_PER_PARAMETER = 4 * LORA_VALUE_BYTES
#: cuBLAS / cuBLASLt workspaces, allocated through PyTorch's caching allocator on CUDA (estimate).
CUDA_WORKSPACE_BYTES = 64 * 2**20
#: what the CUDA context and the libraries' own allocations take outside PyTorch's allocator
#: (estimate; `nvidia-smi` shows it as the process's memory before the first tensor).
CUDA_CONTEXT_BYTES = 512 * 2**20
#: reserved minus allocated: the caching allocator's slack over the peak it serves, above what the H200
#: runs with expandable_segments measured (docs/results-h200.md).
ALLOCATOR_SLACK = 0.20


@dataclass(frozen=True)
class Footprint:
    """Device bytes of one run, by kind; activations per micro-batch (see :func:`activation_bytes`).

    Attributes:
        block_bytes: each decoder block's packed bytes (exact).
        device_non_block_bytes: frozen tensors outside the blocks that stay on the device (head,
            norms, rotary...), the embedding tables counted in ``host_embedding_bytes`` excluded.
        host_embedding_bytes: embedding tables that may live on the host (``embeddings_on_host``).
        lora_parameter_bytes: the trainable (LoRA) parameters; their gradients are as large, their
            AdamW state twice, AdamW's step one more copy for a moment.
        boundary_bytes, recompute_bytes, head_bytes: per micro-batch.
        kept_bytes: what a block that keeps its activations (no recompute) holds from its forward to its
            backward, per micro-batch (an estimate).
        held_weight_bytes: the largest block's 4-bit linear weights dequantized to the compute dtype (twice where
            quantized from another dtype): what ``dequantize_once`` holds while a block phase runs (exact).
        workspace_bytes: library workspaces inside the allocator (cuBLAS on CUDA).
        parts: the sequence-proportional activations by name (per micro-batch; what ``poros plan``
            tabulates: attention, MLP, head and loss...), or empty where unknown.
        attention: the attention kernel the estimate assumes and why, in words.
        loss_chunks, mlp_chunks: the chunk counts the activations are estimated for.
        attention_sms: the SM count the flash backward's deterministic dQ accumulator is split by (0: not
            split; :func:`poros.plan.footprint.attention_sms`), a fact of the device and the run's mode.
        block_structures: how many block structures CUDA graphs key apart (``graph_keys.block_structures``:
            modules and their plain attributes; a model mixing linear- and full-attention layers: 2).
        lora_statics_bytes: the static LoRA buffers every CUDA graph shares (the largest block's LoRA, per
            tensor signature: ``placement.shared_statics_bytes``; the shared LoRA gradient buffers are as large);
            0: unknown (the average block's LoRA).
        expert_scratch_bytes: the largest fused NF4 expert tensor dequantized to the compute dtype: what CUDA
            graphs' capture scratch holds for the whole run (``poros.stream.capture_scratch``); 0: none.
        captured_recompute_bytes: ``recompute_bytes`` with that tensor in the scratch (the largest linear's
            dequantized weight instead); 0: as ``recompute_bytes``.
        cuda_graphs: the run captures its blocks: :func:`predict_peak` counts the graphs' live buffers
            (``placement.graph_statics_bytes``) and the scratch as persistent.
    """

    block_bytes: tuple[int, ...]
    device_non_block_bytes: int
    host_embedding_bytes: int
    lora_parameter_bytes: int
    boundary_bytes: int
    recompute_bytes: int
    head_bytes: int
    workspace_bytes: int = 0
    parts: tuple[tuple[str, int], ...] = ()
    attention: str = ""
    loss_chunks: int = 1
    mlp_chunks: int = 1
    attention_sms: int = 0
    kept_bytes: int = 0  # one block's kept activations, per micro-batch (ActivationParts.kept)
    held_weight_bytes: int = 0  # one block's dequantized 4-bit weights, held by dequantize_once for a block phase
    block_structures: int = 1  # CUDA graphs key each apart (placement.graph_reserve_bytes)
    lora_statics_bytes: int = 0  # the CUDA graphs' shared static LoRA buffers (placement.shared_statics_bytes)
    expert_scratch_bytes: int = 0  # the largest fused NF4 expert tensor, dequantized (capture_scratch holds it)
    captured_recompute_bytes: int = 0  # recompute_bytes with the fused experts in the scratch (0: the same)
    cuda_graphs: bool = False  # the run captures its blocks (predict_peak counts the graphs' live buffers)

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)


@dataclass(frozen=True)
class PeakBreakdown:
    """The predicted peak of allocated device memory and what it is made of.

    ``persistent`` parts live through the whole step; ``phase`` names the moment the peak falls in
    and ``transient`` its parts (boundary states, working sets, gradients at that moment).
    """

    persistent: tuple[tuple[str, int], ...]
    phase: str
    transient: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.persistent) + sum(n for _, n in self.transient)

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "phase": self.phase, "persistent": dict(self.persistent),
                "transient": dict(self.transient)}


def predict_peak(footprint: Footprint, workload: Workload, *, resident: Iterable[int] = (), num_slots: int = 2,
                 embeddings_on_host: bool = True, boundary_on_host: bool = False,
                 optimizer_on_host: bool = False, lora_on_host: bool = False,
                 dequantize_once: bool = False) -> PeakBreakdown:
    """The peak allocated device bytes of a step: the largest of its three phases.

    Persistent: the slot ring (``min(num_slots, streamed blocks)`` x the largest streamed block),
    resident blocks, the modules outside the blocks, LoRA parameters and AdamW state (from the
    first step on), workspaces. On top, per phase (M micro-batches, L blocks, B one boundary, G
    the LoRA gradients):

    * **turn** (head and loss of a micro-batch): the boundary states saved so far (L x B;
      layer-major M x L x B plus each micro-batch's output and gradient) + the head's working set
      (+ G in micro-major from the second micro-batch on, as gradients accumulate);
    * **backward** (one block recomputed): its working set + G + the boundary states still held
      (micro-major frees each as its block is done, so the larger of L x B at the first backward
      block and G at the last; layer-major keeps all M x L until the step's backward is over);
    * **optimizer**: G + AdamW's temporary (one more copy of the LoRA parameters).

    ``optimizer_on_host``: AdamW's state in host memory (``HostAdamW``), only chunks in flight on the device.
    ``lora_on_host`` (with it): the streamed blocks' LoRA tensors on the host, those of the slots' blocks on the device.

    ``boundary_on_host`` (layer-major): the boundary states wait in host memory; on the device
    only the M prelude outputs (HF's graph holds them) and those in flight: at the turn each
    micro-batch's output and its gradient (3 x M x B with the prelude's), in backward the block's
    M inputs, the next block's M arriving and the M gradients (4 x M x B).
    Micro-major keeps its boundary states on the device (autograd saves them): ignored there.

    ``dequantize_once`` (layer-major): a block phase holds the block's dequantized weights
    (``held_weight_bytes``), counted in the backward phase (the forward phase's working set is smaller).
    """
    resident = set(resident)
    streamed = [n for i, n in enumerate(footprint.block_bytes) if i not in resident]
    slots = min(num_slots, len(streamed))
    lora = footprint.lora_parameter_bytes
    staying, lora_persistent, block_grads = adamw_states.lora_parts(lora, footprint.num_blocks, len(streamed), slots,
                                                       states_on_host=optimizer_on_host, lora_on_host=lora_on_host)
    persistent = [
        (f"device slots ({slots} x largest streamed block)", slots * max(streamed, default=0)),
        (f"resident blocks ({len(resident)})", sum(footprint.block_bytes[i] for i in resident)),
        ("modules outside the blocks (head, norms)", footprint.device_non_block_bytes),
        ("embedding tables", 0 if embeddings_on_host else footprint.host_embedding_bytes),
        *lora_persistent,
        ("library workspaces", footprint.workspace_bytes),
    ]
    recompute = footprint.recompute_bytes
    if footprint.cuda_graphs:  # what the graphs keep allocated; a capture's transients are the pool's, reserved
        # the expert scratch: a layer-major step's (its eager runs borrow it too); micro-major allocates afresh
        scratch = workload.schedule == "layer-major" and footprint.expert_scratch_bytes > 0
        graphs = footprint if scratch else dataclasses.replace(footprint, expert_scratch_bytes=0)
        persistent.append(("CUDA graphs: shared LoRA values and gradients, static boundary states"
                           + (", the held expert scratch" if scratch else ""), graph_statics_bytes(graphs, slots)))
        recompute = (footprint.captured_recompute_bytes or recompute) if scratch else recompute
    micro, every = workload.grad_accum, workload.boundary_every
    blocks = kept_states(footprint.num_blocks, every)  # the boundary states kept: L, or L / k rounded up
    segment = every - 1  # boundary_every > 1: a segment's recomputed inputs, alive at its top block's backward
    boundary = footprint.boundary_bytes
    if workload.schedule == "layer-major" and boundary_on_host:
        turn = [("boundary states on the device (M prelude outputs, M outputs, their gradients; the rest on "
                 "the host)", 3 * micro * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states on the device (M prelude outputs, this block's M inputs, the next block's, "
                     "M gradients)" + (f", the segment's {segment} x M recomputed ones" if segment else ""),
                     (4 + segment) * micro * boundary),
                    ("LoRA gradients", staying + block_grads),
                    ("one block's recompute working set", recompute)]
    elif workload.schedule == "layer-major":
        turn = [("boundary states (M x L) + outputs and their gradients", micro * (blocks + 2) * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states (M x L, kept until backward ends)" + (
                        f" + the segment's {segment} x M recomputed ones" if segment else ""),
                     micro * (blocks + 1 + segment) * boundary),
                    ("LoRA gradients", staying + block_grads),
                    ("one block's recompute working set", recompute)]
    else:
        accumulated = lora if micro > 1 else 0  # gradients of the earlier micro-batches
        turn = [("boundary states (L)", blocks * boundary), ("head and loss working set", footprint.head_bytes),
                ("LoRA gradients (earlier micro-batches)", accumulated)]
        first_block = (blocks + segment) * boundary + max(accumulated, lora // max(footprint.num_blocks, 1))
        last_block = 2 * boundary + lora
        backward = [("boundary states and LoRA gradients still held", max(first_block, last_block)),
                    ("one block's recompute working set", recompute)]
    if dequantize_once and workload.schedule == "layer-major":
        backward.append(("held dequantized weights (dequantize_once: one block's 4-bit linears)",
                         footprint.held_weight_bytes))
    optimizer = adamw_states.step_bytes(lora, states_on_host=optimizer_on_host,
                                        staying=staying if lora_on_host else None)
    phases = {"head and loss (forward-backward turn)": turn, "block recompute and backward": backward,
              "optimizer step": optimizer}
    phase = max(phases, key=lambda name: sum(n for _, n in phases[name]))
    return PeakBreakdown(tuple(persistent), phase, tuple(phases[phase]))


def peak_upper_bound(footprint: Footprint, workload: Workload, *, num_slots: int = 2,
                     embeddings_on_host: bool = True) -> int:
    """The same parts as :func:`predict_peak`, all at once: an upper bound (the head's and a block's
    working sets never coincide), what ``poros train --dry-run`` prints as its peak estimate. The
    ring (``num_slots`` x the largest block), the modules outside the blocks (and the embedding
    tables unless on the host), the LoRA parameters with their gradients and AdamW state (4 x),
    every boundary state (M x L layer-major), one block's recompute and the head's working set;
    no workspace."""
    micro = workload.grad_accum if workload.schedule == "layer-major" else 1
    return (num_slots * max(footprint.block_bytes, default=0) + footprint.device_non_block_bytes
            + (0 if embeddings_on_host else footprint.host_embedding_bytes)
            + (LORA_BYTES_PER_PARAMETER // LORA_VALUE_BYTES) * footprint.lora_parameter_bytes
            + micro * kept_states(footprint.num_blocks, workload.boundary_every) * footprint.boundary_bytes
            + footprint.recompute_bytes + footprint.head_bytes)


def kept_states(num_blocks: int, every: int) -> int:
    """The boundary states a pass keeps with ``boundary_every=every``: blocks 0, k, 2k, ... (``poros.stream.segments``)."""
    return -(-num_blocks // every)


def budget_for_peak(peak_bytes: int, *, context_bytes: int, slack: float) -> int:
    """The device memory a peak of ``peak_bytes`` allocated needs: context + peak x (1 + slack)."""
    return context_bytes + math.ceil(peak_bytes * (1 + slack))


def biggest_part(peak: PeakBreakdown, footprint: Footprint) -> str:
    """The largest part of ``peak``, ``"name (size)"``; a working set of several parts (a block's recompute,
    the head and loss) with its own largest part named beside it."""
    name, size = max((*peak.persistent, *peak.transient), key=lambda part: part[1])
    within = {"one block's recompute working set": "block recompute", "head and loss working set": ("head", "loss")}
    prefix = within.get(name)
    inner = [part for part in footprint.parts if prefix and part[0].startswith(prefix)]
    if inner:
        inner_name, inner_size = max(inner, key=lambda part: part[1])
        return f"{name} ({format_gb(size)}; most of it {inner_name}, {format_gb(inner_size)})"
    return f"{name} ({format_gb(size)})"


__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT_BYTES", "CUDA_WORKSPACE_BYTES", "Footprint", "LORA_BYTES_PER_PARAMETER", "LORA_VALUE_BYTES", "PeakBreakdown", "biggest_part", "budget_for_peak", "kept_states", "peak_upper_bound", "predict_peak"]

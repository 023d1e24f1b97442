"""The memory plan of a streamed run and the VRAM-budget planner, from the checkpoint's ``config.json``
alone (no weight is read).

``poros train --dry-run`` prints the memory plan; ``poros plan`` and ``prepare(vram_budget=...)``
ask the budget planner. The arithmetic:

* **Block bytes are computed, not guessed.** The text tower is built as a skeleton on the meta
  device (``AutoModelForCausalLM.from_config(text_config)``: real module tree, no storage). A
  linear that transformers' bitsandbytes integration would quantize (same rule: exact
  ``nn.Linear``, minus ``get_keys_to_not_convert`` and ``_keep_in_fp32_modules``) counts as the
  packed 4-bit weight (``ceil(numel / 2)`` bytes) plus its ``QuantState`` tensors: fp32 absmax
  per 64 values and the 16-value code table, or with double quantization uint8 absmax, the fp32
  offset, fp32 absmax per 256 absmax values and the 256-value code table. Everything else counts
  at its dtype. Every tensor is padded to the block store's alignment, walked exactly as
  :class:`~poros.stream.store.BlockStore` walks a block, so the result equals the store's host
  buffer sizes (``tests/test_cli_train.py`` checks it on every tiny family).
* **Activations are estimates** (:func:`activation_bytes`): the saved block inputs (exact), one
  block's recompute working set, and the head's logits and loss working set.
* **The peak is the largest of a step's phases** (:func:`predict_peak`): the forward-backward
  turn (all boundary states + the head's working set), a block's recompute and backward (its
  working set + the LoRA gradients + the boundary states still held), the optimizer step; on top
  of the slots, the resident blocks, the modules outside the blocks and the LoRA parameters with
  their AdamW state. Within 3 % of every H200 bench record in ``registry/results``
  (``tests/test_planner.py`` holds them to 15 %).
* **The budget planner** (:func:`plan_budget`) is pure arithmetic on those bytes: embedding
  tables to the host, the slot ring, then as many resident blocks as fit, the last ones first.
  With per-block compute times (:func:`probe_compute` on CUDA, or given) and the link bandwidth
  it simulates the executor's copies and compute stage by stage (:func:`predict_step`) and finds
  the budget that takes the copy off the critical path.

Multimodal checkpoints (a config with ``text_config``) are planned for their text tower, the part
Poros trains.
"""

from __future__ import annotations

import copy
import math
import os
import pathlib
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.config import parse_budget
from poros.errors import CheckpointLoadError, ConfigError, StreamingError
from poros.stream import optimizer_states as adamw_states
from poros.stream.store import ALIGN, _frozen_tensors, _shared_tensor_keys

#: bitsandbytes 4-bit block sizes: values per absmax, and absmax values per nested absmax.
QUANT_BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
CODE_4BIT_VALUES = 16  # the NF4 / FP4 code table (fp32)
CODE_NESTED_VALUES = 256  # the 8-bit dynamic map of double quantization (fp32)
#: LoRA tensors are fp32 (PEFT upcasts adapters of a 4-bit base): parameter + gradient + AdamW exp_avg
#: and exp_avg_sq, 4 bytes each.
LORA_VALUE_BYTES = 4
LORA_BYTES_PER_PARAMETER = 4 * LORA_VALUE_BYTES


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


# ---------------------------------------------------------------------------------------------
# The checkpoint's config, offline
# ---------------------------------------------------------------------------------------------
def locate_checkpoint_config(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """The directory holding ``model``'s ``config.json``, without downloading anything.

    A local directory and a model bundled with poros resolve as :func:`poros.load.resolve_checkpoint`
    resolves them; a hub id only through the HF cache (its ``config.json`` is enough: the plan
    needs no weights).

    Returns:
        ``(directory, where)``; ``where`` says how it was found, for the plan's header.

    Raises:
        CheckpointLoadError: no such directory, or a hub id whose ``config.json`` is not cached.
    """
    from poros.assets import is_asset
    from poros.load import resolve_checkpoint

    path = pathlib.Path(model).expanduser()
    hub_like = model.count("/") == 1 and not model.startswith((".", "/", "~")) and not path.exists()
    if not hub_like:
        directory = resolve_checkpoint(model, revision=revision)
        return directory, "bundled with poros" if is_asset(model) else "local directory"
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(model, "config.json", revision=revision)
    if isinstance(cached, str) and os.path.isfile(cached):
        return pathlib.Path(cached).parent, "HF cache"
    raise CheckpointLoadError(
        f"{model!r}{f' (revision {revision})' if revision else ''} is not a local directory and its config.json "
        f"is not in the HF cache ({huggingface_hub.constants.HF_HUB_CACHE}); --dry-run reads only the cache and "
        f"never downloads. Fetch the config first (`hf download {model} config.json`), or pass a local "
        "checkpoint directory."
    )


def load_text_config(directory: pathlib.Path) -> tuple[Any, Any]:
    """``(config, text_config)`` of a checkpoint directory (:func:`poros.load.read_config`)."""
    from poros.load import read_config

    return read_config(directory)


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


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------
def block_bytes(blocks: list[nn.Module], quantized_weights: set[int], *, double_quant: bool) -> list[int]:
    """Host-store bytes of each block, as :class:`~poros.stream.store.BlockStore` packs it.

    Args:
        blocks: the decoder layers of a (meta) skeleton, frozen.
        quantized_weights: ``id`` of every weight parameter that is stored 4-bit.
        double_quant: the QuantStates carry nested statistics.
    """
    shared = _shared_tensor_keys(blocks)  # stays where it is, as in the store
    sizes = []
    for block in blocks:
        total = 0
        for _, owner, attr, _, tensor in _frozen_tensors(block):
            if (id(owner), attr) in shared:
                continue
            if id(owner) in quantized_weights:
                total += sum(padded(n) for n in quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
            else:
                total += padded(tensor.numel() * tensor.element_size())
        sizes.append(total)
    return sizes


def _tensor_bytes(tensor: torch.Tensor, quantized_weights: set[int], double_quant: bool) -> int:
    if id(tensor) in quantized_weights:
        return sum(quantized_tensor_bytes(tensor.numel(), double_quant=double_quant))
    return tensor.numel() * tensor.element_size()


def lora_targets(model: nn.Module, target_modules: str | list[str]) -> dict[str, nn.Linear]:
    """The linears a LoRA config would wrap, by name: the names :func:`poros.trainer.lora_target_modules`
    gives PEFT, matched by PEFT's rule (a name equal to the module path or to its last components).

    Raises:
        ConfigError: a listed name matches no linear of the model.
    """
    from poros.trainer import lora_target_modules

    names = lora_target_modules(model, target_modules)
    return {path: module for path, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(path == name or path.endswith("." + name) for name in names)}


def host_embedding_tables(model: nn.Module, descriptor: ArchitectureDescriptor) -> list[nn.Embedding]:
    """Frozen embedding tables ``prepare(embeddings_on_host=True)`` keeps on the host: the input and
    prelude embeddings that are not tied to the head (identity, as the skeleton has no storage)."""
    from poros.errors import DescriptorError

    disabled = descriptor.disabled_names(model.config)
    head_weight = getattr(resolve_path(model, descriptor.head), "weight", None)
    tables = []
    for path in (descriptor.embeddings, *(p for p in descriptor.prelude_modules if p not in disabled)):
        try:
            module = resolve_path(model, path)
        except DescriptorError:
            continue
        if isinstance(module, nn.Embedding) and module.weight is not head_weight:
            tables.append(module)
    return tables


# ---------------------------------------------------------------------------------------------
# Activations: what one micro-batch holds on the device besides weights and LoRA state (estimates)
# ---------------------------------------------------------------------------------------------
#: bytes per value of the loss head beyond the logits themselves: HF's ForCausalLMLoss upcasts the
#: logits to fp32 and cross_entropy saves its fp32 log-softmax; its backward holds that, the fp32
#: gradient it receives and the fp32 gradient it makes (4 + 4 + 4) before the cast back.
LOSS_BYTES_PER_LOGIT = 12
#: cuBLAS / cuBLASLt workspaces, allocated through PyTorch's caching allocator on CUDA (estimate).
CUDA_WORKSPACE_BYTES = 64 * 2**20
#: what the CUDA context and the libraries' own allocations take outside PyTorch's allocator
#: (estimate; `nvidia-smi` shows it as the process's memory before the first tensor).
CUDA_CONTEXT_BYTES = 512 * 2**20
#: reserved minus allocated: the caching allocator's slack over the peak it serves. Measured 13 % (32B,
#: 8 GB cap) and 18 % (72B, 12 GB cap) on the H200 with expandable_segments (docs/results-h200.md).
ALLOCATOR_SLACK = 0.20


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


# ---------------------------------------------------------------------------------------------
# The budget planner: pure arithmetic on bytes and seconds (no tensor is touched)
# ---------------------------------------------------------------------------------------------
SCHEDULES = ("micro-major", "layer-major")


def format_gb(nbytes: float) -> str:
    """``5_195_600_000`` -> ``"5.20 GB"`` (decimal units, as the bench and the results pages write
    them); below 0.1 GB in MB or kB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= size * (0.1 if unit == "GB" else 1):
            return f"{nbytes / size:.2f} {unit}" if unit == "GB" else f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class Workload:
    """The shape of one optimizer step, which sets the activations and the copies.

    Args:
        batch_size: examples per micro-batch.
        seq_len: tokens per example.
        grad_accum: micro-batches per optimizer step (M).
        schedule: ``"micro-major"`` (every micro-batch streams every block: 2·M copies per block
            per step) or ``"layer-major"`` (:meth:`~poros.model.PorosModel.forward_backward`: each
            block once per direction for all M micro-batches, whose M x L boundary states stay on
            the device).
        loss_chunks: the loss over this many token chunks (``PorosConfig.loss_chunks``; 1: HF's).

    Raises:
        ConfigError: a size below 1 or an unknown schedule.
    """

    batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    schedule: str = "micro-major"
    loss_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "loss_chunks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"Workload {name}={getattr(self, name)!r}: expected an integer >= 1.")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"Workload schedule={self.schedule!r}: expected one of {', '.join(SCHEDULES)}.")


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
        workspace_bytes: library workspaces inside the allocator (cuBLAS on CUDA).
    """

    block_bytes: tuple[int, ...]
    device_non_block_bytes: int
    host_embedding_bytes: int
    lora_parameter_bytes: int
    boundary_bytes: int
    recompute_bytes: int
    head_bytes: int
    workspace_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_bytes)


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of compute for one micro-batch.

    Attributes:
        forward_s: per block, the no-grad forward.
        backward_s: per block, the recompute with grad plus its backward.
        head_s: final norm, head and loss, forward and backward.
        optimizer_s: the optimizer step (once per step).
        source: where the numbers come from, for the plan (``"probe on ..."``, ``"given"``...).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    head_s: float = 0.0
    optimizer_s: float = 0.0
    source: str = "given"

    @classmethod
    def uniform(cls, num_blocks: int, forward_s: float, backward_s: float, head_s: float = 0.0,
                optimizer_s: float = 0.0, source: str = "given") -> "ComputeTimes":
        return cls((forward_s,) * num_blocks, (backward_s,) * num_blocks, head_s, optimizer_s, source)


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
                 optimizer_on_host: bool = False) -> PeakBreakdown:
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

    ``optimizer_on_host``: AdamW's state lives in host memory (``HostAdamW``); on the device only
    the chunks in flight during the optimizer step (:mod:`poros.stream.optimizer_states`).

    ``boundary_on_host`` (layer-major): the boundary states wait in host memory; on the device
    only the M prelude outputs (HF's graph holds them) and those in flight: at the turn each
    micro-batch's output and its gradient (3 x M x B with the prelude's), in backward the block's
    M inputs, the next block's M arriving and the M gradients (4 x M x B).
    Micro-major keeps its boundary states on the device (autograd saves them): ignored there.
    """
    resident = set(resident)
    streamed = [n for i, n in enumerate(footprint.block_bytes) if i not in resident]
    slots = min(num_slots, len(streamed))
    lora = footprint.lora_parameter_bytes
    persistent = [
        (f"device slots ({slots} x largest streamed block)", slots * max(streamed, default=0)),
        (f"resident blocks ({len(resident)})", sum(footprint.block_bytes[i] for i in resident)),
        ("modules outside the blocks (head, norms)", footprint.device_non_block_bytes),
        ("embedding tables", 0 if embeddings_on_host else footprint.host_embedding_bytes),
        adamw_states.persistent_bytes(lora, states_on_host=optimizer_on_host),
        ("library workspaces", footprint.workspace_bytes),
    ]
    micro, blocks = workload.grad_accum, footprint.num_blocks
    boundary = footprint.boundary_bytes
    if workload.schedule == "layer-major" and boundary_on_host:
        turn = [("boundary states on the device (M prelude outputs, M outputs, their gradients; the rest on "
                 "the host)", 3 * micro * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states on the device (M prelude outputs, this block's M inputs, the next block's, "
                     "M gradients)", 4 * micro * boundary),
                    ("LoRA gradients", lora), ("one block's recompute working set", footprint.recompute_bytes)]
    elif workload.schedule == "layer-major":
        turn = [("boundary states (M x L) + outputs and their gradients", micro * (blocks + 2) * boundary),
                ("head and loss working set", footprint.head_bytes)]
        backward = [("boundary states (M x L, kept until backward ends)", micro * (blocks + 1) * boundary),
                    ("LoRA gradients", lora), ("one block's recompute working set", footprint.recompute_bytes)]
    else:
        accumulated = lora if micro > 1 else 0  # gradients of the earlier micro-batches
        turn = [("boundary states (L)", blocks * boundary), ("head and loss working set", footprint.head_bytes),
                ("LoRA gradients (earlier micro-batches)", accumulated)]
        first_block = blocks * boundary + max(accumulated, lora // max(blocks, 1))
        last_block = 2 * boundary + lora
        backward = [("boundary states and LoRA gradients still held", max(first_block, last_block)),
                    ("one block's recompute working set", footprint.recompute_bytes)]
    optimizer = adamw_states.step_bytes(lora, states_on_host=optimizer_on_host)
    phases = {"head and loss (forward-backward turn)": turn, "block recompute and backward": backward,
              "optimizer step": optimizer}
    phase = max(phases, key=lambda name: sum(n for _, n in phases[name]))
    return PeakBreakdown(tuple(persistent), phase, tuple(phases[phase]))


def budget_for_peak(peak_bytes: int, *, context_bytes: int, slack: float) -> int:
    """The device memory a peak of ``peak_bytes`` allocated needs: context + peak x (1 + slack)."""
    return context_bytes + math.ceil(peak_bytes * (1 + slack))


def copy_bytes_per_step(block_bytes: tuple[int, ...], workload: Workload, resident: Iterable[int] = ()) -> int:
    """Host-to-device bytes of one optimizer step: each streamed block twice per pass (forward,
    backward), the last block once when it streams (it stays on the device across the turn); M
    passes micro-major, one layer-major."""
    return sum(block_bytes[stage.block] for stage in _stages(len(block_bytes), workload, set(resident))
               if stage.copy)


@dataclass(frozen=True)
class _Stage:
    block: int | None  # None: the head and loss
    forward: bool
    copy: bool  # the block must be copied in before this stage computes
    prefetched: bool  # the stage before it issues the copy (the executor prefetches one block ahead)
    pass_start: bool  # the first block of a forward pass: nothing runs before it to hide its copy
    keep: bool  # the block stays in its slot after this stage (the last block, across the turn)


def _stages(num_blocks: int, workload: Workload, resident: set[int]) -> list[_Stage]:
    """The executor's order of work in one optimizer step."""
    last = num_blocks - 1
    stages: list[_Stage] = []
    for _ in range(workload.grad_accum if workload.schedule == "micro-major" else 1):
        for i in range(num_blocks):
            stages.append(_Stage(i, True, i not in resident, i > 0, i == 0, i == last and i not in resident))
        stages.append(_Stage(None, True, False, False, False, False))
        for i in range(last, -1, -1):
            stages.append(_Stage(i, False, i not in resident and i != last, i != last, False, False))
    return stages


@dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds of one optimizer step (a per-block pipeline model, see :func:`predict_step`)."""

    step_s: float
    compute_s: float  # every block's forward and backward, the head, the optimizer: M micro-batches
    exposed_copy_s: float  # compute waiting for a copy, pass starts included
    pass_start_copy_s: float  # the part at the start of a forward pass, which no resident set but
    # the first block's can hide
    copy_bound_stages: int  # stages (other than pass starts) that wait for their copy
    copy_s: float  # the link busy time: copy bytes / link
    forward_s: float
    head_s: float
    backward_s: float
    optimizer_s: float
    source: str

    @property
    def copy_hidden(self) -> bool:
        """No stage but the pass starts waits for a copy: the copy is off the critical path."""
        return self.copy_bound_stages == 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "copy_hidden": self.copy_hidden}


def predict_step(block_bytes: tuple[int, ...], workload: Workload, compute: ComputeTimes, link_bytes_per_s: float,
                 *, resident: Iterable[int] = (), num_slots: int = 2) -> StepPrediction:
    """Simulate one step's copies and compute, stage by stage, as the executor issues them.

    A stage is one block's forward (layer-major: for all M micro-batches), the head and loss, or
    one block's recompute and backward. A streamed block's copy starts when three things hold:
    the executor has issued it (at the start of the stage before, which prefetches one block
    ahead; at the stage itself at the start of a forward pass), the copy engine is free (one copy
    at a time), and a slot is free (its previous block's compute is done; the last block keeps its
    slot across the turn). A stage computes when the stage before it is done and its block is in.
    With uniform blocks each stage is ``max(copy, compute)``: the copy is on the critical path
    wherever it is the larger.

    Raises:
        ConfigError: compute times for another number of blocks, or a link that is not positive.
    """
    num_blocks = len(block_bytes)
    if len(compute.forward_s) != num_blocks or len(compute.backward_s) != num_blocks:
        raise ConfigError(f"compute times cover {len(compute.forward_s)} forward / {len(compute.backward_s)} backward "
                          f"blocks; the model has {num_blocks}. Give one time per block (or ComputeTimes.uniform).")
    if link_bytes_per_s <= 0:
        raise ConfigError(f"link bandwidth {link_bytes_per_s!r} bytes/s: expected a positive number, e.g. "
                          "--link-gb-per-s 25.")
    resident = set(resident)
    scale = workload.grad_accum if workload.schedule == "layer-major" else 1
    slots = max(1, min(num_slots, num_blocks - len(resident)))
    slot_free = [0.0] * slots
    kept_slot: int | None = None
    clock = copy_engine_free = previous_start = 0.0
    waits = pass_start_waits = 0.0
    copy_bound = 0
    totals = {"forward": 0.0, "head": 0.0, "backward": 0.0}
    for stage in _stages(num_blocks, workload, resident):
        if stage.block is None:
            seconds, kind = compute.head_s * scale, "head"
        elif stage.forward:
            seconds, kind = compute.forward_s[stage.block] * scale, "forward"
        else:
            seconds, kind = compute.backward_s[stage.block] * scale, "backward"
        ready = clock
        slot = None
        if stage.copy:
            slot = min(range(slots), key=slot_free.__getitem__)
            issued = previous_start if stage.prefetched else clock
            copy_start = max(issued, copy_engine_free, slot_free[slot])
            copy_engine_free = ready = copy_start + block_bytes[stage.block] / link_bytes_per_s
        start = max(clock, ready)
        wait = start - clock
        if wait > 1e-12:
            if stage.pass_start:
                pass_start_waits += wait
            else:
                copy_bound += 1
            waits += wait
        clock = start + seconds
        totals[kind] += clock - start + wait
        previous_start = start
        if slot is not None:
            if stage.keep:
                slot_free[slot], kept_slot = math.inf, slot
            else:
                slot_free[slot] = clock
        if kept_slot is not None and stage.block == num_blocks - 1 and not stage.forward:
            slot_free[kept_slot], kept_slot = clock, None
    compute_s = clock - waits + compute.optimizer_s
    copy_s = copy_bytes_per_step(block_bytes, workload, resident) / link_bytes_per_s
    return StepPrediction(step_s=clock + compute.optimizer_s, compute_s=compute_s, exposed_copy_s=waits,
                          pass_start_copy_s=pass_start_waits, copy_bound_stages=copy_bound, copy_s=copy_s,
                          forward_s=totals["forward"], head_s=totals["head"], backward_s=totals["backward"],
                          optimizer_s=compute.optimizer_s, source=compute.source)


@dataclass(frozen=True)
class BudgetPlan:
    """What the planner decided for a VRAM budget, and what it predicts.

    Attributes:
        budget_bytes: the budget as given (device memory the process may use).
        context_bytes, slack: what the budget must also hold: the CUDA context outside PyTorch's
            allocator, and the allocator's reserved-over-allocated slack (a fraction of the peak).
        num_slots: slots in the ring (``requested_slots`` unless the budget cannot hold them, and
            never more than the streamed blocks).
        resident_blocks: blocks kept on the device for good, the last ones first.
        embeddings_on_host: embedding tables looked up on the host.
        peak: the predicted peak allocated bytes and its parts.
        needed_bytes: what this plan needs of the budget: context + peak x (1 + slack).
        copy_bytes_per_step: host-to-device bytes per optimizer step.
        step: the predicted step time, or None without compute times and a link bandwidth.
        boundary_states: where layer-major keeps its M x L boundary states: ``"device"``, or
            ``"host"`` when the budget cannot hold them (or when asked).
        minimum_bytes: the smallest budget any plan fits in (1 slot, nothing resident, embeddings
            on the host when they may be, boundary states where this plan keeps them);
            ``pipelined_minimum_bytes`` with the requested slots.
        boundary_offload_minimum_bytes: the minimum with the boundary states on the host
            (layer-major; the same as ``minimum_bytes`` otherwise).
        hide_copy_resident: the fewest resident blocks (the last ones) for which no stage but the
            pass starts waits for a copy; None when unknown (no compute times).
        hide_copy_bytes, hide_copy_peak_bytes: the budget that plan needs, and its peak allocated.
        hide_copy_step: that plan's step prediction.
        notes: the decisions, in words.
        optimizer_states: where AdamW's state lives: ``"device"``, or ``"host"`` (``HostAdamW``)
            when the ring asked for does not fit the budget with it on the device (or when asked).
    """

    budget_bytes: int
    context_bytes: int
    slack: float
    workload: Workload
    num_blocks: int
    block_bytes: tuple[int, ...]
    requested_slots: int
    num_slots: int
    resident_blocks: tuple[int, ...]
    embeddings_on_host: bool
    boundary_states: str
    peak: PeakBreakdown
    needed_bytes: int
    copy_bytes_per_step: int
    link_bytes_per_s: float | None
    step: StepPrediction | None
    minimum_bytes: int
    pipelined_minimum_bytes: int
    boundary_bytes: int
    boundary_offload_minimum_bytes: int
    hide_copy_resident: int | None
    hide_copy_bytes: int | None
    hide_copy_peak_bytes: int | None
    hide_copy_step: StepPrediction | None
    notes: tuple[str, ...]
    optimizer_states: str = "device"

    def summary(self) -> str:
        """The decision in one line, for the ``poros`` logger."""
        resident = (f"{len(self.resident_blocks)} of {self.num_blocks} blocks resident "
                    f"({self.resident_blocks[0]}..{self.resident_blocks[-1]})" if self.resident_blocks
                    else f"no resident block of {self.num_blocks}")
        step = f", predicted step {self.step.step_s:.3f} s" if self.step else ""
        boundary = ", boundary states on the host" if self.boundary_states == "host" else ""
        boundary += ", AdamW state on the host" if self.optimizer_states == "host" else ""
        return (f"poros: VRAM budget {format_gb(self.budget_bytes)}: {resident}, {self.num_slots} device slot"
                f"{'s' if self.num_slots != 1 else ''}, embeddings on the {'host' if self.embeddings_on_host else 'device'}"
                f"{boundary}"
                f"; predicted peak {format_gb(self.peak.total)} allocated ({format_gb(self.needed_bytes)} with the "
                f"context and allocator slack), {format_gb(self.copy_bytes_per_step)} copied per step{step}")

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("peak", "step", "hide_copy_step", "workload",
                                                                   "block_bytes")}
        out.update(workload=asdict(self.workload), peak=self.peak.to_dict(),
                   step=self.step.to_dict() if self.step else None,
                   hide_copy_step=self.hide_copy_step.to_dict() if self.hide_copy_step else None,
                   resident_blocks=list(self.resident_blocks), notes=list(self.notes))
        return out


def _fits_plan(footprint: Footprint, workload: Workload, resident: int, slots: int, on_host: bool,
               context_bytes: int, slack: float, boundary_on_host: bool = False,
               optimizer_on_host: bool = False) -> tuple[PeakBreakdown, int]:
    last = footprint.num_blocks
    peak = predict_peak(footprint, workload, resident=range(last - resident, last), num_slots=slots,
                        embeddings_on_host=on_host, boundary_on_host=boundary_on_host,
                        optimizer_on_host=optimizer_on_host)
    return peak, budget_for_peak(peak.total, context_bytes=context_bytes, slack=slack)


def plan_budget(footprint: Footprint, workload: Workload, budget: str | int, *, num_slots: int = 2,
                embeddings_on_host: bool | None = None, compute: ComputeTimes | None = None,
                link_bytes_per_s: float | None = None, context_bytes: int = 0,
                slack: float = ALLOCATOR_SLACK, boundary_states: str | None = None,
                optimizer_states: str = "device") -> BudgetPlan:
    """Decide slots, resident blocks, embedding and boundary-state placement for ``budget``;
    predict peak and step.

    Rules: embedding tables go to the host (only the looked-up rows cross the link) unless
    ``embeddings_on_host=False``; layer-major's M x L boundary states go to the host when the
    budget cannot hold them beside the ring asked for (``boundary_states`` forces either); the
    ring gets ``num_slots`` slots, fewer only when the budget cannot hold them (with 1 slot every
    copy waits); the rest of the budget makes blocks resident, the last ones first (the last of
    forward are the first of backward). With compute times it also finds the fewest resident
    blocks that take the copy off the critical path, and the budget they need.

    Args:
        footprint: the model's bytes and the run's activations.
        workload: the step's shape.
        budget: device memory the process may use: ``"7GiB"``, ``"24GB"``, an int of bytes.
        num_slots: the ring size asked for (2: one block computes while the next arrives).
        compute, link_bytes_per_s: for the step-time prediction (both, or neither).
        context_bytes: memory outside PyTorch's allocator (:data:`CUDA_CONTEXT_BYTES` on CUDA, 0 on CPU).
        slack: allocator slack, a fraction of the peak.
        boundary_states: ``"device"`` or ``"host"`` to force where layer-major keeps its boundary
            states; None lets the budget decide.
        optimizer_states: where AdamW's state lives: ``"device"`` (torch.optim.AdamW), ``"host"``
            (``HostAdamW``) or ``"auto"``: on the host only when the ring asked for does not fit with
            it on the device
            (``poros plan`` and ``prepare`` ask for ``"auto"``: ``PorosConfig.optimizer_states``).

    Raises:
        ConfigError: an unparsable budget, or a budget below the minimum (the message names the
            minimum and what the peak is made of).
    """
    budget_bytes = parse_budget(budget)
    if num_slots < 1:
        raise ConfigError(f"num_slots={num_slots}: expected an integer >= 1 (2 overlaps copy and compute).")
    if boundary_states not in (None, "device", "host"):
        raise ConfigError(f"boundary_states={boundary_states!r}: expected 'device', 'host' or None (the budget decides).")
    if optimizer_states not in ("auto", *adamw_states.OPTIMIZER_STATES):
        raise ConfigError(f"optimizer_states={optimizer_states!r}: expected 'device', 'host' or 'auto' (the budget "
                          "decides).")
    blocks = footprint.num_blocks
    on_host = embeddings_on_host is not False and footprint.host_embedding_bytes > 0

    layer_major = workload.schedule == "layer-major"
    # 'auto': AdamW's state to the host only when the ring asked for (nothing resident, the boundary
    # states wherever they may go) does not fit with it on the device: a slot saves every copy's wait,
    # the host state costs two copies of 8 B per LoRA value per step on the side stream
    boundary_placements = {"device": (False,), "host": (True,)}.get(boundary_states, (False, layer_major))
    states = adamw_states.choose(optimizer_states, lambda: any(
        _fits_plan(footprint, workload, 0, num_slots, on_host, context_bytes, slack, boundary)[1] <= budget_bytes
        for boundary in boundary_placements))
    optimizer_on_host = states == "host"

    def sized(resident: int, slots: int, host: bool) -> tuple[PeakBreakdown, int]:
        return _fits_plan(footprint, workload, resident, slots, on_host, context_bytes, slack, host,
                          optimizer_on_host)

    def fits(resident: int, slots: int, host: bool) -> int:
        return sized(resident, slots, host)[1]

    device_minimum = fits(0, 1, False)
    offload_minimum = fits(0, 1, True) if layer_major else device_minimum
    accepted_minimum = _accepted_minimum(device_minimum, offload_minimum, layer_major, boundary_states)
    # To the host only when no plan with the ring asked for fits with them on the device, and the
    # host plan does fit -- with the ring, or at all where the device cannot hold even one slot --
    # and then with no resident block (so a bigger budget never keeps fewer blocks resident); or
    # when asked.
    auto_host = boundary_states is None and layer_major and offload_minimum <= budget_bytes and not any(
        fits(k, num_slots, False) <= budget_bytes for k in range(blocks + 1)) and (
        fits(0, num_slots, True) <= budget_bytes or device_minimum > budget_bytes)
    offload = layer_major and (auto_host or boundary_states == "host")

    def needs(resident: int, slots: int) -> tuple[PeakBreakdown, int]:
        return sized(resident, slots, offload)

    pipelined = needs(0, num_slots)[1]
    boundary_total = footprint.boundary_bytes * blocks * (workload.grad_accum if layer_major else 1)
    if budget_bytes < accepted_minimum:  # name the placement that reaches the smallest budget
        host = layer_major and (boundary_states == "host"
                                or (boundary_states is None and offload_minimum < device_minimum))
        minimum_peak, minimum = sized(0, 1, host)
        pipelined = fits(0, num_slots, host)
        where = " (boundary states on the host)" if host else ""
        other = (f" With the boundary states on the host it would need {format_gb(offload_minimum)}."
                 if boundary_states == "device" and layer_major and offload_minimum < device_minimum else "")
        parts = ", ".join(f"{name} {format_gb(n)}" for name, n in (*minimum_peak.persistent, *minimum_peak.transient)
                          if n)
        raise ConfigError(
            f"VRAM budget {format_gb(budget_bytes)} is below the minimum for this run: it needs at least "
            f"{format_gb(minimum)} ({human_bytes(minimum)}; 1 device slot, no resident block"
            f"{', embeddings on the host' if on_host else ''}{where}), {format_gb(pipelined)} with {num_slots} slots. "
            f"Predicted peak {format_gb(minimum_peak.total)} at the {minimum_peak.phase}: {parts}; plus "
            f"{format_gb(context_bytes)} context and {slack:.0%} allocator slack.{other} Raise the budget to at "
            f"least {format_gb(minimum)}, or shrink the activations (seq_len, batch_size"
            f"{', or micro-major accumulation' if workload.schedule == 'layer-major' and workload.grad_accum > 1 else ''})."
        )
    # The ring first: a second slot overlaps every copy, a resident block saves one. So resident
    # blocks only with the ring asked for (as many slots as blocks still stream, at most); without
    # room for it, fewer slots and nothing resident. A bigger budget never means fewer resident blocks.
    # an automatic host placement (boundary or AdamW state) keeps no resident block, so that a bigger
    # budget (which keeps them on the device) never keeps fewer blocks resident
    automatic_host = auto_host or (optimizer_on_host and optimizer_states == "auto")
    fitting = [k for k in range(blocks + 1) if needs(k, num_slots)[1] <= budget_bytes and not (automatic_host and k)]
    slots, most = num_slots, max(fitting, default=0)
    while not fitting and slots > 1 and needs(0, slots)[1] > budget_bytes:
        slots -= 1
    hide_resident = hide_bytes = hide_peak = hide_step = None
    timed = compute is not None and link_bytes_per_s is not None

    def step_for(resident: int, ring: int) -> StepPrediction:
        return predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s,
                            resident=range(blocks - resident, blocks), num_slots=ring)

    if timed:  # with the ring asked for, whatever this budget holds
        hide_resident = next(k for k in range(blocks + 1) if step_for(k, num_slots).copy_hidden)
        # resident blocks come with the states on the device unless asked otherwise (an automatic
        # host placement keeps none), so that is the placement the hiding budget is priced in
        hide_peak, hide_bytes = sized(hide_resident, num_slots, offload and not auto_host)
        hide_peak = hide_peak.total
        hide_step = step_for(hide_resident, num_slots)
    # Fill the budget: a block resident beyond the ones that hide the copy still saves its copies
    # (and a smaller choice could need more memory: a resident block can take less than a slot).
    resident = most
    peak, needed = needs(resident, slots)
    streamed = blocks - resident
    step = step_for(resident, slots) if timed else None

    notes = []
    if slots < num_slots:
        notes.append(f"{slots} device slot instead of {num_slots}: {format_gb(budget_bytes)} cannot hold a second "
                     f"one ({format_gb(pipelined)} needed), so every copy waits for the compute before it.")
    if resident:
        hidden = ("" if hide_resident is None else
                  f"; {hide_resident} already take the copy off the critical path" if hide_resident <= resident else
                  f"; {hide_resident} would take the copy off the critical path")
        notes.append(f"{resident} of {blocks} blocks resident (blocks {blocks - resident}..{blocks - 1}): as many as "
                     f"the budget holds{hidden}.")
    else:
        notes.append(f"no resident block: the budget has no room for one ({format_gb(footprint.block_bytes[-1])} each)"
                     if hide_resident != 0 else "no resident block: the copy is already off the critical path.")
    if footprint.host_embedding_bytes:
        notes.append(f"embedding tables on the host ({format_gb(footprint.host_embedding_bytes)} not on the device; "
                     "only the looked-up rows cross the link)" if on_host else
                     f"embedding tables on the device ({format_gb(footprint.host_embedding_bytes)}): "
                     "embeddings_on_host is off (its default off CUDA)")
    if offload:
        notes.append(f"boundary states on the host ({format_gb(boundary_total)} in pinned memory; on the device only "
                     "the prelude's and the ones in flight) " + (
                         f"because the budget cannot hold them beside {num_slots} slots "
                         f"({format_gb(fits(0, num_slots, False))} needed), so no block is resident"
                         if auto_host else "as asked")
                     + f"; their copies (2 x {format_gb(boundary_total)} per step, half each way) are not in the step "
                       "prediction")
    elif layer_major:
        notes.append(f"boundary states on the device ({format_gb(boundary_total)})"
                     + (f"; with them on the host the minimum budget is {format_gb(offload_minimum)}"
                        if offload_minimum < device_minimum else ""))
    else:
        notes.append(f"boundary states on the device ({format_gb(boundary_total)}, saved by autograd)")
    if timed and hide_resident:
        hint = _layer_major_hint(footprint, workload, compute, link_bytes_per_s, num_slots, on_host, context_bytes,
                                 slack)
        if hint:
            notes.append(hint)
    if optimizer_on_host:
        notes.append(f"AdamW state on the host ({format_gb(2 * footprint.lora_parameter_bytes)} in pinned memory, "
                     "stepped a chunk at a time by HostAdamW, bitwise torch's AdamW) "
                     + ("as asked" if optimizer_states == "host" else
                        f"because {num_slots} slots do not fit the budget with it on the device"))
    notes.append("the head stays on the device (streaming the head is not implemented)")
    if streamed == 0:
        notes.append("every block is resident: nothing streams")
    return BudgetPlan(
        budget_bytes=budget_bytes, context_bytes=context_bytes, slack=slack, workload=workload, num_blocks=blocks,
        block_bytes=footprint.block_bytes, requested_slots=num_slots, num_slots=min(slots, streamed),
        resident_blocks=tuple(range(blocks - resident, blocks)), embeddings_on_host=on_host,
        boundary_states="host" if offload else "device", peak=peak,
        needed_bytes=needed, copy_bytes_per_step=copy_bytes_per_step(footprint.block_bytes, workload,
                                                                      range(blocks - resident, blocks)),
        link_bytes_per_s=link_bytes_per_s, step=step, minimum_bytes=accepted_minimum, pipelined_minimum_bytes=pipelined,
        boundary_bytes=boundary_total, boundary_offload_minimum_bytes=offload_minimum,
        hide_copy_resident=hide_resident, hide_copy_bytes=hide_bytes, hide_copy_peak_bytes=hide_peak,
        hide_copy_step=hide_step, notes=tuple(notes), optimizer_states=states,
    )


def _layer_major_hint(footprint: Footprint, workload: Workload, compute: ComputeTimes, link_bytes_per_s: float,
                      num_slots: int, on_host: bool, context_bytes: int, slack: float, most: int = 64) -> str | None:
    """The fewest micro-batches layer-major accumulation needs to hide the copy with no resident block."""
    for micro in range(1, most + 1):
        candidate = Workload(workload.batch_size, workload.seq_len, micro, "layer-major")
        if predict_step(footprint.block_bytes, candidate, compute, link_bytes_per_s, num_slots=num_slots).copy_hidden:
            if candidate == workload:
                return None
            needed = _fits_plan(footprint, candidate, 0, num_slots, on_host, context_bytes, slack)[1]
            return (f"layer-major accumulation over {micro} or more micro-batches of this size would hide the copy "
                    f"with no resident block (each block crosses the link twice per step; its {micro} x "
                    f"{footprint.num_blocks} boundary states need a budget of {format_gb(needed)})")
    return None


def minimum_budget(footprint: Footprint, workload: Workload, *, embeddings_on_host: bool | None = None,
                   context_bytes: int = 0, slack: float = ALLOCATOR_SLACK, boundary_states: str | None = None,
                   optimizer_states: str = "device") -> int:
    """The smallest budget :func:`plan_budget` accepts for this run with the same options (1 slot,
    nothing resident; layer-major's boundary states where that is smaller unless forced; AdamW's state on
    the device unless ``optimizer_states`` is ``"host"`` or ``"auto"``)."""
    on_host = embeddings_on_host is not False and footprint.host_embedding_bytes > 0
    layer_major = workload.schedule == "layer-major"
    optimizer_on_host = optimizer_states != "device"  # 'auto' falls back to the host, which is never larger
    device = _fits_plan(footprint, workload, 0, 1, on_host, context_bytes, slack, False, optimizer_on_host)[1]
    host = (_fits_plan(footprint, workload, 0, 1, on_host, context_bytes, slack, True, optimizer_on_host)[1]
            if layer_major else device)
    return _accepted_minimum(device, host, layer_major, boundary_states)


def _accepted_minimum(device: int, host: int, layer_major: bool, boundary_states: str | None) -> int:
    if not layer_major or boundary_states == "device":
        return device
    return host if boundary_states == "host" else min(device, host)


# ---------------------------------------------------------------------------------------------
# The loaded model's footprint (prepare(vram_budget=...)) and the compute probe
# ---------------------------------------------------------------------------------------------
def footprint_of_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module],
                       workload: Workload, *, device: torch.device, compute_dtype: torch.dtype,
                       block_bytes: Iterable[int] | None = None) -> Footprint:
    """The :class:`Footprint` of a loaded HF + bitsandbytes + PEFT model.

    Block bytes are the block store's (exact; computed from the modules unless ``block_bytes``
    gives them, as after packing); the frozen tensors outside the blocks at their allocated size,
    ``host_tables``' among them as the embedding tables that may live on the host; the LoRA bytes
    are the trainable parameters'.
    """
    from poros.stream.store import packed_block_bytes

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


def measure_link(device: torch.device | str, nbytes: int = 256 * 2**20, repeats: int = 3) -> float:
    """Host-to-device bytes per second of one ``nbytes`` copy from pinned memory (best of ``repeats``
    after a warm-up); on CPU the memcpy a CPU block fetch does."""
    import time

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=on_cuda)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = math.inf
    for attempt in range(repeats + 1):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
        if attempt:  # the first copy warms up
            best = min(best, seconds)
    return nbytes / best


def _probe_config(text_config: Any, layers: int) -> Any:
    """``text_config`` cut to its first ``layers`` decoder layers (each layer kind present), no KV sharing."""
    values = text_config.to_dict()
    values["num_hidden_layers"] = layers
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = values["layer_types"][:layers]
    if isinstance(values.get("per_layer_config"), dict):  # per-layer overrides, keyed by layer index
        values["per_layer_config"] = {k: v for k, v in values["per_layer_config"].items() if int(k) < layers}
    if values.get("num_kv_shared_layers"):
        values["num_kv_shared_layers"] = 0  # a sharing layer computes a little less: timed as a full one
    return type(text_config).from_dict(values)


def _probe_layer_count(text_config: Any, limit: int = 8) -> int:
    """The shortest prefix of the layers that holds every layer kind (``layer_types``), at most ``limit``."""
    kinds = list(getattr(text_config, "layer_types", None) or [])
    if not kinds:
        return 1
    wanted, seen = set(kinds), set()
    for count, kind in enumerate(kinds, start=1):
        seen.add(kind)
        if seen == wanted or count == limit:
            return count
    return len(kinds)


def random_qlora_model(text_config: Any, device: torch.device | str, *, compute_dtype: torch.dtype,
                       quant_type: str = "nf4", double_quant: bool = False, attn_implementation: str | None = None,
                       lora_rank: int = 16, lora_alpha: int = 32, target_modules: str | list[str] = "all-linear",
                       seed: int = 0) -> nn.Module:
    """A PEFT LoRA model around an NF4 base of ``text_config`` with random weights, built on ``device``
    the way ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` builds
    one (transformers' quantizer swaps the linears; ``Params4bit(...).to(device)`` quantizes), so no
    bf16 copy of the model ever exists. For timing, not for parity (``tools/bench.py`` builds its
    models with the same calls and more checks)."""
    import bitsandbytes as bnb
    import peft
    import transformers
    from transformers.quantizers import AutoHfQuantizer

    from poros.trainer import lora_target_modules

    device = torch.device(device)
    quant_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                   bnb_4bit_compute_dtype=compute_dtype,
                                                   bnb_4bit_use_double_quant=double_quant)
    quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=False)
    config = copy.deepcopy(text_config)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    quantizer.preprocess_model(model=model, dtype=compute_dtype, device_map={"": device}, checkpoint_files=None,
                               use_kernels=False)
    generator = torch.Generator(device=device).manual_seed(seed)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                value = torch.randn(module.weight.shape, generator=generator, device=device, dtype=compute_dtype)
                module.weight = bnb.nn.Params4bit(value * 0.02, requires_grad=False,
                                                  **module.weight.__dict__).to(device)
                if module.bias is not None:
                    module.bias = nn.Parameter(torch.zeros(module.bias.shape, device=device, dtype=compute_dtype),
                                               requires_grad=False)
                module._is_hf_initialized = True
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor is None or not tensor.is_meta or name in tied:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            value = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
            if isinstance(tensor, nn.Parameter):
                setattr(parent, attr, nn.Parameter(value, requires_grad=False))
            else:
                setattr(parent, attr, value)
        torch.manual_seed(seed)
        model.initialize_weights()
        model.tie_weights()
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)
    lora = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=lora_target_modules(model, target_modules))
    peft_model = peft.get_peft_model(model, lora)
    peft_model.train()
    return peft_model


def probe_compute(text_config: Any, workload: Workload, device: torch.device | str, *,
                  compute_dtype: torch.dtype = torch.bfloat16, quant_type: str = "nf4", double_quant: bool = False,
                  attn_implementation: str | None = None, lora_rank: int = 16, lora_alpha: int = 32,
                  target_modules: str | list[str] = "all-linear", warmup: int = 1, iterations: int = 3,
                  lora_parameters: int | None = None) -> ComputeTimes:
    """Time one micro-batch's work per block at the run's real shapes: a random NF4 + LoRA model of
    ``text_config`` cut to the fewest layers that hold every layer kind, every block resident (no
    copy), streamed by :func:`poros.prepare` so the executor's own recompute and overheads are in
    the numbers, on the workload's schedule (layer-major: ``forward_backward`` over its M
    micro-batches, whose overheads differ). CUDA events (host clock on CPU) at each block's entry,
    forward and recompute, at the final norm and after backward give each block's forward, its
    recompute + backward and the head's forward + backward, per micro-batch; the median of
    ``iterations`` after ``warmup``. Each real block gets the times of the probed block of its kind.
    The optimizer step is timed on the probe's adapters and scaled to ``lora_parameters`` (default:
    to the model's number of blocks).

    Raises:
        torch.OutOfMemoryError: the probe model does not fit on the device.
    """
    import statistics
    import time

    import poros

    device = torch.device(device)
    on_cuda = device.type == "cuda"
    layers = _probe_layer_count(text_config)
    model = random_qlora_model(_probe_config(text_config, layers), device, compute_dtype=compute_dtype,
                               quant_type=quant_type, double_quant=double_quant,
                               attn_implementation=attn_implementation, lora_rank=lora_rank, lora_alpha=lora_alpha,
                               target_modules=target_modules)
    streamed = poros.prepare(model, resident_blocks=layers, embeddings_on_host=on_cuda)
    probe_lora_parameters = sum(p.numel() for p in streamed.trainable_parameters())
    marks: list[tuple[str, Any]] = []

    def mark(label: str) -> None:
        if on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append((label, event))
        else:
            marks.append((label, time.perf_counter()))

    hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: mark(f"block {i}"))
             for i, layer in enumerate(streamed.executor.layers)]
    hooks.append(streamed.executor.final_norm.register_forward_pre_hook(lambda module, args: mark("head")))
    optimizer = torch.optim.AdamW(streamed.trainable_parameters(), lr=1e-6)
    vocab = text_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    samples: list[dict[str, float]] = []
    micro = workload.grad_accum if workload.schedule == "layer-major" else 1
    try:
        for iteration in range(warmup + iterations):
            batches = []
            for _ in range(micro):
                ids = torch.randint(0, vocab, (workload.batch_size, workload.seq_len), generator=generator).to(device)
                batches.append({"input_ids": ids, "labels": ids})
            marks.clear()
            mark("start")
            if micro > 1:
                items = torch.tensor(micro * workload.batch_size * (workload.seq_len - 1), device=device)
                streamed.forward_backward([{**batch, "num_items_in_batch": items} for batch in batches])
            else:
                streamed(**batches[0]).loss.backward()
            mark("end")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark("optimizer")
            if on_cuda:
                torch.cuda.synchronize(device)
                times = [0.0] + [marks[0][1].elapsed_time(e) / 1000 for _, e in marks[1:]]
            else:
                times = [t - marks[0][1] for _, t in marks]
            if iteration >= warmup:
                samples.append(_segments([label for label, _ in marks], times, layers, micro))
    finally:
        for hook in hooks:
            hook.remove()
        streamed.unpatch()
        del streamed, model, optimizer
        if on_cuda:
            torch.cuda.empty_cache()
    median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    kinds = list(getattr(text_config, "layer_types", None) or [])
    probed_kinds = kinds[:layers]

    def probed(i: int) -> int:
        kind = kinds[i] if i < len(kinds) else None
        return probed_kinds.index(kind) if kind in probed_kinds else 0

    blocks = text_config.num_hidden_layers
    # AdamW's time grows with the parameters: scale to the run's (by default, to its number of blocks)
    optimizer_s = median["optimizer"] * (lora_parameters / probe_lora_parameters if lora_parameters
                                         and probe_lora_parameters else blocks / layers)
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    return ComputeTimes(
        forward_s=tuple(median[f"forward {probed(i)}"] for i in range(blocks)),
        backward_s=tuple(median[f"backward {probed(i)}"] for i in range(blocks)),
        head_s=median["head"], optimizer_s=optimizer_s,
        source=f"probe on {name} ({layers} block{'s' if layers > 1 else ''} at batch {workload.batch_size} x seq "
               f"{workload.seq_len}{f', layer-major over {micro}' if micro > 1 else ''}, median of {iterations})",
    )


def _segments(labels: list[str], times: list[float], layers: int, micro: int = 1) -> dict[str, float]:
    """Per-block forward and recompute + backward, head and optimizer seconds, per micro-batch, from
    one iteration's marks: ``start``, each block's entries in forward (M of them layer-major), the
    head's, each block's recompute entries, ``end``, ``optimizer``. A block's time runs from its
    first entry to the next block's (or the head's, or ``end``)."""
    at = dict(enumerate(times))
    heads = [i for i, label in enumerate(labels) if label == "head"]
    end = labels.index("end")

    def first(label: str, after: int, before: int) -> int:
        return next(i for i in range(after, before) if labels[i] == label)

    try:
        forward = [first(f"block {b}", 0, heads[0]) for b in range(layers)]
        backward = [first(f"block {b}", heads[-1], end) for b in range(layers - 1, -1, -1)]
    except (StopIteration, IndexError):
        raise StreamingError(f"the probe's marks do not follow the executor's order for {layers} blocks and {micro} "
                             f"micro-batches: {labels}") from None
    out = {}
    for position, index in enumerate(forward):
        following = forward[position + 1] if position + 1 < layers else heads[0]
        out[f"forward {position}"] = (at[following] - at[index]) / micro
    for position, index in enumerate(backward):
        following = backward[position + 1] if position + 1 < layers else end
        out[f"backward {layers - 1 - position}"] = (at[following] - at[index]) / micro
    out["head"] = (at[backward[0]] - at[heads[0]]) / micro
    out["optimizer"] = at[labels.index("optimizer")] - at[end]
    return out


def predict_prepared(model: Any, workload: Workload, *, compute: ComputeTimes | None = None,
                     link_bytes_per_s: float | None = None, optimizer_states: str = "device") -> dict[str, Any]:
    """What the planner predicts for a :class:`~poros.model.PorosModel` as :func:`poros.prepare` set it
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
                        boundary_on_host=model.executor.boundary_states == "host",
                        optimizer_on_host=optimizer_states == "host")
    step = None
    if compute is not None and link_bytes_per_s:
        step = predict_step(footprint.block_bytes, workload, compute, link_bytes_per_s, resident=resident,
                            num_slots=slots).to_dict()
    return {"peak_allocated_bytes": peak.total, "peak": peak.to_dict(), "resident_blocks": list(resident),
            "num_slots": store.num_slots, "copy_bytes_per_step": copy_bytes_per_step(footprint.block_bytes, workload,
                                                                                     resident),
            "link_bytes_per_s": link_bytes_per_s, "step": step,
            "compute": asdict(compute) if compute is not None else None}


def plan_for_model(causal_lm: nn.Module, layers: list[nn.Module], host_tables: list[nn.Module], *,
                   budget: str | int, workload: Workload, device: torch.device, compute_dtype: torch.dtype,
                   num_slots: int = 2, embeddings_on_host: bool | None = None,
                   boundary_states: str | None = None, optimizer_states: str = "auto") -> BudgetPlan:
    """:func:`plan_budget` for a loaded model (what ``prepare(vram_budget=...)`` asks); no compute
    times, so the plan fills the budget with resident blocks.

    Raises:
        ConfigError: an unparsable budget, or one below the minimum.
    """
    footprint = footprint_of_model(causal_lm, layers, host_tables, workload, device=device,
                                   compute_dtype=compute_dtype)
    return plan_budget(footprint, workload, budget, num_slots=num_slots, embeddings_on_host=embeddings_on_host,
                       context_bytes=CUDA_CONTEXT_BYTES if device.type == "cuda" else 0,
                       boundary_states=boundary_states, optimizer_states=optimizer_states)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What ``--dry-run`` prints and ``poros plan`` plans from. Sizes in bytes; activations are estimates."""

    model: str
    checkpoint: str  # the directory the config came from
    found_in: str  # "bundled with poros" | "local directory" | "HF cache"
    family: str
    model_type: str
    text_tower_of: str | None  # the multimodal model_type whose text tower is planned, else None
    num_blocks: int
    hidden_size: int
    vocab_size: int
    quantization: str
    double_quant: bool
    compute_dtype: str
    block_bytes: tuple[int, ...]  # host store, per block (exact)
    non_block_bytes: int  # frozen tensors outside the blocks (embeddings, final norm, head, rotary...)
    embedding_table_bytes: int  # the part of non_block_bytes that may live on the host
    host_embedding_bytes: int  # the part of non_block_bytes kept on the host (embeddings_on_host)
    lora_rank: int
    use_dora: bool
    lora_modules: int
    lora_parameters: int
    target_modules: str  # as configured, for the header
    batch_size: int
    seq_len: int
    grad_accum: int
    stream_schedule: str  # "micro-major" | "layer-major"
    num_slots: int
    device: str  # resolved: "cpu", "cuda", "cuda:N"
    activation_bytes_per_value: int  # compute dtype size
    recompute_bytes: int  # one block's recompute working set, one micro-batch (estimate)
    logits_bytes: int  # logits + loss working set, one micro-batch (estimate)

    @property
    def largest_block_bytes(self) -> int:
        return max(self.block_bytes, default=0)

    @property
    def host_store_bytes(self) -> int:
        return sum(self.block_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.largest_block_bytes

    @property
    def device_non_block_bytes(self) -> int:
        return self.non_block_bytes - self.host_embedding_bytes

    @property
    def lora_state_bytes(self) -> int:
        return self.lora_parameters * LORA_BYTES_PER_PARAMETER

    @property
    def boundary_activation_bytes(self) -> int:
        """The saved block inputs: L of them, M x L with layer-major accumulation."""
        micro_batches = self.grad_accum if self.stream_schedule == "layer-major" else 1
        return (micro_batches * self.num_blocks * self.batch_size * self.seq_len * self.hidden_size
                * self.activation_bytes_per_value)

    @property
    def peak_device_bytes_estimate(self) -> int:
        """An upper bound: every part at once, though the head's and a block's working sets never coincide."""
        return (self.slot_bytes + self.device_non_block_bytes + self.lora_state_bytes
                + self.boundary_activation_bytes + self.recompute_bytes + self.logits_bytes)

    @property
    def host_ram_bytes_estimate(self) -> int:
        """Host store + host embeddings; on a CPU run the device's share is host memory as well."""
        host = self.host_store_bytes + self.host_embedding_bytes
        if self.device == "cpu":
            host += self.peak_device_bytes_estimate
        return host

    def footprint(self) -> Footprint:
        """The planner's view of this run (:func:`plan_budget`)."""
        return Footprint(
            block_bytes=self.block_bytes,
            device_non_block_bytes=self.non_block_bytes - self.embedding_table_bytes,
            host_embedding_bytes=self.embedding_table_bytes,
            lora_parameter_bytes=self.lora_parameters * LORA_VALUE_BYTES,
            boundary_bytes=self.batch_size * self.seq_len * self.hidden_size * self.activation_bytes_per_value,
            recompute_bytes=self.recompute_bytes, head_bytes=self.logits_bytes,
            workspace_bytes=CUDA_WORKSPACE_BYTES if self.device.startswith("cuda") else 0,
        )


def plan_run(config: Any) -> Plan:
    """The memory plan of a :class:`~poros.config.PorosConfig`, from the checkpoint's config only.

    Raises:
        CheckpointLoadError: the checkpoint's ``config.json`` is not available offline or unreadable.
        UnknownArchitectureError: no registered family claims its ``model_type``.
        ConfigError: ``target_modules`` names a linear the model does not have.
    """
    from poros import registry
    from poros.trainer import resolve_device

    directory, found_in = locate_checkpoint_config(config.model, revision=config.revision)
    full_config, text_config = load_text_config(directory)
    descriptor = registry.for_config(text_config)
    compute_dtype = getattr(torch, config.compute_dtype)
    model = meta_skeleton(text_config, compute_dtype)
    blocks = list(resolve_path(model, descriptor.decoder_layers))
    quantized = quantized_linears(model)
    quantized_weights = {id(module.weight) for module in quantized.values()}
    sizes = block_bytes(blocks, quantized_weights, double_quant=config.double_quant)

    in_blocks = {id(t) for block in blocks for t in [*block.parameters(), *block.buffers()]}
    outside = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in in_blocks}
    non_block = sum(_tensor_bytes(t, quantized_weights, config.double_quant) for t in outside.values())

    device = str(resolve_device(config.device))
    on_host = config.embeddings_on_host if config.embeddings_on_host is not None else device.startswith("cuda")
    tables = sum(t.weight.numel() * t.weight.element_size() for t in host_embedding_tables(model, descriptor))

    targets = lora_targets(model, config.target_modules)
    lora_parameters = sum(config.lora_rank * (m.in_features + m.out_features)
                          + (m.out_features if config.use_dora else 0) for m in targets.values())

    value_bytes = torch.empty((), dtype=compute_dtype, device="meta").element_size()
    _, recompute, head = activation_bytes(BlockShapes.of(blocks, text_config), batch_size=config.batch_size,
                                          seq_len=config.seq_len, value_bytes=value_bytes,
                                          attn_implementation=config.attn_implementation,
                                          loss_chunks=getattr(config, "loss_chunks", 1))
    return Plan(
        model=config.model, checkpoint=str(directory), found_in=found_in, family=descriptor.name,
        model_type=text_config.model_type,
        text_tower_of=full_config.model_type if text_config is not full_config else None,
        num_blocks=len(blocks), hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
        quantization=config.quantization, double_quant=config.double_quant, compute_dtype=config.compute_dtype,
        block_bytes=tuple(sizes), non_block_bytes=non_block, embedding_table_bytes=tables,
        host_embedding_bytes=tables if on_host else 0, lora_rank=config.lora_rank,
        use_dora=config.use_dora, lora_modules=len(targets), lora_parameters=lora_parameters,
        target_modules=(config.target_modules if isinstance(config.target_modules, str)
                        else ",".join(config.target_modules)),
        batch_size=config.batch_size, seq_len=config.seq_len, grad_accum=config.grad_accum,
        stream_schedule=config.stream_schedule, num_slots=config.num_slots, device=device, activation_bytes_per_value=value_bytes,
        recompute_bytes=recompute, logits_bytes=head,
    )


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------
def human_bytes(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _runs(sizes: tuple[int, ...]) -> str:
    """``(5, 5, 7)`` -> ``"5 B x 2, 7 B x 1"``: block sizes in order, consecutive equal ones grouped."""
    groups: list[list[int]] = []
    for size in sizes:
        if groups and groups[-1][0] == size:
            groups[-1][1] += 1
        else:
            groups.append([size, 1])
    return ", ".join(f"{size:,} B x {count}" for size, count in groups)


def _header(plan: Plan) -> list[str]:
    tower = f", text tower of {plan.text_tower_of}" if plan.text_tower_of else ""
    quant = f"{plan.quantization}{' + double quant' if plan.double_quant else ''}"
    adapter = (f"LoRA r{plan.lora_rank}{' + DoRA' if plan.use_dora else ''} on {plan.lora_modules} linears "
               f"({plan.target_modules}): {plan.lora_parameters:,} trainable parameters")
    return [
        f"model       {plan.model} ({plan.found_in}: {plan.checkpoint})",
        f"family      {plan.family} (model_type {plan.model_type}{tower}): {plan.num_blocks} decoder blocks, "
        f"hidden {plan.hidden_size}, vocab {plan.vocab_size}",
        f"base        {quant}, compute {plan.compute_dtype}",
        f"adapters    {adapter}",
    ]


def _byte_rows(items):
    return [(label, f"{nbytes:,}", human_bytes(nbytes)) for label, nbytes in items]


def format_plan(plan: Plan) -> str:
    """The plan as text: a header and two fixed-width tables (host, device), estimates labelled."""
    from poros.cli.output import table

    header = [
        *_header(plan),
        f"run         batch {plan.batch_size} x seq {plan.seq_len}, {plan.num_slots} device slots, device "
        f"{plan.device}",
        f"blocks      {_runs(plan.block_bytes)} (host store, exact)",
    ]
    host_rows = [
        (f"block store ({plan.num_blocks} blocks)", plan.host_store_bytes),
        ("embedding tables kept on host", plan.host_embedding_bytes),
    ]
    if plan.device == "cpu":
        host_rows.append(("device share (device is cpu: see below)",
                          plan.host_ram_bytes_estimate - plan.host_store_bytes - plan.host_embedding_bytes))
    host_rows.append(("expected host RAM (estimate, without the runtime)", plan.host_ram_bytes_estimate))
    workload = Workload(plan.batch_size, plan.seq_len, plan.grad_accum, plan.stream_schedule)
    layer_major = f"{plan.grad_accum} x " if plan.stream_schedule == "layer-major" and plan.grad_accum > 1 else ""
    predicted = predict_peak(plan.footprint(), workload, num_slots=plan.num_slots,
                             embeddings_on_host=plan.host_embedding_bytes > 0)
    device_rows = [
        (f"device slots ({plan.num_slots} x largest block)", plan.slot_bytes),
        ("modules outside the blocks", plan.device_non_block_bytes),
        ("LoRA params + grads + AdamW state (fp32)", plan.lora_state_bytes),
        (f"boundary activations ({layer_major}{plan.num_blocks} x {plan.batch_size} x {plan.seq_len} x "
         f"{plan.hidden_size} x {plan.activation_bytes_per_value} B)", plan.boundary_activation_bytes),
        ("one block's recompute working set (estimate)", plan.recompute_bytes),
        ("logits and loss (estimate)", plan.logits_bytes),
        ("peak device memory (estimate): all of the above at once", plan.peak_device_bytes_estimate),
        (f"predicted peak allocated (at the {predicted.phase}; as poros plan)", predicted.total),
    ]
    return "\n".join([
        *header, "",
        table(("host memory", "bytes", "size"), _byte_rows(host_rows)), "",
        table(("device memory", "bytes", "size"), _byte_rows(device_rows)), "",
        "Estimates: block bytes are exact; the device peak leaves out the CUDA context and allocator "
        "fragmentation. `poros plan --vram-budget 8GiB` plans slots and resident blocks for a budget.",
    ])


def format_budget_plan(plan: Plan, budget_plan: BudgetPlan, *, link_source: str | None = None) -> str:
    """``poros plan``'s report: the decisions, the predicted peak and its parts against the budget,
    the copies and the step time, and the budget that takes the copy off the critical path."""
    from poros.cli.output import table

    bp, workload = budget_plan, budget_plan.workload
    gb = format_gb
    accumulation = (f"{workload.grad_accum} micro-batches per step, {workload.schedule}" if workload.grad_accum > 1
                    else "1 micro-batch per step")
    header = [
        *_header(plan),
        f"run         batch {workload.batch_size} x seq {workload.seq_len}, {accumulation}, device {plan.device}",
        f"blocks      {_runs(plan.block_bytes)} (packed, exact)",
        f"budget      {gb(bp.budget_bytes)} ({human_bytes(bp.budget_bytes)})",
    ]
    resident = bp.resident_blocks
    streamed = bp.num_blocks - len(resident)
    decisions = [
        ("device slots", f"{bp.num_slots}" + (f" (asked {bp.requested_slots})"
                                              if bp.num_slots < min(bp.requested_slots, streamed) else "")),
        ("resident blocks", f"{len(resident)} of {bp.num_blocks}" + (f" ({resident[0]}..{resident[-1]})"
                                                                     if resident else "")),
        ("embedding tables", "host" if bp.embeddings_on_host else "device"),
        ("boundary states", f"{bp.boundary_states} ({gb(bp.boundary_bytes)}"
                            + ("; pinned, in flight on the device" if bp.boundary_states == "host" else "") + ")"),
        ("AdamW state", bp.optimizer_states + ("; pinned, stepped a chunk at a time" if bp.optimizer_states == "host"
                                               else "")),
        ("head", "device (head streaming not implemented)"),
    ]
    memory = [(name, n) for name, n in (*bp.peak.persistent, *bp.peak.transient) if n]
    slack_bytes = bp.needed_bytes - bp.context_bytes - bp.peak.total
    memory += [("predicted peak allocated", bp.peak.total),
               (f"allocator slack ({bp.slack:.0%} of the peak)", slack_bytes)]
    if bp.context_bytes:
        memory.append(("CUDA context (outside the allocator)", bp.context_bytes))
    memory += [("needed", bp.needed_bytes),
               (f"budget ({'fits' if bp.needed_bytes <= bp.budget_bytes else 'does not fit'})", bp.budget_bytes)]
    per = "per step for all micro-batches" if workload.schedule == "layer-major" else "per micro-batch"
    copies = (f"copies      {gb(bp.copy_bytes_per_step)} host-to-device per step (each streamed block twice {per}, "
              "the last block once)")
    lines = [*header, "", table(("decision", "value"), decisions), "",
             table((f"device memory (peak: {bp.peak.phase})", "bytes", "size"), _byte_rows(memory)), "", copies]
    if bp.step is None:
        lines.append("step time   unknown: no compute times (run on CUDA with --probe, or give --block-ms and "
                     "--link-gb-per-s)")
    else:
        step = bp.step
        link = f"{bp.link_bytes_per_s / 1e9:.1f} GB/s ({link_source or 'given'})"
        lines += ["", table(("predicted step", "seconds"), [
            ("forward (blocks, with copy waits)", f"{step.forward_s:.4f}"),
            ("head and loss", f"{step.head_s:.4f}"),
            ("recompute + backward (blocks, with copy waits)", f"{step.backward_s:.4f}"),
            ("optimizer", f"{step.optimizer_s:.4f}"),
            ("step", f"{step.step_s:.4f}"),
            ("  of which waiting for copies", f"{step.exposed_copy_s:.4f}"),
            ("  link busy (copy bytes / link)", f"{step.copy_s:.4f}"),
        ]), f"compute     {step.source}", f"link        {link}"]
    if bp.hide_copy_resident is None:
        lines.append("hide copy   unknown without compute times")
    elif bp.hide_copy_resident == 0:
        lines.append("hide copy   the copy is already off the critical path (every stage waits on compute)")
    else:
        lines.append(f"hide copy   needs {bp.hide_copy_resident} of {bp.num_blocks} blocks resident: a budget of "
                     f"{gb(bp.hide_copy_bytes)} (predicted peak {gb(bp.hide_copy_peak_bytes)} allocated, step "
                     f"{bp.hide_copy_step.step_s:.4f} s)"
                     + (": this budget has it" if bp.hide_copy_bytes <= bp.budget_bytes else ""))
    lines += ["", "Decisions:", *(f"  - {note}" for note in bp.notes),
              f"Minimum budget for this run: {gb(bp.minimum_bytes)} (1 slot, nothing resident), "
              f"{gb(bp.pipelined_minimum_bytes)} with {bp.requested_slots} slots.",
              "Block bytes are exact; the peak's parts are estimates (within 3 % of the H200 measurements in "
              "registry/results); step times are a pipeline model of the measured or given GPU times, a lower "
              "bound where the host cannot keep the GPU busy (on the H200 at 512 tokens the predictions were "
              "14-62 % below the measured steps: docs/results-h200.md)."]
    return "\n".join(lines)


__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT_BYTES", "BudgetPlan", "ComputeTimes", "Footprint", "Plan", "StepPrediction", "Workload",
           "block_bytes", "copy_bytes_per_step", "format_budget_plan", "format_plan", "human_bytes",
           "locate_checkpoint_config", "measure_link", "minimum_budget", "parse_budget", "plan_budget",
           "plan_for_model", "plan_run", "predict_peak", "predict_step", "probe_compute", "quantized_tensor_bytes"]

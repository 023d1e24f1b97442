"""Where the parts of a streamed model live besides the block ring: which embedding tables may be
looked up on the host (:func:`host_embedding_tables`), whether they are by default
(:func:`embeddings_on_host`), where layer-major keeps its boundary states
(:func:`check_boundary_states`), and what CUDA graphs hold beside the peak (:func:`graph_reserve_bytes`, their
shared LoRA and LoRA gradient buffers :func:`shared_statics_bytes`). The one home of these rules: ``prepare``, the
planner's footprint, the dry-run plan and ``poros plan`` ask here. Torch-free at import."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from typing import Any

from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import DescriptorError
from poros.settings import BOUNDARY_STATES, SETTINGS


def embeddings_on_host(option: bool | None, device: Any) -> bool:
    """``embeddings_on_host`` as given, or its default: on the host when the run computes on CUDA
    (only the looked-up rows cross the link); on the device otherwise. ``device`` is a
    ``torch.device`` or its string (``"cuda:0"``, ``"cpu"``)."""
    if option is not None:
        return bool(option)
    return str(getattr(device, "type", device)).startswith("cuda")


def check_boundary_states(value: str | None) -> None:
    """Raise unless ``value`` names a place layer-major may keep its boundary states (None: the
    budget planner decides, else the device).

    Raises:
        ConfigError: anything but ``"device"``, ``"host"``, ``"disk"`` or None.
    """
    SETTINGS["boundary_states"].check(value)


def host_embedding_tables(model: Any, descriptor: ArchitectureDescriptor) -> list[Any]:
    """Frozen embedding tables (input and prelude) that may live on the host: the ``nn.Embedding``
    modules at the descriptor's ``embeddings`` and enabled ``prelude_modules`` whose weight is not
    the head's (the same parameter, or the same storage once loaded). On a meta skeleton, where
    nothing has storage or is frozen yet, identity decides."""
    from torch import nn

    disabled = descriptor.disabled_names(model.config)
    paths = [descriptor.embeddings, *(p for p in descriptor.prelude_modules if p not in disabled)]
    head_weight = getattr(resolve_path(model, descriptor.head), "weight", None)
    head_storage = head_weight.data_ptr() if head_weight is not None and not head_weight.is_meta else None
    tables = []
    for path in paths:
        try:
            module = resolve_path(model, path)
        except DescriptorError:
            continue
        if not isinstance(module, nn.Embedding) or module.weight is head_weight:
            continue
        if module.weight.is_meta or (not module.weight.requires_grad and module.weight.data_ptr() != head_storage):
            tables.append(module)
    return tables


def graph_reserve_bytes(footprint: Any) -> int:
    """Device memory ``cuda_graphs`` reserves beside the allocated peak: the graphs' shared pool, where each capture
    allocates and frees one block's recompute-and-backward working set (the forward's fits inside it; the fused
    NF4 experts in the held scratch instead, ``footprint.captured_recompute_bytes``) and that block's LoRA gradients
    as autograd makes them (temporaries, copied into the shared gradient buffers at the capture's end). Every
    capture reuses the same bytes, which stay reserved in the pool, out of the reach of the eager allocator: an
    estimate, counted by the planner like the CUDA context. What the graphs keep allocated the peak counts
    (:func:`graph_statics_bytes`, which carries the per-graph parts). ``footprint``: a
    ``poros.plan.budget.Footprint``."""
    return (footprint.captured_recompute_bytes or footprint.recompute_bytes) + _statics_lora(footprint)


def graph_statics_bytes(footprint: Any, num_slots: int) -> int:
    """Device memory CUDA graphs keep allocated for the whole run (``poros.plan.peak.predict_peak`` counts it as
    persistent where ``footprint.cuda_graphs``): the static LoRA buffers, one set every graph shares
    (``graph_capture.ParameterStatics``): ``footprint.lora_statics_bytes`` (:func:`shared_statics_bytes`; 0,
    unknown: the average block's LoRA); the LoRA gradient buffers every backward graph returns, one shared set as
    large; per forward graph its static boundary states in and out; per backward graph the boundary state in, the
    output gradient in and the hidden gradient out; and the capture scratch, the largest fused NF4 expert tensor
    dequantized (``footprint.expert_scratch_bytes``, ``poros.stream.capture_scratch``).

    The graphs: per phase one for each device slot and block structure (``footprint.block_structures``:
    blocks of different modules or attributes key graphs apart), and one more backward, block 0's
    (its input needs no gradient). Not counted: resident blocks' graphs (each keys its own) and graphs
    of more argument shapes (batches padded to several lengths). Activations per micro-batch."""
    keyed = max(num_slots, 1) * max(footprint.block_structures, 1)
    forward, backward = keyed, keyed + 1
    boundary = footprint.boundary_bytes
    return (2 * _statics_lora(footprint) + forward * 2 * boundary + backward * 3 * boundary
            + footprint.expert_scratch_bytes)


def _statics_lora(footprint: Any) -> int:
    return footprint.lora_statics_bytes or footprint.lora_parameter_bytes // max(len(footprint.block_bytes), 1)


def shared_statics_bytes(blocks: Iterable[Iterable[tuple[Hashable, int]]]) -> int:
    """Bytes of the static LoRA buffers all CUDA graphs share, by ``graph_capture.ParameterStatics``' rule:
    per tensor signature as many buffers as the block with the most tensors of that signature has. ``blocks``:
    each block's trainable tensors as ``(signature, bytes)`` (shape, strides and dtype; one device)."""
    most: Counter = Counter()
    for tensors in blocks:
        for entry, count in Counter(tensors).items():
            most[entry] = max(most[entry], count)
    return sum(size * count for (_, size), count in most.items())

def warn_states_stay(boundary_states: str, kept_inputs: int) -> None:
    """Say once that a forward with grad outside a layer-major step keeps its block inputs on the device although
    the plan put the boundary states on the ``boundary_states`` side (the 128K step that ran out of memory)."""
    import logging

    logging.getLogger("poros").warning(
        "poros: boundary_states=%r is honoured by layer-major steps only (model.forward_backward, PorosTrainer, "
        "prepare_trainer's windows); this forward with grad runs micro-major and keeps its %d kept block inputs on "
        "the device (autograd saves them), beyond what the plan priced. Run the step through "
        "model.forward_backward([batch]).", boundary_states, kept_inputs)


__all__ = ["warn_states_stay", "BOUNDARY_STATES", "check_boundary_states", "embeddings_on_host", "graph_reserve_bytes",
           "host_embedding_tables", "shared_statics_bytes"]

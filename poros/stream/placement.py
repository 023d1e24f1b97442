"""Where the parts of a streamed model live besides the block ring: which embedding tables may be
looked up on the host (:func:`host_embedding_tables`), whether they are by default
(:func:`embeddings_on_host`), where layer-major keeps its boundary states
(:func:`check_boundary_states`), and what CUDA graphs hold beside the peak (:func:`graph_reserve_bytes`). The one home of these rules: ``prepare``, the planner's footprint,
the dry-run plan and ``poros plan`` ask here. Torch-free at import."""

from __future__ import annotations

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


def graph_reserve_bytes(footprint: Any, num_slots: int) -> int:
    """Device memory ``cuda_graphs`` holds beside the allocated peak — an estimate, counted by the
    planner like the CUDA context: the graphs' shared pool (one block's recompute-and-backward working
    set; the forward's fits inside it) and, per graph (forward and backward for each slot, and block
    0's backward, whose input needs no gradient), static inputs and outputs (the boundary states in and
    out and the output gradient) and the block's LoRA values and gradients. ``footprint`` is a
    ``poros.plan.budget.Footprint``; activations per micro-batch."""
    lora_per_block = footprint.lora_parameter_bytes // max(len(footprint.block_bytes), 1)
    graphs = 2 * max(num_slots, 1) + 1
    return footprint.recompute_bytes + graphs * (3 * footprint.boundary_bytes + 2 * lora_per_block)

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
           "host_embedding_tables"]

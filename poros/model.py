"""``poros.prepare``: turn an HF NF4 + PEFT LoRA causal LM into a streamed :class:`PorosModel`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from poros import registry
from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.errors import UnsupportedModelError
from poros.stream.executor import StreamingExecutor
from poros.stream.store import BlockStore, HostEmbedding


class PorosModel(nn.Module):
    """An HF causal LM whose decoder blocks stream through the compute device.

    Called like the HF model (``input_ids``, ``attention_mask``, ``labels``, ``position_ids``,
    ``num_items_in_batch``...) and returns the HF output (``.loss``, ``.logits``). Train it with
    ``loss.backward()`` and any torch optimizer over ``trainable_parameters()``.

    Attributes:
        model: the wrapped model as passed to :func:`prepare` (e.g. a ``PeftModel``).
        causal_lm: the HF ``*ForCausalLM`` inside it.
        descriptor: the family descriptor found in the registry.
        store: the :class:`~poros.stream.store.BlockStore` holding the frozen block tensors.
        executor: the :class:`~poros.stream.executor.StreamingExecutor`.
    """

    def __init__(self, model: nn.Module, causal_lm: nn.Module, descriptor: ArchitectureDescriptor,
                 store: BlockStore, executor: StreamingExecutor, restore_flags: list[tuple[nn.Module, bool]],
                 host_tables: list[HostEmbedding] = ()):
        super().__init__()
        self.model = model
        object.__setattr__(self, "causal_lm", causal_lm)
        object.__setattr__(self, "descriptor", descriptor)
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "executor", executor)
        object.__setattr__(self, "_restore_flags", restore_flags)
        object.__setattr__(self, "host_tables", list(host_tables))

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if self.store is None:
            raise UnsupportedModelError(
                "this PorosModel was unpatched; call the original model, or poros.prepare(model) again."
            )
        return self.executor(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def config(self):
        return self.causal_lm.config

    def unpatch(self) -> nn.Module:
        """Put every frozen tensor back in its module (on the compute device) and return the original model."""
        if self.store is not None:
            self.causal_lm.__dict__.pop("forward", None)  # undo patch_hf_model, if it was used
            self.store.restore()
            for layer, flag in self._restore_flags:
                layer.gradient_checkpointing = flag
            for table in self.host_tables:
                table.restore()
            object.__setattr__(self, "store", None)
        return self.model


def _causal_lm_of(model: nn.Module) -> nn.Module:
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _compute_device(module: nn.Module) -> torch.device:
    trainable = [p for p in module.parameters() if p.requires_grad]
    if trainable:
        return trainable[0].device
    return next(module.parameters()).device


def prepare(model: nn.Module, *, num_slots: int = 2, embeddings_on_host: bool | None = None) -> PorosModel:
    """Stream the frozen decoder blocks of an HF NF4 + PEFT LoRA causal LM; returns a :class:`PorosModel`.

    Args:
        model: an HF ``*ForCausalLM`` loaded with ``BitsAndBytesConfig(load_in_4bit=True, ...)`` and
            wrapped by PEFT (``get_peft_model``), or the bare causal LM.
        num_slots: device slots in the block ring (2: compute one block while the next arrives).
        embeddings_on_host: keep frozen embedding tables that are not tied to the head (the input
            embedding, Gemma 4's per-layer table) in host memory and look tokens up there; only the
            looked-up rows cross the link. Default: on when the compute device is CUDA.

    Raises:
        UnknownArchitectureError: the model's ``config.model_type`` is not a registered family; the
            message lists the registered ones.
        UnsupportedModelError: the model's class is not the family's causal-LM class.
    """
    causal_lm = _causal_lm_of(model)
    descriptor = registry.for_config(causal_lm.config)
    if type(causal_lm).__name__ not in descriptor.causal_lm_classes:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} is not a causal-LM class of family {descriptor.name!r} "
            f"(expected {', '.join(descriptor.causal_lm_classes)}). Load the text model with "
            "AutoModelForCausalLM / the family's *ForCausalLM class."
        )
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    restore_flags = [(layer, bool(getattr(layer, "gradient_checkpointing", False))) for layer in layers]
    for layer in layers:
        # The executor recomputes each block itself; HF's own checkpointing inside would do it twice.
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = False
    device = _compute_device(causal_lm)
    store = BlockStore(layers, device, num_slots=num_slots)
    if embeddings_on_host is None:
        embeddings_on_host = device.type == "cuda"
    host_tables = [HostEmbedding(table, device) for table in _host_tables(causal_lm, descriptor)] \
        if embeddings_on_host else []
    executor = StreamingExecutor(causal_lm, descriptor, store)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks' device copies are gone: give their segments back
    return PorosModel(model, causal_lm, descriptor, store, executor, restore_flags, host_tables)


def _host_tables(causal_lm: nn.Module, descriptor: ArchitectureDescriptor) -> list[nn.Module]:
    """Frozen embedding tables (input and prelude) that may live on the host: not tied to the head."""
    disabled = descriptor.disabled_names(causal_lm.config)
    paths = [descriptor.embeddings, *(p for p in descriptor.prelude_modules if p not in disabled)]
    head_weight = getattr(resolve_path(causal_lm, descriptor.head), "weight", None)
    head_storage = head_weight.data_ptr() if head_weight is not None else None
    tables = []
    for path in paths:
        module = resolve_path(causal_lm, path)
        if isinstance(module, nn.Embedding) and not module.weight.requires_grad \
                and module.weight.data_ptr() != head_storage:
            tables.append(module)
    return tables


def patch_hf_model(model: nn.Module, **options: Any) -> PorosModel:
    """Install streaming into ``model`` in place: the same object keeps working with ``model(...)``,
    HF ``Trainer`` and PEFT's ``save_pretrained``, its decoder blocks streamed.

    The causal LM inside ``model`` gets an instance ``forward`` that runs the streaming executor
    (which itself calls the class's own ``forward`` for the prelude and the head).

    Args:
        model: as for :func:`prepare`.
        **options: passed to :func:`prepare` (``num_slots``, ``embeddings_on_host``).

    Returns:
        The :class:`PorosModel` handle: its ``store`` and ``executor`` for inspection, and
        ``unpatch()`` to restore the model (weights back in their modules, ``forward`` restored).
    """
    handle = prepare(model, **options)
    handle.causal_lm.forward = handle.executor.forward
    return handle


def describe(model: PorosModel) -> dict[str, Any]:
    """A small JSON-able summary (family, blocks, bytes) for logs."""
    return {
        "family": model.descriptor.name,
        "blocks": len(model.store.blocks),
        "host_bytes": model.store.host_bytes,
        "slot_bytes": model.store.slot_bytes,
        "num_slots": model.store.num_slots,
    }

"""The offline memory plan of a run (``poros train --dry-run``, ``poros plan``): from a
:class:`~poros.config.PorosConfig` and the checkpoint's ``config.json`` alone -- no weight is read,
nothing is downloaded. :func:`locate_checkpoint_config` finds the config (a local directory, the
bundled model, the HF cache), :func:`plan_run` builds the text tower as a meta skeleton and counts
its bytes with :mod:`poros.stream.footprint`; the :class:`Plan` hands the budget model
(:mod:`poros.stream.planner`) its :class:`~poros.stream.planner.Footprint`. Multimodal checkpoints
(a config with ``text_config``) are planned for their text tower, the part Poros trains.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from poros.adapters import lora_targets
from poros.descriptor import resolve_path
from poros.devices import resolve_device
from poros.errors import CheckpointLoadError
from poros.stream.footprint import (
    BlockShapes,
    activation_bytes,
    block_bytes,
    meta_skeleton,
    quantized_linears,
    tensor_bytes,
)
from poros.stream.placement import embeddings_on_host, host_embedding_tables
from poros.stream.planner import (
    CUDA_WORKSPACE_BYTES,
    LORA_BYTES_PER_PARAMETER,
    LORA_VALUE_BYTES,
    Footprint,
    Workload,
    peak_upper_bound,
)

def locate_checkpoint_config(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """The directory holding ``model``'s ``config.json``, without downloading anything.

    A local directory and a model bundled with poros resolve as :func:`poros.loading.load.resolve_checkpoint`
    resolves them; a hub id only through the HF cache (its ``config.json`` is enough: the plan
    needs no weights).

    Returns:
        ``(directory, where)``; ``where`` says how it was found, for the plan's header.

    Raises:
        CheckpointLoadError: no such directory, or a hub id whose ``config.json`` is not cached.
    """
    from poros.assets import is_asset
    from poros.loading.load import resolve_checkpoint

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
    """``(config, text_config)`` of a checkpoint directory (:func:`poros.loading.load.read_config`), or of a
    known hub id that is no directory: the shape its registry record holds (:func:`poros.records.config_json`)."""
    from poros import records
    from poros.loading.load import read_config

    known = None if pathlib.Path(directory).is_dir() else records.find_checkpoint(str(directory))
    if known is None:
        return read_config(directory)
    import transformers

    fields = records.config_json(known[1])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return config, config.get_text_config()


def config_source(model: str, *, revision: str | None = None) -> tuple[pathlib.Path, str]:
    """:func:`locate_checkpoint_config`, else, for a hub id the registry knows, ``(model, where)``: the plan
    is then made from the shape its record holds, offline, and ``where`` says so.

    Raises:
        CheckpointLoadError: as :func:`locate_checkpoint_config`, for a model the registry does not know.
    """
    from poros import records

    try:
        return locate_checkpoint_config(model, revision=revision)
    except CheckpointLoadError:
        known = records.find_checkpoint(model)
        if known is None:
            raise
        return pathlib.Path(model), (f"not in the HF cache; planned offline from its record in registry/{known[0]}"
                                     f".toml (the shape of {known[1].get('config', model)})")


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
    def workload(self) -> Workload:
        return Workload(self.batch_size, self.seq_len, self.grad_accum, self.stream_schedule)

    @property
    def peak_device_bytes_estimate(self) -> int:
        """An upper bound: every part of the peak model at once (:func:`~poros.stream.planner.peak_upper_bound`),
        though the head's and a block's working sets never coincide."""
        return peak_upper_bound(self.footprint(), self.workload, num_slots=self.num_slots,
                                embeddings_on_host=self.host_embedding_bytes > 0)

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

    directory, found_in = config_source(config.model, revision=config.revision)  # a known model: offline
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
    non_block = sum(tensor_bytes(t, quantized_weights, config.double_quant) for t in outside.values())

    device = str(resolve_device(config.device))
    on_host = embeddings_on_host(config.embeddings_on_host, device)
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


__all__ = ["Plan", "config_source", "load_text_config", "locate_checkpoint_config", "plan_run"]

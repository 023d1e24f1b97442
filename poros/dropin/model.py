"""``poros.prepare``: stream an HF NF4 + PEFT LoRA causal LM in place; it stays the same object
(its class gains :class:`PorosModel`), so trainers that inspect it see the model they know.

``prepare`` first *detects* (family and provider, quantization, adapters, platform) and *gates*:
every check that can refuse the model runs before any weight moves, and raises a typed
:class:`~poros.errors.PorosError` naming what was found and the fix. Then it decides the
**guarantee label** that applies (``bitwise`` / ``numerical`` / ``unverified``, see
``docs/parity-modes.md``) from the validation records in ``registry/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Iterable

import torch
from torch import nn

from poros.adapters import causal_lm_of
from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.devices import compute_device, same_device
from poros.distributed import DDP_IGNORE_ATTRIBUTE, host_parameter_names, world
from poros.errors import AlreadyPreparedError, ConfigError, DeviceError
from poros.dropin import banner, parameter_counts
from poros.dropin.kernels import kernel_report
from poros.plan.entry import cuda_graphs_on, graphs_decided
from poros.stream import graphs
from poros.stream.compute_stream import step_stream
from poros.stream.chunked_loss import use_chunked_loss
from poros.stream.tiling import tile_mlp
from poros.stream.executor import StreamingExecutor
from poros.stream.lora_placement import LoraPlacement
from poros.stream.optimizer_states import resolve as resolve_optimizer_states
from poros.stream.options import StreamOptions, Workload, keyword_parameters
from poros.stream.placement import embeddings_on_host as choose_embeddings_on_host, host_embedding_tables
from poros.stream.segments import resolve_every
from poros.stream.store import BlockStore, HostEmbedding
from poros.dropin.detection import (  # re-exported: this module's names before the split
    COMPILE_WORKAROUND,
    SUPPORTED_ADAPTERS,
    Detection,
    check_not_compiled,
    detect,
    guarantee_label,
    platform_of,
    runtime_gates,
    with_kernels,
)

logger = logging.getLogger("poros")


class PorosModel:
    """What a prepared model gains: :func:`prepare` returns **the model it was given**, streamed in
    place, its class switched to a subclass of its own class with this mixin (same class name).

    So every library that inspects models sees exactly the model it knows: ``isinstance(model,
    PeftModel)``, ``get_base_model()``, ``loss_type``, the forward's signature, ``state_dict``
    keys, ``save_pretrained``, ``generate`` -- HF ``Trainer``, TRL, accelerate and PEFT treat it
    as the unprepared model, bit for bit (``docs/prepare.md``: why not a wrapper). Call it as
    before (``model(input_ids=..., labels=...)``) and train it with ``loss.backward()`` and any
    torch optimizer.

    Attributes:
        causal_lm: the HF ``*ForCausalLM`` inside (the model itself when it is not PEFT-wrapped).
        descriptor: the family descriptor found in the registry.
        store: the :class:`~poros.stream.store.BlockStore` holding the frozen block tensors.
        executor: the :class:`~poros.stream.executor.StreamingExecutor`.
        host_tables: the embedding tables kept on the host (``embeddings_on_host``).
        detection: what :func:`prepare` found (:class:`Detection`), with the guarantee label.
        budget_plan: the planner's ``BudgetPlan`` when :func:`prepare` got a ``vram_budget``, else None.
        kernel_report: what Liger patched on the model (:class:`~poros.dropin.kernels.KernelReport`) when
            ``kernels="liger"`` or Liger's kernels were found on it, else None.
        host_plan: the host tier decision (``poros.plan.host_tiers.HostPlan``: tier, read-ahead, why).
        lora_placement: the :class:`~poros.stream.lora_placement.LoraPlacement` keeping the streamed
            blocks' adapters on the host (``lora_placement="host"``), else None.
        stream_options: the :class:`~poros.stream.options.StreamOptions` the run applies (the executor's
            ``options``): as given, with the choices left open filled in -- ``embeddings_on_host``,
            ``boundary_states``, ``optimizer_states``, ``lora_placement``, ``host_tier`` (and the disk
            tier's ``read_ahead``). The ring and the resident blocks are the store's.
    """

    _POROS_FIELDS = ("causal_lm", "descriptor", "store", "executor", "host_tables", "detection", "budget_plan",
                     "host_plan", "lora_placement", "stream_options", "_restore_flags", "_poros_class",
                     "_ddp_ignored", "_chunked_loss", "_tiled_mlp", "_streamed_counts", "_count_memo", "kernel_report")

    def forward_backward(self, micro_batches: list[dict], *, sync_gradients: bool | None = None,
                         train_step: Any = None) -> list[torch.Tensor]:
        """Gradient accumulation, layer-major: forward and backward of all ``micro_batches`` with each
        block fetched once per direction (instead of once per micro-batch per direction).

        Leaves in ``.grad`` exactly what ``for mb in micro_batches: model(**mb).loss.backward()``
        leaves -- bit for bit. Give each micro-batch ``labels`` and, for HF's accumulation
        semantics, ``num_items_in_batch`` (the loss terms of all micro-batches together).

        Under torch.distributed (world size > 1) the gradients are then averaged over the ranks
        exactly as DDP averages them at the synchronizing micro-batch
        (:func:`poros.distributed.all_reduce_gradients`); ``sync_gradients=False`` skips that, like
        DDP's ``no_sync()``, for a step made of several calls. Call it on this model, not through
        the DDP wrapper (DDP's forward is not involved).

        ``train_step(**micro_batch)``, when given, replaces the model call: one micro-batch's whole training
        step -- the model call inside a loss, its scaling and its backward (e.g. an HF ``Trainer``'s
        ``training_step``, :mod:`poros.dropin.trainer_window`) -- returning the loss. It runs twice per
        micro-batch: the first run stops at the trunk (HF builds the context), the second computes the head,
        the loss and its backward from the streamed hidden states.

        Returns:
            The micro-batches' losses, detached, in order.

        Raises:
            StreamingError: a dropout with p > 0 is active (see the executor).
        """
        with self.lora_placement.accumulation() if self.lora_placement else contextlib.nullcontext(), \
                step_stream(self.executor.store.device, self.executor.graphs is not None):  # graphs: off the legacy stream
            losses = self.executor.forward_backward(train_step or self.forward, micro_batches,
                                                    own_backward=train_step is not None)
        from poros import distributed

        if sync_gradients is not False and distributed.reducing():
            distributed.all_reduce_gradients(self.trainable_parameters())
        return losses

    def generate(self, input_ids: torch.Tensor | None = None, **generate_kwargs: Any) -> torch.Tensor:
        """HF ``generate`` with the blocks streamed and a KV cache on the device (see :mod:`poros.export.generate`)."""
        from poros.export.generate import generation_mode

        generate_kwargs.setdefault("use_cache", True)
        with generation_mode(self):
            return super().generate(input_ids=input_ids, **generate_kwargs)  # the model's own class's generate

    @property
    def device(self) -> torch.device:
        """The compute device. HF's ``model.device`` reads the first parameter, which with
        ``embeddings_on_host`` is the input embedding table kept on the host."""
        return self.store.device

    #: the mark :func:`poros.devices.compute_device` reads first (the trainer's inputs go there): with
    #: ``lora_placement="host"`` the first trainable parameter is on the host
    poros_compute_device = device

    def to(self, *args: Any, **kwargs: Any):
        """Placement is the streaming's: a move to the compute device is a no-op that returns the model.

        HF ``Trainer`` and accelerate call ``model.to(args.device)`` on a model whose ``hf_device_map``
        they do not find (one loaded without a ``device_map``, or through :func:`poros.from_pretrained`).
        ``nn.Module.to`` would bring back to the card what streaming keeps on the host on purpose: the
        embedding table held there (its lookups then fail: the ids go to the host, the table is not
        there), host-placed adapters. Everything that computes is already on the compute device.

        Raises:
            DeviceError: another device or a dtype: the blocks live in the store, not in the modules;
                ``unpatch()`` first.
        """
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or (device is not None and not same_device(device, self.store.device)):
            raise DeviceError(
                f"model.to({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])}): a prepared "
                f"model computes on {self.store.device} and its frozen blocks live in the block store, so it moves "
                "neither to another device nor to another dtype. Call model.unpatch() first (or prepare it on the "
                "device you want).")
        return self

    def cuda(self, device: Any = None):
        """See :meth:`to`: a no-op on the compute device."""
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def cpu(self):
        """See :meth:`to`: a no-op when the model computes on the CPU."""
        return self.to("cpu")

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """HF's ``num_parameters``, the streamed blocks' frozen tensors counted (their modules hold empty
        placeholders while evicted): the HF ``Trainer`` reckons ``total_flos`` (saved in
        ``trainer_state.json``) from it, so the plain run's count (:mod:`poros.dropin.parameter_counts`)."""
        return parameter_counts.count(self, only_trainable, exclude_embeddings)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def guarantee(self) -> str | None:
        """``bitwise`` / ``numerical`` / ``unverified``: what this run promises (see docs/parity-modes.md)."""
        return self.detection.guarantee if self.detection else None

    def unpatch(self) -> nn.Module:
        """Every frozen tensor back in its module (on the compute device), the model's own class back; returns it."""
        self.executor.uninstall()
        if self.executor.graphs is not None:  # the graphs' pool and buffers first: the model's bytes need the room
            self.executor.graphs.release()
        self.causal_lm.__dict__.pop("_poros_handle", None)
        if self.lora_placement is not None:
            self.lora_placement.restore()
        if self._chunked_loss is not None:
            self._chunked_loss.remove()
        if self._tiled_mlp is not None:
            self._tiled_mlp.remove()
        self.store.restore()
        for layer, flag in self._restore_flags:
            layer.gradient_checkpointing = flag
        for table in self.host_tables:
            table.restore()
        if self._ddp_ignored is None:
            self.__dict__.pop(DDP_IGNORE_ATTRIBUTE, None)
        else:
            setattr(self, DDP_IGNORE_ATTRIBUTE, self._ddp_ignored)
        original = self._poros_class
        for name in self._POROS_FIELDS:
            self.__dict__.pop(name, None)
        self.__class__ = original
        return self


_STREAMED_CLASSES: dict[type, type] = {}


def _streamed_class(cls: type) -> type:
    """``cls`` with :class:`PorosModel` mixed in, made once per class; same name, module and qualname,
    so ``_get_name()``, ``architectures`` in a saved config and pickling see the original class."""
    if issubclass(cls, PorosModel):
        return cls
    if cls not in _STREAMED_CLASSES:
        _STREAMED_CLASSES[cls] = type(cls.__name__, (PorosModel, cls),
                                      {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _STREAMED_CLASSES[cls]


def _become_streamed(model: nn.Module, fields: dict[str, Any]) -> PorosModel:
    """Switch ``model`` (in place) to its streamed class and attach the Poros fields (plain attributes:
    none of them is registered as a submodule, so ``state_dict``/``parameters`` do not change)."""
    fields = {**fields, "_poros_class": type(model), "_count_memo": None}
    for name, value in fields.items():
        object.__setattr__(model, name, value)
    model.__class__ = _streamed_class(type(model))
    return model


def prepare(model: nn.Module, *, options: StreamOptions | None = None, **keywords: Any) -> PorosModel:
    """Stream the frozen decoder blocks of an HF NF4 + PEFT LoRA causal LM, in place; returns ``model``
    itself, its class switched to a same-named subclass with the :class:`PorosModel` mixin.

    Detects the family, quantization, adapters and platform, runs every gate, decides the guarantee
    label (logged as one block on the ``poros`` logger and kept as ``PorosModel.detection``), and
    only then moves the frozen block tensors into the host store.

    Args:
        model: an HF ``*ForCausalLM`` loaded with ``BitsAndBytesConfig(load_in_4bit=True, ...)`` and
            wrapped by PEFT (``get_peft_model``), or the bare causal LM.
        options: the run's :class:`~poros.stream.options.StreamOptions` (``poros.StreamOptions``), made
            e.g. from a config with ``StreamOptions.from_config(config)``; None: the defaults.
        **keywords: the options by name, each documented on ``StreamOptions`` (``num_slots``,
            ``embeddings_on_host``, ``require``, ``resident_blocks``, ``vram_budget``, ``workload``,
            ``boundary_states``, ``optimizer_states``, ``host_tier``, ``host_budget``, ``read_ahead``,
            ``cache_dir``, ``cuda_graphs``, ``lora_placement``, ``loss_chunks``, ``mlp_chunks``, ``kernels``);
            beside ``options`` they override its values. What prepare and the planner decide for the choices left open is
            ``PorosModel.stream_options``, the object the executor is built with.

    Raises:
        UnknownArchitectureError: the model's ``config.model_type`` is not a registered family; the
            message lists the registered ones.
        UnsupportedModelError: the model's class is not the family's causal-LM class.
        AlreadyPreparedError, TorchCompileError, OffloadedModelError, QuantizationError, UnsupportedAdapterError,
        BaseNotFrozenError, TrainableInBlockError, CheckpointingError, GuaranteeError: the gates
            (``docs/prepare.md`` lists each with its message).
        MissingDependencyError: ``kernels="liger"`` without liger-kernel (and Triton) installed.
        ConfigError: an unknown option (named, with the closest one) or an invalid value (see
            ``StreamOptions``); Liger's experts kernel over NF4-packed experts; ``resident_blocks`` naming no
            block of this model; ``vram_budget`` without
            ``workload`` or below the minimum the run needs (the message says how much it needs).
    """
    from poros.loading.experts import adopt_expert_lora
    options = _options_of(options, keywords)
    check_not_compiled(model)
    causal_lm = causal_lm_of(model)
    adopt_expert_lora(model, drop_placeholders=True)  # LoRA on NF4 experts; no placeholder streams
    if getattr(causal_lm, "_poros_handle", None) is not None:
        raise AlreadyPreparedError(
            f"this {type(causal_lm).__name__} is already streamed by Poros; keep using it, or call "
            "its unpatch() before preparing again."
        )
    descriptor, layers, detection = detect(model, causal_lm, options.require)
    kernels = kernel_report(model, causal_lm, options.kernels)  # kernels="liger": applied here, past the gates
    if kernels is not None:  # Liger's kernels earn what the records gated with them
        detection = (with_kernels(detection, kernels.summary(), options.require) if kernels.applied
                     else dataclasses.replace(detection, kernels=kernels.summary()))
        logger.info("poros: kernels %s; guarantee %s: %s", kernels.summary(), detection.guarantee, detection.reason)
    fused = bool(kernels is not None and kernels.fused_loss)  # Liger's head: the planner prices what runs
    if options.workload is not None and Workload.of(options.workload).fused_loss != fused:
        options = options.replace(workload=dataclasses.replace(Workload.of(options.workload), fused_loss=fused))
    device = compute_device(causal_lm)  # poros.from_pretrained's mark
    # cuda_graphs="auto" decided once: on CUDA, unless a budget plan has no room for the graphs' memory
    options, budget_plan, resident, num_slots, graphs_on = _plan(causal_lm, descriptor, layers, device, detection,
                                                                 options)
    return _stream(model, causal_lm, descriptor, layers, device, {"detection": detection, "budget_plan": budget_plan,
                                                                   "kernel_report": kernels},
                   options, resident, num_slots, graphs_on)


prepare.__signature__ = inspect.Signature(  # the options by name, as prepare always took them
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="nn.Module"),
     inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="StreamOptions | None"),
     *keyword_parameters()], return_annotation="PorosModel")


def _options_of(options: Any, keywords: dict[str, Any]) -> StreamOptions:
    """``options`` with ``keywords`` applied: the one object the rest of prepare reads."""
    if options is not None and not isinstance(options, StreamOptions):
        raise ConfigError(f"prepare(options={options!r}): expected a poros.StreamOptions (or None), e.g. "
                          "options=StreamOptions(num_slots=2); or pass the options by name.")
    return StreamOptions.from_keywords("prepare", **{**(options.to_dict() if options else {}), **keywords})


def _plan(causal_lm: nn.Module, descriptor: ArchitectureDescriptor, layers: list[nn.Module], device: torch.device,
          detection: Detection, options: StreamOptions):
    """``(options, budget plan, resident block indices, slots, CUDA graphs on)``: what is decided before anything
    moves -- the embedding tables' place, whether graphs run (``cuda_graphs_on``; with a budget
    ``graphs_decided``: ``"auto"`` is off where their memory does not fit), and with a ``vram_budget`` the
    planner's slots, resident blocks, boundary states, AdamW state and LoRA placement (an explicit
    ``boundary_states`` stands). The options come back with those choices filled in."""
    on_host = choose_embeddings_on_host(options.embeddings_on_host, device)
    budget_plan = None
    if options.vram_budget is not None:  # the planner decides slots and resident blocks (nothing moves yet)
        from poros.plan.footprint import plan_for_model

        data_parallel = world().size > 1  # never chosen there (see the refusal below)
        asked = options.replace(embeddings_on_host=on_host,
                                lora_placement="device" if options.lora_placement == "auto" and data_parallel
                                else options.lora_placement)
        tables = host_embedding_tables(causal_lm, descriptor)
        budget_plan, graphs_on = graphs_decided(options.cuda_graphs, device, lambda graphs: plan_for_model(
            causal_lm, layers, tables, asked, device=device,
            compute_dtype=getattr(torch, detection.compute_dtype, torch.float32), cuda_graphs=graphs))
        logger.info(budget_plan.summary())
        resident, num_slots = budget_plan.resident_blocks, max(budget_plan.num_slots, 1)
        on_host, lora = budget_plan.embeddings_on_host, budget_plan.lora_placement
    else:
        graphs_on = cuda_graphs_on(options.cuda_graphs, device)
        resident, num_slots = options.resident_indices(len(layers)), options.num_slots
        lora = "host" if options.lora_placement == "host" else "device"  # "auto" without a budget: the device
    if lora == "host" and world().size > 1:
        raise ConfigError(f"lora_placement='host' with {world().size} data-parallel ranks: the gradients are "
                          "averaged over the ranks on the device, and host-kept LoRA gradients are not supported "
                          "there yet. Use lora_placement='device' (or 'auto') for data parallel runs.")
    planned_states = budget_plan.optimizer_states if budget_plan else None
    decided = options.replace(
        embeddings_on_host=on_host, lora_placement=lora,
        boundary_states=options.boundary_states or (budget_plan.boundary_states if budget_plan else "device"),
        boundary_every=resolve_every(options.boundary_every, budget_plan.boundary_every if budget_plan else None),
        optimizer_states=resolve_optimizer_states(options.optimizer_states, planned_states),
        # the chunk counts the budget needs (never fewer than asked: plan_budget only raises them)
        loss_chunks=budget_plan.loss_chunks if budget_plan else options.loss_chunks,
        mlp_chunks=budget_plan.mlp_chunks if budget_plan else options.mlp_chunks)
    return decided, budget_plan, resident, num_slots, graphs_on


def _stream(model: nn.Module, causal_lm: nn.Module, descriptor: ArchitectureDescriptor, layers: list[nn.Module],
            device: torch.device, found: dict[str, Any], options: StreamOptions, resident: tuple[int, ...],
            num_slots: int, graphs_on: bool) -> PorosModel:
    """Past the gates: the blocks move into the store, the executor is built whole and installed, and
    ``model`` becomes its streamed class. ``found``: the detection and the budget plan."""
    fused = getattr(found.get("kernel_report"), "fused_loss", False)  # Liger's head replaces loss_chunks
    if fused and options.loss_chunks > 1:
        logger.info("poros: loss_chunks=%d is not installed: Liger's fused linear cross-entropy computes the head "
                    "and loss, one chunk of logits at a time", options.loss_chunks)
        options = options.replace(loss_chunks=1)
    chunked_loss = use_chunked_loss(causal_lm, options.loss_chunks) if options.loss_chunks > 1 else None
    tiled_mlp = tile_mlp(causal_lm, options.mlp_chunks) if options.mlp_chunks > 1 else None
    if device.type != "cpu":
        from poros.loading.load import adapters_to_device

        adapters_to_device(model, device)  # a no-op unless PEFT put adapters beside host-kept base layers
    restore_flags = [(layer, bool(getattr(layer, "gradient_checkpointing", False))) for layer in layers]
    for layer in layers:
        # The executor recomputes each block itself; HF's own checkpointing inside would do it twice.
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = False
    counts = parameter_counts.parameter_counts(causal_lm)
    host_plan, tier = _host_tier(causal_lm, layers, resident, options)
    options = options.replace(host_tier=host_plan.tier, read_ahead=host_plan.read_ahead or options.read_ahead)
    blocks_on_device = any(p.device.type == "cuda" and not p.requires_grad for layer in layers
                           for p in layer.parameters())
    store = BlockStore(layers, device, num_slots=num_slots, resident=resident, host_tier=tier)
    host_tables = [HostEmbedding(table, device) for table in host_embedding_tables(causal_lm, descriptor)] \
        if options.embeddings_on_host else []
    _share_host_tables(causal_lm, host_tables)
    ddp_ignored = getattr(model, DDP_IGNORE_ATTRIBUTE, None)  # restored by unpatch
    if host_tables:  # frozen tables on the host: out of DDP's sight (see host_parameter_names)
        setattr(model, DDP_IGNORE_ATTRIBUTE, sorted({*(ddp_ignored or ()),
                                                     *host_parameter_names(model, [t.module for t in host_tables])}))
    placement = LoraPlacement(store) if options.lora_placement == "host" else None
    block_graphs = None
    if graphs_on:
        block_graphs = graphs.BlockGraphs(
            store, resolve_path(causal_lm, descriptor.decoder_layers),
            unsafe=descriptor.graph_unsafe_reason(causal_lm.config.get_text_config()))
    elif options.cuda_graphs is not False:
        logger.info("cuda_graphs: off on %s (CUDA graphs exist on CUDA devices only); every block runs eagerly",
                    device)
    from poros.loading import cache
    from poros.plan.footprint import activation_estimate

    executor = StreamingExecutor(causal_lm, descriptor, store, options, graphs=block_graphs,
                                 before_forward=runtime_gates(causal_lm, layers, placement, tiled_mlp),
                                 spill_dir=cache.cache_root(options.cache_dir) / "spill",
                                 kept_blocks=getattr(found.get("budget_plan"), "kept_activation_blocks", None),
                                 kept_estimate=activation_estimate(causal_lm, layers),
                                 dequantize_once=getattr(found.get("budget_plan"), "dequantize_once", None))
    executor.install()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks' device copies are gone: give their segments back
        if blocks_on_device:  # loaded onto the card: the rest shares the load's one big segment with them
            from poros.loading.host_blocks import release_stranded_segments

            logger.info("poros: device segments after moving the blocks off: %s",
                        release_stranded_segments(model, layers, device))
    prepared = _become_streamed(model, {
        **found, "causal_lm": causal_lm, "descriptor": descriptor, "store": store, "executor": executor,
        "host_tables": host_tables, "host_plan": host_plan, "lora_placement": placement, "stream_options": options,
        "_restore_flags": restore_flags, "_ddp_ignored": ddp_ignored, "_chunked_loss": chunked_loss,
        "_tiled_mlp": tiled_mlp,
        "_streamed_counts": tuple(a - b for a, b in zip(counts, parameter_counts.parameter_counts(causal_lm)))})
    object.__setattr__(causal_lm, "_poros_handle", prepared)
    banner.announce(prepared)  # one stderr line: Poros took effect
    return prepared


def _share_host_tables(causal_lm: nn.Module, host_tables: list[HostEmbedding]) -> None:
    """With several ranks on the node and the model loaded through the NF4 block cache, each host-kept
    embedding table becomes a copy-on-write mapping of one file beside the cache entry, so the node holds
    it once, as it holds the blocks once (``poros.stream.block_file.share_host_table``; the values are the
    same bytes, checked). One process, or no cache: each table stays this process's own copy."""
    from poros.stream.block_file import share_host_table

    block_file = getattr(causal_lm, "poros_block_file", None)
    if not host_tables or block_file is None or world().local_size < 2:
        return
    names = {id(module): name for name, module in causal_lm.named_modules()}
    for table in host_tables:
        for name, parameter in table.module.named_parameters(recurse=False):
            label = f"{names.get(id(table.module), 'table')}.{name}"
            shared = share_host_table(parameter.data, block_file.path.parent / f"host-table-{label}.bin")
            if shared is not None:
                parameter.data = shared


def _host_tier(causal_lm: nn.Module, layers: list[nn.Module], resident: Iterable[int], options: StreamOptions):
    """The host plan and the store.s host tier object, for ``options.host_tier``,
    ``host_budget``, ``read_ahead`` and ``cache_dir``."""
    from poros.loading import cache
    from poros.plan.host_tiers import DEFAULT_READ_AHEAD, plan_host_tier
    from poros.stream.store import packed_block_bytes
    from poros.stream.tiers import make_host_tier

    # the block cache entry the blocks view, or a pre-quantized checkpoint's shards: the node's ranks share either
    block_file, shards = getattr(causal_lm, "poros_block_file", None), getattr(causal_lm, "poros_checkpoint_shards", None)
    plan = plan_host_tier(packed_block_bytes(layers), resident, host_tier=options.host_tier,
                          host_budget=options.host_budget_bytes, read_ahead=options.read_ahead,
                          ranks_per_node=world().local_size, shared_file=block_file is not None or shards is not None,
                          prequantized=block_file is None and shards is not None)
    if plan.notable:
        logger.info("poros: %s", plan.reason)
    tier = make_host_tier(plan.tier, block_file or shards, read_ahead=plan.read_ahead or DEFAULT_READ_AHEAD,
                          spill_dir=cache.cache_root(options.cache_dir) / "spill", chosen=options.host_tier is None,
                          held=plan.held_blocks)
    return plan, tier


def patch_hf_model(model: nn.Module, **options: Any) -> PorosModel:
    """Stream ``model`` in place and keep using the same object: ``model(...)``, HF ``Trainer``, TRL
    ``SFTTrainer`` and PEFT's ``save_pretrained`` work as before, its decoder blocks streamed.

    The same as :func:`prepare` (which also returns the object it was given): the spelling for
    scripts that keep their own model variable.

    Args:
        model: as for :func:`prepare`.
        **options: passed to :func:`prepare` (``num_slots``, ``embeddings_on_host``, ``require``,
            ``resident_blocks``, ``vram_budget``, ``workload``, ``boundary_states``).

    Returns:
        ``model`` itself, now also a :class:`PorosModel`: ``detection``/``guarantee``, ``store`` and
        ``executor`` for inspection, ``forward_backward``, and ``unpatch()`` to restore it.
    """
    return prepare(model, **options)


__all__ = ["COMPILE_WORKAROUND", "Detection", "PorosModel", "SUPPORTED_ADAPTERS", "guarantee_label",
           "patch_hf_model", "platform_of", "prepare"]

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
import logging
import platform as _platform
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
from torch import nn

from poros import records, registry
from poros.adapters import causal_lm_of
from poros.descriptor import ArchitectureDescriptor, resolve_path
from poros.devices import compute_device
from poros.distributed import DDP_IGNORE_ATTRIBUTE, host_parameter_names, world
from poros.errors import (
    AlreadyPreparedError,
    BaseNotFrozenError,
    CacheDuringTrainingError,
    CheckpointingError,
    ConfigError,
    GuaranteeError,
    OffloadedModelError,
    QuantizationError,
    TorchCompileError,
    TrainableInBlockError,
    UnsupportedAdapterError,
    UnsupportedModelError,
)
from poros.dropin import banner
from poros.stream import graphs
from poros.stream.executor import StreamingExecutor
from poros.stream.lora_placement import LoraPlacement
from poros.stream.optimizer_states import check_lora as lora_placement_check
from poros.stream.placement import check_boundary_states, host_embedding_tables
from poros.stream.placement import embeddings_on_host as choose_embeddings_on_host
from poros.stream.store import BlockStore, HostEmbedding

if TYPE_CHECKING:
    from poros.stream.planner import Workload

logger = logging.getLogger("poros")

#: PEFT adapter types Poros streams (``docs/adapters.md`` has the measured matrix).
SUPPORTED_ADAPTERS = ("LORA",)
LABEL_STRENGTH = {"unverified": 0, "numerical": 1, "bitwise": 2}



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
        host_plan: the host tier decision (``poros.loading.host_tiers.HostPlan``: tier, read-ahead, why).
        lora_placement: the :class:`~poros.stream.lora_placement.LoraPlacement` keeping the streamed
            blocks' adapters on the host (``lora_placement="host"``), else None.
    """

    _POROS_FIELDS = ("causal_lm", "descriptor", "store", "executor", "host_tables", "detection", "budget_plan",
                     "host_plan", "lora_placement", "_restore_flags", "_poros_class",
                     "_ddp_ignored")

    def forward_backward(self, micro_batches: list[dict], *, sync_gradients: bool | None = None) -> list[torch.Tensor]:
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

        Returns:
            The micro-batches' losses, detached, in order.

        Raises:
            StreamingError: a dropout with p > 0 is active (see the executor).
        """
        with self.lora_placement.accumulation() if self.lora_placement else contextlib.nullcontext():
            losses = self.executor.forward_backward(self.forward, micro_batches)
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

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def guarantee(self) -> str | None:
        """``bitwise`` / ``numerical`` / ``unverified``: what this run promises (see docs/parity-modes.md)."""
        return self.detection.guarantee if self.detection else None

    def unpatch(self) -> nn.Module:
        """Put every frozen tensor back in its module (on the compute device), give the model its own
        class back, and return it (the same object)."""
        self.executor.uninstall()
        self.causal_lm.__dict__.pop("_poros_handle", None)
        if self.lora_placement is not None:
            self.lora_placement.restore()
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
    fields = {**fields, "_poros_class": type(model)}
    for name, value in fields.items():
        object.__setattr__(model, name, value)
    model.__class__ = _streamed_class(type(model))
    return model


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Detection:
    """What :func:`prepare` found, and the guarantee label that applies."""

    family: str
    provider: str
    quantization: str  # "nf4" | "fp4" | "none"
    double_quant: bool
    compute_dtype: str
    adapters: tuple[str, ...]  # "lora" | "rslora" | "dora", one per adapter type present
    targets: tuple[str, ...]
    platform: str
    platform_class: str
    deterministic: bool
    guarantee: str
    reason: str

    def summary(self) -> str:
        return "\n".join([
            f"poros: family {self.family} ({self.provider})",
            f"poros: base {self.quantization}{' + double quant' if self.double_quant else ''}, "
            f"compute {self.compute_dtype}; adapters {', '.join(self.adapters) or 'none'} on "
            f"{', '.join(self.targets) or '-'}",
            f"poros: platform {self.platform} ({self.platform_class}), "
            f"{banner.determinism(self.platform_class, self.deterministic)}",
            f"poros: guarantee {self.guarantee}: {self.reason}",
        ])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def platform_of(device: torch.device) -> tuple[str, str]:
    """``(platform, platform_class)`` as validation records name them."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"cuda-sm{major}{minor}"
    machine = _platform.machine() or "unknown"
    return f"cpu-{machine}", f"cpu-{machine}"


def _quantization(causal_lm: nn.Module) -> tuple[str, bool, str]:
    import bitsandbytes as bnb

    four_bit = [m for m in causal_lm.modules() if isinstance(m, bnb.nn.Linear4bit)]
    eight_bit = [name for name, m in causal_lm.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    if eight_bit:
        raise QuantizationError(
            f"the base is quantized to 8 bits with bitsandbytes ({len(eight_bit)} Linear8bitLt modules, e.g. "
            f"{eight_bit[0]}); Poros streams 4-bit (NF4/FP4) or unquantized bases. Load it with "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4') instead."
        )
    if not four_bit:
        dtype = next(causal_lm.parameters()).dtype
        return "none", False, str(dtype).removeprefix("torch.")
    state = four_bit[0].weight.quant_state
    compute = four_bit[0].compute_dtype or next(causal_lm.parameters()).dtype
    return state.quant_type if state else "nf4", bool(state and state.nested), str(compute).removeprefix("torch.")


def _adapters(model: nn.Module, causal_lm: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    configs = getattr(model, "peft_config", None) or getattr(causal_lm, "peft_config", None) or {}
    kinds, targets = [], []
    for name, config in configs.items():
        peft_type = str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1].upper()
        if peft_type not in SUPPORTED_ADAPTERS:
            raise UnsupportedAdapterError(
                f"adapter {name!r} is PEFT {peft_type}; Poros streams {', '.join(SUPPORTED_ADAPTERS)} "
                "(with rsLoRA and DoRA) — see docs/adapters.md for the measured matrix. Use a LoraConfig."
            )
        kinds.append("dora" if getattr(config, "use_dora", False) else
                     "rslora" if getattr(config, "use_rslora", False) else "lora")
        found = getattr(config, "target_modules", None) or ()
        targets.extend([found] if isinstance(found, str) else sorted(found))
    return tuple(dict.fromkeys(kinds)), tuple(dict.fromkeys(targets))


def guarantee_label(family: str, adapters: tuple[str, ...], quantization: str, platform_class: str,
                    deterministic: bool) -> tuple[str, str]:
    """The label a run earns from the validation records, and why (see docs/parity-modes.md)."""
    records_here = [r for r in records.validations(family) if r.get("platform_class") == platform_class]
    if not records_here:
        return "unverified", f"no validation record for {family} on {platform_class}"
    gated = {r.get("adapter", "lora") for r in records_here if r.get("label") == "bitwise"}
    missing = [a for a in adapters if a not in gated]
    if missing:
        return "numerical", (f"same modules and math, but {', '.join(missing)} is not gated for {family} on "
                             f"{platform_class} (gated: {', '.join(sorted(gated)) or 'nothing'})")
    if quantization != "nf4":
        return "numerical", f"records gate NF4 bases; this base is {quantization}"
    if platform_class.startswith("cuda") and not deterministic:
        return "numerical", ("deterministic algorithms are off, so fast non-deterministic kernels may run; "
                             "torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 "
                             "gives the gated bitwise mode")
    dates = sorted({str(r.get("date")) for r in records_here if r.get("label") == "bitwise"})
    return "bitwise", f"gated 0.00e+00 for {family} on {platform_class} ({', '.join(dates)})"


# ---------------------------------------------------------------------------------------------
# Gates: every one runs before any weight moves
# ---------------------------------------------------------------------------------------------
_ADAPTER_MARKERS = (".lora_", "lora_magnitude_vector")


def _check_offload(model: nn.Module, causal_lm: nn.Module) -> None:
    device_map = getattr(causal_lm, "hf_device_map", None) or getattr(model, "hf_device_map", None) or {}
    places = {str(v) for v in device_map.values()}
    offloaded = places & {"cpu", "disk"}
    hooked = [name for name, m in causal_lm.named_modules()
              if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    if (offloaded and len(places) > 1) or hooked:
        where = hooked[0] if hooked else next(k for k, v in device_map.items() if str(v) in offloaded)
        raise OffloadedModelError(
            f"the model was dispatched by accelerate with offload (e.g. {where!r} -> "
            f"{device_map.get(where, 'offloaded')}); Poros does its own offloading and needs every module on one "
            "device. Load with device_map={'': 0} (or one device) and let poros.prepare move the blocks."
        )


#: what the refusal of torch.compile says to do (prepare, prepare_trainer and PorosCallback use it)
COMPILE_WORKAROUND = ("Poros streams the blocks through eager PyTorch: drop torch.compile (TrainingArguments("
                      "torch_compile=False), no torch.compile(model)) for the streamed run; docs/prepare.md says why.")


def _check_not_compiled(model: nn.Module) -> None:
    compiled = hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None
    if compiled:
        raise TorchCompileError(
            f"the model was compiled with torch.compile ({type(model).__name__}); compiled graphs capture each "
            "decoder block's tensors and strides, which streaming swaps between calls (inductor then fails with "
            f"assert_size_stride or wrong dimensions). {COMPILE_WORKAROUND}"
        )


def _check_frozen(model: nn.Module, layers: list[nn.Module]) -> None:
    in_blocks = {id(p) for layer in layers for p in layer.parameters()}
    for name, param in model.named_parameters():
        if not param.requires_grad or any(marker in name for marker in _ADAPTER_MARKERS):
            continue
        if id(param) in in_blocks:
            raise TrainableInBlockError(
                f"{name} requires grad but is not an adapter parameter; a decoder block may only train adapter "
                "parameters (its frozen tensors live on the host). Freeze it (param.requires_grad_(False)) or "
                "train it with a LoRA adapter instead."
            )
        if "modules_to_save" not in name:
            raise BaseNotFrozenError(
                f"base weight {name} requires grad; Poros trains frozen-base adapters only. Freeze the base "
                "(PEFT's get_peft_model does) or list the module in LoraConfig(modules_to_save=[...])."
            )


def _check_checkpointing(layers: list[nn.Module]) -> None:
    for index, layer in enumerate(layers):
        function = getattr(layer, "_gradient_checkpointing_func", None)
        keywords = getattr(function, "keywords", {}) or {}
        if getattr(layer, "gradient_checkpointing", False) and keywords.get("use_reentrant", False):
            raise CheckpointingError(
                f"decoder layer {index} has reentrant gradient checkpointing, which drops gradients that flow "
                "through keyword arguments (e.g. K/V shared across layers): the resident run would be wrong and "
                "differ from Poros. Poros recomputes each block itself: call model.gradient_checkpointing_disable(), "
                "or enable it with gradient_checkpointing_kwargs={'use_reentrant': False}."
            )


def _runtime_gates(causal_lm: nn.Module, layers: list[nn.Module], placement: LoraPlacement | None = None):
    """Checks run before every streamed forward (they see what HF passes the trunk)."""

    def check(kwargs: dict) -> None:
        if placement is not None:
            placement.check_forward()
        if kwargs.get("use_cache") and torch.is_grad_enabled() and causal_lm.training:
            raise CacheDuringTrainingError(
                "use_cache=True in a training forward: a KV cache only costs memory when training and Poros "
                "streams without one. Pass use_cache=False (or leave it out)."
            )
        # HF Trainer(gradient_checkpointing=True) enables HF checkpointing after prepare: refuse the
        # reentrant kind (it changes the math), switch the other off (Poros recomputes blocks itself).
        _check_checkpointing(layers)
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False):
                layer.gradient_checkpointing = False

    return check


def prepare(model: nn.Module, *, num_slots: int | None = None, embeddings_on_host: bool | None = None,
            require: str | None = None, resident_blocks: int | Iterable[int] | None = None,
            vram_budget: str | int | None = None,
            workload: Workload | Mapping[str, Any] | None = None, boundary_states: str | None = None,
            optimizer_states: str = "auto", host_tier: str | None = None, host_budget: str | int | None = None,
            read_ahead: int | None = None, cache_dir: str | None = None,
            cuda_graphs: bool | str = False,
            lora_placement: str | None = None) -> PorosModel:
    """Stream the frozen decoder blocks of an HF NF4 + PEFT LoRA causal LM, in place; returns ``model``
    itself, its class switched to a same-named subclass with the :class:`PorosModel` mixin.

    Detects the family, quantization, adapters and platform, runs every gate, decides the guarantee
    label (logged as one block on the ``poros`` logger and kept as ``PorosModel.detection``), and
    only then moves the frozen block tensors into the host store.

    Args:
        model: an HF ``*ForCausalLM`` loaded with ``BitsAndBytesConfig(load_in_4bit=True, ...)`` and
            wrapped by PEFT (``get_peft_model``), or the bare causal LM.
        num_slots: device slots in the block ring (default 2: compute one block while the next
            arrives). With ``vram_budget`` the ring asked for; the planner gives fewer only when the
            budget cannot hold them.
        embeddings_on_host: keep frozen embedding tables that are not tied to the head (the input
            embedding, Gemma 4's per-layer table) in host memory and look tokens up there; only the
            looked-up rows cross the link. Default: on when the compute device is CUDA. With several
            ranks on the node and a model loaded through the NF4 block cache, the ranks map one copy
            of each table (a file beside the cache entry) instead of each holding its own.
        require: ``"bitwise"`` or ``"numerical"``: raise :class:`~poros.errors.GuaranteeError` if the
            label that applies is weaker.
        resident_blocks: blocks kept on the device for good instead of streamed: an int N for the
            last N blocks (the last of forward are the first of backward), or block indices.
        vram_budget: device memory the run may use (``"7GiB"``, ``"24GB"``, an int of bytes): the
            planner (``poros.stream.planner.plan_budget``) picks the slots and the resident blocks
            for it and logs its decision; the plan is kept as ``PorosModel.budget_plan``. Needs
            ``workload``; excludes ``resident_blocks``.
        workload: the step the budget is planned for: a ``poros.stream.planner.Workload`` or a dict
            of its fields (``batch_size``, ``seq_len``, ``grad_accum``, ``schedule``).
        boundary_states: where layer-major accumulation (``forward_backward``) keeps the M x L block
            inputs until backward: ``"device"`` (default) or ``"host"`` (pinned host memory, copied on
            a side stream; bitwise the same). With ``vram_budget`` the planner decides (host only
            when the budget needs it) unless this is given.
        optimizer_states: with ``vram_budget``, where the plan puts AdamW's state: ``"device"``,
            ``"host"`` or ``"auto"`` (host only when the slot ring does not fit with it on the device). Prepare moves no
            optimizer: the plan's choice is ``PorosModel.budget_plan.optimizer_states``, which
            PorosTrainer applies (``poros.stream.host_optimizer.adamw``) and a loop of your own
            should too (``poros.HostAdamW`` when it says ``"host"``).
        lora_placement: where the streamed blocks' LoRA parameters and gradients live between uses:
            ``"device"`` (default) or ``"host"`` (pinned; they come in with their block and the gradients
            go back after its last backward; layer-major ``forward_backward`` and ``poros.HostAdamW``
            with ``placement=model.lora_placement`` only; bitwise the same). With ``vram_budget`` and
            ``"auto"`` the planner decides (host only when the budget needs it: the plan's
            ``lora_placement``); ``"auto"`` without a budget is ``"device"``.
        host_tier: where the streamed blocks live on the host: ``"pinned"``, ``"mapped"`` or ``"disk"``
            (``docs/cache-and-host-memory.md``). A model loaded through the NF4 block cache is served
            from its entry; any other model is first written to a spill file. Unset: ``"mapped"`` for a
            model loaded through the cache (no copy at the start; the node's ranks share the entry's
            pages; where the device will not register the mapping, pinned copies), else ``"pinned"``.
        host_budget: host RAM the blocks may use (``"24GiB"``, bytes): without ``host_tier``, the
            planner (``poros.loading.host_tiers.choose_host_tier``) keeps them on the host as above when they
            fit and streams them from disk otherwise; the decision is kept as ``PorosModel.host_plan``.
        read_ahead: ring buffers of the disk tier (default 3; with ``host_budget``, at most what fits).
        cache_dir: cache root whose ``spill/`` directory takes spill files (default: as for the cache).
        cuda_graphs: ``True`` / ``"auto"``: on CUDA, replay each block phase from a captured CUDA graph
            (``poros.stream.graphs``; bitwise the eager kernels, without their host cost); blocks
            that cannot be captured run eagerly and ``PorosModel.executor.graphs.report`` says why.
            Off on CPU whatever the setting. Default ``False``.

    Raises:
        UnknownArchitectureError: the model's ``config.model_type`` is not a registered family; the
            message lists the registered ones.
        UnsupportedModelError: the model's class is not the family's causal-LM class.
        AlreadyPreparedError, TorchCompileError, OffloadedModelError, QuantizationError, UnsupportedAdapterError,
        BaseNotFrozenError, TrainableInBlockError, CheckpointingError, GuaranteeError: the gates
            (``docs/prepare.md`` lists each with its message).
        ConfigError: ``resident_blocks`` names no block, or with ``vram_budget``; ``vram_budget``
            without ``workload``, unparsable, or below the minimum the run needs (the message says
            how much it needs); ``boundary_states`` not ``"device"`` or ``"host"``.
    """
    _check_budget_options(resident_blocks, vram_budget, workload)
    check_boundary_states(boundary_states)
    lora_placement_check(lora_placement)
    graphs.check(cuda_graphs)
    _check_not_compiled(model)
    causal_lm = causal_lm_of(model)
    if getattr(causal_lm, "_poros_handle", None) is not None:
        raise AlreadyPreparedError(
            f"this {type(causal_lm).__name__} is already streamed by Poros; keep using it, or call "
            "its unpatch() before preparing again."
        )
    descriptor = registry.for_config(causal_lm.config)
    registration = registry.registration(descriptor.name)
    if type(causal_lm).__name__ not in descriptor.causal_lm_classes:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} is not a causal-LM class of family {descriptor.name!r} "
            f"(expected {', '.join(descriptor.causal_lm_classes)}). Load the text model with "
            "AutoModelForCausalLM / the family's *ForCausalLM class."
        )
    layers = list(resolve_path(causal_lm, descriptor.decoder_layers))
    _check_offload(model, causal_lm)
    quantization, double_quant, compute_dtype = _quantization(causal_lm)
    adapters, targets = _adapters(model, causal_lm)
    _check_frozen(model, layers)
    _check_checkpointing(layers)
    device = compute_device(causal_lm)
    platform, platform_class = platform_of(device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    label, reason = guarantee_label(descriptor.name, adapters, quantization, platform_class, deterministic)
    detection = Detection(descriptor.name, f"{registration.plugin} ({registration.provider})", quantization,
                          double_quant, compute_dtype, adapters, targets, platform, platform_class,
                          deterministic, label, reason)
    if require is not None and LABEL_STRENGTH[label] < LABEL_STRENGTH[require]:
        raise GuaranteeError(
            f"prepare(require={require!r}) but this run is {label!r}: {reason}. Meet the condition, or "
            f"pass require={label!r} (or None) to accept it."
        )
    logger.info(detection.summary())
    embeddings_on_host = choose_embeddings_on_host(embeddings_on_host, device)
    budget_plan = None
    if vram_budget is not None:  # the planner decides slots and resident blocks (nothing moves yet)
        from poros.stream.footprint import plan_for_model

        budget_plan = plan_for_model(
            causal_lm, layers, host_embedding_tables(causal_lm, descriptor), budget=vram_budget,
            workload=_workload(workload), device=device,
            compute_dtype=getattr(torch, compute_dtype, torch.float32), num_slots=num_slots or 2,
            embeddings_on_host=embeddings_on_host, boundary_states=boundary_states,
            optimizer_states=optimizer_states,  # data parallel: never chosen (see the refusal below)
            lora_placement="device" if lora_placement == "auto" and world().size > 1 else lora_placement or "device",
            cuda_graphs=graphs.enabled(cuda_graphs, device))
        logger.info(budget_plan.summary())
        resident, num_slots = budget_plan.resident_blocks, max(budget_plan.num_slots, 1)
        embeddings_on_host = budget_plan.embeddings_on_host
        boundary_states = boundary_states or budget_plan.boundary_states  # an explicit choice stands
        lora_placement = budget_plan.lora_placement
    else:
        resident, num_slots = _resident_indices(resident_blocks, len(layers)), num_slots or 2

    if lora_placement == "host" and world().size > 1:
        raise ConfigError(f"lora_placement='host' with {world().size} data-parallel ranks: the gradients are "
                          "averaged over the ranks on the device, and host-kept LoRA gradients are not supported "
                          "there yet. Use lora_placement='device' (or 'auto') for data parallel runs.")
    # -- past the gates: now weights move --------------------------------------------------
    restore_flags = [(layer, bool(getattr(layer, "gradient_checkpointing", False))) for layer in layers]
    for layer in layers:
        # The executor recomputes each block itself; HF's own checkpointing inside would do it twice.
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = False
    host_plan, tier = _host_tier(causal_lm, layers, resident, host_tier, host_budget, read_ahead, cache_dir)
    store = BlockStore(layers, device, num_slots=num_slots, resident=resident, host_tier=tier)
    host_tables = [HostEmbedding(table, device) for table in host_embedding_tables(causal_lm, descriptor)] \
        if embeddings_on_host else []
    _share_host_tables(causal_lm, host_tables)
    ddp_ignored = getattr(model, DDP_IGNORE_ATTRIBUTE, None)  # restored by unpatch
    if host_tables:  # frozen tables on the host: out of DDP's sight (see host_parameter_names)
        setattr(model, DDP_IGNORE_ATTRIBUTE, sorted({*(ddp_ignored or ()),
                                                     *host_parameter_names(model, [t.module for t in host_tables])}))
    executor = StreamingExecutor(causal_lm, descriptor, store)
    executor.boundary_states = boundary_states or "device"
    placement = LoraPlacement(store) if lora_placement == "host" else None  # None / "auto" without a budget: device
    executor.before_forward = _runtime_gates(causal_lm, layers, placement)
    if graphs.enabled(cuda_graphs, device):
        executor.graphs = graphs.BlockGraphs(
            store, executor.layers, unsafe=descriptor.graph_unsafe_reason(causal_lm.config.get_text_config()))
    elif cuda_graphs is not False:
        logger.info("cuda_graphs: off on %s (CUDA graphs exist on CUDA devices only); every block runs eagerly",
                    device)
    executor.install()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the blocks' device copies are gone: give their segments back
    prepared = _become_streamed(model, {
        "causal_lm": causal_lm, "descriptor": descriptor, "store": store, "executor": executor,
        "host_tables": host_tables, "detection": detection, "budget_plan": budget_plan, "host_plan": host_plan,
        "lora_placement": placement,
        "_restore_flags": restore_flags, "_ddp_ignored": ddp_ignored})
    object.__setattr__(causal_lm, "_poros_handle", prepared)
    banner.announce(prepared)  # one stderr line: Poros took effect
    return prepared


def _share_host_tables(causal_lm: nn.Module, host_tables: list[HostEmbedding]) -> None:
    """With several ranks on the node and the model loaded through the NF4 block cache, each host-kept
    embedding table becomes a copy-on-write mapping of one file beside the cache entry, so the node holds
    it once, as it holds the blocks once (``poros.stream.tiers.share_host_table``; the values are the
    same bytes, checked). One process, or no cache: each table stays this process's own copy."""
    from poros.stream.tiers import share_host_table

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


def _host_tier(causal_lm: nn.Module, layers: list[nn.Module], resident: Iterable[int], host_tier: str | None,
               host_budget: str | int | None, read_ahead: int | None, cache_dir: str | None):
    """The host plan and the store's host tier object (None: pinned)."""
    from poros.loading import cache
    from poros.config import parse_budget
    from poros.loading.host_tiers import DEFAULT_READ_AHEAD, choose_host_tier
    from poros.stream.store import packed_block_bytes
    from poros.stream.tiers import make_host_tier

    resident = set(resident)
    budget = parse_budget(host_budget, "host_budget") if host_budget is not None else None
    streamed = [n for i, n in enumerate(packed_block_bytes(layers)) if i not in resident]
    block_file = getattr(causal_lm, "poros_block_file", None)  # the NF4 block cache entry the blocks view
    # data parallel: the node's ranks share the entry local rank 0 built (distributed.shared_host_copy)
    plan = choose_host_tier(streamed, budget, requested=host_tier, read_ahead=read_ahead,
                            ranks_per_node=world().local_size, shared_file=block_file is not None)
    if host_tier is not None or budget is not None or plan.ranks_per_node > 1:
        logger.info("poros: %s", plan.reason)
    tier = make_host_tier(plan.tier, block_file, read_ahead=plan.read_ahead or DEFAULT_READ_AHEAD,
                          spill_dir=cache.cache_root(cache_dir) / "spill", chosen=host_tier is None,
                          held=plan.held_blocks)
    return plan, tier


def _check_budget_options(resident_blocks: Any, vram_budget: Any, workload: Any) -> None:
    if vram_budget is not None and resident_blocks is not None:
        raise ConfigError(
            f"prepare(resident_blocks={resident_blocks!r}, vram_budget={vram_budget!r}): the budget planner chooses "
            "the resident blocks. Pass one of the two."
        )
    if vram_budget is not None and workload is None:
        raise ConfigError(
            f"prepare(vram_budget={vram_budget!r}) needs the step it plans for: the activations depend on it. Pass "
            "workload={'seq_len': 512, 'batch_size': 1} (and 'grad_accum', 'schedule' when accumulating)."
        )


def _workload(workload: Any):
    """A planner ``Workload`` from itself or a dict of its fields."""
    from poros.stream.planner import Workload

    if isinstance(workload, Workload):
        return workload
    if isinstance(workload, Mapping):
        unknown = sorted(set(workload) - {"batch_size", "seq_len", "grad_accum", "schedule"})
        if unknown:
            raise ConfigError(f"workload has unknown keys {unknown}; expected batch_size, seq_len, grad_accum, "
                              "schedule.")
        return Workload(**workload)
    raise ConfigError(f"workload={workload!r}: expected a poros.stream.planner.Workload or a dict of its fields, "
                      "e.g. {'seq_len': 512, 'batch_size': 1}.")


def _resident_indices(resident_blocks: int | Iterable[int] | None, count: int) -> tuple[int, ...]:
    """``resident_blocks`` as block indices: an int N is the last N blocks."""
    if resident_blocks is None:
        return ()
    if isinstance(resident_blocks, bool) or (isinstance(resident_blocks, int) and not 0 <= resident_blocks <= count):
        raise ConfigError(f"resident_blocks={resident_blocks!r}: expected a number of blocks from 0 to {count} (the "
                          f"last ones stay on the device) or a list of block indices.")
    if isinstance(resident_blocks, int):
        return tuple(range(count - resident_blocks, count))
    indices = tuple(sorted(set(resident_blocks)))
    wrong = [i for i in indices if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < count]
    if wrong:
        raise ConfigError(f"resident_blocks names {wrong}, not blocks of this model (indices 0..{count - 1}). Pass "
                          "indices in that range, or an int N for the last N blocks.")
    return indices


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

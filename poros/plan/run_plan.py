"""The offline plan of a run (``poros train --dry-run``, ``poros plan``): from a
:class:`~poros.config.PorosConfig` and the checkpoint's ``config.json`` alone -- no weight is read,
nothing is downloaded, nothing is trained. :func:`locate_checkpoint_config` finds the config (a local
directory, the bundled model, the HF cache); :func:`plan_run` builds the text tower as a meta skeleton
and counts its bytes with :mod:`poros.plan.footprint` (the memory plan), and with
:class:`PlanOptions` (``poros plan``) also plans the VRAM budget (:mod:`poros.plan.budget`), the host
tier (:func:`poros.plan.host_tiers.plan_host_tier`, the decision ``prepare`` takes) and the node's host
RAM: :attr:`Plan.budget`. Multimodal checkpoints (a config with ``text_config``) are planned for their
text tower, the part Poros trains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from poros.adapters import lora_targets
from poros.descriptor import resolve_path
from poros.devices import resolve_device
from poros.errors import ConfigError, HostMemoryError, PorosError
from poros.plan import host_tiers
from poros.plan.entry import cuda_graphs_on, plan_config, workload_of
from poros.loading.prequantized import read_prequantized
from poros.plan.activations import BlockShapes, activation_bytes, attention_sms
from poros.plan.block_bytes import block_bytes, meta_skeleton, quantized_linears, tensor_bytes
from poros.plan.footprint import chunked_footprints, with_activations
from poros.spellings import format_gb, parse_budget
from poros.stream.placement import embeddings_on_host, host_embedding_tables
from poros.plan.budget import (
    CUDA_WORKSPACE_BYTES,
    LORA_BYTES_PER_PARAMETER,
    LORA_VALUE_BYTES,
    BudgetPlan,
    ComputeTimes,
    Footprint,
    Workload,
    peak_upper_bound,
)
from poros.plan.checkpoint_config import config_source, load_text_config, locate_checkpoint_config
from poros.plan.step_time import parse_block_ms
from poros.stream.graph_keys import block_structures
from poros.plan.experts import (expert_lora_parameters, expert_sizes, largest_fused_experts, lora_shapes,
                                lora_statics_bytes)


@dataclass(frozen=True)
class PlanOptions:
    """What ``poros plan`` adds to the config to plan its VRAM budget (``vram_budget``; on CUDA, unset, the
    device's memory): the compute and link times, given or measured, and the node's ranks."""

    block_ms: str | None = None  # "FWD,BWD" ms per block and micro-batch, or one total (split 1:2); skips the probe
    head_ms: float = 0.0  # head and loss, forward and backward, per micro-batch in ms (with block_ms)
    link_gb_per_s: float | None = None  # host-to-device GB/s (10^9 bytes); None: measured with compute times
    probe: bool | None = None  # time one block at the run's shapes (None: on CUDA, unless block_ms is given)
    ranks_per_node: int = 1  # data parallel: each GPU plans for its share of batch_size
    #: what measures: ``probe_compute(text_config, workload, device, ...)`` and ``measure_link(device)``
    #: (``poros.doctor.probe``, which the layer above lends); None: nothing is measured
    prober: Any = None
    #: the host RAM the run may use here (``host_tiers.MachineRam``); None: read from the machine
    #: (``host_tiers.machine_host_ram``: $POROS_HOST_RAM, else MemAvailable and the cgroup limit)
    machine_ram: Any = None


@dataclass(frozen=True)
class BudgetReport:
    """``poros plan``'s part of a :class:`Plan`: the plan for the VRAM budget, the host tier the run gets,
    the node's host RAM, and the times the plan used."""

    budget_plan: BudgetPlan
    host: host_tiers.HostPlan  # plan_host_tier: what prepare decides for the same options
    data_parallel: dict  # host_tiers.node_host_ram
    compute: ComputeTimes | None  # None: the step time is unknown
    link_source: str | None  # where the link rate came from ("given: --link-gb-per-s", "measured: ...")
    ranks_per_node: int
    per_rank_batch: int
    host_tier_requested: str | None  # the config's host_tier
    notices: tuple[str, ...] = ()  # one line each: what could not be measured, and what to do
    host_ram: tuple[tuple[str, int], ...] = ()  # host RAM one rank needs, by part (host_ram_parts)
    #: the host budget the plan took for the machine's RAM (fit_machine) instead of the config's; None: the config's
    refit_host_budget: int | None = None

    @property
    def host_ram_bytes(self) -> int:
        return sum(n for _, n in self.host_ram)


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
    budget: BudgetReport | None = None  # poros plan (plan_run with PlanOptions); None for the memory plan alone
    shapes: BlockShapes | None = None  # what the activations are priced from (the planner re-prices chunk counts)
    attn_implementation: str | None = None
    loss_chunks: int = 1
    mlp_chunks: int = 1
    experts: str | None = None  # MoE models: experts per block, their bf16 and NF4 bytes (None: no experts)
    attention_sms: int = 0  # the flash backward's deterministic dQ split (poros.plan.footprint.attention_sms)
    cuda_graphs: bool = False  # the run captures its blocks (cuda_graphs_on: the peak counts the graphs' buffers)
    packed: bool = False  # packing: true (rows of several examples: a seq x seq mask, no flash kernel)
    prequantized: bool = False  # a bnb-4bit checkpoint: its blocks stream from its own shards (the mapped tier)
    fused_loss: bool = False  # kernels: liger: the head is Liger's fused linear cross-entropy (no loss_chunks)
    block_structures: int = 1  # how many block structures CUDA graphs key apart (graph_keys.block_structures)
    lora_statics_bytes: int = 0  # the CUDA graphs' shared static LoRA buffers (placement.shared_statics_bytes)

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
        return Workload(self.batch_size, self.seq_len, self.grad_accum, self.stream_schedule, self.loss_chunks,
                        packed=self.packed, fused_loss=self.fused_loss)

    @property
    def peak_device_bytes_estimate(self) -> int:
        """An upper bound: every part of the peak model at once (:func:`~poros.plan.budget.peak_upper_bound`),
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
        """The planner's view of this run (:func:`plan_budget`), its activations by part."""
        base = self._base_footprint()
        if self.shapes is None:
            return base
        return with_activations(base, self.shapes, self.workload, value_bytes=self.activation_bytes_per_value,
                                attn_implementation=self.attn_implementation, mlp_chunks=self.mlp_chunks,
                                loss_chunks=self.loss_chunks)

    def footprint_for(self):
        """``(loss_chunks, mlp_chunks) -> Footprint``: the planner's re-pricing of the chunk counts."""
        return chunked_footprints(self._base_footprint(), self.shapes, self.workload,
                                  value_bytes=self.activation_bytes_per_value,
                                  attn_implementation=self.attn_implementation)

    def _base_footprint(self) -> Footprint:
        return Footprint(
            cuda_graphs=self.cuda_graphs,
            block_bytes=self.block_bytes,
            device_non_block_bytes=self.non_block_bytes - self.embedding_table_bytes,
            host_embedding_bytes=self.embedding_table_bytes,
            lora_parameter_bytes=self.lora_parameters * LORA_VALUE_BYTES,
            boundary_bytes=self.batch_size * self.seq_len * self.hidden_size * self.activation_bytes_per_value,
            recompute_bytes=self.recompute_bytes, head_bytes=self.logits_bytes,
            workspace_bytes=CUDA_WORKSPACE_BYTES if self.device.startswith("cuda") else 0,
            attention_sms=self.attention_sms, block_structures=self.block_structures,
            lora_statics_bytes=self.lora_statics_bytes,
        )


def plan_run(config: Any, options: PlanOptions | None = None) -> Plan:
    """The plan of a :class:`~poros.config.PorosConfig`, from the checkpoint's config only: the memory plan
    (``poros train --dry-run``), and with ``options`` (``poros plan``) also :attr:`Plan.budget`, the plan
    for ``vram_budget`` with the host tier and the node's host RAM.

    Raises:
        CheckpointLoadError: the checkpoint's ``config.json`` is not available offline or unreadable.
        UnknownArchitectureError: no registered family claims its ``model_type``.
        ConfigError: ``target_modules`` names a linear the model does not have; with ``options``: no
            budget on the CPU, a budget below the run's minimum, a bad ``block_ms`` or link rate, a host
            budget below the disk tier's minimum.
        DeviceError: with ``options``, a CUDA device that is not here (unless the budget, ``block_ms`` and
            ``link_gb_per_s`` are all given: a CUDA run is then planned on any machine).
        DistributedError: ``batch_size`` does not split over ``ranks_per_node``.
    """
    if options is None:
        return _memory_plan(config)[0]
    # the budget, the probe and the link measurement need the GPU itself; all three given, a CUDA run is
    # planned on any machine
    given_all = config.vram_budget is not None and options.block_ms is not None and options.link_gb_per_s is not None
    device = resolve_device(config.device, check=not given_all)
    budget = config.vram_budget
    if budget is None:
        if device.type != "cuda":
            raise ConfigError("poros plan needs a budget on the CPU: pass --vram-budget (e.g. --vram-budget 8GiB for "
                              "an 8 GiB card); on CUDA it defaults to the device's memory.")
        budget = torch.cuda.get_device_properties(device).total_memory
    plan, text_config = _memory_plan(config)
    return replace(plan, budget=_budget_report(config, options, plan, text_config, device, budget))


def _memory_plan(config: Any) -> tuple[Plan, Any]:
    """The memory plan and the text config it was made from."""
    from poros import registry

    directory, found_in = config_source(config.model, revision=config.revision)  # a known model: offline
    full_config, text_config = load_text_config(directory)
    descriptor = registry.for_config(text_config)
    compute_dtype = getattr(torch, config.compute_dtype)
    model = meta_skeleton(text_config, compute_dtype)
    blocks = list(resolve_path(model, descriptor.decoder_layers))
    # a pre-quantized (bnb-4bit) checkpoint: its own quant type, double quantization and skipped modules
    prequantized = read_prequantized(full_config, directory)
    quantized = prequantized.quantized_linears(model) if prequantized else quantized_linears(model)
    double_quant = prequantized.double_quant if prequantized else config.double_quant
    quantized_weights = {id(module.weight) for module in quantized.values()}
    sizes = block_bytes(blocks, quantized_weights, double_quant=double_quant)
    sizes, experts_line = expert_sizes(blocks, sizes, config.quantize_experts)

    in_blocks = {id(t) for block in blocks for t in [*block.parameters(), *block.buffers()]}
    outside = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in in_blocks}
    non_block = sum(tensor_bytes(t, quantized_weights, double_quant) for t in outside.values())

    device = str(resolve_device(config.device))
    on_host = embeddings_on_host(config.embeddings_on_host, device)
    tables = sum(t.weight.numel() * t.weight.element_size() for t in host_embedding_tables(model, descriptor))

    targets = lora_targets(model, config.target_modules)
    lora_parameters = sum(math.prod(shape) for m in targets.values() for shape in lora_shapes(m, config))
    expert_lora = expert_lora_parameters(blocks, config)
    lora_parameters += expert_lora
    if experts_line:
        experts_line += (f"; LoRA rank {config.lora_rank} per expert (lora_on_experts): "
                         f"{expert_lora / 1e6:.1f} M parameters, {format_gb(expert_lora * LORA_BYTES_PER_PARAMETER)} "
                         "with gradients and AdamW state" if expert_lora else "; no LoRA on the experts "
                         "(lora_on_experts=false)")

    value_bytes = torch.empty((), dtype=compute_dtype, device="meta").element_size()
    shapes = BlockShapes.of(blocks, text_config, lora_targets={name.split(".")[-1] for name in targets},
                            lora_value_bytes=LORA_VALUE_BYTES, compute_dtype=compute_dtype)
    if experts_line and config.quantize_experts is not False and device.startswith("cuda"):
        # prepare's default experts forward on a CUDA device with grouped_mm: each fused tensor dequantized whole
        shapes = replace(shapes, dequantized_experts=largest_fused_experts(blocks))
    sms = attention_sms(device, config.deterministic)
    _, recompute, head = activation_bytes(shapes, batch_size=config.batch_size,
                                          seq_len=config.seq_len, value_bytes=value_bytes,
                                          attn_implementation=config.attn_implementation,
                                          loss_chunks=config.loss_chunks, mlp_chunks=config.mlp_chunks,
                                          attention_sms=sms, packed=config.packing,
                                          fused_loss=config.kernels == "liger")
    return Plan(
        model=config.model, checkpoint=str(directory), found_in=found_in, family=descriptor.name,
        model_type=text_config.model_type,
        text_tower_of=full_config.model_type if text_config is not full_config else None,
        num_blocks=len(blocks), hidden_size=text_config.hidden_size, vocab_size=text_config.vocab_size,
        quantization=prequantized.quant_type if prequantized else config.quantization, double_quant=double_quant,
        compute_dtype=config.compute_dtype,
        block_bytes=tuple(sizes), non_block_bytes=non_block, embedding_table_bytes=tables,
        host_embedding_bytes=tables if on_host else 0, lora_rank=config.lora_rank,
        use_dora=config.use_dora, lora_modules=len(targets), lora_parameters=lora_parameters,
        target_modules=(config.target_modules if isinstance(config.target_modules, str)
                        else ",".join(config.target_modules)),
        batch_size=config.batch_size, seq_len=config.seq_len, grad_accum=config.grad_accum,
        stream_schedule=config.stream_schedule, num_slots=config.num_slots, device=device, activation_bytes_per_value=value_bytes,
        recompute_bytes=recompute, logits_bytes=head, shapes=shapes, attn_implementation=config.attn_implementation,
        loss_chunks=config.loss_chunks, mlp_chunks=config.mlp_chunks, experts=experts_line, attention_sms=sms,
        cuda_graphs=cuda_graphs_on(config.cuda_graphs, device),
        packed=config.packing, prequantized=prequantized is not None, fused_loss=config.kernels == "liger",
        block_structures=block_structures(blocks),
        lora_statics_bytes=lora_statics_bytes(blocks, targets, config),
    ), text_config


def _budget_report(config: Any, options: PlanOptions, plan: Plan, text_config: Any, device: torch.device,
                   budget: Any) -> BudgetReport:
    """The plan for ``budget`` on ``device``, the host tier and the node's host RAM (see :func:`plan_run`)."""
    ranks = options.ranks_per_node
    per_rank_batch = config.batch_size  # per device, as HF / axolotl / torchtune count it
    workload = workload_of(config)
    compute, link, link_source, notices = _times(config, options, plan, text_config, workload, device)
    footprint = plan.footprint()
    on_host = embeddings_on_host(config.embeddings_on_host, device)
    # the tier the run will take: ``mapped`` when the model loads through the block cache (prepare decides
    # the same from the loaded model's entry) or is a pre-quantized checkpoint (its shards), unless the run
    # packs MoE experts after loading (pinned buffers)
    cached = (not config.no_cache or plan.prequantized) and not (plan.experts and config.quantize_experts is not False)

    def report(host_budget: Any) -> BudgetReport:
        _, budget_plan = plan_config(config, footprint, vram_budget=budget, device=device, compute=compute,
                                     link_bytes_per_s=link, footprint_for=plan.footprint_for(),
                                     embeddings_on_host=on_host, host_budget=host_budget)
        host = host_tiers.plan_host_tier(footprint.block_bytes, budget_plan.resident_blocks,
                                         host_tier=config.host_tier,
                                         host_budget=None if host_budget is None else parse_budget(host_budget),
                                         read_ahead=config.read_ahead, ranks_per_node=ranks, shared_file=cached,
                                         prequantized=plan.prequantized)
        node = host_tiers.node_host_ram(footprint, host, on_host, shared_tables=cached)
        return BudgetReport(budget_plan, host, node, compute, link_source, ranks, per_rank_batch, config.host_tier,
                            tuple(notices), host_ram=host_tiers.host_ram_parts(budget_plan, host, footprint))

    machine = options.machine_ram if options.machine_ram is not None else host_tiers.machine_host_ram()
    return fit_machine(report, config.host_budget, machine)


def fit_machine(report: Callable[[Any], BudgetReport], host_budget: Any,
                machine: host_tiers.MachineRam | None) -> BudgetReport:
    """``report(host_budget)`` when the host RAM it needs (and the process's own,
    :data:`~poros.plan.host_tiers.PROCESS_HOST_BYTES`) fits what ``machine`` has; else, with no host budget
    given, the report for a host budget of what the machine has (the planner then picks ``boundary_every``,
    the host tier and the boundary states' place to fit it), said in a notice.

    Raises:
        HostMemoryError: the run does not fit the machine's RAM with the host budget given, or at all: one line
            naming what it needs, what the machine has, and the plan that fits (or the smallest host RAM).
    """
    first = report(host_budget)
    if machine is None or first.host_ram_bytes + host_tiers.PROCESS_HOST_BYTES <= machine.available:
        return first
    room = machine.available - host_tiers.PROCESS_HOST_BYTES
    refit, budget = None, room
    for _ in range(4):  # the budget less what the plan needs beyond it (e.g. boundary states in flight)
        if budget <= 0:
            break
        try:
            refit = report(budget)
        except ConfigError:
            refit = None
            break
        if refit.host_ram_bytes <= room:
            break
        budget -= refit.host_ram_bytes - room
    fits = refit is not None and refit.host_ram_bytes <= room
    has = (f"this machine has {format_gb(machine.available)} ({machine.source}), "
           f"{format_gb(host_tiers.PROCESS_HOST_BYTES)} of it for the process itself")
    needs = f"the run needs {format_gb(first.host_ram_bytes)} of host RAM ({_parts_words(first)})"
    if fits and host_budget is None:
        notice = (f"host RAM: {needs} but {has}; planned for host_budget={format_gb(budget)} instead: "
                  f"{_plan_words(refit)}")
        return replace(refit, notices=(*refit.notices, notice), refit_host_budget=budget)
    if fits:
        raise HostMemoryError(f"host_budget={host_budget}: {needs} but {has}. Fix: --host-budget "
                          f"{max(budget >> 30, 1)}GiB, which plans {_plan_words(refit)}.")
    raise HostMemoryError(f"{needs} but {has}, and no plan fits it (the disk tier and boundary_every included). Fix: "
                      "free host RAM, or plan a smaller run (a shorter seq_len, fewer micro-batches).")


def fit_host_ram(config: Any, machine: host_tiers.MachineRam | None = None) -> tuple[Any, str | None]:
    """The config a run on this machine takes, and what changed, in one line (None: nothing): ``PorosTrainer``
    calls it before loading. With a ``vram_budget`` the plan ``poros plan`` makes (:func:`fit_machine`: a
    host budget for the machine's RAM, or a refusal); without, the streamed blocks (and the host embedding
    tables) against the machine's RAM: the disk tier for the rest when no host budget is given.
    ``machine``: None reads it (:func:`~poros.plan.host_tiers.machine_host_ram`).

    Raises:
        HostMemoryError: as :func:`fit_machine`.
    """
    machine = machine if machine is not None else host_tiers.machine_host_ram()
    if machine is None:
        return config, None
    if config.vram_budget is not None:
        try:
            report = plan_run(config, PlanOptions(machine_ram=machine)).budget
        except HostMemoryError:
            raise
        except PorosError:  # a VRAM budget the run does not fit: prepare says so, with the loaded model's plan
            return config, None
        if report.refit_host_budget is None:
            return config, None
        return config.replace(host_budget=str(report.refit_host_budget)), f"poros: {report.notices[-1]}"
    plan = _memory_plan(config)[0]
    need = sum(plan.block_bytes) + plan.host_embedding_bytes
    room = machine.available - host_tiers.PROCESS_HOST_BYTES
    if need <= room:
        return config, None
    has = (f"this machine has {format_gb(machine.available)} ({machine.source}), "
           f"{format_gb(host_tiers.PROCESS_HOST_BYTES)} of it for the process itself")
    blocks = f"the streamed blocks and host tables need {format_gb(need)} of host RAM"
    if config.host_budget is not None or room < 2 * max(plan.block_bytes, default=0) + plan.host_embedding_bytes:
        fix = (f"--host-budget {max((room - plan.host_embedding_bytes) >> 30, 1)}GiB (the disk tier)"
               if room > 2 * max(plan.block_bytes, default=0) + plan.host_embedding_bytes
               else "free host RAM, or a machine with more")
        raise HostMemoryError(f"{blocks} but {has}. Fix: {fix}.")
    budget = room - plan.host_embedding_bytes
    return (config.replace(host_budget=str(budget)),
            f"poros: host RAM: {blocks} but {has}; host_budget={format_gb(budget)}: the disk tier streams the rest")


def _plan_words(report: BudgetReport) -> str:
    bp = report.budget_plan
    return (f"the {report.host.tier} tier, boundary_every={bp.boundary_every}, boundary states on the "
            f"{bp.boundary_states}: {format_gb(report.host_ram_bytes)} of host RAM")


def _parts_words(report: BudgetReport) -> str:
    return ", ".join(f"{name} {format_gb(n)}" for name, n in report.host_ram)


def _times(config: Any, options: PlanOptions, plan: Plan, text_config: Any, workload: Workload,
           device: torch.device) -> tuple[ComputeTimes | None, float | None, str | None, list[str]]:
    """``(compute, link bytes/s, link source, notices)``: the times given in ``options``, or measured by
    ``options.prober`` (the compute probe on CUDA or when asked; the link when there are compute times)."""
    on_cuda = device.type == "cuda"
    compute = link = link_source = None
    notices: list[str] = []
    if options.block_ms is not None:
        forward, backward = parse_block_ms(options.block_ms)
        compute = ComputeTimes.uniform(plan.num_blocks, forward, backward, options.head_ms / 1000,
                                       source=f"given: --block-ms {options.block_ms}"
                                              + (f" --head-ms {options.head_ms:g}" if options.head_ms else ""))
    elif options.prober is not None and (options.probe or (options.probe is None and on_cuda)):
        try:
            compute = options.prober.probe_compute(
                text_config, workload, device, compute_dtype=getattr(torch, config.compute_dtype),
                quant_type=plan.quantization, double_quant=plan.double_quant,  # a bnb-4bit checkpoint: its own
                attn_implementation=config.attn_implementation, lora_rank=config.lora_rank,
                lora_alpha=config.lora_alpha, target_modules=config.target_modules,
                lora_parameters=plan.lora_parameters)
        except torch.OutOfMemoryError as error:
            notices.append(f"the compute probe did not fit on {device} ({str(error).splitlines()[0]}); the step "
                           "time stays unknown. Give --block-ms (and --link-gb-per-s) from another run, or free the "
                           "device.")
    if options.link_gb_per_s is not None:
        if options.link_gb_per_s <= 0:
            raise ConfigError(f"--link-gb-per-s {options.link_gb_per_s:g}: expected a positive GB/s, e.g. 25 (PCIe 4 "
                              "x16).")
        link, link_source = options.link_gb_per_s * 1e9, "given: --link-gb-per-s"
    elif compute is not None and options.prober is not None and (on_cuda or options.probe):
        link = options.prober.measure_link(device)
        link_source = "measured: one pinned 256 MiB copy" if on_cuda else "measured: a 256 MiB host memcpy (cpu)"
    return compute, link, link_source, notices


__all__ = ["BudgetReport", "Plan", "PlanOptions", "config_source", "fit_host_ram", "fit_machine", "load_text_config", "locate_checkpoint_config",
           "parse_block_ms", "plan_run"]

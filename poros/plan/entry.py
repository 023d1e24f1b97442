"""The planner's one way in: the step a run is planned for, built from a :class:`~poros.config.PorosConfig`
or from ``prepare``'s keywords (:func:`workload_of`; nothing outside ``poros.plan`` builds a
:class:`~poros.stream.options.Workload`), the budget plan of a configuration (:func:`plan_config`:
``poros plan`` and ``poros doctor --model`` ask it, so the two never disagree), and the decisions of
the device a run's settings leave open: whether CUDA graphs run (:func:`cuda_graphs_on`, the one rule of
``cuda_graphs="auto"``; under a budget :func:`graphs_decided`, which turns ``"auto"`` off where the graphs' memory
does not fit) and what the device holds outside the allocated peak (:func:`device_context_bytes`).

``prepare`` plans a loaded model through :func:`poros.plan.footprint.plan_for_model` with the same
rules; ``PorosTrainer`` through ``prepare``. Torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from poros.errors import ConfigError
from poros.plan.budget import CUDA_CONTEXT_BYTES, BudgetPlan, ComputeTimes, Footprint, plan_budget
from poros.settings import SETTINGS
from poros.stream.options import StreamOptions, Workload, step_of
from poros.stream.placement import graph_reserve_bytes


def workload_of(config: Any = None, *, schedule: str | None = None, **fields: Any) -> Workload:
    """The step a run is planned for.

    Args:
        config: a :class:`~poros.config.PorosConfig`: its ``batch_size``, ``seq_len``, ``grad_accum``,
            ``loss_chunks``, ``packing`` and ``stream_schedule`` (or ``schedule``).
        fields: without a config, the workload's fields by name (``prepare``'s ``workload`` keyword as a
            dict: ``batch_size``, ``seq_len``, ``grad_accum``, ``schedule``, ``loss_chunks``, ``packed``).

    Raises:
        ConfigError: a size below 1 or an unknown schedule.
    """
    if config is not None:
        if fields:
            raise TypeError(f"workload_of(config, ...) takes no fields beside the config's; got {sorted(fields)}")
        return Workload(**step_of(config, schedule))
    if schedule is not None:
        fields["schedule"] = schedule
    return Workload(**fields)


def cuda_graphs_on(value: Any, device: Any) -> bool:
    """Whether ``cuda_graphs=value`` applies on ``device`` (a ``torch.device`` or its string): graphs exist
    on CUDA only, so ``True`` and ``"auto"`` mean on there and off anywhere else.

    Raises:
        ConfigError: not true, false or ``"auto"``.
    """
    SETTINGS["cuda_graphs"].check(value)
    return value is not False and str(getattr(device, "type", device)).startswith("cuda")


def graphs_decided(setting: Any, device: Any, plan: Callable[[bool], BudgetPlan]) -> tuple[BudgetPlan, bool]:
    """The budget plan and whether CUDA graphs run: ``plan(graphs)`` plans with or without the graphs' pool and
    static buffers (``placement.graph_reserve_bytes``). ``cuda_graphs="auto"`` keeps them where the plan with them
    fits the budget and turns them off where only the plan without them does (the plan's notes say so); ``True``
    keeps them, and its error names ``auto`` / ``false`` where those would fit.

    Raises:
        ConfigError: the budget fits no plan (or, with ``True``, not the plan with graphs).
    """
    if not cuda_graphs_on(setting, device):
        return plan(False), False
    try:
        return plan(True), True
    except ConfigError as error:
        try:
            without = plan(False)
        except ConfigError:
            raise error from None
        if setting is True:
            raise ConfigError(f"{error} Without CUDA graphs it fits (their pool and static buffers are what does "
                              "not): cuda_graphs: auto turns them off where they do not fit, or cuda_graphs: false.") \
                from None
    note = ("cuda_graphs: auto -> off: the graphs' pool and static buffers do not fit the budget beside the run "
            "(set a larger vram_budget to replay the blocks from graphs)")
    return dataclasses.replace(without, notes=(*without.notes, note)), False


def device_context_bytes(footprint: Footprint, device: Any, *, cuda_graphs: bool) -> int:
    """Device memory a plan counts outside the allocated peak: the CUDA context on a CUDA ``device`` (a
    ``torch.device`` or its string) and, with ``cuda_graphs`` (on for this run: :func:`cuda_graphs_on`), the
    graphs' pool and static buffers (``placement.graph_reserve_bytes``). What ``prepare(vram_budget=...)``
    and ``poros plan`` both reserve."""
    context = CUDA_CONTEXT_BYTES if str(getattr(device, "type", device)).startswith("cuda") else 0
    return context + (graph_reserve_bytes(footprint) if cuda_graphs else 0)


def plan_config(config: Any, footprint: Footprint, *, vram_budget: Any, device: Any, schedule: str | None = None,
                compute: ComputeTimes | None = None, link_bytes_per_s: float | None = None,
                footprint_for: Any = None, **changes: Any) -> tuple[StreamOptions, BudgetPlan]:
    """The budget plan of ``config`` for ``footprint`` on ``device``: its options
    (``StreamOptions.from_config``, with ``vram_budget`` and ``changes``), its workload (every field of
    the step: ``loss_chunks`` and packing included), the CUDA context and graph reserve, then
    :func:`~poros.plan.budget.plan_budget`.

    Returns:
        ``(options, plan)``.

    Raises:
        ConfigError: an invalid option, or a budget below the run's minimum.
    """
    options = StreamOptions.from_config(config, schedule=schedule, vram_budget=vram_budget, **changes)

    def planned(graphs: bool) -> BudgetPlan:
        context = device_context_bytes(footprint, device, cuda_graphs=graphs)
        chunked = None if footprint_for is None else (
            lambda loss_chunks, mlp_chunks: dataclasses.replace(footprint_for(loss_chunks, mlp_chunks),
                                                                cuda_graphs=graphs))
        return plan_budget(dataclasses.replace(footprint, cuda_graphs=graphs), options.budget_workload(), options,
                           compute=compute, link_bytes_per_s=link_bytes_per_s, context_bytes=context,
                           footprint_for=chunked)

    plan, _ = graphs_decided(config.cuda_graphs, device, planned)
    return options, plan


__all__ = ["cuda_graphs_on", "device_context_bytes", "graphs_decided", "plan_config", "workload_of"]

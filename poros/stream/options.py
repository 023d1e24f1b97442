"""``StreamOptions``: every option of a streamed run as one frozen value, checked in one place.

How a run streams -- the slot ring, the resident blocks, the VRAM budget and the step it is planned
for (:class:`Workload`), where the embedding tables, the boundary states, AdamW's state and the LoRA
tensors live, the host tier, CUDA graphs, the chunked loss, the tiled MLP, the guarantee the run must earn -- is
made once and carried whole::

    PorosConfig ──StreamOptions.from_config──┐
    prepare(model, **keywords) ──from_keywords┴─▶ StreamOptions ─▶ prepare ─▶ planner (plan_budget)
                                                                     │
                                  the choices left open, filled in ─▶ BlockStore, StreamingExecutor
                                  (StreamOptions.replace)              (PorosModel.options)

Construction checks every value (:class:`~poros.errors.ConfigError` naming the option, what it
got, what it expects); an unknown name fails with the closest one. What needs the model (a
resident block index past the last block) is checked by :meth:`StreamOptions.resident_indices`.
Torch-free: the planner, ``poros plan`` and the CLI build it without loading anything.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from poros.config import parse_budget
from poros.errors import ConfigError
from poros.stream import optimizer_states as adamw_states
from poros.stream.placement import check_boundary_states
from poros.stream.segments import check_every

SCHEDULES = ("micro-major", "layer-major")
#: where the streamed blocks live on the host (``poros/stream/tiers.py``; chosen by ``poros.loading.host_tiers``)
HOST_TIERS = ("pinned", "mapped", "disk")
#: the guarantee labels ``require`` may ask for, weakest first (docs/parity-modes.md)
REQUIRABLE = ("numerical", "bitwise")


@dataclass(frozen=True)
class Workload:
    """The shape of one optimizer step, which sets the activations and the copies.

    Args:
        batch_size: examples per micro-batch.
        seq_len: tokens per example.
        grad_accum: micro-batches per optimizer step (M).
        schedule: ``"micro-major"`` (every micro-batch streams every block: 2·M copies per block
            per step) or ``"layer-major"`` (:meth:`~poros.dropin.model.PorosModel.forward_backward`: each
            block once per direction for all M micro-batches, whose M x L boundary states stay on
            the device).
        loss_chunks: the loss over this many token chunks (``PorosConfig.loss_chunks``; 1: HF's).
        packed: rows hold several examples kept apart by ``position_ids`` restarts (``PorosConfig.packing``,
            ``poros.data.packing``): transformers then builds a ``batch x 1 x seq x seq`` mask, which SDPA
            copies into the compute dtype, and never takes the flash kernel.
        boundary_every: k, the input of every k-th block kept for backward and the others recomputed
            (``StreamOptions.boundary_every``): fewer boundary states, one more forward through
            (k - 1) / k of the blocks and their copies.

    Raises:
        ConfigError: a size below 1 or an unknown schedule.
    """

    batch_size: int = 1
    seq_len: int = 512
    grad_accum: int = 1
    schedule: str = "micro-major"
    loss_chunks: int = 1
    packed: bool = False
    boundary_every: int = 1

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "loss_chunks", "boundary_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"Workload {name}={getattr(self, name)!r}: expected an integer >= 1.")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"Workload schedule={self.schedule!r}: expected one of {', '.join(SCHEDULES)}.")

    @classmethod
    def of(cls, value: Any) -> "Workload":
        """``value`` itself, or the workload of a mapping of its fields.

        Raises:
            ConfigError: a mapping with other keys, or anything else.
        """
        if isinstance(value, Workload):
            return value
        if isinstance(value, Mapping):
            fields = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(fields))
            if unknown:
                raise ConfigError(f"workload has unknown keys {unknown}; expected {', '.join(fields)}.")
            return cls(**value)
        raise ConfigError(f"workload={value!r}: expected a poros.stream.planner.Workload or a dict of its fields, "
                          "e.g. {'seq_len': 512, 'batch_size': 1}.")


@dataclass(frozen=True)
class StreamOptions:
    """Every option of a streamed run (``poros.prepare``'s keywords), frozen and checked.

    Build it from keywords, :meth:`from_keywords` (unknown names fail by name) or
    :meth:`from_config`; change it with :meth:`replace` (a new, checked object).

    Args:
        num_slots: device slots in the block ring (2: compute one block while the next arrives; None
            means 2). With ``vram_budget`` the ring asked for; the planner gives fewer only when the
            budget cannot hold them.
        embeddings_on_host: keep frozen embedding tables that are not tied to the head (the input
            embedding, a per-layer embedding table) in host memory and look tokens up there; only the
            looked-up rows cross the link. None: on when the compute device is CUDA. With several
            ranks on the node and a model loaded through the NF4 block cache, the ranks map one copy
            of each table (a file beside the cache entry) instead of each holding its own.
        require: ``"bitwise"`` or ``"numerical"``: ``prepare`` raises
            :class:`~poros.errors.GuaranteeError` if the label that applies is weaker.
        resident_blocks: blocks kept on the device for good instead of streamed: an int N for the
            last N blocks (the last of forward are the first of backward), or block indices.
        vram_budget: device memory the run may use (``"7GiB"``, ``"24GB"``, an int of bytes): the
            planner (``poros.stream.planner.plan_budget``) picks the slots and the resident blocks
            for it and logs its decision; the plan is kept as ``PorosModel.budget_plan``. ``prepare``
            needs ``workload`` with it; excludes ``resident_blocks``.
        workload: the step the budget is planned for: a :class:`Workload` or a dict of its fields
            (``batch_size``, ``seq_len``, ``grad_accum``, ``schedule``, ``loss_chunks``).
        boundary_states: where layer-major accumulation (``forward_backward``) keeps the M x L block
            inputs until backward: ``"device"`` or ``"host"`` (pinned host memory, copied on a side
            stream; bitwise the same). None: the planner decides under ``vram_budget`` (host only
            when the budget needs it), else the device.
        boundary_every: k, keep the input of every k-th block for backward (where ``boundary_states``
            says) and recompute the k - 1 between from it, one more forward without grad through the
            segment's blocks (``poros.stream.segments``; bitwise the same, both schedules): an int >= 1,
            or ``"auto"``: the planner's choice under ``vram_budget`` and ``host_budget`` (the smallest k
            that fits the budget with the boundary states off the disk), 1 without a budget. None: 1
            (``PorosConfig.boundary_every`` defaults to ``"auto"``).
        optimizer_states: with ``vram_budget``, where the plan puts AdamW's state: ``"device"``,
            ``"host"`` or ``"auto"`` (host only when the slot ring does not fit with it on the
            device). ``prepare`` moves no optimizer: the plan's choice is
            ``PorosModel.budget_plan.optimizer_states``, which PorosTrainer applies
            (``poros.stream.host_optimizer.adamw``) and a loop of your own should too
            (``poros.HostAdamW`` when it says ``"host"``).
        host_tier: where the streamed blocks live on the host: ``"pinned"``, ``"mapped"`` or ``"disk"``
            (``docs/cache-and-host-memory.md``). A model loaded through the NF4 block cache is served
            from its entry; any other model is first written to a spill file. None: ``"mapped"`` for
            a model loaded through the cache (no copy at the start; the node's ranks share the
            entry's pages; where the device will not register the mapping, pinned copies), else
            ``"pinned"``.
        host_budget: host RAM the blocks may use (``"24GiB"``, bytes): without ``host_tier``, the
            planner (``poros.loading.host_tiers.choose_host_tier``) keeps them on the host as above
            when they fit and streams them from disk otherwise; the decision is kept as
            ``PorosModel.host_plan``.
        read_ahead: ring buffers of the disk tier (>= 2; None: 3, or with ``host_budget`` what fits).
        cache_dir: cache root whose ``spill/`` directory takes spill files (None: as for the cache).
        cuda_graphs: ``True`` / ``"auto"``: on CUDA, replay each block phase from a captured CUDA graph
            (``poros.stream.graphs``; bitwise the eager kernels, without their host cost); blocks
            that cannot be captured run eagerly and ``PorosModel.executor.graphs.report`` says why.
            Off on CPU whatever the setting. Default ``False``.
        lora_placement: where the streamed blocks' LoRA parameters and gradients live between uses:
            ``"device"`` (default; None means it) or ``"host"`` (pinned; they come in with their block
            and the gradients go back after its last backward; layer-major ``forward_backward`` and
            ``poros.HostAdamW`` with ``placement=model.lora_placement`` only; bitwise the same). With
            ``vram_budget`` and ``"auto"`` the planner decides (host only when the budget needs it:
            the plan's ``lora_placement``); ``"auto"`` without a budget is ``"device"``.
        loss_chunks: the loss over this many token chunks, each chunk's fp32 working set recomputed
            in backward (``poros.stream.chunked_loss``; ``prepare`` installs it, ``unpatch`` removes
            it); 1: HF's own loss. With ``vram_budget`` the planner may raise it (and ``mlp_chunks``)
            when the budget cannot hold the step otherwise: the plan's ``loss_chunks``.
        mlp_chunks: each decoder block's MLP, norms and attention projections over this many sequence
            chunks in forward, recompute and backward, each saving only its input (``poros.stream.tiling``;
            ``prepare`` installs it, ``unpatch`` removes it): one chunk's ``batch x seq x intermediate_size``
            activations and one chunk's fp32 norm and LoRA input copies alive at a time;
            1: the MLP over the whole sequence. Bitwise a resident run with the same tiling
            (``poros.stream.tiling.tile_mlp``), not the untiled one.

    Raises:
        ConfigError: a value of the wrong kind or out of range; ``resident_blocks`` with
            ``vram_budget``. The message names the option and the fix.
    """

    num_slots: int = 2
    embeddings_on_host: bool | None = None
    require: str | None = None
    resident_blocks: int | tuple[int, ...] | None = None
    vram_budget: str | int | None = None
    workload: Workload | None = None
    boundary_states: str | None = None
    boundary_every: int | str | None = None
    optimizer_states: str = "auto"
    host_tier: str | None = None
    host_budget: str | int | None = None
    read_ahead: int | None = None
    cache_dir: str | None = None
    cuda_graphs: bool | str = False
    lora_placement: str = "device"
    loss_chunks: int = 1
    mlp_chunks: int = 1

    def __post_init__(self) -> None:
        normal = {"num_slots": 2 if self.num_slots is None else self.num_slots,
                  "lora_placement": self.lora_placement or "device",
                  "workload": None if self.workload is None else Workload.of(self.workload),
                  "resident_blocks": _resident_blocks(self.resident_blocks),
                  "cache_dir": None if self.cache_dir is None else os.fspath(self.cache_dir)}
        for name, value in normal.items():
            object.__setattr__(self, name, value)
        _check_counts(self)
        _check_choices(self)
        _check_budgets(self)

    # -- ways in -------------------------------------------------------------------------------
    @classmethod
    def from_keywords(cls, source: str = "prepare", **keywords: Any) -> "StreamOptions":
        """The options of ``source(**keywords)``; an unknown keyword fails by name, with the closest option.

        Raises:
            ConfigError: an unknown keyword, or an invalid value.
        """
        unknown = sorted(set(keywords) - set(option_names()))
        if unknown:
            close = difflib.get_close_matches(unknown[0], option_names(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{source}() got an unknown option {unknown[0]!r}{hint} The options are "
                              f"{', '.join(option_names())} (poros.stream.options.StreamOptions).")
        return cls(**keywords)

    @classmethod
    def from_config(cls, config: Any, *, schedule: str | None = None, **changes: Any) -> "StreamOptions":
        """The options of a :class:`~poros.config.PorosConfig`: every field that is also an option, by
        name, and the workload of its step (``batch_size``, ``seq_len``, ``grad_accum``, ``loss_chunks``
        and ``schedule``, by default the config's ``stream_schedule``); ``changes`` override any option.

        Raises:
            ConfigError: an unknown name in ``changes``, or an invalid value.
        """
        shared = {name: getattr(config, name) for name in option_names() if hasattr(config, name)}
        shared["workload"] = Workload(config.batch_size, config.seq_len, config.grad_accum,
                                      schedule or config.stream_schedule, config.loss_chunks,
                                      packed=bool(getattr(config, "packing", False)))
        return cls.from_keywords("StreamOptions.from_config", **{**shared, **changes})

    def replace(self, **changes: Any) -> "StreamOptions":
        """A copy with ``changes`` applied, checked like a new one.

        Raises:
            ConfigError: an unknown name, or an invalid value.
        """
        return self.from_keywords("StreamOptions.replace", **{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every option by name (the workload as itself)."""
        return {name: getattr(self, name) for name in option_names()}

    # -- what needs the model ----------------------------------------------------------------------
    def resident_indices(self, count: int) -> tuple[int, ...]:
        """``resident_blocks`` as block indices of a model of ``count`` blocks: an int N is the last N.

        Raises:
            ConfigError: a number above ``count`` or an index that is not a block of the model.
        """
        resident = self.resident_blocks
        if resident is None:
            return ()
        if isinstance(resident, int):
            if resident > count:
                raise ConfigError(f"resident_blocks={resident!r}: expected a number of blocks from 0 to {count} "
                                  "(the last ones stay on the device) or a list of block indices.")
            return tuple(range(count - resident, count))
        wrong = [i for i in resident if not i < count]
        if wrong:
            raise ConfigError(f"resident_blocks names {wrong}, not blocks of this model (indices 0..{count - 1}). "
                              "Pass indices in that range, or an int N for the last N blocks.")
        return resident

    def budget_workload(self) -> Workload:
        """The step ``vram_budget`` is planned for.

        Raises:
            ConfigError: no ``workload`` was given.
        """
        if self.workload is None:
            raise ConfigError(
                f"vram_budget={self.vram_budget!r} needs the step it plans for: the activations depend on it. Pass "
                "workload={'seq_len': 512, 'batch_size': 1} (and 'grad_accum', 'schedule' when accumulating).")
        return self.workload


def option_names() -> tuple[str, ...]:
    """The options, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(StreamOptions))


def keyword_parameters() -> list[inspect.Parameter]:
    """Every option as a keyword-only parameter with its default: the signature ``prepare(**options)`` shows."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                              annotation=f.type) for f in dataclasses.fields(StreamOptions)]


def check_cuda_graphs(value: Any) -> None:
    """Raise unless ``value`` is a ``cuda_graphs`` setting (True, False or ``"auto"``)."""
    if not (value is True or value is False or value == "auto"):
        raise ConfigError(f"cuda_graphs={value!r}: expected true, false or 'auto' (graphs on when the device is CUDA).")


def _resident_blocks(value: Any) -> int | tuple[int, ...] | None:
    """``resident_blocks`` as an int N >= 0, a sorted tuple of distinct indices, or None."""
    if value is None or (_integer(value) and value >= 0):
        return value
    items = list(value) if isinstance(value, Iterable) and not isinstance(value, (str, bytes)) else None
    if items is None or not all(_integer(i) and i >= 0 for i in items):
        raise ConfigError(f"resident_blocks={value!r}: expected a number of blocks >= 0 (the last ones stay on the "
                          "device) or a list of block indices >= 0.")
    return tuple(sorted(set(items)))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(options: StreamOptions) -> None:
    if not _integer(options.num_slots) or options.num_slots < 1:
        raise ConfigError(f"num_slots={options.num_slots!r}: expected an integer >= 1 (2 overlaps copy and compute).")
    if options.read_ahead is not None and (not _integer(options.read_ahead) or options.read_ahead < 2):
        raise ConfigError(f"read_ahead={options.read_ahead!r}: the disk tier needs at least 2 ring buffers (one "
                          "copying to the device, one being read). Pass 2 or more.")
    if not _integer(options.loss_chunks) or options.loss_chunks < 1:
        raise ConfigError(f"loss_chunks={options.loss_chunks!r}: expected an integer >= 1 (1: HF's own loss). Fix: "
                          "e.g. loss_chunks: 8.")
    if not _integer(options.mlp_chunks) or options.mlp_chunks < 1:
        raise ConfigError(f"mlp_chunks={options.mlp_chunks!r}: expected an integer >= 1 (1: the MLP over the whole "
                          "sequence). Fix: e.g. mlp_chunks: 8.")


def _check_choices(options: StreamOptions) -> None:
    if options.embeddings_on_host not in (None, True, False):
        raise ConfigError(f"embeddings_on_host={options.embeddings_on_host!r}: expected true, false or None (on "
                          "when the device is CUDA).")
    if options.require is not None and options.require not in REQUIRABLE:
        raise ConfigError(f"require={options.require!r}: expected 'numerical', 'bitwise' or None (accept any "
                          "guarantee label; docs/parity-modes.md).")
    if options.host_tier is not None and options.host_tier not in HOST_TIERS:
        raise ConfigError(f"host_tier={options.host_tier!r}: expected one of {', '.join(HOST_TIERS)}, or None to "
                          "let the host budget decide.")
    check_boundary_states(options.boundary_states)
    check_every(options.boundary_every)
    adamw_states.check(options.optimizer_states)
    adamw_states.check_lora(options.lora_placement)
    check_cuda_graphs(options.cuda_graphs)


def _check_budgets(options: StreamOptions) -> None:
    if options.vram_budget is not None:
        parse_budget(options.vram_budget)
        if options.resident_blocks is not None:
            raise ConfigError(f"resident_blocks={options.resident_blocks!r} with vram_budget={options.vram_budget!r}: "
                              "the budget planner chooses the resident blocks. Pass one of the two.")
    if options.host_budget is not None:
        parse_budget(options.host_budget, "host_budget")


__all__ = ["HOST_TIERS", "REQUIRABLE", "SCHEDULES", "StreamOptions", "Workload", "check_cuda_graphs",
           "keyword_parameters", "option_names"]

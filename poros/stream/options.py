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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from poros.errors import ConfigError
from poros.settings import HOST_TIERS, REQUIRABLE, SETTINGS, STREAMING, keyword_fields

SCHEDULES = ("micro-major", "layer-major")


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
        fused_loss: the head and the loss run as Liger's fused linear cross-entropy (``kernels: liger``,
            ``poros.dropin.kernels``): one chunk of logits at a time, the input gradient made in forward;
            ``loss_chunks`` then does not apply (it stays 1).

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
    fused_loss: bool = False

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
        raise ConfigError(f"workload={value!r}: expected a poros.plan.budget.Workload or a dict of its fields, "
                          "e.g. {'seq_len': 512, 'batch_size': 1}.")


@dataclass(frozen=True)
@keyword_fields
class StreamOptions:
    """Every option of a streamed run (``poros.prepare``'s keywords), frozen and checked.

    Build it from keywords, :meth:`from_keywords` (unknown names fail by name) or
    :meth:`from_config`; change it with :meth:`replace` (a new, checked object). Each option is a row
    of :data:`poros.settings.STREAMING` (its type, default, help and check); sizes are kept as written
    and in bytes (:attr:`vram_budget_bytes`, :attr:`host_budget_bytes`), parsed once here.

    Args:
        {settings}

    Raises:
        ConfigError: a value of the wrong kind or out of range; ``resident_blocks`` with
            ``vram_budget``; a ``workload`` whose ``loss_chunks`` differs from ``loss_chunks``. The
            message names the option and the fix.
    """

    def __post_init__(self) -> None:
        sizes = {}  # the size settings in bytes, parsed once, here
        for setting in STREAMING:
            value = getattr(self, setting.name)
            if setting.size:
                sizes[setting.name] = setting.to_bytes(value)
            else:
                setting.check(value)
            object.__setattr__(self, setting.name, setting.normalise(value))
        object.__setattr__(self, "_bytes", sizes)
        self._one_loss_chunks()
        if self.vram_budget is not None and self.resident_blocks is not None:
            raise ConfigError(f"resident_blocks={self.resident_blocks!r} with vram_budget={self.vram_budget!r}: "
                              "the budget planner chooses the resident blocks. Pass one of the two.")

    def _one_loss_chunks(self) -> None:
        """``loss_chunks`` has one value: the workload's is the option's (a workload's own, given without
        ``loss_chunks``, becomes the option)."""
        if self.workload is None:
            return
        workload = Workload.of(self.workload)
        chunks = self.loss_chunks
        if workload.loss_chunks != 1:
            if chunks not in (1, workload.loss_chunks):
                raise ConfigError(f"loss_chunks={chunks} with a workload of loss_chunks={workload.loss_chunks}: "
                                  "expected one value; pass loss_chunks alone (the workload follows it).")
            chunks = workload.loss_chunks
        object.__setattr__(self, "loss_chunks", chunks)
        object.__setattr__(self, "workload", dataclasses.replace(workload, loss_chunks=chunks))

    @property
    def vram_budget_bytes(self) -> int | None:
        """``vram_budget`` in bytes (None: no budget)."""
        return self._bytes["vram_budget"]

    @property
    def host_budget_bytes(self) -> int | None:
        """``host_budget`` in bytes (None: no limit)."""
        return self._bytes["host_budget"]

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
        shared["workload"] = step_of(config, schedule)
        return cls.from_keywords("StreamOptions.from_config", **{**shared, **changes})

    def replace(self, **changes: Any) -> "StreamOptions":
        """A copy with ``changes`` applied, checked like a new one.

        Raises:
            ConfigError: an unknown name, or an invalid value.
        """
        current = self.to_dict()
        if "loss_chunks" in changes and "workload" not in changes and self.workload is not None:
            current["workload"] = dataclasses.replace(self.workload, loss_chunks=changes["loss_chunks"])
        return self.from_keywords("StreamOptions.replace", **{**current, **changes})

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
    SETTINGS["cuda_graphs"].check(value)


def step_of(config: Any, schedule: str | None = None) -> dict[str, Any]:
    """The step a :class:`~poros.config.PorosConfig` trains, as :class:`Workload`'s fields: ``batch_size``,
    ``seq_len``, ``grad_accum``, ``loss_chunks``, ``packed`` (its ``packing``), ``fused_loss`` (its ``kernels``
    is ``liger``: Liger's fused linear cross-entropy) and ``schedule`` (by default its ``stream_schedule``). :func:`poros.plan.workload_of` and :meth:`StreamOptions.from_config` read it."""
    return {"batch_size": config.batch_size, "seq_len": config.seq_len, "grad_accum": config.grad_accum,
            "schedule": schedule or config.stream_schedule, "loss_chunks": config.loss_chunks,
            "packed": bool(getattr(config, "packing", False)),
            "fused_loss": getattr(config, "kernels", "default") == "liger"}


__all__ = ["HOST_TIERS", "REQUIRABLE", "SCHEDULES", "StreamOptions", "Workload", "check_cuda_graphs",
           "keyword_parameters", "option_names", "step_of"]

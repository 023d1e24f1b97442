"""Training: :class:`PorosTrainer`, one run of ``train()``, evaluation, experiment trackers,
training checkpoints, stopping on a signal, the run lock, progress lines and the checks run before any
weight is read (:mod:`~poros.training.validation`); the offline dry-run plan is the planner's
(:mod:`poros.plan.run_plan`).

May import: poros.dropin, poros.export, poros.plan, poros.loading, poros.stream, poros.data, and the core.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public names of the old ``poros.training`` module (now :mod:`poros.training.run`)
_RUN_NAMES = ("METRIC_FIELDS", "METRICS_FILE", "TrainingRun", "TrainResult", "stream_schedule")


def __getattr__(name: str) -> Any:
    if name in _RUN_NAMES:
        value = getattr(importlib.import_module("poros.training.run"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'poros.training' has no attribute {name!r}")

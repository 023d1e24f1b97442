"""What one run of ``train()`` reports: :class:`TrainResult` (what :meth:`PorosTrainer.train` returns),
the fields of every ``metrics.jsonl`` row (:data:`METRIC_FIELDS`), the peak memory a row records
(:func:`peak_memory`: CUDA's peak allocated bytes, else the process's peak RSS) and the window of steps a
logged throughput is measured over (:class:`ThroughputWindow`). :mod:`poros.training.run` fills them.
"""

from __future__ import annotations

import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from poros.training import evaluation


METRICS_FILE = "metrics.jsonl"
#: Every row of ``metrics.jsonl`` (and of ``TrainResult.log_history``) has these keys.
METRIC_FIELDS = ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "num_tokens",
                 "peak_memory_gb", "peak_memory_kind", "h2d_gb_per_s")


@dataclass
class TrainResult:
    """What :meth:`PorosTrainer.train` returns.

    Attributes:
        steps: optimizer steps done, counting those before a resumed checkpoint.
        losses: the loss of every step from step 1 (the sum of its micro-batch losses).
        final_loss: ``losses[-1]`` (None when no step ran).
        interrupted: True when SIGINT/SIGTERM stopped the run (a checkpoint was written).
        output_dir: where ``metrics.jsonl`` and the checkpoints are.
        last_checkpoint: the newest checkpoint this run wrote, or None.
        log_history: the rows written to ``metrics.jsonl`` (see :data:`METRIC_FIELDS`; evaluation rows:
            :data:`poros.training.evaluation.EVAL_METRIC_FIELDS`).
        eval_loss: the last evaluation's ``eval_loss`` (None without eval data).
    """

    steps: int
    losses: list[float]
    final_loss: float | None
    interrupted: bool
    output_dir: pathlib.Path
    last_checkpoint: pathlib.Path | None
    log_history: list[dict[str, Any]] = field(default_factory=list)
    eval_loss: float | None = None


def peak_memory(device: torch.device) -> tuple[float | None, str]:
    """``(GB, kind)``: CUDA's peak allocated bytes on a CUDA device, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, "cuda_max_allocated"
    try:
        import resource
    except ImportError:  # Windows
        return None, "unavailable"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024) / 1e9, "process_peak_rss"


@dataclass
class ThroughputWindow:
    """The steps since the last log line, for their throughput: when they began, and the run's token count
    and host-to-device bytes before them."""

    started: float  # time.perf_counter()
    first_tokens: int
    first_bytes: int

    def leave_out(self, seconds: float, bytes_copied: int) -> None:
        """Leave an evaluation's time and copies out of the window's throughput."""
        self.started += seconds
        self.first_bytes += bytes_copied


__all__ = ["METRICS_FILE", "METRIC_FIELDS", "ThroughputWindow", "TrainResult", "peak_memory"]

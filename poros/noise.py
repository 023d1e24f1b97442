"""Known third-party noise that says nothing to a Poros user: hidden by the CLI unless ``--verbose``.

Each entry is a message that every run prints and that needs no action:

* bitsandbytes' ``Failed to load CPU gemm_4bit_forward from kernels-community`` (a WARNING on its
  ``bitsandbytes.backends.cpu.ops`` logger when the optional ``kernels`` package is absent: the CPU
  falls back to bitsandbytes' own kernel, which is the one Poros's parity is gated on);
* transformers' ``is_gradient_checkpointing`` FutureWarning (PEFT reads the deprecated property
  while wrapping the model).

Only these exact messages are hidden; every other warning still shows.
"""

from __future__ import annotations

import logging
import warnings

#: (logger name, message start) of third-party log records hidden by default.
QUIET_LOG_RECORDS = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
)
#: (category, message regex) of third-party warnings hidden by default.
QUIET_WARNINGS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_noise(verbose: bool = False) -> None:
    """Hide :data:`QUIET_LOG_RECORDS` and :data:`QUIET_WARNINGS` for this process (nothing with ``verbose``)."""
    if verbose:
        return
    for category, pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, start in QUIET_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))


__all__ = ["QUIET_LOG_RECORDS", "QUIET_WARNINGS", "quiet_known_noise"]

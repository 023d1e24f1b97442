"""Known third-party noise that says nothing to a Poros user: hidden by the CLI unless ``--verbose``.

Each entry is a message that runs print and that needs no action:

* bitsandbytes' ``Failed to load CPU gemm_4bit_forward from kernels-community`` (a WARNING on its
  ``bitsandbytes.backends.cpu.ops`` logger when the optional ``kernels`` package is absent, printed
  as bitsandbytes is imported -- by ``poros doctor`` too: the CPU falls back to bitsandbytes' own
  kernel, which is the one Poros's parity is gated on);
* transformers' ``Token indices sequence length is longer than the specified maximum sequence length``
  (the tokenizer's ``model_max_length``; Poros cuts every example to ``seq_len`` itself);
* transformers' ``is_gradient_checkpointing`` FutureWarning (PEFT reads the deprecated property
  while wrapping the model);
* the progress bars of transformers (``Loading weights``) and huggingface_hub (downloads) when
  stderr is not a terminal: in a piped log each redraw is another line of carriage returns. On a
  terminal they stay.

Only these exact messages are hidden; every other warning still shows. :func:`quiet_known_noise`
imports nothing heavy (``poros doctor`` stays torch-free): a library that is not imported yet reads
``HF_HUB_DISABLE_PROGRESS_BARS`` when it is.

``import poros`` calls it too (:func:`quiet_on_import`), so a Python script sees what ``poros train``
shows; ``POROS_VERBOSE=1`` in the environment leaves everything shown, and
``quiet_known_noise(verbose=True)`` shows it again after the import (what ``--verbose`` does).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

#: (logger name, message start) of third-party log records hidden by default.
QUIET_LOG_RECORDS = (
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community"),
    ("transformers.tokenization_utils_base",
     "Token indices sequence length is longer than the specified maximum sequence length"),
)
#: (category, message regex) of third-party warnings hidden by default.
QUIET_WARNINGS = (
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
#: the variable huggingface_hub (and so transformers) reads for its progress bars
PROGRESS_BARS_VARIABLE = "HF_HUB_DISABLE_PROGRESS_BARS"
#: the variable that keeps ``import poros`` from hiding anything
VERBOSE_VARIABLE = "POROS_VERBOSE"
_set_progress_variable = False  # whether this process set PROGRESS_BARS_VARIABLE (and may unset it)


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_noise(verbose: bool = False, *, stream=None) -> None:
    """Hide :data:`QUIET_LOG_RECORDS`, :data:`QUIET_WARNINGS` and, when ``stream`` (default stderr) is not a
    terminal, the third-party progress bars, for this process; with ``verbose``, show them again (undo what an
    earlier call, ``import poros``'s included, hid)."""
    if verbose:
        _show_known_noise()
        return
    for category, pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, start in QUIET_LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.start == start for f in logger.filters):
            logger.addFilter(_DropMessage(start))
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        hide_progress_bars()


def _show_known_noise() -> None:
    global _set_progress_variable
    for category, pattern in QUIET_WARNINGS:
        warnings.filters[:] = [f for f in warnings.filters if not (f[0] == "ignore" and f[2] is category and f[1]
                                                                   is not None and f[1].pattern == pattern)]
    for name, start in QUIET_LOG_RECORDS:
        logger = logging.getLogger(name)
        for dropped in [f for f in logger.filters if isinstance(f, _DropMessage) and f.start == start]:
            logger.removeFilter(dropped)
    if _set_progress_variable:
        os.environ.pop(PROGRESS_BARS_VARIABLE, None)
        _set_progress_variable = False


def quiet_on_import() -> None:
    """What ``import poros`` runs: :func:`quiet_known_noise`, unless ``POROS_VERBOSE`` is set (not 0)."""
    quiet_known_noise(verbose=os.environ.get(VERBOSE_VARIABLE, "").strip() not in ("", "0"))


def hide_progress_bars() -> None:
    """No transformers or huggingface_hub progress bar in this process (and the processes it starts)."""
    global _set_progress_variable
    if PROGRESS_BARS_VARIABLE not in os.environ:
        os.environ[PROGRESS_BARS_VARIABLE] = "1"
        _set_progress_variable = True
    if "huggingface_hub" in sys.modules:  # imported already: its flag was read at import
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


__all__ = ["PROGRESS_BARS_VARIABLE", "QUIET_LOG_RECORDS", "QUIET_WARNINGS", "VERBOSE_VARIABLE", "hide_progress_bars",
           "quiet_known_noise", "quiet_on_import"]

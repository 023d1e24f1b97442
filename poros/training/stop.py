"""Stopping a run on SIGINT / SIGTERM: :class:`StopRequest` turns the first signal into a flag the
training loop checks after each optimizer step (which then writes a checkpoint); a second signal
aborts at once. Used by :class:`~poros.training.trainer.PorosTrainer` and ``poros train``."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

logger = logging.getLogger("poros")


class StopRequest:
    """Turns SIGINT/SIGTERM into a flag checked after each optimizer step; a second signal aborts."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    #: a repeat within this many seconds is the same request (torchrun forwards the Ctrl-C its ranks also got)
    REPEAT_S = 2.0

    def _handle(self, signal_number, frame) -> None:
        if self.signal_name is not None and time.monotonic() - self._first_at > self.REPEAT_S:
            self.restore()  # the second one: stop waiting for the step
            raise KeyboardInterrupt
        if self.signal_name is None:
            self.signal_name, self._first_at = signal.Signals(signal_number).name, time.monotonic()

    def __enter__(self) -> StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:
                    self._previous[number] = signal.signal(number, self._handle)
        else:
            logger.info("poros: train() runs outside the main thread: SIGINT/SIGTERM will not checkpoint")
        return self

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self.restore()


__all__ = ["StopRequest"]

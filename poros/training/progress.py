"""Progress on long work (training, evaluation): a tqdm bar on a terminal, plain lines when piped.

::

    bar = progress_bar(total=100, initial=0, unit="step", label="train")
    with showing(bar):                 # while shown, echo() prints above the bar
        for _ in range(100):
            ...
            bar.update(1)
            echo("step 10/100 | loss ...")

On a terminal the bar is tqdm's. When stdout is not a terminal (``poros train | tee log``, a
batch job, CI) a redrawn bar would fill the log with carriage returns, so :class:`PlainProgress`
prints a plain line instead -- ``train 40/100 steps (40%) | 1.52 s/step | 1m31s left`` -- after
the first step (the first rate and time left) and whenever ``interval`` seconds passed without any
line on stdout: a run that logs often gets no extra lines, a slow one still shows it is alive.

Torch-free; tqdm (a dependency of transformers) is imported only for a terminal.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

from poros.distributed import is_main_process

__all__ = ["PlainProgress", "echo", "progress_bar", "showing"]

#: the bars being shown, innermost last: :func:`echo` writes through it.
_SHOWN: list[Any] = []


def echo(text: str) -> None:
    """A line for the user on stdout (above the progress bar when one is shown); data parallel: rank 0's."""
    if not is_main_process():  # rank 0 speaks for the job
        return
    if _SHOWN:
        _SHOWN[-1].write(text)
    else:
        print(text, flush=True)


class PlainProgress:
    """Progress as plain lines on stdout, for output that is not a terminal.

    A line is printed after the first update (unless ``first_line`` is False) and whenever
    ``interval`` seconds passed since the last line on stdout (its own or one written through
    :meth:`write`, so a run that already logs often gets no extra lines).

    Args:
        total: the count at the end.
        initial: the count already done (a resumed run).
        unit: what is counted, singular (``"step"``, ``"batch"``).
        label: the first word of each line (``"train"``, ``"eval"``).
        first_line: print a line after the first update.
        interval: seconds without a line after which one is printed.
        clock: seconds, monotonic (``time.monotonic``).
    """

    def __init__(self, total: int, initial: int = 0, *, unit: str = "step", label: str = "", first_line: bool = True,
                 interval: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.initial, self.count, self.unit, self.label = total, initial, initial, unit, label
        self.first_line, self.interval, self.clock = first_line, interval, clock
        self.postfix: dict[str, Any] = {}
        self.started = self.last_line = clock()

    def update(self, n: int = 1) -> None:
        first = self.count == self.initial
        self.count += n
        if (first and self.first_line) or self.clock() - self.last_line >= self.interval:
            self._print(self.line())

    def set_postfix(self, **values: Any) -> None:
        """Values shown at the end of each line (``loss=7.5455``), as tqdm's ``set_postfix``."""
        self.postfix = values

    def line(self) -> str:
        """``train 40/100 steps (40%) | 1.52 s/step | 1m31s left | loss 7.5455``."""
        done = self.count - self.initial
        elapsed = self.clock() - self.started
        parts = [f"{self.label} {self.count}/{self.total} {self.unit}s ({100 * self.count / max(self.total, 1):.0f}%)"
                 .lstrip()]
        if done > 0:
            per_unit = elapsed / done
            parts.append(f"{per_unit:.2f} s/{self.unit}" if per_unit >= 1 else f"{1 / max(per_unit, 1e-9):.2f} "
                         f"{self.unit}s/s")
            parts.append(f"{_duration(per_unit * max(self.total - self.count, 0))} left")
        parts += [f"{key} {value}" for key, value in self.postfix.items()]
        return " | ".join(parts)

    def write(self, text: str) -> None:
        self._print(text)

    def close(self) -> None:
        pass

    def _print(self, text: str) -> None:
        if is_main_process():  # data parallel: rank 0 speaks for the job
            print(text, file=sys.stdout, flush=True)
        self.last_line = self.clock()


def _duration(seconds: float) -> str:
    """``91`` -> ``1m31s``; ``3725`` -> ``1h02m``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def progress_bar(total: int, initial: int = 0, *, unit: str = "step", label: str = "", nested: bool = False) -> Any:
    """tqdm's bar when stdout is a terminal, else a :class:`PlainProgress`.

    Args:
        nested: a bar inside another (evaluation inside training): tqdm's disappears when closed;
            the plain one prints by time only (no first line).
    """
    if not sys.stdout.isatty() or not is_main_process():  # data parallel: the plain one, silent off rank 0
        return PlainProgress(total, initial, unit=unit, label=label, first_line=not nested)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit=unit, desc=label or None, dynamic_ncols=True, file=sys.stdout,
                leave=not nested)


@contextlib.contextmanager
def showing(bar: Any) -> Iterator[Any]:
    """While inside, :func:`echo` writes through ``bar``; the bar is closed on the way out."""
    _SHOWN.append(bar)
    try:
        yield bar
    finally:
        _SHOWN.remove(bar)
        bar.close()

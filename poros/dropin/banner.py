"""The one line that says Poros took effect, on stderr: ``poros.prepare``, ``prepare_trainer`` and
``PorosCallback`` print it, as HF's Trainer prints its own banner, so a user's script shows it without
configuring any logger::

    poros: streaming qwen3: 28 of 28 decoder blocks from the host (pinned) through 2 device slots on
    cuda:0; guarantee bitwise

With Liger's kernels on the model (``kernels: liger``, ``use_liger_kernel=True``) it ends with what Liger
patched (``; kernels liger (rms_norm x57, swiglu x28, rope, fused linear cross-entropy)``), or, for a family
Liger has no kernels for, why it patched nothing (``; kernels liger not applied: liger-kernel 0.8.5 has no
kernels for model type ...``).

The detail (family provider, adapters, platform, the reason for the label) stays on the ``poros``
logger at INFO, and on ``PorosModel.detection``. ``PorosTrainer`` prints that detail itself and
silences the line (:func:`silenced`); under data parallel only rank 0 prints it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from typing import Any

from poros.distributed import is_main_process

_SILENCED: contextvars.ContextVar[bool] = contextvars.ContextVar("poros_banner_silenced", default=False)


def determinism(platform_class: str, deterministic_algorithms: bool) -> str:
    """What the run's kernels promise, in words: torch's deterministic-algorithms switch chooses kernels on CUDA
    only; the CPU kernels a run uses are run-to-run deterministic whatever it says."""
    if not platform_class.startswith("cuda"):
        return "deterministic (CPU kernels; torch's deterministic-algorithms switch only matters on CUDA)"
    return f"deterministic algorithms {'on' if deterministic_algorithms else 'off'}"


def banner_line(model: Any) -> str:
    """The line for a prepared model: family, the blocks streamed and from where, the guarantee label."""
    store = model.store
    total = len(store.blocks)
    streamed = sum(not block.resident for block in store.blocks)
    tier = getattr(getattr(model, "host_plan", None), "tier", None) or "pinned"
    resident = f", {total - streamed} resident on the device" if streamed < total else ""
    slots = f" through {store.num_slots} device slot{'' if store.num_slots == 1 else 's'}" if streamed else ""
    detection = model.detection
    label = f"; guarantee {detection.guarantee}" if detection is not None else ""
    kernels = f"; kernels {detection.kernels}" if detection is not None and detection.kernels else ""
    return (f"poros: streaming {model.descriptor.name}: {streamed} of {total} decoder blocks from the host "
            f"({tier}){slots} on {store.device}{resident}{label}{kernels}")


def announce(model: Any) -> None:
    """Print :func:`banner_line` on stderr (rank 0; not inside :func:`silenced`)."""
    if _SILENCED.get() or not is_main_process():
        return
    print(banner_line(model), file=sys.stderr, flush=True)


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """No banner inside: for callers that report the detection themselves (``PorosTrainer``)."""
    token = _SILENCED.set(True)
    try:
        yield
    finally:
        _SILENCED.reset(token)


__all__ = ["announce", "banner_line", "determinism", "silenced"]

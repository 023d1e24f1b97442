"""Which device a run computes on: :func:`resolve_device` turns the ``device`` option (``"auto"``,
None, ``"cuda"``, ``"cuda:1"``, ``"cpu"``) into a ``torch.device`` -- the one rule the trainer, the
loader, the planner's dry run, the bench, the CLI and :mod:`poros.training.validation` share -- and, asked to
``check``, refuses a CUDA device this machine cannot use before anything is loaded;
:func:`compute_device` reads the device off a model; :func:`cpu_threads` is the ``cpu_threads`` rule. torch is imported inside the functions
(``poros plan``'s parser imports this module); :mod:`poros.errors` is the only other import."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from poros.errors import DeviceError

if TYPE_CHECKING:
    import torch


def resolve_device(device: Any = "auto", *, with_index: bool = False, check: bool = False) -> "torch.device":
    """``"auto"`` or None -> CUDA when available, else CPU; anything else as ``torch.device``.

    Args:
        device: ``"auto"``, None, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        with_index: a bare ``cuda`` gets the index of the current CUDA device (``cuda:0``), as the
            loader's ``device_map`` and the bench's generators need.
        check: raise when a CUDA device is not available here (a run about to use it); without it the
            device is named, not used (a plan for a CUDA run is made on any machine).

    Raises:
        DeviceError: with ``check``, a CUDA device on a torch built without CUDA, with no visible
            GPU, or with fewer GPUs than the index asks for.
    """
    import torch

    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    named = str(device)
    resolved = torch.device(device)
    if check and resolved.type == "cuda":
        _check_cuda(named, resolved)
    if with_index and resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _check_cuda(named: str, resolved: "torch.device") -> None:
    """Raise :class:`DeviceError` unless this torch can compute on ``resolved`` here."""
    import torch

    fix = "Fix: pass --device cpu (or auto), or run where a CUDA build of torch sees a GPU."
    if torch.version.cuda is None:
        raise DeviceError(f"--device {named}: this torch {torch.__version__} is built without CUDA; expected a CUDA "
                          f"build (pip install torch --index-url https://download.pytorch.org/whl/cu128). {fix}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceError(f"--device {named}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, or no driver). "
                          f"{fix}")
    if resolved.index is not None and resolved.index >= count:
        raise DeviceError(f"--device {named}: only {count} GPU(s) are visible (cuda:0..cuda:{count - 1}). Fix: pass "
                          f"--device cuda:0 .. cuda:{count - 1}.")


#: ``cpu_threads: auto`` takes one thread on the CPU for a model narrower than this hidden size: its
#: ops are too small to share between threads (``python -m tools.bench.cpu_threads`` measures the crossing).
ONE_THREAD_BELOW_HIDDEN = 1024


def cpu_threads(setting: int | str, device: "torch.device", hidden_size: int) -> int | None:
    """The torch CPU thread count for the ``cpu_threads`` option, or None to leave torch's own.

    ``"auto"``: 1 on the CPU below :data:`ONE_THREAD_BELOW_HIDDEN`, unless ``OMP_NUM_THREADS`` is set
    (the user chose); None otherwise. An integer is taken as it is."""
    if setting != "auto":
        return int(setting)
    if device.type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    return 1 if hidden_size < ONE_THREAD_BELOW_HIDDEN else None


def compute_device(module: Any) -> "torch.device":
    """The device ``module`` computes on: the one it is marked with (``poros_compute_device``: a streamed
    model's store device, or :func:`poros.from_pretrained`'s mark), else its first trainable parameter's, else
    its first parameter's. The mark comes first: a streamed model may keep its adapters on the host
    (``lora_placement="host"``) and its embedding table on either side, so no parameter tells."""
    marked = getattr(module, "poros_compute_device", None)
    if marked is not None:
        return marked
    trainable = [p for p in module.parameters() if p.requires_grad]
    if trainable:
        return trainable[0].device
    return next(module.parameters()).device


def same_device(asked: "torch.device", compute: "torch.device") -> bool:
    """Whether two devices are one (``cuda`` with no index names the current CUDA device)."""
    import torch

    if asked.type != compute.type:
        return False
    if asked.type != "cuda":  # one host: ``cpu`` and ``cpu:0`` (accelerate's ranks on the CPU) are the same
        return True
    if asked.index is None or compute.index is None:
        current = torch.cuda.current_device() if asked.type == "cuda" and torch.cuda.is_available() else None
        return (asked.index if asked.index is not None else current) == (
            compute.index if compute.index is not None else current)
    return asked.index == compute.index


__all__ = ["ONE_THREAD_BELOW_HIDDEN", "compute_device", "cpu_threads", "resolve_device", "same_device"]

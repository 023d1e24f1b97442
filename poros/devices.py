"""Which device a run uses, checked to exist before anything is loaded.

One small module (torch and :mod:`poros.errors` only) so that the trainer, the planner, the CLI
and :mod:`poros.validation` resolve a device the same way without importing each other.
"""

from __future__ import annotations

import os

import torch

from poros.errors import DeviceError


def resolve_device(device: str, *, check: bool = True) -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else as ``torch.device``.

    Args:
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        check: raise when a CUDA device is not available here; False names a target without using
            it (a plan for a CUDA run is made on any machine).

    Raises:
        DeviceError: with ``check``, a CUDA device on a torch built without CUDA, with no visible
            GPU, or with fewer GPUs than the index asks for.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type != "cuda" or not check:
        return resolved
    fix = "Fix: pass --device cpu (or auto), or run where a CUDA build of torch sees a GPU."
    if torch.version.cuda is None:
        raise DeviceError(f"--device {device}: this torch {torch.__version__} is built without CUDA; expected a CUDA "
                          f"build (pip install torch --index-url https://download.pytorch.org/whl/cu128). {fix}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise DeviceError(f"--device {device}: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}, or no driver). "
                          f"{fix}")
    if resolved.index is not None and resolved.index >= count:
        raise DeviceError(f"--device {device}: only {count} GPU(s) are visible (cuda:0..cuda:{count - 1}). Fix: pass "
                          f"--device cuda:0 .. cuda:{count - 1}.")
    return resolved


__all__ = ["resolve_device"]

"""Which device a run computes on: :func:`resolve_device` turns the ``device`` option (``"auto"``,
None, ``"cuda"``, ``"cuda:1"``, ``"cpu"``) into a ``torch.device`` -- the one rule the trainer, the
loader, the planner's dry run and the bench share -- and :func:`compute_device` reads it off a model.
torch is imported inside the functions (``poros plan``'s parser imports this module)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def resolve_device(device: Any = "auto", *, with_index: bool = False) -> "torch.device":
    """``"auto"`` or None -> CUDA when available, else CPU; anything else as ``torch.device``.

    Args:
        with_index: a bare ``cuda`` gets the index of the current CUDA device (``cuda:0``), as the
            loader's ``device_map`` and the bench's generators need.
    """
    import torch

    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if with_index and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def compute_device(module: Any) -> "torch.device":
    """The device ``module`` computes on: its first trainable parameter's, else its first parameter's."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if trainable:
        return trainable[0].device
    return next(module.parameters()).device


__all__ = ["compute_device", "resolve_device"]

"""``lora_placement="host"``: each streamed block's LoRA parameters and gradients travel with the block.

::

    host (pinned slab)                          device
     block i: LoRA A/B (+ .grad) ──on fetch(i)──▶ device copies, bound to the parameters
                                  ◀─on release(i)─ .grad copied back (the parameters did not change)
     optimizer step: HostAdamW brings parameter + gradient + AdamW state of a chunk in, steps, writes
                     parameter and state back (the same kernels as torch's AdamW)

Notable features:

* **Hooks on the store, not the engine.** :class:`LoraPlacement` is a store observer: the store calls
  ``on_fetch(i)`` when block i's frozen bytes are queued for the device and ``on_release(i)`` when
  they are evicted, for forward, recompute and backward alike. Each parameter's ``.data`` (and
  ``.grad``) is pointed at a device copy while its block is on the device and at its host tensor
  otherwise: between steps, every streamed block's LoRA tensors live on the host.
* **Exact copies, the same sums.** Copies change no bit. A gradient is accumulated on the device
  (``AccumulateGrad``'s own ``+=``, micro-batch 0 first, as resident) while the block is there, so
  it goes back to the host once per step in layer-major accumulation: after the block's last backward.
  A gradient already on the host (accumulation over several ``forward_backward`` calls) comes
  back in with its block and keeps accumulating on the device.
* **Layer-major only.** In the micro-major schedule autograd holds views of each block's
  parameters from forward to backward; :meth:`LoraPlacement.check_forward` refuses it.
* **Resident blocks keep their adapters on the device**, as do adapters outside the blocks.
* **Clipping**: :func:`clip_grad_norm_` is ``torch.nn.utils.clip_grad_norm_`` with the per-tensor norms
  computed on the compute device (the kernels of the resident run), a chunk of gradients at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from poros.errors import ConfigError
from poros.stream.pinned_slab import PinnedSlab, expected_bytes


class LoraPlacement:
    """Keeps the trainable parameters of a store's streamed blocks on the host between their uses.

    Args:
        store: the :class:`~poros.stream.store.BlockStore`; the placement registers as its observer.
        pin_memory: pin the host tensors (default: when the store's device is CUDA).

    Attributes:
        device: the compute device (where parameters are stepped and used).
        stats: ``{"in": parameter tensors brought in, "grads_out": gradients sent back}`` (no timing).
    """

    def __init__(self, store: Any, *, pin_memory: bool | None = None) -> None:
        self.store, self.device = store, store.device
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        #: block index -> its trainable parameters (streamed blocks only)
        self.parameters: dict[int, list[nn.Parameter]] = {}
        self.host: dict[int, torch.Tensor] = {}  # id(parameter) -> its host tensor
        self.host_grad: dict[int, torch.Tensor] = {}  # id(parameter) -> a host buffer for its gradient
        self.on_device: set[int] = set()  # blocks whose parameters are bound to device copies now
        self.accumulating = False  # inside PorosModel.forward_backward (see check_forward)
        self.stats = {"in": 0, "grads_out": 0}
        for record in store.blocks:
            if not record.resident:
                self.parameters[record.index] = [p for p in record.module.parameters() if p.requires_grad]
        # the host tensors at their own size (no power-of-two rounding): each parameter's value and gradient
        self.slab = PinnedSlab(self.pin_memory, expected=expected_bytes(
            [p for ps in self.parameters.values() for p in ps], copies=2))
        for parameters in self.parameters.values():
            for parameter in parameters:
                self.host[id(parameter)] = self._to_host(parameter.data)
                self.bind(parameter, self.host[id(parameter)],
                           None if parameter.grad is None else self._to_host(parameter.grad))
        store.observers.append(self)

    # -- where a parameter lives -------------------------------------------------------------------
    def travels(self, parameter: torch.Tensor) -> bool:
        """Whether ``parameter``'s home is the host (it is a streamed block's adapter)."""
        return id(parameter) in self.host

    def home(self, parameter: torch.Tensor) -> torch.Tensor:
        """The host tensor ``parameter`` is bound to between uses."""
        return self.host[id(parameter)]

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.slab.empty(tensor.shape, tensor.dtype).copy_(tensor)

    @staticmethod
    def bind(parameter: nn.Parameter, data: torch.Tensor, grad: torch.Tensor | None) -> None:
        parameter.grad = None  # a parameter's gradient must sit on its device: unbind it first
        parameter.data = data
        parameter.grad = grad

    # -- the store's observer ----------------------------------------------------------------------
    def on_fetch(self, index: int) -> None:
        """Block ``index`` is coming in: its parameters (and gradients, if any) too, on the compute stream."""
        if index not in self.parameters or index in self.on_device:
            return
        for parameter in self.parameters[index]:
            grad = parameter.grad
            device_grad = None if grad is None else grad.to(self.device, non_blocking=True, copy=True)
            self.bind(parameter, self.host[id(parameter)].to(self.device, non_blocking=True, copy=True), device_grad)
            self.stats["in"] += 1
        self.on_device.add(index)

    def on_wait(self, index: int) -> None:
        """Nothing to wait for: the copies were queued on the compute stream itself."""

    def on_release(self, index: int) -> None:
        """Block ``index`` leaves: parameters back to their (unchanged) host tensors, gradients copied out."""
        if index not in self.on_device:
            return
        for parameter in self.parameters[index]:
            grad = parameter.grad
            host_grad = None
            if grad is not None:
                host_grad = self.host_grad.get(id(parameter))
                if host_grad is None or host_grad.shape != grad.shape or host_grad.dtype != grad.dtype:
                    host_grad = self.slab.empty(grad.shape, grad.dtype)
                    self.host_grad[id(parameter)] = host_grad
                if host_grad.data_ptr() != grad.data_ptr():
                    host_grad.copy_(grad, non_blocking=True)
                self.stats["grads_out"] += 1
            self.bind(parameter, self.host[id(parameter)], host_grad)
        self.on_device.discard(index)

    # -- the schedule ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulation(self) -> Iterator[None]:
        """Marks a layer-major ``forward_backward`` (the only schedule whose forward may build a graph)."""
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False

    def check_forward(self) -> None:
        """Refuse a forward that builds a graph outside layer-major accumulation.

        Raises:
            ConfigError: a micro-major training forward (grad enabled) with the LoRA tensors on the host.
        """
        if torch.is_grad_enabled() and not self.accumulating:
            raise ConfigError("lora_placement='host' and a forward with grad outside forward_backward: the LoRA "
                              "tensors travel with their block only in layer-major accumulation. Train through "
                              "PorosModel.forward_backward(micro_batches) (PorosTrainer: stream_schedule "
                              "layer-major), run this forward under torch.no_grad(), or prepare with "
                              "lora_placement='device'.")

    def restore(self) -> None:
        """Every parameter back on the compute device for good (``unpatch``); the observer is removed."""
        for index in list(self.on_device):
            self.on_release(index)
        for parameters in self.parameters.values():
            for parameter in parameters:
                grad = parameter.grad
                self.bind(parameter, parameter.data.to(self.device, copy=True),
                           None if grad is None else grad.to(self.device, copy=True))
        if self in self.store.observers:
            self.store.observers.remove(self)
        self.parameters, self.host, self.host_grad = {}, {}, {}


def grad_norm(parameters: Iterable[torch.Tensor], device: torch.device | str,
              chunk_bytes: int = 32 * 2**20) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` (norm 2) of the parameters' gradients, computed on ``device``.

    Gradients that live on the host are brought in a chunk at a time; the per-tensor norms use the
    kernels torch uses on ``device`` (``torch._foreach_norm`` where supported, else ``vector_norm``
    per tensor), grouped by dtype in parameter order as torch groups them, and the total is torch's
    stack-and-norm on ``device``: the resident run's numbers when every gradient lives there.
    """
    device = torch.device(device)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms: list[torch.Tensor] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for group in by_dtype.values():
        start = 0
        while start < len(group):
            end, size = start, 0
            while end < len(group) and (end == start or size < chunk_bytes):
                size += group[end].numel() * group[end].element_size()
                end += 1
            tensors = [g.to(device, non_blocking=True) for g in group[start:end]]
            if torch.utils._foreach_utils._has_foreach_support(tensors, device):
                norms.extend(torch._foreach_norm(tensors, 2.0))
            else:
                norms.extend(torch.linalg.vector_norm(g, 2.0) for g in tensors)
            start = end
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, device: torch.device | str,
                    chunk_bytes: int = 32 * 2**20) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(parameters, max_norm)`` (norm 2) for gradients that may live on the host.

    The total norm is :func:`grad_norm`'s (the resident run's); each gradient is then scaled where
    it lives by torch's clip coefficient (an elementwise multiply: one rounding on any device).
    Returns the total norm, as torch does.
    """
    parameters = list(parameters)
    total_norm = grad_norm(parameters, device, chunk_bytes)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return total_norm
    clip_coef_clamped = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for where, group in by_device.items():
        coef = clip_coef_clamped.to(where)  # a host gradient: waits for the copies that sent it back
        if torch.utils._foreach_utils._has_foreach_support(group, where):
            torch._foreach_mul_(group, coef)
        else:
            for grad in group:
                grad.mul_(coef)
    return total_norm

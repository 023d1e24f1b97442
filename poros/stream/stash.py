"""Layer-major's boundary states in host memory: :class:`HostStash` (the executor's ``boundary_states="host"``)."""

from __future__ import annotations

from typing import Any

import torch


class HostStash:
    """Layer-major boundary states in host memory (pinned on CUDA), moved on their own stream.

    ``put`` starts copying a state to the host right after the compute stream made it (the device
    memory is reused only once the copy is done: ``record_stream``); ``fetch`` starts bringing one
    back into a tensor allocated on the compute stream; ``take`` makes the compute stream wait for
    it. Copies are exact: what comes back is bit for bit what went out. On CPU the "host" is the
    device: the same bookkeeping, plain copies (what the tests exercise).
    """

    def __init__(self, device: torch.device, stream=None) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.stream = stream
        self.host: dict[Any, torch.Tensor] = {}
        self.back: dict[Any, tuple[torch.Tensor, Any]] = {}

    def put(self, key, tensor: torch.Tensor) -> None:
        if not self.on_cuda:
            self.host[key] = tensor.clone()
            return
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)  # same strides: bitwise-same layout back
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self.stream)
        self.host[key] = host

    def fetch(self, key) -> None:
        if key in self.back:
            return
        host = self.host.pop(key)
        if not self.on_cuda:
            self.back[key] = (host, None)
            return
        compute = torch.cuda.current_stream(self.device)
        tensor = torch.empty_like(host, device=self.device)
        self.stream.wait_stream(compute)  # the memory's earlier readers are done
        with torch.cuda.stream(self.stream):
            tensor.copy_(host, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        tensor.record_stream(self.stream)  # freed untaken (an exception): not reused under the copy
        self.back[key] = (tensor, arrived)

    def take(self, key) -> torch.Tensor:
        self.fetch(key)
        tensor, arrived = self.back.pop(key)
        if arrived is not None:
            torch.cuda.current_stream(self.device).wait_event(arrived)
        return tensor


__all__ = ["HostStash"]

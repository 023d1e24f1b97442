"""Layer-major's boundary states off the device: in host memory, :class:`HostStash` (the executor's
``boundary_states="host"``), or in files, :class:`DiskStash` (``boundary_states="disk"``, for a host that
cannot hold the M x L states)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
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


class DiskStash:
    """Layer-major boundary states in files, one per state, in a directory of their own under
    ``spill_dir`` (the cache's ``spill/``), read back in backward and deleted as they are read.

    ``put`` brings a state to the host (on CUDA a synchronous copy on the side stream) and writes it
    with ``torch.save`` (storage, shape, strides and dtype as they are: what comes back is bit for
    bit what went out, in the same layout); ``fetch`` reads it back (on CUDA through pinned memory,
    a non-blocking copy on the side stream, as :class:`HostStash`); ``take`` waits for it.
    :meth:`close` removes the directory and whatever is still in it: the executor calls it after the
    step and when the step fails, so nothing is left behind. Host RAM: one state at a time.
    """

    def __init__(self, device: torch.device, stream=None, spill_dir: str | os.PathLike | None = None) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.stream = stream
        root = Path(spill_dir) if spill_dir is not None else Path(os.environ.get("TMPDIR", tempfile.gettempdir()))
        root.mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=f"boundary-{os.getpid()}-{uuid.uuid4().hex[:8]}-", dir=root))
        self.files: dict[Any, Path] = {}
        self.back: dict[Any, tuple[torch.Tensor, Any]] = {}

    def _path(self, key) -> Path:
        return self.directory / ("-".join(str(part) for part in (key if isinstance(key, tuple) else (key,))) + ".pt")

    def put(self, key, tensor: torch.Tensor) -> None:
        if self.on_cuda:
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)  # same strides
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.stream)
            self.stream.synchronize()  # the bytes are on the host before they are written
        else:
            host = tensor.detach()
        if host.untyped_storage().nbytes() > host.numel() * host.element_size():
            host = host.clone()  # a view: save its own values, not the storage it shares
        path = self._path(key)
        torch.save(host, path)
        self.files[key] = path

    def fetch(self, key) -> None:
        if key in self.back:
            return
        path = self.files.pop(key)
        host = torch.load(path, weights_only=True, map_location="cpu")
        path.unlink()
        if not self.on_cuda:
            self.back[key] = (host, None)
            return
        pinned = host.pin_memory()
        compute = torch.cuda.current_stream(self.device)
        tensor = torch.empty_like(pinned, device=self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            tensor.copy_(pinned, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.stream)
        tensor.record_stream(self.stream)
        self.back[key] = (tensor, arrived)

    take = HostStash.take  # the state back on the device, once its copy has arrived

    def close(self) -> None:
        """Remove the directory and every state still in it (a failed step's), and forget them."""
        self.files.clear()
        self.back.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


__all__ = ["DiskStash", "HostStash"]

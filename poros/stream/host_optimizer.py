"""``HostAdamW``: torch's AdamW with its state in (pinned) host memory, stepped on the device chunk by chunk.

::

    host (pinned)                         device
     chunk 0: exp_avg, exp_avg_sq ──copy──▶ ┐ step chunk 0 (torch.optim.adam.adam, the group's flags)
     chunk 1 ──────────(copy stream)──────▶ │ ◀── prefetched while chunk 0 steps
     ...       ◀──────write back───────────┘ step chunk 1 ...

Notable features:

* **The same kernels, the same bits.** Each chunk is stepped by torch's own functional
  ``torch.optim.adam.adam`` with the flags of the param group (``foreach`` / ``fused`` /
  ``capturable`` left to torch's defaults exactly as a resident ``torch.optim.AdamW`` over the same
  parameters would pick them: the choice depends on the parameters' device and dtype, not on how
  many there are). AdamW is elementwise, so stepping a subset of the tensors at a time changes no
  bit of any tensor; ``tests/test_host_optimizer.py`` checks that with ``torch.equal``.
* **A chunk is about a decoder block's worth of state** (``chunk_bytes``): the device holds at most
  three chunks of state (the one stepping, the one prefetched, the one being written back)
  instead of ``8 B`` per trainable value (plus the foreach path's full-size temporaries).
* **It is a ``torch.optim.AdamW``** (a subclass): param groups, schedulers, ``state_dict`` /
  ``load_state_dict`` and the saved file are torch's own format, so HF Trainer and PorosTrainer
  checkpoints resume either way (the saved state tensors are CPU tensors; torch's loader casts them
  to wherever the loading optimizer keeps them). ``load_state_dict`` puts the state straight into
  host memory, never the whole state on the device.
* **Gradients, parameters and clipping do not move**: ``clip_grad_norm_`` runs on the device
  gradients before ``step()``, exactly as with the resident optimizer. With ``placement`` (a
  :class:`~poros.stream.lora_placement.LoraPlacement`, ``lora_placement="host"``) the parameters
  whose home is the host travel with their state instead: parameter, gradient and state of a chunk
  come in on the copy stream, are stepped on the device, and parameter and state go back.
* On CPU (tests, CI) the same code runs with a real copy per fetch and per write-back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.adam import adam

from poros.errors import ConfigError
from poros.stream.optimizer_states import DEFAULT_CHUNK_BYTES
from poros.stream.pinned_slab import PinnedSlab, expected_bytes


class HostAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose ``exp_avg`` / ``exp_avg_sq`` (and a device ``step``) live on the host.

    Args:
        params, lr, betas, eps, weight_decay, amsgrad, maximize, foreach, capturable, fused: as
            ``torch.optim.AdamW`` (same defaults, same meaning, same choice of kernels).
        chunk_bytes: device state bytes stepped at a time (rounded up to whole parameters).
        pin_memory: pin the host state (default: when a parameter is on CUDA).
        placement: the :class:`~poros.stream.lora_placement.LoraPlacement` of a ``lora_placement="host"``
            model: the parameters it keeps on the host are stepped on its device, a chunk at a time.

    Note:
        Between steps ``optimizer.state[p]`` holds host tensors; :meth:`state_dict` waits for the
        last write-back first. ``differentiable=True`` is not supported (it would need the state
        on the device for autograd).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, fused: bool | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin_memory: bool | None = None,
                 placement: Any = None) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=False, fused=fused)
        self.chunk_bytes = int(chunk_bytes)
        self.pin_memory = pin_memory
        self.placement = placement
        self._copy_streams: dict[torch.device, Any] = {}  # one side stream per CUDA device
        self._slabs: dict[bool, PinnedSlab] = {}  # pinned or not -> where the host state is carved from

    # -- construction from what HF Trainer builds ---------------------------------------------------
    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.AdamW, **options: Any) -> HostAdamW:
        """The same param groups, hyper-parameters and state as ``optimizer``, with the state on the host.

        Use it on the optimizer HF ``Trainer`` builds (its decay / no-decay groups, its
        ``adamw_torch`` / ``adamw_torch_fused`` flags)::

            trainer = transformers.Trainer(model=model, args=args, ...)
            trainer.optimizer = poros.HostAdamW.from_optimizer(trainer.create_optimizer())

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.AdamW``.
        """
        if not isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("differentiable"):
            raise TypeError(f"HostAdamW.from_optimizer takes a torch.optim.AdamW (not differentiable); found "
                            f"{type(optimizer).__name__}. Build the optimizer with optim='adamw_torch' or "
                            "'adamw_torch_fused', or construct poros.HostAdamW(params, ...) directly.")
        defaults = {key: optimizer.defaults[key] for key in
                    ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "fused")}
        host = cls([{**group, "params": list(group["params"])} for group in optimizer.param_groups], **defaults,
                   **options)
        if optimizer.state:
            host.load_state_dict(optimizer.state_dict())
        return host

    # -- where state lives ------------------------------------------------------------------------
    def _on_device(self, group: dict, key: str) -> bool:
        """True for the state tensors the resident AdamW keeps beside the parameter (all but a host ``step``)."""
        return key != "step" or bool(group["fused"] or group["capturable"])

    def _pin(self, param: torch.Tensor) -> bool:
        if self.pin_memory is not None:
            return self.pin_memory
        return self._device(param).type == "cuda"

    def _travels(self, param: torch.Tensor) -> bool:
        return self.placement is not None and self.placement.travels(param)

    def _device(self, param: torch.Tensor) -> torch.device:
        """Where ``param`` is stepped: the placement's device for a parameter whose home is the host."""
        return self.placement.device if self._travels(param) else param.device

    def _host_copy(self, value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """An empty host tensor shaped like ``value`` (pinned when the parameter is on CUDA), at its own size:
        carved from a :class:`~poros.stream.pinned_slab.PinnedSlab`, not rounded up to a power of two."""
        pin = self._pin(param)
        if pin not in self._slabs:  # sized for exp_avg, exp_avg_sq (max_exp_avg_sq) of each parameter pinned alike
            expected = sum(expected_bytes([p for p in group["params"] if self._pin(p) == pin],
                                          3 if group["amsgrad"] else 2) for group in self.param_groups)
            self._slabs[pin] = PinnedSlab(pin, expected=expected)
        return self._slabs[pin].empty(value.shape, value.dtype)

    def _copy_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]

    def wait_for_write_back(self) -> None:
        """Block the host until every state write-back enqueued so far has landed in host memory."""
        for stream in self._copy_streams.values():
            stream.synchronize()

    # -- the step ---------------------------------------------------------------------------------
    def _chunks(self, group: dict) -> Iterator[list[torch.Tensor]]:
        chunk, size = [], 0
        for param in group["params"]:
            if param.grad is None:
                continue
            chunk.append(param)
            size += 2 * param.numel() * param.element_size()
            if size >= self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk

    def _fetch(self, group: dict, chunk: list[torch.Tensor]) -> tuple[dict, dict, Any]:
        """Device copies of the chunk's host state (and of travelling parameters and gradients), enqueued
        on the copy stream (or copied now on CPU)."""
        device = self._device(chunk[0])
        stream = self._copy_stream(device)
        fetched, travelling = {}, {}
        if stream is not None and any(self._travels(param) for param in chunk):
            stream.wait_stream(torch.cuda.current_stream(device))  # gradients sent back by the compute stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for param in chunk:
                if self._travels(param):
                    travelling[param] = (torch.empty_like(param, device=device).copy_(param, non_blocking=True),
                                         torch.empty_like(param.grad, device=device).copy_(param.grad,
                                                                                           non_blocking=True))
                host_state = self.state.get(param)
                if not host_state:
                    continue
                fetched[param] = {
                    key: (torch.empty_like(value, device=device).copy_(value, non_blocking=True)
                          if isinstance(value, torch.Tensor) and self._on_device(group, key) else value)
                    for key, value in host_state.items()
                }
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
        return fetched, travelling, ready

    def _write_back(self, group: dict, chunk: list[torch.Tensor], host_states: dict, homes: dict) -> None:
        """Copy the chunk's stepped device state (and travelling parameters) into their host tensors;
        ``self.state`` and the parameters point at the host again."""
        device = self._device(chunk[0])
        stream = self._copy_stream(device)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for param in chunk:
                device_state = self.state[param]
                host_state = host_states.get(param, {})
                for key, value in device_state.items():
                    if not (isinstance(value, torch.Tensor) and self._on_device(group, key)):
                        host_state[key] = value
                        continue
                    if key not in host_state:  # state created by this step
                        host_state[key] = self._host_copy(value, param)
                    host_state[key].copy_(value, non_blocking=True)
                    if stream is not None:
                        value.record_stream(stream)
                self.state[param] = host_state
                if param in homes:
                    stepped = param.data
                    home, host_grad = homes[param]
                    home.copy_(stepped, non_blocking=True)
                    if stream is not None:
                        stepped.record_stream(stream)
                    self.placement.bind(param, home, host_grad)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient, a chunk of state at a time on the device."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.placement is not None and self.placement.on_device:
            # A block still on the device (a forward_backward that stopped half-way): send it home first,
            # or the step would update its device copies and the release after it would bind the stale
            # host tensors back (the update lost).
            self.placement.store.release_all()
        for group in self.param_groups:
            chunks = list(self._chunks(group))
            pending = self._fetch(group, chunks[0]) if chunks else None
            for index, chunk in enumerate(chunks):
                fetched, travelling, ready = pending
                pending = self._fetch(group, chunks[index + 1]) if index + 1 < len(chunks) else None
                device = self._device(chunk[0])
                if ready is not None:
                    torch.cuda.current_stream(device).wait_event(ready)
                homes = {}
                for param, (data, grad) in travelling.items():  # step the device copies
                    if device.type == "cuda":
                        data.record_stream(torch.cuda.current_stream(device))
                        grad.record_stream(torch.cuda.current_stream(device))
                    homes[param] = (param.data, param.grad)
                    self.placement.bind(param, data, grad)
                host_states = {}
                for param, device_state in fetched.items():
                    if device.type == "cuda":  # allocated on the copy stream, used on the compute stream
                        for value in device_state.values():
                            if isinstance(value, torch.Tensor) and value.device == device:
                                value.record_stream(torch.cuda.current_stream(device))
                    host_states[param] = self.state[param]
                    self.state[param] = device_state
                self._step_chunk({**group, "params": chunk})
                self._write_back(group, chunk, host_states, homes)
        if self.placement is not None:  # the next forward (and a save) reads the parameters' host copies
            self.wait_for_write_back()
        return loss

    def _step_chunk(self, group: dict) -> None:
        # the body of torch.optim.Adam.step for one param group (torch 2.13), over the chunk's parameters
        params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
        beta1, beta2 = group["betas"]
        has_complex = self._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                       state_steps)
        adam(params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
             amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
             foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
             fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
             found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])

    # -- saving and loading -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW ``state_dict`` (the state tensors are the host copies, after the last write-back)."""
        self.wait_for_write_back()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's AdamW ``load_state_dict``, with the state cast to each parameter's dtype in host memory."""
        saved_state = state_dict["state"]
        self.wait_for_write_back()  # no copy may still write the host state this drops
        super().load_state_dict({**state_dict, "state": {}})  # validates and loads the groups
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        groups = {id(param): group for group in self.param_groups for param in group["params"]}
        params = [param for group in self.param_groups for param in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            if saved_id not in saved_state:
                continue
            group = groups[id(param)]
            host_state = {}
            for key, value in saved_state[saved_id].items():
                if not isinstance(value, torch.Tensor):
                    host_state[key] = value
                elif key == "step":  # torch keeps step float32 (on the device only when fused/capturable)
                    step = value.to(dtype=torch.float32) if self._on_device(group, key) else value.clone()
                    host_state[key] = self._host_copy(step, param).copy_(step) if self._on_device(group, key) else step
                else:
                    cast = value.to(dtype=param.dtype) if param.is_floating_point() else value
                    host_state[key] = self._host_copy(cast, param).copy_(cast)
            self.state[param] = host_state


def adamw(parameters, *, optimizer_states: str = "device", **options: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(parameters, **options)``, or :class:`HostAdamW` when ``optimizer_states`` is ``"host"``."""
    parameters = list(parameters)
    if optimizer_states == "host":
        return HostAdamW(parameters, **options)
    if options.pop("placement", None) is not None:
        raise ConfigError("lora_placement='host' needs optimizer_states='host': the LoRA parameters live on the host "
                          "and poros.HostAdamW brings them in to step. Set optimizer_states: host.")
    return torch.optim.AdamW(parameters, **options)

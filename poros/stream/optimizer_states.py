"""Where AdamW's state lives, in device bytes: beside the LoRA parameters, or in host memory (``HostAdamW``).

Torch-free arithmetic for the planner (``poros plan``, ``prepare(vram_budget=...)``) and the name
of the choice (``PorosConfig.optimizer_states``). The optimizer itself is
:class:`poros.stream.host_optimizer.HostAdamW`.
"""

from __future__ import annotations

from collections.abc import Callable

from poros.errors import ConfigError

#: Where AdamW's ``exp_avg`` / ``exp_avg_sq`` live: ``"device"`` (torch.optim.AdamW) or ``"host"`` (HostAdamW).
OPTIMIZER_STATES = ("device", "host")
#: HostAdamW's state bytes per chunk: about one decoder block of r16 all-linear LoRA at 72B shape.
DEFAULT_CHUNK_BYTES = 32 * 2**20
#: Chunks of state on the device at once in HostAdamW: the one stepping, the next arriving, the last leaving.
CHUNKS_IN_FLIGHT = 3


def persistent_bytes(lora_parameter_bytes: int, *, states_on_host: bool) -> tuple[str, int]:
    """The LoRA parameters and, unless on the host, AdamW's two state tensors (fp32 each), all step long."""
    if states_on_host:
        return ("LoRA parameters (AdamW state on the host)", lora_parameter_bytes)
    return ("LoRA parameters + AdamW state", 3 * lora_parameter_bytes)


def step_bytes(lora_parameter_bytes: int, *, states_on_host: bool,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[tuple[str, int]]:
    """The optimizer step's transient device bytes: the gradients and AdamW's working copies.

    Resident: torch's foreach AdamW makes one more full copy (``exp_avg_sq``'s square root).
    On the host: the chunks in flight (both states) and that copy of one chunk.
    """
    lora = lora_parameter_bytes
    if not states_on_host:
        return [("LoRA gradients", lora), ("AdamW temporary", lora)]
    in_flight = min(2 * lora, CHUNKS_IN_FLIGHT * chunk_bytes) + min(lora, chunk_bytes // 2)
    return [("LoRA gradients", lora), (f"AdamW state chunks in flight ({CHUNKS_IN_FLIGHT}) + temporary", in_flight)]


def check(value: str) -> None:
    """Raise unless ``value`` is ``"device"``, ``"host"`` or ``"auto"`` (the budget planner decides).

    Raises:
        ConfigError: anything else.
    """
    if value not in ("auto", *OPTIMIZER_STATES):
        raise ConfigError(f"optimizer_states={value!r}: expected 'device', 'host' or 'auto' (the budget decides).")


def choose(requested: str, fits_with_states_on_device: Callable[[], bool]) -> str:
    """``requested`` unless ``"auto"``; then ``"device"`` when the plan fits with the states there, else ``"host"``.

    The planner asks with the ring asked for, nothing resident and the boundary states wherever they
    may go: a slot saves every copy's wait, while the host state costs two copies of 8 B per LoRA
    value per step on the side stream.
    """
    if requested != "auto":
        return requested
    return "device" if fits_with_states_on_device() else "host"


def host_note(state_size: str, *, asked: bool, num_slots: int) -> str:
    """The budget plan's note for AdamW's state on the host (``state_size``: its bytes, formatted)."""
    return (f"AdamW state on the host ({state_size} in pinned memory, stepped a chunk at a time by HostAdamW, "
            "bitwise torch's AdamW) " + ("as asked" if asked else
                                         f"because {num_slots} slots do not fit the budget with it on the device"))


def resolve(configured: str, planned: str | None) -> str:
    """``PorosConfig.optimizer_states`` for a run: ``"auto"`` takes the budget plan's choice (device without one)."""
    if configured != "auto":
        return configured
    return planned or "device"

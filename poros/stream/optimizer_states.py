"""Where AdamW's state (and the streamed blocks' LoRA tensors) live, in device bytes.

AdamW's state: beside the LoRA parameters, or in host memory (``HostAdamW``). The LoRA parameters and
gradients of the streamed blocks: on the device all step, or on the host, travelling with their block
(``lora_placement="host"``, :mod:`poros.stream.lora_placement`). Torch-free arithmetic for the planner
(``poros plan``, ``prepare(vram_budget=...)``) and the names of the choices
(``PorosConfig.optimizer_states``, ``PorosConfig.lora_placement``).
"""

from __future__ import annotations

from collections.abc import Callable

from poros.errors import ConfigError
from poros.settings import LORA_PLACEMENTS, OPTIMIZER_STATES, SETTINGS

#: HostAdamW's state bytes per chunk: about one decoder block of r16 all-linear LoRA at 72B shape.
DEFAULT_CHUNK_BYTES = 32 * 2**20
#: Chunks of state on the device at once in HostAdamW: the one stepping, the next arriving, the last leaving.
CHUNKS_IN_FLIGHT = 3


def persistent_bytes(lora_parameter_bytes: int, *, states_on_host: bool) -> tuple[str, int]:
    """The LoRA parameters and, unless on the host, AdamW's two state tensors (fp32 each), all step long."""
    if states_on_host:
        return ("LoRA parameters (AdamW state on the host)", lora_parameter_bytes)
    return ("LoRA parameters + AdamW state", 3 * lora_parameter_bytes)


def lora_parts(lora_parameter_bytes: int, num_blocks: int, streamed: int, slots: int, *, states_on_host: bool,
               lora_on_host: bool) -> tuple[int, list[tuple[str, int]], int]:
    """``(LoRA bytes that stay on the device, the persistent parts, the streamed gradients in backward)``.

    With the LoRA tensors on the host only the adapters outside the streamed blocks stay (the
    streamed blocks' share is taken as uniform: ``lora / num_blocks`` each); the blocks in the
    slots hold their parameters, and the block in backward its gradients too (no block has any at the
    head's turn: a block's gradients leave with it). Without: 0 streamed gradients (all are in ``staying``).
    """
    if not lora_on_host:
        return lora_parameter_bytes, [persistent_bytes(lora_parameter_bytes, states_on_host=states_on_host)], 0
    per_block = lora_parameter_bytes // max(num_blocks, 1)
    staying = lora_parameter_bytes - per_block * streamed
    return staying, [persistent_bytes(staying, states_on_host=states_on_host),
                     (f"LoRA parameters of the blocks in the {slots} slots (the rest on the host)",
                      slots * per_block)], per_block


def step_bytes(lora_parameter_bytes: int, *, states_on_host: bool, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
               staying: int | None = None) -> list[tuple[str, int]]:
    """The optimizer step's transient device bytes: the gradients and AdamW's working copies.

    Resident: torch's foreach AdamW makes one more full copy (``exp_avg_sq``'s square root).
    On the host: the chunks in flight (both states) and that copy of one chunk. ``staying``: the
    LoRA bytes left on the device with the LoRA tensors on the host (their chunks carry parameters
    and gradients too, twice the state bytes).
    """
    lora = lora_parameter_bytes
    if staying is not None:
        in_flight = min(4 * lora, 2 * CHUNKS_IN_FLIGHT * chunk_bytes) + min(lora, chunk_bytes // 2)
        return [("LoRA gradients (adapters outside the streamed blocks)", staying),
                (f"LoRA + AdamW state chunks in flight ({CHUNKS_IN_FLIGHT}) + temporary", in_flight)]
    if not states_on_host:
        return [("LoRA gradients", lora), ("AdamW temporary", lora)]
    in_flight = min(2 * lora, CHUNKS_IN_FLIGHT * chunk_bytes) + min(lora, chunk_bytes // 2)
    return [("LoRA gradients", lora), (f"AdamW state chunks in flight ({CHUNKS_IN_FLIGHT}) + temporary", in_flight)]


def check(value: str) -> None:
    """Raise unless ``value`` is ``"device"``, ``"host"`` or ``"auto"`` (the budget planner decides).

    Raises:
        ConfigError: anything else.
    """
    SETTINGS["optimizer_states"].check(value)


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


def check_lora(value: str | None) -> None:
    """Raise unless ``value`` is None, ``"device"``, ``"host"`` or ``"auto"`` (the budget planner decides).

    Raises:
        ConfigError: anything else.
    """
    SETTINGS["lora_placement"].check(value)


def choose_lora(requested: str, states: str, layer_major: bool, fits_on_device: Callable[[], bool]) -> str:
    """``lora_placement`` for a plan: ``"host"`` as asked (layer-major with AdamW's state on the host
    only), ``"auto"`` the host only when those hold and the plan does not fit with the LoRA tensors
    on the device.

    Raises:
        ConfigError: an unknown value, or ``"host"`` with the state on the device or micro-major.
    """
    check_lora(requested)
    if requested == "host" and (states != "host" or not layer_major):
        raise ConfigError(f"lora_placement='host' needs AdamW's state on the host (planned: {states!r}) and the "
                          "layer-major schedule. Set optimizer_states: host and stream_schedule: layer-major, or "
                          "lora_placement: auto.")
    if requested != "auto":
        return requested
    return "host" if states == "host" and layer_major and not fits_on_device() else "device"


def lora_note(lora_size: str, *, asked: bool) -> str:
    """The budget plan's note for the LoRA tensors on the host (``lora_size``: the streamed blocks' share)."""
    return (f"LoRA parameters and gradients on the host ({lora_size} of the streamed blocks in pinned memory; each "
            "block's come in with it and its gradients go back after its last backward; bitwise the same) "
            + ("as asked" if asked else "because the plan does not fit with them on the device"))

"""Does an adapter fit this base? Its LoRA shapes against the base's layers, before a weight is read.

An adapter trained on another base (another size of the family, a base of another width) used to
get as far as PEFT's ``load_state_dict`` and fail there with a size mismatch per tensor, thousands of
characters in one line. Here the adapter's ``lora_A`` / ``lora_B`` shapes come from its safetensors
header (no tensor read) and the base's linear layers from a skeleton the base's config builds on the
meta device (no weight read), and a mismatch is one line::

    the adapter in ./run was trained on a base with hidden size 64, this base (./small128) has 128
    (model.layers.0.self_attn.q_proj: the adapter's lora_A takes 64 features, the base's layer 128) ...

``poros merge`` and ``poros generate`` (through :func:`poros.dropin.with_adapter.load_with_adapter`)
run it first.
"""

from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

from poros.errors import CheckpointLoadError

#: the prefix PEFT's ``save_pretrained`` puts before a causal LM's module paths
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdaptedShape:
    """What an adapter's tensors say about the linear layer they adapt.

    Attributes:
        module: the module path in the causal LM (``model.layers.0.self_attn.q_proj``).
        in_features: ``lora_A``'s second dimension.
        out_features: ``lora_B``'s first dimension.
    """

    module: str
    in_features: int
    out_features: int


def read_safetensors_header(path: pathlib.Path) -> dict[str, Any]:
    """The header of an adapter's safetensors file (name -> dtype, shape, offsets), without reading a tensor;
    the file's size is checked against the bytes the header lists (a truncated copy is found here, not in
    safetensors' "incomplete metadata" deep in a merge).

    Raises:
        CheckpointLoadError: the file is too short, its header is not JSON, or it holds fewer or more bytes
            than its header lists.
    """
    fix = ("Fix: copy the adapter directory again, or save it again (poros train writes it at the end of a run; "
           "its checkpoint-N directories hold earlier copies).")
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except (OSError, struct.error, ValueError) as error:
        raise CheckpointLoadError(f"{path} is not a readable safetensors file ({type(error).__name__}: "
                                  f"{str(error)[:120]}); expected the adapter_model.safetensors PEFT writes. "
                                  + fix) from error
    header.pop("__metadata__", None)
    listed = 8 + length + max((int(entry["data_offsets"][1]) for entry in header.values()
                               if isinstance(entry, dict) and "data_offsets" in entry), default=0)
    if size != listed:
        raise CheckpointLoadError(f"{path} is {'truncated' if size < listed else 'longer than its header says'}: "
                                  f"its header lists {listed} bytes, the file has {size}. " + fix)
    return header


def adapted_shapes(weights: pathlib.Path) -> list[AdaptedShape]:
    """Every module the adapter file adapts with LoRA A/B, with the features its tensors take and give."""
    header = read_safetensors_header(weights)
    shapes = []
    for name, entry in header.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        partner = header.get(name.removesuffix("lora_A.weight") + "lora_B.weight")
        if partner is None or len(entry["shape"]) != 2 or len(partner["shape"]) != 2:
            continue  # not a linear's LoRA (merge and PEFT say what they make of it)
        shapes.append(AdaptedShape(module, int(entry["shape"][1]), int(partner["shape"][0])))
    return sorted(shapes, key=lambda shape: shape.module)


def base_linear_shapes(text_config: Any) -> dict[str, tuple[int, int]]:
    """``module path -> (in_features, out_features)`` of every linear of the causal LM ``text_config``
    builds, on the meta device (no memory, no weights)."""
    import torch
    import transformers
    from torch import nn

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(text_config)
    return {name: (module.in_features, module.out_features) for name, module in skeleton.named_modules()
            if isinstance(module, nn.Linear)}


def check_adapter_fits(adapter: pathlib.Path, weights: pathlib.Path, base: str, text_config: Any) -> None:
    """Refuse an adapter whose LoRA shapes do not fit the base ``text_config`` describes.

    Modules the skeleton does not have are left alone (a multimodal checkpoint's names are mapped
    later, and merge names a module it finds no weight for).

    Raises:
        CheckpointLoadError: an adapted module's features differ from the base layer's: the message
            names the hidden size each was trained for when that is the difference, the module and
            both shapes otherwise, and the fix (the base it was trained on).
    """
    expected = base_linear_shapes(text_config)
    hidden = getattr(text_config, "hidden_size", None)
    for shape in adapted_shapes(weights):
        found = expected.get(shape.module)
        if found is None or found == (shape.in_features, shape.out_features):
            continue
        base_in, base_out = found
        fix = ("Fix: pass --model (model= in Python) the base this adapter was trained on (its poros_config.json or "
               "adapter_config.json names it), or train an adapter on this base.")
        if hidden is not None and (base_in == hidden and shape.in_features != base_in
                                   or base_out == hidden and shape.out_features != base_out):
            side, trained = ("lora_A takes", shape.in_features) if base_in == hidden and shape.in_features != base_in \
                else ("lora_B gives", shape.out_features)
            raise CheckpointLoadError(
                f"the adapter in {adapter} was trained on a base with hidden size {trained}, this base ({base}) has "
                f"{hidden} ({shape.module}: the adapter's {side} {trained} features, the base's layer {hidden}). "
                + fix)
        raise CheckpointLoadError(
            f"the adapter in {adapter} does not fit this base ({base}): its {shape.module} maps "
            f"{shape.in_features} -> {shape.out_features} features, the base's layer {base_in} -> {base_out}; it "
            "was trained on a base of another size. " + fix)


#: bytes read at each of three places (start, middle, end) of every weight file for :func:`base_identity`
IDENTITY_SAMPLE_BYTES = 1 << 16
#: the key of ``poros_config.json`` that records the base's identity when the adapter is saved
BASE_IDENTITY_KEY = "base_identity"


def base_identity(weight_files: list[pathlib.Path]) -> str:
    """A fingerprint of a base checkpoint's weights, cheap at any size: sha256 over each weight file's name,
    size, safetensors header and three samples of its data (start, middle, end). Two bases of the same
    shapes (a model and its fine-tune, another seed) differ in every tensor, so in the samples too."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(weight_files, key=lambda path: path.name):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}:".encode())
        with open(path, "rb") as handle:
            for offset in (0, max(size // 2 - IDENTITY_SAMPLE_BYTES // 2, 0), max(size - IDENTITY_SAMPLE_BYTES, 0)):
                handle.seek(offset)
                digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
    return digest.hexdigest()


def check_base_identity(adapter: pathlib.Path, base: str, weight_files: list[pathlib.Path]) -> None:
    """Refuse a base whose weights are not the ones the adapter was trained on, where the adapter recorded them
    (``poros_config.json``'s :data:`BASE_IDENTITY_KEY`, written by ``PorosTrainer.save``; an adapter without it
    is not checked).

    Raises:
        CheckpointLoadError: the fingerprints differ (same shapes, other weights: merged, another model).
    """
    record_file = adapter / "poros_config.json"
    try:
        recorded = json.loads(record_file.read_text(encoding="utf-8")).get(BASE_IDENTITY_KEY)
    except (OSError, ValueError, AttributeError):
        return
    if not recorded or not weight_files:
        return
    found = base_identity(weight_files)
    if found != recorded.get("sha256"):
        raise CheckpointLoadError(
            f"the adapter in {adapter} was trained on {recorded.get('model')} (weights {recorded.get('sha256', '')[:12]}), "
            f"and the base given, {base}, holds other weights of the same shapes ({found[:12]}): with it the adapter "
            "would make another model than the one trained. Fix: pass --model (model= in Python) the base it was "
            "trained on.")


def check_adapter_base(info: Any, *, revision: str | None = None) -> None:
    """:func:`check_adapter_fits` for an adapter :func:`poros.loading.load.read_adapter` found: the base it
    names is resolved (a hub id from the HF cache or downloaded, as loading would) and its config read.

    Raises:
        CheckpointLoadError: as :func:`check_adapter_fits`, and when the base cannot be found.
    """
    from poros.errors import PorosError
    from poros.loading.load import inspect_checkpoint, read_config, resolve_checkpoint

    directory = resolve_checkpoint(info.base_model, revision=revision)
    _, text_config = read_config(directory)
    check_adapter_fits(info.path, info.weights, info.base_model, text_config)
    try:
        weight_files = inspect_checkpoint(directory, allow_pickle=True).weight_files
    except PorosError:
        return  # loading names what is wrong with the base
    check_base_identity(info.path, info.base_model, weight_files)


__all__ = ["BASE_IDENTITY_KEY", "IDENTITY_SAMPLE_BYTES", "AdaptedShape", "adapted_shapes", "base_identity",
           "base_linear_shapes", "check_adapter_base", "check_adapter_fits", "check_base_identity",
           "read_safetensors_header"]

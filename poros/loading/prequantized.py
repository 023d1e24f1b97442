"""Pre-quantized bitsandbytes 4-bit checkpoints (the ``*-bnb-4bit`` repos most users download).

Such a checkpoint is what ``save_pretrained`` writes for a model loaded with
``BitsAndBytesConfig(load_in_4bit=True, ...)``: ``config.json`` holds ``quantization_config``
(``quant_method: bitsandbytes``, ``bnb_4bit_quant_type``, ``bnb_4bit_use_double_quant``,
``bnb_4bit_quant_storage``, ``llm_int8_skip_modules``) and every quantized linear ``X`` has::

    X.weight                                  the packed 4-bit values (uint8, or the quant storage dtype), [n, 1]
    X.weight.absmax                           per-64-value scales (uint8 with double quantization, else fp32)
    X.weight.quant_map                        the 16-value code table (fp32)
    X.weight.nested_absmax, .nested_quant_map the scales of the scales (double quantization only)
    X.weight.quant_state.bitsandbytes__nf4    the rest of the QuantState as JSON bytes (shape, blocksize, dtype...)

Those are the very bytes the block store streams: transformers turns them into ``Params4bit``
(``Params4bit.from_prequantized``) without a quantize pass and without a bf16 copy, and Poros keeps
every decoder block's tensors on the host as they load (:mod:`poros.loading.load`). This module
reads what the config says (:func:`read_prequantized`) and checks, from the safetensors headers and
the small JSON states only, that every tensor the load needs is there (:func:`check_tensors`), so a
damaged or partial download fails in one line naming the missing key instead of deep inside
transformers (or, worse, loading packed bytes as a weight).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

from poros.errors import CheckpointLoadError

#: the 4-bit quant types bitsandbytes has and Poros streams
QUANT_TYPES = ("nf4", "fp4")
#: what each packed weight ``X.weight`` needs beside it (plus ``quant_state.bitsandbytes__<type>``)
COMPANIONS = ("absmax", "quant_map")
NESTED_COMPANIONS = ("nested_absmax", "nested_quant_map")
QUANT_STATE_PREFIX = "quant_state.bitsandbytes__"
FIX = ("Download the checkpoint again (`hf download REPO`), or start from its bf16 source (Poros quantizes it on "
       "load; `poros quantize` writes a bnb-4bit copy).")


@dataclass(frozen=True)
class Prequantized:
    """What a pre-quantized checkpoint's ``quantization_config`` says.

    Attributes:
        quant_type: ``"nf4"`` or ``"fp4"``.
        double_quant: ``bnb_4bit_use_double_quant`` (the scales are quantized too).
        compute_dtype: ``bnb_4bit_compute_dtype`` (``"bfloat16"``...).
        quant_storage: ``bnb_4bit_quant_storage``: the dtype the packed values are stored as.
        skip_modules: ``llm_int8_skip_modules``: modules kept unquantized (Unsloth's "dynamic" repos keep
            some block linears in bf16); empty when the config names none.
        config: the ``quantization_config`` dict as the checkpoint holds it.
    """

    quant_type: str
    double_quant: bool
    compute_dtype: str
    quant_storage: str
    skip_modules: tuple[str, ...]
    config: dict[str, Any]

    def describe(self) -> str:
        """``pre-quantized (nf4, double quant)``: the words the load and the detection line use."""
        return f"pre-quantized ({self.quant_type}{', double quant' if self.double_quant else ''})"

    def quantized_linears(self, model) -> dict[str, Any]:
        """The linears of ``model`` (a meta skeleton) stored 4-bit in this checkpoint, by name: transformers'
        own rule (``replace_with_bnb_linear``) with this checkpoint's ``llm_int8_skip_modules``."""
        from torch import nn
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module

        keep = HfQuantizer.get_modules_to_not_convert(model, list(self.skip_modules) or None,
                                                      getattr(model, "_keep_in_fp32_modules", None))
        return {name: module for name, module in model.named_modules()
                if type(module) is nn.Linear and should_convert_module(name, keep)}


def quantization_config_of(config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a transformers config (or config dict) as a dict, None without one."""
    found = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                       None)
    if found is None:
        return None
    return dict(found) if isinstance(found, dict) else found.to_dict()


def read_prequantized(config: Any, where: str | pathlib.Path) -> Prequantized | None:
    """What ``config``'s ``quantization_config`` says, or None for an unquantized checkpoint.

    Args:
        config: the checkpoint's transformers config (a multimodal config holds it at the top level).
        where: the checkpoint, for the messages.

    Raises:
        CheckpointLoadError: quantized by another method (GPTQ, AWQ, FP8...), bitsandbytes 8-bit, or a
            4-bit quant type other than nf4/fp4.
    """
    found = quantization_config_of(config)
    if found is None:
        return None
    method = str(found.get("quant_method", "bitsandbytes"))
    if method != "bitsandbytes":
        raise CheckpointLoadError(
            f"{where}: config.json says quantization_config.quant_method={method!r}; Poros streams bitsandbytes "
            f"4-bit checkpoints (quant_method 'bitsandbytes', load_in_4bit) or unquantized ones. Use the model's "
            f"bf16 release or its *-bnb-4bit one.")
    if found.get("load_in_8bit") or found.get("_load_in_8bit"):
        raise CheckpointLoadError(
            f"{where}: an 8-bit bitsandbytes checkpoint (quantization_config.load_in_8bit=true); Poros streams 4-bit "
            f"bases (nf4/fp4). Use the model's bf16 release (quantized on load) or a *-bnb-4bit checkpoint, or "
            f"write one with `poros quantize BF16_CHECKPOINT OUT`.")
    if not (found.get("load_in_4bit") or found.get("_load_in_4bit")):
        raise CheckpointLoadError(
            f"{where}: quantization_config is bitsandbytes but says neither load_in_4bit nor load_in_8bit; expected "
            f"a 4-bit checkpoint as save_pretrained writes it. {FIX}")
    quant_type = str(found.get("bnb_4bit_quant_type", "fp4"))
    if quant_type not in QUANT_TYPES:
        raise CheckpointLoadError(
            f"{where}: quantization_config.bnb_4bit_quant_type={quant_type!r}; Poros streams the 4-bit types "
            f"{' and '.join(QUANT_TYPES)}. Use the model's bf16 release or an nf4 *-bnb-4bit checkpoint.")
    skip = found.get("llm_int8_skip_modules") or ()
    return Prequantized(
        quant_type=quant_type, double_quant=bool(found.get("bnb_4bit_use_double_quant", False)),
        compute_dtype=str(found.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch."),
        quant_storage=str(found.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch."),
        skip_modules=tuple([skip] if isinstance(skip, str) else skip), config=found)


def _headers(weight_files: list[pathlib.Path]) -> dict[str, tuple[str, pathlib.Path, list[int]]]:
    """Every tensor of the shards: key -> (dtype, file, shape), from the safetensors headers alone."""
    from safetensors import safe_open

    found = {}
    for file in weight_files:
        with safe_open(file, framework="pt") as shard:
            for key in shard.keys():
                piece = shard.get_slice(key)
                found[key] = (piece.get_dtype(), file, list(piece.get_shape()))
    return found


def _quant_state(file: pathlib.Path, key: str) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as shard:
        raw = bytes(shard.get_tensor(key).numpy().tobytes())
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointLoadError(f"{file.name}: {key} is not a bitsandbytes quant state (its bytes are not JSON: "
                                  f"{exc}). {FIX}") from exc


def check_tensors(weight_files: list[pathlib.Path], prequantized: Prequantized, where: str | pathlib.Path,
                  ) -> dict[str, list[int]]:
    """Check that every packed weight has what transformers needs to rebuild it; return their shapes.

    Reads the safetensors headers and each ``quant_state.bitsandbytes__*`` JSON (a few hundred bytes
    per linear), no weight.

    Returns:
        ``{weight key: [out_features, in_features]}`` of every packed weight, from its quant state (the
        header holds the packed shape ``[n, 1]``), for the shape check against ``config.json``.

    Raises:
        CheckpointLoadError: a packed weight without one of its companions (absmax, quant_map, the quant
            state, the nested tensors of a double-quant checkpoint) or a companion without its weight; a
            quant state of another type than the config's; one that is not JSON.
    """
    headers = _headers(weight_files)
    companion_suffixes = (*COMPANIONS, *NESTED_COMPANIONS)
    packed: set[str] = set()
    for key in headers:
        head, _, tail = key.rpartition(".weight.")
        if head and (tail in companion_suffixes or tail.startswith(QUANT_STATE_PREFIX)):
            packed.add(f"{head}.weight")
    needed = [*COMPANIONS, f"{QUANT_STATE_PREFIX}{prequantized.quant_type}",
              *(NESTED_COMPANIONS if prequantized.double_quant else ())]
    missing, wrong_type = [], []
    for weight in sorted(packed):
        if weight not in headers:
            missing.append(weight)
        missing.extend(f"{weight}.{name}" for name in needed if f"{weight}.{name}" not in headers)
        other = [k for k in (f"{weight}.{QUANT_STATE_PREFIX}{t}" for t in QUANT_TYPES if t != prequantized.quant_type)
                 if k in headers]
        wrong_type.extend(other)
    if wrong_type:
        raise CheckpointLoadError(
            f"{where}: {wrong_type[0]} is a {wrong_type[0].rpartition('__')[2]} quant state but config.json says "
            f"bnb_4bit_quant_type={prequantized.quant_type!r} ({len(wrong_type)} such tensors); the shards and the "
            f"config come from different exports. {FIX}")
    if missing:
        raise CheckpointLoadError(
            f"{where}: {len(missing)} tensors of the 4-bit weights are missing, e.g. {missing[0]} "
            f"({'double quant: ' if prequantized.double_quant else ''}each packed X.weight needs "
            f"{', '.join('X.weight.' + n for n in needed)}); the download is partial or the shards were edited. {FIX}")
    shapes = {}
    for weight in sorted(packed):
        state_key = f"{weight}.{QUANT_STATE_PREFIX}{prequantized.quant_type}"
        state = _quant_state(headers[state_key][1], state_key)
        if "shape" not in state:
            raise CheckpointLoadError(f"{where}: {state_key} names no shape (keys {sorted(state)}). {FIX}")
        shapes[weight] = list(state["shape"])
    return shapes


__all__ = ["COMPANIONS", "NESTED_COMPANIONS", "Prequantized", "QUANT_TYPES", "check_tensors",
           "quantization_config_of", "read_prequantized"]

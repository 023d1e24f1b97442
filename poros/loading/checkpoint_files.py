"""A checkpoint before any weight is read: where it is (:func:`resolve_checkpoint`: a local directory,
the bundled tiny model, or a hub id downloaded or from the HF cache), its config and family
(:func:`read_config`), its weight files and what the load will do with them (:func:`inspect_checkpoint`,
:class:`CheckpointInfo`: safetensors, pickle ``.bin`` only when allowed, every shard of the index
present, a multimodal checkpoint's text tower), and after the load that every weight was read with its
shape (:func:`check_shapes`, :func:`check_loading_info`). What :mod:`poros.loading.load` loads from.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor
from poros.errors import CheckpointLoadError
from poros.loading.prequantized import Prequantized, check_tensors, read_prequantized


BUNDLED_MODEL = "poros-tiny-qwen3"  # shipped in the package (poros/assets)
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Text-tower keys of multimodal checkpoints -> the causal LM's names (current and legacy exports).
MULTIMODAL_KEY_MAPPING = {
    r"^model\.language_model\.": "model.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
}
# Checkpoint files fetched for a hub id (weights, configs, tokenizer, chat template).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


@dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` found in a checkpoint directory, before reading any weight."""

    path: pathlib.Path
    config: Any  # the checkpoint's full config (multimodal for VLM checkpoints)
    text_config: Any  # the config of the tower that trains
    descriptor: ArchitectureDescriptor
    weight_files: list[pathlib.Path]
    weight_format: str  # "safetensors" or "pickle"
    multimodal: bool
    has_tokenizer: bool
    #: a pre-quantized bitsandbytes 4-bit checkpoint's quantization (``poros.loading.prequantized``), else None
    prequantized: Prequantized | None = None

    @property
    def key_mapping(self) -> dict[str, str] | None:
        return dict(MULTIMODAL_KEY_MAPPING) if self.multimodal else None


def resolve_checkpoint(name_or_path: str | os.PathLike, *, revision: str | None = None) -> pathlib.Path:
    """The local directory of a checkpoint: a directory, the bundled ``poros-tiny-qwen3``, or a hub id.

    A hub id is resolved through the normal HF cache (``huggingface_hub.snapshot_download``): a cached
    snapshot is used without any network access; otherwise it is downloaded unless
    ``HF_HUB_OFFLINE=1``.

    Raises:
        CheckpointLoadError: a path that is a file, or a hub id that is neither cached nor downloadable.
    """
    name = os.fspath(name_or_path)
    if name == BUNDLED_MODEL:
        from poros.assets import asset_path

        return asset_path(name)
    path = pathlib.Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointLoadError(
            f"{path} is a file; a checkpoint is a directory holding config.json and the weight shards. "
            f"Pass the directory that contains it."
        )
    looks_local = name.startswith((".", "/", "~")) or name.count("/") != 1
    if looks_local:
        raise CheckpointLoadError(
            f"no checkpoint directory at {path}. Pass an existing directory with config.json and "
            f"*.safetensors, or a hub id like 'Qwen/Qwen2.5-7B'."
        )
    import huggingface_hub

    try:
        return pathlib.Path(huggingface_hub.snapshot_download(name, revision=revision, local_files_only=True,
                                                              allow_patterns=HUB_PATTERNS))
    except Exception:  # noqa: BLE001 -- not cached (LocalEntryNotFoundError and friends); try the network
        pass
    try:
        return pathlib.Path(huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointLoadError(
            f"{name!r} is not a local directory and is not in the HF cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}), and downloading it failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). On a machine with "
            f"access run `hf download {name}` (it then works offline), or pass a local directory."
        ) from exc


def read_config(path: pathlib.Path) -> tuple[Any, Any]:
    """``(config, text_config)`` of a checkpoint directory; ``text_config is config`` for a text model.

    Raises:
        CheckpointLoadError: no ``config.json``, or transformers cannot read it.
    """
    import transformers

    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointLoadError(f"{path} has no config.json: not a transformers checkpoint directory. "
                                  f"Point at the directory that save_pretrained wrote.")
    _check_model_type(config_file, transformers)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        first = str(exc).split(". ")[0][:300]
        raise CheckpointLoadError(
            f"{config_file} could not be read by transformers {transformers.__version__}: {first}. A newer "
            f"model type may need a newer transformers; a hand-edited config must be valid JSON."
        ) from exc
    return config, config.get_text_config()


def _check_model_type(config_file: pathlib.Path, transformers: Any) -> None:
    """A ``model_type`` transformers does not know, said in one line (transformers' own message is a paragraph
    of install commands)."""
    import difflib

    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # transformers says what is wrong with the file
    known = transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    if not isinstance(model_type, str) or model_type in known:
        return
    close = difflib.get_close_matches(model_type, list(known), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise CheckpointLoadError(
        f"{config_file} has model_type {model_type!r}, which transformers {transformers.__version__} does not know; "
        f"{hint}Fix: correct model_type, or, for an architecture newer than this transformers, a newer "
        "transformers (pip install -U transformers).")


def inspect_checkpoint(path: pathlib.Path, *, allow_pickle: bool = False) -> CheckpointInfo:
    """Check a checkpoint directory without reading weights: config, family, shards, format, tokenizer.

    A checkpoint whose ``config.json`` holds a ``quantization_config`` is pre-quantized
    (:mod:`poros.loading.prequantized`): only bitsandbytes 4-bit (nf4/fp4) is accepted, and the text
    config of a multimodal one gets the quantization config too (the text tower loads pre-quantized).

    Raises:
        CheckpointLoadError: no or unreadable ``config.json``; an index naming a shard that is missing;
            no weights; only pickle weights without ``allow_pickle=True``; a quantization Poros does not
            stream (another method, 8-bit, a 4-bit type other than nf4/fp4).
        UnknownArchitectureError: no registered family claims the config's ``model_type``.
    """
    from poros import registry

    config, text_config = read_config(path)
    descriptor = registry.for_config(text_config)  # UnknownArchitectureError lists the known families
    prequantized = read_prequantized(config, path)
    if prequantized is not None and getattr(text_config, "quantization_config", None) is None:
        text_config.quantization_config = dict(prequantized.config)  # the text tower loads it as the VLM would
    weight_format, weight_files = _weight_files(path, allow_pickle)
    has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
    return CheckpointInfo(path, config, text_config, descriptor, weight_files, weight_format,
                          multimodal=text_config is not config, has_tokenizer=has_tokenizer, prequantized=prequantized)


def _weight_files(path: pathlib.Path, allow_pickle: bool) -> tuple[str, list[pathlib.Path]]:
    for index_name, single_name, weight_format in ((SAFE_INDEX, SAFE_SINGLE, "safetensors"),
                                                   (PICKLE_INDEX, PICKLE_SINGLE, "pickle")):
        index_file = path / index_name
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointLoadError(f"{index_file} is not a valid shard index ({exc}). Re-download "
                                          f"the checkpoint or re-save it with save_pretrained.") from exc
            shards = sorted({path / name for name in weight_map.values()})
            missing = [shard.name for shard in shards if not shard.is_file()]
            if missing:
                raise CheckpointLoadError(
                    f"{index_file.name} lists {len(shards)} shards but {len(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} missing from {path}: "
                    f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. The download or copy is "
                    f"incomplete: fetch the missing files again."
                )
            files = shards
        elif (path / single_name).is_file():
            files = [path / single_name]
        else:
            continue
        if weight_format == "pickle" and not allow_pickle:
            raise CheckpointLoadError(
                f"{path} has only pickle weights ({files[0].name}); loading them can run arbitrary code. "
                f"Convert the checkpoint to safetensors, or pass allow_pickle=True if you trust its source."
            )
        return weight_format, files
    raise CheckpointLoadError(f"{path} has a config.json but no weights ({SAFE_INDEX} or {SAFE_SINGLE}). "
                              f"Copy the *.safetensors shards and their index next to config.json.")


def check_shapes(info: CheckpointInfo) -> None:
    """Compare every checkpoint tensor's shape (safetensors headers only) with the model the config builds.

    transformers skips this check for the weights it quantizes on load: a shard of another model size
    would be quantized as it is and fail (or worse, not fail) later. Keys the model does not have
    (a vision tower, or names transformers converts itself) are left to transformers. A pre-quantized
    checkpoint's packed weights are checked with the shape their quant state records, after
    :func:`poros.loading.prequantized.check_tensors` found every tensor they need.
    """
    if info.weight_format != "safetensors":
        return
    import re

    import transformers
    from safetensors import safe_open

    logical = {} if info.prequantized is None else check_tensors(info.weight_files, info.prequantized, info.path)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(info.text_config)
    expected = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    mapping = info.key_mapping or {}
    mismatched = []
    for file in info.weight_files:
        with safe_open(file, framework="pt") as shard:
            for key in shard.keys():
                name = key
                for pattern, replacement in mapping.items():
                    name = re.sub(pattern, replacement, name, count=1)
                shape = tuple(logical.get(key) or shard.get_slice(key).get_shape())
                if name in expected and expected[name] != shape:
                    if info.prequantized is not None and len(shape) == 2 and shape[1] == 1:
                        raise CheckpointLoadError(
                            f"{info.path}: {key} in {file.name} is packed 4-bit ({list(shape)}) but the checkpoint has "
                            f"no {key}.quant_state.bitsandbytes__{info.prequantized.quant_type} (nor absmax, quant_map) "
                            f"to unpack it with; the download is partial or the shards were edited. Download the "
                            f"checkpoint again, or start from its bf16 source.")
                    mismatched.append(f"{key} is {list(shape)} in {file.name}, the config makes {list(expected[name])}")
    if mismatched:
        raise CheckpointLoadError(
            f"{info.path}: {len(mismatched)} tensor shapes do not match config.json: {'; '.join(mismatched[:3])}"
            f"{' ...' if len(mismatched) > 3 else ''}. The shards belong to a different model size or the config "
            f"was edited: use the config.json that came with these shards."
        )


def check_loading_info(info: CheckpointInfo, model: nn.Module, loading_info: dict) -> None:
    missing = sorted(loading_info.get("missing_keys", ()))
    if missing:
        hint = ""
        if info.multimodal:
            hint = (f" The checkpoint is multimodal ({type(info.config).__name__}); its text keys were looked "
                    f"up under {sorted(MULTIMODAL_KEY_MAPPING)}.")
        raise CheckpointLoadError(
            f"{info.path}: {len(missing)} weights of {type(model).__name__} are not in the checkpoint and would "
            f"be randomly initialised: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}.{hint} "
            f"Check that the checkpoint matches its config.json (a truncated or foreign export)."
        )
    mismatched = loading_info.get("mismatched_keys") or []
    if mismatched:
        raise CheckpointLoadError(mismatch_message(info, "; ".join(map(str, mismatched[:5]))))


def mismatch_message(info: CheckpointInfo, detail: str) -> str:
    files = {}
    index_file = info.path / (SAFE_INDEX if info.weight_format == "safetensors" else PICKLE_INDEX)
    if index_file.is_file():
        files = json.loads(index_file.read_text()).get("weight_map", {})
    named = sorted({file for key, file in files.items() if key.split(".weight")[0] in detail})
    where = f" (in {', '.join(named[:3])})" if named else ""
    return (f"{info.path}: tensor shapes do not match config.json{where}: {detail.strip()[:600]}. The weights "
            f"belong to a different model size or the config was edited: use the config.json that came "
            f"with these shards.")


__all__ = ["BUNDLED_MODEL", "CheckpointInfo", "HUB_PATTERNS", "MULTIMODAL_KEY_MAPPING", "PICKLE_INDEX", "PICKLE_SINGLE", "SAFE_INDEX", "SAFE_SINGLE", "TOKENIZER_FILES", "check_loading_info", "check_shapes", "inspect_checkpoint", "mismatch_message", "read_config", "resolve_checkpoint"]

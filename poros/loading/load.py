"""Load a checkpoint for streamed training: NF4 blocks on the host, the rest on the compute device.

The weights go through transformers' own ``from_pretrained`` with a ``BitsAndBytesConfig`` -- the
same renaming, dtype plan and ``bnb.nn.Params4bit(...).to(device)`` quantization call, tensor by
tensor from the memory-mapped safetensors shards -- so the loaded base is bitwise the base the
resident reference loads. Two things differ, both around that machinery, never inside the math:

* **Blocks go to the host as they are loaded.** Each decoder-block tensor is quantized on the
  compute device (so the NF4 bytes are the device's, as in the reference) and moved to host memory
  right after transformers sets it on its module. The device never holds more than the tensor in
  flight plus the non-block modules (embeddings, final norm, head); the host holds the NF4 blocks
  plus the tensor in flight -- never the bf16 model. transformers' allocator warm-up (a device
  allocation the size of the whole model) is skipped. :func:`poros.prepare` then packs each block
  into its pinned buffer, one block at a time.
* **Multimodal checkpoints train their text tower.** Gemma 3 (4B+), Gemma 4 and Qwen 3.5/3.6
  checkpoints hold a vision tower and the text weights under ``model.language_model.*`` (older
  exports: ``language_model.model.*``). ``Gemma3ForCausalLM.from_pretrained`` on such a checkpoint
  silently random-initialises every text weight (``reference/transformers-families.md``). Here the
  text config is loaded into the family's causal LM with the text keys renamed, the vision keys are
  left unread, and a load that leaves any weight uninitialised is an error, not a warning.

* **Pre-quantized checkpoints load as they are.** A ``*-bnb-4bit`` checkpoint (``quantization_config``
  in its ``config.json``, :mod:`poros.loading.prequantized`) holds the packed bytes the store streams:
  transformers unpacks them (no quantize pass, no bf16), each block tensor is read from the shard
  straight into host memory, and nothing is cached (the checkpoint is the packed blocks).

Before any weight is read, the checkpoint is checked: config present and of a registered family,
every shard of the index present, safetensors (pickle ``.bin`` only with ``allow_pickle=True``), and
for a pre-quantized one every tensor its 4-bit weights need.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from poros.descriptor import ArchitectureDescriptor
from poros.devices import resolve_device
from poros.errors import CheckpointLoadError
from poros.loading.prequantized import Prequantized, check_tensors, read_prequantized

logger = logging.getLogger("poros")

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


@dataclass
class LoadedModel:
    """What :func:`load_pretrained` returns.

    Attributes:
        model: the family's HF causal LM (e.g. ``Qwen3ForCausalLM``; the text tower of a multimodal
            checkpoint), NF4 base, no adapters. Decoder blocks on the host when ``device`` is CUDA.
        tokenizer: the checkpoint's tokenizer (``AutoTokenizer``), or None when it has none or it
            was not asked for.
        path: the local checkpoint directory.
        descriptor: the family descriptor that streams it.
        info: the :class:`CheckpointInfo` of the checks before loading.
        device: the compute device.
        unused_keys: checkpoint tensors not read (a multimodal checkpoint's vision tower).
    """

    model: nn.Module
    tokenizer: Any
    path: pathlib.Path
    descriptor: ArchitectureDescriptor
    info: CheckpointInfo
    device: torch.device
    unused_keys: list[str] = field(default_factory=list)


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


def load_pretrained(
    name_or_path: str | os.PathLike,
    *,
    quantization: str = "nf4",
    compute_dtype: torch.dtype | str = torch.bfloat16,
    double_quant: bool = False,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    load_tokenizer: bool = True,
    allow_pickle: bool = False,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    _blocks_to_host_on_cpu: bool = False,
) -> LoadedModel:
    """Load a checkpoint as the family's causal LM with a 4-bit base, decoder blocks on the host.

    Args:
        name_or_path: a checkpoint directory, a hub id (through the HF cache), or
            ``"poros-tiny-qwen3"`` (the model shipped in the package).
        quantization: ``"nf4"`` or ``"fp4"`` (``bnb_4bit_quant_type``).
        compute_dtype: ``bnb_4bit_compute_dtype`` and the dtype of the unquantized tensors.
        double_quant: ``bnb_4bit_use_double_quant``.
        device: the compute device; default CUDA when available, else CPU. Blocks are quantized
            there and kept on the host when it is CUDA.
        attn_implementation: ``"sdpa"``/``"eager"``; None keeps transformers' default.
        load_tokenizer: also load the checkpoint's tokenizer (None, with a warning, if it has none).
        allow_pickle: accept ``pytorch_model.bin`` checkpoints (unsafe: pickle runs code).
        revision: hub revision for a hub id.
        cache_dir: the NF4 block cache root (``docs/cache-and-host-memory.md``): the first load writes
            the packed blocks there, later loads map them instead of reading and quantizing the
            checkpoint's block weights. None: no cache (every load quantizes). The blocks of the
            returned model are then views of the mapped entry (``model.poros_block_file``). A
            pre-quantized checkpoint already holds the packed blocks: it is read as it is, never cached.

    A pre-quantized bitsandbytes 4-bit checkpoint (a ``*-bnb-4bit`` repo: ``quantization_config`` in its
    ``config.json``) loads its packed bytes as they are -- no quantize pass, no bf16 copy -- with the
    checkpoint's own quant type, double quantization and skipped modules (``quantization`` and
    ``double_quant`` are then not used; a different ``quantization`` is logged). Its decoder-block tensors
    are read straight into host memory: they never visit the device.

    Raises:
        CheckpointLoadError: see :func:`inspect_checkpoint`; a weight the checkpoint does not provide
            (it would be random-initialised); a tensor whose shape does not match the config.
        UnknownArchitectureError: the checkpoint's family is not registered.
    """
    import transformers

    if quantization not in ("nf4", "fp4"):
        raise CheckpointLoadError(f"quantization={quantization!r}: Poros streams 4-bit bases, 'nf4' or 'fp4'.")
    if isinstance(compute_dtype, str):
        compute_dtype = getattr(torch, compute_dtype)
    device = resolve_device(device or None, with_index=True)
    path = resolve_checkpoint(name_or_path, revision=revision)
    info = inspect_checkpoint(path, allow_pickle=allow_pickle)
    prequantized = info.prequantized
    if prequantized is None:
        quantization_config = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_use_double_quant=double_quant,
        )
    else:  # the checkpoint's own config decides; passing one would only make transformers warn
        quantization_config = None
        _note_checkpoint_quantization(info, quantization)
    extra: dict[str, Any] = {}
    if attn_implementation is not None:
        extra["attn_implementation"] = attn_implementation
    if info.multimodal:
        extra["key_mapping"] = info.key_mapping
    check_shapes(info)
    blocks_prefix = info.descriptor.decoder_layers + "."
    move = device.type != "cpu" or _blocks_to_host_on_cpu

    def load(skip_blocks=contextlib.nullcontext()):
        # On CPU the blocks are already on the host; tests pass _blocks_to_host_on_cpu=True to run the
        # CUDA path's moves (each tensor replaced by a host copy) where there is no GPU.
        with blocks_to_host(blocks_prefix, move=move, read_to_host=prequantized is not None), skip_blocks:
            try:
                model, loading_info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, config=info.text_config, quantization_config=quantization_config,
                    device_map={"": str(device)}, dtype=compute_dtype,
                    use_safetensors=info.weight_format == "safetensors", output_loading_info=True, **extra,
                )
            except RuntimeError as exc:
                if "mismatch" in str(exc):
                    raise CheckpointLoadError(_mismatch_message(info, str(exc))) from exc
                raise
        check_loading_info(info, model, loading_info)
        if device.type != "cpu":
            sweep_blocks_to_host(model, info.descriptor)
        return model, loading_info

    if cache_dir is None or prequantized is not None:
        model, loading_info = load()
    else:
        from poros.loading.cache_blocks import load_through_cache

        model, loading_info = load_through_cache(
            load, cache_dir, model=os.fspath(name_or_path), info=info, revision=revision, device=device,
            quantization_config=quantization_config)
    tokenizer = None
    if load_tokenizer:
        if info.has_tokenizer:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        else:
            logger.warning("poros: %s has no tokenizer files; pass token ids or a tokenizer yourself", path)
    unused = sorted(loading_info.get("unexpected_keys", ()))
    if unused:
        logger.info("poros: %d checkpoint tensors not used (e.g. %s)", len(unused), unused[0])
    return LoadedModel(model, tokenizer, path, info.descriptor, info, device, unused)


@dataclass
class AdapterInfo:
    """What :func:`read_adapter` found in an adapter directory (PEFT layout, as ``PorosTrainer.save`` writes).

    Attributes:
        path: the adapter directory.
        peft_config: ``adapter_config.json`` as a dict.
        base_model: the base checkpoint: the ``base_model`` argument, else ``poros_config.json``'s
            ``base_model_name_or_path``, else ``adapter_config.json``'s.
        poros_config: the training run's :class:`~poros.config.PorosConfig` fields from
            ``poros_config.json`` (empty for an adapter Poros did not train).
        weights: the adapter weights file (``adapter_model.safetensors``).
    """

    path: pathlib.Path
    peft_config: dict[str, Any]
    base_model: str
    poros_config: dict[str, Any]
    weights: pathlib.Path


def read_adapter(adapter: str | os.PathLike, base_model: str | os.PathLike | None = None) -> AdapterInfo:
    """Check an adapter directory and find its base model, before anything is loaded.

    Raises:
        CheckpointLoadError: no directory, no ``adapter_config.json`` or no ``adapter_model.safetensors``,
            or no base model named anywhere (pass ``base_model``).
    """
    path = pathlib.Path(adapter).expanduser()
    config_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise CheckpointLoadError(
            f"{path} is not an adapter directory: expected adapter_config.json and adapter_model.safetensors "
            f"(found {sorted(p.name for p in path.iterdir())[:8] if path.is_dir() else 'no directory'}). Pass the "
            "directory that PorosTrainer.save / PEFT's save_pretrained wrote."
        )
    peft_config = json.loads(config_file.read_text())
    record_file = path / "poros_config.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    base = base_model or record.get("base_model_name_or_path") or peft_config.get("base_model_name_or_path")
    if not base:
        raise CheckpointLoadError(
            f"{path} names no base model (adapter_config.json base_model_name_or_path is empty and there is no "
            "poros_config.json). Pass the base checkpoint with --model / base_model=."
        )
    return AdapterInfo(path, peft_config, os.fspath(base), dict(record.get("config") or {}), weights)



def adapters_to_device(model: nn.Module, device: torch.device | str) -> int:
    """Move every trainable tensor (the adapters PEFT just added) to the compute device; returns how many.

    PEFT creates each adapter on its base layer's device, and a loaded block's base layer is on the
    host. Parameters keep their identity (``.data`` is swapped), so call this before building the
    optimizer. PEFT initialises adapters on the CPU in every case, so values are unchanged.
    """
    device = torch.device(device)
    moved = 0
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.device != device:
            parameter.data = parameter.data.to(device)
            moved += 1
    return moved


def _note_checkpoint_quantization(info: CheckpointInfo, quantization: str) -> None:
    prequantized = info.prequantized
    if quantization != prequantized.quant_type:
        logger.warning("poros: %s is %s; quantization=%r is not used (its packed bytes are loaded as they are)",
                       info.path, prequantized.describe(), quantization)
    else:
        logger.info("poros: %s is %s: its packed bytes are loaded as they are", info.path, prequantized.describe())


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
        raise CheckpointLoadError(_mismatch_message(info, "; ".join(map(str, mismatched[:5]))))


def _mismatch_message(info: CheckpointInfo, detail: str) -> str:
    files = {}
    index_file = info.path / (SAFE_INDEX if info.weight_format == "safetensors" else PICKLE_INDEX)
    if index_file.is_file():
        files = json.loads(index_file.read_text()).get("weight_map", {})
    named = sorted({file for key, file in files.items() if key.split(".weight")[0] in detail})
    where = f" (in {', '.join(named[:3])})" if named else ""
    return (f"{info.path}: tensor shapes do not match config.json{where}: {detail.strip()[:600]}. The weights "
            f"belong to a different model size or the config was edited: use the config.json that came "
            f"with these shards.")


@contextlib.contextmanager
def blocks_to_host(prefix: str, *, move: bool, read_to_host: bool = False, on_block_done=None):
    """While transformers loads: move each decoder-block tensor to the host right after it is set.

    transformers quantizes a tensor on its target device, then calls ``set_param_for_module``; the
    wrapper lets that happen unchanged and then (``move``) moves the result (``Params4bit`` with its
    QuantState, or a plain tensor) to the host. Each time a new block starts, freed host memory is
    handed back to the OS (glibc keeps freed bf16/fp32 temporaries in its heap otherwise, and the
    load's RSS would grow with the model instead of staying at NF4 + one tensor). The allocator
    warm-up, which reserves device memory for the whole model up front, is skipped.

    ``read_to_host``: nothing in a block is quantized on load (a pre-quantized checkpoint, or an
    unquantized base), so each block tensor is read from the shard straight into host memory instead of
    to the device (transformers' ``get_device`` answers ``"cpu"`` for it): it never visits the device.

    ``on_block_done(model, block)``: called with the block's index (a string) once every tensor of that
    block is set, i.e. when the next block's first tensor arrives (transformers loads the checkpoint in
    key order, block after block); the last block is the caller's to finish after the load.
    ``poros quantize`` writes and drops each block there (the warm-up is skipped then too).
    """
    import transformers
    from transformers import core_model_loading, modeling_utils

    if not hasattr(core_model_loading, "set_param_for_module"):
        if not move and on_block_done is None:  # on the CPU the blocks are on the host already: load as transformers does
            yield
            return
        raise CheckpointLoadError(
            f"transformers {transformers.__version__} has no core_model_loading.set_param_for_module, where Poros "
            "moves each block to the host as it is loaded (transformers 5.24 has it). Install the tested "
            "version (pip install 'transformers==5.24.*'), or load on the CPU (device='cpu')."
        )
    set_param = core_model_loading.set_param_for_module
    warmup = modeling_utils.caching_allocator_warmup
    current_block = [None]

    def set_param_then_host(model, target_name, param_value, *args, **kwargs):
        set_param(model, target_name, param_value, *args, **kwargs)
        if not target_name.startswith(prefix):
            return
        block = target_name[len(prefix):].split(".", 1)[0]
        if block != current_block[0]:
            finished, current_block[0] = current_block[0], block
            if on_block_done is not None and finished is not None:
                on_block_done(model, finished)
            _trim_host_heap()
        if move:
            module_path, _, name = target_name.rpartition(".")
            _to_host(model.get_submodule(module_path), name)

    get_device = core_model_loading.get_device

    def device_of(device_map, param_name, *args, **kwargs):
        if param_name.startswith(prefix):
            return "cpu"
        return get_device(device_map, param_name, *args, **kwargs)

    core_model_loading.set_param_for_module = set_param_then_host
    if move or on_block_done is not None:
        modeling_utils.caching_allocator_warmup = lambda *args, **kwargs: None
    if move and read_to_host:
        core_model_loading.get_device = device_of
    try:
        yield
    finally:
        core_model_loading.set_param_for_module = set_param
        core_model_loading.get_device = get_device
        modeling_utils.caching_allocator_warmup = warmup
        _trim_host_heap()


def _trim_host_heap() -> None:
    """Return free heap memory to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    import ctypes
    import ctypes.util

    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


_LIBC = None


def _to_host(module: nn.Module, name: str) -> None:
    """Replace ``module.<name>`` by a host copy, keeping what transformers marked on it.

    ``_is_hf_initialized`` must survive: transformers initialises, after loading, every tensor
    without it (a Gemma 4 ``layer_scalar`` buffer would silently become 1.0).
    """
    if name in module._buffers:
        buffer = module._buffers[name]
        if buffer is not None:
            moved = buffer.to("cpu", copy=True)
            _keep_marks(buffer, moved)
            module._buffers[name] = moved
        return
    param = module._parameters.get(name)
    if param is None:
        return
    if hasattr(param, "quant_state"):  # bnb Params4bit: .to moves the QuantState too, keeps the packing
        moved = param.to("cpu") if param.device.type != "cpu" else param
    else:
        moved = nn.Parameter(param.data.to("cpu", copy=True), requires_grad=param.requires_grad)
    _keep_marks(param, moved)
    module._parameters[name] = moved


def _keep_marks(old: torch.Tensor, new: torch.Tensor) -> None:
    if new is not old and hasattr(old, "_is_hf_initialized"):
        new._is_hf_initialized = old._is_hf_initialized


def sweep_blocks_to_host(model: nn.Module, descriptor: ArchitectureDescriptor) -> None:
    """Anything transformers created in a block after loading (non-persistent buffers) goes to the host too."""
    from poros.descriptor import resolve_path

    for layer in resolve_path(model, descriptor.decoder_layers):
        for module in layer.modules():
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and tensor.device.type != "cpu":
                    _to_host(module, name)


__all__ = ["AdapterInfo", "adapters_to_device", "blocks_to_host", "read_adapter", "read_config", "CheckpointInfo",
           "LoadedModel", "MULTIMODAL_KEY_MAPPING", "check_loading_info", "check_shapes", "inspect_checkpoint",
           "load_pretrained",
           "resolve_checkpoint", "sweep_blocks_to_host"]

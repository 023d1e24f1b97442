"""The torch half of the NF4 block cache (``poros.loading.cache``): decoder blocks into an entry and back.

* :func:`write_blocks_entry` -- after a cold load, pack every block the way the block store does
  (``poros.stream.store.block_layouts``) into a new entry, with each block's tensor layout and the
  plain fields of its bitsandbytes ``Params4bit`` / ``QuantState`` objects.
* :func:`skip_block_weights` -- during a cached load, transformers reads and converts only the
  non-block weights; each block's tensors are made from the entry (views of its mapping), so no
  block weight is read from the checkpoint or quantized.
* :func:`bind_blocks` -- after either load, check that the model's blocks have the entry's layout and
  point every block tensor at its view of the mapped entry. The block store then finds its bytes
  there (``poros.stream.tiers``): copied into pinned buffers, mapped, or read from disk.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from poros.loading import cache
from poros.errors import CacheEntryError
from poros.stream.store import bind_entry, block_layouts, entry_view
from poros.stream.block_file import release_mapping

logger = logging.getLogger("poros")

QUANT_FIELDS = ("absmax", "code", "offset")


# -- plain values <-> JSON --------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CacheEntryError(f"cannot record {type(value).__name__} {value!r} in a cache manifest")


def _unplain(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        return getattr(torch, value["dtype"])
    if isinstance(value, dict) and "size" in value:
        return torch.Size(value["size"])
    return value


def _describe_state(state) -> dict[str, Any]:
    """A QuantState's plain fields (its tensors come from the block buffer), nested state included."""
    described = {}
    for name, value in vars(state).items():
        if name in QUANT_FIELDS and (value is None or isinstance(value, torch.Tensor)):
            described[name] = None if value is None else "tensor"
        elif name == "state2":
            described[name] = None if value is None else _describe_state(value)
        else:
            described[name] = _plain(value)
    return described


def _describe_block(block: nn.Module, entries) -> dict[str, Any]:
    """The manifest record of one block (offset, nbytes and checksum are filled in when written)."""
    params4bit = {}
    for name, param in block.named_parameters():
        if getattr(param, "quant_state", None) is None:
            continue
        module = block.get_submodule(name.rpartition(".")[0])
        fields = {k: _plain(v) for k, v in vars(param).items()
                  if k not in ("quant_state", "module", "_is_hf_initialized")}
        params4bit[name] = {"fields": fields, "quant_state": _describe_state(param.quant_state),
                            "module_state": getattr(module, "quant_state", None) is param.quant_state}
    trainable = sorted(name for name, param in block.named_parameters() if param.requires_grad)
    return {
        "requires_grad": trainable,
        "entries": [{"name": e.name, "kind": e.kind, "offset": e.offset, "nbytes": e.nbytes,
                     "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape), "stride": list(e.stride)}
                    for e in entries],
        "params4bit": params4bit,
    }


# -- writing ----------------------------------------------------------------------------------------
def write_blocks_entry(root, name: str, manifest: dict[str, Any], blocks: list[nn.Module]) -> cache.CacheEntry:
    """Write ``blocks`` (the loaded model's decoder layers, NF4, on the host) as entry ``name``."""
    from poros.stream.block_file import default_checksum, write_block_file

    layouts = _layouts(blocks)
    algorithm = default_checksum()
    manifest = {**manifest, "checksum": algorithm,
                "blocks": [_describe_block(b, layout[0]) for b, layout in zip(blocks, layouts)]}

    def write(path):
        file = write_block_file(path, dict(enumerate(layouts)), len(blocks), algorithm=algorithm)
        return list(zip(file.offsets, file.nbytes, file.checksums))

    return cache.write_entry(root, name, manifest, write)


# -- binding ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _all_frozen(blocks: list[nn.Module]):
    """The store packs the tensors that do not require grad; straight from transformers, the float
    parameters of a block (norms, biases) still do (PEFT freezes them later). The cache holds them
    all: freeze them while laying the blocks out, then put the flags back."""
    params = [p for block in blocks for p in block.parameters() if p.requires_grad]
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(True)


def _layouts(blocks: list[nn.Module]):
    with _all_frozen(blocks):
        return block_layouts(blocks)


def _layout_rows(entries) -> list[tuple]:
    return [(e.name, e.kind, e.offset, e.nbytes, str(e.dtype).removeprefix("torch."), list(e.shape), list(e.stride))
            for e in entries]


def bind_blocks(blocks: list[nn.Module], entry: cache.CacheEntry):
    """Point every frozen tensor of ``blocks`` at its view of the mapped entry; returns the ``BlockFile``.

    Raises:
        CacheEntryError: the blocks' layout (tensor names, dtypes, shapes, offsets) is not the entry's.
    """
    records = entry.manifest["blocks"]
    layouts = _layouts(blocks)
    if len(records) != len(blocks):
        raise CacheEntryError(f"{entry.directory.name}: holds {len(records)} blocks, the model has {len(blocks)}")
    for index, ((entries, _, nbytes), record) in enumerate(zip(layouts, records)):
        expected = [(r["name"], r["kind"], r["offset"], r["nbytes"], r["dtype"], r["shape"], r["stride"])
                    for r in record["entries"]]
        if _layout_rows(entries) != expected or nbytes != record["nbytes"]:
            raise CacheEntryError(f"{entry.directory.name}: block {index}'s tensors are not laid out as the entry "
                                  "records them (another model or library version)")
    file = entry.block_file()
    for index, (entries, _, _) in enumerate(layouts):
        view = file.block_view(index)
        for item in entries:
            bind_entry(item, entry_view(view, item))
    return file


def _fill_block(block: nn.Module, record: dict[str, Any], view: torch.Tensor) -> None:
    """Give the skeleton ``block`` (transformers' meta modules) its tensors from the entry's ``view``."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import QuantState

    tensors = {}
    for item in record["entries"]:
        dtype = getattr(torch, item["dtype"])
        raw = view[item["offset"]: item["offset"] + item["nbytes"]]
        tensors[item["name"]] = (item["kind"], raw.view(dtype).as_strided(item["shape"], item["stride"]))

    def state_of(prefix: str, described: dict[str, Any]):
        state = QuantState.__new__(QuantState)
        for key, value in described.items():
            if key == "state2":
                value = None if value is None else state_of(f"{prefix}.state2", value)
            elif key in QUANT_FIELDS and value == "tensor":
                value = tensors[f"{prefix}.{key}"][1]
            else:
                value = _unplain(value)
            setattr(state, key, value)
        return state

    for name, (kind, tensor) in tensors.items():
        if kind == "quant":
            continue
        module_path, _, attr = name.rpartition(".")
        module = block.get_submodule(module_path)
        if kind == "buffer":
            module._buffers[attr] = tensor
            tensor._is_hf_initialized = True
            continue
        described = record["params4bit"].get(name)
        if described is None:
            param = nn.Parameter(tensor, requires_grad=name in record["requires_grad"])
        else:
            fields = {k: _unplain(v) for k, v in described["fields"].items()}
            state = state_of(f"{name}.quant_state", described["quant_state"])
            param = bnb.nn.Params4bit(tensor, requires_grad=False, quant_state=state, module=module, **fields)
            if described["module_state"]:
                module.quant_state = state
        param._is_hf_initialized = True
        module._parameters[attr] = param


@contextlib.contextmanager
def skip_block_weights(prefix: str, layers_path: str, entry: cache.CacheEntry):
    """While transformers loads: leave every checkpoint tensor of a decoder block unread and give the
    blocks their tensors from ``entry`` instead (so they are neither missing nor initialised)."""
    from transformers import core_model_loading, modeling_utils

    from poros.descriptor import resolve_path

    convert = modeling_utils.convert_and_load_state_dict_in_model
    file = entry.block_file()

    def without_blocks(model, state_dict, load_config, *args, **kwargs):
        meta = model.state_dict()
        mapping = load_config.weight_mapping or []
        renamings = [m for m in mapping if isinstance(m, core_model_loading.WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, core_model_loading.WeightConverter)]
        kept = {}
        for key, tensor in state_dict.items():
            renamed, _ = core_model_loading.rename_source_key(key, renamings, converters, model.base_model_prefix,
                                                              meta)
            if not (renamed.startswith(prefix) or key.startswith(prefix)):
                kept[key] = tensor
        loading_info, *rest = convert(model, kept, load_config, *args, **kwargs)
        layers = list(resolve_path(model, layers_path))
        if len(layers) != len(entry.manifest["blocks"]):
            raise CacheEntryError(f"{entry.directory.name}: holds {len(entry.manifest['blocks'])} blocks, the model "
                                  f"has {len(layers)}")
        for index, (layer, record) in enumerate(zip(layers, entry.manifest["blocks"])):
            _fill_block(layer, record, file.block_view(index))
        covered = {f"{prefix}{index}.{item['name']}" for index, record in enumerate(entry.manifest["blocks"])
                   for item in record["entries"] if item["kind"] != "quant"}
        uncovered = sorted(k for k in loading_info.missing_keys if k.startswith(prefix) and k not in covered)
        if uncovered:
            raise CacheEntryError(f"{entry.directory.name}: does not hold {uncovered[0]} (a block tensor it would "
                                  "need; shared between blocks?)")
        loading_info.missing_keys -= covered
        return (loading_info, *rest)

    modeling_utils.convert_and_load_state_dict_in_model = without_blocks
    try:
        yield
    finally:
        modeling_utils.convert_and_load_state_dict_in_model = convert


# -- the cached load -------------------------------------------------------------------------------
def load_through_cache(load, cache_dir, *, model: str, info, revision: str | None, device: torch.device,
                       quantization_config) -> tuple[nn.Module, dict]:
    """Run ``load`` (``poros.loading.load.load_pretrained``'s transformers load) through the NF4 block cache.

    Looks the entry up under the build lock: a sound entry is mapped and only the non-block weights
    are read; a damaged one (or one whose layout is not the model's) is reported in one line, removed
    and rebuilt; none is written after a cold load. Either way the returned model's block tensors are
    views of the mapped entry and ``model.poros_block_file`` is its ``BlockFile``.
    """
    import datetime

    from poros.descriptor import resolve_path

    root = cache.cache_root(cache_dir)
    quantization = {k: str(v) for k, v in sorted(quantization_config.to_dict().items())}
    fields = {
        "checkpoint": cache.checkpoint_identity(info.path, info.weight_files, revision),
        "quantization": quantization, "device_type": device.type, "family": info.descriptor.name,
        "decoder_layers": info.descriptor.decoder_layers, "model_type": getattr(info.text_config, "model_type", None),
        "multimodal": info.multimodal, "versions": cache.package_versions(),
    }
    name = cache.entry_name(model, cache.entry_key(fields))
    prefix = info.descriptor.decoder_layers + "."
    try:
        cache.prepare_root(root)  # created and written once: a read-only root warns here, not at the lock
    except OSError as problem:
        logger.warning(cache.unusable_root_warning(root, problem))
        return load()
    with cache.build_lock(root, name):
        entry = None
        try:
            entry = cache.open_entry(root, name, verify=False)  # manifest and size; the checksum pass follows
        except CacheEntryError as problem:
            _report(problem, root / name)
        if entry is not None:
            try:
                loaded, loading_info = _load_while_verifying(
                    entry, lambda: load(skip_block_weights(prefix, info.descriptor.decoder_layers, entry)))
                file = bind_blocks(list(resolve_path(loaded, info.descriptor.decoder_layers)), entry)
                logger.info("poros: NF4 blocks from the cache: %s", entry.directory)
            except CacheEntryError as problem:
                loaded = loading_info = None  # views of a damaged entry: never trained on
                release_mapping(entry.blocks_path)  # so the removed file's space is freed before the rebuild
                _report(problem, root / name)
                entry = None
        if entry is None:
            loaded, loading_info = load()
            layers = list(resolve_path(loaded, info.descriptor.decoder_layers))
            manifest = {"format": cache.FORMAT_VERSION, "model": model, "checkpoint": str(info.path), "key": fields,
                        "quantization": {"quant_type": quantization_config.bnb_4bit_quant_type,
                                         "double_quant": quantization_config.bnb_4bit_use_double_quant,
                                         "compute_dtype": str(quantization_config.bnb_4bit_compute_dtype
                                                              ).removeprefix("torch.")},
                        "device_type": device.type, "family": info.descriptor.name,
                        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            try:
                entry = write_blocks_entry(root, name, manifest, layers)
            except (OSError, CacheEntryError) as problem:
                logger.warning("poros: could not write the NF4 block cache entry %s (%s); training without it.",
                               root / name, problem)
                return loaded, loading_info
            file = bind_blocks(layers, entry)
            logger.info("poros: NF4 blocks written to the cache: %s", entry.directory)
    entry.touch()
    loaded.poros_block_file = file
    return loaded, loading_info


def _load_while_verifying(entry: cache.CacheEntry, load):
    """``load()`` (transformers reading the non-block weights) while threads check every block's checksum
    (file reads and xxhash/zlib, which let go of the GIL): a start pays the longer of the two, not both.
    The check's verdict is awaited before anything is returned, so a damaged entry is never trained on.
    When the load fails (its own error: it reads no block byte) or is interrupted (Ctrl-C), the check
    stops at its next 64 MiB read instead of running to the end."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="poros-cache-check") as pool:
        checked = pool.submit(entry.verify, stop=stop)
        try:
            result = load()
            checked.result()
        except BaseException:
            stop.set()
            raise
    return result


def _report(problem: Exception, directory) -> None:
    logger.warning("poros: cache entry damaged, rebuilding it from the checkpoint: %s", problem)
    cache.remove_entry(directory)


__all__ = ["bind_blocks", "load_through_cache", "skip_block_weights", "write_blocks_entry"]

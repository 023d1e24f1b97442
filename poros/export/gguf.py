"""Merge a LoRA adapter into its base and write GGUF for llama.cpp and Ollama, one tensor at a time:
``poros merge --format gguf``.

::

    base checkpoint (safetensors shards)                           model.gguf
     headers of every shard ──names, shapes──▶ llama.cpp names, types ──▶ header, metadata, tensor infos
     shard k ──tensor t──▶ --dtype ──▶ adapted? PEFT's merge ──▶ F32 / BF16 / Q8_0 ──▶ t's bytes (one tensor
                                      (poros.export.merge)         (gguf's quantize)     in memory)

GGUF lists every tensor's name, shape, type and offset before the data, so a first pass reads only
the shards' headers and lays the file out; the second reads, merges, converts and writes each
tensor and drops it before the next -- the host holds one tensor (plus the adapter), as ``poros
merge`` does.

Notable choices:

* **llama.cpp's own conventions** (``convert_hf_to_gguf.py``): tensor names from gguf-py's
  ``TensorNameMap`` for the architecture; one-dimensional tensors and norms in F32; the rest in
  the type asked (``bf16``, ``f16``, ``f32``, ``q8_0``), a row that Q8_0's blocks do not divide in
  F16; data converted by gguf-py's ``quants.quantize`` -- the bytes its converter writes for the
  same tensor. A tied head has no tensor of its own (llama.cpp then uses the token embedding).
* **The metadata llama.cpp reads** for the architecture: block count, context and embedding
  lengths, feed-forward length, head counts, key/value lengths, RoPE base and scaling, RMS-norm
  epsilon, file type; the tokenizer as a GPT-2 BPE vocabulary (tokens, types, merges, special ids,
  add_bos, chat template) from the adapter's tokenizer, else the base's.
* **The tokenizer as llama.cpp's converter reads it**: ``tokenizer.ggml.pre`` from the digest of the
  tokenizer's ids for the converter's check text (its table, vendored in
  :mod:`poros.export.llama_vocab`), else from the tokenizer's own split regex; a tokenizer llama.cpp
  cannot reproduce is refused in one line (:func:`tokenizer_pre`). An Ollama ``NAME.Modelfile`` is
  written beside the file (:mod:`poros.export.modelfile`).
* **Architectures as data.** :data:`GGUF_ARCHITECTURES` maps an HF ``model_type`` to the GGUF
  architecture; a model type without an entry is refused by name.
* **Atomic.** The file is written beside its name and renamed into place once complete.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from poros.errors import ConfigError, MissingDependencyError, UnsupportedModelError
from poros.export.modelfile import write_modelfile
from poros.export.merge import (MergeResult, ShardReader, floating_dtype, model_key, peak_rss, plan_merge,
                                progress_line)
from poros.spellings import human_bytes
from poros.export.gguf_tokenizer import added_specials, load_tokenizer, tokenizer_pre, tokenizer_source, write_tokenizer


@dataclass(frozen=True)
class GgufArchitecture:
    """How llama.cpp names a family.

    Attributes:
        arch: gguf-py's architecture name (``gguf.MODEL_ARCH_NAMES``), ``general.architecture``.
        tokenizer_pre: the pre-tokenizer the family's published tokenizers get from llama.cpp's converter
            (informational, for the docs' table); the file's own ``tokenizer.ggml.pre`` is chosen from the
            tokenizer exported (:func:`tokenizer_pre`), as the converter chooses it.
    """

    arch: str
    tokenizer_pre: str


#: HF ``model_type`` -> its GGUF architecture (convert_hf_to_gguf.py: Qwen2Model, Qwen3Model)
GGUF_ARCHITECTURES = {
    "qwen2": GgufArchitecture("qwen2", "qwen2"),
    "qwen3": GgufArchitecture("qwen3", "qwen2"),
}
#: ``--gguf-type`` -> (gguf.GGMLQuantizationType name, gguf.LlamaFileType name)
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f16": ("F16", "MOSTLY_F16"),
    "f32": ("F32", "ALL_F32"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
}


@dataclass
class GgufResult(MergeResult):
    """What :func:`merge_to_gguf` wrote (``output`` is the ``.gguf`` file; ``shards`` the files written).

    Attributes:
        gguf_type: the type of the weight matrices (``bf16``, ``q8_0``...).
        architecture: the GGUF architecture (``general.architecture``).
        tokenizer_pre: llama.cpp's pre-tokenizer written (``tokenizer.ggml.pre``, :func:`tokenizer_pre`).
        modelfile: the Ollama Modelfile written beside the file (:mod:`poros.export.modelfile`).
    """

    gguf_type: str = "bf16"
    architecture: str = ""
    tokenizer_pre: str = ""
    modelfile: pathlib.Path | None = None

    def summary(self) -> str:
        peak = f", peak RSS {human_bytes(self.peak_rss_bytes)}" if self.peak_rss_bytes else ""
        ollama = f"; for Ollama: ollama create NAME -f {self.modelfile}" if self.modelfile else ""
        return (f"poros: merged {self.merged_modules} adapted weights into {self.output} (GGUF {self.gguf_type}, "
                f"architecture {self.architecture}, pre-tokenizer {self.tokenizer_pre}): {self.tensors} tensors, "
                f"{human_bytes(self.bytes_written)} in {self.seconds:.1f} s{peak}{ollama}")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF file, laid out before any data is read."""

    shard: int  # index into the checkpoint's weight files
    key: str  # its checkpoint name
    name: str  # its llama.cpp name
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType


def gguf_architecture(model_type: str | None) -> GgufArchitecture:
    """The GGUF architecture of an HF ``model_type``.

    Raises:
        UnsupportedModelError: no entry in :data:`GGUF_ARCHITECTURES` (the message lists them).
    """
    found = GGUF_ARCHITECTURES.get(model_type or "")
    if found is None:
        raise UnsupportedModelError(
            f"poros merge --format gguf writes the llama.cpp architectures {', '.join(sorted(GGUF_ARCHITECTURES))}; "
            f"this base is model_type {model_type!r}. Fix: merge to safetensors (poros merge without --format) and "
            "convert that with llama.cpp's convert_hf_to_gguf.py.")
    return found


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str) -> Any:
    """The GGUF type of a tensor, as convert_hf_to_gguf.py chooses it: F32 for one-dimensional tensors, norms
    and anything that is not a ``.weight``; the type asked for the rest, F16 where Q8_0's blocks do not divide
    a row."""
    import gguf

    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    qtype = gguf.GGMLQuantizationType[GGUF_TYPES[gguf_type][0]]
    block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        return gguf.GGMLQuantizationType.F16
    return qtype


def convert(tensor: Any, qtype: Any) -> Any:
    """A merged torch tensor as the numpy array gguf-py writes for ``qtype`` (its own ``quants.quantize``)."""
    import gguf
    import torch

    return gguf.quants.quantize(tensor.to(torch.float32).numpy(), qtype)


def layout(plan: Any, arch: GgufArchitecture, gguf_type: str) -> list[PlannedTensor]:
    """Every tensor of the checkpoint with its llama.cpp name and GGUF type, from the shards' headers only.

    Raises:
        UnsupportedModelError: a checkpoint tensor llama.cpp's architecture has no name for (a vision
            tower, a module llama.cpp does not implement).
    """
    import gguf

    text_config = plan.checkpoint.text_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.arch.upper()], text_config.num_hidden_layers)
    planned = []
    for shard, path in enumerate(plan.checkpoint.weight_files):
        with ShardReader(path) as reader:
            for key, (_, shape) in reader.tensors.items():
                mapped = model_key(key, plan.checkpoint.key_mapping or {})
                name = names.get_name(mapped, try_suffixes=(".weight", ".bias"))
                if name is None:
                    raise UnsupportedModelError(
                        f"{key} has no name in llama.cpp's {arch.arch} architecture; expected only the text model's "
                        "tensors. Fix: merge to safetensors (poros merge without --format) and convert with llama.cpp.")
                shape = tuple(shape)
                planned.append(PlannedTensor(shard, key, name, shape, tensor_type(name, shape, gguf_type)))
    return planned


def merge_to_gguf(adapter: str | os.PathLike, output: str | os.PathLike, *, model: str | os.PathLike | None = None,
                  gguf_type: str = "bf16", dtype: str = "bfloat16", device: str = "cpu", overwrite: bool = False,
                  progress: TextIO | None = sys.stderr) -> GgufResult:
    """Merge ``adapter`` into its base (as :func:`poros.export.merge.merge_adapter`) and write one GGUF file.

    Args:
        adapter, model, dtype, device: as for :func:`~poros.export.merge.merge_adapter` (``dtype``: the
            merge's; the file's matrices are ``gguf_type``).
        output: the ``.gguf`` file to write (must not exist unless ``overwrite``).
        gguf_type: ``bf16`` (default), ``f16``, ``f32`` or ``q8_0``: the type of the weight matrices.
        progress: a stream for one plain progress line per shard (None: silent).

    Raises:
        ConfigError: an unknown ``gguf_type``; ``output`` exists (without ``overwrite``) or is a directory.
        UnsupportedModelError: a base whose architecture has no GGUF entry, or that llama.cpp would compute
            differently (sliding-window attention, a RoPE scaling it lacks).
        CheckpointLoadError, UnsupportedAdapterError: as :func:`~poros.export.merge.merge_adapter`.
        MissingDependencyError: the gguf package is not installed.
    """
    gguf = require_gguf()
    start = time.perf_counter()
    if gguf_type not in GGUF_TYPES:
        raise ConfigError(f"--gguf-type {gguf_type!r} is not one poros writes; use one of {', '.join(GGUF_TYPES)}.")
    target = pathlib.Path(output).expanduser()
    if target.is_dir() or (target.exists() and not overwrite):
        raise ConfigError(f"--output {target} exists{' and is a directory' if target.is_dir() else ''}; pass a new "
                          f"file name{'' if target.is_dir() else ', or --overwrite to replace it'}.")
    plan = plan_merge(adapter, model, floating_dtype(dtype))
    arch = gguf_architecture(getattr(plan.checkpoint.text_config, "model_type", None))
    tensors = layout(plan, arch, gguf_type)
    staging = target.with_name(f".{target.name}.partial")
    writer = gguf.GGUFWriter(staging, arch.arch)
    write_metadata(writer, plan, arch, gguf_type)
    for item in tensors:  # GGUF lists every tensor before the data: shapes and types from the headers
        byte_shape = gguf.quant_shape_to_byte_shape(item.shape, item.qtype)
        writer.add_tensor_info(item.name, byte_shape, gguf.np.uint8, _product(byte_shape), raw_dtype=item.qtype)
    merged_modules: set[str] = set()
    total_bytes = 0
    shards = plan.checkpoint.weight_files
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for number, path in enumerate(shards):
            with ShardReader(path) as reader:
                for item in (item for item in tensors if item.shard == number):  # the order the infos list
                    data = convert(plan.merged(item.key, reader.read(item.key), device, merged_modules), item.qtype)
                    writer.write_tensor_data(data.view(gguf.np.uint8))  # one tensor in memory at a time
                    total_bytes += data.nbytes
                    del data
            if progress is not None:
                progress_line(progress, number + 1, len(shards), len(merged_modules), len(plan.modules), start)
        plan.check_all_merged(merged_modules)
        writer.close()
        os.replace(staging, target)
    except BaseException:  # nothing half-written is left behind
        writer.close()
        staging.unlink(missing_ok=True)
        raise
    tokenizer = load_tokenizer(tokenizer_source(plan))
    modelfile = write_modelfile(target, tokenizer)
    return GgufResult(target, plan.base_path, 1, len(tensors), len(merged_modules), total_bytes,
                      time.perf_counter() - start, peak_rss(), [modelfile], gguf_type=gguf_type,
                      architecture=arch.arch, tokenizer_pre=tokenizer_pre(tokenizer), modelfile=modelfile)


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def require_gguf() -> Any:
    """The ``gguf`` package (gguf-py, llama.cpp's own writer).

    Raises:
        MissingDependencyError: it is not installed (the fix names the extra).
    """
    try:
        import gguf
    except ImportError as error:
        raise MissingDependencyError(
            f"poros merge --format gguf needs the gguf package (llama.cpp's gguf-py), which is not installed "
            f"({error}). Fix: pip install 'poros-train[gguf]' (or pip install gguf).") from error
    return gguf


def write_metadata(writer: Any, plan: Any, arch: GgufArchitecture, gguf_type: str) -> None:
    """``general.*``, the architecture's hyperparameters and the tokenizer, as llama.cpp reads them.

    Raises:
        UnsupportedModelError: sliding-window attention, or a RoPE scaling llama.cpp's architecture lacks.
    """
    import gguf

    config = plan.checkpoint.text_config
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"the base uses sliding-window attention (use_sliding_window: true, window {config.sliding_window}); "
            f"llama.cpp's {arch.arch} attends to every token, so it would compute another model. Fix: merge to "
            "safetensors (poros merge without --format) and serve it with transformers or vLLM.")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(_model_name(plan.info.base_model))
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _rope(writer, config, arch)
    write_tokenizer(writer, plan, arch)


def _rope(writer: Any, config: Any, arch: GgufArchitecture) -> None:
    import gguf

    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(
            f"the base scales RoPE with {kind!r}; GGUF for {arch.arch} is written with linear or yarn scaling only. "
            "Fix: merge to safetensors (poros merge without --format).")
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if kind == "linear" else gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    if kind == "yarn" and rope.get("original_max_position_embeddings"):
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def _model_name(base: str) -> str:
    return pathlib.Path(str(base).rstrip("/")).name or str(base)


__all__ = ["GGUF_ARCHITECTURES", "GGUF_TYPES", "GgufArchitecture", "GgufResult", "PlannedTensor", "convert",
           "added_specials", "gguf_architecture", "layout", "load_tokenizer", "merge_to_gguf", "require_gguf",
           "tensor_type", "tokenizer_pre", "tokenizer_source", "write_metadata", "write_tokenizer"]

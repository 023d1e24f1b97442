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
merge`` does; for an MoE checkpoint with one matrix per expert, one layer's matrices of one
projection, stacked into the one GGUF tensor llama.cpp reads.

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
  architecture and its converter (:mod:`poros.export.gguf_arch`: Qwen2/Qwen3 as they are; Qwen3.5 MoE's
  stacked experts and DeltaNet transforms; Gemma 4's fused experts, router scales and ``rope_freqs``); a
  model type without an entry is refused by name. A GGUF tensor is a function of its checkpoint tensors
  (one, or every expert's matrix of one projection): the layout runs it on meta tensors, the data pass on
  the merged tensors, so the host holds one GGUF tensor's sources at a time.
* **Atomic.** The file is written beside its name and renamed into place once complete.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from poros.errors import ConfigError, MissingDependencyError, UnsupportedModelError
from poros.export.gguf_arch import GGUF_ARCHITECTURES, GgufArchitecture, Planned, Source, converter_dtype
from poros.export.modelfile import write_modelfile
from poros.export.merge import (MergeResult, ShardReader, floating_dtype, model_key, peak_rss, plan_merge,
                                progress_line)
from poros.spellings import human_bytes
from poros.export.gguf_tokenizer import added_specials, load_tokenizer, tokenizer_pre, tokenizer_source, write_tokenizer


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
    """One tensor of the GGUF file, laid out before any data is read: llama.cpp's name, its shape (torch order) and
    type, and how it is made from the checkpoint (:class:`poros.export.gguf_arch.Planned`)."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    planned: Planned

    @property
    def shard(self) -> int:
        """The shard of its first source (-1: a generated tensor)."""
        return self.planned.sources[0].shard if self.planned.sources else -1


def gguf_architecture(model_type: str | None) -> GgufArchitecture:
    """The GGUF architecture of an HF ``model_type``.

    Raises:
        UnsupportedModelError: no entry in :data:`GGUF_ARCHITECTURES` (the message lists them).
    """
    found = GGUF_ARCHITECTURES.get(model_type or "")
    if found is None:
        raise UnsupportedModelError(
            f"poros merge --format gguf writes the model types {', '.join(sorted(GGUF_ARCHITECTURES))}; "
            f"this base is model_type {model_type!r}. Fix: merge to safetensors (poros merge without --format) and "
            "convert that with llama.cpp's convert_hf_to_gguf.py.")
    return found


#: gguf-py's tensors the converter always writes in F32 (``prepare_tensors``: the router, the shared expert's
#: gate, DeltaNet's convolution), by their names' patterns
ALWAYS_F32 = ("FFN_GATE_INP", "FFN_GATE_INP_SHEXP", "POS_EMBD", "TOKEN_TYPES", "SSM_CONV1D")


def tensor_type(name: str, shape: tuple[int, ...], gguf_type: str) -> Any:
    """The GGUF type of a tensor, as convert_hf_to_gguf.py chooses it: F32 for one-dimensional tensors, norms,
    anything that is not a ``.weight`` and the tensors it always keeps in F32 (:data:`ALWAYS_F32`); the type asked
    for the rest, F16 where Q8_0's blocks do not divide a row."""
    import gguf

    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or any(
            re.fullmatch(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[kind]].replace("{bid}", r"\d+") + r"\.weight", name)
            for kind in ALWAYS_F32):
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
    """Every tensor of the GGUF file with its llama.cpp name, shape and type, from the shards' headers only (the
    architecture's converter, :mod:`poros.export.gguf_arch`, says which checkpoint tensors make it and how).

    Raises:
        UnsupportedModelError: a checkpoint tensor llama.cpp's architecture has no name for (a module llama.cpp
            does not implement), or an incomplete set of experts.
    """
    sources = []
    for shard, path in enumerate(plan.checkpoint.weight_files):
        with ShardReader(path) as reader:
            for key, (_, shape) in reader.tensors.items():
                sources.append(Source(shard, key, model_key(key, plan.checkpoint.key_mapping or {}), tuple(shape)))
    planned = []
    for item in arch.converter(arch.arch, plan.checkpoint.text_config).plan(sources):
        shape = item.shape()
        planned.append(PlannedTensor(item.name, shape, tensor_type(item.name, shape, gguf_type), item))
    return planned


def tensor_data(item: PlannedTensor, readers: dict[int, Any], plan: Any, device: str, merged_modules: set[str]) -> Any:
    """The bytes gguf-py writes for ``item``: its checkpoint tensors read, merged (:meth:`MergePlan.merged`), in
    the dtype the converter transforms them in, through the converter's transform, converted to its type."""
    sources = [converter_dtype(plan.merged(source.key, readers[source.shard].read(source.key), device, merged_modules))
               for source in item.planned.sources]
    tensor = item.planned.build(sources)
    del sources
    return convert(tensor, item.qtype)


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
    pre = write_metadata(writer, plan, arch, gguf_type)
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
        with contextlib.ExitStack() as stack:  # the order the infos list; a tensor's sources may span shards
            readers = {number: stack.enter_context(ShardReader(path)) for number, path in enumerate(shards)}
            done = 0
            for item in tensors:
                data = tensor_data(item, readers, plan, device, merged_modules)
                writer.write_tensor_data(data.view(gguf.np.uint8))  # one GGUF tensor in memory at a time
                total_bytes += data.nbytes
                del data
                if progress is not None and item.shard > done:
                    done = item.shard
                    progress_line(progress, done, len(shards), len(merged_modules), len(plan.modules), start)
        if progress is not None:
            progress_line(progress, len(shards), len(shards), len(merged_modules), len(plan.modules), start)
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
                      architecture=arch.arch, tokenizer_pre=pre, modelfile=modelfile)


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


def write_metadata(writer: Any, plan: Any, arch: GgufArchitecture, gguf_type: str) -> str:
    """``general.*``, the architecture's hyperparameters (its converter's, :mod:`poros.export.gguf_arch`) and the
    tokenizer, as llama.cpp reads them; returns the pre-tokenizer written.

    Raises:
        UnsupportedModelError: sliding-window attention the architecture lacks, a RoPE scaling it lacks, or a
            tokenizer llama.cpp cannot reproduce.
    """
    import gguf

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(_model_name(plan.info.base_model))
    writer.add_file_type(gguf.LlamaFileType[GGUF_TYPES[gguf_type][1]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    converter = arch.converter(arch.arch, plan.checkpoint.text_config)
    converter.metadata(writer)
    return converter.write_vocabulary(writer, plan, arch)


def _model_name(base: str) -> str:
    return pathlib.Path(str(base).rstrip("/")).name or str(base)


__all__ = ["GGUF_ARCHITECTURES", "GGUF_TYPES", "GgufArchitecture", "GgufResult", "PlannedTensor", "convert",
           "added_specials", "gguf_architecture", "layout", "load_tokenizer", "merge_to_gguf", "require_gguf",
           "tensor_type", "tokenizer_pre", "tokenizer_source", "write_metadata", "write_tokenizer"]

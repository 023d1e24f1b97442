"""safetensors shards one tensor at a time, without the ``safetensors`` package's whole-file load:
:class:`ShardReader` reads a tensor with plain file reads (no memory map, so the process holds only the
tensor asked for), :class:`ShardWriter` writes the header first and then each tensor's bytes as it comes,
laid out as ``safetensors.torch.save_file`` lays them out. What ``poros merge`` (:mod:`poros.export.merge`)
and its GGUF writer stream the base through.
"""

from __future__ import annotations

import copy
import json
import pathlib
import struct
from typing import Any

import torch

from poros.errors import CheckpointLoadError


#: torch dtype -> safetensors dtype name (the header's "dtype")
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
SAFETENSORS_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class ShardReader:
    """Reads one safetensors file tensor by tensor with plain file reads (no memory map), so that the
    process holds only the tensor asked for, not the pages of the whole file.

    Attributes:
        metadata: the header's ``__metadata__``.
        tensors: name -> (dtype, shape), in file order.
    """

    def __init__(self, path: pathlib.Path) -> None:
        self._file = open(path, "rb")
        (length,) = struct.unpack("<Q", self._file.read(8))
        header = json.loads(self._file.read(length))
        self._data_start = 8 + length
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._spans = {name: tuple(entry["data_offsets"]) for name, entry in header.items()}
        self.tensors = {name: (SAFETENSORS_DTYPES_BY_NAME[entry["dtype"]], tuple(entry["shape"]))
                        for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])}

    def read(self, name: str) -> torch.Tensor:
        dtype, shape = self.tensors[name]
        start, end = self._spans[name]
        data = torch.empty(end - start, dtype=torch.uint8)
        self._file.seek(self._data_start + start)
        if end > start and self._file.readinto(data.numpy()) != end - start:
            raise CheckpointLoadError(f"{self._file.name} ends inside tensor {name}: the file is truncated. "
                                      "Download or copy the shard again.")
        return data.view(dtype).reshape(shape)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


class ShardWriter:
    """Writes one safetensors file tensor by tensor: the header first (names, dtypes, shapes known from the
    input shard), then each tensor's bytes as it comes, so only the tensor in hand is in memory.

    Tensors are laid out as ``safetensors.torch.save_file`` lays them out (larger elements first, then by
    name: every tensor stays aligned to its element size); :attr:`names` is that order, and
    :meth:`write` must be called in it.
    """

    def __init__(self, path: pathlib.Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str]) -> None:
        ordered = sorted(entries, key=lambda e: (-element_size(e[2]), e[0]))
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self.expected: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, shape, dtype in ordered:
            size = element_size(dtype)
            for dim in shape:
                size *= dim
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
            self.expected.append((name, tuple(shape), dtype))
        self.names = [name for name, _, _ in self.expected]
        self.data_bytes = offset
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != expected:
            raise RuntimeError(f"ShardWriter: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected {expected}")
        self._next += 1
        if tensor.numel():
            self._file.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()
        if exc[0] is None and self._next != len(self.expected):
            raise RuntimeError(f"ShardWriter: {len(self.expected) - self._next} tensors were not written")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_DTYPES_BY_NAME", "ShardReader", "ShardWriter", "element_size"]

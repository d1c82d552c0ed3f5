"""A safetensors file written straight from tensor memory (the publish writer's hot path).

safetensors' own `save_file` first copies every tensor into a Python `bytes` object, holding
the GIL, and only then writes: at 8B scale that is a second full copy of each 87 MB adapter,
made while the trainer's main thread competes for the GIL. Here the header is built from
shapes and dtypes, and each tensor's bytes go to the file from its own memory (a memoryview of
the tensor; `FileIO.write` releases the GIL during the system call), so several writer threads
proceed in parallel and nothing is copied in Python.

The file is the format safetensors defines (8-byte little-endian header length, a JSON header
of name -> dtype, shape, data_offsets plus `__metadata__`, padded with spaces to a multiple of
8, then the data), laid out as safetensors lays it out itself: tensors ordered by dtype size
(largest first) and then by name. Tests check it byte for byte against `save_file`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.storage.folder_io import write_all

# torch dtype -> safetensors dtype name (the ones an export or checkpoint writes)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU, contiguous; storage may be shared between them) to ``path``."""
    for name, t in tensors.items():
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensor {name}: needs a contiguous CPU tensor, got {t.device} contiguous={t.is_contiguous()}")
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} is not one of {', '.join(map(str, SAFETENSORS_DTYPES))}")
    order = file_order({n: (t.dtype, t.shape) for n, t in tensors.items()})
    with open(path, "wb", buffering=0) as f:
        write_all(f, _header([(n, tensors[n].dtype, tensors[n].shape) for n in order], metadata))
        for name in order:
            t = tensors[name]
            if t.numel():
                write_all(f, _bytes(t))


@dataclass(frozen=True)
class PackedHeader:
    """The header of a file whose tensors lie back to back in one body (packed_header), and the
    body's byte size it declares."""

    raw: bytes
    body_nbytes: int


def packed_header(entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                  metadata: dict[str, str] | None = None) -> PackedHeader:
    """The header for tensors of one ``dtype`` named with their shapes in ``entries``, in file
    order (`file_order`): safetensors' own layout. Building it is a few ms of Python for a
    model's worth of tensors, so a publish writer makes it once per layout (trainer/export/slot_export.py
    export_layout) instead of once per file."""
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(map(str, SAFETENSORS_DTYPES))}")
    items = [(name, dtype, torch.Size(shape)) for name, shape in entries]
    if [n for n, _, _ in items] != file_order({n: (d, s) for n, d, s in items}):
        raise ValueError("entries must be in file order (by name for one dtype): safetensors' own layout")
    return PackedHeader(_header(items, metadata), sum(shape.numel() for _, _, shape in items) * dtype.itemsize)


def write_packed(path: str | Path, header: PackedHeader, body: torch.Tensor) -> None:
    """``header`` then ``body`` (1-D, CPU, contiguous: the tensors back to back) in ONE write: the
    writer thread takes the GIL twice per file instead of once per tensor."""
    if body.device.type != "cpu" or body.dim() != 1 or not body.is_contiguous():
        raise ValueError(f"body: needs a 1-D contiguous CPU tensor, got {body.device} shape {tuple(body.shape)}")
    if body.numel() * body.element_size() != header.body_nbytes:
        raise ValueError(f"entries hold {header.body_nbytes} bytes, body has {body.numel() * body.element_size()}")
    with open(path, "wb", buffering=0) as f:
        write_all(f, header.raw)
        if body.numel():
            write_all(f, _bytes(body))


def file_order(specs: dict[str, tuple[torch.dtype, torch.Size]]) -> list[str]:
    """The order safetensors lays tensors out in: larger dtypes first, then by name."""
    return sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))


def _header(items: list[tuple[str, torch.dtype, torch.Size]], metadata: dict[str, str] | None) -> bytes:
    """8-byte length, then the JSON header of ``items`` (in file order), space-padded so the data
    starts 8-byte aligned."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in items:
        end = offset + shape.numel() * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())

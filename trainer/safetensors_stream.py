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
from pathlib import Path

import torch

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
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        end = offset + t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
    with open(path, "wb", buffering=0) as f:
        _write_all(f, struct.pack("<Q", len(raw)) + raw)
        for name in order:
            t = tensors[name]
            if t.numel():
                _write_all(f, memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def _write_all(f, data) -> None:  # noqa: ANN001 - a raw (unbuffered) binary file
    """FileIO.write may write less than asked (a signal, a full pipe); regular files rarely do."""
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]

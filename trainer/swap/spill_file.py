"""One evicted slot's snapshot as a file in the spill folder: written atomically, checksummed,
read back into (pinned) host memory in one piece.

Layout (little-endian):
    MAGIC (8 bytes) | header length (u64) | header CRC-32 (u32) | header (JSON, utf-8) |
    padding to 64 | payload
The header holds the key, the counters (``meta``), and each payload part's dtype, shape, offset
and the CRC-32 of every CHUNK-sized piece of it. The payload holds the pending loss
statistics (float64) and the four buffer rows, raw bytes, each part 64-byte aligned, so a read
is one ``readinto`` into one host buffer and the rows are views of it: no format conversion,
so nothing is rounded.

Invariants:
  F1 a spill file appears under its final name only whole: written to ``<name>.tmp``, flushed
     and fsynced (a full disk fails the write, not a later read), then renamed;
  F2 a file is loaded only after every checksum matches (header and payload pieces); any
     mismatch, a truncated file or a foreign format is a ``SpillFileError`` naming the file,
     never rows with wrong bytes.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"LFSWAP1\n"
FORMAT = "lorafleet-slot-swap-v1"
ALIGN = 64
CHUNK = 16 * 2**20  # payload bytes per CRC-32 (pieces are checked in parallel)
_PREFIX = struct.Struct("<8sQI")  # magic, header length, header CRC-32
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_crc_pool: ThreadPoolExecutor | None = None


class SpillFileError(RuntimeError):
    """A spill file that cannot be loaded as written (corrupt, truncated, not ours)."""


def _pool() -> ThreadPoolExecutor:
    global _crc_pool
    if _crc_pool is None:  # zlib.crc32 releases the GIL on large buffers: the pieces run in parallel
        _crc_pool = ThreadPoolExecutor(max_workers=max(1, min(8, (os.cpu_count() or 1) // 2)),
                                       thread_name_prefix="swap-crc")
    return _crc_pool


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous host tensor, without a copy."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def chunk_crcs(payload: memoryview) -> list[int]:
    pieces = [payload[i : i + CHUNK] for i in range(0, len(payload), CHUNK)]
    return list(_pool().map(zlib.crc32, pieces))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class EncodedSpill:
    """A snapshot ready to be written: its file head (prefix, header, padding) and payload parts."""

    head: bytes
    parts: list[tuple[memoryview, int]]  # (bytes, zero padding after them)

    @property
    def size(self) -> int:
        return len(self.head) + sum(len(v) + pad for v, pad in self.parts)


def encode_spill(key: str, meta: dict, pending: torch.Tensor, rows: dict[str, torch.Tensor]) -> EncodedSpill:
    """The file of a snapshot, checksums computed, nothing written (views of the rows, no copy)."""
    tensors = {"pending": pending.to(torch.float64).contiguous()} | {k: v.contiguous() for k, v in rows.items()}
    layout, parts, offset = [], [], 0
    for name, t in tensors.items():
        view = _bytes_view(t)
        layout.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "offset": offset, "nbytes": len(view), "crc32": chunk_crcs(view)})
        parts.append((view, _aligned(len(view)) - len(view)))
        offset = _aligned(offset + len(view))
    header = json.dumps({"format": FORMAT, "key": key, "meta": meta, "parts": layout, "payload_bytes": offset,
                         "chunk": CHUNK}).encode()
    head = _PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header
    return EncodedSpill(head=head + b"\0" * (_aligned(len(head)) - len(head)), parts=parts)


def write_spill_file(path: Path, spill: EncodedSpill) -> None:
    """Write the encoded snapshot to ``path`` (F1). OSError on any failure, with the temporary
    file removed."""
    tmp = path.with_name(path.name.removesuffix(".swap") + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(spill.head)
            for view, pad in spill.parts:
                f.write(view)
                f.write(b"\0" * pad)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # the folder itself is unusable (e.g. a file in its place): nothing was written
            pass
        raise


def read_spill_file(path: Path, key: str, *, pin: bool) -> tuple[dict, torch.Tensor, dict[str, torch.Tensor]]:
    """(meta, pending, rows) of the file, verified (F2); the rows are views of one host buffer,
    pinned when ``pin``. SpillFileError when the file is not what was written; OSError when it
    cannot be read."""
    with open(path, "rb") as f:
        prefix = f.read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            raise SpillFileError(f"{path}: truncated ({len(prefix)} bytes)")
        magic, header_len, header_crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise SpillFileError(f"{path}: not a lorafleet spill file")
        raw = f.read(header_len)
        if len(raw) != header_len or zlib.crc32(raw) != header_crc:
            raise SpillFileError(f"{path}: header checksum mismatch (the file is corrupt or truncated)")
        header = json.loads(raw)
        if header.get("format") != FORMAT or header.get("key") != key:
            raise SpillFileError(f"{path}: holds {header.get('key')!r} in {header.get('format')!r}, expected {key!r}")
        f.seek(_aligned(_PREFIX.size + header_len))
        payload = torch.empty(header["payload_bytes"], dtype=torch.uint8, pin_memory=pin)
        view = _bytes_view(payload)
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise SpillFileError(f"{path}: truncated payload ({got} of {len(view)} bytes)")
            got += n
    parts = {}
    for entry in header["parts"]:
        start, n = entry["offset"], entry["nbytes"]
        if header["chunk"] != CHUNK or start + n > len(view) or chunk_crcs(view[start : start + n]) != entry["crc32"]:
            raise SpillFileError(f"{path}: {entry['name']} checksum mismatch (the file is corrupt); its snapshot is not loaded")
        parts[entry["name"]] = payload[start : start + n].view(_DTYPES[entry["dtype"]]).view(entry["shape"])
    pending = parts.pop("pending")
    return header["meta"], pending, parts

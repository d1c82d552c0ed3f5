"""The slot-state folder's names and its metadata file: light to import (no torch, no trainer).

A slot-state folder (written by trainer/swap/slot_checkpoint.py) holds ``slot_state.json`` (format
tag, hyper-parameters, rank, scale, seed, registration, step, pending statistics, the model it
was saved for) and ``slot_state.safetensors`` (the tensors: fp32, but the Adam moments in the slot's
``hyper.state_dtype``, bf16 for a compact optimizer state; a folder written before that field
existed reads as float32). The coordinator reads the metadata
without loading the tensors (a Tinker checkpoint's LoRA shape: service/tenants/tinker_model.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FORMAT = "lorafleet-slot-state-v1"
META = "slot_state.json"
TENSORS = "slot_state.safetensors"


def read_slot_meta(folder: str | Path) -> dict[str, Any] | None:
    """The folder's slot-state metadata, or None when it holds no slot state."""
    meta_file = Path(folder) / META
    if not meta_file.is_file():
        return None
    return json.loads(meta_file.read_text())

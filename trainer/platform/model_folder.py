"""The base model's Hugging Face folder: its ``config.json``, read in this one place.

Standard library only (no torch, no Ray), so service/ and rollout/ read the model's config
through it as well as the trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.json"


def read_model_config(model_path: str | Path) -> dict:
    """The folder's config.json as a dict. FileNotFoundError when the folder has none; ValueError
    when it is not a JSON object; another OSError when it cannot be read. Each names the file."""
    path = Path(model_path) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"base model folder {str(model_path)!r} has no {CONFIG_FILE} (expected a Hugging Face checkpoint)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a JSON {type(cfg).__name__}, expected an object")
    return cfg

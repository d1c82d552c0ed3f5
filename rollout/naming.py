"""Request ids and served LoRA names: the two string encodings the engines see.

* Request id: ``<adapter>::<uuid4 hex>``. SGLang's scheduler matches an abort's
  rid with ``startswith`` (FINDINGS.md: aborting ``jobX`` also killed
  ``jobX-2``), so rids must be *prefix-free*: no rid may be a prefix of
  another. Adapter names cannot contain ':' and the suffix is always 32 hex
  digits, so a rid ends exactly where its "::" + 32 hex digits end, and two
  different rids are never prefixes of each other.
* Served LoRA name of a version: ``<adapter>@v<version>``. Adapter names cannot
  contain '@', so the name decodes unambiguously.
"""

from __future__ import annotations

import re
import uuid

from rollout.config import ADAPTER_NAME_PATTERN

RID_SEPARATOR = "::"
VERSION_SEPARATOR = "@v"
_NAME = ADAPTER_NAME_PATTERN.removeprefix("^").removesuffix("$")  # the one adapter-name rule (rollout/config.py)
_LORA_RE = re.compile(rf"^(?P<adapter>{_NAME})@v(?P<version>\d+)$")


def new_rid(adapter: str) -> str:
    """A fresh request id for one request of `adapter`."""
    return f"{adapter}{RID_SEPARATOR}{uuid.uuid4().hex}"


def rid_prefix(adapter: str) -> str:
    """The prefix every rid of `adapter` starts with (for servers with native prefix abort)."""
    return f"{adapter}{RID_SEPARATOR}"


def lora_name(adapter: str, version: int) -> str:
    """The name version `version` of `adapter` is loaded under on the engines."""
    if version < 0:
        raise ValueError(f"adapter versions are >= 0, got {version}")
    return f"{adapter}{VERSION_SEPARATOR}{version}"


def served_by(name: str, adapter: str) -> bool:
    """Whether a loaded LoRA name belongs to `adapter` (any version, or the bare name)."""
    m = _LORA_RE.match(name)
    return name == adapter or (m is not None and m["adapter"] == adapter)

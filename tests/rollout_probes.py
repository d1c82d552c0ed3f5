"""What tests do to or read from the rollout side, kept out of the production classes.

* ``wait_unloaded(pool)``: wait until every unload the engine pool scheduled has run
  (rollout/engines/pool.py: an adapter's old versions are unloaded in the background);
* ``kill_engine(engine)``: the named fault of the engine-failure tests: SIGKILL a managed SGLang
  server's whole process group at once (rollout/engines/engine.py ``EngineProcess``);
* ``adapter_of_rid(rid)``, ``parse_lora_name(name)``: the two encodings of rollout/naming.py
  decoded from their stated formats (``<adapter>::<32 hex digits>``, ``<adapter>@v<version>``),
  not from its code, so the tests check its encoders against the definitions.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

from rollout.config import ADAPTER_NAME_RE  # the one adapter-name rule


async def wait_unloaded(pool, timeout_s: float = 30.0) -> None:  # noqa: ANN001 - a rollout.engines.pool.EnginePool
    """Every unload the pool has scheduled so far has run (its errors are the pool's to log)."""
    tasks = list(pool._unload_tasks)  # noqa: SLF001 - the pool's own set of scheduled unloads
    if tasks:
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout_s)


def kill_engine(engine) -> None:  # noqa: ANN001 - a rollout.engines.engine.EngineProcess
    """SIGKILL the server and every process it started (the server leads its own process group)."""
    if engine.pid is None:
        return
    try:
        os.killpg(os.getpgid(engine.pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def adapter_of_rid(rid: str) -> str:
    """The adapter of a request id ``<adapter>::<32 lowercase hex digits>``; ValueError otherwise."""
    adapter, sep, uid = rid.rpartition("::")
    if not sep or ADAPTER_NAME_RE.fullmatch(adapter) is None or re.fullmatch(r"[0-9a-f]{32}", uid) is None:
        raise ValueError(f"{rid!r} is not a lorafleet request id ('<adapter>::<32 hex digits>')")
    return adapter


def parse_lora_name(name: str) -> tuple[str, int]:
    """(adapter, version) of a served LoRA name ``<adapter>@v<version>``; ValueError otherwise."""
    adapter, sep, version = name.rpartition("@v")
    if not sep or ADAPTER_NAME_RE.fullmatch(adapter) is None or re.fullmatch(r"[0-9]+", version) is None:
        raise ValueError(f"{name!r} is not a versioned lorafleet LoRA name ('<adapter>@v<version>')")
    return adapter, int(version)

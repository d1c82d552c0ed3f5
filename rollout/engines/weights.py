"""One version of an adapter's LoRA weights, and the two ways it travels to an engine.

Weights are PEFT-named (``base_model.model.<HF module>.lora_A.weight`` ...) with
the PEFT ``adapter_config.json`` as a dict, so the same object is loadable by
peft, SGLang and vLLM. They come either as tensors (from the trainer's export)
or as a PEFT folder (``init_from``, a checkpoint); either can be sent either way:

* ``tensors``: SGLang's ``/load_lora_adapter_from_tensors``. Wire format (from
  sglang 0.5.23: io_struct.LoadLoRAAdapterFromTensorsReqInput, tp_worker,
  utils.common.SafeUnpickler): ``serialized_named_tensors`` is a list with one
  entry per TP rank, each the base64 text of a pickle of ``{name: tensor}``.
  SGLang's own Engine pickles with torch's ForkingPickler, which passes CPU
  tensors as shared-memory handles that only work inside one machine; a plain
  ``pickle`` stores the bytes (torch pickles storages through
  ``torch.storage._load_from_bytes``, which SGLang's SafeUnpickler maps to a
  weights-only ``torch.load``), so it works across machines with no shared
  filesystem.
* ``disk``: a PEFT folder the server reads with ``/load_lora_adapter`` (engines on the
  trainer's node). The service's hot path (issue 18): the trainer writes the folder itself
  (safetensors: raw tensor bytes, no pickle, no base64) into the state dir's handoff folder,
  and only the path travels. Such a folder is a *handoff* folder (`handoff=True`): written for
  this one version, it is deleted (`discard`) once no engine can need it again (superseded by
  a newer version that every engine in routing loaded, a failed publish, a removed adapter);
  rollout/engines/pool.py `EnginePool` does that, so the folder count stays at one per live adapter
  (plus publishes in flight).
"""

from __future__ import annotations

import base64
import json
import pickle
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


_PICKLE_LOCK = threading.Lock()


def _pickle_with_torch_storage_reducer(obj: Any) -> bytes:
    """pickle.dumps, with tensor storages named as torch pickles them (torch.storage._load_from_bytes).

    Importing megatron.core (which happens in any process that unpickles a trainer
    result or a tensor pickled next to Megatron) replaces torch.storage._load_from_bytes
    with megatron.core.safe_globals.safe_load_from_bytes; storages pickled afterwards
    name that function, and SGLang's SafeUnpickler refuses it ("Blocked unsafe global").
    While pickling, the module attribute is a function that pickles under torch's own
    name and loads the same way the current one does."""
    import torch.storage as ts

    with _PICKLE_LOCK:
        current = ts._load_from_bytes
        if getattr(current, "__module__", "torch.storage") == "torch.storage":
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

        def _load_from_bytes(b):
            return current(b)

        _load_from_bytes.__module__ = "torch.storage"
        _load_from_bytes.__qualname__ = "_load_from_bytes"
        ts._load_from_bytes = _load_from_bytes
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            ts._load_from_bytes = current


class AdapterWeights:
    """LoRA weights of one adapter version: a PEFT config dict plus tensors or a folder.

    Invariant: at least one of `tensors` and `folder` is set; when both are,
    they hold the same weights. `handoff`: the folder was written for this object alone
    (the service's handoff folder, or `ensure_folder`), so `discard` may delete it."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None, folder: str | None = None,
                 *, handoff: bool = False):
        if tensors is None and folder is None:
            raise ValueError("AdapterWeights needs tensors or a PEFT folder")
        if not isinstance(config, dict) or "r" not in config:
            raise ValueError("AdapterWeights.config must be a PEFT adapter_config dict (with 'r')")
        self.config = dict(config)
        self.tensors = None if tensors is None else {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        self.folder = None if folder is None else str(folder)
        self.handoff = bool(handoff) and folder is not None
        self._payload: str | None = None

    @classmethod
    def from_folder(cls, folder: str | Path, *, handoff: bool = False) -> AdapterWeights:
        """A PEFT adapter folder; refused with a message naming the missing file. `handoff`: written for
        this version alone (deleted by `discard`); never set it on a checkpoint or a tenant's folder."""
        folder = Path(folder)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            if not (folder / name).is_file():
                raise ValueError(f"{folder} is not a PEFT adapter folder: {name} is missing")
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        return cls(config, folder=str(folder.resolve()), handoff=handoff)

    def discard(self) -> None:
        """Delete the folder if it is a handoff folder (no engine will read it again); else nothing.
        The tensors, if any, stay usable."""
        if self.handoff and self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder, self.handoff = None, False

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def load_tensors(self) -> dict[str, torch.Tensor]:
        if self.tensors is None:
            if self.folder is None:
                raise ValueError("these weights were discarded (their handoff folder is deleted)")
            from safetensors.torch import load_file

            self.tensors = load_file(str(Path(self.folder) / ADAPTER_WEIGHTS))
        return self.tensors

    def wire_payload(self) -> str:
        """Base64 text of a plain pickle of the tensors (one TP rank's entry of serialized_named_tensors)."""
        if self._payload is None:
            raw = _pickle_with_torch_storage_reducer(dict(self.load_tensors()))
            self._payload = base64.b64encode(raw).decode("ascii")
        return self._payload

    def ensure_folder(self, dest: str | Path) -> str:
        """A PEFT folder with these weights: the existing one, else written to `dest` (a fresh folder
        for this object alone: it becomes a handoff folder, deleted by `discard`)."""
        if self.folder is not None:
            return self.folder
        if self.tensors is None:
            raise ValueError("these weights were discarded (their handoff folder is deleted)")
        from safetensors.torch import save_file

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone() for k, v in self.tensors.items()}, str(dest / ADAPTER_WEIGHTS))  # clone: shared lora_A storage
        (dest / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        self.folder, self.handoff = str(dest.resolve()), True
        return self.folder

    def __getstate__(self):
        # Ray / pickle: drop the cached payload (rebuilt on demand, and larger than the tensors),
        # and ship the tensors as safetensors bytes: a pickled torch storage names the function
        # that rebuilds it, which in a process that imported megatron.core is Megatron's, so
        # unpickling it would import Megatron into the receiver (seconds of a blocked event
        # loop in the rollout worker) — see _pickle_with_torch_storage_reducer.
        state = dict(self.__dict__)
        state["_payload"] = None
        if self.tensors is not None:
            from safetensors.torch import save

            # clone: fused projections share one lora_A tensor, and safetensors refuses shared storage
            state["tensors"] = save({k: v.clone() for k, v in self.tensors.items()})
        return state

    def __setstate__(self, state):
        if isinstance(state.get("tensors"), bytes):
            from safetensors.torch import load

            state = {**state, "tensors": load(state["tensors"])}
        self.__dict__.update(state)


class VersionSuperseded(Exception):
    """The trainer never wrote this version's handoff folder: a newer publish of the same adapter
    replaced it while it waited for the writer (latest-wins, trainer/export/export_writer.py). Not a
    failure: the version is simply never served."""


class PendingFolder:
    """A handoff folder the trainer is still writing: its path and the trainer calls writing it
    (Ray ObjectRefs, or any awaitables). The coordinator sends this instead of AdapterWeights so
    it never waits for the write (issue 18); the rollout worker awaits `ready()` before loading."""

    def __init__(self, folder: str | Path, writers: list[Any]):
        self.folder = str(folder)
        self.writers = list(writers)

    async def ready(self) -> AdapterWeights:
        """The written folder as handoff weights. Raises VersionSuperseded when a writer answered
        that a newer version superseded it (nothing was written), and the trainer's error if a
        write failed (the folder and any half-written temporary of it are then deleted: nothing
        will read them)."""
        import asyncio

        from trainer.export.export_writer import Superseded
        from trainer.storage.folder_io import remove_partial_writes

        try:
            results = await asyncio.gather(*self.writers)
            superseded = [r for r in results if isinstance(r, Superseded)]
            if superseded:
                raise VersionSuperseded(f"{self.folder} was superseded by {superseded[0].by} before it was written")
            return AdapterWeights.from_folder(self.folder, handoff=True)
        except VersionSuperseded:
            raise
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            remove_partial_writes(self.folder)  # a trainer rank killed mid-write leaves its temporary
            raise

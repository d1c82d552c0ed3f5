"""Publishing a stepped RL run's weights to the engines: `Publisher` (the loop's steps 4 and 4b).

A publish hands the run's current weights to the rollout worker as a new version, and returns
as soon as the weights are taken from the trainer: with weight_transfer 'disk' at once (the
trainer snapshots the slot before its next call and writes the handoff folder on a writer
thread while that call runs; the rollout worker waits for the write, not the loop), with
'tensors' after the tensors came back. The engines load the version while the loop goes on
(the rollout worker applies one adapter's publishes in order, and any later remove/abort of the
adapter after them; its buffer counts the version as published before the load starts, so
groups of older weights are already one behind: service/loop/training_loop.py G1).

Invariants:
  U1 the registry's served version moves only when a publish finished (`settle` reports it;
     the loop calls mark_served), never before the engines have it (training_loop.py G3);
  U2 a failed publish of a run's newest version is published again under a fresh version, at
     most REPUBLISH_AT_MOST times in a row (then the run's next step publishes); a failed
     older version is not (a newer one is on its way);
  U3 a failed publish's handoff folder is removed (nothing reads it again); handoff folders of a
     previous process are never read (the folder starts empty);
  U4 latest-wins: a publish whose version a newer one of the same run superseded before it was
     written (the trainer's writer drops it, trainer/export/export_writer.py) or loaded (the rollout worker
     loaded the newer one first) is reported superseded by the rollout worker: it is left out of the
     outcomes, so it is never marked served and never republished (it still counted for staleness:
     it was a real step);
  U5 handoff folders are files of the state dir on trainer rank 0's node, never folders of the
     storage, whatever `service.storage` is: every one (the first version's too) is written by rank
     0's writer (a rename into place: trainer/storage/folder_io.py) and read by SGLang by path, so
     with 'disk' the engines must share that node's filesystem; a fleet without a shared filesystem
     uses 'tensors' (docs/ray-cluster.md gives the numbers behind that choice).
"""

from __future__ import annotations

import functools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.engines.weights import AdapterWeights, PendingFolder
from rollout.messages import PUBLISH_SUPERSEDED
from service.tenants.batches import PublishOutcome
from service.config.job import JobConfig
from service.config.settings import ServiceSettings
from service.fleet.remote import call
from service.fleet.rollout_client import RolloutClient
from service.fleet.trainer_group import TrainerGroup

log = logging.getLogger(__name__)

HANDOFF_DIR = "handoff"  # <state_dir>/handoff: PEFT folders the trainer writes for the engines (weight_transfer 'disk')
REPUBLISH_AT_MOST = 3  # U2: failed publishes in a row of one run that are published again


@dataclass(frozen=True)
class _Publish:
    """A publish in flight."""

    registration_id: str
    name: str
    version: int
    ref: Any  # ObjectRef of the rollout worker's publish_version
    folder: str | None  # its handoff folder (weight_transfer 'disk')


class Publisher:
    def __init__(self, job: JobConfig, settings: ServiceSettings, trainer: TrainerGroup, rollout: RolloutClient | None) -> None:
        self.job = job
        self.trainer = trainer
        self.rollout = rollout
        self._in_flight: list[_Publish] = []  # oldest first
        self.superseded = 0  # settled publishes a newer version of their run superseded (never served, U4)
        self.handoff_dir = Path(settings.state_dir) / HANDOFF_DIR
        shutil.rmtree(self.handoff_dir, ignore_errors=True)  # U3

    @functools.cached_property
    def dtype(self) -> str:
        """The dtype of the handoff folders: engines.publish_dtype, auto = what the engines serve in
        (rollout.config.EngineConfig.served_dtype). Their device 'auto' is a GPU exactly when the
        placement gives the engines GPUs (service/fleet/actors.py start_rollout_worker: none on 'cpu')."""
        engines = self.job.engines
        device = engines.device if engines.device != "auto" else ("cuda" if self.job.placement.accelerator == "gpu" else "cpu")
        return engines.resolved_publish_dtype(device, self.job.base_model.path)

    def _folder(self, name: str, registration_id: str, version: int) -> Path:
        return self.handoff_dir / f"{name}-{registration_id[:12]}-v{version}"

    def weights_now(self, slot: int, name: str, registration_id: str, version: int) -> AdapterWeights:
        """The slot's weights as the engines take them, written and ready (a run's first version).
        'disk': the trainer writes the PEFT folder straight into the handoff folder (U5: rank 0's writer,
        as every publish, waited for here) and only its path travels (the rollout worker's pool deletes
        it once superseded); 'tensors' (remote engines): the tensors, sent in the load request."""
        if self.job.engines.weight_transfer != "disk":
            cfg, tensors = self.trainer.peft_tensors(slot)
            return AdapterWeights(cfg, tensors=tensors)
        folder = self._folder(name, registration_id, version)
        call(self.trainer.begin_export_peft(slot, folder, self.dtype), self.trainer.call_timeout_s, "export_peft")
        return AdapterWeights.from_folder(folder, handoff=True)

    def publish(self, slot: int, name: str, registration_id: str, version: int) -> None:
        """Hand the slot's current weights to the engines as `version` (module doc); `settle` reports
        the outcome. Latest-wins (U4): the background export is keyed by the registration, so a newer
        publish of the run supersedes one still queued in the trainer's writer."""
        if self.job.engines.weight_transfer == "disk":
            folder = self._folder(name, registration_id, version)
            weights: AdapterWeights | PendingFolder = PendingFolder(
                folder, self.trainer.begin_export_peft(slot, folder, self.dtype, registration_id))
        else:
            cfg, tensors = self.trainer.peft_tensors(slot)
            weights = AdapterWeights(cfg, tensors=tensors)
        ref = self.rollout.publish_version(name, version, weights)
        self._in_flight.append(_Publish(registration_id, name, version, ref,
                                        weights.folder if isinstance(weights, PendingFolder) else None))

    def settle(self, runs: dict[str, Any]) -> list[PublishOutcome]:
        """Publishes that finished since the last call. `runs`: registration id -> the run's tenant
        (service/tenant_runs.RlRun) while it is prepared and resident (its publish_failures counter and
        weight_version decide U2)."""
        if not self._in_flight:
            return []
        finished = self.rollout.finished([p.ref for p in self._in_flight])
        out = []
        for p in self._in_flight:
            if p.ref not in finished:
                continue
            run = runs.get(p.registration_id)
            try:
                if self.rollout.outcome(p.ref) == PUBLISH_SUPERSEDED:  # U4: neither served nor failed
                    self.superseded += 1
                    log.info("%s v%d was superseded by a newer version before the engines got it", p.name, p.version)
                    continue
                if run is not None:
                    run.publish_failures = 0
                out.append(PublishOutcome(p.registration_id, p.name, p.version, None))
            except Exception as e:
                if p.folder is not None:  # U3: never current anywhere
                    shutil.rmtree(p.folder, ignore_errors=True)
                newest = run is not None and run.weight_version == p.version
                if run is not None:
                    run.publish_failures += 1
                again = newest and run.publish_failures <= REPUBLISH_AT_MOST
                out.append(PublishOutcome(p.registration_id, p.name, p.version, f"{type(e).__name__}: {e}"[:500], republish=again))
        self._in_flight = [p for p in self._in_flight if p.ref not in finished]
        return out

    def in_flight(self) -> int:
        return len(self._in_flight)

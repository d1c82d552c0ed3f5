"""What the controller needs from the fleet: the `Runtime` protocol.

The controller (service/control/controller.py) owns the registry and decides WHAT
happens to each adapter run; a Runtime does the side effects (trainer slot,
engine weights, rollout, checkpoints). The controller commits a state change
only after the matching Runtime call returned; when a call raises, the run
becomes FAILED with the exception as its reason and the other runs go on.

Every method receives the run's `AdapterRef` (frozen snapshot) and must act
on that registration only: `ref.registration_id` and `ref.slot_version` tell a
new tenant of a slot from the previous one. Methods are called from the
controller's reconcile pass, one at a time (never concurrently with each other,
except `abort`, `ready`, `stats` and `processes`, which the API's threads call at any time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from service.registry.registry import AdapterRef
from trainer.interface import Health
from trainer.storage import layouts

if TYPE_CHECKING:
    from service.registry.registry import Registry
    from service.scheduling.residency import ResidencyKnobs


@dataclass(frozen=True)
class Prepared:
    """Result of `prepare_adapter`: the step / samples a resumed run continues from
    (0 for a fresh start), and `total_steps` when the run's data, counted as it opened, gives a
    total other than the registered one (an estimate, for a file past data_check_bytes): the
    total its schedule now runs to, for the registry to record. None: the registered total stands."""

    step: int = 0
    samples_trained: int = 0
    total_steps: int | None = None


@dataclass(frozen=True)
class Finished:
    """Result of `finish_adapter`: the final PEFT export folder (must hold
    adapter_config.json and adapter_model.safetensors; the controller checks)
    and the final checkpoint folder with its step (recorded together: issue 14 F9)."""

    export_path: str
    checkpoint_path: str | None = None
    checkpoint_step: int | None = None


# One health value for every component (trainer, engines, rollout); its home is trainer/interface.py
# because the trainer's interface answers it and trainer/ imports nothing of service/.
ComponentHealth = Health


@dataclass(frozen=True)
class ProcessInfo:
    """One process of the fleet (GET /v1/fleet): what it is, its id on its node, and that node."""

    name: str  # "coordinator", "trainer-rank-0", "rollout-worker", "engine-0", ...
    role: str  # coordinator | trainer | rollout | engine
    pid: int | None  # None: not running, or not known (an external engine)
    detail: str = ""
    node_id: str = ""  # the Ray node it runs on ("" not known); service/fleet/nodes.py
    node_ip: str = ""  # that node's address


@dataclass(frozen=True)
class RuntimeStats:
    """Gauges for GET /metrics; the runtime fills what it knows."""

    queue_depth: dict[str, int] = field(default_factory=dict)  # adapter name -> groups buffered for training
    engine_inflight: dict[str, int] = field(default_factory=dict)  # engine id -> requests in flight
    train_step_seconds: float | None = None  # wall time of the last mixed train call
    swap_out_seconds: dict[str, float] = field(default_factory=dict)  # adapter name -> its last swap-out (trainer side)
    swap_in_seconds: dict[str, float] = field(default_factory=dict)  # adapter name -> its last swap-in


@runtime_checkable
class Runtime(Protocol):
    def prepare_adapter(self, ref: AdapterRef, weight_version: int) -> Prepared:
        """Initialize slot `ref.slot` for this run and publish its first weights to
        the engines as `weight_version` (the controller assigns it); start generating for it. Source of the weights, first match:
        `ref.checkpoint_path` (the run's own last checkpoint: restart recovery),
        `ref.config.resume_from`, `ref.config.init_from` (PEFT folder), else fresh
        (seeded by `ref.config.seed`). Must overwrite everything the slot held
        before (weights, optimizer moments, scheduler, data cursor): the previous
        tenant may not have been released cleanly. Called for PENDING runs, and
        again after a restart (of the service or the trainer) for live runs trained before."""
        ...

    def finish_adapter(self, ref: AdapterRef) -> Finished:
        """Retirement, first half: stop generating for this run, abort its in-flight
        requests, wait for (or drop) its in-flight train contribution, save its
        final checkpoint and PEFT export. The slot still belongs to the run."""
        ...

    def release_adapter(self, ref: AdapterRef) -> None:
        """Retirement, second half (and after a failure): clear the trainer slot and
        unload this run's versions from the engines. Idempotent; a no-op for a
        registration the runtime does not hold (e.g. never prepared here)."""
        ...

    def abort(self, ref: AdapterRef) -> int:
        """Abort this run's in-flight generation requests (rid prefix "<name>::")
        without retiring it; return how many were aborted."""
        ...

    def ready(self) -> dict[str, ComponentHealth]:
        """Health of each component (e.g. "trainer", "engine-0", "rollout")."""
        ...

    def stats(self) -> RuntimeStats:
        """Current gauges (cheap; called on every /metrics scrape)."""
        ...

    def processes(self) -> list[ProcessInfo]:
        """The fleet's processes and their ids (GET /v1/fleet, for operators and fault drills)."""
        ...

    def attach(self, registry: "Registry", knobs: "ResidencyKnobs") -> Any:
        """The controller attaches the runtime: it makes its scheduler (service/scheduling/scheduler.py, the one
        owner of slots and residency) over the controller's registry. Optional (a runtime without
        one never evicts)."""
        ...


def run_dir(state_dir: Path, ref: AdapterRef) -> Path:
    """A run's folder in a local store at the state dir (trainer/storage/layouts.py run_prefix:
    checkpoints/ and export/ below it). Unique per registration, inside the state dir, which is an
    allowed root for resume_from/init_from."""
    return Path(state_dir) / layouts.run_prefix(ref.name, ref.registration_id)

"""The trainer as the runtime uses it: `TrainerGroup`, a restartable handle on trainer/actor.py's
`TrainActorGroup` (one TrainWorker actor per rank, every call collective, rank 0 answers).

What this adds for the service: placement (rank r goes into bundle tp_rank of the
trainer placement group of its dp_rank, service/placement.py), a liveness probe,
restart after a rank died (a dead rank takes the whole group: slot state is spread
over all ranks), and a deliberate stop.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from service.runtime import ComponentHealth
from trainer.config import TrainerConfig

PROBE_TIMEOUT_S = 2.0


class TrainerGroup:
    def __init__(self, config: TrainerConfig, placement_groups: list[Any] | None = None, *, cpus_per_rank: float = 1.0,
                 gpus_per_rank: float = 0.0) -> None:
        self.config = config
        self.placement_groups = placement_groups
        self.cpus_per_rank = cpus_per_rank
        self.gpus_per_rank = gpus_per_rank
        self.group: Any = None  # trainer.actor.TrainActorGroup while running
        self.starts = 0
        self.stopped_reason: str | None = None

    @property
    def world_size(self) -> int:
        return self.config.tp * self.config.dp

    def _actor_options(self) -> list[dict]:
        out = []
        for r in range(self.world_size):
            options: dict[str, Any] = {"num_cpus": self.cpus_per_rank, "num_gpus": self.gpus_per_rank, "max_restarts": 0}
            if self.placement_groups:
                dp_rank, tp_rank = divmod(r, self.config.tp)
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_groups[dp_rank], placement_group_bundle_index=tp_rank
                )
            out.append(options)
        return out

    def start(self) -> float:
        """Create every rank and build the model on each (blocks); returns the seconds taken."""
        from trainer.actor import TrainActorGroup

        t0 = time.monotonic()
        self.group = TrainActorGroup(self.config, actor_options=self._actor_options(), use_gpus=self.gpus_per_rank > 0)
        self.starts += 1
        self.stopped_reason = None
        return time.monotonic() - t0

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.group is None:
            raise RuntimeError(f"the trainer is not running ({self.stopped_reason or 'not started'})")
        return getattr(self.group, method)(*args, **kwargs)

    @staticmethod
    def is_lost(error: BaseException) -> bool:
        return isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError))

    def health(self, note: str = "running") -> ComponentHealth:
        if self.group is None:
            return ComponentHealth(False, f"trainer not running ({self.stopped_reason or note})")
        try:
            # Any actor method is a probe; a rank answers between calls only.
            ray.get([w.master_address.remote() for w in self.group.workers], timeout=PROBE_TIMEOUT_S)
        except GetTimeoutError:
            return ComponentHealth(True, f"{self.world_size} rank(s), busy training")
        except Exception as e:
            return ComponentHealth(False, f"trainer rank unreachable: {type(e).__name__}")
        return ComponentHealth(True, f"{self.world_size} rank(s), {note}, starts={self.starts}")

    def stop(self, reason: str = "stopped") -> None:
        group, self.group = self.group, None
        self.stopped_reason = reason
        if group is not None:
            try:
                group.shutdown()
            except Exception:
                pass

    def restart(self) -> float:
        self.stop("restarting")
        return self.start()

    def kill_rank(self, rank: int = 0) -> None:
        """Kill one rank's process without telling the group (fault injection for tests)."""
        ray.kill(self.group.workers[rank], no_restart=True)

"""The fleet's health: engines watched and restarted, the trainer's liveness, and what the API
reports of the processes (GET /v1/ready, /metrics, /v1/fleet): `FleetHealth`.

Engines (the loop's fault step): every managed engine whose process died, or that stays out of
routing on two checks in a row although alive, is restarted: a connection error takes an
engine out, and the rollout worker takes it back within about a second once it answers /health
and its adapters are brought up to date (``EnginePool.readmit``); one still out after that is
restarted. The rollout worker loads every adapter's current version on the restarted engine.

H1 a restart is started, not waited for (issue 14 F6): the loop goes on training SFT runs and
   RL runs with groups already generated while the engine starts (tens of seconds); only
   generation waits for an engine, and a publish while none is in routing becomes current at
   once and is loaded when it comes back (EnginePool.publish);
H2 an engine with a restart in flight is not looked at again until that restart finished; a
   restart that failed is reported and the next check starts another;
H3 the record of engine processes to reap after a crash (service/fleet/engine_pids.py) is rewritten
   when restarted engines replace dead ones.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from service.fleet.engine_pids import record_engines
from service.fleet.nodes import fleet_processes
from service.control.runtime_protocol import ComponentHealth, ProcessInfo, RuntimeStats
from service.fleet.rollout_client import RolloutClient
from service.fleet.trainer_group import TrainerGroup, TrainerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _EngineRestart:
    """A restart of one engine in flight."""

    ref: Any  # ObjectRef of the rollout worker's restart_engine: EngineHealth, or its error
    why: str
    started: float  # time.monotonic()


@dataclass(frozen=True)
class EngineRestarted:
    """One restart that finished (ok: it serves again)."""

    index: int
    ok: bool
    message: str


class FleetHealth:
    def __init__(self, state_dir: Any, trainer: TrainerGroup, rollout: RolloutClient | None) -> None:
        self.state_dir = state_dir
        self.trainer = trainer
        self.rollout = rollout
        self.trainer_note = "running"
        self.last_train_s: float | None = None
        self._unroutable: dict[int, int] = {}  # engine index -> checks in a row that found it alive but not routed to
        self._restarts: dict[int, _EngineRestart] = {}  # engine index -> its restart in flight (H1)
        self._lock = threading.Lock()

    # --- engines -----------------------------------------------------------------------------------

    def check_engines(self) -> list[str]:
        """Start the restarts the module doc says; returns what was done, including restarts that
        ended since the last check."""
        if self.rollout is None:
            return []
        done = [r.message for r in self._finished_restarts()]
        for e in self.rollout.engine_health():
            if e.index in self._restarts:  # H2: being restarted, its health says nothing yet
                continue
            unroutable = e.alive and not e.routable
            if unroutable and self._unroutable.get(e.index, 0) == 0:
                self._unroutable[e.index] = 1  # once may be a readmission in progress: look again next time
                continue
            self._unroutable.pop(e.index, None)
            if not e.alive or unroutable:
                why = "was dead" if not e.alive else "stayed out of routing after a connection error"
                with self._lock:
                    self._restarts[e.index] = _EngineRestart(self.rollout.begin_restart_engine(e.index), why, time.monotonic())
                done.append(f"engine {e.index} {why}: restarting it; training goes on, generation waits for an engine")
        return done

    def _finished_restarts(self) -> list[EngineRestarted]:
        with self._lock:
            restarts = dict(self._restarts)
        if not restarts:
            return []
        finished = self.rollout.finished([r.ref for r in restarts.values()])
        done = []
        for index, r in restarts.items():
            if r.ref not in finished:
                continue
            with self._lock:
                del self._restarts[index]
            took = time.monotonic() - r.started
            try:
                health = self.rollout.outcome(r.ref, f"rollout restart_engine({index})")
                done.append(EngineRestarted(index, True, f"engine {index} {r.why}: restarted ({health.url}) and republished; "
                                                          f"seen back {took:.1f} s after the restart began"))
            except Exception as err:
                done.append(EngineRestarted(index, False, f"engine {index} {r.why}: its restart failed after {took:.1f} s "
                                                          f"({type(err).__name__}: {err}); the next check tries again"[:1000]))
        if any(d.ok for d in done):  # H3
            record_engines(self.state_dir, self.rollout.engine_health())  # each engine with its node (multinode)
        return done

    def restarting_engines(self) -> list[int]:
        with self._lock:
            return sorted(self._restarts)

    # --- the trainer ------------------------------------------------------------------------------

    def trainer_lost(self) -> bool:
        """Whether the trainer should run but a rank's process is gone (it died while nothing trained),
        or a restart failed halfway."""
        if not self.trainer.running:
            return self.trainer.state == TrainerState.RESTARTING
        return self.trainer.lost()

    # --- what the API reports ------------------------------------------------------------------

    def ready(self, prepared: int) -> dict[str, ComponentHealth]:
        out = {"trainer": self.trainer.health(note=self.trainer_note)}
        if self.rollout is None:  # SFT-only runtime (tests): nothing generates
            return out
        try:
            engines = self.rollout.engine_health(timeout_s=10)
            out["rollout"] = ComponentHealth(True, f"{prepared} adapter(s) prepared")
            restarting = set(self.restarting_engines())
            for e in engines:
                note = " (restarting)" if e.index in restarting else "" if e.routable else " (not routable)"
                out[f"engine-{e.index}"] = ComponentHealth(
                    e.alive and e.routable and e.index not in restarting, f"{e.url} starts={e.starts} inflight={e.inflight}" + note
                )
        except Exception as e:
            out["rollout"] = ComponentHealth(False, f"rollout worker unreachable: {type(e).__name__}: {e}")
        return out

    def stats(self, staged: Callable[[], dict[str, int]], swap_out_s: dict[str, float], swap_in_s: dict[str, float]) -> RuntimeStats:
        """`staged()`: adapter name -> RL groups staged in the coordinator (added to the rollout's buffer);
        the swap gauges are the scheduler's."""
        queue: dict[str, int] = {}
        inflight: dict[str, int] = {}
        try:
            if self.rollout is None:
                raise RuntimeError("no rollout worker")
            for name, s in self.rollout.all_stats(timeout_s=5).items():
                queue[name] = s.buffered_groups
            for e in self.rollout.engine_health(timeout_s=5):
                inflight[str(e.index)] = e.inflight
        except Exception:
            log.debug("stats: rollout worker unreachable", exc_info=True)
        for name, n in staged().items():
            queue[name] = queue.get(name, 0) + n
        return RuntimeStats(queue_depth=queue, engine_inflight=inflight, train_step_seconds=self.last_train_s,
                            swap_out_seconds=dict(swap_out_s), swap_in_seconds=dict(swap_in_s))

    def processes(self) -> list[ProcessInfo]:
        """Every process of the fleet with its id and node (the operator's GET /v1/fleet)."""
        return fleet_processes(self.trainer, self.rollout)

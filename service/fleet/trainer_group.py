"""The trainer as the coordinator uses it: `TrainerGroup`, tp * dp TrainWorker actors acting as one.
It implements the trainer's interface (trainer/interface.py `TrainerInterface`) by fanning each
method out to every rank.

Every trainer method is collective: the group calls it on every rank with the same
arguments (one typed lambda per rank, `_all`) and returns rank 0's answer. On top it
adds what the service needs: start (ranks placed by service/fleet/actors.py, model built on
each), a liveness probe, restart after a rank died (a dead rank takes the whole group:
slot state is spread over all ranks), the ranks' process ids, and a deliberate stop.

The scheduler's round (service/scheduling/scheduler.py) is one collective call, `run_round`: the dataset
runs' samples and the Tinker models' calls in ONE mixed step (trainer/rounds.py). Every other
method is one trainer method forwarded to every rank (trainer/actor.py `TrainWorker` exposes
each once, typed); the group adds nothing but the fan-out.

Errors: a rank's exception comes back as itself (service/fleet/remote.py); a dead rank
raises Ray's actor error, which `is_lost` recognizes (the runtime turns it into
TrainerLost and the loop restarts the group).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

import ray

from service.fleet.actors import start_train_workers
from service.fleet.remote import call, is_actor_lost
from service.control.runtime_protocol import ComponentHealth
from trainer.config import SlotHyperParams, TrainerConfig
from trainer.interface import PendingWrite
from trainer.rounds import RoundResult, RoundWork

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
SWAP_DIR_NAME = "swap"  # under the service's state dir: evicted slots beyond the host-memory budget


def with_service_storage(config: TrainerConfig, state_dir: str | Path, storage: str) -> TrainerConfig:
    """The trainer config the service runs: the folders it writes (slot states, PEFT exports) go to
    the service's storage (`storage`: ServiceSettings.storage_location, keys relative to it), and
    evicted slots spill to `<state_dir>/swap` unless the job names another folder
    (trainer.swap_spill_dir); trainer.swap_host_budget_mb bounds host memory, trainer.swap_disk_budget_mb
    the folder."""
    update: dict = {"storage": storage}
    if config.swap_spill_dir is None:
        update["swap_spill_dir"] = str(Path(state_dir).absolute() / SWAP_DIR_NAME)
    return config.model_copy(update=update)


class TrainerState(StrEnum):
    NOT_STARTED = "not started"
    RUNNING = "running"
    RESTARTING = "restarting"  # stopped to be started again (a start that fails leaves it here)
    STOPPED = "stopped"


class TrainerGroup:
    def __init__(self, config: TrainerConfig, placement_groups: list[Any] | None = None, *, cpus_per_rank: float = 1.0,
                 gpus_per_rank: float = 0.0, setup_timeout_s: float = 900.0, call_timeout_s: float = 3600.0,
                 placer: Callable[[list[Any]], list[Any]] | None = None) -> None:
        """`placer`: called with the placement groups before a restart, returns the groups to restart in (a
        group on a lost node placed anew: service/fleet/node_faults.py NodeFaults.ensure_trainer_groups)."""
        self.config = config
        self.placement_groups = placement_groups
        self.placer = placer
        self.cpus_per_rank = cpus_per_rank
        self.gpus_per_rank = gpus_per_rank
        self.setup_timeout_s = setup_timeout_s
        self.call_timeout_s = call_timeout_s
        self.workers: list[Any] = []  # TrainWorker actor handles, rank order, while running
        self.placement: list[dict] = []  # per rank: rank, tp_rank, dp_rank, device (from setup)
        self._pids: list[int] = []  # per rank, read once at start (a rank busy training answers nothing)
        self.starts = 0
        self.state = TrainerState.NOT_STARTED
        self.stopped_reason: str | None = "not started"  # why it is not running (shown in health)
        self._in_flight = 0  # collective calls under way (a rank busy in one does not answer probes)
        self._in_flight_lock = threading.Lock()
        # One collective call at a time, whichever thread calls (the loop's train, the Tinker
        # worker's forward_backward): every rank must run the calls in the same order, so a
        # call's per-rank submissions never interleave with another's.
        self._collective_lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self.config.tp * self.config.dp

    @property
    def running(self) -> bool:
        return bool(self.workers)

    # --- life ----------------------------------------------------------------------------------------

    def start(self) -> float:
        """Create every rank and build the model on each (blocks); returns the seconds taken."""
        t0 = time.monotonic()
        self.workers = start_train_workers(self.world_size, self.config.tp, self.placement_groups,
                                           cpus=self.cpus_per_rank, gpus=self.gpus_per_rank)
        try:
            addr, port = call(self.workers[0].master_address.remote(), self.setup_timeout_s, "trainer rank 0 address")
            config = self.config.model_dump()
            self.placement = call([w.setup.remote(config, r, addr, port) for r, w in enumerate(self.workers)],
                                  self.setup_timeout_s, "trainer setup")
            self._pids = call([w.pid.remote() for w in self.workers], self.setup_timeout_s, "trainer pids")
        except BaseException:
            self._kill_workers()
            raise
        self.starts += 1
        self.state, self.stopped_reason = TrainerState.RUNNING, None
        return time.monotonic() - t0

    def stop(self, reason: str = "stopped") -> None:
        self.state, self.stopped_reason = TrainerState.STOPPED, reason
        self._kill_workers()

    def restart(self) -> float:
        self._kill_workers()
        self.state, self.stopped_reason = TrainerState.RESTARTING, "restarting"
        if self.placer is not None and self.placement_groups:  # multinode hook: groups of a lost node placed anew
            self.placement_groups = self.placer(self.placement_groups)
        return self.start()

    def _kill_workers(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass

    @staticmethod
    def is_lost(error: BaseException) -> bool:
        return is_actor_lost(error)

    def _probe(self) -> str:
        """"ok", "busy" (no answer while a call is under way), "silent" (no answer while idle: a rank
        stopped or hung), or "lost" (a rank's process is gone). Any actor method is a probe; a rank
        answers between calls only."""
        try:
            ray.get([w.pid.remote() for w in self.workers], timeout=PROBE_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return "busy" if self._in_flight else "silent"
        except Exception as e:
            if is_actor_lost(e):
                return "lost"
            raise
        return "ok"

    def health(self, note: str = "running") -> ComponentHealth:
        if not self.workers:
            return ComponentHealth(False, f"trainer not running ({self.stopped_reason or note})")
        try:
            probe = self._probe()
        except Exception as e:
            return ComponentHealth(False, f"trainer probe failed: {type(e).__name__}: {e}")
        if probe == "busy":
            return ComponentHealth(True, f"{self.world_size} rank(s), busy training")
        if probe == "silent":
            return ComponentHealth(False, f"trainer rank not answering for {PROBE_TIMEOUT_S:g} s while idle (stopped or hung)")
        if probe == "lost":
            return ComponentHealth(False, "trainer rank unreachable: its process is gone")
        return ComponentHealth(True, f"{self.world_size} rank(s), {note}, starts={self.starts}")

    def lost(self) -> bool:
        """Whether a rank's process is gone (the group must be restarted). A silent rank is not lost:
        it is reported not ready and left to the operator (it may be paused on purpose)."""
        return bool(self.workers) and self._probe() == "lost"

    def pids(self) -> list[int]:
        """Process id of every rank, rank order (GET /v1/fleet); empty while not running."""
        return list(self._pids) if self.workers else []

    def rank_nodes(self) -> list[str]:
        """The Ray node id of every rank, rank order: its placement-group bundle's node ("" without groups)."""
        from service.fleet.placement import group_node_ids

        if not self.placement_groups:
            return [""] * self.world_size
        return [group_node_ids(self.placement_groups[r // self.config.tp])[r % self.config.tp] for r in range(self.world_size)]

    # --- the trainer's interface (trainer/actor.py TrainWorker), rank 0 answers ----------------------

    def _all(self, remote: Callable[[Any], Any], *, what: str) -> Any:
        """`remote(worker)` -> ObjectRef, on every rank at once; rank 0's answer. `what` names it in errors."""
        with self._collective_lock:
            return self._all_locked(remote, what=what)

    def _all_locked(self, remote: Callable[[Any], Any], *, what: str) -> Any:
        """`_all` for a caller that holds the collective lock."""
        if not self.workers:
            raise RuntimeError(f"the trainer is not running ({self.stopped_reason or 'not started'})")
        with self._in_flight_lock:
            self._in_flight += 1
        try:
            return call([remote(w) for w in self.workers], self.call_timeout_s, f"trainer {what}")[0]
        finally:
            with self._in_flight_lock:
                self._in_flight -= 1

    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | None = None,
                  registration: str | None = None) -> dict:
        return self._all(lambda w: w.init_slot.remote(slot, hyper, seed, init_from=init_from, registration=registration), what="init_slot")

    def clear_slot(self, slot: int) -> None:
        self._all(lambda w: w.clear_slot.remote(slot), what="clear_slot")

    def run_round(self, work: RoundWork) -> RoundResult:
        """The scheduler's round: every tenant's work in ONE collective call (trainer/rounds.py)."""
        return self._all(lambda w: w.run_round.remote(work), what="round")

    def peft_tensors(self, slot: int):
        return self._all(lambda w: w.peft_tensors.remote(slot), what="peft_tensors")

    def export_peft(self, slot: int, out_dir: str | Path, dtype: str = "float32", durable: bool = True) -> str:
        return self._all(lambda w: w.export_peft.remote(slot, str(out_dir), dtype, durable), what="export_peft")

    def begin_export_peft(self, slot: int, out_dir: str | Path, dtype: str = "float32", key: str | None = None) -> list[Any]:
        """export_peft without waiting, in `dtype` (trainer.export.export_writer.EXPORT_DTYPES: a publish
        folder in the engines' dtype; the trainer casts before its copy to host): ObjectRefs that all resolve once rank 0 has written the folder
        (whoever needs it awaits them: the rollout worker's publish_version via PendingFolder; the loop
        does not wait, issue 18). Every rank snapshots the slot in its call order, so the folder holds
        the weights as they are now, whatever later calls change; the write runs on rank 0's writer
        thread while the next train call runs; `wait_export` (the last ref, in the actor's export
        concurrency group) raises if the write failed. `key` (latest-wins, issue 28): a queued,
        unwritten export of the same key is superseded by this one and never written; its
        `wait_export` then resolves to a trainer.export.export_writer.Superseded. Submitted under the collective lock: the
        snapshot is collective (TP gather), so no other thread's call may interleave its submissions."""
        from trainer.export.export_writer import export_dtype

        out = str(out_dir)
        export_dtype(dtype)  # refused here, before any rank starts a collective call
        return self._in_background(lambda w: w.export_peft_in_background.remote(slot, out, dtype, key), lambda w: w.wait_export, out)

    def save_slot_state(self, slot: int, out_dir: str | Path) -> str:
        return self._all(lambda w: w.save_slot_state.remote(slot, str(out_dir)), what="save_slot_state")

    def begin_save_slot_state(self, slot: int, out_dir: str | Path) -> PendingWrite:
        """The slot's state taken now on every rank (in order with the collective calls, under the
        collective lock like begin_export_peft), its folder written on rank 0's slot-state writer
        thread: the returned write is done once `wait_slot_state` (EXPORT_GROUP) answered."""
        out = str(out_dir)
        return _RayWrite(self._in_background(lambda w: w.save_slot_state_in_background.remote(slot, out), lambda w: w.wait_slot_state, out),
                         self.call_timeout_s)

    def _in_background(self, take: Callable[[Any], Any], wait: Callable[[Any], Any], out: str) -> list[Any]:
        """`take(worker)` on every rank (what it writes taken now, collective: submitted under the collective
        lock so no other thread's call interleaves), then rank 0's `wait(worker)` method for `out` in
        EXPORT_GROUP: the refs, the last one resolving once rank 0 has written the folder (or raising)."""
        from trainer.actor import EXPORT_GROUP

        if not self.workers:
            raise RuntimeError(f"the trainer is not running ({self.stopped_reason or 'not started'})")
        with self._collective_lock:
            refs = [take(w) for w in self.workers]
            refs.append(wait(self.workers[0]).options(concurrency_group=EXPORT_GROUP).remote(out))
        return refs

    def load_slot_state(self, slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
        return self._all(lambda w: w.load_slot_state.remote(slot, str(in_dir), registration=registration), what="load_slot_state")

    def reset_optimizer(self, slot: int) -> None:
        self._all(lambda w: w.reset_optimizer.remote(slot), what="reset_optimizer")

    def swap_out(self, slot: int, key: str) -> dict:
        """Evict `slot` under `key` (the run's registration id); SwapError leaves the slot as it was."""
        return self._all(lambda w: w.swap_out.remote(slot, key), what="swap_out")

    def swap_in(self, slot: int, key: str) -> dict:
        return self._all(lambda w: w.swap_in.remote(slot, key), what="swap_in")

    def drop_swapped(self, key: str) -> bool:
        return self._all(lambda w: w.drop_swapped.remote(key), what="drop_swapped")

    def prefetch_swapped(self, key: str) -> str:
        """Every rank starts reading `key`'s spill file into host memory, so its swap-in is a copy
        to the device; returns at once (rank 0's answer: "started", "prefetching", "host", "absent", "no room")."""
        return self._all(lambda w: w.prefetch_swapped.remote(key), what="prefetch_swapped")

    def swap_tiers(self) -> dict:
        """Rank 0's swap tiers, for the gauges: {"host"|"disk"|"prefetched": {"count", "bytes"[, "budget_bytes"]}}."""
        return self._all(lambda w: w.swap_tiers.remote(), what="swap_tiers")


class _RayWrite:
    """A background slot-state write on the trainer's ranks (TrainerGroup.begin_save_slot_state): done
    once every rank took the state and rank 0 committed the folder; `result` raises what failed."""

    def __init__(self, refs: list[Any], timeout_s: float) -> None:
        self.refs = refs
        self.timeout_s = timeout_s

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> str:
        return call(self.refs, self.timeout_s, "trainer save_slot_state (background)")[-1]

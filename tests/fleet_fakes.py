"""FAKES of the two actor interfaces the coordinator drives, for the unit tests of FleetRuntime and the loop
(tests/unit/test_runtime.py, test_loop.py). Everything else in those tests is real: the Controller and its
SQLite registry, FleetRuntime, the loop, SftSource over the tiny world's data, checkpoint files, and the
rollout side's AdapterBuffer (staleness filter and stamps).

  FakeTrainer  the surface of service/fleet/trainer_group.py TrainerGroup. A slot's "weights" are its step
               count; a round (`run_round`, the scheduler's one trainer call) steps every slot that got
               samples of its own registration. Faults:
               `fail_next` (the call raises that error), `nonfinite` (slots whose steps are skipped).
               `kill()` makes every call raise FakeRankDied, which `is_lost` recognizes (a dead rank).
  FakeRollout  the surface of service/fleet/rollout_client.py RolloutClient. Each adapter has `prompts`
               prompts; groups are "generated" with the adapter's newest version until `ahead` of them
               are buffered, and handed out through a real AdapterBuffer. A publish returns a FakeRef that
               has finished (failing with `fail_publish` when set); an engine restart one that finishes at
               once, or (`hold_restart`) when the test calls `finish_restart`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollout.data import DataCursor, DataStatus
from rollout.groups import AdapterBuffer, RolloutGroup, Sample
from rollout.messages import AdapterStats, EngineHealth
from service.control.runtime_protocol import ComponentHealth
from service.fleet.trainer_group import TrainerState
from trainer.optim.slot_steps import SlotMetrics, StepReport, TrainResult
from trainer.interface import WrittenFolder
from trainer.rounds import RoundResult
from trainer.storage.locations import open_store, readable_folder


class FakeRankDied(RuntimeError):
    """Stands in for Ray's actor error of a killed trainer rank."""


class FakeTrainer:
    def __init__(self) -> None:
        self.slots: dict[int, dict[str, Any]] = {}  # slot -> {"registration", "step"}
        self.calls: list[tuple] = []
        self.starts = 1
        self.workers = [object()]
        self.stopped_reason: str | None = None
        self.state = TrainerState.RUNNING
        self.dead = False
        self.fail_next: BaseException | None = None
        self.nonfinite: set[int] = set()

    # --- life
    @property
    def running(self) -> bool:
        return bool(self.workers)

    def kill(self) -> None:
        self.dead = True

    def _check(self, what: str, *args: Any) -> None:
        self.calls.append((what, *args))
        if self.dead:
            raise FakeRankDied(f"trainer rank 0 died (during {what})")
        if not self.workers:
            raise RuntimeError(f"the trainer is not running ({self.stopped_reason})")

    @staticmethod
    def is_lost(error: BaseException) -> bool:
        return isinstance(error, FakeRankDied)

    def health(self, note: str = "running") -> ComponentHealth:
        if not self.workers:
            return ComponentHealth(False, f"trainer not running ({self.stopped_reason})")
        if self.dead:
            return ComponentHealth(False, "trainer rank unreachable: FakeRankDied")
        return ComponentHealth(True, f"1 rank(s), {note}, starts={self.starts}")

    def restart(self) -> float:
        self.calls.append(("restart",))
        self.slots.clear()
        self.dead = False
        self.workers = [object()]
        self.starts += 1
        self.stopped_reason = None
        self.state = TrainerState.RUNNING
        return 0.0

    def stop(self, reason: str = "stopped") -> None:
        self.workers = []
        self.stopped_reason = reason
        self.state = TrainerState.STOPPED

    def pids(self) -> list[int]:
        return [4242]

    def rank_nodes(self) -> list[str]:
        return ["f" * 56]

    def lost(self) -> bool:
        return self.running and self.dead

    # --- the trainer's interface
    def init_slot(self, slot, hyper, seed, init_from=None, registration=None) -> dict:
        self._check("init_slot", slot, registration)
        self.slots[slot] = {"registration": registration, "step": 0}
        return {}

    def clear_slot(self, slot) -> None:
        self._check("clear_slot", slot)
        self.slots.pop(slot, None)

    def load_slot_state(self, slot, in_dir, registration=None) -> dict:
        self._check("load_slot_state", slot, registration)
        saved = json.loads((readable_folder(open_store(None), in_dir, legacy_marker="slot.json") / "slot.json").read_text())
        self.slots[slot] = {"registration": registration, "step": saved["step"]}
        return {}

    def save_slot_state(self, slot, out_dir) -> str:
        """Committed in the store like the real trainer's rank 0 does (trainer/storage/store.py)."""
        self._check("save_slot_state", slot)
        with open_store(None).write_folder(str(out_dir)) as tmp:
            (tmp / "slot.json").write_text(json.dumps({"step": self.slots[slot]["step"]}))
        return str(out_dir)

    def begin_save_slot_state(self, slot, out_dir):
        """Written before it answers (a trainer may: trainer/interface.py WrittenFolder)."""
        return WrittenFolder(self.save_slot_state(slot, out_dir))

    def export_peft(self, slot, out_dir, dtype="float32", durable=True) -> str:
        self._check("export_peft", slot)
        with open_store(None).write_folder(str(out_dir), durable=durable) as out:
            (out / "adapter_config.json").write_text(json.dumps({"r": 4, "step": self.slots[slot]["step"]}))
            (out / "adapter_model.safetensors").write_bytes(b"fake weights of step %d" % self.slots[slot]["step"])
        return str(out_dir)

    def peft_tensors(self, slot):
        self._check("peft_tensors", slot)
        return {"r": 4}, {}

    def run_round(self, work) -> RoundResult:
        """The round's dataset batch only (these unit tests have no Tinker calls)."""
        assert not (work.calls or work.forwards or work.optim), "FakeTrainer serves dataset batches only"
        return RoundResult(train=self.train(work.batch) if work.batch is not None else None)

    def train(self, batch) -> TrainResult:
        self._check("train", len(batch.samples))
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        per_slot: dict[int, int] = {}
        tokens: dict[int, int] = {}  # learned tokens per slot, as the real trainer's loss_tokens
        foreign: dict[int, int] = {}
        for s in batch.samples:
            if self.slots.get(s.slot, {}).get("registration") != s.registration:
                foreign[s.slot] = foreign.get(s.slot, 0) + 1
                continue
            per_slot[s.slot] = per_slot.get(s.slot, 0) + 1
            tokens[s.slot] = tokens.get(s.slot, 0) + sum(s.loss_mask)
        slots = {}
        for slot, n in per_slot.items():
            if slot in self.nonfinite:
                slots[slot] = SlotMetrics(samples=n, steps=[StepReport(step=self.slots[slot]["step"] + 1, lr=0.1,
                                                                       grad_norm=float("nan"), loss=float("nan"),
                                                                       skipped_nonfinite=True)])
                continue
            self.slots[slot]["step"] += 1
            slots[slot] = SlotMetrics(samples=n, loss=1.0 / self.slots[slot]["step"], loss_tokens=tokens[slot],
                                      steps=[StepReport(step=self.slots[slot]["step"], lr=0.1, grad_norm=1.0,
                                                        loss=1.0 / self.slots[slot]["step"])])
        return TrainResult(slots=slots, stepped=[s for s in slots if s not in self.nonfinite],
                           skipped_nonfinite=sorted(self.nonfinite & set(slots)), dropped_foreign=foreign)


@dataclass(eq=False)  # hashed by identity, like an ObjectRef
class FakeRef:
    error: BaseException | None = None
    value: Any = None
    done: bool = True  # False: still running (an engine restart the test holds)


@dataclass
class _FakeAdapter:
    spec: Any
    buffer: AdapterBuffer
    version: int
    next_prompt: int
    consumed: int = 0
    paused: bool = False


class FakeRollout:
    def __init__(self, prompts: int = 6, samples_per_group: int = 2, ahead: int = 2) -> None:
        self.prompts = prompts
        self.ahead = ahead
        self.samples_per_group = samples_per_group
        self.adapters: dict[str, _FakeAdapter] = {}
        self.calls: list[tuple] = []
        self.fail_publish: BaseException | None = None
        self.engine_alive = True
        self.engine_starts = 1
        self.hold_restart = False  # True: a restart stays in flight until the test finishes it (finish_restart)
        self.restart_refs: list[FakeRef] = []
        self.fatal: dict[str, str] = {}  # adapter name -> the fatal_reason its stats report (planted)

    def _generate(self, a: _FakeAdapter) -> None:
        """Prompts not taken yet become groups of the adapter's newest version, `ahead` buffered at most."""
        while not a.paused and a.next_prompt < self.prompts and len(a.buffer) < self.ahead:
            samples = [Sample(response_ids=[5, 6], response_text="ab", logprobs=[-0.5, -0.5], finish_reason="stop",
                              reward=float(i), advantage=float(i) - 0.5) for i in range(self.samples_per_group)]
            a.buffer.put(RolloutGroup(adapter=a.spec.name, registration_id=a.spec.registration_id, version=a.version,
                                      prompt_index=a.next_prompt, epoch=0, prompt_text="p", prompt_ids=[1, 2, 3],
                                      samples=samples))
            a.next_prompt += 1

    def add_adapter(self, spec, weights) -> None:
        self.calls.append(("add_adapter", spec.name, spec.initial_version))
        buffer = AdapterBuffer(spec.name, spec.registration_id, spec.max_staleness or 0)
        buffer.note_published(spec.initial_version)
        start = spec.cursor.consumed if spec.cursor is not None else 0
        self.adapters[spec.name] = _FakeAdapter(spec, buffer, spec.initial_version, start, consumed=start)

    def remove_adapter(self, name) -> int:
        self.calls.append(("remove_adapter", name))
        self.adapters.pop(name, None)
        return 0

    def publish_version(self, name, version, weights) -> FakeRef:
        self.calls.append(("publish_version", name, version))
        if self.fail_publish is not None:
            return FakeRef(self.fail_publish)
        a = self.adapters[name]
        a.version = version
        a.buffer.note_published(version)
        return FakeRef()

    def abort_adapter(self, name, *, pause, timeout_s=120.0) -> int:
        self.calls.append(("abort_adapter", name, pause))
        if name in self.adapters:
            self.adapters[name].paused = self.adapters[name].paused or pause
        return 0

    def pop_groups(self, name, max_groups) -> list[RolloutGroup]:
        a = self.adapters[name]
        self._generate(a)
        ready, _stale = a.buffer.pop(max_groups, a.version)
        a.consumed += len(ready)
        return ready

    def data_cursor(self, name) -> DataCursor:
        a = self.adapters[name]
        return DataCursor(epoch=0, position=a.consumed, consumed=a.consumed)

    def stats(self, name, timeout_s=120.0) -> AdapterStats:
        a = self.adapters[name]
        exhausted = a.next_prompt >= self.prompts
        return AdapterStats(
            name=name, registration_id=a.spec.registration_id, version=a.version, paused=a.paused, inflight_requests=0,
            inflight_groups=0, buffered_groups=len(a.buffer), groups_completed=a.next_prompt, groups_consumed=a.consumed,
            groups_aborted=0, groups_requeued=0, groups_failed=0, dropped_stale=a.buffer.dropped_stale,
            refused_foreign=a.buffer.refused_foreign, reward_failures=0, last_error=None, rejections_in_a_row=0, fatal_reason=self.fatal.get(name),
            data=DataStatus(rows=self.prompts, epoch=0, position=a.next_prompt, pending=0, consumed=a.consumed,
                            exhausted=exhausted and len(a.buffer) == 0),
        )

    def all_stats(self, timeout_s=5.0) -> dict[str, AdapterStats]:
        return {n: self.stats(n) for n in self.adapters}

    def engine_health(self, timeout_s=30.0) -> list[EngineHealth]:
        return [EngineHealth(index=0, url="http://127.0.0.1:1", alive=self.engine_alive, routable=self.engine_alive,
                             inflight=0, starts=self.engine_starts)]

    async def engine_health_async(self, timeout_s=30.0) -> list[EngineHealth]:
        return self.engine_health(timeout_s)

    def begin_restart_engine(self, index) -> FakeRef:
        self.calls.append(("restart_engine", index))
        ref = FakeRef(done=False)
        self.restart_refs.append(ref)
        if not self.hold_restart:
            self.finish_restart()
        return ref

    def finish_restart(self) -> None:
        """The engine is back (every restart in flight ends)."""
        self.engine_alive = True
        self.engine_starts += 1
        for ref in self.restart_refs:
            ref.value, ref.done = self.engine_health()[0], True
        self.restart_refs.clear()

    def processes(self, timeout_s=10.0) -> dict[str, Any]:
        from rollout.engines.engine_launcher import EngineInfo

        return {"worker": 4343, "node_id": "a" * 56, "node_ip": "10.0.0.5",
                "engines": [EngineInfo(index=0, url="http://10.0.0.6:30000", pid=4444, alive=self.engine_alive,
                                       starts=self.engine_starts, node_id="b" * 56, node_ip="10.0.0.6")]}

    def shutdown(self, timeout_s=120.0) -> None:
        self.calls.append(("shutdown",))

    @staticmethod
    def finished(refs: list[FakeRef]) -> set:
        return {r for r in refs if r.done}  # every fake publish has finished; a held restart has not

    @staticmethod
    def outcome(ref: FakeRef, what: str = "") -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

"""The Tinker face's one handle on the scheduler: `TinkerModels`.

Creating a model makes it a tenant of the scheduler at once, evicted and waiting for a slot like a
registered run waits in the queue (issue 41: a creation is never refused for room): its first
operation (its creation) waits in the one FIFO under the same fairness rule, turns and priorities;
it gets a slot when one is free or the residency policy frees one, and its slot is filled from its
seeded init (its "restore"), then the creation is answered. While it waits, its future answers
try_again with the reason (M3). Only a tenant's quota refuses (past max_live_runs).

Its operations go straight onto each model's queue (service/tenants/tinker_model.py). In the fleet,
the training loop runs the rounds (service/loop/training_loop.py); the scheduler is the only thing
that calls the trainer: api/tinker/ starts no thread of its own.

Durable (issue 40): every model is a record (service/registry/tinker_records.py) with its journal
(service/tenants/tinker_durability.py). `revive` brings the models of an earlier process back at
start, each evicted, restored from its last snapshot when it next has work, with the operations to
replay and to run in order.

Latency of a Tinker call (docs/tinker.md): a submission wakes the scheduler's wait at once; a
call then waits at most `window_s` for calls of other models to join it (none once every resident
is ready: service/scheduling/scheduler.py `round_wait`), plus the round in
progress when it came (the loop's train call, or a placement's swaps), plus its own round. It
never waits for a dataset run's step: a round with a ready Tinker call does not wait for the
other tenants beyond `window_s`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from service.config.quotas import Quotas
from service.errors import QuotaExceeded
from service.registry.tinker_records import TinkerRecords
from service.scheduling.scheduler import Scheduler
from service.scheduling.tenant import TenantKind
from service.config.durability import Durability
from service.tenants.tinker_durability import ModelJournal, SnapshotCounts, restore_plan
from service.tenants.tinker_lora import LoraSpec
from service.tenants.tinker_model import TinkerModel
from service.tenants.tinker_ops import OpKind, TinkerOp, _no_answer
from service.tenants.tinker_stats import ModelStats, SlotGrants
from trainer.config import TARGET_GROUPS, SlotHyperParams
from trainer.storage.store import CheckpointStore

log = logging.getLogger(__name__)

Answer = Callable[[str, dict], Callable[[Any, BaseException | None], None]]  # (request id, request) -> its done


class TinkerModels:
    def __init__(self, scheduler: Scheduler, records: TinkerRecords, store: CheckpointStore, *, base_model: str,
                 tokenizer_id: str, max_rank: int, lora_alpha: float = 32.0, max_seq_len: int = 4096,
                 target_groups: tuple[str, ...] = TARGET_GROUPS, durability: Durability | None = None,
                 quotas: Quotas | None = None) -> None:
        """``target_groups``: what the trainer has LoRA layers for (TrainerConfig.target_groups)."""
        self.scheduler = scheduler
        self.records = records
        self.store = store
        self.durability = durability or Durability.parse("interval:300")
        self.quotas = quotas
        self.base_model = base_model  # the served base model's name (get_server_capabilities, create_model)
        self.tokenizer_id = tokenizer_id  # what AutoTokenizer.from_pretrained loads offline
        self.max_rank = max_rank
        self.target_groups = tuple(target_groups)
        self.lora_alpha = lora_alpha
        self.max_seq_len = max_seq_len
        self.grants = SlotGrants()  # slots given to its models (their stats' waited_grants: tinker_stats.py)
        self.snapshots = SnapshotCounts()  # every model's snapshots (tinker_durability.py; /metrics)

    def _model(self, model_id: str, owner: str, lora: LoraSpec, snapshot: str | None = None,
               snapshot_at: float | None = None) -> TinkerModel:
        s = self.scheduler
        journal = ModelJournal(self.records, self.store, self.durability, owner, model_id, snapshot, snapshot_at, self.snapshots)
        hyper = SlotHyperParams(rank=lora.rank, alpha=self.lora_alpha, targets=lora.targets)
        return TinkerModel(model_id, owner, lora, trainer=s.trainer, clock=s.clock, wake=s.notify, end=s.release,
                           hyper=hyper, journal=journal, stats=ModelStats(self.grants), contended=lambda: s.contended)

    def check_lora(self, lora: LoraSpec) -> None:
        if not 1 <= lora.rank <= self.max_rank:
            raise ValueError(f"LoRA rank {lora.rank} not supported: 1..{self.max_rank} on this server")
        missing = [t for t in lora.targets if t not in self.target_groups]
        if missing:
            raise ValueError(f"LoRA on {missing} is not available on this server: its trainer has LoRA layers for "
                             f"{list(self.target_groups)} (train_unembed needs output_layer in trainer.target_modules)")

    def check_quota(self, owner: str) -> None:
        """QuotaExceeded when `owner` already holds its max_live_runs of runs and models (the quota and the usage named)."""
        quota = self.quotas.of(owner) if self.quotas is not None else None
        if quota is None or quota.max_live_runs is None:
            return
        runs = sum(1 for r in self.scheduler.registry.live() if r.owner == owner)
        models = sum(1 for m in self.models() if m.owner == owner)
        if runs + models >= quota.max_live_runs:
            raise QuotaExceeded(f"tenant {owner!r} holds {runs} adapter run(s) and {models} Tinker model(s), its quota "
                                f"{self.quotas.source(owner)}.max_live_runs is {quota.max_live_runs}: unload a model or "
                                "retire a run first")

    def create(self, model_id: str, owner: str, lora: LoraSpec, session_id: str, done: Callable[[Any, BaseException | None], None],
               *, request_id: str | None = None, user_metadata: dict | None = None, answer: dict | None = None) -> TinkerModel:
        """A new model, waiting for a slot (module doc); `done(None, None)` once its slot holds its
        seeded init. ValueError for a LoRA this server cannot train; QuotaExceeded past the quota.
        Operations may be queued on the returned model at once: they run after its creation."""
        self.check_lora(lora)
        self.check_quota(owner)
        model = self._model(model_id, owner, lora)
        seq = self.records.next_seq()
        self.records.add_model(model_id, owner, session_id, lora.rank, lora.seed, lora.targets, user_metadata, seq)
        model.applied_seq = seq
        model.restore_durable(None, [])  # its slot is filled from its seeded init when it gets one
        self.scheduler.add(model)
        model.submit(TinkerOp(OpKind.ALONE, done, run=lambda slot: None, request_id=request_id,
                              request=lambda: {"kind": "create", "answer": answer}))
        return model

    def revive(self, answer: Answer) -> list[TinkerModel]:
        """At start: every live model of an earlier process, back as an evicted tenant (module doc).
        `answer(request_id, request)` builds the done of an operation that must still be answered."""
        out = []
        for row in self.records.live_models():
            lora = LoraSpec(row.rank, row.seed, row.targets)
            model = self._model(row.model_id, row.tenant, lora, row.snapshot, row.snapshot_at)
            model.applied_seq, model.step = row.snapshot_seq, row.snapshot_step
            plan = restore_plan(row.model_id, self.records.futures_after(row.model_id, row.snapshot_seq), row.snapshot_step,
                                row.snapshot_at)
            self.scheduler.add(model)
            replay = [model.rebuild(f, _no_answer, replay=True) for f in plan.replay]
            pending = [model.rebuild(f, answer(f.request_id, f.request or {})) for f in plan.run]
            model.restore_durable(row.snapshot, replay + [op for op in pending if op is not None], plan.diverged)
            out.append(model)
            log.info("revived Tinker model %s of %s: step %d, %d to replay, %d to run%s", row.model_id, row.tenant,
                     row.snapshot_step, len(plan.replay), len(plan.run), " (diverged)" if plan.diverged else "")
        return out

    def get(self, model_id: str) -> TinkerModel | None:
        t = self.scheduler.get(model_id)
        return t if isinstance(t, TinkerModel) else None

    def models(self) -> list[TinkerModel]:
        return [t for t in self.scheduler.tenants(TenantKind.TINKER) if isinstance(t, TinkerModel)]

    def placement(self) -> tuple[dict[str, int], set[str]]:
        """Where the models are, for the views (api/tinker/model_views.py): model id -> the slot it holds
        (one read of the slot record), and the evicted ones whose snapshot the trainer spilled to disk
        (the scheduler's S4 set; the others' are in host memory)."""
        slots = {h.key: slot for slot, h in self.scheduler.slot_holders().items() if h.state is None}
        return slots, set(self.scheduler._spilled)

    def stats(self) -> dict[str, float]:
        """The Tinker gauges of GET /metrics (the scheduler's counters and the models' residency)."""
        c = self.scheduler.counters
        models = self.models()
        resident = {h.key for h in self.scheduler.slot_holders().values()}
        return {
            "mixed_steps": c["mixed_steps"], "forward_backward_calls": c["forward_backward_calls"],
            "coalescing_factor": c["forward_backward_calls"] / c["mixed_steps"] if c["mixed_steps"] else 0.0,
            "largest_step": c["largest_step"], "joined_steps": c["joined_steps"], "joined_calls": c["joined_calls"],
            "models_evicted": sum(1 for m in models if m.key not in resident),
            "models_waiting_for_slot": sum(1 for m in models if m.waiting_reason is not None),
            "evictions": c["evictions"], "restores": c["restores"],
            "snapshots_taken": self.snapshots.taken, "snapshots_recorded": self.snapshots.recorded,
            "snapshots_failed": self.snapshots.failed, "snapshot_loop_seconds": self.snapshots.loop_seconds,
            "snapshot_background_seconds": self.snapshots.background_seconds,
        }

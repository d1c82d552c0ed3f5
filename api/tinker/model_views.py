"""Tinker models as the operators and their tenants see them beside the runs: one `ModelRow` per live
model, built from the TinkerService's models (their `TinkerModel` and its stats,
service/tenants/tinker_stats.py) and where the scheduler has them. What GET /v1/tinker/models pages,
the dashboard and `lorafleet tinker` show, /v1/fleet counts and /metrics exports.

State (`residency`, as a run's):
  * resident: it holds trainer slot `slot`;
  * queued: it waits for its first slot (created beyond the free slots; its seeded init fills it);
  * evicted: it has trained and is out of its slot, its state `where`: "host" (the trainer's host
    memory), "disk" (spilled by the trainer) or "store" (its durable snapshot only: after a restart
    or a lost trainer).
While a queued or evicted model has a call waiting for a slot, `queue_position` is its 1-based place
in the scheduler's one queue (service/scheduling/slot_moves.py S2: oldest wait first, runs and models
together): the runs and models that began to wait before it, plus one.

Cost of a build: the live models (in memory), one read of the slot record, and the registry's queue
read in pages only as far as the newest waiting model's wait; the read cache (api/front/read_cache.py)
shares one build between the requests of a burst. On the serving loop, no thread.

Pages: creation order (oldest first, like the runs' list), filtered by state, owner (the admin only)
and a part of the model id; `limit` from `offset`, or after a `cursor` (keyset on the creation
number: a page boundary never repeats or skips a model when others come or go meanwhile).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.errors import BadValue

if TYPE_CHECKING:
    from api.tinker.service import TinkerService

RESIDENCY = ("resident", "queued", "evicted")
_CURSOR_PREFIX = "m"
_QUEUE_PAGE = 256


@dataclass(frozen=True)
class ModelRow:
    model_id: str
    owner: str
    session_id: str
    rank: int
    number: int  # creation order in this process (the cursor's key)
    residency: str
    slot: int | None
    queue_position: int | None
    where: str | None
    waiting_reason: str | None
    step: int
    tokens_trained: int
    forward_backward_calls: int
    last_loss: float | None
    loss_curve: tuple[tuple[int, float], ...]
    sample_calls: int
    sampled_sequences: int
    admissions: int
    waited_grants: int | None
    created_at: float
    first_slot_at: float | None
    updated_at: float


@dataclass(frozen=True)
class ModelQuery:
    """One page of the model list (the runs' ListQuery's rules: service/registry/views.py)."""

    state: str | None = None
    owner: str | None = None
    id_contains: str | None = None
    limit: int = 100
    offset: int = 0
    cursor: str | None = None

    def __post_init__(self) -> None:
        if self.state is not None and self.state not in RESIDENCY:
            raise BadValue(f"state {self.state!r} is not a model state: {', '.join(RESIDENCY)}", field="state")
        if self.cursor is not None and self.offset:
            raise BadValue("give a cursor or an offset, not both (a cursor continues where its page ended)", field="cursor")
        if self.cursor is not None:
            after_number(self.cursor)


def after_number(cursor: str) -> int:
    digits = cursor[len(_CURSOR_PREFIX):] if cursor.startswith(_CURSOR_PREFIX) else ""
    if not digits.isdigit():
        raise BadValue(f"cursor {cursor!r} is not one this service gave out; pass the next_cursor of a page "
                       "(or leave it out for the first page)", field="cursor")
    return int(digits)


def model_rows(service: TinkerService) -> list[ModelRow]:
    """Every live model, in creation order (module doc)."""
    records = sorted(service.models.values(), key=lambda r: r.model.stats.number)
    slots, spilled = service.fleet.placement()
    since = {r.model_id: r.model.slot_wait() for r in records if r.model_id not in slots}  # one look at each head
    waiting = {model_id: t for model_id, t in since.items() if t is not None}
    places = _places(service, waiting)
    return [_row(r, slots.get(r.model_id), places.get(r.model_id), r.model_id in spilled) for r in records]


def _row(record, slot: int | None, place: int | None, spilled: bool) -> ModelRow:  # noqa: ANN001 - a ModelRecord
    m, s = record.model, record.model.stats
    if slot is not None:
        residency, where = "resident", None
    elif m.restore_from() is not None:  # its slot is filled from its durable state: its seeded init, or a snapshot
        fresh = m.journal.snapshot_ref is None and m.step == 0
        residency, where = ("queued", None) if fresh else ("evicted", "store")
    else:
        residency, where = "evicted", "disk" if spilled else "host"
    return ModelRow(record.model_id, record.tenant, record.session_id, record.rank, s.number, residency, slot, place, where,
                    m.waiting_reason if slot is None else None, m.step, s.tokens_trained, s.forward_backward_calls,
                    s.last_loss, s.curve, s.sample_calls, s.sampled_sequences, s.admissions, s.waited_grants, s.created_at,
                    s.first_slot_at, s.updated_at)


def _places(service: TinkerService, waiting: dict[str, float]) -> dict[str, int]:
    """model id -> its place in the one queue: the runs queued before it (the registry's queue, read as far
    as the newest wait) and the models waiting before it, plus one."""
    if not waiting:
        return {}
    registry = service.fleet.scheduler.registry
    newest, runs, offset = max(waiting.values()), [], 0
    while True:
        page = registry.queue_heads(_QUEUE_PAGE, offset)
        runs += [q.queued_at for q in page]
        if len(page) < _QUEUE_PAGE or (page and page[-1].queued_at > newest):
            break
        offset += _QUEUE_PAGE
    runs.sort()
    order = sorted(waiting.items(), key=lambda kv: (kv[1], kv[0]))
    return {mid: i + 1 + bisect.bisect_left(runs, since) for i, (mid, since) in enumerate(order)}


def page(rows: list[ModelRow], query: ModelQuery, tenant: str | None) -> tuple[list[ModelRow], int, str | None]:
    """(the page, rows matching in all, the next page's cursor or None) for the caller `tenant` (None: the admin)."""
    needle = (query.id_contains or "").lower()
    match = [r for r in rows
             if (tenant is None or r.owner == tenant)
             and (query.owner is None or r.owner == query.owner)
             and (query.state is None or r.residency == query.state)
             and needle in r.model_id.lower()]
    start = match
    if query.cursor is not None:
        after = after_number(query.cursor)
        start = [r for r in match if r.number > after]
    shown = start[query.offset: query.offset + query.limit]
    more = len(start) > query.offset + query.limit
    return shown, len(match), f"{_CURSOR_PREFIX}{shown[-1].number}" if more and shown else None


def residency_counts(rows: list[ModelRow]) -> dict[str, int]:
    return {where: sum(1 for r in rows if r.residency == where) for where in RESIDENCY}


def series_rows(rows: list[ModelRow], series: str, top_k: int) -> list[ModelRow]:
    """The models that get per-model series on /metrics, chosen as the runs' (settings.metrics_adapter_series):
    none, the `top_k` updated most recently, or all."""
    if series == "all":
        return rows
    if series == "top":
        return sorted(rows, key=lambda r: r.updated_at, reverse=True)[:top_k]
    return []


def model_of_path(path: str | None) -> str | None:
    """The model id of a tinker://<model>/<kind>/<name> path (a sampler checkpoint's), else None."""
    prefix = "tinker://"
    if not path or not path.startswith(prefix):
        return None
    parts = path[len(prefix):].split("/")
    return parts[0] if len(parts) == 3 and parts[0] else None


def note_sample(service: TinkerService, tenant: str, model_path: str | None, sequences: int) -> None:
    """A sample request of a session opened on `model_path`: its model's stats count it (the caller's own model only)."""
    record = service.models.get(model_of_path(model_path) or "")
    if record is not None and record.tenant == tenant:
        record.model.stats.sampled(sequences)

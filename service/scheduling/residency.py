"""Keep-warm eviction and turns: which resident tenants give their slot up this round.

A pure policy (no I/O), ONE for every kind of tenant (RL and SFT runs, Tinker models): the
scheduler (service/scheduling/scheduler.py) feeds it what it knows about each resident tenant and how many
tenants wait for a slot, and evicts what it returns (the trainer's bit-exact swap-out under the
tenant's key, then the slot record gives the slot back).

Policy (docs/concepts.md "More tenants than slots"), applied at each placement, which the loop
runs at every round boundary (between two mixed train calls, never inside one):
  P1 nothing is evicted unless runs wait that want a slot (`wanting`) beyond the free slots:
     a slot is never emptied for nobody;
  P2 idle first: a resident with no ready work (RL: fewer groups staged than a step; SFT: no rows;
     Tinker: no queued call) that has not worked for `idle_evict_s` is evicted, least recently
     active first;
  P3 turns: while tenants still wait, a resident that has taken its turn's optimizer steps since it
     came in (`turn_steps`, times its tenant's priority: service/config/quotas.py) is evicted, least
     recently active first, so that none waits forever (the bound: docs/concepts.md "Fair turns");
  P4 at most as many evictions as waiting tenants beyond the free slots; a tenant that came in
     this round (steps_in == 0 and not idle) is never evicted by P3 (turn_steps >= 1).
A Tinker model being created waits like any other tenant (its creation is its first queued call,
service/scheduling/scheduler.py S1): it takes a free slot, or one a resident gives up by the same
rule; it is never refused for room.

The engines' side follows the same rule of recency (`AdapterLru`): a served adapter is loaded on
demand, and the least recently used one that no request is using is unloaded to make room; a load
that finds every loaded adapter in use waits for one to be released, it never fails for room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Resident:
    """What the runtime knows of one resident (slot-holding, prepared) run."""

    registration_id: str
    idle_s: float  # seconds since it last stepped (or came in, if it has not stepped since)
    ready: bool  # a whole step is ready for it now (RL: staged groups; SFT: rows left)
    steps_in: int  # steps taken since it last came into its slot
    last_active: float  # monotonic time of its last step or arrival; smaller = less recently used
    slot: int | None = None  # the slot it holds (the scheduler's, for the eviction)
    turn_steps: int | None = None  # its turn (P3: knobs.turn_of its owner); None = knobs.turn_steps


@dataclass(frozen=True)
class ResidencyKnobs:
    idle_evict_s: float  # P2
    turn_steps: int  # P3
    quotas: Any = None  # service.config.quotas.Quotas: tenants' priorities (P3) and token shares; None = all equal

    def turn_of(self, owner: str | None) -> int:
        """The optimizer steps of one turn of `owner`'s tenants (P3): turn_steps x its priority."""
        return self.turn_steps * (self.quotas.priority(owner) if self.quotas is not None else 1)


def choose_evictions(residents: list[Resident], wanting: int, free_slots: int, knobs: ResidencyKnobs) -> list[str]:
    """Registration ids to evict now, in eviction order (P1-P4)."""
    need = wanting - free_slots
    if need <= 0:
        return []  # P1
    lru = sorted(residents, key=lambda r: (r.last_active, r.registration_id))
    idle = _idle(lru, knobs)  # P2
    taken = {r.registration_id for r in idle}
    turns = [r for r in lru if r.registration_id not in taken and r.steps_in >= (r.turn_steps or knobs.turn_steps)]  # P3
    return [r.registration_id for r in (idle + turns)[:need]]  # P4


def _idle(lru: list[Resident], knobs: ResidencyKnobs) -> list[Resident]:
    return [r for r in lru if not r.ready and r.idle_s >= knobs.idle_evict_s]


class AdapterLru:
    """Which adapters one engine (or sampler) keeps loaded, by the one rule of recency: at most
    `capacity`; `touch` marks one used now; `room_for` names the least recently used ones that no
    request is using (`busy`), to unload before loading another. Pure (no I/O): the caller loads
    and unloads, then tells it (`loaded`, `forget`)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an adapter cache holds at least 1 adapter, got capacity {capacity}")
        self.capacity = capacity
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first

    def __contains__(self, name: str) -> bool:
        return name in self._order

    def __len__(self) -> int:
        return len(self._order)

    def names(self) -> list[str]:
        """Loaded names, least recently used first."""
        return list(self._order)

    def touch(self, name: str) -> None:
        if name in self._order:
            self._order.move_to_end(name)

    def loaded(self, name: str) -> None:
        self._order[name] = None
        self._order.move_to_end(name)

    def forget(self, name: str) -> None:
        self._order.pop(name, None)

    def room_for(self, name: str, busy: Callable[[str], bool] | Iterable[str] = ()) -> list[str] | None:
        """What to unload so `name` fits: [] when it is loaded or there is room; the least recently
        used idle names otherwise; None when too few are idle (every other one is in use: wait)."""
        if name in self._order or len(self._order) < self.capacity:
            return []
        in_use = busy if callable(busy) else set(busy).__contains__
        need = len(self._order) - self.capacity + 1
        idle = [n for n in self._order if not in_use(n)][:need]
        return idle if len(idle) == need else None

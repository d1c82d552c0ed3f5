"""Keep-warm eviction and turns: which resident runs give their slot up this round.

A pure policy (no I/O): the controller feeds it what the runtime knows about each resident
run and how many queued runs want a slot, and evicts what it returns (runtime `evict` = the
trainer's bit-exact swap-out under the registration id, then the registry's `release_slot`).

Policy (docs/concepts.md "More tenants than slots"), applied at each reconcile, which the loop
runs at every round boundary (between two mixed train calls, never inside one):
  P1 nothing is evicted unless runs wait that want a slot (`wanting`) beyond the free slots:
     a slot is never emptied for nobody;
  P2 idle first: a resident with no ready step (RL: fewer groups staged than a step; SFT: none)
     that has not stepped for `idle_evict_s` is evicted, least recently active first;
  P3 turns: while runs still wait, a resident that has taken `turn_steps` steps since it came in
     is evicted, least recently active first, so that none waits forever;
  P4 at most as many evictions as waiting runs beyond the free slots; a run that came in this
     round (steps_in == 0 and not idle) is never evicted by P3 (turn_steps >= 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """What the runtime knows of one resident (slot-holding, prepared) run."""

    registration_id: str
    idle_s: float  # seconds since it last stepped (or came in, if it has not stepped since)
    ready: bool  # a whole step is ready for it now (RL: staged groups; SFT: rows left)
    steps_in: int  # steps taken since it last came into its slot
    last_active: float  # monotonic time of its last step or arrival; smaller = less recently used


@dataclass(frozen=True)
class ResidencyKnobs:
    idle_evict_s: float  # P2
    turn_steps: int  # P3


def choose_evictions(residents: list[Resident], wanting: int, free_slots: int, knobs: ResidencyKnobs) -> list[str]:
    """Registration ids to evict now, in eviction order (P1-P4)."""
    need = wanting - free_slots
    if need <= 0:
        return []  # P1
    lru = sorted(residents, key=lambda r: (r.last_active, r.registration_id))
    idle = [r for r in lru if not r.ready and r.idle_s >= knobs.idle_evict_s]  # P2
    taken = {r.registration_id for r in idle}
    turns = [r for r in lru if r.registration_id not in taken and r.steps_in >= knobs.turn_steps]  # P3
    return [r.registration_id for r in (idle + turns)[:need]]  # P4

"""The controller as a named Ray actor (`lorafleet-controller`).

A thin wrapper: the actor IS service.controller.Controller, run in its own
process with a small thread pool, so tenant calls (GET/POST from the API) are
answered while a reconcile pass waits on the trainer. The Controller is
thread-safe for that: the registry serializes its transactions, and reconcile
passes are serialized by their own lock.

Typed errors (NotFound, Conflict, ...) raised in the actor reach the caller of
`ray.get` as instances of the same classes (Ray's RayTaskError subclasses the
cause), so `except NotFound` works on both sides.
"""

from __future__ import annotations

from typing import Any

import ray

from service.config import ServiceSettings, SlotCapacity
from service.controller import Controller

CONTROLLER_ACTOR_NAME = "lorafleet-controller"
DEFAULT_NAMESPACE = "lorafleet"
# Concurrent calls the actor serves: tenant reads must not queue behind a reconcile pass.
CONTROLLER_MAX_CONCURRENCY = 16


def start_controller_actor(
    settings: ServiceSettings,
    capacity: SlotCapacity,
    *,
    namespace: str = DEFAULT_NAMESPACE,
    detached: bool = False,
) -> Any:
    """Start the named controller actor and wait until its registry is open.

    Refuses (ValueError) when an actor of that name already lives in the
    namespace: two controllers over one registry would break its invariants."""
    try:
        ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=namespace)
    except ValueError:
        pass
    else:
        raise ValueError(f"a controller actor {CONTROLLER_ACTOR_NAME!r} already runs in namespace {namespace!r}")
    actor_cls = ray.remote(Controller)
    handle = actor_cls.options(
        name=CONTROLLER_ACTOR_NAME,
        namespace=namespace,
        num_cpus=0,  # bookkeeping only; never holds a CPU the trainer or engines need
        max_concurrency=CONTROLLER_MAX_CONCURRENCY,
        lifetime="detached" if detached else None,
        max_restarts=0,  # a restart must be a deliberate new start over the same registry file
    ).remote(settings, capacity)
    ray.get(handle.health.remote(), timeout=120)
    return handle


def get_controller_actor(namespace: str = DEFAULT_NAMESPACE) -> Any:
    """The running controller actor; ValueError when none runs."""
    return ray.get_actor(CONTROLLER_ACTOR_NAME, namespace=namespace)

"""Typed errors of the control plane.

Every error a tenant can cause is one of these; the API maps each class to one
HTTP status (api/app.py), so the mapping lives in exactly one place. Messages
say what was wrong and what is allowed. `field` names the offending config
field (dotted, e.g. "config.data.path") when there is one.

The classes pickle with all their attributes (Ray ships actor exceptions to
the caller by pickling; the default Exception pickling would drop keyword
attributes).
"""

from __future__ import annotations


class LorafleetError(Exception):
    """Base of the tenant-facing errors. `code` is a stable machine-readable tag."""

    code = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def __reduce__(self):
        return (_rebuild, (type(self), self.message, self.field))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[LorafleetError], message: str, field: str | None) -> LorafleetError:
    return cls(message, field=field)


class BadValue(LorafleetError):
    """A value that is well-formed but cannot work (missing data file, rank above max, path escape)."""

    code = "bad_value"


class NotFound(LorafleetError):
    """No adapter run of that name."""

    code = "not_found"


class Conflict(LorafleetError):
    """The request clashes with the current state (name in use, still retiring, already retiring)."""

    code = "conflict"


class NoFreeSlot(Conflict):
    """Every trainer slot is held by a live adapter run."""

    code = "no_free_slot"


class QuotaExceeded(LorafleetError):
    """A tenant's quota is used up (live or queued runs per key: service/config/quotas.py); the
    message gives the quota and the tenant's usage. Nothing was recorded (HTTP 429)."""

    code = "quota_exceeded"


class ServiceStopping(LorafleetError):
    """The service is stopping (its state is being saved for the restart): the request was not taken;
    the same request, sent again, is served after the restart (HTTP 503: clients retry)."""

    code = "stopping"


class NotReady(RuntimeError):
    """A part of the fleet a step needs is still starting (the engines, for an RL run's preparation):
    the step is tried again at the next pass; nothing changed."""


class PlacementError(ValueError):
    """A plan that cannot run on the cluster; the message shows the arithmetic."""


class NoPlacement(PlacementError):
    """A lost node's groups found no room within placement.node_loss_wait_s: the service drains and stops
    (service/fleet/node_faults.py raises it, service/loop/training_loop.py stops on it)."""


class NoRoomYet(PlacementError):
    """Moving a lost engine found no room this time; the next engine check tries again."""

"""The one way the coordinator waits on an actor: `call(ref, timeout_s, what)` (and `call_async`, its
twin for a coroutine on the API's event loop: it awaits the ObjectRef instead of blocking a thread).

`ray.get` with a deadline; an exception raised inside the actor comes back as
itself (Ray wraps it in a RayTaskError whose `cause` is the original), so callers
catch `TrainerLost`, `RolloutError`, `ValueError`, ... as usual. A timeout
raises `TimeoutError` naming the call, and a dead actor raises Ray's actor error
unchanged (`is_actor_lost` tells it apart).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError


def call(ref: Any, timeout_s: float, what: str) -> Any:
    """The result of one ObjectRef (or a list of them) within `timeout_s`; `what` names the call in errors."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except GetTimeoutError:
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s") from None
    except RayTaskError as e:
        raise _unwrapped(e) from None


async def call_async(ref: Any, timeout_s: float, what: str) -> Any:
    """`call` for a coroutine: the ObjectRef awaited on the running loop, errors as `call` gives them."""
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} did not answer within {timeout_s:g} s") from None
    except RayTaskError as e:
        raise _unwrapped(e) from None


def _unwrapped(error: RayTaskError) -> BaseException:
    """The exception raised inside the actor (Ray's `cause`); Ray's own error when the actor is gone."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) and not is_actor_lost(error) else error


def is_actor_lost(error: BaseException) -> bool:
    """Whether `error` says the actor's process is gone (killed, crashed, node lost)."""
    return isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError))

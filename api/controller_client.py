"""How the API calls the controller: in-process object or Ray actor handle, one interface.

`create_app` takes either a `service.controller.Controller` (tests, single
process) or the handle of the `lorafleet-controller` actor. Both are called
with a timeout (settings.controller_timeout_s); a plain controller's blocking
SQLite work runs in a worker thread so the event loop keeps serving. Typed
errors come back as themselves (a Ray-wrapped error is unwrapped to its cause).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import anyio.to_thread

from service.errors import LorafleetError


class ControllerUnavailable(Exception):
    """The controller did not answer in time or is gone (HTTP 503)."""


class ControllerClient:
    def __init__(self, handle: Any, timeout_s: float) -> None:
        self._handle = handle
        self._timeout_s = timeout_s
        # A Ray actor handle's methods have .remote(); a plain object's do not.
        self._is_actor = hasattr(getattr(handle, "health", None), "remote")

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            if self._is_actor:
                ref = getattr(self._handle, method).remote(*args, **kwargs)
                return await asyncio.wait_for(_await_ref(ref), self._timeout_s)
            fn = functools.partial(getattr(self._handle, method), *args, **kwargs)
            return await asyncio.wait_for(anyio.to_thread.run_sync(fn), self._timeout_s)
        except TimeoutError:
            raise ControllerUnavailable(f"the controller did not answer {method} within {self._timeout_s:g} s") from None
        except LorafleetError as e:
            cause = getattr(e, "cause", None)  # Ray's dual RayTaskError: re-raise the original
            raise (cause if isinstance(cause, LorafleetError) else e) from None
        except Exception as e:
            if type(e).__module__.startswith("ray.") and type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
                raise ControllerUnavailable(f"the controller actor is unavailable: {type(e).__name__}") from None
            raise


async def _await_ref(ref: Any) -> Any:
    return await ref

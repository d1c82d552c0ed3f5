"""The engines Tinker sampling uses: which there are (following the fleet), which sampler adapters each
holds, and which one serves a request.

**The fleet's list.** ``EngineSource`` answers the engines now (index, URL, whether the rollout worker
routes to it, its requests in flight, how often it was started). The sampler reads it at most every
``refresh_s`` and at once after an engine failed, never caching one URL: an engine added, restarted
or replaced after a node loss (a new URL, or a new start) is a new engine to the sampler and is used
at once; one that is gone is forgotten. In the fleet the source is the rollout worker's
``engine_health`` (api/tinker/fleet.py); ``static_engines(urls)`` serves a fixed list (tests, tools).

**Residency** (one engine's sampler adapters): the scheduler's one rule of recency
(service/scheduling/residency.py ``AdapterLru``), one cache per engine of ``capacity`` adapters (the
job's ``engines.max_loaded_loras`` less what the dataset runs may hold: api/tinker/fleet.py). A
session's adapter is loaded when a request needs it there; to make room the least recently used one
that no request is using is unloaded.

**Routing** (one rule, docs/tinker.md "Sampling"): among the engines in routing,
  R1 those holding the session's adapter (every one, for the base model); of those the session's
     previous engine (its prefix cache), else the least loaded;
  R2 if none holds it: the session's previous engine if it can load it now, else the least loaded
     engine that can (a free place first, then one with an idle adapter to unload);
  R3 if no engine can load it now (every loaded adapter on every engine is in use), the request waits
     for a request to end: it never waits while an engine has room. Counted (``waits``): requests that
     waited for room (``room_waits``) and, checked apart from R1-R3 when a wait begins, those that
     waited while an engine in routing had a free place or an idle adapter (``waits_with_room``: 0).
Least loaded = fewest requests in flight there (the sampler's own and the rollout worker's at its
last reading), then the lower index.

Invariants (one asyncio loop; the steps between awaits are atomic):
  E1 a request counts in its engine's use of its adapter (``in_use``) from the moment it is routed
     until it is released, so that adapter is never unloaded under it;
  E2 the adapter operations of one engine run one at a time in arrival order (``ops``), so an unload
     and a later load of the same name never overlap, and a request generates only once its
     adapter's load has finished (``loading``);
  E3 an engine that failed a request is out of routing until the fleet's list is read again (at
     once, by the next request) and what the engine holds was read back (``_reconcile``): names the
     sampler does not know are unloaded, names it lost are forgotten; an engine that cannot be read
     back stays out (each later reading tries again).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from rollout.engines.client import EngineClient, EngineError
from rollout.engines.weights import AdapterWeights
from service.scheduling.residency import AdapterLru

log = logging.getLogger(__name__)

LORA_PREFIX = "tinker-samp-"  # every sampler adapter's engine name starts so (never a dataset run's "<name>@v<k>")


@dataclass(frozen=True)
class EngineEntry:
    """One engine as the fleet lists it."""

    index: int
    url: str
    routable: bool = True
    inflight: int = 0  # the rollout worker's requests in flight there
    starts: int = 1  # a restart (same URL or not) is a new engine to the sampler

    @property
    def key(self) -> str:
        return f"{self.index}|{self.url}|{self.starts}"


EngineSource = Callable[[], Awaitable[list[EngineEntry]]]


def static_engines(urls: list[str]) -> EngineSource:
    """A fixed list of engine URLs (index = position)."""
    entries = [EngineEntry(i, u) for i, u in enumerate(urls)]

    async def source() -> list[EngineEntry]:
        return entries

    return source


class NoEngine(RuntimeError):
    """No engine can serve the request (none is up, or every one failed it); the message says which."""


class EngineFailed(RuntimeError):
    """An engine refused or failed a routed request's adapter operation (the request is released)."""

    def __init__(self, engine: "SamplerEngine", error: EngineError):
        super().__init__(f"engine {engine.entry.index}: {error}")
        self.engine, self.error = engine, error


@dataclass
class SamplerEngine:
    """One engine as the sampler sees it."""

    entry: EngineEntry
    client: EngineClient
    lru: AdapterLru
    in_use: Counter = field(default_factory=Counter)  # adapter name -> requests routed here using it (E1)
    loading: dict[str, asyncio.Future] = field(default_factory=dict)  # names whose load has not finished (E2)
    ops: asyncio.Lock = field(default_factory=asyncio.Lock)  # E2
    active: int = 0  # the sampler's requests in flight here
    up: bool = True
    deterministic: bool | None = None  # started with --enable-deterministic-inference (asked once)

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def load(self) -> tuple[int, int]:
        return (self.active + self.entry.inflight, self.entry.index)


@dataclass
class Routed:
    """A request's place: its engine, and the adapter operations to run before it generates."""

    engine: SamplerEngine
    name: str | None
    victims: list[str]
    load: bool
    ready: asyncio.Future | None  # another request's load of this name, to wait for


class SamplerEngines:
    def __init__(self, source: EngineSource, *, capacity: int, request_timeout_s: float = 600.0,
                 refresh_s: float = 2.0, engine_wait_s: float = 120.0) -> None:
        """``capacity``: sampler adapters per engine; ``engine_wait_s``: how long a request waits for a
        first engine to come up (the service starting, every engine restarting) before it fails."""
        self.source = source
        self.capacity = capacity
        self.request_timeout_s = request_timeout_s
        self.refresh_s = refresh_s
        self.engine_wait_s = engine_wait_s
        self.engines: dict[str, SamplerEngine] = {}  # by EngineEntry.key
        self.counts: dict[int, Counter] = {}  # engine index -> requests, adapter_loads, adapter_unloads
        self.waits: Counter = Counter()  # room_waits, waits_with_room (R3, module doc)
        self._cond: asyncio.Condition | None = None  # guards routing; notified when a request ends or engines change
        self._refreshing: asyncio.Lock | None = None
        self._refreshed_at = -1e18

    def _loop_state(self) -> asyncio.Condition:
        if self._cond is None:  # made on the serving loop (its primitives bind to it)
            self._cond = asyncio.Condition()
            self._refreshing = asyncio.Lock()
        return self._cond

    # -- the fleet's list --------------------------------------------------------------------------------

    async def refresh(self, force: bool = False) -> None:
        """Read the fleet's list (at most every refresh_s unless forced) and follow it (E3)."""
        cond = self._loop_state()
        loop = asyncio.get_running_loop()
        async with self._refreshing:
            if not force and loop.time() - self._refreshed_at < self.refresh_s:
                return
            try:
                listed = await self.source()
            except Exception as err:  # noqa: BLE001 - keep routing on what we knew; try again later
                log.warning("Tinker sampler: reading the engine list failed: %s: %s", type(err).__name__, err)
                self._refreshed_at = loop.time()
                return
            self._refreshed_at = loop.time()
            now = {e.key: e for e in listed}
            for key in [k for k in self.engines if k not in now]:  # gone (replaced or removed)
                old = self.engines.pop(key)
                old.up = False
                if not old.active:
                    await old.client.aclose()
            for key, entry in now.items():
                e = self.engines.get(key)
                if e is None:
                    e = SamplerEngine(entry, EngineClient(entry.url, request_timeout_s=self.request_timeout_s),
                                      AdapterLru(self.capacity), up=False)
                    self.engines[key] = e
                    self.counts.setdefault(entry.index, Counter())
                e.entry = entry
                if entry.routable and not e.up:
                    e.up = await self._reconcile(e)
                elif not entry.routable:
                    e.up = False
        async with cond:
            cond.notify_all()

    async def _reconcile(self, e: SamplerEngine) -> bool:
        """E3: bring what the sampler believes of ``e`` in line with what it holds; False when unreachable."""
        try:
            held = {n for n in await e.client.loaded_adapters() if n.startswith(LORA_PREFIX) and "@" not in n}
            for name in sorted(held):
                if name not in e.lru:
                    await e.client.unload_adapter(name)  # a previous sampler process's, or one lost track of
        except EngineError as err:
            log.info("Tinker sampler: engine %d (%s) not usable yet: %s", e.entry.index, e.entry.url, err)
            return False
        for name in [n for n in e.lru.names() if n not in held and not e.in_use[n]]:
            e.lru.forget(name)
        return True

    def lost(self, e: SamplerEngine, err: BaseException) -> None:
        """A request found ``e`` unreachable: out of routing until the list names it again (E3)."""
        if e.up:
            log.warning("Tinker sampler: engine %d (%s) failed: %s; routing around it", e.entry.index, e.entry.url, err)
        e.up = False
        self._refreshed_at = -1e18  # the next request reads the list again

    # -- routing and residency --------------------------------------------------------------------------

    def _route(self, name: str | None, sticky: str | None, tried: set[str]) -> Routed | None:
        """R1-R3 over the engines in routing (None: R3, wait)."""
        up = [e for e in self.engines.values() if e.up and e.key not in tried]
        holding = [e for e in up if name is None or (name in e.lru and name not in e.loading)]
        if holding:  # R1
            e = next((x for x in holding if x.key == sticky), None) or min(holding, key=lambda x: x.load)
            return Routed(e, name, [], False, None)
        loading = [e for e in up if name in e.lru]  # another request is loading it there: join it
        if loading:
            e = next((x for x in loading if x.key == sticky), None) or min(loading, key=lambda x: x.load)
            return Routed(e, name, [], False, e.loading.get(name))
        options = []
        for e in up:  # R2
            victims = e.lru.room_for(name, lambda n, e=e: e.in_use[n] > 0)
            if victims is not None:
                options.append((e.key != sticky, bool(victims), e.load, e, victims))
        if not options:
            return None
        *_, e, victims = min(options, key=lambda o: o[:3])
        return Routed(e, name, victims, True, None)

    async def acquire(self, name: str | None, weights_folder, sticky: str | None, tried: set[str]) -> SamplerEngine:  # noqa: ANN001
        """An engine for one request of adapter ``name`` (None: the base model), its adapter loaded
        there and counted in use (E1). NoEngine when none can serve it: no engine came up within
        engine_wait_s, or every engine in the list was ``tried`` already."""
        cond = self._loop_state()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.engine_wait_s
        waited = False
        while True:
            await self.refresh()
            async with cond:
                up = [e for e in self.engines.values() if e.up]
                if tried and all(e.key in tried for e in up):  # never wait after a failure: fail with it
                    raise NoEngine(f"every sampling engine failed this request ({len(tried)} tried)")
                routed = self._route(name, sticky, tried) if up else None
                if routed is not None:
                    e = routed.engine
                    for v in routed.victims:
                        e.lru.forget(v)
                    if routed.load:
                        e.lru.loaded(name)
                        e.loading[name] = loop.create_future()
                    elif name is not None:
                        e.lru.touch(name)
                    if name is not None:
                        e.in_use[name] += 1
                    e.active += 1
                    self.counts[e.entry.index]["requests"] += 1
                elif not up and loop.time() > deadline:
                    raise NoEngine(f"no sampling engine is up (waited {self.engine_wait_s:.0f} s for the fleet's engines)")
                else:  # R3, or no engine yet: until a request ends, or the list is read again
                    if up and not waited:
                        waited = True
                        self.waits["room_waits"] += 1
                        self.waits["waits_with_room"] += any(_has_room(e) for e in up if e.key not in tried)
                    try:
                        await asyncio.wait_for(cond.wait(), self.refresh_s)
                    except TimeoutError:
                        pass
                    continue
            try:
                await self._prepare(routed, weights_folder)
            except BaseException as err:
                await self.release(e, name)
                if isinstance(err, EngineError):
                    raise EngineFailed(e, err) from err
                raise
            return e

    async def _prepare(self, routed: Routed, weights_folder) -> None:  # noqa: ANN001 - a Path
        """The routed request's adapter operations (E2), or its wait for another request's load."""
        e, name = routed.engine, routed.name
        if routed.ready is not None:
            await asyncio.shield(routed.ready)
            return
        if not (routed.victims or routed.load):
            return
        async with e.ops:
            try:
                for v in routed.victims:
                    await e.client.unload_adapter(v)
                    self.counts[e.entry.index]["adapter_unloads"] += 1
                if routed.load:
                    await self._load(e, name, weights_folder)
            except BaseException as err:
                if routed.load:
                    e.lru.forget(name)
                    fut = e.loading.pop(name)
                    fut.set_exception(err)
                    fut.exception()  # retrieved: those waiting on it get it too
                raise
        if routed.load:
            e.loading.pop(name).set_result(None)

    async def _load(self, e: SamplerEngine, name: str, weights_folder) -> None:  # noqa: ANN001 - a Path
        weights = AdapterWeights.from_folder(weights_folder)
        try:
            await e.client.load_adapter(name, weights, transfer="disk")
        except EngineError as err:
            # stock SGLang answers 400 "already loaded" for a name it holds: it holds this session's
            # weights (names are per session, and a session's weights never change)
            if err.status != 400 or "already" not in err.body:
                raise
        self.counts[e.entry.index]["adapter_loads"] += 1

    async def release(self, e: SamplerEngine, name: str | None) -> None:
        cond = self._loop_state()
        async with cond:
            e.active -= 1
            if name is not None:
                e.in_use[name] -= 1
                if e.in_use[name] <= 0:
                    del e.in_use[name]
            if not e.up and e.key not in self.engines and not e.active:
                await e.client.aclose()
            cond.notify_all()

    def holders(self, name: str) -> list[int]:
        """Indexes of the engines in routing that hold ``name`` (tests, metrics)."""
        return sorted(e.entry.index for e in self.engines.values() if e.up and name in e.lru)

    def metrics(self) -> dict[str, float]:
        """Per engine index: ``sampler.<count>.<index>`` (api/tinker/metrics.py renders them with an engine label);
        the waits for room: ``sampler_waits.<count>``."""
        return {**{f"sampler.{what}.{index}": float(counts[what]) for index, counts in sorted(self.counts.items())
                   for what in ("requests", "adapter_loads", "adapter_unloads")},
                **{f"sampler_waits.{what}": float(self.waits[what]) for what in ("room_waits", "waits_with_room")}}

    async def aclose(self) -> None:
        for e in self.engines.values():
            await e.client.aclose()
        self.engines.clear()


def _has_room(e: SamplerEngine) -> bool:
    """A free place, or a loaded adapter no request uses (what a load could take), on ``e``."""
    return len(e.lru) < e.lru.capacity or any(not e.in_use[n] for n in e.lru.names())

"""The Tinker sampler over several engines (api/tinker/sampling/engines.py, api/tinker/sampling/sampler.py): the
routing rule, one adapter cache per engine, following the fleet's list, and an engine lost mid-request.

Driven with FAKE engine clients (`FakeEngine`: load, unload and generate answer when the test lets
them, and an engine can be killed at a chosen moment): the one way to hold requests in flight on
chosen engines and lose an engine exactly while one runs. The real thing (two SGLang CPU engines, one
killed mid-request) is tests/integration/test_tinker_sampling_fleet.py. The sessions' and records'
durability runs against a real Registry (SQLite) in a temporary folder.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout.engines.client import EngineUnavailable

pytestmark = pytest.mark.unit


class FakeEngine:
    """FAKE engine client (see module doc): one engine of `capacity` adapters."""

    def __init__(self, url: str, capacity: int) -> None:
        self.url, self.capacity = url, capacity
        self.loaded: set[str] = set()
        self.sampling: dict[str, int] = {}
        self.log: list[tuple[str, str | None]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.dead = False

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnavailable("connection refused", url=self.url)

    async def load_adapter(self, name, weights, transfer="disk"):
        self._alive()
        assert len(self.loaded) < self.capacity, f"{self.url}: load of {name} past capacity {sorted(self.loaded)}"
        self.loaded.add(name)
        self.log.append(("load", name))

    async def unload_adapter(self, name):
        self._alive()
        assert not self.sampling.get(name), f"{name} unloaded while sampled"
        self.loaded.discard(name)
        self.log.append(("unload", name))

    async def generate_many(self, rids, input_ids, sampling_params, lora_name, logprob_start_len, top_logprobs_num):
        """One request for the group, as the real client sends it: it holds the engine until the gate
        opens, and logs one ("generate", lora) per sample, the generations the engine runs."""
        self._alive()
        assert lora_name is None or lora_name in self.loaded, f"{lora_name} sampled on {self.url} while not loaded"
        self.log += [("generate", lora_name)] * len(rids)
        self.sampling[lora_name] = self.sampling.get(lora_name, 0) + len(rids)  # generations in flight
        try:
            await self.gate.wait()
        finally:
            self.sampling[lora_name] -= len(rids)
        self._alive()  # killed while the request ran: the connection drops
        return [type("R", (), {"finish_reason": "length", "token_ids": [7, 8], "logprobs": [-0.5, -0.25], "top_logprobs": None,
                               "prompt_logprobs": None, "prompt_top_logprobs": None})() for _ in rids]

    async def server_info(self):
        self._alive()
        return {}

    async def loaded_adapters(self):
        self._alive()
        return sorted(self.loaded)

    async def aclose(self):
        pass


class World:
    """Fake engines by URL, the fleet's list (mutable), and a sampler over it."""

    def __init__(self, tmp_path: Path, monkeypatch, capacity: int = 1, urls=("http://e0", "http://e1"), records=None,
                 refresh_s: float = 0.05):
        from api.tinker.sampling import engines as sampler_engines
        from api.tinker.sampling.engines import EngineEntry
        from api.tinker.sampling.sampler import SglangSampler
        from rollout.engines.weights import AdapterWeights

        self.fakes: dict[str, FakeEngine] = {}
        monkeypatch.setattr(sampler_engines, "EngineClient", lambda url, **kw: self.fakes.setdefault(url, FakeEngine(url, capacity)))
        monkeypatch.setattr(AdapterWeights, "from_folder", staticmethod(lambda folder: folder))
        self.listed = [EngineEntry(i, u) for i, u in enumerate(urls)]

        async def source():
            return list(self.listed)

        self.sampler = SglangSampler(source, records=records, max_loaded=capacity, refresh_s=refresh_s, engine_wait_s=1.0)
        self.folders = []
        for i in range(6):
            f = tmp_path / f"ckpt{i}"
            f.mkdir(exist_ok=True)
            self.folders.append(f)

    def session(self, i: int, tenant: str = "alice"):
        return self.sampler.sessions[self.sampler.create_session(tenant, self.folders[i])]

    def sample(self, s, **kw):
        return asyncio.create_task(self.sampler.sample(s, [1, 2, 3], 2, {"max_tokens": 2}, **kw))

    def served_by(self, s) -> list[str]:
        return [u for u, f in self.fakes.items() if ("generate", s.lora_name) in f.log]


async def _until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_sessions_spread_over_the_engines_and_stick(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch, capacity=2)

    async def scenario():
        a, b = w.session(0), w.session(1)
        for f in ("http://e0", "http://e1"):
            w.fakes.setdefault(f, FakeEngine(f, 2))
        for fake in w.fakes.values():
            fake.gate.clear()
        ta = w.sample(a)
        await _until(lambda: any(f.sampling.get(a.lora_name) for f in w.fakes.values()))
        tb = w.sample(b)  # e0 has a's request in flight: the least loaded is e1
        await _until(lambda: any(f.sampling.get(b.lora_name) for f in w.fakes.values()))
        assert w.served_by(a) != w.served_by(b)
        for fake in w.fakes.values():
            fake.gate.set()
        assert all(r.proto is not None for r in await asyncio.gather(ta, tb))
        first = {id(s): w.served_by(s) for s in (a, b)}
        for _ in range(3):  # R1: each session stays on its engine (its adapter and its prefix cache are there)
            assert (await w.sample(a)).proto is not None and (await w.sample(b)).proto is not None
        assert {id(s): w.served_by(s) for s in (a, b)} == first
        counts = w.sampler.metrics()
        assert counts["sampler.requests.0"] == 4 and counts["sampler.requests.1"] == 4
        assert counts["sampler.adapter_loads.0"] == 1 and counts["sampler.adapter_loads.1"] == 1

    asyncio.run(scenario())


def test_a_session_stays_on_its_engine_even_when_another_is_as_idle(tmp_path, monkeypatch):
    """The base model is on every engine (R1 over all of them): a session first served by e1 (e0 was
    busy) stays on e1 once both are idle, where least-loaded alone would pick e0."""
    w = World(tmp_path, monkeypatch, capacity=2)

    async def scenario():
        await w.sampler.engines.refresh(force=True)
        other = w.session(0)
        base = w.sampler.sessions[w.sampler.create_session("alice", None)]
        w.fakes["http://e0"].gate.clear()
        busy = w.sample(other)  # e0 busy
        await _until(lambda: w.fakes["http://e0"].sampling.get(other.lora_name))
        assert (await w.sample(base)).proto is not None
        w.fakes["http://e0"].gate.set()
        await busy
        for _ in range(3):  # both idle now
            assert (await w.sample(base)).proto is not None
        assert [f.log.count(("generate", None)) for f in (w.fakes["http://e0"], w.fakes["http://e1"])] == [0, 4 * 2]

    asyncio.run(scenario())


def test_no_request_waits_for_room_while_an_engine_has_room_then_waits_for_a_release(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch, capacity=1)

    async def scenario():
        s = [w.session(i) for i in range(3)]
        await w.sampler.engines.refresh(force=True)
        for fake in w.fakes.values():
            fake.gate.clear()
        busy = [w.sample(s[0]), w.sample(s[1])]  # one per engine: both engines' one place is in use
        await _until(lambda: sum(sum(f.sampling.values()) for f in w.fakes.values()) == 4)
        assert sorted(len(f.loaded) for f in w.fakes.values()) == [1, 1]
        waiting = w.sample(s[2])  # R3: no engine can load it now: it waits, it does not fail
        await asyncio.sleep(0.1)  # a negative check: given time to run, it has not run
        assert not waiting.done() and not any(s[2].lora_name in f.loaded for f in w.fakes.values())
        w.fakes["http://e1"].gate.set()  # e1's request ends: its idle adapter makes room there
        assert (await waiting).proto is not None
        assert w.served_by(s[2]) == ["http://e1"] and ("unload", s[1].lora_name) in w.fakes["http://e1"].log
        assert w.sampler.metrics()["sampler_waits.room_waits"] == 1  # counted: it waited, when no engine had room
        assert w.sampler.metrics()["sampler_waits.waits_with_room"] == 0
        w.fakes["http://e0"].gate.set()
        assert all(r.proto is not None for r in await asyncio.gather(*busy))

    asyncio.run(scenario())


def test_a_new_adapter_goes_where_there_is_room_not_merely_to_the_least_loaded(tmp_path, monkeypatch):
    """e0 is the least loaded but its one place holds an adapter in use; e1 is busier but has room:
    the new session's adapter is loaded on e1 at once (it does not wait for e0)."""
    w = World(tmp_path, monkeypatch, capacity=1)

    async def scenario():
        await w.sampler.engines.refresh(force=True)
        a, c = w.session(0), w.session(1)
        base = w.sampler.sessions[w.sampler.create_session("alice", None)]
        for fake in w.fakes.values():
            fake.gate.clear()
        tasks = [w.sample(a)]  # e0: a's adapter, in use
        await _until(lambda: w.fakes["http://e0"].sampling.get(a.lora_name))
        tasks += [w.sample(base), w.sample(base)]  # e1 (least loaded, then sticky): two requests, no adapter
        await _until(lambda: w.fakes["http://e1"].sampling.get(None) == 4)
        tasks.append(w.sample(c))
        await _until(lambda: ("load", c.lora_name) in w.fakes["http://e1"].log or w.sampler.engines.waits["room_waits"])
        assert w.sampler.engines.waits["waits_with_room"] == 0, "c waited while e1 had room"
        assert ("load", c.lora_name) in w.fakes["http://e1"].log
        for fake in w.fakes.values():
            fake.gate.set()
        assert all(r.proto is not None for r in await asyncio.gather(*tasks))

    asyncio.run(scenario())


def test_an_engine_lost_mid_request_gives_a_retry_on_another(tmp_path, monkeypatch):
    w = World(tmp_path, monkeypatch, capacity=2)

    async def scenario():
        a = w.session(0)
        await w.sampler.engines.refresh(force=True)
        w.fakes["http://e0"].gate.clear()
        task = w.sample(a)  # both idle: the lower index, e0
        await _until(lambda: w.fakes["http://e0"].sampling.get(a.lora_name))
        w.fakes["http://e0"].dead = True  # the engine dies with the request in flight
        w.fakes["http://e0"].gate.set()
        out = await asyncio.wait_for(task, 5)
        assert out.proto is not None and w.served_by(a) == ["http://e0", "http://e1"]
        # the next request does not try the dead engine again
        assert (await w.sample(w.session(1))).proto is not None
        assert w.served_by(w.sampler.sessions[list(w.sampler.sessions)[1]]) == ["http://e1"]
        w.fakes["http://e1"].dead = True  # every engine dead: a clear error, at once
        out = await asyncio.wait_for(w.sample(w.session(2)), 5)
        assert out.json["category"] == "server" and "every sampling engine failed" in out.json["error"], out.json
        assert "engine 1" in out.json["error"]

    asyncio.run(scenario())


def test_the_sampler_follows_the_fleet_list(tmp_path, monkeypatch):
    """An engine replaced after a node loss (a new URL at its index) is used at once; the old one is
    forgotten; an engine added is used; with no engine at all a request fails after engine_wait_s."""
    from api.tinker.sampling.engines import EngineEntry

    w = World(tmp_path, monkeypatch, capacity=2, urls=("http://e0",), refresh_s=0.0)  # every request reads the list

    async def scenario():
        a = w.session(0)
        assert (await w.sample(a)).proto is not None and w.served_by(a) == ["http://e0"]
        w.listed = [EngineEntry(0, "http://e0-new", starts=2)]  # replaced on another node
        assert (await w.sample(a)).proto is not None
        assert w.served_by(a) == ["http://e0", "http://e0-new"]  # reloaded there on demand
        assert ("load", a.lora_name) in w.fakes["http://e0-new"].log
        w.listed = [EngineEntry(0, "http://e0-new", starts=2), EngineEntry(1, "http://e1")]
        w.fakes["http://e0-new"].gate.clear()
        busy = w.sample(a)
        await _until(lambda: w.fakes["http://e0-new"].sampling.get(a.lora_name))
        b = w.session(1)
        assert (await w.sample(b)).proto is not None and w.served_by(b) == ["http://e1"]  # the added engine
        w.fakes["http://e0-new"].gate.set()
        await busy
        w.listed = []
        out = await asyncio.wait_for(w.sample(b), 5)
        assert "no sampling engine is up" in out.json["error"]

    asyncio.run(scenario())


def test_sessions_and_stability_records_outlive_the_sampler(tmp_path, monkeypatch):
    """A session made by one sampler is found by the next over the same registry file (a restart), for
    its tenant only; its adapter is loaded again on demand; a sample with record_as is recorded under
    the acknowledgement's ids with the engine's tokens and log-probs."""
    from service.registry.registry import Registry

    registry = Registry(tmp_path / "registry.sqlite", 2)
    try:
        w = World(tmp_path, monkeypatch, capacity=2, urls=("http://e0",), records=registry)

        async def first():
            a = w.session(0)
            out = await w.sample(a, record_as="req1")
            await w.sampler.aclose()
            return a, out

        a, out = asyncio.run(first())
        assert out.proto is not None
        recs = registry.sampled_sequences("alice", ["req1-0", "req1-1", "req1-2"])
        assert sorted(recs) == ["req1-0", "req1-1"] and recs["req1-0"].tokens == (7, 8)
        assert recs["req1-0"].logprobs == (-0.5, -0.25) and recs["req1-0"].prompt == (1, 2, 3)
        assert recs["req1-0"].session_id == a.session_id and registry.sampled_sequences("bob", ["req1-0"]) == {}

        w2 = World(tmp_path, monkeypatch, capacity=2, urls=("http://e0",), records=registry)  # the restarted service
        w2.fakes["http://e0"] = FakeEngine("http://e0", 2)
        w2.fakes["http://e0"].loaded.add(a.lora_name)  # the engine outlived the service: its adapter is still there

        async def second():
            assert w2.sampler.session("bob", a.session_id) is None
            again = w2.sampler.session("alice", a.session_id)
            assert again is not None and again.lora_name == a.lora_name and str(again.folder) == str(a.folder)
            out = await w2.sample(again)
            await w2.sampler.aclose()
            return out

        assert asyncio.run(second()).proto is not None
        log = w2.fakes["http://e0"].log
        assert log[:2] == [("unload", a.lora_name), ("load", a.lora_name)], log  # unknown to the new sampler: reloaded clean
    finally:
        registry.close()


def test_expired_records_are_swept_now_and_then(tmp_path, monkeypatch):
    """The sampler deletes expired sessions and records (sampling_records.py S2) at most every
    SWEEP_EVERY_S: a request past that interval sweeps (one indexed DELETE)."""
    import time

    from api.tinker.sampling import sampler as sampling
    from service.registry.registry import Registry

    registry = Registry(tmp_path / "registry.sqlite", 2)
    try:
        registry.record_samples("old", "alice", "samp-x", "base", [1], [([2], [-0.5])], now=time.time() - 2 * 86400)
        w = World(tmp_path, monkeypatch, capacity=2, urls=("http://e0",), records=registry)

        def left() -> int:
            return registry._db.execute("SELECT COUNT(*) FROM tinker_sampled_sequences").fetchone()[0]

        async def scenario():
            a = w.session(0)
            assert (await w.sample(a)).proto is not None
            assert left() == 1  # within the interval: no sweep, the expired record is still there
            w.sampler._swept -= 2 * sampling.SWEEP_EVERY_S
            assert (await w.sample(a)).proto is not None

        asyncio.run(scenario())
        assert registry._db.execute("SELECT COUNT(*) FROM tinker_sampled_sequences").fetchone()[0] == 0
        assert registry._db.execute("SELECT COUNT(*) FROM tinker_sample_requests").fetchone()[0] == 0
    finally:
        registry.close()

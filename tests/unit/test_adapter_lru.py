"""The engines' adapter residency: the one rule of recency (service/scheduling/residency.py AdapterLru) and the
Tinker sampler that uses it (api/tinker/sampling/sampler.py SglangSampler).

The rule is pure and tested against a reference written from its definition (a list ordered by
last use). The sampler is driven with a FAKE engine client (`CountingEngine`: load, unload and
generate answer at once, or when the test releases them), the one way to hold requests in flight
on chosen adapters at once; what it checks is the sampler's bookkeeping: the engine never holds
more than its capacity, an adapter is never unloaded while a request samples from it, a request
that finds every loaded adapter busy waits for room and then succeeds (it never fails for room),
and tenants' sessions share one cache.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from service.scheduling.residency import AdapterLru

pytestmark = pytest.mark.unit


def test_the_rule_is_least_recently_used_among_the_idle():
    """Random uses against a reference list ordered by last use: `room_for` always names the least
    recently used idle names, as many as needed, or None when too few are idle."""
    rng = random.Random(7)
    lru, ref = AdapterLru(4), []  # ref: least recently used first
    for _ in range(2000):
        name = f"a{rng.randrange(9)}"
        busy = {n for n in ref if rng.random() < 0.3}
        victims = lru.room_for(name, busy)
        if name in ref or len(ref) < 4:
            assert victims == []
        else:
            idle = [n for n in ref if n not in busy]
            assert victims == (idle[:1] if idle else None)
        if victims is None:
            continue
        for v in victims:
            lru.forget(v)
            ref.remove(v)
        if name in ref:
            lru.touch(name)
            ref.remove(name)
        else:
            lru.loaded(name)
        ref.append(name)
        assert lru.names() == ref and len(lru) <= 4


def test_a_cache_of_no_room_is_refused():
    with pytest.raises(ValueError, match="at least 1 adapter"):
        AdapterLru(0)


class CountingEngine:
    """FAKE engine client (see module doc)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.loaded: set[str] = set()
        self.sampling: dict[str, int] = {}
        self.log: list[tuple[str, str]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def load_adapter(self, name, weights, transfer="disk"):
        assert len(self.loaded) < self.capacity, f"load of {name} past the engine's capacity: {sorted(self.loaded)}"
        self.loaded.add(name)
        self.log.append(("load", name))

    async def unload_adapter(self, name):
        assert not self.sampling.get(name), f"{name} unloaded while {self.sampling[name]} request(s) sample from it"
        self.loaded.discard(name)
        self.log.append(("unload", name))

    async def generate_many(self, rids, input_ids, sampling_params, lora_name, logprob_start_len, top_logprobs_num):
        """A sample's group, one request (as EngineClient sends it); `sampling` counts its generations."""
        assert lora_name in self.loaded, f"{lora_name} sampled while not loaded"
        self.sampling[lora_name] = self.sampling.get(lora_name, 0) + len(rids)
        try:
            await self.gate.wait()
        finally:
            self.sampling[lora_name] -= len(rids)
        return [type("R", (), {"finish_reason": "length", "token_ids": [1, 2], "logprobs": [-0.1, -0.2], "top_logprobs": None,
                               "prompt_logprobs": None, "prompt_top_logprobs": None})() for _ in rids]

    async def server_info(self):
        return {}

    async def loaded_adapters(self):
        return sorted(self.loaded)

    async def aclose(self):
        pass


def _sampler(tmp_path: Path, capacity: int, monkeypatch):
    pytest.importorskip("tinker")
    from api.tinker.sampling import engines as sampler_engines
    from api.tinker.sampling.sampler import SglangSampler

    engine = CountingEngine(capacity)
    monkeypatch.setattr(sampler_engines, "EngineClient", lambda url, **kw: engine)  # the FAKE in place of the HTTP client
    sampler = SglangSampler("http://127.0.0.1:9", max_loaded=capacity)
    folders = []
    for i in range(6):
        f = tmp_path / f"ckpt{i}"
        f.mkdir()
        (f / "adapter_config.json").write_text("{}")
        (f / "adapter_model.safetensors").write_bytes(b"")
        folders.append(f)
    return sampler, engine, folders


def test_sessions_of_every_tenant_share_one_cache_and_busy_adapters_stay(tmp_path, monkeypatch):
    from rollout.engines.weights import AdapterWeights

    monkeypatch.setattr(AdapterWeights, "from_folder", staticmethod(lambda folder: folder))
    sampler, engine, folders = _sampler(tmp_path, capacity=2, monkeypatch=monkeypatch)

    async def scenario():
        sids = [sampler.create_session("alice" if i % 2 else "bob", folders[i]) for i in range(4)]
        sessions = [sampler.sessions[s] for s in sids]
        for s in sessions:  # one after another: each load past 2 unloads the least recently used
            out = await sampler.sample(s, [1, 2, 3], 1, {"max_tokens": 2})
            assert out.proto is not None
        assert engine.log[-2:] == [("unload", sessions[1].lora_name), ("load", sessions[3].lora_name)]
        # two requests hold sessions 2 and 3 in flight; a third for session 0 must wait, not fail
        engine.gate.clear()
        busy = [asyncio.create_task(sampler.sample(s, [1], 1, {"max_tokens": 2})) for s in sessions[2:]]
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(sampler.sample(sessions[0], [1], 1, {"max_tokens": 2}))
        await asyncio.sleep(0.05)
        assert not waiting.done() and sessions[0].lora_name not in engine.loaded  # it waits for room
        engine.gate.set()
        results = await asyncio.gather(*busy, waiting)
        assert all(r.proto is not None for r in results)
        assert sessions[0].lora_name in engine.loaded and len(engine.loaded) == 2

    asyncio.run(scenario())

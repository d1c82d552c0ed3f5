"""Engine pool bookkeeping that needs no server: least-in-flight routing, health, version rules."""

import asyncio

import pytest

from rollout.engines.client import EngineClient
from rollout.engines.pool import EnginePool, NoHealthyEngine, UnknownAdapter

pytestmark = pytest.mark.unit


def make_pool(n):
    # Clients to a closed port: these tests never send a request.
    return EnginePool([EngineClient(f"http://127.0.0.1:9/{i}") for i in range(n)])


def test_least_inflight_routing_skips_unhealthy_engines():
    pool = make_pool(3)
    e = pool._engines
    assert pool._pick_engine().index == 0  # ties go to the lowest index
    e[0].inflight.update({"a::1": "a@v0", "a::2": "a@v0"})
    e[1].inflight.update({"a::3": "a@v0"})
    assert pool._pick_engine().index == 2
    e[2].inflight.update({"b::1": "b@v0", "b::2": "b@v0"})
    assert pool._pick_engine().index == 1
    pool.mark_unhealthy(1)
    assert pool._pick_engine().index == 0
    assert pool.inflight() == 5 and pool.inflight("a") == 3 and pool.inflight_by_engine() == [2, 1, 2]
    pool.mark_unhealthy(0)
    pool.mark_unhealthy(2)
    with pytest.raises(NoHealthyEngine, match="no healthy engine"):
        pool._pick_engine()


def test_unknown_adapter_and_version_order():
    pool = make_pool(1)
    with pytest.raises(UnknownAdapter, match="'x' is not published"):
        pool.current_version("x")
    with pytest.raises(UnknownAdapter):
        asyncio.run(pool.generate_group("x", [1], {}, 1))
    with pytest.raises(ValueError, match="'tensors' or 'disk'"):
        EnginePool([], weight_transfer="nfs")


def test_readmit_keeps_an_unreachable_engine_out():
    """readmit probes /health first: an engine that does not answer stays out of routing."""
    pool = make_pool(2)
    pool.mark_unhealthy(1)

    async def probe():
        try:
            return await pool.readmit(1, health_timeout_s=1.0), await pool.readmit(0)
        finally:
            await pool.aclose()

    assert asyncio.run(probe()) == (False, True)  # engine 0 was never out: nothing to do
    assert not pool.healthy(1) and pool.healthy(0)


def test_a_spill_folder_the_pool_made_is_removed_at_close_and_a_given_one_kept(tmp_path):
    from pathlib import Path

    made, given = make_pool(1), EnginePool([EngineClient("http://127.0.0.1:9/0")], spill_dir=str(tmp_path))
    assert Path(made.spill_dir).is_dir()

    async def close_both():
        await made.aclose()
        await given.aclose()

    asyncio.run(close_both())
    assert not Path(made.spill_dir).exists()  # it used to stay in /tmp, one per pool
    assert tmp_path.is_dir()  # the caller's folder is the caller's


def test_a_pool_that_only_sends_tensors_makes_no_spill_folder(tmp_path, monkeypatch):
    """The folder is made at the first 'disk' transfer: a killed process (a drill, a benchmark) used
    to leave an empty /tmp/lorafleet-spill-* behind for every pool it made."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pool = make_pool(2)  # never closed: as when its process is killed
    assert pool.weight_transfer == "tensors"
    assert list(tmp_path.iterdir()) == []
    assert EnginePool([EngineClient("http://127.0.0.1:9/0")], weight_transfer="disk").spill_dir.startswith(str(tmp_path))

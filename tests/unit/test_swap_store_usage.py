"""The swap store's running totals (trainer/swap/swap_store.py `_held`, issue 26: a placement asked for
them at every put, and summing every evicted snapshot cost ~3 ms a call with 1,000 tenants out):
after every operation, host_bytes(), disk_bytes() and usage() equal the sums over the table,
recomputed here from the definitions (a host snapshot's rows; a spilled one's file; a prefetch's
rows in host memory). Operations are drawn at random over a store with a real spill folder and
budgets small enough that puts go to both tiers and some are refused; prefetches that succeed and
one that fails on a damaged file are included."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.swap.swap_store import SlotSnapshot, SwapError, SwapStore

pytestmark = pytest.mark.unit


def _snapshot(numel: int) -> SlotSnapshot:
    rows = {kind: torch.full((numel,), float(numel)) for kind in ("weight", "grad", "exp_avg", "exp_avg_sq")}
    return SlotSnapshot(meta={"step": numel}, pending=torch.zeros(3, dtype=torch.float64), rows=rows)


def _recomputed(store: SwapStore) -> dict:
    """The tiers' counts and bytes from the table itself (what usage() summed before it kept totals)."""
    snaps = list(store._snapshots.values())
    host = [s for s in snaps if s.spill_path is None]
    disk = [s for s in snaps if s.spill_path is not None]
    fetched = [s for s in disk if s.prefetch is not None]
    row_bytes = lambda s: sum(t.numel() * t.element_size() for t in s.rows.values()) if s.rows is not None else s.row_bytes  # noqa: E731
    return {"host": (len(host), sum(row_bytes(s) for s in host)),
            "disk": (len(disk), sum(s.file_bytes for s in disk)),
            "prefetched": (len(fetched), sum(row_bytes(s) for s in fetched))}


def _check(store: SwapStore) -> None:
    want = _recomputed(store)
    got = store.usage()
    assert {t: (got[t]["count"], got[t]["bytes"]) for t in want} == want
    assert store.host_bytes() == want["host"][1] + want["prefetched"][1]
    assert store.disk_bytes() == want["disk"][1]


def test_running_totals_equal_the_sums_over_the_table(tmp_path):
    rng = random.Random(7)
    one = _snapshot(100).nbytes
    store = SwapStore(host_budget_bytes=3 * one + one // 2, spill_dir=tmp_path / "spill", disk_budget_bytes=40 * one)
    keys = [f"run-{i}" for i in range(12)]
    seen = {"host": 0, "disk": 0, "refused": 0, "prefetched": 0}
    for _ in range(300):
        key = rng.choice(keys)
        op = rng.choice(["put", "put", "prefetch", "load", "drop"])
        if op == "put" and key not in store:
            try:
                seen[store.put(key, _snapshot(rng.choice([50, 100, 150])))] += 1
            except SwapError:
                seen["refused"] += 1
        elif op == "prefetch":
            if store.prefetch(key) == "started":
                seen["prefetched"] += 1
                _check(store)  # under way: its rows already count in host memory
                store._snapshots[key].prefetch.result()
        elif op == "load" and key in store:
            snap, _ = store.load(key)
            assert snap.meta["step"] * 4 * 4 == snap.nbytes  # the rows that went in come back
        elif op == "drop":
            store.drop(key)
        _check(store)
    assert all(seen[k] > 0 for k in ("host", "disk", "prefetched")), seen  # every tier was exercised
    for key in keys:
        store.drop(key)
    _check(store)
    assert store.usage()["host"]["count"] == store.usage()["disk"]["count"] == store.host_bytes() == 0


def test_a_failed_prefetch_gives_its_host_memory_back(tmp_path):
    one = _snapshot(100).nbytes
    store = SwapStore(host_budget_bytes=one, spill_dir=tmp_path / "spill", disk_budget_bytes=10 * one)
    assert store.put("a", _snapshot(100)) == "host"
    assert store.put("b", _snapshot(100)) == "disk"
    store.drop("a")
    path = store.spill_path("b")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of the rows: the checksum no longer matches
    path.write_bytes(bytes(data))
    assert store.prefetch("b") == "started"
    _check(store)
    with pytest.raises(SwapError, match="reading spilled snapshot"):
        store.load("b")
    _check(store)
    assert store.usage()["prefetched"]["count"] == 0 and store.host_bytes() == 0
    assert store.usage()["disk"]["count"] == 1  # still stored (T2)

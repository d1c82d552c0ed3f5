"""Shared helpers of the rollout worker tests against a real SGLang server (test_rollout_sglang.py,
test_rollout_multiturn.py): adapter specs on the tiny world's data, an async deadline wait, a
started worker on the module's server, and a recorder of the requests an engine client sends."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time

from rollout.engines.client import EngineClient
from rollout.config import DataConfig, RewardConfig, RolloutSpec, SamplingConfig
from rollout.messages import AdapterRollout
from rollout.worker_actor import RolloutWorkerImpl


def rollout_spec(tiny_world, name, task, registration_id, *, rollout: RolloutSpec | None = None, **sampling):
    """An adapter on the tiny world's `task` data (digits, vowels) scored by target_share; `rollout`: its
    custom rollout (None: the built-in single_turn)."""
    return AdapterRollout(
        name=name,
        registration_id=registration_id,
        data=DataConfig(path=str(tiny_world / "data" / f"{task}.jsonl"), shuffle_seed=0),
        reward=RewardConfig(name="target_share"),
        sampling=SamplingConfig(**{"temperature": 1.0, "max_new_tokens": 12, "n_samples_per_prompt": 4, **sampling}),
        rollout=rollout,
    )


async def _truth(value) -> bool:
    return bool(await value) if inspect.isawaitable(value) else bool(value)


def count_concurrent_requests(client: EngineClient) -> dict[str, int]:
    """Wrap ``client.generate`` to record the peak number of concurrent requests, in total and
    per adapter (the rid's ``<adapter>::`` prefix); returns the live peak dict."""
    inner, live, peak = client.generate, {}, {"total": 0}

    async def generate(*, rid: str, **kwargs):
        adapter = rid.split("::", 1)[0]
        for key in ("total", adapter):
            live[key] = live.get(key, 0) + 1
            peak[key] = max(peak.get(key, 0), live[key])
        try:
            return await inner(rid=rid, **kwargs)
        finally:
            for key in ("total", adapter):
                live[key] -= 1

    client.generate = generate
    return peak


async def wait_for(predicate, timeout_s, what):
    """Poll ``predicate`` (a function, or a coroutine function) until it is true; fail after
    ``timeout_s`` naming ``what``. Deadlines are generous: this is a shared 2-core machine."""
    deadline = time.monotonic() + timeout_s
    while not await _truth(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def started_worker(sglang_server, cfg, tiny_world, adapter_names, *, managed=False):
    """A started rollout worker on the module's server. ``managed``: the worker watches the
    engine process (it sees it die and can restart it); else it knows only the URL. On the
    way out it removes ``adapter_names`` (unknown names are a no-op) and shuts down; the
    server stays up."""
    where = {"engines": [sglang_server.engine]} if managed else {"engine_urls": [sglang_server.url]}
    worker = RolloutWorkerImpl(sglang_server.cfg, cfg, tiny_world / "model", **where)
    await worker.start()
    try:
        yield worker
    finally:
        for name in adapter_names:
            await worker.remove_adapter(name)
        await worker.shutdown()


def record_requests(client: EngineClient) -> list[dict]:
    """Wrap ``client.generate`` to record every request it sends, in order: {rid, input_ids, max_new_tokens,
    finish_reason} (None while in flight; the answer's, or "raised <error>"); returns the live list."""
    inner, log = client.generate, []

    async def generate(*, rid: str, input_ids, sampling_params, **kwargs):
        entry = {"rid": rid, "input_ids": list(input_ids), "max_new_tokens": sampling_params.get("max_new_tokens"),
                 "finish_reason": None}
        log.append(entry)
        try:
            result = await inner(rid=rid, input_ids=input_ids, sampling_params=sampling_params, **kwargs)
        except BaseException as e:
            entry["finish_reason"] = f"raised {type(e).__name__}"
            raise
        entry["finish_reason"] = result.finish_reason
        return result

    client.generate = generate
    return log


def record_aborts(client: EngineClient) -> list[str]:
    """Wrap ``client.abort`` to record the rid of every abort it sends; returns the live list."""
    inner, rids = client.abort, []

    async def abort(rid: str) -> None:
        rids.append(rid)
        await inner(rid)

    client.abort = abort
    return rids

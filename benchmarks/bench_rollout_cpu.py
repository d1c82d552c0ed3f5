"""Rollout on CPU: generation throughput with 1 and 4 concurrent adapters, live-update and abort latency.

Starts one real SGLang server (CPU engine, rollout.engines.sglang_cpu) with the tiny
model, loads PEFT adapters made for it, and drives it through
rollout.engines.pool.EnginePool, the same path the rollout worker uses:

* throughput: `--requests` concurrent requests of `--tokens` new tokens
  (sampling at temperature 1, EOS ignored so every request has the full
  length), all for one adapter, then spread over 4 adapters, then the base
  model; generated tokens / wall seconds, median of `--repeats`;
* update latency: `EnginePool.publish` of a new version (load under
  "<adapter>@v<k>" + routing switch) while requests run, by tensors and by folder;
* abort latency: `--requests` requests each of A and B in flight; time from
  `EnginePool.abort_adapter("A")` to every A request having returned.

    .venv/bin/python -m benchmarks.bench_rollout_cpu --out rollout_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report import emit
from rollout.config import EngineConfig
from rollout.engines.engine import EngineProcess
from rollout.engines.pool import EnginePool
from rollout.engines.weights import AdapterWeights
from tests.rollout_probes import wait_unloaded


def make_adapters(model_dir: Path, out: Path, count: int) -> list[Path]:
    from tests.integration.sglang_fixtures import make_peft_adapter

    return [make_peft_adapter(model_dir, out / f"a{i}", seed=i + 1) for i in range(count)]


async def throughput(pool: EnginePool, names: list[str | None], prompt: list[int], requests: int, tokens: int) -> float:
    params = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True}
    client = pool.client(0)
    jobs = []
    for i in range(requests):
        name = names[i % len(names)]
        if name is None:  # the base model, straight through the client
            jobs.append(client.generate(rid=f"base::{i:032x}", input_ids=prompt + [i % 50], sampling_params=params, lora_name=None))
        else:
            jobs.append(pool.generate_group(name, prompt + [i % 50], params, 1))
    t0 = time.perf_counter()
    outs = await asyncio.gather(*jobs)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) if hasattr(o, "token_ids") else sum(len(r.token_ids) for r in o.results) for o in outs)
    assert n == requests * tokens, (n, requests * tokens)
    return n / dt


async def run(args) -> dict:
    from examples.tiny.build import ensure_tiny_world
    from transformers import AutoTokenizer

    model_dir = ensure_tiny_world() / "model"
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    adapters = make_adapters(model_dir, work, 5)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = tok("<|user|>ab 12 ou kk 9\n<|assistant|>", add_special_tokens=False)["input_ids"]
    cfg = EngineConfig(max_lora_rank=8, max_loras_per_batch=5, max_loaded_loras=16, cpu_threads=args.cpu_threads)
    engine = EngineProcess(0, cfg, model_dir, log_dir=work / "logs")
    result: dict = {"requests": args.requests, "tokens": args.tokens, "repeats": args.repeats, "cpu_threads": args.cpu_threads,
                    "cpus": os.cpu_count(), "loadavg_1m_at_start": round(os.getloadavg()[0], 2)}
    try:
        t0 = time.perf_counter()
        engine.start()
        engine.wait_ready()
        result["server_start_s"] = round(time.perf_counter() - t0, 1)
        from rollout.engines.client import EngineClient

        pools = {t: EnginePool([EngineClient(engine.url)], weight_transfer=t) for t in ("tensors", "disk")}
        pool = pools["tensors"]
        names = [f"bench{i}" for i in range(4)]
        for i, n in enumerate(names):
            await pool.publish(n, 0, AdapterWeights.from_folder(adapters[i]))
        await throughput(pool, names, prompt, 4, 8)  # warm-up
        for label, use in (("1 adapter", names[:1]), ("4 adapters", names), ("base model", [None])):
            rates = [await throughput(pool, use, prompt, args.requests, args.tokens) for _ in range(args.repeats)]
            result[f"tokens_per_s {label}"] = round(statistics.median(rates), 1)
            result[f"tokens_per_s {label} (all)"] = [round(r, 1) for r in rates]

        # update latency under load
        params = {"temperature": 1.0, "max_new_tokens": args.tokens, "ignore_eos": True}
        for transfer, p in pools.items():
            name, version = f"upd-{transfer}", 0
            await p.publish(name, 0, AdapterWeights.from_folder(adapters[0]))
            for under_load in (False, True):
                lat = []
                for _ in range(args.update_repeats):
                    version += 1
                    load = []
                    if under_load:
                        load = [asyncio.create_task(p.generate_group(name, prompt, params, 1)) for _ in range(args.requests)]
                        while p.inflight(name) < args.requests:
                            await asyncio.sleep(0.005)
                        await asyncio.sleep(0.1)
                    w = AdapterWeights.from_folder(adapters[version % 5])
                    if transfer == "tensors":
                        w.load_tensors()  # the trainer hands over tensors: reading the file is not part of the update
                    t0 = time.perf_counter()
                    await p.publish(name, version, w)
                    lat.append(time.perf_counter() - t0)
                    await asyncio.gather(*load)
                    await wait_unloaded(p)
                key = f"update_ms by {transfer}, {'under load' if under_load else 'idle'}"
                result[key] = round(1000 * statistics.median(lat), 1)
                result[key + " (all)"] = [round(1000 * x, 1) for x in lat]
            await p.remove_adapter(name)

        # abort latency
        lat = []
        long = {"temperature": 1.0, "max_new_tokens": 256, "ignore_eos": True}
        for _ in range(args.repeats):
            a = [asyncio.create_task(pool.generate_group(names[0], prompt, long, 1)) for _ in range(args.requests)]
            b = [asyncio.create_task(pool.generate_group(names[1], prompt, long, 1)) for _ in range(args.requests)]
            while pool.inflight(names[0]) < args.requests or pool.inflight(names[1]) < args.requests:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            count = await pool.abort_adapter(names[0])
            groups = await asyncio.gather(*a)
            lat.append(time.perf_counter() - t0)
            assert count == args.requests and all(g.aborted for g in groups)
            await pool.abort_adapter(names[1])
            await asyncio.gather(*b)
        result["abort_ms"] = round(1000 * statistics.median(lat), 1)
        result["abort_ms (all)"] = [round(1000 * x, 1) for x in lat]
        for p in pools.values():
            await p.aclose()
    finally:
        engine.stop()
    result["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests per measurement")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the throughput and abort measurements")
    ap.add_argument("--update-repeats", type=int, default=7, help="updates measured per transfer mode and load")
    ap.add_argument("--cpu-threads", type=int, default=1, help="EngineConfig.cpu_threads")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    emit(result, args.out)


if __name__ == "__main__":
    main()

"""A Tinker call's latency on the fleet's loop, idle and busy (issue 24: "a call never waits on an
idle loop"; docs/tinker.md "Latency").

The fleet as `lorafleet serve` starts it, in this process (service/fleet/startup.py: Ray, one trainer
rank, one SGLang engine, the controller, the runtime and its scheduler), the training loop on a
thread (service mode), and one Tinker model made as the Tinker face makes it
(service/tenants/tinker_models.py). Measured: the time from queuing a forward_backward (D datums of L
tokens) to its result, N times, with the loop

  * idle: no dataset run registered (the loop waits for work; the call wakes it);
  * busy: an SFT run training all the while (every round is a dataset step; the call rides in one).

  .venv/bin/python -m benchmarks.bench_tinker_latency                # tiny world, CPU
  .venv/bin/python -m benchmarks.bench_tinker_latency --calls 20 --window-ms 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _datums(n: int, length: int, seed: int):  # noqa: ANN202
    import torch

    from trainer.rounds import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        full = torch.randint(0, 400, (length + 1,), generator=g)
        out.append(Datum(tokens=full[:-1].tolist(), inputs={"target_tokens": full[1:], "weights": torch.ones(length)}))
    return out


def _call(model, data) -> float:  # noqa: ANN001
    finished = threading.Event()
    errors: list = []
    t0 = time.monotonic()
    model.forward_backward(data, "cross_entropy", None,
                           lambda value, error: (errors.append(error or getattr(value, "error", None)), finished.set()))
    if not finished.wait(600):
        raise TimeoutError("a forward_backward was not answered in 600 s")
    if errors[0]:
        raise RuntimeError(errors[0])
    return time.monotonic() - t0


def _measure(model, calls: int, datums: int, length: int) -> dict:  # noqa: ANN001
    _call(model, _datums(datums, length, 0))  # warm-up
    times = [_call(model, _datums(datums, length, 1 + i)) for i in range(calls)]
    ms = sorted(1000 * t for t in times)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "max_ms": ms[-1], "calls": calls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--datums", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--window-ms", type=float, default=None, help="the service's tinker_window_ms (default: the service's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from examples.tiny.build import ensure_tiny_world
    from service.fleet.startup import start_fleet
    from service.cli import TINY_JOB
    from service.config.job import load_job
    from service.config.settings import load_settings
    from service.loop.training_loop import LoopOptions, run_training_loop
    from service.shutdown import StopSignal
    from service.tenants.tinker_lora import LoraSpec
    from service.tenants.tinker_models import TinkerModels

    world = ensure_tiny_world()
    with tempfile.TemporaryDirectory(prefix="tinker-latency-") as d:  # the fleet's state: removed at the end
        tmp = Path(d)
        job = load_job(TINY_JOB)
        job = job.model_copy(update={"adapters": [], "base_model": job.base_model.model_copy(update={"path": str(world / "model")})})
        window = {} if args.window_ms is None else {"tinker_window_ms": args.window_ms}
        settings = load_settings(state_dir=tmp / "state", data_roots=[world / "data", tmp], **window)
        rows = {}
        with start_fleet(job, settings) as fleet:
            stop = StopSignal()
            loop = threading.Thread(target=run_training_loop, args=(fleet.controller, fleet.runtime,
                                                                     LoopOptions(batch_mode=False), stop), daemon=True)
            loop.start()
            try:
                models = TinkerModels(fleet.runtime.scheduler, fleet.runtime.tinker_records, fleet.runtime.store, base_model="model",
                                      tokenizer_id=str(world / "model"), max_rank=8)
                admitted: list = []
                model = models.create("bench", "bench", LoraSpec(rank=4, seed=1), "bench-session", lambda value, error: admitted.append(error))
                while not admitted:
                    time.sleep(0.05)  # admission on the loop's next placement
                if admitted[0] is not None:
                    raise RuntimeError(admitted[0])
                rows["idle loop"] = _measure(model, args.calls, args.datums, args.seq_len)
                fleet.controller.register("busy", {"objective": "sft", "rank": 4, "alpha": 8, "learning_rate": 1e-3,
                                                   "data": {"path": str(world / "data" / "kinds_sft.jsonl")},
                                                   "prompts_per_step": 6, "num_step": 100000, "checkpoint_interval": 0})
                while fleet.controller.get("busy").step < 2:
                    time.sleep(0.1)  # the run trains: every round is a dataset step from here on
                rows["busy loop (an SFT run training)"] = _measure(model, args.calls, args.datums, args.seq_len)
                rows["busy loop (an SFT run training)"]["sft_step_s"] = fleet.runtime.health.last_train_s
            finally:
                stop.request("benchmark over")
                loop.join(120)
    print(f"forward_backward of {args.datums} x {args.seq_len} tokens, Tinker window {settings.tinker_window_ms:g} ms, {args.calls} calls:")
    for name, r in rows.items():
        print(f"  {name:34s} median {r['median_ms']:7.1f} ms   p90 {r['p90_ms']:7.1f} ms   max {r['max_ms']:7.1f} ms")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

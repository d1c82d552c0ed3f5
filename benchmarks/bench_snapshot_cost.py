"""What a Tinker model's durability snapshot at eviction costs the trainer (issue 41): its CPU, and what its
background writer costs the train calls running beside it.

At K = 1,024 tenants through 8 slots every eviction takes a snapshot (each model's turns come minutes
apart, past `interval:300`): ModelJournal.snapshot -> TrainerGroup.begin_save_slot_state (the state
taken in call order, written on rank 0's slot-state writer thread), then the swap-out. Two measures,
the tiny world, rank 8:

  evict      the real TrainerGroup (one Ray actor rank, as the service runs it): N evictions (swap_out,
             swap_in) without and with a background snapshot each; the trainer process's CPU (user +
             system, every thread) and the coordinator's (this process) per eviction.
  beside     an in-process trainer: train calls of 8 slots x 2 samples alone, then with a thread
             writing slot states (write_slot_state, as the writer does) every P seconds: each call's
             wall and its own thread's CPU (the writer's Python holds the interpreter lock while the
             call's torch operations let it go and take it back).

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_snapshot_cost --evictions 40 --calls 40 --out snapshot_cost.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.proc_stats import cpu_s
from benchmarks.report import emit
from examples.tiny.build import ensure_tiny_world

RANK = 8


def evictions(world: Path, n: int, scratch: Path) -> dict:
    import os

    import ray

    from service.fleet.trainer_group import TrainerGroup
    from tests.local_ray import start_ray, stop_ray
    from trainer.config import SlotHyperParams, TrainerConfig

    start_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = TrainerGroup(TrainerConfig(base_model_path=str(world / "model"), num_slots=8, max_rank=RANK, micro_batch_tokens=64),
                         setup_timeout_s=300, call_timeout_s=60)
    try:
        group.start()
        group.init_slot(0, SlotHyperParams(rank=RANK, alpha=2 * RANK, lr=1e-2, samples_per_step=2), seed=0)
        rank0 = ray.get(group.workers[0].__ray_call__.remote(lambda _: os.getpid()))
        out: dict = {}
        for turn, snapshot in enumerate((False, True, False, True)):  # alternated: the machine's drift falls on both
            c0, d0, w0 = cpu_s(rank0), time.process_time(), time.perf_counter()
            for i in range(n):
                pending = group.begin_save_slot_state(0, scratch / f"s{turn}-{i}") if snapshot else None
                group.swap_out(0, "bench")
                group.swap_in(0, "bench")
                if pending is not None:
                    pending.result()
            row = {"trainer_cpu_ms": 1e3 * (cpu_s(rank0) - c0) / n, "coordinator_cpu_ms": 1e3 * (time.process_time() - d0) / n,
                   "wall_ms": 1e3 * (time.perf_counter() - w0) / n}
            out.setdefault("with_snapshot" if snapshot else "swap_only", []).append({k: round(v, 2) for k, v in row.items()})
        return out
    finally:
        group.stop()
        stop_ray()


def beside(world: Path, n: int, scratch: Path, periods: list[float]) -> dict:
    import torch

    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.swap.slot_checkpoint import slot_state_snapshot, write_slot_state

    torch.set_num_threads(1)
    config = TrainerConfig(base_model_path=str(world / "model"), num_slots=8, max_rank=RANK, micro_batch_tokens=512)
    trainer = MultiLoraTrainer(config)
    for slot in range(8):
        trainer.init_slot(slot, SlotHyperParams(rank=RANK, alpha=2 * RANK, lr=1e-3, samples_per_step=10**6), seed=slot)
    gen = torch.Generator().manual_seed(0)

    def calls() -> dict:
        wall, cpu = [], []
        for _ in range(n):
            batch = TrainBatch(samples=[TrainSample(slot=s, tokens=torch.randint(0, 400, (40,), generator=gen).tolist(),
                                                    loss_mask=[0] * 8 + [1] * 32) for s in range(8) for _ in range(2)])
            w0, c0 = time.perf_counter(), time.thread_time()
            trainer.train(batch)
            wall.append(1e3 * (time.perf_counter() - w0))
            cpu.append(1e3 * (time.thread_time() - c0))
        return {"wall_ms_p50": round(statistics.median(wall), 2), "cpu_ms_p50": round(statistics.median(cpu), 2)}

    state = slot_state_snapshot(trainer, 1, copy=True)
    calls()  # warm-up
    rows = [{"writer_period_s": None, **calls()}]
    for period in periods:
        stop, written = threading.Event(), [0]

        def write(period: float = period) -> None:
            while not stop.is_set():
                folder = scratch / f"w{written[0]}"
                write_slot_state(config, folder, *state)
                shutil.rmtree(folder)
                written[0] += 1
                time.sleep(period)

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            row = calls()
        finally:
            stop.set()
            writer.join()
        rows.append({"writer_period_s": period, "writes": written[0], **row})
    rows.append({"writer_period_s": None, **calls()})
    return {"calls": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--evictions", type=int, default=40)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--periods", default="0.1,0.02", help="the writer's pause between writes, seconds (comma-separated)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    world = ensure_tiny_world()
    scratch = Path(tempfile.mkdtemp(prefix="snapshot-cost-"))
    try:
        result = {"evict": evictions(world, args.evictions, scratch),
                  "beside": beside(world, args.calls, scratch, [float(x) for x in args.periods.split(",")])}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

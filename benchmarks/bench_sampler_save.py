"""What a Tinker sampler save costs the trainer, durable against ephemeral (trainer/storage/store.py S5).

Every step of the cookbook's RL loop calls `save_weights_and_get_sampling_client`, which the SDK
calls ephemeral: lorafleet commits its folder without waiting for the disk; a named
`save_weights_for_sampler` syncs each file, the manifest and the folder. This times the trainer's
`export_peft` of one slot of the tiny world (the real trainer in this process, its own local store
in a temporary folder on the disk given) both ways, alternating, each save into a fresh key.

On an idle disk a sync costs little; at fleet scale others write beside the saves (the models'
snapshots, the registry's commits), and a sync of ext4 waits for the journal's commit of their
data too. `--beside-mib M` runs a writer thread beside the saves that writes and syncs an M MiB
file again and again (a snapshot writer's pattern).

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_sampler_save --saves 40 --out sampler_save.json
  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_sampler_save --saves 40 --beside-mib 2 --out sampler_save_beside.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from examples.tiny.build import ensure_tiny_world


def _summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"p50_ms": round(statistics.median(ms), 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2),
            "mean_ms": round(statistics.fmean(ms), 2), "n": len(ms)}


def _write_beside(folder: Path, mib: int, stop: threading.Event, written: list[int]) -> None:
    """Write and sync an `mib` MiB file over and over until `stop` (each time a new file: new blocks)."""
    data = os.urandom(mib << 20)
    while not stop.is_set():
        path = folder / f"beside-{len(written) % 4}"
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        written.append(1)


def main(argv: list[str] | None = None) -> int:
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=40, help="saves of each kind")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--store-dir", default=None, help="the disk to write on (default: the system's temporary folder)")
    ap.add_argument("--beside-mib", type=int, default=0, help="a writer thread beside the saves: MiB per synced file (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    world = ensure_tiny_world()
    with tempfile.TemporaryDirectory(dir=args.store_dir) as folder:
        trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(world / "model"), num_slots=1, max_rank=args.rank,
                                                 storage=folder))
        trainer.init_slot(0, SlotHyperParams(objective="sft", rank=args.rank, alpha=2.0 * args.rank), seed=0)
        times: dict[str, list[float]] = {"durable": [], "ephemeral": []}
        stop, written = threading.Event(), []
        beside = threading.Thread(target=_write_beside, args=(Path(folder), args.beside_mib, stop, written), daemon=True)
        if args.beside_mib:
            beside.start()
        for i in range(args.saves + 2):  # the first of each kind warms up (imports, the store's folders)
            for kind in times:
                t0 = time.perf_counter()
                trainer.export.export_peft(0, f"saves/{kind}-{i}", durable=kind == "durable")
                if i >= 2:
                    times[kind].append((time.perf_counter() - t0) * 1e3)
        stop.set()
        if args.beside_mib:
            beside.join()
    out = {"rank": args.rank, "store_dir": args.store_dir or tempfile.gettempdir(), "beside_mib": args.beside_mib,
           "beside_files": len(written), **{k: _summary(v) for k, v in times.items()}}
    out["saved_ms_p50"] = round(out["durable"]["p50_ms"] - out["ephemeral"]["p50_ms"], 2)
    print(json.dumps(out, indent=1))
    print(f"reproduce: python -m benchmarks.bench_sampler_save {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**out, "all_ms": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

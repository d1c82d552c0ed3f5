"""Checkpoint throughput to object storage against the local disk, and an evicted tenant's turn
when its spill file lives in object storage.

Backends: the local store (trainer/storage/local_store.py: copy, fsync, manifest) in a temporary
folder, and S3Store (trainer/storage/s3_store.py) on a SeaweedFS server started on loopback
(tests/s3_server.py), whose data folder is on the same disk. Shapes: a slot's trainer state as the
trainer writes it (slot_state.safetensors: weights, gradient and both AdamW moments, fp32, of the
LoRA elements of `benchmarks.bench_slot_swap.lora_elements`, random values; slot_state.json):
``tiny`` = the CPU tiny world at rank 8 (0.4 MiB), ``qwen3-8b`` = the 8B shape at rank 16 (558 MiB).

  put      put_folder of the state folder (copied: the source stays), MB/s = state bytes / seconds
  get      get_folder into a fresh reader (S3: an empty cache, so a download; both verify SHA-256),
           with the pages of the store's files dropped from the page cache first (cold)
  turn     one evicted tenant's turn with its spill in the store: swap-out = encode the spill file
           (trainer/swap/spill_file.py) + write it + put_folder under layouts.spill; swap-in =
           get_folder from a fresh reader + read_spill_file (checksums) into host memory

  PYTHONPATH=$PWD .venv/bin/python -m benchmarks.bench_storage --shapes tiny,qwen3-8b --iters 2 --out storage.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.bench_slot_swap import KINDS, drop_page_cache, lora_elements
from tests.s3_server import seaweedfs
from trainer.storage import layouts
from trainer.storage.local_store import LocalStore
from trainer.swap.spill_file import encode_spill, read_spill_file, write_spill_file

RANKS = {"tiny": 8, "qwen3-1.7b": 16, "qwen3-8b": 16}


def slot_tensors(shape: str) -> dict[str, torch.Tensor]:
    p = lora_elements(shape, RANKS[shape])
    return {kind: torch.randn(p) for kind in KINDS}


def state_folder(root: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, int]:
    folder = root / f"state-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "slot_state.safetensors"))
    (folder / "slot_state.json").write_text(json.dumps({"step": 3, "rank": 16}))
    return folder, sum(f.stat().st_size for f in folder.iterdir())


def drop_cache(*folders: Path) -> None:
    """Evict the pages of every file below the folders (the store's copy, SeaweedFS's volumes). The
    server does not fsync its volumes, and dirty pages cannot be dropped: write them back first."""
    os.sync()
    for folder in folders:
        for p in Path(folder).rglob("*"):
            if p.is_file():
                try:
                    drop_page_cache(p)
                except OSError:
                    pass


def timed(fn) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_backend(name: str, make_reader, store, data_dirs: list[Path], shape: str, iters: int, scratch: Path) -> dict:  # noqa: ANN001
    tensors = slot_tensors(shape)
    src, nbytes = state_folder(scratch, tensors)
    puts, gets, outs, ins = [], [], [], []
    for i in range(iters):
        key = f"bench/{shape}/put-{i}"
        puts.append(timed(lambda: store.put_folder(key, src)))  # noqa: B023
        drop_cache(*data_dirs)
        reader = make_reader()
        gets.append(timed(lambda: reader.get_folder(key)))  # noqa: B023
        store.delete(key)
        # a turn: the evicted slot's snapshot goes out as a spill file in the store, then comes back
        spill_key = layouts.spill(0, f"tenant-{shape}-{i}")

        def swap_out() -> None:
            with store.write_folder(spill_key) as d:  # noqa: B023
                write_spill_file(d / "slot.swap", encode_spill("t", {"step": 3}, torch.zeros(7, dtype=torch.float64), tensors))

        outs.append(timed(swap_out))
        drop_cache(*data_dirs)
        reader = make_reader()
        ins.append(timed(lambda: read_spill_file(reader.get_folder(spill_key) / "slot.swap", "t", pin=False)))  # noqa: B023
        store.delete(spill_key)
    shutil.rmtree(src, ignore_errors=True)
    mb = nbytes / 1e6
    med = statistics.median
    row = {"backend": name, "shape": shape, "state_mib": round(nbytes / 2**20, 2), "iters": iters,
           "put_ms": round(med(puts) * 1e3, 1), "put_mb_s": round(mb / med(puts), 1),
           "get_ms": round(med(gets) * 1e3, 1), "get_mb_s": round(mb / med(gets), 1),
           "swap_out_ms": round(med(outs) * 1e3, 1), "swap_in_ms": round(med(ins) * 1e3, 1),
           "turn_ms": round((med(outs) + med(ins)) * 1e3, 1),
           "put_s_all": [round(t, 3) for t in puts], "get_s_all": [round(t, 3) for t in gets]}
    print(f"{name:6s} {shape:10s} {row['state_mib']:8.2f} MiB  put {row['put_ms']:9.1f} ms {row['put_mb_s']:7.1f} MB/s  "
          f"get {row['get_ms']:9.1f} ms {row['get_mb_s']:7.1f} MB/s  turn {row['swap_out_ms']:.1f} + {row['swap_in_ms']:.1f} ms",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="tiny,qwen3-8b")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    load_start = os.getloadavg()
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="lorafleet-bench-storage-"))
    try:
        with seaweedfs() as server:
            for shape in args.shapes.split(","):
                if "local" in args.backends:
                    local = LocalStore(scratch / "local")
                    rows.append(bench_backend("local", lambda: local, local, [scratch / "local"], shape, args.iters, scratch))  # noqa: B023
                if "s3" in args.backends:
                    s3 = server.store("bench", cache_dir=scratch / "cache")

                    def reader():  # noqa: ANN202 - another machine: an empty cache
                        return server.store("bench", cache_dir=scratch / "readers" / uuid.uuid4().hex)

                    rows.append(bench_backend("s3", reader, s3, [server.folder / "data"], shape,
                                              args.iters, scratch))
                    shutil.rmtree(scratch / "readers", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {"rows": rows, "load_average_start": load_start, "load_average_end": os.getloadavg(), "cpus": os.cpu_count()}
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

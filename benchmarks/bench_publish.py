"""Weight publishing: what one stepped adapter costs from the trainer to the engine, before and after
the file handoff (issue 18 items 3-4). CPU only (this machine has no GPU; say so next to the numbers).

Four parts (``--parts``):

* ``wire``: per adapter of the Qwen3-8B rank-16 shape (36 layers, every linear: 43.6 M parameters,
  87 MB bf16 / 174 MB fp32, real PEFT names and shapes, random values), each hop of the publish:
    before ('tensors'): trainer -> coordinator (a Ray actor returns the tensors, as
      TrainerGroup.peft_tensors), AdapterWeights(...), coordinator -> rollout worker (Ray: the
      safetensors-bytes __getstate__), then in the worker the wire format of
      /load_lora_adapter_from_tensors: pickle, base64, JSON;
    after ('disk', file handoff): the trainer writes the PEFT folder (trainer.export.peft_io.write_peft_folder,
      what TrainerGroup.export_peft runs) into a folder on disk (the state dir's handoff folder) and
      on tmpfs (/dev/shm), then the coordinator -> worker hop of AdapterWeights.from_folder (a path).
* ``engine``: engine-side load on a real SGLang CPU server (the tiny model: hidden 64, 4 layers,
  ffn 256; its adapters are made as large as the 8B ones by raising the rank: rank 3870 in fp32 is
  87 MB, rank 7740 is 174 MB), by tensors in the request and by folder; plus smaller ranks for the
  per-MB slope.
* ``round``: a round of N stepped adapters as service/loop/training_loop.py publishes them, on real Ray actors
  standing for the trainer and the rollout worker: the time the loop waits (its critical path) and
  the time until the worker has every version (engine load not included: see ``engine``), and when
  the trainer's next train call (submitted after the round's exports) starts. Modes:
  ``before`` (tensors through Ray, wire format built in the worker), ``handoff`` (the loop waits
  for the trainer's folder write), ``deferred`` (the loop only submits the write; the worker awaits
  it, rollout.engines.weights.PendingFolder; the rank writes each folder before its next call),
  ``background`` (what the service does with weight_transfer 'disk' since the writer thread:
  the rank only snapshots in order, trainer/export/export_writer.py writes while the next call runs).
  ``--publish-dtypes``: the trainer holds fp32 weights (as the real one does) and the snapshot casts
  them to each publish dtype (engines.publish_dtype; trainer/export/slot_export.py snapshot_peft), one round set
  per dtype; without it the snapshot keeps the held dtype (``--dtypes``).
* ``host`` (issue 28; CPU or GPU): the host side of a background export with the shared arena
  (trainer/export/peft_export.py BackgroundExports), per bf16 adapter of the 8B shape (``--host-mb``
  shrinks it for a CPU run): the arena's one-time cudaHostRegister; N device->host copies into
  the registered arena against torch pinned memory (rate, and main-thread ms per copy issued);
  and N folders written from the arena to /dev/shm by W writer threads against W writer
  processes (``--host-writers``) while the main thread runs a fixed loop of small tensor ops (a
  train call's host work): the loop's slowdown against running alone is the writers' share of
  the GIL.

    .venv/bin/python -m benchmarks.bench_publish --parts wire,round --out publish_cpu.json
    .venv/bin/python -m benchmarks.bench_publish --parts engine --out publish_engine.json
    .venv/bin/python -m benchmarks.bench_publish --parts round --round-modes background --publish-dtypes float32,bfloat16 --out publish_dtype.json
    python -m benchmarks.bench_publish --parts host --rounds 64 --out publish_host.json    # on the GPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import emit

# Qwen3-8B: hidden 4096, 32 query heads and 8 kv heads of 128, ffn 12288, 36 layers.
QWEN3_8B = {"layers": 36, "hidden": 4096, "q": 4096, "kv": 1024, "ffn": 12288}


def qwen3_8b_lora(rank: int = 16, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT config, PEFT-named tensors) of a rank-`rank` LoRA on every linear of the Qwen3-8B shape."""
    s = QWEN3_8B
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (s["hidden"], s["q"]), "self_attn.k_proj": (s["hidden"], s["kv"]),
        "self_attn.v_proj": (s["hidden"], s["kv"]), "self_attn.o_proj": (s["q"], s["hidden"]),
        "mlp.gate_proj": (s["hidden"], s["ffn"]), "mlp.up_proj": (s["hidden"], s["ffn"]), "mlp.down_proj": (s["ffn"], s["hidden"]),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(s["layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            base = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g).to(dtype)
            tensors[f"{base}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g).to(dtype)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "task_type": "CAUSAL_LM", "target_modules": sorted({m.split(".")[1] for m in shapes})}
    return config, tensors


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def timed(fn, repeats: int) -> tuple[float, list[float], object]:
    """Median seconds of `repeats` calls of fn(), all times, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def _ms(x: float) -> float:
    return round(1000 * x, 1)


# --- Ray actors standing for the trainer rank and the rollout worker ---------------------------------

def _actors():
    import ray

    from trainer.actor import EXPORT_GROUP

    @ray.remote(num_cpus=0, concurrency_groups={EXPORT_GROUP: 1})  # as service/fleet/actors.py starts TrainWorker
    class Trainer:
        """Holds one slot's PEFT tensors, as the trainer rank would after a step. The background
        export is the trainer's own machinery (trainer/export/export_writer.py: ExportWriter,
        replace_folder_atomically; trainer/peft_io.write_peft_folder) with the snapshot a clone of
        the tensors (what SlotExporter.snapshot_peft is on CPU: fresh copies of the slot's
        blocks; on CUDA a device->host copy instead)."""

        def __init__(self, dtype: str, publish_dtype: str | None = None):
            from trainer.export.export_writer import ExportWriter, export_dtype

            self.cfg, self.tensors = qwen3_8b_lora(dtype=getattr(torch, dtype))
            # the export's dtype: the snapshot casts to it (snapshot_peft); None = the held dtype
            self.publish = export_dtype(publish_dtype) if publish_dtype else getattr(torch, dtype)
            self.writer = ExportWriter(self._write)

        def peft_tensors(self):  # TrainerGroup.peft_tensors: the tensors travel back through Ray
            return self.cfg, self.tensors

        def export_peft(self, out_dir: str) -> str:  # TrainerGroup.export_peft: rank 0 writes the folder
            from trainer.export.peft_io import write_peft_folder

            return str(write_peft_folder(out_dir, self.cfg, {k: v.to(self.publish) for k, v in self.tensors.items()}))

        def export_peft_in_background(self, out_dir: str) -> str:  # TrainWorker's: snapshot now, write later
            snap = {k: v.to(self.publish, copy=True) for k, v in self.tensors.items()}  # fresh, cast: snapshot_peft
            self.writer.submit(out_dir, snap, sum(t.numel() * t.element_size() for t in snap.values()))
            return out_dir

        def wait_export(self, out_dir: str) -> str:  # dispatched in EXPORT_GROUP, like TrainWorker's
            return self.writer.wait(out_dir)

        def _write(self, out_dir: str, snap: dict) -> None:
            from trainer.export.export_writer import replace_folder_atomically
            from trainer.export.peft_io import write_peft_folder

            replace_folder_atomically(lambda tmp: write_peft_folder(tmp, self.cfg, snap), out_dir)

        def train(self) -> float:  # the next train call: when it started (CLOCK_MONOTONIC, machine-wide)
            return time.monotonic()

    @ray.remote(num_cpus=0)
    class Worker:
        """The rollout worker's side of a publish, up to the HTTP request to the engine."""

        def publish_tensors(self, weights) -> int:  # EngineClient.load_adapter(transfer='tensors'): the body it builds
            body = json.dumps({"lora_name": "x", "config_dict": weights.config, "serialized_named_tensors": [weights.wire_payload()]})
            return len(body)

        def publish_folder(self, weights) -> int:  # EngineClient.load_adapter(transfer='disk'): a path
            return len(json.dumps({"lora_name": "x", "lora_path": weights.folder}))

        async def publish_pending(self, pending) -> int:  # RolloutCore.publish_version: await the trainer's write
            weights = await pending.ready()
            return len(json.dumps({"lora_name": "x", "lora_path": weights.folder}))

        def ping(self, weights=None) -> int:  # receives (unpickles) what it is sent, does nothing
            return 0

    return Trainer, Worker


def part_wire(args, out: dict) -> None:
    import ray

    from rollout.engines.weights import AdapterWeights, _pickle_with_torch_storage_reducer

    Trainer, Worker = _actors()
    worker = Worker.remote()
    ray.get(worker.ping.remote())
    handoff_roots = {"state dir (disk)": Path(args.state_dir), "tmpfs (/dev/shm)": Path("/dev/shm")}
    for dtype in args.dtypes:
        cfg, tensors = qwen3_8b_lora(dtype=getattr(torch, dtype))
        row: dict = {"params": sum(t.numel() for t in tensors.values()), "MB": round(nbytes(tensors) / 1e6, 1)}
        trainer = Trainer.remote(dtype)
        ray.get(trainer.peft_tensors.remote())  # warm
        r = args.repeats
        # before
        m, _, _ = timed(lambda: ray.get(trainer.peft_tensors.remote()), r)
        row["before: trainer -> coordinator (Ray, tensors) ms"] = _ms(m)
        m, _, w = timed(lambda: AdapterWeights(cfg, tensors=tensors), r)
        row["before: AdapterWeights() ms"] = _ms(m)
        m, _, _ = timed(lambda: ray.get(worker.ping.remote(w)), r)
        row["before: coordinator -> worker (Ray, safetensors bytes) ms"] = _ms(m)
        m, _, raw = timed(lambda: _pickle_with_torch_storage_reducer(dict(tensors)), r)
        row["before: pickle ms"] = _ms(m)
        m, _, b64 = timed(lambda: base64.b64encode(raw).decode("ascii"), r)
        row["before: base64 ms"] = _ms(m)
        m, _, body = timed(lambda: json.dumps({"lora_name": "x", "config_dict": cfg, "serialized_named_tensors": [b64]}), r)
        row["before: JSON ms"] = _ms(m)
        row["before: request body MB"] = round(len(body) / 1e6, 1)
        m, _, _ = timed(lambda: len(pickle_loads(base64.b64decode(json.loads(body)["serialized_named_tensors"][0]))), r)
        row["before: engine-side parse (JSON, base64, unpickle) ms"] = _ms(m)
        del raw, b64, body
        # after
        for label, root in handoff_roots.items():
            folder = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir=root))
            try:
                m, _, _ = timed(lambda: ray.get(trainer.export_peft.remote(str(folder / "a"))), r)
                row[f"after: trainer writes the folder, {label} ms"] = _ms(m)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        m, _, _ = timed(lambda: ray.get(worker.publish_folder.remote(AdapterWeights(cfg, folder="/state/handoff/a/v1"))), r)
        row["after: coordinator -> worker (a path) + request body ms"] = _ms(m)
        ray.kill(trainer)
        out.setdefault("wire", {})[dtype] = row
        print(dtype, json.dumps(row, indent=1), flush=True)


def pickle_loads(raw: bytes):
    import pickle

    return pickle.loads(raw)


def part_round(args, out: dict) -> None:
    """A round as service/loop/training_loop.py ran it (publish per stepped adapter in series) and with the file handoff."""
    import ray

    from rollout.engines.weights import AdapterWeights, PendingFolder
    from trainer.actor import EXPORT_GROUP

    Trainer, Worker = _actors()
    worker = Worker.remote()
    # (label, held dtype, publish dtype): fp32 weights cast to each publish dtype, or as held
    setups = ([(f"float32 weights published in {p}", "float32", p) for p in args.publish_dtypes] if args.publish_dtypes
              else [(d, d, None) for d in args.dtypes])
    for label, dtype, publish_dtype in setups:
        trainer = Trainer.remote(dtype, publish_dtype)
        ray.get(trainer.peft_tensors.remote())
        rows = {}
        for n in args.rounds:
            row = {}
            if "before" in args.round_modes and n <= args.max_before_round:
                t0 = time.perf_counter()
                refs = []
                for _ in range(n):
                    cfg, tensors = ray.get(trainer.peft_tensors.remote())
                    refs.append(worker.publish_tensors.remote(AdapterWeights(cfg, tensors=tensors)))
                row["before: loop waits s"] = round(time.perf_counter() - t0, 2)
                ray.get(refs)
                row["before: every version at the worker, request bodies built s"] = round(time.perf_counter() - t0, 2)
            for mode in args.round_modes:
                if mode == "before":
                    continue
                folder = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir=args.state_dir))
                try:
                    t0_mono = time.monotonic()
                    t0 = time.perf_counter()
                    refs = []
                    for i in range(n):
                        path = str(folder / f"a{i}" / "v1")
                        if mode == "handoff":  # the loop waits for the trainer's write
                            ray.get(trainer.export_peft.remote(path))
                            refs.append(worker.publish_folder.remote(AdapterWeights({"r": 16}, folder=path)))
                        elif mode == "deferred":  # the loop submits the write; the worker awaits it (PendingFolder)
                            refs.append(worker.publish_pending.remote(PendingFolder(path, [trainer.export_peft.remote(path)])))
                        else:  # "background": the service now (TrainerGroup.begin_export_peft): snapshot in order, write off the rank's path
                            writers = [trainer.export_peft_in_background.remote(path),
                                       trainer.wait_export.options(concurrency_group=EXPORT_GROUP).remote(path)]
                            refs.append(worker.publish_pending.remote(PendingFolder(path, writers)))
                    row[f"{mode}: loop waits s"] = round(time.perf_counter() - t0, 3)
                    # the trainer's next train call, submitted after the round's exports: how long it waits for them
                    row[f"{mode}: next train call starts after s"] = round(ray.get(trainer.train.remote()) - t0_mono, 3)
                    ray.get(refs)
                    row[f"{mode}: every version at the worker s"] = round(time.perf_counter() - t0, 2)
                    row[f"{mode}: handoff folder MB"] = round(sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6)
                finally:
                    shutil.rmtree(folder, ignore_errors=True)
            rows[str(n)] = row
            print(label, n, row, flush=True)
        ray.kill(trainer)
        out.setdefault("round", {})[label] = rows


def part_engine(args, out: dict) -> None:
    asyncio.run(_engine(args, out))


async def _engine(args, out: dict) -> None:
    from examples.tiny.build import ensure_tiny_world
    from rollout.engines.client import EngineClient
    from rollout.config import EngineConfig
    from rollout.engines.engine import EngineProcess
    from rollout.engines.weights import AdapterWeights
    from tests.integration.sglang_fixtures import make_peft_adapter

    model_dir = ensure_tiny_world() / "model"
    work = Path(tempfile.mkdtemp(prefix="bench-publish-", dir=args.state_dir))
    top = max(args.ranks)
    # The engine config caps the rank at 1024 for real deployments; the bench raises it (no validation
    # on model_copy) so a tiny-model adapter can be as large as an 8B one.
    cfg = EngineConfig(max_lora_rank=16, max_loras_per_batch=1, max_loaded_loras=2, cpu_threads=1).model_copy(update={"max_lora_rank": top})
    engine = EngineProcess(0, cfg, model_dir, log_dir=work / "logs")
    rows = {}
    try:
        t0 = time.perf_counter()
        engine.start()
        engine.wait_ready()
        out["engine_start_s"] = round(time.perf_counter() - t0, 1)
        async with EngineClient(engine.url, admin_timeout_s=600) as client:
            k = 0
            for rank in args.ranks:
                folder = make_peft_adapter(model_dir, work / f"r{rank}", seed=1, rank=rank, alpha=rank)
                w = AdapterWeights.from_folder(folder)
                mb = round(nbytes(w.load_tensors()) / 1e6, 1)
                row = {"MB": mb}
                for transfer in ("tensors", "disk"):
                    times = []
                    for _ in range(args.repeats):
                        k += 1
                        fresh = AdapterWeights(w.config, tensors=w.tensors) if transfer == "tensors" else w  # no cached payload
                        t0 = time.perf_counter()
                        await client.load_adapter(f"b{k}", fresh, transfer=transfer)
                        times.append(time.perf_counter() - t0)
                        await client.unload_adapter(f"b{k}")
                    row[f"load by {transfer} ms"] = _ms(statistics.median(times))
                    row[f"load by {transfer} ms (all)"] = [_ms(x) for x in times]
                    row[f"load by {transfer} ms per MB"] = round(1000 * statistics.median(times) / mb, 2)
                rows[str(rank)] = row
                print(rank, row, flush=True)
    finally:
        engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    out["engine"] = rows


def qwen3_8b_entries(rank: int = 16) -> list[tuple[str, tuple[int, ...]]]:
    """qwen3_8b_lora's names and shapes in file order, without making the tensors."""
    from trainer.export.safetensors_stream import file_order

    s = QWEN3_8B
    shapes = {"self_attn.q_proj": (s["hidden"], s["q"]), "self_attn.k_proj": (s["hidden"], s["kv"]),
              "self_attn.v_proj": (s["hidden"], s["kv"]), "self_attn.o_proj": (s["q"], s["hidden"]),
              "mlp.gate_proj": (s["hidden"], s["ffn"]), "mlp.up_proj": (s["hidden"], s["ffn"]), "mlp.down_proj": (s["ffn"], s["hidden"])}
    out = {}
    for layer in range(s["layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            base = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{base}.lora_A.weight"], out[f"{base}.lora_B.weight"] = (rank, fan_in), (fan_out, rank)
    return [(k, out[k]) for k in file_order({k: (torch.bfloat16, torch.Size(v)) for k, v in out.items()})]


def part_host(args, out: dict) -> None:
    """The ``host`` part (module docstring)."""
    import threading

    from trainer.export.peft_export import BackgroundExports, ExportRequest, make_snapshots
    from trainer.export.safetensors_stream import packed_header

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    entries = qwen3_8b_entries()
    elems = sum(torch.Size(s).numel() for _, s in entries)
    if args.host_mb:  # a smaller adapter (CPU runs): the first tensors' worth
        keep, total = [], 0
        for name, shape in entries:
            if total * 2 >= args.host_mb * 1e6:
                break
            keep.append((name, shape))
            total += torch.Size(shape).numel()
        entries, elems = keep, total
    header = packed_header(entries, torch.bfloat16, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32}
    n = max(args.rounds)
    adapter_bytes = elems * 2
    arena_bytes = (n + 1) * -(-adapter_bytes // 4096) * 4096
    bodies = torch.randn(n, elems, device=dev).to(torch.bfloat16)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "adapters": n, "adapter_mb": round(adapter_bytes / 1e6, 1)}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def issue_copies(bg):  # main-thread time to issue n copies, and until they are done
        t0 = time.perf_counter()
        hosts, blocks, done = bg.to_host(bodies)
        issued = time.perf_counter() - t0
        for d in done:  # one CopyDone per row on CUDA (trainer/export/copy_feeder.py), None on the CPU
            if d is not None:
                d.synchronize()
        return issued, time.perf_counter() - t0, hosts, blocks, done

    bg = BackgroundExports(device=dev, threads=1, max_pending_bytes=arena_bytes)
    t0 = time.perf_counter()
    arena = bg.arena
    res["arena_gb"], res["arena_register_s"] = round(arena.nbytes / 1e9, 2), round(time.perf_counter() - t0, 3)
    for b in issue_copies(bg)[3]:  # warm: the arena's pages touched
        b.release()
    rows = {}
    for kind in ("arena", "pinned"):
        best = None
        for _ in range(args.repeats):
            if kind == "arena":
                issued, total, hosts, blocks, _ = issue_copies(bg)
                for b in blocks:
                    b.release()
            else:
                stream = bg.copy_stream if cuda else None
                t0 = time.perf_counter()
                hosts = [torch.empty(elems, dtype=torch.bfloat16, pin_memory=cuda) for _ in range(n)]
                if cuda:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for i in range(n):
                            hosts[i].copy_(bodies[i], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                    issued = time.perf_counter() - t0
                    ev.synchronize()
                else:
                    for i in range(n):
                        hosts[i].copy_(bodies[i])
                    issued = time.perf_counter() - t0
                total = time.perf_counter() - t0
                del hosts
            row = {"issue_ms_per_copy": round(1e3 * issued / n, 3), "copy_gb_s": round(n * adapter_bytes / total / 1e9, 2)}
            best = row if best is None or row["copy_gb_s"] > best["copy_gb_s"] else best
        rows[kind] = best
        print("d2h", kind, best, flush=True)
    res["d2h"] = rows
    bg.close()

    def host_loop(iters: int) -> float:  # the main thread's host work: small tensor ops (a train call's launches)
        x = torch.zeros(64, device=dev)
        t0 = time.perf_counter()
        for _ in range(iters):
            x.add_(1.0).mul_(0.5)
        sync()
        return time.perf_counter() - t0

    host_loop(2000)
    alone = min(host_loop(args.host_loop_iters) for _ in range(3))
    res["host_loop_alone_s"] = round(alone, 4)
    writes = {}
    root = Path(tempfile.mkdtemp(prefix="bench-host-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        for kind in ("thread", "process"):
            for w in args.host_writers:
                bgk = BackgroundExports(device=dev, threads=w, kind=kind, max_pending_bytes=arena_bytes)
                bgk._arena = arena  # the registered arena, shared by the runs (registration is once per rank)
                # warm the writers (a process starts on its first write)
                hosts, blocks, done = bgk.to_host(bodies[:w])
                reqs = [ExportRequest(i, str(root / f"warm-{kind}-{w}-{i}")) for i in range(w)]
                bgk.submit(reqs, make_snapshots(hosts, blocks, done, [config] * w, entries, header))
                for r in reqs:
                    bgk.writer.wait(r.folder)
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(exist_ok=True)
                hosts, blocks, done = bgk.to_host(bodies)
                reqs = [ExportRequest(i, str(root / f"{kind}-{w}-{i}")) for i in range(n)]

                def claim(reqs=reqs, bgk=bgk):  # the rollout worker's part: wait for each folder, then delete it
                    for r in reqs:
                        bgk.writer.wait(r.folder)
                        shutil.rmtree(r.folder, ignore_errors=True)

                claimer = threading.Thread(target=claim, daemon=True)
                t0 = time.perf_counter()
                bgk.submit(reqs, make_snapshots(hosts, blocks, done, [config] * n, entries, header))
                claimer.start()
                loops, loop_s = 0, 0.0
                while claimer.is_alive():
                    loop_s += host_loop(args.host_loop_iters)
                    loops += 1
                claimer.join()
                total = time.perf_counter() - t0
                row = {"write_gb_s": round(n * adapter_bytes / total / 1e9, 2), "loops_during": loops,
                       "host_loop_slowdown": round(loop_s / loops / alone, 3) if loops else None}
                writes[f"{kind}x{w}"] = row
                print("writers", kind, w, row, flush=True)
                bgk.close()
                shutil.rmtree(root, ignore_errors=True)
                root.mkdir(exist_ok=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["writers"] = writes
    out["host"] = res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="wire,round,engine")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", default="1,16,64")
    p.add_argument("--round-modes", default="before,handoff,deferred,background",
                   help="before: the tensors path; handoff: the loop waits for the trainer's write; deferred: it does not, "
                        "the rank writes before its next call; background: the rank snapshots, its writer thread writes")
    p.add_argument("--publish-dtypes", default="",
                   help="round part: the trainer holds fp32 weights and publishes in each of these (float32, bfloat16, "
                        "float16: engines.publish_dtype), instead of --dtypes")
    p.add_argument("--max-before-round", type=int, default=16, help="largest N run the old way (it is ~1 s per adapter)")
    p.add_argument("--ranks", default="16,256,1024,3870,7740", help="engine part: tiny-model ranks (3870: 87 MB, 7740: 174 MB fp32)")
    p.add_argument("--state-dir", default=os.environ.get("BENCH_STATE_DIR", tempfile.gettempdir()), help="where handoff folders go (disk)")
    p.add_argument("--host-mb", type=float, default=None, help="host part: adapter size in MB (default: the 8B shape, 87 MB)")
    p.add_argument("--host-writers", default="1,4", help="host part: writer threads / processes to compare")
    p.add_argument("--host-loop-iters", type=int, default=2000, help="host part: small tensor ops per main-thread loop")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.host_writers = [int(x) for x in args.host_writers.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.publish_dtypes = [d for d in args.publish_dtypes.split(",") if d]
    args.rounds = [int(x) for x in args.rounds.split(",")]
    args.ranks = [int(x) for x in args.ranks.split(",")]
    args.round_modes = args.round_modes.split(",")
    parts = args.parts.split(",")
    out: dict = {"cpus": os.cpu_count(), "loadavg_1m_at_start": round(os.getloadavg()[0], 2), "torch_threads": torch.get_num_threads()}
    if "wire" in parts or "round" in parts:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    if "wire" in parts:
        part_wire(args, out)
    if "round" in parts:
        part_round(args, out)
    if "engine" in parts:
        part_engine(args, out)
    if "host" in parts:
        part_host(args, out)
    out["loadavg_1m_at_end"] = round(os.getloadavg()[0], 2)
    emit(out, args.out)


if __name__ == "__main__":
    main()

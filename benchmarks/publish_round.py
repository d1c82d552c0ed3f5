"""bench_parallel_step's mode export: what publishing a round's stepped adapters costs the round
(issues 18 and 28), on the real trainer at the benchmark's shape, once per writer kind.

Per writer kind (--export-writer: thread, process; trainer/export/peft_export.py), after the case's
mixed rounds, every one of the N slots stepped in each round:

  order check   a background export of slot 0 followed at once by a mixed round equals, tensor
                by tensor, a synchronous export just before it (background_equals_sync);
  round         a mixed round followed by the N background exports as ONE batched call
                (SlotExporter.export_peft_in_background_many, latest-wins keyed per slot as
                the service keys them per run), against the mixed round alone: the publishing
                cost a round pays. A claimer thread on rank 0 waits for each folder in order and
                deletes it (the rollout worker's part); a folder that a newer export of its slot
                superseded (the writer fell behind) is counted, never written.
  export calls  the main thread's time in that call per round (median over the timed rounds,
                warm-up excluded), and of it the wait for room (back-pressure: in the host arena,
                or under the writer's byte bound).
  room          the arena's plan (BackgroundExports.size_for: blocks of the largest file's size,
                slots + writer threads of them) against a snapshot's size; allocations that found
                no room per round, and for the first that did in a timed round, what held the
                arena then (BackgroundExports.room_report: blocks in use, queued jobs, jobs being
                written, blocks this call took, the block size against the planned one), so a
                run that waits says why.

--export-sync adds the synchronous export_peft of the N slots (the path before issue 18).
Folders go to /dev/shm.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

from benchmarks.bench_mixed_step import sync, timed
from tests.trainer_probes import hold_writer, use_export_writer


def _gather(obj) -> list:
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def export_timings(trainer, n: int, run_mixed, opts: dict, kind: str) -> dict:
    """Mode export with writer `kind` (module docstring); the slowest rank's numbers."""
    import torch.distributed as dist

    from safetensors.torch import load_file

    from trainer.export.export_writer import Superseded
    from trainer.export.peft_export import ExportRequest

    rank0 = trainer.layout.rank == 0
    dtype = opts.get("export_dtype", "bfloat16")
    use_export_writer(trainer.export, kind, opts["export_threads"])
    root = tempfile.mkdtemp(prefix="bench-export-", dir="/dev/shm") if rank0 else ""
    out: dict = {"writer": kind, "threads": opts["export_threads"]}
    try:
        # warm: the arena (registered once per rank) and every writer thread's process, started by
        # one held export per thread (each thread takes one when the hold ends)
        t0 = time.perf_counter()
        warm = [ExportRequest(0, os.path.join(root, f"warm{i}") if rank0 else f"unused-warm{i}") for i in range(opts["export_threads"])]
        if rank0:
            hold_writer(trainer.export.writer(), True)
        trainer.export.export_peft_in_background_many(warm, dtype=dtype)
        if rank0:
            hold_writer(trainer.export.writer(), False)
            for r in warm:
                trainer.export.wait_export(r.folder)
        out["warm_exports_s"] = time.perf_counter() - t0
        sync_s = None
        if opts.get("export_sync"):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(n):
                trainer.export.export_peft(k, os.path.join(root, "sync", f"s{k}") if rank0 else "unused")
            sync()
            dist.barrier()
            sync_s = time.perf_counter() - t0
            if rank0:
                shutil.rmtree(os.path.join(root, "sync"), ignore_errors=True)

        # the order check on this device: a background export followed at once by a train call
        check = os.path.join(root, "check") if rank0 else "unused-check"
        trainer.export.export_peft(0, os.path.join(check, "sync") if rank0 else "unused")
        trainer.export.export_peft_in_background(0, os.path.join(check, "bg") if rank0 else "unused-bg", dtype=dtype)
        run_mixed()
        same = None
        if rank0:
            trainer.export.wait_export(os.path.join(check, "bg"))
            a, b = (load_file(os.path.join(check, x, "adapter_model.safetensors")) for x in ("sync", "bg"))
            same = sorted(a) == sorted(b) and all(torch.equal(a[k].to(b[k].dtype), b[k]) for k in a)  # sync is fp32
            shutil.rmtree(check, ignore_errors=True)

        claims: list[str | None] = []
        claimed = threading.Condition()
        failures: list[str] = []
        superseded = [0]

        def claimer():  # the rollout worker's part: wait for each folder in order, then discard it
            i = 0
            while True:
                with claimed:
                    claimed.wait_for(lambda: len(claims) > i)
                    folder = claims[i]
                i += 1
                if folder is None:
                    return
                try:
                    if isinstance(trainer.export.wait_export(folder), Superseded):
                        superseded[0] += 1
                except Exception as err:  # noqa: BLE001 - reported in the row
                    failures.append(f"{type(err).__name__}: {err}"[:200])
                shutil.rmtree(folder, ignore_errors=True)

        claimer_thread = threading.Thread(target=claimer, daemon=True)
        if rank0:
            claimer_thread.start()
        rounds = iter(range(10**9))
        calls: list[float] = []  # main-thread seconds of each round's export call
        waits: list[float] = []  # of it, waiting for room (the arena, or the writer's byte bound)
        waited: list[list[dict]] = []  # room_report()s of the round's allocations that found no room
        exports = trainer.export.background

        def room_wait_s() -> float:
            return exports.arena.wait_seconds + exports.writer.room_wait_seconds

        def mixed_then_exports():
            run_mixed()
            r = next(rounds)
            requests = [ExportRequest(k, os.path.join(root, f"r{r}", f"s{k}") if rank0 else f"unused-{r}-{k}", key=f"slot{k}")
                        for k in range(n)]
            wait0, seq0 = (room_wait_s(), exports.room_wait_count) if rank0 else (0.0, 0)
            t_exports = time.perf_counter()
            trainer.export.export_peft_in_background_many(requests, dtype=dtype)
            calls.append(time.perf_counter() - t_exports)
            waits.append((room_wait_s() if rank0 else 0.0) - wait0)
            waited.append([w for w in exports.room_waits if w["seq"] > seq0] if rank0 else [])
            if rank0:
                with claimed:
                    claims.extend(q.folder for q in requests)
                    claimed.notify_all()

        writer = exports.writer if rank0 else None
        base_written, base_write_s = (writer.written, writer.write_seconds) if writer else (0, 0.0)
        alloc0 = _allocator_counts()
        res = timed(mixed_then_exports, opts["iters"], opts["warmup"], None, end_round=dist.barrier,
                    progress=dist.get_rank() == 0)
        allocs = {k: v - alloc0[k] for k, v in _allocator_counts().items()}
        timed_calls, timed_waits, timed_waited = calls[-opts["iters"]:], waits[-opts["iters"]:], waited[-opts["iters"]:]
        first_wait = next((w[0] for w in timed_waited if w), None)
        b2b_rounds = opts.get("back_to_back_rounds", 8)
        b2b_exports_ms = back_to_back_ms(mixed_then_exports, b2b_rounds, dist.barrier)
        b2b_mixed_ms = back_to_back_ms(run_mixed, b2b_rounds, dist.barrier)
        parts = None
        if opts.get("export_parts"):
            while rank0 and exports.writer.pending():  # the exports above hold arena blocks until written
                time.sleep(0.05)
            parts = publish_parts_ms(trainer, n, run_mixed, dtype, b2b_rounds)
        t0 = time.perf_counter()
        if rank0:
            with claimed:
                claims.append(None)
                claimed.notify_all()
            claimer_thread.join()
        drain_s = time.perf_counter() - t0
        written = writer.written - base_written if writer else 0
        stats = _gather({"same": same, "sync": sync_s, "drain": drain_s, "written": written, "superseded": superseded[0],
                         "write_s": (writer.write_seconds - base_write_s) / written if written else None,
                         "failures": failures, "call_s": statistics.median(timed_calls), "wait_s": statistics.median(timed_waits),
                         "mb": _adapter_bytes(trainer, dtype) / 1e6 if rank0 else 0.0,
                         "register_s": exports.arena.register_seconds if rank0 else 0.0,
                         "plan": _plan(trainer, exports, dtype) if rank0 else None,
                         "waited_allocs": statistics.median(len(w) for w in timed_waited), "first_wait": first_wait,
                         "allocs": allocs})
        out.update({
            "adapter_mb_on_rank0": round(stats[0]["mb"], 1),
            "arena_register_s": stats[0]["register_s"],
            "sync_export_ms_per_adapter": None if sync_s is None else 1e3 * max(x["sync"] for x in stats) / n,
            "round_with_exports_ms": res["ms"], "round_with_exports_all_ms": res["all_ms"],
            "round_with_exports_peak_gib": res["peak_gib"],
            "writer_ms_per_adapter": None if stats[0]["write_s"] is None else 1e3 * stats[0]["write_s"],
            "export_calls_ms_per_round": 1e3 * max(x["call_s"] for x in stats),
            "room_wait_ms_per_round": 1e3 * stats[0]["wait_s"],
            "room_plan": stats[0]["plan"], "waited_allocs_per_round": stats[0]["waited_allocs"],
            "room_at_first_wait": stats[0]["first_wait"],
            "cuda_allocator_over_rounds": stats[0]["allocs"],
            "written": stats[0]["written"], "superseded": stats[0]["superseded"],
            "writes_left_after_rounds_s": stats[0]["drain"],
            "back_to_back_rounds": b2b_rounds, "back_to_back_mixed_ms": b2b_mixed_ms,
            "back_to_back_with_exports_ms": b2b_exports_ms,
            "back_to_back_publish_share": (b2b_exports_ms - b2b_mixed_ms) / b2b_mixed_ms,
            "back_to_back_parts_ms": parts,
            "write_failures": stats[0]["failures"],
            "background_equals_sync": stats[0]["same"],
        })
    finally:
        if rank0:
            shutil.rmtree(root, ignore_errors=True)
    return out


def back_to_back_ms(fn, rounds: int, end_round) -> float:
    """ms per round of `rounds` calls of fn run as the service's loop runs them: each round waits
    for its own stream's work (what a train call's metrics wait for), not for the whole device, so
    a round's snapshot copies on the copy stream overlap the next round's compute; ONE device sync
    at the end counts the last round's copies once. (`timed` syncs the whole device after every
    round, so it also counts each round's device->host copies in full, after the step: an upper
    bound on what publishing costs the loop.)"""
    sync()
    end_round()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        end_round()
    sync()
    end_round()
    return (time.perf_counter() - t0) * 1e3 / rounds


def publish_parts_ms(trainer, n: int, run_mixed, dtype: str, rounds: int) -> dict:
    """Where a round's publishing time goes (--export-parts; back to back, rank 0 of tp1 only): ms
    per round of the mixed round followed by (a) the snapshot's gathers alone, (b) the gathers
    and their device->host copies into the arena, blocks released when the copies end (no
    writer), against (c) the mixed round alone. The full export (gathers, copies, writes) is the
    row's back-to-back column."""
    from trainer.export.export_writer import export_dtype

    exporter, background = trainer.export, trainer.export.background
    to = export_dtype(dtype)
    state = trainer.slots.state(0)
    layout = exporter.export_layout(state.rank, state.hyper)
    slots = list(range(n))
    pending: list = []

    def settle():  # the previous round's copies (ended long ago, normally), then their blocks back
        for blocks, done in pending:
            for d, b in zip(done, blocks):
                if d is not None:
                    d.synchronize()
                if b is not None:
                    b.release()
        pending.clear()

    def gathers(copy: bool):
        def fn():
            run_mixed()
            settle()
            with trainer.buffers.behind_step():  # as the exporter gathers (trainer/optim/step_overlap.py)
                bodies = exporter._gather(slots, layout, to, gather_only=False)
                if copy:
                    _, blocks, done = background.to_host(bodies)
                    pending.append((blocks, done))
        return fn

    import torch.distributed as dist

    out = {"mixed": back_to_back_ms(run_mixed, rounds, dist.barrier),
           "mixed_gathers": back_to_back_ms(gathers(False), rounds, dist.barrier),
           "mixed_gathers_copies": back_to_back_ms(gathers(True), rounds, dist.barrier)}
    settle()
    return out


def _adapter_bytes(trainer, dtype: str) -> int:
    """Bytes of slot 0's publish file data (its export layout, in `dtype`)."""
    from trainer.export.export_writer import export_dtype

    state = trainer.slots.state(0)
    return trainer.export.export_layout(state.rank, state.hyper).index.numel() * export_dtype(dtype).itemsize


def _allocator_counts() -> dict:
    """CUDA caching-allocator counters ({} without CUDA): a retry frees cached blocks after a
    synchronization of the device, a main-thread stall an export call could hide (its chunk
    temporaries are held by the copy stream until their copies end). Warm-up rounds included."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_sync_all_streams")}


def _plan(trainer, exports, dtype: str) -> dict:
    """The arena's plan against this case's snapshot (rank 0; after the rounds)."""
    snapshot = _adapter_bytes(trainer, dtype)
    return {"snapshot_bytes": snapshot, "planned_block_bytes": exports.planned_block, "arena_bytes": exports.arena.nbytes,
            "arena_holds_planned_blocks": exports.arena.nbytes // max(1, exports.planned_block),
            "slots": trainer.config.num_slots, "threads": exports.threads,
            "writer_bound_bytes": exports.writer.max_pending_bytes}


def room_line(e: dict) -> str:
    """The room columns of a mode export result in words: the plan, and what held the arena at the first wait."""
    plan, first = e.get("room_plan") or {}, e.get("room_at_first_wait")
    text = ""
    if plan:
        text = (f"arena {plan['arena_bytes'] / 1e9:.2f} GB = {plan['arena_holds_planned_blocks']} blocks of "
                f"{plan['planned_block_bytes'] / 1e6:.1f} MB planned (slots {plan['slots']} + threads {plan['threads']}), "
                f"snapshot {plan['snapshot_bytes'] / 1e6:.1f} MB")
    text += f"; allocations that waited per round {e.get('waited_allocs_per_round', 0):g}"
    if e.get("cuda_allocator_over_rounds"):
        text += f"; CUDA allocator over the rounds {e['cuda_allocator_over_rounds']}"
    if first:
        text += (f"; at the first wait: {first['blocks_in_use']} blocks in use of {first['arena_holds_blocks']} "
                 f"({first['queued']} queued, {first['writing']} being written, {first['taken_by_this_call']} taken by "
                 f"this call, {first['held_otherwise']} otherwise), block {first['block_bytes'] / 1e6:.1f} MB for a "
                 f"{first['snapshot_bytes'] / 1e6:.1f} MB snapshot, planned {first['planned_block_bytes'] / 1e6:.1f} MB, "
                 f"largest free range {first['largest_free_bytes'] / 1e6:.1f} MB")
    return text


def export_table(layouts: list[dict]) -> str:
    """Mode export's rows: per writer kind, the round's publishing cost."""
    def fmt(x, spec=".1f"):
        return "-" if x is None else format(x, spec)

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    lines = ["| layout | N adapters | writer | MB per adapter | mixed ms | mixed + N background exports ms | publishing / mixed "
             "| export call ms / round (of it waiting for room) | writer ms / adapter | written / superseded | peak GiB "
             "| back to back: mixed / with exports ms (publishing / mixed) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lay in layouts:
        for r in lay["results"]:
            for e in (r.get("export") or {}).values():
                name = f"{lay['layout']} {lay.get('path', 'fused')} ({lay['recompute']})"
                if "error" in e:
                    lines.append(f"| {name} | {r['n']} | {e.get('writer', '-')} | {e['error'][:80]} ||||||||| ")
                    continue
                share = e.get("publish_share_of_mixed")  # rounds synced device-wide: an upper bound
                lines.append(
                    f"| {name} | {r['n']} | {e['writer']} x {e['threads']} | {fmt(e['adapter_mb_on_rank0'])} | "
                    f"{fmt(r.get('mixed', {}).get('ms'), '.0f')} | {fmt(e['round_with_exports_ms'], '.0f')} | "
                    f"{pct(share)} | "
                    f"{fmt(e['export_calls_ms_per_round'])} ({fmt(e['room_wait_ms_per_round'])}) | "
                    f"{fmt(e['writer_ms_per_adapter'])} | {e['written']} / {e['superseded']} | {fmt(e['round_with_exports_peak_gib'])} | "
                    f"{fmt(e.get('back_to_back_mixed_ms'), '.0f')} / {fmt(e.get('back_to_back_with_exports_ms'), '.0f')} "
                    f"({pct(e.get('back_to_back_publish_share'))}) |"
                    + (f" FAILED WRITES: {e['write_failures'][:2]}" if e.get("write_failures") else "")
                    + (f" WAITED FOR ROOM: {room_line(e)}" if e.get("room_at_first_wait") else "")
                    + ("" if e.get("background_equals_sync") else " BACKGROUND EXPORT DIFFERS FROM THE SYNCHRONOUS ONE"))
    return "\n".join(lines)

"""The cost of ``tinker_durability: step`` per optim_step (issue 40): one Tinker model's training step
with and without the durable snapshot that policy ``step`` takes before the step is acknowledged.

One trainer (a Qwen3-8B-shaped random model by default, bf16 base on CUDA; ``--tiny`` for the CPU)
with one resident model of rank 16 (every target, fp32 LoRA weights and AdamW moments, as the
trainer keeps them), and per case (L tokens per optim_step) two modes, alternating over --repeats:

  interval  what ``interval:<s>`` costs between its snapshots: the round (RoundRunner.run_round, the
            scheduler's call: one forward_backward of L tokens in datums of at most --datum-tokens, then
            the optim_step)
  step      the same round, then what ``step`` adds before the optim_step is acknowledged: the
            forward_backward's request recorded (its wire body as JSON, ``TinkerRecords.set_request``,
            awaited: a write-ahead log entry) and the model's snapshot by the service's own code
            (``ModelJournal.snapshot``: the slot's whole state, gathered to the host, written as one
            safetensors file and checksummed through the store (``LocalStore`` in --store-dir: fsync'd),
            then recorded in SQLite (synchronous=FULL) and the previous snapshot deleted)

Reported per case: the median ms per step of each mode, the ratio of their steps per second, and the
step mode's extra split into its parts (request record, slot state saved, record, old snapshot
deleted; their medians), the snapshot's bytes and write rate; then the restore (the snapshot loaded
into a free slot: what a model's return after a crash costs before its replay).

  python -m benchmarks.bench_durable_step --out durable_step.json                 # GPU: 8B, rank 16
  python -m benchmarks.bench_durable_step --tiny --tokens 64 --iters 2 --repeats 1  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks.bench_mixed_step import TINY, sync, write_config  # noqa: E402
from benchmarks.bench_parallel_step import QWEN3_8B  # noqa: E402

LR, BETAS, EPS = 1e-4, (0.9, 0.95), 1e-8
TENANT, MODEL = "bench", "model-0"


def step_work(tokens: int, datum_tokens: int, vocab: int, seed: int):
    """(RoundWork of one forward_backward over `tokens` tokens in datums of <= datum_tokens, then the
    optim_step; that forward_backward's wire body, as a client sends it)."""
    from trainer.rounds import AdamStep, Call, Datum, RoundWork

    g = torch.Generator().manual_seed(seed)
    datums, wire = [], []
    left = tokens
    while left > 0:
        n = min(left, datum_tokens)
        left -= n
        seq = torch.randint(0, vocab, (n,), generator=g)
        target = torch.cat([seq[1:], seq[:1]])
        weights = torch.ones(n)
        weights[-1] = 0.0
        datums.append(Datum(seq.tolist(), {"target_tokens": target, "weights": weights}))
        wire.append({"model_input": {"chunks": [{"type": "encoded_text", "tokens": seq.tolist()}]},
                     "loss_fn_inputs": {"target_tokens": {"data": target.tolist(), "dtype": "int64", "shape": [n]},
                                        "weights": {"data": weights.tolist(), "dtype": "float32", "shape": [n]}}})
    adam = AdamStep(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    work = RoundWork(calls=[Call(0, datums, "cross_entropy")], optim=[(0, adam)], max_seq_len=min(tokens, datum_tokens))
    return work, {"forward_backward_input": {"data": wire, "loss_fn": "cross_entropy"}}


class DurableModel:
    """One model's step under either policy, through the service's records and journal."""

    def __init__(self, trainer, runner, folder: Path) -> None:  # noqa: ANN001
        from service.config.durability import Durability
        from service.registry.tinker_records import TinkerRecords
        from service.tenants.tinker_durability import ModelJournal
        from trainer.storage.local_store import LocalStore

        from trainer.actor import TrainWorker

        self.trainer, self.runner = trainer, runner
        self.worker = TrainWorker(trainer)  # the trainer interface the service's journal calls (a rank, in process)
        self.records = TinkerRecords(folder / "records.sqlite")
        self.store = LocalStore(folder / "store")
        self.records.add_model(MODEL, TENANT, "session-0", 16, 0, ("all",), None, 0).wait()
        self.journal = ModelJournal(self.records, self.store, Durability.parse("step"), TENANT, MODEL)
        self.seq = 0
        self.parts: dict[str, list[float]] = {"request_ms": [], "snapshot_ms": []}

    def round(self, work) -> None:  # noqa: ANN001
        result = self.runner.run_round(work)
        errors = [c.error for c in result.calls if c.error] + [o for o in result.optim if isinstance(o, str)]
        assert not errors, errors[:3]

    def durable_round(self, work, request: dict) -> None:  # noqa: ANN001
        """The round, then what policy step adds before the optim_step is acknowledged, each part timed
        (the journal's snapshot is split at its calls: the same calls, in its order)."""
        self.seq += 1
        request_id = f"fb-{self.seq}"
        t0 = time.perf_counter()
        self.records.add_future(request_id, TENANT, MODEL, "forward_backward", seq=self.seq)
        self.records.set_request(request_id, self.seq, request).wait()  # the face waits before answering the id
        t1 = time.perf_counter()
        self.round(work)
        sync()
        t2 = time.perf_counter()
        url = self.journal.snapshot(self.worker, 0, self.seq, self.seq)
        t3 = time.perf_counter()
        self.parts["request_ms"].append((t1 - t0) * 1e3)
        self.parts["snapshot_ms"].append((t3 - t2) * 1e3)
        self.last_url = url

    def split_snapshot(self) -> dict:
        """One more snapshot with its parts timed apart (ModelJournal.snapshot's calls, in its order)."""
        self.seq += 1
        key = self.journal.snapshot_prefix + f"/split-{self.seq}"
        url = self.store.url(key)
        t0 = time.perf_counter()
        self.worker.save_slot_state(0, url)
        t1 = time.perf_counter()
        self.records.set_snapshot(MODEL, url, self.seq, self.seq).wait()
        t2 = time.perf_counter()
        self.store.delete(key)
        t3 = time.perf_counter()
        folder = Path(self.store.root) / key
        return {"save_ms": (t1 - t0) * 1e3, "record_ms": (t2 - t1) * 1e3, "delete_ms": (t3 - t2) * 1e3,
                "folder_exists_after_delete": folder.exists()}

    def snapshot_bytes(self) -> int:
        folder = Path(self.store.root) / self.store.key_of(self.last_url)
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())

    def restore_ms(self) -> float:
        """The last snapshot loaded into the free slot 1, then cleared (a model's return after a crash)."""
        sync()
        t0 = time.perf_counter()
        self.worker.load_slot_state(1, self.last_url, registration="restore")
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        self.trainer.clear_slot(1)
        return ms


def measure(model: DurableModel, work, request: dict, iters: int, warmup: int, repeats: int) -> dict:
    runs = {"interval": lambda: model.round(work), "step": lambda: model.durable_round(work, request)}
    for fn in runs.values():
        for _ in range(warmup):
            fn()
        sync()
    times: dict[str, list[float]] = {m: [] for m in runs}
    for _ in range(repeats):
        for mode, fn in runs.items():
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                sync()
                times[mode].append((time.perf_counter() - t0) * 1e3)
    out = {f"{m}_ms": statistics.median(t) for m, t in times.items()}
    out["all_ms"] = {m: [round(x, 1) for x in t] for m, t in times.items()}
    out["step_over_interval_steps_per_s"] = out["interval_ms"] / out["step_ms"]
    out["added_ms"] = out["step_ms"] - out["interval_ms"]
    out["request_ms"] = statistics.median(model.parts["request_ms"])
    out["snapshot_ms"] = statistics.median(model.parts["snapshot_ms"])
    return out


def main(argv: list[str] | None = None) -> int:
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.step.round_runner import RoundRunner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke test)")
    ap.add_argument("--tokens", default=None, help="tokens per optim_step, comma list (default 1024,8192; tiny 64)")
    ap.add_argument("--datum-tokens", type=int, default=1024, help="the longest datum (sequence) of a step")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--store-dir", default=None, help="where the store and records live (default: a temporary folder)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    shape = TINY if args.tiny else QWEN3_8B
    cases = [int(t) for t in (args.tokens or ("64" if args.tiny else "1024,8192")).split(",")]
    datum_tokens = min(args.datum_tokens, max(cases))
    with tempfile.TemporaryDirectory(dir=args.store_dir) as folder:
        cfg = TrainerConfig(base_model_path=write_config(shape, folder), random_init=True, num_slots=2, max_rank=args.rank,
                            micro_batch_tokens=max(cases))
        t0 = time.perf_counter()
        trainer = MultiLoraTrainer(cfg)
        build_s = time.perf_counter() - t0
        runner = RoundRunner(trainer, max_seq_len=datum_tokens)
        hyper = SlotHyperParams(objective="sft", rank=args.rank, alpha=2.0 * args.rank, lr=LR, betas=BETAS, eps=EPS,
                                weight_decay=0.0, max_grad_norm=None)
        trainer.init_slot(0, hyper, seed=0)
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        model = DurableModel(trainer, runner, Path(folder))
        print(f"# {device}, base {trainer.base.dtype}, built in {build_s:.1f} s, one model of rank {args.rank}, "
              f"store {model.store.root}", flush=True)
        rows = []
        for tokens in cases:
            work, request = step_work(tokens, datum_tokens, shape["vocab_size"], seed=tokens)
            row = {"tokens": tokens, "datum_tokens": datum_tokens, "request_json_bytes": len(json.dumps(request))}
            row.update(measure(model, work, request, args.iters, args.warmup, args.repeats))
            row["snapshot_bytes"] = model.snapshot_bytes()
            row["split"] = model.split_snapshot()
            row["write_mb_s"] = row["snapshot_bytes"] / 1e6 / (row["split"]["save_ms"] / 1e3)
            row["restore_ms"] = model.restore_ms()
            print(f"# {tokens} tokens: {json.dumps({k: v for k, v in row.items() if k != 'all_ms'})}", flush=True)
            rows.append(row)
        model.records.close()

    print()
    print("| tokens per step | interval: ms per step | step: ms per step | steps/s, step / interval | added ms "
          "(request record + snapshot) | snapshot: save slot state + record + delete old | snapshot MiB (MB/s) | restore ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["split"]
        print(f"| {r['tokens']:,} | {r['interval_ms']:.1f} | {r['step_ms']:.1f} | {r['step_over_interval_steps_per_s']:.2f}x | "
              f"{r['added_ms']:.0f} ({r['request_ms']:.1f} + {r['snapshot_ms']:.0f}) | {s['save_ms']:.0f} + {s['record_ms']:.1f} + "
              f"{s['delete_ms']:.1f} | {r["snapshot_bytes"] / 2**20:.1f} ({r['write_mb_s']:.0f}) | {r['restore_ms']:.0f} |")
    print(f"\nreproduce: python -m benchmarks.bench_durable_step {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": str(trainer.base.dtype), "rank": args.rank, "shape": shape,
                       "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

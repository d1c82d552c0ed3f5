"""Tinker API on CPU: forward_backward calls per second and the coalescing factor.

One in-process server (uvicorn on loopback, the Tinker routes over a MultiLoraTrainer
on the tiny world), C concurrent clients of the official tinker SDK (C = 1, 4, 16 by
default), each with its own API key and LoRA model; every client runs S steps of
forward_backward (cross_entropy, D datums of the tiny SFT data) + optim_step, submitting
both before waiting, as the Tinker docs recommend. Reported per C: wall seconds of the
steps (model creation excluded), forward_backward calls/s, mixed steps, and the
coalescing factor (calls per mixed step, from the server's counters).

  .venv/bin/python -m benchmarks.bench_tinker_cpu                      # 1, 4, 16 clients
  .venv/bin/python -m benchmarks.bench_tinker_cpu --clients 4 --steps 3 --window-ms 20

``--durability step`` runs the same with every optim_step acknowledged only after the model's
snapshot is durable (issue 40; the default is ``interval:300``): compare the two rows' steps/s for
the cost of ``step`` on this machine (docs/tinker.md, "Restarts, crashes and lost machines"):

  .venv/bin/python -m benchmarks.bench_tinker_cpu --clients 1 4 --durability interval:300 step

``--ops`` measures the trainer primitives alone (no HTTP; runs on a GPU too): N models'
forward_backward calls (one sequence of L tokens each, cross_entropy) as ONE coalesced
mixed step vs N separate steps over the same tokens, each followed by the N optim_steps;
median ms over --iters after a warm-up, a Qwen3-1.7B-shaped random model by default
(``--tiny`` for the tiny shape):

  python -m benchmarks.bench_tinker_cpu --ops --models 16 --seq-len 1024       # GPU (bf16)
  python -m benchmarks.bench_tinker_cpu --ops --tiny --models 16 --seq-len 64  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def sft_data(tok, data_dir: Path, start: int, n: int):  # noqa: ANN001, ANN201
    from tinker import types

    rows = [json.loads(line) for line in (data_dir / "echo_sft.jsonl").read_text().splitlines()]
    out = []
    for r in (rows[(start + i) % len(rows)] for i in range(n)):
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        full = p + c
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(c)}))
    return out


def run(clients: int, steps: int, datums: int, window_s: float, durability: str = "interval:300") -> dict:
    import tinker
    from tinker import types

    from api.server import ApiServer
    from api.tinker.auth import TenantKeys
    from tests.tinker_in_process import in_process_service, tinker_app
    from examples.tiny.build import ensure_tiny_world

    world = ensure_tiny_world()
    keys = {f"bench{i}": f"tml-bench-{i:04d}-key" for i in range(clients)}
    svc = in_process_service(world / "model", TenantKeys(keys), tempfile.mkdtemp(prefix="tinker-bench-"), num_slots=clients,
                             max_rank=8, base_model="tiny-qwen3", window_s=window_s, durability=durability)
    with ApiServer(tinker_app(svc)) as server:
        tcs = [tinker.ServiceClient(base_url=server.url, api_key=k).create_lora_training_client(
            base_model="tiny-qwen3", rank=8, seed=i, train_unembed=False).result() for i, k in enumerate(keys.values())]
        tok = tcs[0].get_tokenizer()
        data = [sft_data(tok, world / "data", i * datums, datums) for i in range(clients)]
        barrier = threading.Barrier(clients + 1)

        def client(i: int) -> None:
            barrier.wait()
            for _ in range(steps):
                fb = tcs[i].forward_backward(data[i], "cross_entropy")
                opt = tcs[i].optim_step(types.AdamParams(learning_rate=1e-3))
                fb.result()
                opt.result()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        before = svc.metrics()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = svc.metrics()
    calls = after["forward_backward_calls"] - before["forward_backward_calls"]
    mixed = after["mixed_steps"] - before["mixed_steps"]
    return {"clients": clients, "durability": durability, "steps": steps, "datums_per_call": datums,
            "window_ms": window_s * 1e3, "wall_s": round(wall, 2), "steps_per_s": round(clients * steps / wall, 2),
            "fwdbwd_calls": calls, "calls_per_s": round(calls / wall, 2), "mixed_steps": mixed,
            "coalescing_factor": round(calls / mixed, 2) if mixed else 0.0}


def run_ops(models: int, seq_len: int, iters: int, tiny: bool, rank: int) -> dict:
    """One coalesced forward_backward of ``models`` calls vs ``models`` separate ones (same tokens)."""
    import statistics

    import torch

    from benchmarks.bench_mixed_step import QWEN3_1_7B, TINY, sync, write_config
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.step.round_runner import AdamStep, Call, Datum, RoundRunner

    shape = TINY if tiny else QWEN3_1_7B
    with tempfile.TemporaryDirectory() as folder:
        trainer = MultiLoraTrainer(TrainerConfig(base_model_path=write_config(shape, folder), random_init=True,
                                                 num_slots=models, max_rank=rank))
    ops = RoundRunner(trainer, max_seq_len=seq_len)
    for slot in range(models):
        trainer.init_slot(slot, SlotHyperParams(rank=rank, alpha=32.0), seed=slot)
    g = torch.Generator().manual_seed(0)
    calls = []
    for slot in range(models):
        full = torch.randint(0, shape["vocab_size"], (seq_len + 1,), generator=g)
        calls.append(Call(slot, [Datum(full[:-1].tolist(), {"target_tokens": full[1:], "weights": torch.ones(seq_len)})],
                          "cross_entropy"))
    adam = AdamStep(learning_rate=1e-5)

    def coalesced() -> None:
        ops.forward_backward(calls)
        for c in calls:
            ops.optim_step(c.slot, adam)

    def separate() -> None:
        for c in calls:
            ops.forward_backward([c])
            ops.optim_step(c.slot, adam)

    out = {"models": models, "seq_len": seq_len, "device": str(trainer.device), "dtype": str(trainer.buffers.weight.dtype)}
    for name, fn in (("coalesced", coalesced), ("separate", separate)):
        fn()  # warm-up
        times = []
        for _ in range(iters):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"{name}_ms"] = round(statistics.median(times), 1)
    out["speedup"] = round(out["separate_ms"] / out["coalesced_ms"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--datums", type=int, default=4, help="datums per forward_backward call")
    ap.add_argument("--window-ms", type=float, default=20.0, help="coalescing window")
    ap.add_argument("--durability", nargs="+", default=["interval:300"], help="tinker_durability policies to run (step, interval:<s>)")
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument("--ops", action="store_true", help="trainer primitives only: coalesced vs separate steps")
    ap.add_argument("--models", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    import torch

    if args.ops:
        row = run_ops(args.models, args.seq_len, args.iters, args.tiny, args.rank)
        print(json.dumps(row))
        if args.out:
            Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
        return
    torch.set_num_threads(1)
    rows = [run(c, args.steps, args.datums, args.window_ms / 1e3, d) for d in args.durability for c in args.clients]
    print("| clients | durability | fwd_bwd calls | wall s | steps/s | calls/s | mixed steps | coalescing factor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['clients']} | {r['durability']} | {r['fwdbwd_calls']} | {r['wall_s']} | {r['steps_per_s']} | {r['calls_per_s']} | "
              f"{r['mixed_steps']} | {r['coalescing_factor']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The Tinker round against a dataset-run round with the same tokens (issue 45 item 4).

One trainer (a Qwen3-1.7B-shaped random model by default, bf16 on CUDA; ``--tiny`` for the CPU),
N resident slots of rank 16, and for each case (N models x one sequence of L tokens) two rounds of
the scheduler, both through ``RoundRunner.run_round`` (trainer/step/round_runner.py), what every
trainer rank runs:

  tinker   the coalesced Tinker path: N forward_backward calls (one cross_entropy datum of L tokens
           each, riding in one packed micro-batch) and the N models' optim_steps (per-slot AdamW)
  dataset  N dataset runs' samples of the same tokens (``RoundWork.batch``, SFT, every slot stepping
           in the round: one batched AdamW over the due slots)

The two rounds do the same work: the same L tokens per slot go through the model, the same L - 1
positions are learned (the datum's last position has weight 0, where a sample's last token predicts
nothing), the slots' loss is the sum of the token losses (``loss_normalization: constant`` with 1
token: the gradient is the one a Tinker loss sum gives) and AdamW takes the same parameters (no
clipping). Checked before timing (``same_work``): from the same fresh slots each path's per-slot loss
must agree with the other's (5e-4 relative in fp32, 3e-2 in bf16), and the weights after one round are
reported as max |difference| / lr (Adam's first update moves each trained weight by about lr).

Reported per case: the median ms of each round (device-synced, modes alternating over --repeats),
the Tinker path's overhead (ms and ratio), then where it goes: one more set of rounds with every
phase device-synced at its edges (so the phases add to a little more than the round):

  prepare    the calls validated and their datums made into riders (``_riders``; Tinker only)
  plan       the train call's planning around the micro-batches (phases, micro-batch split)
  packing    building the packed stream: the loop samples' tensors / the riders' targets, the
             stream's tensors (``pack_sequences``) and the scatter of the log-probs back
  forward    the model's forward over the stream (with each slot's LoRA)
  loss       the losses: per datum (each rider's loss, and its outputs copied to the host) or the
             loop's rows in one call (``sample_loss_numerators``)
  backward   the backward and the micro-batch's bookkeeping
  optimizer  per-slot AdamW (N ``optim_step`` calls, each with its gradient norm read on the host)
             or the batched step of the due slots (``step_due_slots``)
  outputs    the Tinker answers assembled (``finish``)
  rest       the round minus all of the above

and on CUDA the round's host-device synchronisations by call site (benchmarks/sync_census.py).
``--profile-out DIR``: a torch.profiler table of one round of each path (device-busy ms against
wall ms: host-bound time shows as the difference).

  python -m benchmarks.bench_tinker_round --out tinker_round.json                  # GPU: 64 x 256 and 16 x 1024
  python -m benchmarks.bench_tinker_round --tiny --cases 64x32 --iters 2           # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from benchmarks.bench_mixed_step import QWEN3_1_7B, TINY, measure_modes, sync, timed, write_config  # noqa: E402

PHASES = ("prepare", "plan", "packing", "forward", "loss", "backward", "optimizer", "outputs", "rest")
LR = 1e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
LOSS_TOL = {torch.float32: 5e-4, torch.bfloat16: 3e-2}


def parse_cases(text: str) -> list[tuple[int, int]]:
    """'64x256,16x1024' -> [(64, 256), (16, 1024)] (N models x L tokens)."""
    out = []
    for item in text.split(","):
        n, length = item.lower().split("x")
        if int(n) < 1 or int(length) < 2:
            raise ValueError(f"case {item!r}: needs N >= 1 models and L >= 2 tokens")
        out.append((int(n), int(length)))
    return out


def round_works(n: int, length: int, vocab: int, seed: int = 0):
    """(dataset RoundWork, tinker RoundWork) over the same n sequences of ``length`` tokens, slot k the k-th."""
    from trainer.batch import TrainBatch, TrainSample
    from trainer.rounds import AdamStep, Call, Datum, RoundWork

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]
    batch = TrainBatch(samples=[TrainSample(slot=k, tokens=s.tolist(), loss_mask=[0] + [1] * (length - 1))
                                for k, s in enumerate(seqs)])
    weights = torch.ones(length)
    weights[-1] = 0.0  # the last token predicts nothing in a sample: a datum's last position learns nothing
    calls = [Call(k, [Datum(s.tolist(), {"target_tokens": torch.cat([s[1:], s[:1]]), "weights": weights})], "cross_entropy")
             for k, s in enumerate(seqs)]
    adam = AdamStep(learning_rate=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
    return RoundWork(batch=batch), RoundWork(calls=calls, optim=[(k, adam) for k in range(n)], max_seq_len=length)


def fresh_slots(trainer, n: int, rank: int) -> None:
    """Slots 0..n-1 initialized anew (same seeds: the same weights each time), the others free.
    Hyper-parameters making a dataset run's step the Tinker step: the loss a sum over tokens, the
    same AdamW, no clipping, one sample a step."""
    from trainer.config import SlotHyperParams

    hyper = SlotHyperParams(objective="sft", rank=rank, alpha=2.0 * rank, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, max_grad_norm=None,
                            samples_per_step=1, loss_normalization="constant", loss_norm_tokens=1)
    for slot in range(trainer.config.num_slots):
        if trainer.slots[slot] is not None:
            trainer.clear_slot(slot)
    for slot in range(n):
        trainer.init_slot(slot, hyper, seed=slot)


def run_dataset(runner, work) -> None:
    result = runner.run_round(work)
    assert result.refused is None and len(result.train.stepped) == len(work.batch.samples), result.refused


def run_tinker(runner, work) -> None:
    result = runner.run_round(work)
    errors = [c.error for c in result.calls if c.error] + [o for o in result.optim if isinstance(o, str)]
    assert not errors, errors[:3]


def same_work(trainer, runner, works, n: int, rank: int) -> dict:
    """Each path's one round from the same fresh slots: per-slot losses (must agree) and weights."""
    dataset, tinker = works
    fresh_slots(trainer, n, rank)
    res = runner.run_round(dataset)
    want = [res.train.slots[k].loss for k in range(n)]
    w_dataset = trainer.buffers.rows(trainer.buffers.weight, list(range(n))).float().clone()
    fresh_slots(trainer, n, rank)
    res = runner.run_round(tinker)
    got = [c.metrics["loss:sum"] for c in res.calls]
    w_tinker = trainer.buffers.rows(trainer.buffers.weight, list(range(n))).float()
    loss_err = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(got, want))
    tol = LOSS_TOL.get(trainer.base.dtype, LOSS_TOL[torch.bfloat16])
    if not loss_err <= tol:
        raise AssertionError(f"the two rounds do not do the same work: per-slot loss differs by {loss_err:.2e} "
                             f"(> {tol:.0e}); tinker {got[:3]}, dataset {want[:3]}")
    report = {"loss_rel_err": loss_err, "loss_sum_slot0": want[0],
              "weights_max_diff_over_lr": (w_tinker - w_dataset).abs().max().item() / LR}
    fresh_slots(trainer, n, rank)
    return report


class PhaseClock:
    """Device-synced time per phase of a round, by wrapping (for this process, while ``on()``) the
    functions each phase runs in: benchmark instrumentation only, restored on leaving."""

    def __init__(self, trainer, runner) -> None:
        self.trainer, self.runner = trainer, runner
        self.ms: dict[str, float] = defaultdict(float)

    def timed(self, key: str, fn):
        def wrapper(*args, **kwargs):
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            self.ms[key] += (time.perf_counter() - t0) * 1e3
            return out
        return wrapper

    @contextmanager
    def on(self):
        import trainer.core as core
        import trainer.step.lora_passes as lora_passes
        import trainer.step.micro_batch as micro_batch

        patches = [(core, "forward_backward", "fwd_bwd"), (core, "step_due_slots", "step_due"),
                   (micro_batch, "sample_loss_numerators", "loss"), (lora_passes, "pack_sequences", "pack_stream"),
                   (self.trainer, "train", "train"), (self.trainer.passes, "stream_logprobs", "stream"),
                   (self.trainer.passes, "logprobs", "logprobs"), (self.trainer.passes, "mixed_logprobs", "logprobs"),
                   (self.runner, "optim_step", "optim_step")]
        build = micro_batch.MicroBatchTensors.__dict__["build"]
        kept = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, key in patches:
            setattr(obj, name, self.timed(key, getattr(obj, name)))
        micro_batch.MicroBatchTensors.build = staticmethod(self.timed("build", build.__func__))
        self.runner._riders = self._riders(self.runner._riders)
        try:
            yield self
        finally:
            micro_batch.MicroBatchTensors.build = build
            for obj, name, fn in kept:
                if obj in (self.trainer, self.trainer.passes, self.runner):
                    delattr(obj, name)  # the instance's own attribute goes: the class's method shows again
                else:
                    setattr(obj, name, fn)
            del self.runner._riders

    def _riders(self, inner):
        def riders(*args, **kwargs):
            results, rs, finish = self.timed("prepare", inner)(*args, **kwargs)
            for r in rs:
                r.loss = self.timed("loss", r.loss)
            return results, rs, self.timed("outputs", finish)
        return riders

    def split(self, round_ms: float) -> dict[str, float]:
        """The phases of the rounds timed so far (``round_ms`` their total), as PHASES. The train call
        holds plan, packing, forward, loss, backward and the loop's step; the Tinker optim_steps,
        the riders' preparation and the answers come outside it."""
        m = self.ms
        out = {"prepare": m["prepare"], "plan": m["train"] - m["fwd_bwd"] - m["step_due"],
               "packing": m["logprobs"] - m["stream"] + m["pack_stream"] + m["build"],
               "forward": m["stream"] - m["pack_stream"], "loss": m["loss"],
               "backward": m["fwd_bwd"] - m["logprobs"] - m["loss"] - m["build"],
               "optimizer": m["step_due"] + m["optim_step"], "outputs": m["outputs"]}
        out["rest"] = round_ms - m["train"] - m["prepare"] - m["outputs"] - m["optim_step"]
        return out


def phase_split(trainer, runner, fn, rounds: int) -> dict:
    """ms per round of each phase, over ``rounds`` rounds with every phase device-synced."""
    clock = PhaseClock(trainer, runner)
    total = 0.0
    with clock.on():
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            total += (time.perf_counter() - t0) * 1e3
    split = clock.split(total)
    return {k: round(split[k] / rounds, 2) for k in PHASES} | {"round_ms": round(total / rounds, 2)}


def profile_rounds(runs: dict, folder: str, tag: str) -> dict:
    """One round of each path under torch.profiler: its wall ms, the device's busy ms (the device-side
    entries' self time: kernels, copies, memsets) and the device-to-host copies; the op table to a file."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    cuda = torch.cuda.is_available()
    out = {}
    for name, fn in runs.items():
        fn()
        sync()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall_ms = (time.perf_counter() - t0) * 1e3
        events = prof.key_averages()
        device = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
        busy_us = sum(getattr(e, "self_device_time_total", 0.0) for e in device)
        d2h = [e for e in device if "DtoH" in e.key]
        out[name] = {"wall_ms": round(wall_ms, 1), "device_busy_ms": round(busy_us / 1e3, 1),
                     "d2h_copies": sum(e.count for e in d2h)}
        with open(os.path.join(folder, f"profile_{tag}_{name}.txt"), "w") as f:
            f.write(json.dumps(out[name]) + "\n")
            f.write(events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=50,
                                 max_name_column_width=90))
    return out


def table(rows: list[dict]) -> str:
    lines = ["| N models x L tokens | dataset round ms | Tinker round ms | overhead ms (ratio) | where the overhead goes "
             "(phase: Tinker - dataset ms, synced rounds) | syncs per round dataset / Tinker |", "|---|---|---|---|---|---|"]
    for r in rows:
        d, t = r["dataset"].get("ms"), r["tinker"].get("ms")
        if d is None or t is None:
            lines.append(f"| {r['n']} x {r['len']} | {d} | {t} | failed: {r['dataset'].get('error') or r['tinker'].get('error')} | | |")
            continue
        diffs = {k: r["phases"]["tinker"][k] - r["phases"]["dataset"][k] for k in PHASES}
        where = ", ".join(f"{k} {v:+.1f}" for k, v in sorted(diffs.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 0.05)
        syncs = " / ".join(str(sum(r["syncs"][m].values())) for m in ("dataset", "tinker")) if r["syncs"]["tinker"] else "- (CUDA only)"
        lines.append(f"| {r['n']} x {r['len']} | {d:.1f} | {t:.1f} | {t - d:+.1f} ({t / d:.2f}) | {where} | {syncs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.sync_census import census
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer
    from trainer.step.round_runner import RoundRunner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (CPU smoke test)")
    ap.add_argument("--cases", default=None, help="N models x L tokens, comma list (default 64x256,16x1024; tiny 64x32)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10, help="timed rounds per mode and repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="each mode this many times, the modes alternating")
    ap.add_argument("--phase-rounds", type=int, default=3, help="device-synced rounds for the phase split")
    ap.add_argument("--profile-out", default=None, help="folder for torch.profiler tables of one round of each path")
    ap.add_argument("--out", default=None, help="write results JSON here")
    args = ap.parse_args(argv)

    shape = TINY if args.tiny else QWEN3_1_7B
    plan = parse_cases(args.cases or ("64x32" if args.tiny else "64x256,16x1024"))
    n_max = max(n for n, _ in plan)
    with tempfile.TemporaryDirectory() as folder:
        cfg = TrainerConfig(base_model_path=write_config(shape, folder), random_init=True, num_slots=n_max, max_rank=args.rank,
                            micro_batch_tokens=max(n * length for n, length in plan))  # one micro-batch a round, both paths
        t0 = time.perf_counter()
        trainer = MultiLoraTrainer(cfg)
        build_s = time.perf_counter() - t0
    runner = RoundRunner(trainer, max_seq_len=max(length for _, length in plan))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"# {device}, {trainer.base.dtype}, built in {build_s:.1f} s, {n_max} slots x rank {args.rank}, "
          f"micro-batches of {cfg.micro_batch_tokens} tokens", flush=True)

    rows = []
    for n, length in plan:
        works = round_works(n, length, shape["vocab_size"])
        row = {"n": n, "len": length, "tokens": n * length, "same_work": same_work(trainer, runner, works, n, args.rank)}
        print(f"# {n} x {length}: same work {row['same_work']}", flush=True)
        runs = {"dataset": lambda w=works[0]: run_dataset(runner, w), "tinker": lambda w=works[1]: run_tinker(runner, w)}
        measure_modes(row, list(runs), args.repeats, lambda mode: timed(runs[mode], args.iters, args.warmup),
                      f"{n:3d} x {length:5d}")
        row["phases"] = {mode: phase_split(trainer, runner, fn, args.phase_rounds) for mode, fn in runs.items()}
        for mode, split in row["phases"].items():
            print(f"# phases {mode:8s} {split}", flush=True)
        row["syncs"] = {mode: census(fn) for mode, fn in runs.items()}
        for mode, sites in row["syncs"].items():
            if sites:
                print(f"# syncs {mode}: {sum(sites.values())} per round; "
                      + "; ".join(f"{k} x{v}" for k, v in list(sites.items())[:5]), flush=True)
        if args.profile_out:
            row["profile"] = profile_rounds(runs, args.profile_out, f"{n}x{length}")
            print(f"# profile {row['profile']}", flush=True)
        rows.append(row)

    print()
    print(table(rows))
    print(f"\nreproduce: python -m benchmarks.bench_tinker_round {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "dtype": str(trainer.base.dtype), "rank": args.rank,
                       "config": cfg.model_dump(mode="json"), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

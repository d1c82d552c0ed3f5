"""Resume at the trainer level (fp32, CPU): an RL adapter with a KL term and a warm-up +
cosine schedule, saved mid-run with a half-accumulated step and loaded into a
different slot, continues exactly as the uninterrupted run; and a train step draws
no random numbers, which is why a slot checkpoint needs no generator state.

What can make a continuation random, and where its state lives:
* trainer: nothing after init_slot. Dropout is 0 in the base (trainer/base/base_model.py) and
  LoRA has none; init draws from its own seeded generator once. Checked below: the
  global torch generator is untouched by train().
* data order: a pure function of (seed, epoch) (rollout/data.py), so the data cursor
  plus the seed is its whole state.
* sampling on the SGLang engines: not seeded per request, so generation after a resume
  differs from an uninterrupted run's as any two runs' do; no generator state of ours
  could make it repeat.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

HYPER = dict(objective="rl", rank=4, alpha=8, lr=2e-2, betas=(0.85, 0.995), eps=1e-6, weight_decay=0.05,
             max_grad_norm=0.5, samples_per_step=2, kl_coef=0.2, lr_schedule="cosine", warmup_steps=2,
             total_steps=6, min_lr_ratio=0.1, clip_low=0.2, clip_high=0.28)
PARTNER = dict(objective="sft", rank=8, alpha=8, lr=1e-2, samples_per_step=1)
# Samples of the resumed adapter per call: 3 in call 2 leaves one accumulated toward step 2
# when the state is saved after call 2.
CALLS = [2, 3, 1, 2, 2, 2]
SAVE_AFTER = 2


def make_batch(slot, partner_slot, n, call, vocab):
    from trainer.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(1000 + call)
    samples = []
    for i in range(n + 1):  # n for the adapter, 1 for the partner
        length = int(torch.randint(6, 13, (1,), generator=g))
        tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
        rollout = (-torch.rand(length, generator=g) * 6).tolist()
        samples.append(TrainSample(slot=slot if i < n else partner_slot, tokens=tokens,
                                   loss_mask=[0, 0] + [1] * (length - 2),
                                   advantage=float(torch.randn(1, generator=g)), rollout_logprobs=rollout))
    return TrainBatch(samples=samples)


@pytest.fixture(scope="module")
def trainer(tiny_world):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=3, max_rank=8,
                                          micro_batch_tokens=32))


def _clear(trainer):
    for slot in range(trainer.config.num_slots):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)


def _run(trainer, calls, slot_of_call, reports):
    for call, n in calls:
        res = trainer.train(make_batch(slot_of_call(call), 0, n, call, trainer.vocab_size))
        reports += [(r.step, r.lr, r.loss, r.grad_norm) for r in res.slots[slot_of_call(call)].steps]


def test_rl_resume_with_cosine_schedule_continues_exactly(trainer, tmp_path):
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state, slot_state_tensors

    from trainer.config import SlotHyperParams

    hyper, partner = SlotHyperParams(**HYPER), SlotHyperParams(**PARTNER)
    calls = list(enumerate(CALLS))

    _clear(trainer)
    trainer.init_slot(0, partner, seed=7)
    trainer.init_slot(1, hyper, seed=11)
    straight: list = []
    _run(trainer, calls, lambda c: 1, straight)
    want = slot_state_tensors(trainer, 1)
    want_status = slot_status(trainer, 1)

    _clear(trainer)
    trainer.init_slot(0, partner, seed=7)
    trainer.init_slot(1, hyper, seed=11)
    resumed: list = []
    _run(trainer, calls[:SAVE_AFTER], lambda c: 1, resumed)
    assert slot_status(trainer, 1)["pending_samples"] == 1  # saved in the middle of a step
    save_slot_state(trainer, 1, tmp_path / "state")
    trainer.clear_slot(1)
    trainer.init_slot(1, SlotHyperParams(objective="sft", rank=2, alpha=2), seed=99)  # someone else moves in
    load_slot_state(trainer, 2, tmp_path / "state")
    _run(trainer, calls[SAVE_AFTER:], lambda c: 2, resumed)
    got = slot_state_tensors(trainer, 2)

    assert [r[0] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert len({r[1] for r in straight}) == 6  # warm-up then cosine: the lr changes every update
    assert resumed == straight  # lr, loss and grad norm of every update, exactly
    assert slot_status(trainer, 2)["step"] == want_status["step"] == 6
    for kind in ("weight", "exp_avg", "exp_avg_sq", "grad"):
        for side in (0, 1):
            for name, t in want[kind][side].items():
                assert torch.equal(got[kind][side][name], t), (kind, name)


def test_train_draws_no_random_numbers(trainer):
    """The trainer's continuation depends on no generator: train() leaves torch's global
    generators (CPU and, where present, CUDA) exactly as it found them."""
    from trainer.config import SlotHyperParams

    _clear(trainer)
    trainer.init_slot(0, SlotHyperParams(**PARTNER), seed=7)
    trainer.init_slot(1, SlotHyperParams(**HYPER), seed=11)
    torch.manual_seed(1234)
    cpu_before = torch.get_rng_state()
    cuda_before = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for call, n in enumerate(CALLS[:3]):
        res = trainer.train(make_batch(1, 0, n, call, trainer.vocab_size))
    assert res.stepped  # it really trained
    assert torch.equal(torch.get_rng_state(), cpu_before)
    if torch.cuda.is_available():
        assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), cuda_before))

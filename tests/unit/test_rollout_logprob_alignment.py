"""The sampler's log-probabilities stay with their tokens, from SGLang's answer to the loss's ratio.

A sample's ``rollout_logprobs[i]`` is the sampler's log p(token i | tokens before i); a micro-batch
row (trainer/step/micro_batch.py) puts the prediction of token t + 1 at position t (``labels``,
``mask``, ``rollout``), where the trainer's log-probability ``lp[t]`` is that of ``labels[t]``, so the
importance ratio exp(lp - q) compares two log-probabilities of the SAME token. Checked here on the
CPU, without servers, against the definition: a policy whose log-probability of each token given its
context is a known, position-dependent number (``policy_logprob``), so a value one position off is
a different value.

* the rows alone: hand-made samples of different lengths (padding), with and without rollout
  log-probabilities;
* the whole rollout side: SGLang's /generate answers in its wire format (``output_token_logprobs``
  entries ``[logprob, token id, text]``; ``input_token_logprobs`` from the log-prob start, None at
  the first token) read by the real client parser (rollout/engines/client.py), through the rollout
  context, multi-turn trajectories (environment tokens between turns), the group and the loop's
  train samples (service/tenants/batches.py), to the rows and the loss's ratio, which is exactly 1
  at every learned token when the trainer's policy is the sampler's.

The engine pool is a stand-in (``PolicyEngine``: no server in a unit test) that answers with
real parsed results; the real pool and server: tests/integration/test_rollout_multiturn.py and
test_logprob_parity.py. Plants this catches: tests/unit/off_by_one_mutations.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.config import SamplingConfig
from rollout.context import RolloutContext
from rollout.data import PromptRow
from rollout.engines.client import parse_generate_response
from rollout.engines.pool import GroupGeneration
from rollout.groups import trajectory_group
from rollout.trajectory import Trajectory
from service.tenants.batches import rl_step
from trainer.batch import TrainSample
from trainer.config import SlotHyperParams
from trainer.losses.rows import TokenLossInputs, sample_loss_numerators
from trainer.step.micro_batch import MicroBatchTensors

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
VOCAB = 100


def policy_logprob(context: list[int], token: int) -> float:
    """The policy's log p(token | context): distinct for every (position, token) pair, in (-6, 0)."""
    return -(0.01 + 0.05 * len(context) + 0.0007 * token)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _check_rows(samples: list[TrainSample]) -> MicroBatchTensors:
    """Build the rows of ``samples`` and check every position against the definition: position t of
    row j predicts token t + 1 (label, its loss mask, and the sampler's log-prob of THAT token)."""
    t = MicroBatchTensors.build(samples, [SlotHyperParams()] * len(samples), CPU)
    for j, x in enumerate(samples):
        n = len(x.tokens)
        assert t.labels[j, : n - 1].tolist() == x.tokens[1:]
        assert t.mask[j, : n - 1].tolist() == [bool(m) for m in x.loss_mask[1:]]
        assert not t.mask[j, n - 1 :].any() and not t.has_rollout[j, n - 1 :].any()  # the last token and padding
        assert t.has_rollout[j, : n - 1].all().item() == (x.rollout_logprobs is not None)
        for pos in range(n - 1):
            if x.rollout_logprobs is not None and x.loss_mask[pos + 1]:
                want = f32(policy_logprob(x.tokens[: pos + 1], x.tokens[pos + 1]))
                assert t.rollout[j, pos].item() == want, f"row {j} position {pos}: q is not the log-prob of token {pos + 1}"
    return t


def _ratios_on_policy(samples: list[TrainSample], t: MicroBatchTensors) -> None:
    """The trainer's log-probabilities from the definition (its policy = the sampler's): lp[j, t] of
    labels[j, t] given the tokens up to t. The ppo loss's ratio is then exactly 1 at every learned
    token and never clipped."""
    lp = torch.zeros_like(t.rollout)
    for j, x in enumerate(samples):
        for pos in range(len(x.tokens) - 1):
            lp[j, pos] = policy_logprob(x.tokens[: pos + 1], int(t.labels[j, pos]))
    rollout = torch.where(t.has_rollout & t.mask, t.rollout, lp)  # what forward_backward hands the losses
    _, stats = sample_loss_numerators(TokenLossInputs(
        logprobs=lp.requires_grad_(), mask=t.mask, losses=t.losses, advantage=torch.ones(len(samples)),
        rollout_logprobs=rollout, kl_coef=t.kl_coef, ref_logprobs=None, per_token_weight=t.weight))
    assert stats.tokens.sum() > 0
    assert torch.equal(stats.ratio_sum, stats.tokens), "the ratio exp(lp - q) is not 1 on the sampler's own tokens"
    assert stats.clipped.sum() == 0


def _sample(tokens: list[int], learned: set[int], with_logprobs: bool = True) -> TrainSample:
    mask = [int(i in learned) for i in range(len(tokens))]
    lps = [policy_logprob(tokens[:i], tok) if i in learned else 0.0 for i, tok in enumerate(tokens)]
    return TrainSample(slot=0, tokens=tokens, loss_mask=mask, advantage=1.0, rollout_logprobs=lps if with_logprobs else None)


def test_rows_put_the_log_prob_of_token_t_plus_1_at_position_t():
    samples = [
        _sample([5, 6, 7, 8, 9, 10, 11], {3, 4, 5, 6}),
        _sample([20, 21, 22], {2}),  # the shortest: padding after it
        _sample([30, 31, 32, 33, 34, 35, 36, 37, 38], {2, 3, 6, 7, 8}),  # a masked gap (environment tokens)
        _sample([40, 41, 42, 43], {2, 3}, with_logprobs=False),  # on-policy: no rollout log-probs
    ]
    t = _check_rows(samples)
    assert t.rollout[3].eq(0).all()
    _ratios_on_policy(samples, t)


class PolicyEngine:
    """Stand-in for the engine pool (no server in a unit test): answers each generate with what an
    SGLang server sends, in its wire format, for a deterministic sampler of ``policy_logprob``, and
    reads it with the real client parser (rollout/engines/client.py)."""

    def __init__(self) -> None:
        self.calls = 0

    def answer(self, context: list[int], length: int, prompt_logprobs_from: int = -1) -> dict:
        out: list[int] = []
        for k in range(length):
            out.append((7 * sum(context + out) + 3 * k + self.calls) % (VOCAB - 10) + 10)
        meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": len(context),
                "output_token_logprobs": [[policy_logprob(context + out[:k], tok), tok, None] for k, tok in enumerate(out)]}
        if prompt_logprobs_from >= 0:  # SGLang: from the start on; the first token has no context (None)
            meta["input_token_logprobs"] = [[None if i == 0 else policy_logprob(context[:i], context[i]), context[i], None]
                                            for i in range(prompt_logprobs_from, len(context))]
        return {"text": "", "output_ids": out, "meta_info": meta}

    async def generate_group(self, adapter: str, input_ids: list[int], params: dict, n: int) -> GroupGeneration:
        self.calls += 1
        length = 2 + self.calls % 3
        results = [parse_generate_response(f"{adapter}::{self.calls}-{i}", self.answer(input_ids, length))
                   for i in range(n)]
        return GroupGeneration(adapter=adapter, version=self.calls, engine=0, results=results)


class _Vocab:
    def __len__(self) -> int:
        return VOCAB


def test_the_client_keeps_each_log_prob_with_its_token():
    """SGLang's answer read by the client: the i-th log-prob is that of the i-th generated token, and
    the prompt's from the log-prob start on (None where a token has no context)."""
    context = [1, 2, 3, 4, 5]
    for start in (0, 2):
        r = parse_generate_response("a::1", PolicyEngine().answer(context, 4, prompt_logprobs_from=start))
        assert r.logprobs == [policy_logprob(context + r.token_ids[:k], tok) for k, tok in enumerate(r.token_ids)]
        want = [None if i == 0 else policy_logprob(context[:i], context[i]) for i in range(start, len(context))]
        assert r.prompt_logprobs == want


def test_rollout_log_probs_reach_the_rows_at_their_tokens():
    """Multi-turn and single-turn trajectories of one group, through the rollout context, the group
    and the loop's train samples: each model token's log-prob sits at that token's index of the
    sample (0.0 on the prompt and environment tokens, which are not learned), and the rows and the
    ratio are as the definition says."""
    prompt = [1, 2, 3, 4]
    ctx = RolloutContext(PolicyEngine(), "a", n=2, sampling=SamplingConfig(), tokenizer=_Vocab())

    async def rollouts() -> list[Trajectory]:
        multi = Trajectory(prompt_ids=prompt)
        multi.add_turn((await ctx.generate(prompt))[0])
        multi.add_observation([60, 61, 62])
        multi.add_turn((await ctx.generate(multi.tokens))[0])
        multi.add_observation([63])
        multi.add_turn((await ctx.generate(multi.tokens))[0])
        single = Trajectory(prompt_ids=prompt)
        single.add_turn((await ctx.generate(prompt))[0])
        multi.reward, single.reward = 1.0, 0.0
        return ctx.check([multi, single])

    trajectories = asyncio.run(rollouts())
    row = PromptRow(index=0, epoch=0, prompt="p", prompt_text="p", input_ids=prompt)
    samples, _ = rl_step(0, "r", [trajectory_group(trajectories, adapter="a", registration_id="r", row=row, prompt_text="p")])
    for traj, x in zip(trajectories, samples):
        model_tokens = set()
        at = len(prompt)
        for seg in traj.segments:
            if seg.source == "model":
                model_tokens.update(range(at, at + len(seg.token_ids)))
            at += len(seg.token_ids)
        assert x.tokens == traj.tokens and at == len(x.tokens)
        assert x.loss_mask == [int(i in model_tokens) for i in range(len(x.tokens))]
        want = [policy_logprob(x.tokens[:i], tok) if i in model_tokens else 0.0 for i, tok in enumerate(x.tokens)]
        assert x.rollout_logprobs == want, "a generated token's log-prob is not at that token's index"
    assert all(x.loss_mask[-1] == 1 for x in samples)  # both end on a model token
    t = _check_rows(samples)
    _ratios_on_policy(samples, t)

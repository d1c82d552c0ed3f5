"""Multi-turn rollouts (environments, tools, rollout functions) against a real SGLang CPU server (one for the module).

The proofs of issue 29, items 2, 3 and 5:
  * 3-turn trajectories: every token after the prompt is where the environment's own log puts it, the
    mask is 1 exactly on the model's tokens, and each model token's sampler log-probability equals
    HF+PEFT's teacher-forced one on the whole sequence (environment tokens included in the context);
  * the calculator environment (examples/tiny_agent) is called from the generated text and its result
    appended as environment tokens;
  * every turn's request carries the adapter's rid prefix, and aborting the adapter reaches the requests
    of later turns (and no turn starts after it);
  * a failing environment stops only its adapter, with the reason; time and token budgets hold;
  * an async rollout function works, and one that labels environment tokens as the model's is refused;
  * done-when: groups of the tool-using environment and of a single-turn adapter, from the engine, and SFT
    rows train in ONE mixed step of the real trainer; each slot matches the independent reference trainer
    (tests/reference/trainer.py, HF + peft) given samples rebuilt from the environment's log, and a
    reference that also learned the environment's tokens differs by far more than the tolerance.

Steadiness: waits on conditions with generous deadlines; no timings asserted."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
import torch

from rollout.config import RolloutConfig, RolloutSpec
from rollout.rewards import target_share
from rollout.engines.weights import AdapterWeights
from service.tenants.batches import rl_samples, rl_step
from tests.integration import envs_for_tests as envs
from tests.integration.rollout_world import record_aborts, record_requests, rollout_spec, started_worker, wait_for
from tests.integration.sglang_fixtures import make_peft_adapter, one_torch_thread, sglang_server_fixture
from tests.rollout_probes import adapter_of_rid

pytestmark = pytest.mark.integration

sglang_server = sglang_server_fixture()

ENVS = "tests.integration.envs_for_tests"
LOGPROB_TOL = 1e-5  # fp32 both sides, as test_logprob_parity.py
REL_TOL = 5e-5  # trainer vs the reference, as tests/reference/test_trainer_against_reference.py


def cfg(**over) -> RolloutConfig:
    return RolloutConfig(**{"max_inflight_per_adapter": 8, "max_inflight_total": 24, "max_buffered_groups_per_adapter": 2,
                            "rollout_import_roots": [ENVS], **over})


def env(name: str, **over) -> RolloutSpec:
    return RolloutSpec(name=f"{ENVS}:{name}", **over)


@pytest.fixture(scope="module")
def tokenizer(tiny_world):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_world / "model")


@pytest.fixture(scope="module")
def adapters(tiny_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("mt-adapters")
    return {k: make_peft_adapter(tiny_world / "model", root / k, seed=seed) for k, seed in (("a", 21), ("b", 22))}


def hf_teacher_forced(model_dir, adapter_dir, sequences: list[list[int]]) -> list[list[float]]:
    """log p(tokens[i] | tokens[:i]) for i >= 1 under HF+PEFT, per sequence."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir).eval()
    out = []
    with torch.no_grad(), one_torch_thread():
        for seq in sequences:
            logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            out.append([logp[i - 1, t].item() for i, t in enumerate(seq) if i > 0])
    return out


def from_log(episode: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(response tokens, mask) of a trajectory rebuilt from its environment's own log: each action's tokens
    (learned), then the observation it answered, tokenized by the HF tokenizer (not learned)."""
    ids, mask = [], []
    for i, action in enumerate(episode["actions"]):
        ids += action
        mask += [1] * len(action)
        if i < len(episode["actions"]) - 1:  # an observation after the last turn is never appended (the trajectory ended)
            obs = tokenizer(episode["observations"][i], add_special_tokens=False)["input_ids"]
            ids += obs
            mask += [0] * len(obs)
    return ids, mask


def matching_episode(sample, kind: str, tokenizer) -> dict:
    found = [e for e in envs.EPISODES if e["kind"] == kind and from_log(e, tokenizer)[0] == sample.response_ids]
    assert len(found) == 1, f"{len(found)} {kind} episodes give this sample's tokens"
    return found[0]


# --- 3 turns: mask and log-probabilities ---------------------------------------------------------


def test_three_turn_trajectories_match_the_environment_log_and_hf(sglang_server, adapters, tiny_world, tokenizer):
    envs.EPISODES.clear()

    async def run():
        async with started_worker(sglang_server, cfg(), tiny_world, ["mt", "mta", "calc"]) as worker:
            log = record_requests(worker.pool.client(0))
            await worker.add_adapter(rollout_spec(tiny_world, "mt", "digits", "reg-mt", max_new_tokens=8, rollout=env("ThreeTurns")),
                                     AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "mta", "vowels", "reg-mta", max_new_tokens=8,
                                                  rollout=env("AsyncThreeTurns", kwargs={"note": "fine"})),
                                     AdapterWeights.from_folder(adapters["a"]))
            # the example's calculator, calling on any digit (so that calls happen with an untrained adapter)
            await worker.add_adapter(rollout_spec(tiny_world, "calc", "digits", "reg-calc", max_new_tokens=8,
                                                  rollout=env("LoggedCalculator", kwargs={"call_share": 0.01}, max_turns=3)),
                                     AdapterWeights.from_folder(adapters["b"]))
            names = ("mt", "mta", "calc")
            await wait_for(lambda: all(worker.core.stats(n).buffered_groups >= 2 for n in names), 300, "2 groups of each adapter")
            groups = {n: await worker.pop_groups(n, 2) for n in names}
            return groups, {n: worker.core.stats(n) for n in names}, list(log)

    groups, stats, log = asyncio.run(run())
    assert all(s.groups_dropped_error == 0 and s.last_error is None for s in stats.values()), stats
    rids = {e["rid"] for e in log}
    checked_tokens = 0
    sequences, expected = [], []
    for name, kind, note in (("mt", "three_turns", "ok"), ("mta", "async_three_turns", "fine")):
        for g in groups[name]:
            assert (g.adapter, g.version, len(g.samples)) == (name, 0, 4)
            for s in g.samples:
                episode = matching_episode(s, kind, tokenizer)
                ids, mask = from_log(episode, tokenizer)
                assert s.response_mask == mask and s.turns == 3 and len(episode["actions"]) == 3
                assert episode["observations"] == [f"\n<|system|>{note} 1\n<|assistant|>", f"\n<|system|>{note} 2\n<|assistant|>"]
                assert s.reward == pytest.approx(sum(episode["rewards"])) and episode["rewards"][:2] == [0.1, 0.1]
                assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask) if not m)
                # every turn went to the engine as a request of this adapter (its rid prefix), from the whole context so far
                full = [*g.prompt_ids, *s.response_ids]
                starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
                assert len(starts) == 3
                for k, start in enumerate(starts):
                    context = full[: len(g.prompt_ids) + start]
                    assert any(adapter_of_rid(e["rid"]) == name and e["input_ids"] == context for e in log), (name, k)
                train = rl_samples(0, g.registration_id, g)[g.samples.index(s)]
                assert train.tokens == full and train.loss_mask == [0] * len(g.prompt_ids) + mask
                assert train.rollout_logprobs == [0.0] * len(g.prompt_ids) + s.logprobs
                sequences.append(full)
                expected.append((len(g.prompt_ids), mask, s.logprobs))
                checked_tokens += sum(mask)
    assert {adapter_of_rid(r) for r in rids} == {"mt", "mta", "calc"}  # each a '<adapter>::<32 hex>' request id
    ref = hf_teacher_forced(tiny_world / "model", adapters["a"], sequences)
    worst = 0.0
    for (n_prompt, mask, got), want in zip(expected, ref):
        for i, m in enumerate(mask):
            if m:  # want[j] is log p(seq[j + 1]); response token i is seq[n_prompt + i]
                worst = max(worst, abs(got[i] - want[n_prompt + i - 1]))
    assert worst <= LOGPROB_TOL, worst
    print(f"\n{checked_tokens} model tokens of {len(sequences)} 3-turn trajectories: worst |SGLang - HF+PEFT| {worst:.2e}")

    # The calculator: called from the generated text, its result appended as environment tokens.
    calls = 0
    for g in groups["calc"]:
        for s in g.samples:
            episode = matching_episode(s, "calculator", tokenizer)
            for i, obs in enumerate(episode["observations"]):
                if obs.startswith("\n<|system|>= "):
                    numbers = [int(x) for x in re.findall(r"\d+", tokenizer.decode(episode["actions"][i]))]
                    assert obs == f"\n<|system|>= {sum(numbers[:16])}\n<|assistant|>"
                    calls += 1
            assert s.response_mask == from_log(episode, tokenizer)[1]
    assert calls > 0, "no trajectory called the calculator: the test proved nothing"


# --- abort, failures, budgets --------------------------------------------------------------------


def test_abort_by_prefix_reaches_an_agents_later_turns(sglang_server, adapters, tiny_world):
    """Two agents: one with its later turns in flight, one held between turns (its environment stepping,
    nothing in flight). Aborting each reaches the requests of its later turns, and the held one never
    starts another turn; a single-turn adapter beside them goes on."""
    envs.STEPS.clear()

    async def run():
        envs.GATE = asyncio.Event()
        async with started_worker(sglang_server, cfg(max_buffered_groups_per_adapter=64), tiny_world,
                                  ["agent", "held", "plain"]) as worker:
            log = record_requests(worker.pool.client(0))
            aborts = record_aborts(worker.pool.client(0))
            await worker.add_adapter(rollout_spec(tiny_world, "agent", "digits", "reg-ag", max_new_tokens=300, ignore_eos=True,
                                                  rollout=env("ThreeTurns", max_tokens=512)), AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "held", "digits", "reg-he", max_new_tokens=4, rollout=env("GatedTurns")),
                                     AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "plain", "vowels", "reg-pl", max_new_tokens=8),
                                     AdapterWeights.from_folder(adapters["b"]))

            def sent(name):
                return [e for e in log if e["rid"].startswith(f"{name}::")]

            def later_turns_in_flight():  # a request whose context holds a whole 300-token turn
                return [e for e in sent("agent") if len(e["input_ids"]) > 300 and e["finish_reason"] is None]

            await wait_for(later_turns_in_flight, 300, "a later turn of the agent in flight")
            in_flight = later_turns_in_flight()
            agent_in_flight = [e for e in sent("agent") if e["finish_reason"] is None]  # any turn
            count = await worker.abort_adapter("agent", pause=True)
            await wait_for(lambda: worker.core.stats("agent").inflight_groups == 0, 120, "the agent's groups to end")

            # the held agent: every started trajectory waits in its step, nothing of it in flight
            await wait_for(lambda: worker.core.stats("held").inflight_groups >= 1 and worker.pool.inflight("held") == 0
                           and ("gated", 1) in envs.STEPS, 120, "the held agent between turns")
            held_sent = len(sent("held"))
            held_count = await worker.abort_adapter("held", pause=True)
            envs.GATE.set()  # its steps return: the next turns would start now
            await wait_for(lambda: worker.core.stats("held").inflight_groups == 0, 120, "the held agent's groups to end")

            # make room first: the plain adapter may have filled its buffer (64 groups) while the agent's
            # 300-token turns ran (a loaded machine: CI saw "2 more plain groups" time out that way)
            await worker.pop_groups("plain", 10**6)
            plain_before = worker.core.stats("plain").groups_completed
            await wait_for(lambda: worker.core.stats("plain").groups_completed >= plain_before + 2, 120, "2 more plain groups")
            stats = {n: worker.core.stats(n) for n in ("agent", "held")}
            return (count, in_flight, agent_in_flight, stats, list(aborts), held_sent, held_count, len(sent("held")),
                    len(sent("agent")), len(log))

    (count, in_flight, agent_in_flight, stats, aborts, held_sent, held_count, held_sent_after, agent_sent,
     _) = asyncio.run(run())
    # The abort reached the later turns in flight: each got an abort of its exact rid (a stock server has no
    # prefix abort). The engine ended them (or had just finished them: the pool reports them aborted anyway),
    # or, once a sibling trajectory was aborted, the worker cancelled them and aborted them on the engine too.
    assert in_flight and count >= len(in_flight) and {e["rid"] for e in in_flight} <= set(aborts)
    allowed = {"abort", "length", "raised CancelledError"}
    ended = [e["finish_reason"] for e in in_flight]
    assert set(ended) <= allowed, ended
    # The engine itself ended some request of the agent with "abort": a cancellation only follows a
    # sibling's abort, so the first of them to end came from the engine. That request may be of any turn
    # (CI saw the one later turn in flight cancelled after its sibling's first turn was aborted).
    ended_any = [e["finish_reason"] for e in agent_in_flight]
    assert set(ended_any) <= allowed and "abort" in ended_any, ended_any
    # Held between turns: nothing was in flight to abort, and no turn started after the abort.
    assert held_count == 0 and held_sent_after == held_sent
    for s in stats.values():
        assert s.groups_aborted >= 1 and s.groups_completed == 0 and s.buffered_groups == 0
        assert s.data.consumed == 0 and s.groups_requeued == s.groups_aborted  # their prompts come back


def test_a_failing_environment_stops_only_its_adapter_with_the_reason(sglang_server, adapters, tiny_world):
    async def run():
        async with started_worker(sglang_server, cfg(max_buffered_groups_per_adapter=64), tiny_world, ["broken", "tuple", "fine"]) as worker:
            await worker.add_adapter(rollout_spec(tiny_world, "broken", "digits", "reg-br", max_new_tokens=4,
                                                  rollout=env("Broken", max_failures_in_a_row=3)), AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "tuple", "digits", "reg-tu", max_new_tokens=4,
                                                  rollout=env("WrongStep", max_failures_in_a_row=2)), AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "fine", "vowels", "reg-fi", max_new_tokens=8),
                                     AdapterWeights.from_folder(adapters["b"]))
            await wait_for(lambda: all(worker.core.stats(n).fatal_reason for n in ("broken", "tuple")), 180, "both to stop")
            before = worker.core.stats("fine").groups_completed
            await wait_for(lambda: worker.core.stats("fine").groups_completed >= before + 2, 120, "2 more groups of the fine adapter")
            return {n: worker.core.stats(n) for n in ("broken", "tuple", "fine")}

    stats = asyncio.run(run())
    broken, wrong, fine = stats["broken"], stats["tuple"], stats["fine"]
    assert broken.fatal_reason.startswith("its rollout failed on 3 groups in a row; last: rollout "
                                          f"{ENVS}:Broken failed: RuntimeError: environment crashed (on purpose, for the test)")
    assert "step must return rollout.environment.StepResult, got tuple" in wrong.fatal_reason
    for s in (broken, wrong):
        assert s.groups_dropped_error >= (3 if s is broken else 2) and s.groups_completed == 0 and s.buffered_groups == 0
        assert s.data.consumed == 0 and s.groups_requeued == 0  # dropped, never re-served
    assert fine.fatal_reason is None and fine.groups_dropped_error == 0


def test_time_and_token_budgets_bound_every_trajectory(sglang_server, adapters, tiny_world):
    async def run():
        async with started_worker(sglang_server, cfg(), tiny_world, ["sleepy", "longgen", "turns", "tokens"]) as worker:
            log = record_requests(worker.pool.client(0))
            aborts = record_aborts(worker.pool.client(0))
            w = AdapterWeights.from_folder(adapters["a"])
            await worker.add_adapter(rollout_spec(tiny_world, "sleepy", "digits", "reg-sl", max_new_tokens=4,
                                                  rollout=env("Sleepy", kwargs={"seconds": 8}, timeout_s=1.5)), w)
            await worker.add_adapter(rollout_spec(tiny_world, "longgen", "digits", "reg-lg", max_new_tokens=400, ignore_eos=True,
                                                  rollout=env("ThreeTurns", timeout_s=1.0, max_failures_in_a_row=1000)), w)
            await worker.add_adapter(rollout_spec(tiny_world, "turns", "digits", "reg-tn", max_new_tokens=4,
                                                  rollout=env("Chatty", max_turns=4)), w)
            await worker.add_adapter(rollout_spec(tiny_world, "tokens", "digits", "reg-tk", max_new_tokens=6, ignore_eos=True,
                                                  rollout=env("Chatty", max_turns=100, max_tokens=60)), w)
            await wait_for(lambda: worker.core.stats("sleepy").groups_dropped_timeout >= 1
                           and worker.core.stats("longgen").groups_dropped_timeout >= 1
                           and all(worker.core.stats(n).buffered_groups >= 1 for n in ("turns", "tokens")), 240, "budgets to act")
            out = {n: worker.core.stats(n) for n in ("sleepy", "longgen", "turns", "tokens")}
            groups = {n: await worker.pop_groups(n, 1) for n in ("turns", "tokens")}
            # A group cut by its time budget in mid-generation does not leave its requests running on the
            # engine: each gets an abort of its exact rid (test_rollout_sglang.py proves those end them).
            cut = [e["rid"] for e in log if e["rid"].startswith("longgen::") and e["finish_reason"] is None][:4]
            await wait_for(lambda: set(cut) <= set(aborts), 60, "aborts of the timed-out group's requests")
            return out, groups, list(log), cut

    stats, groups, log, cut = asyncio.run(run())
    assert "ran past its time budget of 1.5 s (rollout.timeout_s)" in stats["sleepy"].last_error
    assert stats["longgen"].groups_dropped_timeout >= 1 and stats["longgen"].groups_completed == 0 and len(cut) == 4
    for s in groups["turns"][0].samples:  # never done: ended by max_turns, trained on with its rewards
        assert s.turns == 4 and s.finish_reason == "truncated" and s.reward == 4.0
    g = groups["tokens"][0]
    for s in g.samples:  # ended by the token budget: the context never grows past 60 tokens
        assert s.finish_reason == "truncated" and len(g.prompt_ids) + len(s.response_ids) <= 60
    for e in log:
        if e["rid"].startswith("tokens::"):
            assert len(e["input_ids"]) + e["max_new_tokens"] <= 60
    assert stats["tokens"].trajectories_truncated >= 4 and stats["turns"].trajectories_truncated >= 4


def test_a_rollout_function_and_what_it_may_not_claim(sglang_server, adapters, tiny_world, tokenizer):
    async def run():
        async with started_worker(sglang_server, cfg(), tiny_world, ["fn", "forger"]) as worker:
            await worker.add_adapter(rollout_spec(tiny_world, "fn", "digits", "reg-fn", max_new_tokens=6, rollout=env("two_tries")),
                                     AdapterWeights.from_folder(adapters["a"]))
            await worker.add_adapter(rollout_spec(tiny_world, "forger", "digits", "reg-fo", max_new_tokens=6,
                                                  rollout=env("claims_env_tokens", max_failures_in_a_row=2)),
                                     AdapterWeights.from_folder(adapters["a"]))
            await wait_for(lambda: worker.core.stats("fn").buffered_groups >= 1 and worker.core.stats("forger").fatal_reason, 180,
                           "a function group and the forger stopped")
            return await worker.pop_groups("fn", 1), worker.core.stats("forger")

    groups, forger = asyncio.run(run())
    hint_text = "\n<|user|>again\n<|assistant|>"
    hint = tokenizer(hint_text, add_special_tokens=False)["input_ids"]
    for s in groups[0].samples:
        i = s.response_mask.index(0)
        assert s.turns == 2 and s.response_ids[i : i + len(hint)] == hint and s.response_mask[i : i + len(hint)] == [0] * len(hint)
        assert s.reward == pytest.approx(target_share(s.response_text.rsplit(hint_text, 1)[1], "0123456789"))
    assert "a model segment is not a generation of this group" in forger.fatal_reason and forger.groups_completed == 0


# --- done when: one mixed step beside a single-turn and an SFT run, against the reference ---------------


def test_a_tool_using_run_trains_beside_single_turn_and_sft_in_one_mixed_step(sglang_server, tiny_world, tokenizer, tmp_path):
    from rollout.config import DataConfig
    from service.tenants.sft_source import SftSource
    from tests.reference.trainer import ReferenceAdapter
    from trainer.batch import TrainBatch, TrainSample
    from trainer.config import SlotHyperParams, TrainerConfig
    from trainer.core import MultiLoraTrainer

    envs.EPISODES.clear()
    hyper = dict(rank=8, alpha=16, lr=1e-2, eps=1e-2, samples_per_step=4, max_grad_norm=None)
    hypers = {0: SlotHyperParams(objective="rl", **hyper), 1: SlotHyperParams(objective="rl", **hyper),
              2: SlotHyperParams(objective="sft", **hyper)}
    regs = {0: "reg-tool", 1: "reg-single", 2: "reg-sft"}
    trainer = MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=3, max_rank=8, dtype="float32"))
    served = {}
    for slot in hypers:  # fresh slots (B = 0: the served adapter is the base), as a new run starts
        trainer.init_slot(slot, hypers[slot], seed=slot + 1, registration=regs[slot])
        served[slot] = AdapterWeights.from_folder(trainer.export.export_peft(slot, tmp_path / f"slot{slot}"))
    inits = {slot: trainer.export.peft_tensors(slot)[1] for slot in hypers}

    async def run():
        async with started_worker(sglang_server, cfg(), tiny_world, ["tool", "single"]) as worker:
            await worker.add_adapter(rollout_spec(tiny_world, "tool", "digits", "reg-tool", max_new_tokens=8,
                                                  rollout=env("LoggedCalculator", kwargs={"call_share": 0.01}, max_turns=3)),
                                     served[0])
            await worker.add_adapter(rollout_spec(tiny_world, "single", "vowels", "reg-single", max_new_tokens=8), served[1])

            def called(group) -> bool:  # the environment's own log: a tool result was appended in one of its trajectories
                return any(obs.startswith("\n<|system|>= ") for s in group.samples
                           for obs in matching_episode(s, "calculator", tokenizer)["observations"])

            async def a_tool_group_with_a_call():
                staged.extend(await worker.pop_groups("tool", 1))
                return any(called(g) for g in staged)

            staged: list = []
            await wait_for(a_tool_group_with_a_call, 300, "a tool group with a calculator call")
            await wait_for(lambda: worker.core.stats("single").buffered_groups >= 1, 120, "a single-turn group")
            return next(g for g in staged if called(g)), (await worker.pop_groups("single", 1))[0]

    tool_group, single_group = asyncio.run(run())
    tool_samples, tool_plan = rl_step(0, regs[0], [tool_group])
    single_samples, _ = rl_step(1, regs[1], [single_group])
    sft = SftSource(DataConfig(path=str(tiny_world / "data" / "kinds_sft.jsonl"), label_key="completion", shuffle_seed=0),
                    tokenizer, slot=2, registration_id=regs[2], samples_per_step=4)
    _, sft_samples = sft.take_step()
    batch = tool_samples + single_samples + sft_samples
    random.Random(0).shuffle(batch)  # adapters interleaved on the wire
    result = trainer.train(TrainBatch(samples=batch))  # ONE mixed step of the three runs
    assert sorted(result.slots) == [0, 1, 2] and all(len(result.slots[s].steps) == 1 for s in hypers)

    # The reference sees the tool run's samples as the environment's log says they are: prompt, then each
    # action (learned) and each tool result (in the context, not learned); the sampler's log-probabilities
    # as the old policy's.
    def rebuilt(group, learn_env: bool = False) -> list[TrainSample]:
        out = []
        for s in group.samples:
            episode = matching_episode(s, "calculator", tokenizer)
            ids, mask = from_log(episode, tokenizer)
            mask = [1] * len(ids) if learn_env else mask
            n = len(group.prompt_ids)
            out.append(TrainSample(slot=0, tokens=[*group.prompt_ids, *ids], loss_mask=[0] * n + mask, advantage=s.advantage,
                                   rollout_logprobs=[0.0] * n + list(s.logprobs), registration=regs[0]))
        return out

    own = {0: rebuilt(tool_group), 1: single_samples, 2: sft_samples}
    worst = 0.0
    for slot, samples in own.items():
        ref = ReferenceAdapter(tiny_world / "model", hypers[slot], inits[slot])
        with one_torch_thread():
            report = ref.step(samples)
        ours = result.slots[slot].steps[-1]
        for key, got, want in (("loss", ours.loss, report["loss"]), ("grad_norm", ours.grad_norm, report["grad_norm"])):
            # relative, and absolute below 1: an RL step's loss at ratio 1 is -mean(advantage) = 0 up to rounding
            err = abs(got - want) / max(abs(want), 1.0)
            worst = max(worst, err)
            assert err <= REL_TOL, (slot, key, got, want)
        weights = trainer.export.peft_tensors(slot)[1]
        for name, w in ref.state().items():
            err = ((weights[name] - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
            worst = max(worst, err)
            assert err <= REL_TOL, (slot, name, err)
    # The control: had the loss also seen the environment's tokens, it would differ far beyond the tolerance.
    wrong = ReferenceAdapter(tiny_world / "model", hypers[0], inits[0])
    with one_torch_thread():
        wrong_report = wrong.step(rebuilt(tool_group, learn_env=True))
    ours = result.slots[0].steps[-1]
    assert abs(ours.grad_norm - wrong_report["grad_norm"]) > 100 * REL_TOL * abs(wrong_report["grad_norm"]), wrong_report
    assert tool_plan.metrics["env_token_share"] > 0
    print(f"\none mixed step (tool {len(tool_samples)}, single-turn {len(single_samples)}, sft {len(sft_samples)} samples): "
          f"worst relative error vs the reference {worst:.2e}; env tokens {tool_plan.metrics['env_token_share']:.0%} of the "
          f"tool run's response; the env-learning control's grad norm {wrong_report['grad_norm']:.4g} vs ours {ours.grad_norm:.4g}")

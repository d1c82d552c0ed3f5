"""Trajectories, the rollout interface's resolution and checks, and multi-turn samples as train samples.

No server here: the engine side of multi-turn rollouts (real SGLang, HF reference) is
tests/integration/test_rollout_multiturn.py."""

from __future__ import annotations

import pytest

from rollout.config import RolloutSpec, SamplingConfig
from rollout.context import InvalidRollout, RolloutContext
from rollout.groups import RolloutGroup, Sample
from rollout.rollouts import RolloutLoadError, load_rollout, single_turn
from rollout.trajectory import Generation, Trajectory
from service.tenants.batches import rl_samples, rl_step

ROOT = "tests.integration.envs_for_tests"


def gen(rid: str, ids, lps=None, version: int = 3, text: str = "") -> Generation:
    return Generation(rid, tuple(ids), tuple(lps or [-0.5] * len(ids)), text, "stop", version)


def three_turns() -> Trajectory:
    t = Trajectory(prompt_ids=[1, 2, 3])
    t.add_turn(gen("a::1", [10, 11], [-0.1, -0.2], version=3, text="ab"))
    t.add_observation([50, 51, 52], "<obs>")
    t.add_turn(gen("a::2", [12], [-0.3], version=5, text="c"))
    t.add_observation([53], "!")
    t.add_turn(gen("a::3", [13, 14], [-0.4, -0.5], version=7, text="de"))
    return t


def test_a_flattened_trajectory_learns_only_model_tokens_with_their_logprobs():
    t = three_turns()
    f = t.flat()
    assert f.response_ids == [10, 11, 50, 51, 52, 12, 53, 13, 14]
    assert f.response_mask == [1, 1, 0, 0, 0, 1, 0, 1, 1]
    assert f.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert f.text == "ab<obs>c!de"
    assert t.tokens == [1, 2, 3, *f.response_ids]
    assert (t.turns, t.version, t.finish_reason) == (3, 3, "stop")  # the version of its first turn
    t.truncated = True
    assert t.finish_reason == "truncated"
    t.add_observation([])  # nothing to append: no empty segment
    assert len(t.segments) == 5


def test_multi_turn_samples_become_train_samples_with_the_environment_masked():
    f = three_turns().flat()
    group = RolloutGroup(adapter="a", registration_id="r", version=3, prompt_index=0, epoch=0, prompt_text="p",
                         prompt_ids=[1, 2, 3], samples=[
                             Sample(response_ids=f.response_ids, response_text=f.text, logprobs=f.logprobs, finish_reason="stop",
                                    reward=1.0, advantage=0.5, response_mask=f.response_mask, turns=3, version=3),
                             Sample(response_ids=[20, 21], response_text="x", logprobs=[-1.0, -2.0], finish_reason="stop",
                                    reward=0.0, advantage=-0.5)])
    multi, single = rl_samples(2, "r", group)
    assert multi.tokens == [1, 2, 3, 10, 11, 50, 51, 52, 12, 53, 13, 14]
    assert multi.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1]
    assert multi.rollout_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert single.loss_mask == [0, 0, 0, 1, 1] and single.rollout_logprobs == [0.0, 0.0, 0.0, -1.0, -2.0]
    _, plan = rl_step(2, "r", [group])
    assert plan.metrics == {"turns_mean": 2.0, "env_token_share": 4 / 11}
    with pytest.raises(ValueError, match="one entry per response token"):
        Sample(response_ids=[1, 2], response_text="", logprobs=[-1.0, -1.0], finish_reason="stop", reward=0.0,
               response_mask=[1])


def test_trajectory_problems():
    t = Trajectory(prompt_ids=[1])
    assert "no model turn" in t.problem()
    t.add_turn(gen("a::1", [5]))
    assert t.problem(vocab_size=10) is None
    t.add_observation([12])
    assert "outside the vocabulary (0..9): [12]" in t.problem(vocab_size=10)
    t.reward = float("nan")
    assert "finite number" in t.problem()
    assert "prompt is empty" in Trajectory(prompt_ids=[]).problem()


@pytest.mark.parametrize("name, kind", [(f"{ROOT}:ThreeTurns", "environment"), (f"{ROOT}:AsyncThreeTurns", "environment"),
                                        (f"{ROOT}:two_tries", "function"), ("single_turn", "builtin")])
def test_rollouts_resolve_by_kind(name, kind):
    loaded = load_rollout(RolloutSpec(name=name), [ROOT])
    assert loaded.kind == kind and loaded.custom == (kind != "builtin")
    assert load_rollout(None).run is single_turn and not load_rollout(None).custom


@pytest.mark.parametrize(
    "spec, roots, field, message",
    [
        (dict(name="nope"), [ROOT], "name", "unknown built-in rollout 'nope'; built-ins: ['single_turn']"),
        (dict(name="os:system"), [ROOT], "name", "custom rollout module 'os' is not under an allowed rollout import root"),
        (dict(name=f"{ROOT}:ThreeTurns"), [], "name", "allowed: none configured (set LORAFLEET_ROLLOUT_IMPORT_ROOTS)"),
        (dict(name=f"{ROOT}_other:ThreeTurns"), [ROOT], "name", "is not under an allowed rollout import root"),
        (dict(name=f"{ROOT}.missing:Env"), [ROOT], "name", f"cannot import rollout module '{ROOT}.missing': ModuleNotFoundError"),
        (dict(name=f"{ROOT}:Nothing"), [ROOT], "name", "has no environment class (with reset and step) or async rollout function 'Nothing'"),
        (dict(name=f"{ROOT}:not_a_rollout"), [ROOT], "name", "'not_a_rollout' in rollout module '" + ROOT + "' is neither an environment class"),
        (dict(name=f"{ROOT}:EPISODES"), [ROOT], "name", "is neither an environment class"),
        (dict(name=f"{ROOT}:ThreeTurns", kwargs={"colour": "red"}), [ROOT], "kwargs", "the kwargs do not fit the environment 'ThreeTurns'"),
        (dict(name=f"{ROOT}:two_tries", kwargs={"tries": 3}), [ROOT], "kwargs", "the kwargs do not fit the rollout function 'two_tries'"),
        (dict(name="single_turn", kwargs={"x": 1}), [ROOT], "kwargs", "the built-in rollout 'single_turn' takes no kwargs"),
    ],
)
def test_rollout_refusals_say_what_is_allowed(spec, roots, field, message):
    with pytest.raises(RolloutLoadError) as e:
        load_rollout(RolloutSpec(**spec), roots)
    assert message in str(e.value) and e.value.field == field


def test_a_refused_module_is_never_imported():
    import sys

    assert "tests.integration.envs_never_imported" not in sys.modules
    with pytest.raises(RolloutLoadError, match="not under an allowed rollout import root"):
        load_rollout(RolloutSpec(name="tests.integration.envs_never_imported:Env"), ["examples"])
    assert "tests.integration.envs_never_imported" not in sys.modules


class _Tok:
    def __len__(self) -> int:
        return 100


def test_the_context_refuses_trajectories_it_did_not_generate():
    ctx = RolloutContext(None, "a", n=2, sampling=SamplingConfig(), tokenizer=_Tok())
    g1, g2 = gen("a::1", [5, 6]), gen("a::2", [7])
    ctx.generated = {g.rid: g for g in (g1, g2)}

    def traj(g, prompt=(1, 2)):
        t = Trajectory(prompt_ids=list(prompt))
        t.add_turn(g)
        return t

    assert len(ctx.check([traj(g1), traj(g2)])) == 2
    refusals = [
        ([traj(g1)], "must return n_samples_per_prompt = 2 trajectories, got 1"),
        ((traj(g1), "x"), "must return a list of rollout.trajectory.Trajectory, got tuple of ['Trajectory', 'str']"),
        ([traj(g1), traj(g2, prompt=(1, 3))], "must share one prompt"),
        ([traj(g1), traj(gen("a::2", [8]))], "trajectory 1: a model segment is not a generation of this group"),
        ([traj(g1), traj(gen("a::9", [7]))], "trajectory 1: a model segment is not a generation of this group"),
        ([traj(g1), traj(gen("a::2", [7], [-0.9]))], "not a generation of this group"),  # its log-probabilities forged
    ]
    for trajectories, message in refusals:
        with pytest.raises(InvalidRollout, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
            ctx.check(trajectories)



def test_a_group_of_trajectories_is_as_old_as_its_oldest_first_turn():
    """Staleness per trajectory: the group's version is the oldest first turn among its trajectories (later turns
    may come from newer weights); advantages are group-relative over each trajectory's summed reward."""
    from rollout.data import PromptRow
    from rollout.groups import trajectory_group

    row = PromptRow(index=3, epoch=1, prompt="p", prompt_text="<p>", input_ids=[1, 2, 3], label="L", metadata={"k": 1})
    a = three_turns()  # first turn v3, later turns v5, v7
    a.reward = 0.1 + 0.1 + 0.8
    b = Trajectory(prompt_ids=[1, 2, 3], reward=0.0)
    b.add_turn(gen("a::9", [30], version=4))
    g = trajectory_group([a, b], adapter="a", registration_id="r", row=row, prompt_text="<p>", engine=2)
    assert (g.version, g.prompt_index, g.epoch, g.label, g.engine, g.row) == (3, 3, 1, "L", 2, row)
    assert [s.version for s in g.samples] == [3, 4] and [s.turns for s in g.samples] == [3, 1]
    assert g.samples[0].response_mask == [1, 1, 0, 0, 0, 1, 0, 1, 1] and g.samples[1].response_mask is None  # single turn: all learned
    assert g.samples[0].advantage == pytest.approx(1.0, abs=1e-5) and g.samples[1].advantage == pytest.approx(-1.0, abs=1e-5)
    assert g.samples[0].reward == pytest.approx(1.0)

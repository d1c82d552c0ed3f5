"""service.loop.tb_log: TensorBoard event files per adapter run, read back with TensorBoard's own
EventAccumulator, holding exactly the series the registry (and so GET .../metrics) holds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.config.adapter import AdapterConfig
from service.loop.fleet_stats import FleetStats
from service.registry.registry import AdapterState, Registry
from service.loop.tb_log import FLEET_RUN, TrainingLog, run_dir, tensorboard_dir

pytestmark = pytest.mark.unit

CONFIG = AdapterConfig(data={"path": "x.jsonl"}, reward={"name": "target_share"}, num_step=50)


def read_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    # tensorboard.summary.Writer stores scalars as tensor summaries (the scalars plugin's format)
    return {tag: [(e.step, _value(e)) for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def _value(event) -> float:
    from tensorboard.util import tensor_util

    return float(tensor_util.make_ndarray(event.tensor_proto))


def finish_run(tlog: TrainingLog, name: str, registration_id: str) -> None:
    """Close one run's writers, as when it ended (COMPLETED or FAILED); a later step would open them again."""
    key = (name, registration_id)
    with tlog._lock:  # noqa: SLF001 - the log's one lock over its writers
        writer = tlog._writers.pop(key, None)  # noqa: SLF001
        if writer is not None:
            writer.close()
        run = tlog._wandb_runs.pop(key, None)  # noqa: SLF001
        if run is not None:
            run.finish()


@pytest.fixture
def registry(tmp_path):
    reg = Registry(tmp_path / "registry.sqlite3", num_slots=4)
    yield reg
    reg.close()


def active_run(registry: Registry, name: str) -> str:
    rid = registry.register(name, CONFIG, total_steps=50).registration_id
    registry.transition(rid, AdapterState.ACTIVE)
    return rid


def train_steps(registry, tlog, name, rid, steps, seed):
    """Commit steps to the registry and log what was committed, as the loop does."""
    rng = np.random.default_rng(seed)
    for step in steps:
        metrics = {"loss": float(rng.uniform(1, 4)), "learning_rate": 0.003 * min(1.0, step / 3), "grad_norm": float(rng.uniform(0, 2))}
        if name != "sft":
            metrics |= {"reward_mean": float(rng.uniform(0, 1)), "staleness_mean": float(rng.integers(0, 2))}
        registry.record_step(rid, step=step, samples=8, metrics=metrics)
        assert tlog.log_step(name, rid, step, metrics, samples=8)


def test_event_files_hold_the_registry_series_per_run(tmp_path, registry):
    with TrainingLog(tmp_path, use_wandb=False) as tlog:
        runs = {"digits": active_run(registry, "digits"), "sft": active_run(registry, "sft")}
        for i, (name, rid) in enumerate(runs.items()):
            train_steps(registry, tlog, name, rid, range(1, 7), seed=i)
    for name, rid in runs.items():
        _, series = registry.metrics(name)  # what GET /v1/adapters/{name}/metrics serves
        scalars = read_scalars(run_dir(tmp_path, name, rid))
        expected_tags = set(series[0].metrics) | {"samples"}
        assert set(scalars) == expected_tags, name
        for tag in series[0].metrics:
            assert [s for s, _ in scalars[tag]] == [r.step for r in series]
            np.testing.assert_array_equal([v for _, v in scalars[tag]], np.float32([r.metrics[tag] for r in series]))
        assert [v for _, v in scalars["samples"]] == [8.0] * len(series)
    assert sorted(p.name for p in tensorboard_dir(tmp_path).iterdir()) == ["digits", "sft"]


def test_a_re_registered_name_gets_a_run_folder_of_its_own(tmp_path, registry):
    with TrainingLog(tmp_path, use_wandb=False) as tlog:
        first = active_run(registry, "a")
        train_steps(registry, tlog, "a", first, [1, 2], seed=0)
        registry.transition(first, AdapterState.RETIRING)
        registry.transition(first, AdapterState.CLEANUP)
        registry.transition(first, AdapterState.COMPLETED)
        finish_run(tlog, "a", first)
        second = active_run(registry, "a")
        train_steps(registry, tlog, "a", second, [1, 2, 3], seed=1)
    assert first[:8] != second[:8]
    assert [s for s, _ in read_scalars(run_dir(tmp_path, "a", first))["loss"]] == [1, 2]
    assert [s for s, _ in read_scalars(run_dir(tmp_path, "a", second))["loss"]] == [1, 2, 3]


def test_replayed_and_non_finite_values_are_not_written(tmp_path):
    with TrainingLog(tmp_path, use_wandb=False) as tlog:
        assert tlog.log_step("a", "r" * 32, 1, {"loss": 2.0}, samples=4)
        assert tlog.log_step("a", "r" * 32, 2, {"loss": math.nan, "grad_norm": math.inf, "reward_mean": 0.5}, samples=4)
        assert not tlog.log_step("a", "r" * 32, 2, {"loss": 9.0}, samples=4)  # step 2 again (a replay)
        assert not tlog.log_step("a", "r" * 32, 1, {"loss": 9.0}, samples=4)
    assert not tlog.log_step("a", "r" * 32, 3, {"loss": 1.0}, samples=4)  # closed
    scalars = read_scalars(run_dir(tmp_path, "a", "r" * 32))
    assert scalars["loss"] == [(1, 2.0)]
    assert scalars["reward_mean"] == [(2, 0.5)] and "grad_norm" not in scalars


def test_fleet_rounds_are_written_under_their_own_run(tmp_path):
    stats = FleetStats()
    with TrainingLog(tmp_path, use_wandb=False) as tlog:
        for i in range(3):
            tlog.log_round(stats.record_round(collect_s=1.0 + i, train_s=0.5, steps=2, samples=16, rollout_tokens=10 * i))
    scalars = read_scalars(tensorboard_dir(tmp_path) / FLEET_RUN)
    assert scalars["round/collect_s"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert scalars["round/rollout_tokens"] == [(1, 0.0), (2, 10.0), (3, 20.0)]
    assert {"round/train_s", "round/publish_s", "round/checkpoint_s", "round/steps", "round/trained_tokens"} <= set(scalars)


def test_a_write_failure_does_not_raise(tmp_path):
    blocker = tmp_path / "tensorboard"
    blocker.write_text("a file where the folder should be")
    with TrainingLog(tmp_path, use_wandb=False) as tlog:
        assert not tlog.log_step("a", "r" * 32, 1, {"loss": 1.0}, samples=1)
        tlog.log_round(FleetStats().record_round(collect_s=0.0, train_s=0.0, steps=0, samples=0))


def test_many_runs_hold_no_thread_and_no_open_file(tmp_path, registry):
    """A thousand tenants must not cost a thousand writer threads and open files in the coordinator
    (issue 26): each run's events are appended in the caller's thread, and nothing stays open."""
    import os
    import threading

    fds_before = len(os.listdir("/proc/self/fd"))
    threads_before = threading.active_count()
    with TrainingLog(tmp_path) as tlog:
        rids = {f"r{i:03d}": active_run(registry, f"r{i:03d}") for i in range(60)}
        for step in (1, 2):
            for name, rid in rids.items():
                assert tlog.log_step(name, rid, step, {"loss": float(step)}, samples=2)
        assert threading.active_count() == threads_before
        assert len(os.listdir("/proc/self/fd")) <= fds_before
    for name, rid in list(rids.items())[::20]:
        assert read_scalars(run_dir(tmp_path, name, rid))["loss"] == [(1, 1.0), (2, 2.0)]

"""Placement plans realized as real Ray placement groups (a local Ray with logical GPUs:
Ray reserves GPU slots by count, so no device is needed to test the reservation)."""

from __future__ import annotations

from tests.local_ray import start_ray, stop_ray

from tests.waiting import wait_until

import pytest

from service.config.placement import PlacementConfig

from service.errors import PlacementError

from service.fleet.placement import ClusterShape, cluster_shape_from_ray, group_node_ids, placement_group_specs, plan_placement, release_placement_groups, reserve_placement_groups

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray", reason="ray is part of the pinned stack (deploy/setup.sh)")


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    start_ray(num_cpus=4, num_gpus=4, include_dashboard=False, object_store_memory=80 * 1024**2, log_to_driver=False)
    try:
        yield
    finally:
        stop_ray()


def gpu_plan(engines: int, trainer_dp: int) -> PlacementConfig:
    return PlacementConfig.model_validate(
        {
            "accelerator": "gpu",
            "engines": {"count": engines, "tensor_parallel": 1, "cpus": 0.5},
            "trainer": {"tensor_parallel": 1, "data_parallel": trainer_dp, "cpus_per_rank": 0.5},
        }
    )


def test_plan_from_the_live_cluster_is_reserved_and_pinned(local_ray):
    shape = cluster_shape_from_ray()
    assert shape.node_gpus == (4,) and shape.node_cpus == (4.0,)
    assert shape.node_ids == (ray.get_runtime_context().get_node_id(),) and shape.node_addresses is not None
    plan = plan_placement(gpu_plan(engines=2, trainer_dp=2), shape)
    groups = reserve_placement_groups(plan, timeout_s=30)
    try:
        table = {g.id.hex(): ray.util.placement_group_table(g) for g in groups}
        assert sorted(t["name"] for t in table.values()) == sorted(s.name for s in placement_group_specs(plan))
        assert all(t["state"] == "CREATED" and t["strategy"] == "STRICT_PACK" for t in table.values())
        assert all(group_node_ids(g) == [shape.node_ids[0]] * len(g.bundle_specs) for g in groups)  # pinned by node id
        # all four logical GPUs reserved (Ray's resource view catches up within a few reports: a
        # read right after creation saw them free once in a full run)
        wait_until(lambda: ray.available_resources().get("GPU", 0) == 0, "every GPU reserved", timeout_s=10, interval_s=0.1)
    finally:
        release_placement_groups(groups)


def test_reservation_is_all_or_nothing(local_ray):
    # The planner is told of 8 GPUs but Ray has 4: the groups that could be placed are
    # released again and the error names what stayed pending.
    plan = plan_placement(gpu_plan(engines=4, trainer_dp=4), ClusterShape.uniform(1, 8))
    with pytest.raises(PlacementError, match=r"could not reserve 4 of 8 placement groups within 2 s") as err:
        reserve_placement_groups(plan, timeout_s=2)
    assert "pending: lorafleet-" in str(err.value)
    # nothing left reserved (Ray's resource view catches up with removals within a few reports)
    wait_until(lambda: ray.available_resources().get("GPU", 0) == 4, "every GPU free again", timeout_s=10, interval_s=0.1)


def test_cpu_default_plan_reserves_cpu_bundles(local_ray):
    plan = plan_placement(PlacementConfig())
    groups = reserve_placement_groups(plan, timeout_s=30)
    try:
        bundles = [b for g in groups for b in ray.util.placement_group_table(g)["bundles"].values()]
        assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    finally:
        release_placement_groups(groups)

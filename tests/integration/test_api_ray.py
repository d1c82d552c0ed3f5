"""The API over the real named Ray actor `lorafleet-controller`: typed errors cross
the actor boundary and map to the same statuses; the actor is found by name."""

from __future__ import annotations

import uuid

import pytest

from service.controller_actor import CONTROLLER_ACTOR_NAME, get_controller_actor, start_controller_actor
from tests.integration.api_world import CAPACITY, client, make_world, serve

pytestmark = pytest.mark.integration


@pytest.fixture
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_api_over_ray_actor(ray_cluster, tmp_path):
    world = make_world(tmp_path)
    namespace = f"lorafleet-test-{uuid.uuid4().hex[:8]}"
    handle = start_controller_actor(world.settings, CAPACITY, namespace=namespace)
    try:
        assert get_controller_actor(namespace)._actor_id == handle._actor_id
        with pytest.raises(ValueError, match=f"a controller actor '{CONTROLLER_ACTOR_NAME}' already runs"):
            start_controller_actor(world.settings, CAPACITY, namespace=namespace)
        cfg = world.rl_config()
        with serve(handle, world.settings) as server, client(server.url) as http:
            rows = [
                ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 201, "PENDING"),
                ("POST", "/v1/adapters", {"name": "a", "config": cfg}, 409, "in use by a live run"),
                ("POST", "/v1/adapters", {"name": "b", "config": world.rl_config(rank=64)}, 400, "above the service's max rank 16"),
                ("POST", "/v1/adapters", {"name": "b", "config": cfg}, 201, "PENDING"),
                ("POST", "/v1/adapters", {"name": "c", "config": cfg}, 409, "no free slot"),
                ("GET", "/v1/adapters/zz", None, 404, "no adapter named 'zz'"),
                ("DELETE", "/v1/adapters/a", None, 202, "RETIRING"),
                ("DELETE", "/v1/adapters/a", None, 409, "already retiring"),
                ("GET", "/ready", None, 503, "no runtime attached"),
            ]
            for i, (method, path, body, status, text) in enumerate(rows):
                r = http.request(method, path, json=body)
                assert r.status_code == status, f"row {i}: {r.text}"
                assert text in r.text, f"row {i}: {r.text}"
            assert r.json()["slots"] == {"total": 2, "free": 0, "max_rank": 16}
            error = http.post("/v1/adapters", json={"name": "c", "config": cfg}).json()
            assert error["error"] == "no_free_slot"
    finally:
        ray_cluster.kill(handle)

"""api/cli/watch.py: the terminal table with reward and loss sparklines (`lorafleet adapters watch`)."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from api.cli.watch import BLOCKS, render, sparkline, watch

pytestmark = pytest.mark.unit


def adapter(name, state="ACTIVE", step=3, **over):
    return {"name": name, "state": state, "step": step, "total_steps": 30, "samples_trained": 8 * step, "slot": 0,
            "last_reward": 0.5, "last_loss": 1.25, "last_metrics": {"learning_rate": 0.003, "staleness_mean": 0.5}, **over}


def text_of(table, width=160) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == BLOCKS
    assert sparkline([7.0, 0.0]) == BLOCKS[-1] + BLOCKS[0]
    assert sparkline([2.0, 2.0, 2.0]) == BLOCKS[3] * 3  # flat: mid-height
    assert sparkline([1.0, None, math.nan, 3.0]) == BLOCKS[0] + "  " + BLOCKS[-1]
    assert sparkline([None, None]) == "  " and sparkline([]) == ""


def test_sparkline_shows_the_newest_values():
    values = list(range(100))
    assert len(sparkline(values, width=10)) == 10
    assert sparkline(values, width=10) == sparkline(values[-10:], width=10)
    assert sparkline([5.0, 1.0, 2.0], width=2) == BLOCKS[0] + BLOCKS[-1]


def test_render_shows_every_adapter_with_its_fields_and_curves():
    rl_steps = [{"step": i, "reward_mean": 0.1 * i, "loss": 2.0 - 0.1 * i} for i in range(1, 9)]
    sft_steps = [{"step": i, "loss": 4.0 - 0.25 * i} for i in range(1, 9)]
    table = render(
        [adapter("digits"), adapter("kinds", last_reward=None, slot=None, queue_position=2),
         adapter("old", state="FAILED", slot=None, last_metrics={})],
        {"digits": rl_steps, "kinds": sft_steps, "old": []},
    )
    out = text_of(table)
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") > 5}
    assert set(lines) >= {"digits", "kinds", "old"}
    assert BLOCKS[0] + BLOCKS[1] in lines["digits"] and BLOCKS[-1] in lines["digits"]  # rising reward
    assert sparkline([s["loss"] for s in sft_steps]) in lines["kinds"] and "q2" in lines["kinds"]
    assert "3/30" in lines["digits"] and "24" in lines["digits"] and "0.500" in lines["digits"] and "1.2500" in lines["digits"]
    assert "0.003" in lines["digits"]  # the learning rate, in significant digits
    assert "FAILED" in lines["old"] and lines["old"].count("-") >= 3


@pytest.fixture
def live_api(tmp_path):
    """The real app on loopback over a real Controller with one ACTIVE run (steps recorded by the test)."""
    from service.control.controller import Controller
    from service.registry.registry import AdapterState
    from tests.integration.api_world import CAPACITY, TOKEN, make_world, serve

    # The test records steps through the controller, not the API: with the read cache a page would show
    # them only after read_cache_s (api/front/read_cache.py); 0 builds each poll's page after it came.
    world = make_world(tmp_path, read_cache_s=0, read_stale_s=0)
    controller = Controller(world.settings, CAPACITY)
    try:
        rid = controller.register("digits", world.rl_config(num_step=30)).registration_id
        controller.registry.transition(rid, AdapterState.ACTIVE)
        with serve(controller, world.settings) as server:
            yield server.url, TOKEN, controller, rid
    finally:
        controller.close()


def record(controller, rid, step):
    controller.record_step(rid, step=step, samples=8, metrics={"loss": 3.0 / step, "reward_mean": 0.2 * step, "learning_rate": 0.003})


def test_watch_once_prints_the_table_from_the_api(live_api):
    from api.cli.client import LorafleetClient

    url, token, controller, rid = live_api
    for step in (1, 2, 3):
        record(controller, rid, step)
    console = Console(width=160, record=True, color_system=None)
    with LorafleetClient(url, token) as client:
        watch(client, once=True, console=console)
    out = console.export_text()
    assert "digits" in out and "ACTIVE" in out and "3/30" in out
    assert sparkline([0.2, 0.4, 0.6000000000000001]) in out and sparkline([3.0, 1.5, 1.0]) in out


def test_watch_redraws_until_interrupted(live_api):
    from api.cli.client import LorafleetClient

    url, token, controller, rid = live_api
    record(controller, rid, 1)
    sleeps = []

    def sleep(seconds):  # the loop's pause: train a step after the first draw, stop after the second
        sleeps.append(seconds)
        if len(sleeps) == 1:
            record(controller, rid, 2)
        else:
            raise KeyboardInterrupt

    console = Console(width=160, record=True, color_system=None, force_terminal=False)
    with LorafleetClient(url, token) as client:
        watch(client, interval_s=0.5, console=console, sleep=sleep)
    assert sleeps == [0.5, 0.5]
    assert "2/30" in console.export_text()  # the last table drawn shows the new step


def test_watch_ends_on_a_refused_token(live_api):
    from api.cli.client import ApiError, LorafleetClient

    url, _, _, _ = live_api
    with LorafleetClient(url, "wrong-token") as client, pytest.raises(ApiError, match="401"):
        watch(client, interval_s=0.5, console=Console(record=True), sleep=lambda s: None)


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        watch(None, interval_s=0)

"""The engines' hosts: per engine, its placement group (on the node the planner chose), that node's
Ray id, and the EngineLauncher actor in the group (rollout/engines/engine_launcher.py) that starts and restarts
the SGLang server.

The coordinator holds one `EngineHosts`; the rollout worker holds the launcher handles and routes to
the engines' URLs. When an engine's node is lost, service/fleet/node_faults.py clears that engine's entry
here (`release`), reserves a group elsewhere and installs it (`install`), and hands the new launcher
to the rollout worker.

Invariants:
  * `groups[i]`, `nodes[i]` and `launchers[i]` are engine i's current placement group, its node and the
    launcher inside it; all None between `release` and `install` (engine i then has no host: it is
    being placed anew);
  * a launcher runs inside its engine's group (service/fleet/actors.py engine_launcher_options), so the
    engine's GPUs and CPUs are the group's bundle and its node is the group's node.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from service.fleet.actors import start_engine_launcher
from service.config.job import JobConfig
from service.config.settings import ServiceSettings
from service.fleet.placement import release_placement_groups

log = logging.getLogger(__name__)


class EngineHosts:
    def __init__(self, job: JobConfig, settings: ServiceSettings, groups: list[Any], nodes: list[str | None]) -> None:
        self.job = job
        self.settings = settings
        self.groups: list[Any | None] = list(groups)
        self.nodes: list[str | None] = list(nodes)
        self.launchers: list[Any | None] = [start_engine_launcher(job, settings, i, g) for i, g in enumerate(self.groups)]

    def release(self, index: int) -> None:
        """Engine `index` loses its host: its launcher is killed (its engine dies with it), its group released."""
        launcher, group = self.launchers[index], self.groups[index]
        self.launchers[index] = self.groups[index] = self.nodes[index] = None
        if launcher is not None:
            kill_actor(launcher)
        if group is not None:
            try:
                release_placement_groups([group])
            except Exception as e:  # noqa: BLE001 - a group on a dead node may linger; its resources went with the node
                log.info("releasing engine %d's placement group: %s", index, e)

    def install(self, index: int, group: Any, node: str) -> Any:
        """Engine `index`'s new host: `group` (reserved and ready, on `node`); returns its new launcher (not
        started: the rollout worker's adopt_engine starts it)."""
        assert self.groups[index] is None, f"engine {index} still has a host: release it first"
        self.groups[index], self.nodes[index] = group, node
        self.launchers[index] = start_engine_launcher(self.job, self.settings, index, group)
        return self.launchers[index]

    def live_groups(self) -> list[Any]:
        return [g for g in self.groups if g is not None]

    def close(self) -> None:
        """Kill every launcher (their engines die with them: die_with_parent). The groups are released
        with the others by the caller (Fleet.close)."""
        for launcher in self.launchers:
            if launcher is not None:
                kill_actor(launcher)


def kill_actor(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass

"""The fleet: the Ray actors and their placement, the trainer group and the rollout client, the
fleet runtime over them, engines' hosts and pids, nodes, health and node faults, and the start
of the whole service.

May import: service.config, service.errors, service.shutdown, service.registry, service.scheduling,
service.tenants, service.control, service.loop, trainer, rollout.
"""

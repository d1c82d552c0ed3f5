"""The controller: tenant operations and the reconcile pass over the registry, registration-time
checks of an adapter config, what a tenant may start from, and the protocol of what it needs
from the fleet (the runtime).

May import: service.config, service.errors, service.registry, service.scheduling, trainer.interface, trainer.storage,
rollout.
"""

"""The one scheduler: the owner of trainer slots and residency for every kind of tenant, what
it asks of a tenant, the keep-warm and turns policy, and a round's parts.

May import: service.config, service.errors, service.registry, trainer.batch, trainer.rounds, trainer.interface.
"""

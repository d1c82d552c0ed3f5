"""The kinds of tenant: RL and SFT runs (dataset-driven) and Tinker models (tenant-driven), what
each offers a round and how it settles; the Tinker face's handle on the scheduler.

May import: service.config, service.errors, service.registry, service.scheduling, trainer.batch, trainer.config,
trainer.rounds, trainer.interface, trainer.storage, rollout.
"""

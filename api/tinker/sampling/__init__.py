"""Tinker sampling: ``sampler`` (SglangSampler: sampling sessions over the fleet's SGLang engines,
each request's options, the stable_reinforce records it writes), ``engines`` (which engine serves a
request by one routing rule, each engine's adapter LRU, following the fleet's engine list) and
``stability`` (stable_reinforce's provenance spans checked against the sampling records).

May import: api.tinker.futures, api.tinker.sampling, service.registry, service.scheduling.residency, trainer.losses, trainer.rounds, rollout.engines.
"""

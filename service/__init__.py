"""The service: the controller, the registry, the one scheduler and the training loop, in the
coordinator process, over the fleet (trainer ranks, rollout worker, engines).

At the top: the `lorafleet` service commands (`cli`), the two ways to run (`modes`: batch and
service), typed errors (`errors`) and the graceful stop (`shutdown`). Below, folders by role:
config, registry, scheduling, tenants, control, loop, fleet (each `__init__.py` says what lives
there and what it may import). service/ never imports api/.

May import: service, trainer, rollout.
"""

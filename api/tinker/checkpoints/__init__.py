"""The Tinker RestClient's training runs and checkpoints: ``runs`` (TrainingRuns: runs and
checkpoints as records over the store; listing, deletion, TTL), ``external_weights``
(save_weights_external exports and their signed download URLs) and ``routes`` (their APIRouter).

May import: api.tinker, service.registry, trainer.storage.
"""

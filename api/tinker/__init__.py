"""The Tinker wire protocol (``/api/v1``): the official ``tinker`` SDK trains lorafleet slots.

The wire face only (the scheduler in service/ runs the work). Modules: ``auth`` (API keys ->
tenants), ``wire`` (JSON bodies) and ``proto_io`` (the SDK's protobuf bodies), ``futures``
(request ids, long-poll retrieve), ``service`` (sessions, model records, checkpoint paths; a
request -> an operation on its model's queue), ``routes`` (the APIRouter), ``runs`` (training
runs and checkpoints on disk: listing, deletion, TTL), ``external_weights`` (save_weights_external
and its signed download URLs), ``runs_routes`` (the RestClient's routes), ``sampling`` (sampling
sessions over SGLang) with ``sampler_engines`` (which engine serves a request, each engine's adapters),
``stability`` (stable_reinforce's provenance checked against the sampling records), ``metrics``, and
``fleet`` (the service over the running fleet).

May import: api, service, trainer.config, trainer.rounds, trainer.storage, trainer.losses, rollout.
"""

"""The Tinker wire protocol (``/api/v1``): the official ``tinker`` SDK trains lorafleet slots.

The wire face only (the scheduler in service/ runs the work). Modules: ``auth`` (API keys ->
tenants), ``wire`` (JSON bodies) and ``proto_io`` (the SDK's protobuf bodies), ``futures``
(request ids, long-poll retrieve), ``service`` (sessions, model records, checkpoint paths; a
request -> an operation on its model's queue), ``routes`` (the APIRouter), ``outcomes`` (an operation's answer as
the SDK reads it), ``metrics``, and ``fleet`` (the service over the running fleet). Sub-folders:
``checkpoints`` (training runs, checkpoints, external weights and their routes) and ``sampling``
(sampling sessions over the engines, the routing rule, stable_reinforce's provenance).

May import: api, service, trainer.config, trainer.rounds, trainer.storage, trainer.losses, rollout.
"""

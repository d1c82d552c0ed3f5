"""The Tinker wire protocol (``/api/v1``): the official ``tinker`` SDK trains lorafleet slots.

Modules: ``auth`` (API keys -> tenants), ``proto_io`` (the SDK's protobuf bodies),
``futures`` (request ids, long-poll retrieve), ``coalescer`` (forward_backward calls of
different models -> one mixed step), ``backend`` (what the routes call, and its
in-process implementation over a MultiLoraTrainer), ``routes`` (the APIRouter), ``runs``
(training runs and checkpoints on disk: listing, deletion, TTL), ``external_weights``
(save_weights_external and its signed download URLs), ``runs_routes`` (the RestClient's routes).
"""

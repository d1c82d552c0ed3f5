"""Server-side custom losses (issue 42 item 2): ``create_custom_loss``, and the ``loss_id`` that
``forward_backward(data, "custom", {"loss_id": ...})`` names (what the SDK's
``forward_backward_custom`` sends for an uploaded loss once ``/client/config`` answers
``custom_loss_server_side: true``: one forward_backward, no client-side forward and surrogate).

The SDK traces the user's per-datum loss with torch.fx and sends it as data (its
``CreateCustomLossRequest``: name, inputs, graph). It is checked here once, when created:
``compile_custom_loss`` (trainer/losses/custom_graph.py) rebuilds it from its allow-list, and a graph it
refuses (an operation off the list, an ``os``/``builtins`` target, too many nodes, ...) is the future's
``user`` error naming the node and its target; nothing is stored. An accepted loss is a record
(service/registry/tinker_records.py ``tinker_custom_losses``) under ``<session>:loss:<custom_loss_seq_id>``
(the SDK's per-session counter: a retried request finds its own loss; the same number with another graph
is refused).

Invariants:
  C1 a loss belongs to its tenant and its session; a forward_backward names it only for a model of the
     same session (the SDK's rule: "names the stored loss in forward_backward requests of the same
     session"): another tenant's, another session's or an unknown id is 404 "unknown custom loss", as if
     it did not exist, and nothing is queued;
  C2 the call carries the loss as its spec (plain data) to the trainer, which rebuilds it
     (trainer/step/custom_calls.py); the operation's recorded request holds the spec, so a replay after
     a restart runs the same loss.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, HTTPException, Request

from api.tinker.futures import Outcome, user_error
from api.tinker.proto_io import ForwardBackwardBody
from api.tinker.service import TinkerService
from api.tinker.wire import _In
from service.registry.tinker_records import TinkerRecords
from trainer.losses.custom_graph import compile_custom_loss

CACHE_SIZE = 1024  # losses kept in memory (a forward_backward reads its loss without the registry)


class CreateCustomLossIn(_In):
    """The SDK's CreateCustomLossRequest (its inputs and graph are checked by compile_custom_loss)."""

    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: list[Any]
    graph: Any


class CustomLosses:
    """The tenants' custom losses: created (checked and recorded) and looked up by owner (C1)."""

    def __init__(self, records: TinkerRecords, cache_size: int = CACHE_SIZE):
        self.records = records
        self.cache_size = cache_size
        self._cache: OrderedDict[str, tuple[str, str, dict]] = OrderedDict()  # loss id -> (tenant, session, spec)

    def create(self, tenant: str, body: CreateCustomLossIn) -> str:
        """The loss's id; ValueError naming what the graph may not do (nothing recorded then)."""
        if body.custom_loss_seq_id < 0:
            raise ValueError(f"custom_loss_seq_id must be >= 0, got {body.custom_loss_seq_id}")
        spec = {"name": body.name, "inputs": body.inputs, "graph": body.graph}
        compile_custom_loss(body.name, body.inputs, body.graph)
        loss_id = f"{body.session_id}:loss:{body.custom_loss_seq_id}"
        existing = self._find(tenant, loss_id)
        if existing is not None:
            if existing[1] != spec:
                raise ValueError(f"custom_loss_seq_id {body.custom_loss_seq_id} of this session names another loss "
                                 f"({existing[1]['name']!r}); each loss takes its own number")
            return loss_id
        self.records.add_custom_loss(loss_id, tenant, body.session_id, spec)
        self._remember(loss_id, (tenant, body.session_id, spec))
        return loss_id

    def _find(self, tenant: str, loss_id: str) -> tuple[str, dict] | None:
        """(session, spec) of the tenant's loss, from memory or the records; None if not the tenant's."""
        cached = self._cache.get(loss_id)
        if cached is not None:
            self._cache.move_to_end(loss_id)
            return (cached[1], cached[2]) if cached[0] == tenant else None
        found = self.records.custom_loss(tenant, loss_id)
        if found is not None:
            self._remember(loss_id, (tenant, *found))
        return found

    def _remember(self, loss_id: str, entry: tuple[str, str, dict]) -> None:
        self._cache[loss_id] = entry
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def for_call(self, tenant: str, session_id: str, fb: ForwardBackwardBody) -> dict | None:
        """The spec a ``custom`` call of a model of ``session_id`` runs (None for a built-in loss);
        404 under C1."""
        if fb.loss_fn != "custom":
            return None
        found = self._find(tenant, fb.loss_id or "")
        if found is None or found[0] != session_id:
            raise HTTPException(404, f"unknown custom loss {fb.loss_id} (a loss is named by the session that created it)")
        return found[1]


def custom_loss_router(service: TinkerService, losses: CustomLosses) -> APIRouter:
    r = APIRouter()

    @r.post("/create_custom_loss")
    async def create_custom_loss(body: CreateCustomLossIn, request: Request) -> dict:
        t = service.keys.authenticate(request)
        service.session(t, body.session_id)  # another tenant's session: 404
        rid = service.futures.create(t, None)
        try:
            outcome = Outcome(json={"type": "create_custom_loss", "loss_id": losses.create(t, body)})
        except ValueError as err:
            outcome = user_error(str(err))
        service.futures.resolve(rid, outcome)
        await service.futures.durable()  # D1, and the loss's record with it
        return {"request_id": rid}

    return r

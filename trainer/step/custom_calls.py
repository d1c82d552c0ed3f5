"""Server-side custom losses in the trainer's round (issue 42 item 2): a Tinker call whose ``loss_fn`` is
``custom`` carries the tenant's loss as plain data (trainer/rounds.py ``Call.custom_loss``: the
``{name, inputs, graph}`` that ``create_custom_loss`` received). The round runner
(trainer/step/round_runner.py) rebuilds it here (trainer/losses/custom_graph.py: an allow-list, nothing
imported or evaluated by name), checks each datum before anything runs, runs it per datum in the
mixed pass (one round trip: no client-side forward and surrogate backward), and answers the call's
metrics as the SDK combines them (``loss:sum``, ``custom/<x>:sum`` summed, ``custom/<x>:mean``
averaged over the call's datums).

Invariants:
* a loss is compiled from its spec alone, so every rank (and a replay after a restart) rebuilds
  the same loss; compiled losses are cached by the spec's canonical JSON (``CompiledLosses``);
* a datum that the loss cannot train (a missing or mis-ranked input, a failing dry run, a loss that
  does not depend on the log-probs) is refused before the pass, like every other loss's bad input;
* under data parallelism each rank runs its share of the datums (``rider_share``); the custom
  metrics of every datum travel to every rank in one ``all_gather`` of a float64 vector
  (``gather_datum_metrics``, as trainer/step/dp_outputs.py does for the outputs), so every rank
  combines the same per-datum numbers in the same order as one rank would.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import torch
import torch.distributed as dist

from trainer.batch import RiderSequence, rider_share
from trainer.losses.custom_graph import CustomLoss, compile_custom_loss
from trainer.platform.distributed import ParallelLayout, dp_group

CACHE_SIZE = 64  # compiled losses kept per runner (a tenant's loss is compiled once, not every round)


class CompiledLosses:
    """``get(spec)``: the spec's CustomLoss (ValueError naming what is wrong), compiled once."""

    def __init__(self, size: int = CACHE_SIZE):
        self.size = size
        self._losses: OrderedDict[str, CustomLoss] = OrderedDict()

    def get(self, spec: dict | None) -> CustomLoss:
        if not isinstance(spec, dict) or set(spec) != {"name", "inputs", "graph"}:
            raise ValueError("loss_fn 'custom' names a loss created with create_custom_loss: send "
                             "loss_fn_config {'loss_id': <the id it answered>}")
        key = json.dumps(spec, sort_keys=True)
        loss = self._losses.get(key)
        if loss is None:
            loss = compile_custom_loss(spec["name"], spec["inputs"], spec["graph"])
            self._losses[key] = loss
            while len(self._losses) > self.size:
                self._losses.popitem(last=False)
        self._losses.move_to_end(key)
        return loss


def check_custom_datum(loss: CustomLoss, n: int, inputs: dict[str, torch.Tensor]) -> None:
    """One datum of ``n`` tokens for ``loss``: target_tokens [n] (the positions whose log-probs the
    loss receives), every floating input finite, then the loss's own checks (ranks, dry run)."""
    tt = inputs.get("target_tokens")
    if tt is None or tuple(tt.shape) != (n,):
        got = "none" if tt is None else f"shape {tuple(tt.shape)}"
        raise ValueError(f"loss_fn_inputs['target_tokens'] must have shape ({n},) (model_input has {n} tokens), got {got}")
    for key, t in inputs.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"loss_fn_inputs[{key!r}] has non-finite values")
    loss.check_datum(n, inputs)


def datum_floats(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """One datum's metrics as Python floats (one device transfer for its tensors)."""
    tensors = [v.detach().reshape(()).double() for v in metrics.values() if isinstance(v, torch.Tensor)]
    values = iter(torch.stack(tensors).tolist() if tensors else [])
    return {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}


def gather_datum_metrics(mine: dict[int, dict[str, float]], keys: list[tuple[str, ...]], riders: list[RiderSequence],
                         layout: ParallelLayout, device: torch.device, group=None) -> dict[int, dict[str, float]]:  # noqa: ANN001
    """Every custom rider's metrics on every DP rank: ``mine`` this rank's share's (rider -> metrics),
    ``keys[k]`` rider k's metric names (empty: no custom loss), the same on every rank. Collective
    over DP (every rank calls it with the same riders and keys); ``group``: the DP group (default
    the trainer's)."""
    shares = [rider_share([r.slot for r in riders], q, layout.dp_size) for q in range(layout.dp_size)]
    width = max(sum(len(keys[k]) for k in share) for share in shares)
    flat = torch.zeros(max(width, 1), dtype=torch.float64)
    start = 0
    for k in shares[layout.dp_rank]:
        if keys[k]:
            flat[start : start + len(keys[k])] = torch.tensor([mine[k][name] for name in keys[k]], dtype=torch.float64)
            start += len(keys[k])
    parts = [torch.empty_like(flat, device=device) for _ in range(layout.dp_size)]
    dist.all_gather(parts, flat.to(device), group=group if group is not None else dp_group())
    got: dict[int, dict[str, float]] = {}
    for part, share in zip(parts, shares):
        values = part.cpu().tolist()
        start = 0
        for k in share:
            if keys[k]:
                got[k] = dict(zip(keys[k], values[start : start + len(keys[k])]))
                start += len(keys[k])
    return got

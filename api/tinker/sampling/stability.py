"""stable_reinforce's server side: a call's provenance spans checked against the sampling records, and
the loss's inputs built from those records (never from log-probabilities the client sends).

A datum of a ``stable_reinforce`` call carries provenance (the SDK's ``Datum.with_provenance``): one
list of spans tiling ``model_input`` and one tiling ``loss_fn_inputs['target_tokens']``; a span says
that its positions are positions ``[offset, offset + length)`` of a recorded sequence's prompt
(``PromptProvenanceSpan``) or of its sampled tokens (``SampledProvenanceSpan``). Checked, each
refusal naming the datum, the span and what is wrong (the call then changes nothing):

  P1 every datum has provenance, and each list tiles its field exactly (the lengths sum to it);
  P2 every span names a sequence THIS tenant sampled with ``record_stability_info=True`` whose record
     is live (service/registry/sampling_records.py: one day after its last use);
  P3 every span lies inside what was recorded (a prompt span within the prompt, a sampled span within
     the sampled tokens), and the tokens it covers are the recorded ones: the model_input tokens of
     every span, and the target tokens of every sampled span (a prompt span's targets are not the
     objective's: their advantages must be 0, P4);
  P4 advantages are non-zero only on sampled positions;
  P5 ``sampled_sequence`` is the server's: a client sending it is refused.

Then the datum's inputs become the loss's (trainer/losses/stable_reinforce.py): ``logprobs`` = the
engine's recorded log-probability of each sampled target (0 elsewhere; a client's ``logprobs`` is
replaced), ``sampled_sequence`` = 1, 2, ... for the datum's sampled sequences in order of appearance
(0 elsewhere). The records named are used (their day restarts) once the call is accepted.

The call's statistics (stable_reinforce.statistics per datum, from the policy log-probs the pass
returns) are added to its metrics and summed into the sampler's counters (/metrics).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from service.registry.sampling_records import SampledSequenceRecord, SamplingRecords
from trainer.losses import stable_reinforce
from trainer.losses.table import resolve_loss
from trainer.rounds import CallResult, Datum

LOSS = "stable_reinforce"
SERVER_INPUTS = ("sampled_sequence",)  # P5


@dataclass(frozen=True)
class Span:
    sampled: bool  # SampledProvenanceSpan; else PromptProvenanceSpan
    sequence_id: str
    offset: int
    length: int

    @property
    def kind(self) -> str:
        return "sampled tokens" if self.sampled else "prompt tokens"


@dataclass(frozen=True)
class Provenance:
    model_input: tuple[Span, ...]
    loss_fn_inputs: tuple[Span, ...]


def _tiles(what: str, spans: tuple[Span, ...], n: int) -> None:
    covered = sum(s.length for s in spans)
    if covered != n:
        raise ValueError(f"the {what} spans cover {covered} positions but {what} has {n}: the spans must tile it exactly")


def _recorded(what: str, j: int, span: Span, records: dict[str, SampledSequenceRecord]) -> tuple:
    """The recorded tokens span ``j`` of ``what`` names (P3: it must lie inside them)."""
    rec = records[span.sequence_id]
    source = rec.tokens if span.sampled else rec.prompt
    if span.offset + span.length > len(source):
        raise ValueError(f"{what} span {j}: it claims {span.kind} [{span.offset}, {span.offset + span.length}) of sequence "
                         f"{span.sequence_id!r}, which has {len(source)} {span.kind}")
    return source[span.offset: span.offset + span.length]


def _check_datum(datum: Datum, prov: Provenance, records: dict[str, SampledSequenceRecord]) -> Datum:
    """P1-P5 for one datum; the datum with the loss's inputs."""
    for key in SERVER_INPUTS:
        if key in datum.inputs:
            raise ValueError(f"loss_fn_inputs[{key!r}] is filled by the server from the provenance spans; do not send it")
    missing = [k for k in ("target_tokens", "advantages") if k not in datum.inputs]
    if missing:
        raise ValueError(f"loss_fn_inputs lacks {missing} ({LOSS} takes target_tokens and advantages; logprobs, if sent, "
                         "is replaced by what the server recorded)")
    targets, adv = datum.inputs["target_tokens"], datum.inputs["advantages"]
    _tiles("model_input", prov.model_input, len(datum.tokens))
    _tiles("loss_fn_inputs", prov.loss_fn_inputs, int(targets.shape[0]))
    for what, spans in (("model_input", prov.model_input), ("loss_fn_inputs", prov.loss_fn_inputs)):
        for j, span in enumerate(spans):
            if span.sequence_id not in records:
                raise ValueError(f"{what} span {j} names sequence {span.sequence_id!r}, which is not a sequence this API key "
                                 "sampled with record_stability_info=True, or its record expired (one day after its last use)")
    q = torch.zeros(len(targets), dtype=torch.float32)
    groups = torch.zeros(len(targets), dtype=torch.float32)
    number: dict[str, int] = {}
    at = 0
    for j, span in enumerate(prov.model_input):
        want = _recorded("model_input", j, span, records)
        if tuple(datum.tokens[at: at + span.length]) != tuple(want):
            raise ValueError(f"model_input span {j} (positions [{at}, {at + span.length})) is not the {span.kind} "
                             f"[{span.offset}, {span.offset + span.length}) that sequence {span.sequence_id!r} recorded")
        at += span.length
    at = 0
    for j, span in enumerate(prov.loss_fn_inputs):
        want = _recorded("loss_fn_inputs", j, span, records)
        end = at + span.length
        if span.sampled:
            if tuple(targets[at:end].tolist()) != tuple(want):
                raise ValueError(f"loss_fn_inputs span {j}: target_tokens [{at}, {end}) are not the sampled tokens "
                                 f"[{span.offset}, {span.offset + span.length}) of sequence {span.sequence_id!r}")
            q[at:end] = torch.tensor(records[span.sequence_id].logprobs[span.offset: span.offset + span.length], dtype=torch.float32)
            groups[at:end] = number.setdefault(span.sequence_id, len(number) + 1)
        else:
            nonzero = torch.nonzero(adv[at:end] != 0)
            if len(nonzero):
                p = at + int(nonzero[0])
                raise ValueError(f"advantages are non-zero at position {p}, a prompt token of sequence {span.sequence_id!r} "
                                 f"(loss_fn_inputs span {j}): {LOSS} takes advantages on sampled tokens only")
        at = end
    return Datum(tokens=datum.tokens, inputs={**datum.inputs, "logprobs": q, "sampled_sequence": groups})


def attach_recorded_inputs(tenant: str, loss_fn: str, data: list[Datum], provenance: list[Provenance | None],
                           records: SamplingRecords | None) -> list[Datum]:
    """The call's data with stable_reinforce's inputs from the records (other losses: as they are,
    provenance unused). ValueError naming the datum and what is wrong (module doc, P1-P5)."""
    if loss_fn != LOSS:
        return data
    missing = [i for i, p in enumerate(provenance) if p is None]
    if missing:
        raise ValueError(f"datum {missing[0]}: {LOSS} needs the provenance of every datum (Datum.with_provenance: which "
                         "sampled sequence each position came from, from a sampling client made with "
                         "record_stability_info=True); this datum has none")
    if records is None:
        raise ValueError(f"{LOSS} needs sequences sampled by this server with record_stability_info=True; this server "
                         "keeps no sampling records (it has no sampling engine)")
    ids = sorted({s.sequence_id for p in provenance for s in (*p.model_input, *p.loss_fn_inputs)})
    found = records.sampled_sequences(tenant, ids, touch=False)
    out = []
    for i, (datum, prov) in enumerate(zip(data, provenance)):
        try:
            out.append(_check_datum(datum, prov, found))
        except ValueError as err:
            raise ValueError(f"datum {i}: {err}") from None
    records.sampled_sequences(tenant, ids)  # accepted: each record used, its day restarted
    return out


def with_statistics(loss_fn: str, config: dict[str, float] | None, data: list[Datum], counters: Counter | None,
                    outcome: Callable[[CallResult], object]) -> Callable[[CallResult], object]:
    """``outcome`` of the call's result, its metrics first joined by stable_reinforce's statistics
    (computed from the policy log-probs the pass returned), which are also summed into ``counters``
    (the sampler's, for /metrics)."""
    if loss_fn != LOSS:
        return outcome

    def with_stats(result: CallResult) -> object:
        if result.error is None and len(result.outputs) == len(data):
            cfg = resolve_loss(LOSS, config)[1]
            totals: Counter = Counter()
            worst = 0.0
            for datum, out in zip(data, result.outputs):
                stats = stable_reinforce.statistics(out["logprobs"].double(), datum.inputs, cfg)
                worst = max(worst, stats.pop("max_abs_log_ratio"))
                totals.update(stats)
            totals["max_abs_log_ratio"] = worst
            result.metrics.update(stable_reinforce.call_metrics(totals))
            if counters is not None:
                counters.update({k: v for k, v in totals.items() if k != "max_abs_log_ratio"})
                counters["calls"] += 1
        return outcome(result)

    return with_stats

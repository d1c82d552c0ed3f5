"""The round runner: a scheduler round (trainer/rounds.py) on one rank, every tenant's work in one
call. ``RoundRunner(trainer).run_round(work)``: the Tinker forwards, then ONE mixed pass (the dataset
runs' samples, stepped per slot as ``MultiLoraTrainer.train`` steps them, and the Tinker
forward_backward calls riding in the same micro-batches), then the Tinker optimizer steps in order.
The rank's actor body (trainer/actor.py) runs it; nothing else forwards a round.

Its parts:

* ``forward_backward(calls)``: the calls (each one model's data, loss and config) of
  SEVERAL slots in one mixed pass (packed micro-batches, each slot one contiguous
  segment); every call's loss is the SUM of its datums' per-token losses
  (trainer/losses/table.py) and its gradient ACCUMULATES in its slot's gradient rows.
  Nothing steps. The base is frozen and sequences never interact, so a slot's gradient
  is exactly what its calls would give alone.
* ``train_with(batch, calls)``: the same calls riding in the service loop's train call
  (``MultiLoraTrainer.train`` with RiderSequences): one packed forward/backward over the
  union of the loop's samples and the calls' datums; the loop's slots step as ``train``
  steps them, the calls' slots only accumulate. ``forward_backward`` is this call with
  no batch, so both share every line of the pass.
* ``forward(calls)``: the same outputs and losses, no gradient.
* a call of loss_fn ``custom`` carries the tenant's server-side custom loss (``Call.custom_loss``):
  rebuilt from its allow-list and run per datum in the same pass, its metrics combined as the SDK
  combines them (trainer/step/custom_calls.py).
* ``optim_step(slot, adam)``: the slot's accumulated gradient as is (Tinker scales by
  nothing: losses are sums), clipped to ``grad_clip_norm`` (0 = off) and applied with
  the call's AdamW parameters; then zeroed.

Validation runs before anything changes: a call with bad input gets an error and
changes nothing; the other calls of the same mixed pass run as if it were absent.
Data parallelism: every rank receives the whole round and runs the losses of its share of the
datums (trainer/batch.py ``rider_share``, as a run's samples are shared); a slot's gradient rows
hold the rank's part until its optim_step sums the parts over the ranks (a Tinker loss is a SUM
over datums); ``finish`` gathers every datum's outputs (trainer/step/dp_outputs.py), so every
output and ``loss:sum`` is what one rank would answer. TP: every rank of a TP group runs the same.
"""

from __future__ import annotations

from itertools import groupby
from typing import Any, Callable

import torch

from trainer.batch import TrainBatch
from trainer.batch import RiderSequence, rider_share
from trainer.rounds import AdamStep, Call, CallResult, Datum, RoundResult, RoundWork  # noqa: F401 - the types live there
from trainer.base.packing import split_by_token_budget
from trainer.step.custom_calls import CompiledLosses, check_custom_datum, datum_floats, gather_datum_metrics
from trainer.step.dp_outputs import DatumOutputs, gather_datum_outputs
from trainer.losses.custom_graph import CustomLoss, combine_metrics
from trainer.losses.table import LossSpec, check_inputs, column_inputs, datum_columns, resolve_loss


class RoundRunner:
    def __init__(self, trainer: Any, *, max_seq_len: int = 4096):
        """`trainer`: a trainer.core.MultiLoraTrainer (typed loosely: the core does not import this
        module, and this module needs only its public train call, slot states and passes)."""
        self.trainer = trainer
        self.max_seq_len = max_seq_len
        self.custom_losses = CompiledLosses()  # server-side custom losses, compiled once (trainer/step/custom_calls.py)

    # -- validation -----------------------------------------------------------------------

    def _validate(self, call: Call) -> tuple[LossSpec | None, dict[str, float], CustomLoss | None]:
        """(the table's loss and its config, or None and the call's custom loss); ValueError naming the problem."""
        self.trainer.slot_state(call.slot)  # "slot N is not initialized" for a gone model
        custom = self.custom_losses.get(call.custom_loss) if call.loss_fn == "custom" else None
        spec, cfg = (None, {}) if custom is not None else resolve_loss(call.loss_fn, call.loss_fn_config)
        if not call.data:
            raise ValueError("data is empty: send at least one datum")
        vocab = self.trainer.vocab_size
        for i, d in enumerate(call.data):
            n = len(d.tokens)
            try:
                if n == 0:
                    raise ValueError("model_input has no tokens")
                if n > self.max_seq_len:
                    raise ValueError(f"model_input has {n} tokens, more than this server allows ({self.max_seq_len})")
                if min(d.tokens) < 0 or max(d.tokens) >= vocab:
                    raise ValueError(f"model_input token ids must be in [0, {vocab}), got {min(d.tokens)}..{max(d.tokens)}")
                if custom is not None:
                    check_custom_datum(custom, n, d.inputs)
                else:
                    check_inputs(call.loss_fn, spec, n, d.inputs)
                tt = d.inputs["target_tokens"]
                if tt.is_floating_point():
                    raise ValueError("loss_fn_inputs['target_tokens'] must be integers (int64)")
                if int(tt.min()) < 0 or int(tt.max()) >= vocab:
                    raise ValueError(f"target_tokens must be in [0, {vocab}), got {int(tt.min())}..{int(tt.max())}")
            except ValueError as err:
                raise ValueError(f"datum {i}: {err}") from None
        return spec, cfg, custom

    # -- the mixed pass ---------------------------------------------------------------------

    def forward_backward(self, calls: list[Call]) -> list[CallResult]:
        """The calls alone: the combined call with no loop batch."""
        return self.train_with(None, calls)[1]

    def train_with(self, batch: TrainBatch | None,
                   calls: list[Call]) -> tuple[Any, list[CallResult]]:
        """ONE mixed step: the loop's ``batch`` (stepped as ``MultiLoraTrainer.train`` steps it) and
        the calls' datums (gradients accumulating, no step) in the same packed micro-batches.

        A call with bad input, or aimed at a slot the batch trains (a loop slot never accumulates
        a Tinker gradient), gets its error and changes nothing; the batch and the other calls
        run as if it were absent. Conversely a batch that ``train`` refuses changes nothing and
        is answered by its ValueError in place of the TrainResult (the caller raises it), while
        the calls run alone. The TrainResult is None when ``batch`` is None."""
        try:
            self.trainer.check_batch(batch)
        except ValueError as err:
            return err, self.forward_backward(calls)
        batch_slots = {s.slot for s in batch.samples} if batch is not None else set()
        results, riders, finish = self._riders(calls, batch_slots, backward=True)
        if batch is None and not riders:
            return None, results
        train_result = self.trainer.train(batch, riders)
        finish()
        return (train_result if batch is not None else None), results

    def forward(self, calls: list[Call]) -> list[CallResult]:
        """The same outputs and losses as forward_backward, no gradient (same micro-batches)."""
        results, riders, finish = self._riders(calls, set(), backward=False)
        layout = self.trainer.layout  # under DP this rank's share (as ``train`` shares them); finish() gathers
        mine = [riders[k] for k in rider_share([r.slot for r in riders], layout.dp_rank, layout.dp_size)]
        slots = [r.slot for r in mine]
        budget = self.trainer.config.micro_batch_tokens
        for group in split_by_token_budget([len(r.tokens) for r in mine], slots, budget):
            mb = [mine[i] for i in group]  # slot order (stable): each slot one contiguous segment
            lp = self.trainer.packed_lora_pass([r.tokens for r in mb], [r.slot for r in mb], [r.targets for r in mb])
            start = 0
            for r in mb:
                r.loss(lp[start : start + len(r.tokens)])
                start += len(r.tokens)
        finish()
        return results

    def _riders(self, calls: list[Call], batch_slots: set[int], backward: bool):
        """(results, RiderSequences of the valid calls' datums, finish) — each rider's loss is its
        datum's per-token loss summed (trainer/losses/table.py) and records the datum's outputs;
        ``finish()`` fills the valid calls' outputs and ``loss:sum`` once the pass has run."""
        results = [CallResult() for _ in calls]
        losses: dict[int, tuple[LossSpec | None, dict[str, float], CustomLoss | None]] = {}
        for c, call in enumerate(calls):
            try:
                if call.slot in batch_slots:
                    raise ValueError(f"slot {call.slot} is being trained by the service's loop; it cannot take Tinker calls")
                losses[c] = self._validate(call)
            except ValueError as err:
                results[c].error = str(err)
        # rider k is column j of datum i of call c (j None: a datum of [n] inputs; a datum of [n, K]
        # inputs rides as its K columns, each a 1-D datum of the same loss: table.py's definition)
        keys = [(c, i, j) for c in losses for i, d in enumerate(calls[c].data) for j in _columns(d.inputs)]
        fields = [_output_fields(calls[c].loss_fn) for c, _, _ in keys]
        ran: dict[int, DatumOutputs] = {}  # rider k -> its outputs and loss sum (under DP: this rank's share)
        custom_metrics: dict[int, dict] = {}  # rider k of a custom call -> its metrics (this rank's share)

        def loss_fn(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
            c, i, j = keys[k]

            def loss(seg: torch.Tensor) -> torch.Tensor:
                spec, cfg, custom = losses[c]
                inputs = {name: v.to(seg.device) for name, v in column_inputs(calls[c].data[i].inputs, j).items()}
                if custom is not None:  # the datum's loss and metrics (trainer/losses/custom_graph.py)
                    total, custom_metrics[k] = custom.datum(seg, inputs)
                    per_position = {"logprobs": seg}
                else:
                    elementwise = spec.fn(seg, inputs, cfg).loss
                    per_position = {"logprobs": seg, "elementwise_loss": elementwise}
                    total = elementwise.sum()
                ran[k] = ({name: per_position[name].detach().float().cpu() for name in fields[k]}, float(total.detach()))
                return total
            return loss

        riders = [RiderSequence(calls[c].slot, calls[c].data[i].tokens,
                                column_inputs(calls[c].data[i].inputs, j)["target_tokens"].tolist(), loss_fn(k))
                  for k, (c, i, j) in enumerate(keys)]

        def finish() -> None:
            layout = self.trainer.layout
            got = (dict(enumerate(gather_datum_outputs(ran, riders, fields, layout, self.trainer.device)))
                   if layout.dp_size > 1 and riders else ran)
            for c in losses:
                results[c].outputs, results[c].metrics = [], {"loss:sum": 0.0}
            # datum order: each call's loss:sum added up as one rank adds it; a datum's riders are consecutive
            for (c, _), riders_of in groupby(range(len(keys)), key=lambda k: keys[k][:2]):
                parts = []
                for k in riders_of:
                    out, loss_sum = got[k]
                    results[c].metrics["loss:sum"] += loss_sum
                    parts.append(out)
                if keys[k][2] is None:  # one rider: the datum's [n] outputs
                    results[c].outputs.append(parts[0])
                else:  # its K columns: [n, K] outputs
                    results[c].outputs.append({name: torch.stack([p[name] for p in parts], dim=1) for name in parts[0]})
            self._custom_metrics(losses, keys, riders, got, custom_metrics, results)

        return results, riders, finish

    def _custom_metrics(self, losses: dict, keys: list[tuple[int, int]], riders: list[RiderSequence],
                        got: dict[int, DatumOutputs], mine: dict[int, dict], results: list[CallResult]) -> None:
        """The custom calls' metrics (the SDK's combination over each call's datums, in datum order);
        under DP every datum's metrics come from the rank that ran it."""
        names = [tuple(losses[c][2].metric_refs) if losses[c][2] is not None else () for c, _, _ in keys]
        if not any(names):
            return
        layout = self.trainer.layout
        floats = {k: datum_floats(m) for k, m in mine.items()}
        if layout.dp_size > 1:
            floats = gather_datum_metrics(floats, names, riders, layout, self.trainer.device)
        for c in {c for c, _, _ in keys if losses[c][2] is not None}:
            ks = [k for k, (cc, _, _) in enumerate(keys) if cc == c]
            combined = combine_metrics([got[k][1] for k in ks], [floats.get(k, {}) for k in ks])
            results[c].metrics.update({name: v for name, v in combined.items() if name != "loss:sum"})

    # -- optimizer ----------------------------------------------------------------------------

    def optim_step(self, slot: int, adam: AdamStep) -> dict[str, float]:
        adam.check()
        report = self.trainer.adam_step_slot(
            slot, lr=adam.learning_rate, beta1=adam.beta1, beta2=adam.beta2, eps=adam.eps,
            weight_decay=adam.weight_decay, max_grad_norm=adam.grad_clip_norm or None,
        )
        if report["skipped_nonfinite"]:
            raise ValueError(f"the accumulated gradient is not finite (norm {report['grad_norm']}); "
                             "it was discarded and the weights are unchanged")
        return {"grad_norm": report["grad_norm"], "step": float(report["step"])}

    # -- the scheduler's round (trainer/rounds.py) -------------------------------------------------

    def run_round(self, work: RoundWork) -> RoundResult:
        """Forwards, then the mixed pass (the batch and the forward_backward calls), then the
        optimizer steps in order; each part's failure answers only itself (trainer/rounds.py)."""
        out = RoundResult()
        if work.forwards:
            out.forwards = self.forward(work.forwards)
        batch = work.batch if work.batch is not None and work.batch.samples else None
        if batch is not None or work.calls:
            train, out.calls = self.train_with(batch, work.calls)
            if isinstance(train, ValueError):
                out.refused = str(train)
            else:
                out.train = train
        for slot, adam in work.optim:
            try:
                out.optim.append(self.optim_step(slot, adam))
            except ValueError as err:  # a bad parameter or a non-finite gradient: this step only
                out.optim.append(str(err))
        return out


def _columns(inputs: dict) -> tuple[int | None, ...] | range:
    """A datum's riders: one (None) for [n] inputs, its K columns for [n, K] inputs."""
    k = datum_columns(inputs)
    return (None,) if k is None else range(k)


def _output_fields(loss_fn: str) -> tuple[str, ...]:
    """The per-position outputs a call of ``loss_fn`` answers for each datum (Tinker's wire: every
    loss gives ``logprobs``; cross_entropy its ``elementwise_loss`` too)."""
    return ("logprobs", "elementwise_loss") if loss_fn == "cross_entropy" else ("logprobs",)

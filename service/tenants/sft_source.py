"""Supervised examples of one SFT adapter run, as train samples: `SftSource`.

An SFT run needs no rollout: each optimizer step takes `prompts_per_step`
prompt/completion rows from its data source (rollout.data.DataSource, so order,
epochs and the resumable cursor are the same as for RL prompts) and turns each
into one sample:

    tokens    = prompt ids (chat template, generation prompt) + completion ids + EOS
    loss_mask = 0 on the prompt, 1 on the completion and EOS

Accounting follows the loop's rule: rows of a step are `take_step`-n, then
`commit`-ted (consumed) only after the train call that used them succeeded, or
`give_back`-ed (served again first) when it failed. A step is always whole: when
the data has fewer rows left than a step needs, those rows are dropped and the
source reports itself exhausted (the trainer never sees a partial step that
could not complete). The planned total counts on this: service/config_checks.planned_steps.

Length limits: rows whose prompt, completion (+ EOS) or whole sample is over the
limits in the data config (the model's context, the service's limits, filled in
at registration) are skipped and counted by the data source, so no step of this
adapter exceeds samples_per_step x max_sample_tokens. When no row fits at all,
`failure_reason` says why and no step is ever made (the runtime fails the run).

Deterministic: the same cursor gives the same samples in the same order, so a
resumed SFT run trains exactly as an uninterrupted one.
"""

from __future__ import annotations

from rollout.data import DataCursor, DataSource, PromptRow
from rollout.config import DataConfig
from trainer.batch import TrainSample


class SftSource:
    def __init__(self, cfg: DataConfig, tokenizer, *, slot: int, registration_id: str, samples_per_step: int,
                 cursor: DataCursor | None = None) -> None:
        if cfg.label_key is None:
            raise ValueError("an SFT data source needs a completion key (data.label_key)")
        self.source = DataSource(cfg, tokenizer, cursor, completions=True)
        self.slot = slot
        self.registration_id = registration_id
        self.samples_per_step = samples_per_step
        self._dropped_tail = False

    def sample(self, row: PromptRow) -> TrainSample:
        completion = row.completion_ids or []  # the label's tokens + EOS (DataSource, completions=True)
        tokens = [*row.input_ids, *completion]
        mask = [0] * len(row.input_ids) + [1] * len(completion)
        return TrainSample(slot=self.slot, tokens=tokens, loss_mask=mask, registration=self.registration_id)

    def take_step(self) -> tuple[list[PromptRow], list[TrainSample]] | None:
        """One whole step's rows and samples, or None when no whole step is left."""
        rows: list[PromptRow] = []
        while len(rows) < self.samples_per_step:
            row = self.source.take()
            if row is None:
                break
            rows.append(row)
        if len(rows) < self.samples_per_step:
            for row in rows:  # a tail shorter than one step: dropped (see module doc)
                self.source.consume(row)
            self._dropped_tail = self._dropped_tail or bool(rows)
            return None
        return rows, [self.sample(r) for r in rows]

    def commit(self, rows: list[PromptRow]) -> None:
        for row in rows:
            self.source.consume(row)

    def give_back(self, rows: list[PromptRow]) -> None:
        for row in reversed(rows):  # requeue puts each in front: reverse keeps the order
            self.source.requeue(row)

    @property
    def exhausted(self) -> bool:
        return self.source.status().exhausted

    @property
    def failure_reason(self) -> str | None:
        """Why this run can never make a step (no row fits the length limits), or None."""
        return self.source.unusable

    def skip_metrics(self) -> dict[str, float]:
        """Rows skipped so far (rows_skipped_too_long, rows_skipped_oversized), for the step's metrics."""
        return self.source.status().skip_metrics()

    def cursor(self) -> DataCursor:
        return self.source.cursor()

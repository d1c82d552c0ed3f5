"""The floor under a LoRA step, for benchmarks (and the test that it is one): the trainer's own
micro-batches and forward/backward path with LoRA off.

  frozen_base_pass(trainer, batch)   forward+backward of ``batch`` through the frozen base alone
"""

from __future__ import annotations


def frozen_base_pass(trainer, batch) -> float:  # noqa: ANN001 - a trainer.core.MultiLoraTrainer, a TrainBatch
    """Forward+backward of ``batch`` through the frozen base alone (LoRA off), in the
    micro-batches and along the path ``MultiLoraTrainer.train`` uses, the gradient going to the
    input embeddings only; changes no slot. Returns the summed log-prob of the learned tokens.
    Collective like ``train``."""
    import torch

    from trainer.batch import PlannedSample, dp_shard
    from trainer.config import SlotHyperParams
    from trainer.step.micro_batch import MicroBatchTensors, micro_batches

    samples = batch.samples
    planned = [PlannedSample(i, s.slot, 0) for i, s in enumerate(samples)]
    local = dp_shard(planned, trainer.layout.dp_rank, trainer.layout.dp_size)
    total = 0.0
    for mb, _ in micro_batches(local, [len(s.tokens) for s in samples], [], trainer.config):
        mbs = [samples[p.index] for p in mb]
        t = MicroBatchTensors.build(mbs, [SlotHyperParams(objective="sft")] * len(mbs), trainer.device)
        lp = trainer.passes.logprobs(mbs, t.ids, t.labels, lora=False, input_grad=True)
        loss = -torch.where(t.mask, lp, torch.zeros_like(lp)).sum()
        loss.backward()
        total -= float(loss)
    return total

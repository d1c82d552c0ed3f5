"""The training loop (one short driver of the whole loop), publishing stepped weights to the
engines, and what the loop reports: fleet statistics, the batch-mode progress view, TensorBoard.

May import: service.config, service.errors, service.shutdown, service.registry, service.scheduling, service.tenants,
trainer.storage, rollout.
"""

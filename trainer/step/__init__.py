"""One train call: the forward passes with each sample's slot LoRA on, micro-batches and their
forward/backward, and the round runner (every tenant's work of a scheduler round in one call; under DP
its Tinker datums' outputs gathered from the ranks: dp_outputs.py).

May import: trainer.config, trainer.batch, trainer.rounds, trainer.platform, trainer.kernels, trainer.base,
trainer.lora, trainer.losses, trainer.optim.
"""

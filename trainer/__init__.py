"""The trainer: N resident LoRA slots on one frozen Megatron base, trained in mixed-adapter steps.

At the top: the rank's trainer (`core`), its Ray actor body (`actor`), the interface the service
calls (`interface`), the config and the strict base of every config model (`strict_model`), and
the wire types of a train call and a round (`batch`, `rounds`). Below, folders by role: platform,
kernels, lora, base, optim, losses, step, export, swap, storage (each `__init__.py` says what lives
there and what it may import).

trainer/ imports neither service/, rollout/ nor api/, and none of ray, fastapi or sglang at
module level, so the GPU tier runs it alone.

May import: trainer.
"""

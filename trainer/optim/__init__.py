"""Per-slot optimizer steps: AdamW with each slot's own schedule, clipping and moments (fp32, or
bf16 stochastically rounded: compact_state.py), applied to whole rows of the slot buffers, and the
step on a CUDA stream of its own under the next forward.

May import: trainer.config, trainer.platform, trainer.kernels, trainer.lora.
"""

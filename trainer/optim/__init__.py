"""Per-slot optimizer steps: AdamW with each slot's own schedule, clipping and moments, applied
to whole rows of the slot buffers, and the step on a CUDA stream of its own under the next forward.

May import: trainer.config, trainer.platform, trainer.kernels, trainer.lora.
"""

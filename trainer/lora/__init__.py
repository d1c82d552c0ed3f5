"""LoRA slots on the frozen base: the multi-slot linear, expert and unembedding layers, the fused
base+LoRA node, the slot-major buffers that hold every slot's weights, gradients and moments, and
the slot table (who holds each slot, its scales).

May import: trainer.config, trainer.platform, trainer.kernels.
"""

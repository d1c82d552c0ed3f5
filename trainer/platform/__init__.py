"""What the trainer runs on: process groups and Megatron parallel state, the adjustments Megatron
needs on machines without CUDA or TransformerEngine, and the base model folder's config.json.

May import: trainer.config.
"""

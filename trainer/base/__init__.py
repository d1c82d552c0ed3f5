"""The frozen base model: a Hugging Face checkpoint converted by Megatron-Bridge, its layer spec
(fused attention without TransformerEngine), and the packed token stream it runs on.

May import: trainer.config, trainer.platform, trainer.kernels, trainer.lora (the MoE provider settings).
"""

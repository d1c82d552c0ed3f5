"""A slot's whole state out of the device and back: keep-warm eviction into host memory and
spill files (bounded tiers, prefetch), and a slot to a checkpoint folder and back.

May import: trainer.config, trainer.platform, trainer.lora, trainer.storage.
"""

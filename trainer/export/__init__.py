"""Slots as PEFT adapters: the Hugging Face names, the export layout and snapshot, and the
background writers (threads or processes over shared host memory) of publish folders.

May import: trainer.config, trainer.platform, trainer.base, trainer.lora, trainer.storage.
"""

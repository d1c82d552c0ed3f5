"""The one loss table: every objective a tenant may train with (SFT cross-entropy, the GRPO-style
RL loss, the Tinker losses), each with its inputs, config and metrics. Functions over tensors only.

May import: nothing of the product (torch only).
"""

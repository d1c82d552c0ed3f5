"""Kernels of the LoRA step: segmented (grouped) GEMMs over slot segments, their Triton forms,
the AdamW row update, rotary embedding and the chunked log-probs. Plain functions over tensors:
nothing here knows a slot, an adapter or a tenant.

May import: trainer.platform.
"""

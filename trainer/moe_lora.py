"""Mixture-of-experts bases: LoRA slots on every routed expert, grouped by (expert, slot).

Filled in below; ``moe_provider_overrides`` is what the frozen base needs first.
"""

from __future__ import annotations

from typing import Any

from trainer.cpu_compat import transformer_engine_available


def moe_provider_overrides() -> dict[str, Any]:
    """Provider fields for an MoE base, set before the model is built.

    * No auxiliary losses (load balancing, z-loss) and no input jitter: the router is
      frozen, so a load-balancing loss could only move the LoRA weights upstream of the
      router, and it is a statistic over *all* tokens of a micro-batch (expert load x
      mean router probability), which couples the adapters that share it: with it, an
      adapter would not get the gradient it gets alone. Off for every adapter.
    * Dropless (no capacity factor): with token dropping, whether a token is processed
      depends on the other tokens of the micro-batch (the same coupling).
    * No fused permutation without TransformerEngine (megatron-core refuses it).
    """
    out: dict[str, Any] = {
        "moe_aux_loss_coeff": 0.0,
        "moe_router_load_balancing_type": "none",
        "moe_z_loss_coeff": None,
        "moe_input_jitter_eps": None,
        "moe_expert_capacity_factor": None,
        # The all-to-all dispatcher makes a CUDA stream when built; all-gather does not, and
        # with one expert-parallel rank both are a local permutation.
        "moe_token_dispatcher_type": "allgather",
    }
    if not transformer_engine_available():
        out["moe_permute_fusion"] = False
    return out

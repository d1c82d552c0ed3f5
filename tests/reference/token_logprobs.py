"""The unchunked reference of trainer/kernels/chunked_logprobs.py, tests only: the whole fp32 logits
matrix (each LoRA segment's delta added), log_softmax, gather. Written from the definition

    logprob[t] = log_softmax((h[t] @ W^T + z[t] @ B_k^T) / temperature)[target[t]]   (t in slot k's segment)

with 0 at targets equal to IGNORE_TARGET; it holds the [tokens, vocab] matrix the chunked kernel avoids.
"""

from __future__ import annotations

import torch

from trainer.kernels.chunked_logprobs import IGNORE_TARGET, LogitLora


def full_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
    lora: LogitLora | None = None,
) -> torch.Tensor:
    """Log-probs of ``targets`` (shaped like ``hidden`` without its last dim) under the full logits."""
    logits = hidden @ weight.t()
    if lora is not None:
        flat = logits.reshape(-1, logits.shape[-1])
        pieces, at = [], 0
        for k, start, end in lora.segments:
            pieces += [flat.new_zeros(start - at, flat.shape[1]), lora.z[start:end] @ lora.lora_b[k].t()]
            at = end
        pieces.append(flat.new_zeros(flat.shape[0] - at, flat.shape[1]))
        logits = (flat + torch.cat(pieces)).view(logits.shape)
    logits = logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    safe = targets.clamp(min=0)
    out = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != IGNORE_TARGET, out, torch.zeros_like(out))

"""Per-token log-probs over a large vocabulary without materializing full fp32 logits.

For T tokens and a vocabulary V, full logits are T x V (16384 x 151936 fp32 = 10 GB,
plus the same again for their gradient). Here the logits are computed a chunk of
tokens at a time from the final hidden states and the output weight; forward keeps
only the per-token log-sum-exp (fp32, T values), backward recomputes each chunk's
logits and turns them into the hidden-state (and, if it trains, weight) gradient right
away. Peak extra memory: one chunk's logits, ``chunk_size x V`` in fp32.

Numerics: logits are the matmul in the hidden states' dtype (as Megatron's output
layer computes them), then fp32 for log-softmax, as in Megatron's and Hugging Face's
cross-entropy paths. ``-token_logprobs`` is the cross-entropy.

Tensor parallel (vocab-parallel output layer): pass ``tp_group`` and the local vocab
shard as ``weight``; max, sum-exp and the target logit are all-reduced across the
group, and the hidden-state gradient is all-reduced in backward (what Megatron's
``ColumnParallelLinear`` input copy does). Sequence parallel hidden states must be
gathered by the caller first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

IGNORE_TARGET = -100


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    logits = (h @ weight.t()).float()
    if inv_temperature != 1.0:
        logits = logits * inv_temperature
    return logits


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, inv_temperature, tp_group, vocab_start):
        total = hidden.shape[0]
        vocab_local = weight.shape[0]
        lse = torch.empty(total, dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(total, dtype=torch.float32, device=hidden.device)
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            logits = _chunk_logits(hidden[start:end], weight, inv_temperature)
            tgt = targets[start:end]
            local_tgt = tgt - vocab_start
            owned = (local_tgt >= 0) & (local_tgt < vocab_local)
            tgt_logit = logits.gather(1, local_tgt.clamp(0, vocab_local - 1).unsqueeze(1)).squeeze(1)
            tgt_logit = torch.where(owned, tgt_logit, torch.zeros_like(tgt_logit))
            if tp_group is None:
                chunk_lse = torch.logsumexp(logits, dim=1)
            else:
                m = logits.max(dim=1).values
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
                s = torch.exp(logits - m.unsqueeze(1)).sum(dim=1)
                dist.all_reduce(s, group=tp_group)
                chunk_lse = m + torch.log(s)
                dist.all_reduce(tgt_logit, group=tp_group)
            del logits
            valid = tgt != IGNORE_TARGET
            lse[start:end] = chunk_lse
            logprobs[start:end] = torch.where(valid, tgt_logit - chunk_lse, torch.zeros_like(chunk_lse))
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        ctx.vocab_start = vocab_start
        ctx.mark_non_differentiable(lse)
        return logprobs, lse

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_lse):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        vocab_local = weight.shape[0]
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            tgt = targets[start:end]
            g = torch.where(tgt != IGNORE_TARGET, grad_logprobs[start:end].float(), 0.0)
            # d logprob / d logits = onehot(target) - softmax; chain the upstream grad g.
            probs = torch.exp(_chunk_logits(h, weight, ctx.inv_temperature) - lse[start:end].unsqueeze(1))
            grad_logits = probs.mul_(-g.unsqueeze(1))
            local_tgt = tgt - ctx.vocab_start
            owned = (local_tgt >= 0) & (local_tgt < vocab_local)
            rows = torch.nonzero(owned).squeeze(1)
            grad_logits[rows, local_tgt[rows]] += g[rows]
            if ctx.inv_temperature != 1.0:
                grad_logits.mul_(ctx.inv_temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_h:
                grad_h[start:end] = grad_logits @ weight
            if need_w:
                grad_w += (grad_logits.t() @ h).float()
            del probs, grad_logits
        if need_h and ctx.tp_group is not None:
            dist.all_reduce(grad_h, group=ctx.tp_group)
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 2048,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """log p(targets[t] | hidden[t]) for every token, fp32, shape of ``targets``.

    hidden: [..., H] final (normed) hidden states; weight: [V or V/tp, H] output weight;
    targets: [...] token ids, IGNORE_TARGET (-100) where there is no target (those
    positions get 0 and no gradient). ``temperature`` divides the logits, as a sampler
    with that temperature did. Differentiable in hidden and weight.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on token dims")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size {hidden.shape[-1]} != output weight's input size {weight.shape[1]}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab_start = 0
    if tp_group is not None:
        vocab_start = dist.get_rank(tp_group) * weight.shape[0]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    if tp_group is None:
        bad = (flat_t != IGNORE_TARGET) & ((flat_t < 0) | (flat_t >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"targets must be in [0, {weight.shape[0]}) or {IGNORE_TARGET}")
    logprobs, _ = _ChunkedTokenLogprobs.apply(
        flat_h, weight, flat_t, int(chunk_size), 1.0 / float(temperature), tp_group, vocab_start
    )
    return logprobs.reshape(targets.shape)


def full_token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The unchunked reference: full fp32 logits, log_softmax, gather."""
    logits = (hidden @ weight.t()).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    safe = targets.clamp(min=0)
    out = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != IGNORE_TARGET, out, torch.zeros_like(out))


class LogprobOutputProcessor:
    """A ``GPTModel.forward(output_processor=...)`` hook returning chunked log-probs.

    ``model(tokens, position_ids, None, packed_seq_params=..., output_processor=proc,
    output_processor_context=targets)`` with ``targets`` shaped like ``tokens`` ([b, s])
    returns fp32 log-probs [b, s] instead of logits; the final hidden states go straight
    into ``chunked_token_logprobs`` (no [s, b, V] logits tensor is ever made).
    """

    def __init__(self, chunk_size: int = 2048, temperature: float = 1.0, tp_group: dist.ProcessGroup | None = None):
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.tp_group = tp_group

    def __call__(self, *, hidden_states, output_layer, output_weight, context, **_: Any) -> torch.Tensor:
        if context is None:
            raise ValueError("pass the targets ([b, s] token ids) as output_processor_context")
        weight = output_weight if output_weight is not None else output_layer.weight
        # hidden_states: [s, b, h] -> [b, s, h] to line up with the [b, s] targets.
        return chunked_token_logprobs(
            hidden_states.transpose(0, 1), weight, context, self.chunk_size, self.temperature, self.tp_group
        )

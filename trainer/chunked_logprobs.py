"""Per-token log-probs over a large vocabulary without materializing full fp32 logits.

For T tokens and a vocabulary V, full logits are T x V (16384 x 151936 fp32 = 10 GB,
plus the same again for their gradient). Here the logits exist one chunk of tokens
at a time, computed from the final hidden states and the output weight.

The hidden-state gradient is formed in forward, while the chunk's logits are at hand:
log p(t | h) has d/dh = (onehot(t) - softmax) @ W / temperature, a [T, H] tensor
(``u`` below, kept in the hidden dtype), and backward only scales it by the upstream
gradient. So there is no second pass over the logits and no logits recompute: two
vocabulary GEMMs per chunk (logits, then ``(softmax - onehot) @ W``), as the full
path has, and far fewer elementwise passes over chunk x V. ``u`` is only made when a
gradient will be asked for (grad mode on and hidden requires grad). A trainable
output weight (not the lorafleet case: the base is frozen) takes the classic route:
forward keeps the log-sum-exp, backward recomputes each chunk's logits.

Numerics: logits are the matmul in the hidden states' dtype (as Megatron's output
layer computes them), log-softmax in fp32 (as Megatron's and Hugging Face's
cross-entropy paths do); ``(softmax - onehot)`` is rounded to the hidden dtype before
its GEMM, as the full path's logits gradient is. ``-token_logprobs`` is the
cross-entropy.

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
    """Logits in the compute dtype; fp32 when a temperature scales them."""
    logits = h @ weight.t()
    if inv_temperature != 1.0:
        logits = logits.float() * inv_temperature
    return logits


def _chunk_forward(h, weight, tgt, inv_temperature, tp_group, vocab_start, want_u):
    """(logprobs fp32 [c], lse fp32 [c], u [c, H] or None) for one chunk of tokens.

    u = (softmax - onehot(target)) @ W: minus the gradient of the log-prob w.r.t. h
    (before the temperature factor); rows of ignored targets are left as they come.
    """
    vocab_local = weight.shape[0]
    logits = _chunk_logits(h, weight, inv_temperature)
    local_tgt = tgt - vocab_start
    owned = (local_tgt >= 0) & (local_tgt < vocab_local)
    idx = local_tgt.clamp(0, vocab_local - 1).unsqueeze(1)
    if tp_group is None:
        logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)
        lp = logp.gather(1, idx).squeeze(1)
        lse = logits.gather(1, idx).squeeze(1).float() - lp
        del logp
        probs = torch.softmax(logits, dim=1) if want_u else None  # compute dtype, fp32 inside
    else:
        tgt_logit = logits.gather(1, idx).squeeze(1).float()
        tgt_logit = torch.where(owned, tgt_logit, torch.zeros_like(tgt_logit))
        dist.all_reduce(tgt_logit, group=tp_group)
        f = logits.float()  # may alias fp32 logits: only in-place use below, after the gather
        m = f.max(dim=1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        f.sub_(m.unsqueeze(1))
        s = f.exp().sum(dim=1)
        dist.all_reduce(s, group=tp_group)
        lse = m + torch.log(s)
        lp = tgt_logit - lse
        probs = f.sub_((lse - m).unsqueeze(1)).exp_().to(h.dtype) if want_u else None
        del f
    del logits
    u = None
    if want_u:
        rows = torch.nonzero(owned).squeeze(1)
        # softmax - onehot: the target column becomes p_t - 1, taken from the fp32 log-prob.
        probs[rows, local_tgt[rows]] = (torch.exp(lp[rows]) - 1.0).to(probs.dtype)
        u = probs.to(h.dtype) @ weight
        del probs
    return lp, lse, u


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, inv_temperature, tp_group, vocab_start, want_u):
        total = hidden.shape[0]
        lse = torch.empty(total, dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(total, dtype=torch.float32, device=hidden.device)
        u_all = torch.empty_like(hidden) if want_u else None
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            tgt = targets[start:end]
            lp, chunk_lse, u = _chunk_forward(
                hidden[start:end], weight, tgt, inv_temperature, tp_group, vocab_start, want_u
            )
            lse[start:end] = chunk_lse
            logprobs[start:end] = torch.where(tgt != IGNORE_TARGET, lp, torch.zeros_like(lp))
            if want_u:
                u_all[start:end] = u
        need_w = weight.requires_grad
        ctx.save_for_backward(
            u_all,
            hidden if need_w else None,
            weight if need_w else None,
            targets,
            lse if need_w else None,
        )
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        ctx.vocab_start = vocab_start
        ctx.mark_non_differentiable(lse)
        return logprobs, lse

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_lse):
        u_all, hidden, weight, targets, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = torch.where(targets != IGNORE_TARGET, grad_logprobs.float(), 0.0)
        grad_h = grad_w = None
        if need_h:
            if u_all is None:
                raise RuntimeError("chunked_token_logprobs ran without a hidden-state gradient; cannot backprop to it")
            grad_h = (u_all.float() * (-ctx.inv_temperature * g).unsqueeze(1)).to(u_all.dtype)
            if ctx.tp_group is not None:
                dist.all_reduce(grad_h, group=ctx.tp_group)
        if need_w:
            grad_w = _weight_grad(hidden, weight, targets, lse, g, ctx)
        return grad_h, grad_w, None, None, None, None, None, None


def _weight_grad(hidden, weight, targets, lse, g, ctx) -> torch.Tensor:
    """dW = sum_t g_t (onehot_t - p_t)^T h_t / temperature, recomputing each chunk's logits."""
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    vocab_local = weight.shape[0]
    for start in range(0, hidden.shape[0], ctx.chunk_size):
        end = min(start + ctx.chunk_size, hidden.shape[0])
        h = hidden[start:end]
        gc = g[start:end]
        probs = torch.exp(_chunk_logits(h, weight, ctx.inv_temperature).float() - lse[start:end].unsqueeze(1))
        grad_logits = probs.mul_(-gc.unsqueeze(1))
        local_tgt = targets[start:end] - ctx.vocab_start
        rows = torch.nonzero((local_tgt >= 0) & (local_tgt < vocab_local)).squeeze(1)
        grad_logits[rows, local_tgt[rows]] += gc[rows]
        grad_logits = (grad_logits * ctx.inv_temperature).to(hidden.dtype)
        grad_w += (grad_logits.t() @ h).float()
        del probs, grad_logits
    return grad_w.to(weight.dtype)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
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
    want_u = torch.is_grad_enabled() and hidden.requires_grad
    logprobs, _ = _ChunkedTokenLogprobs.apply(
        flat_h, weight, flat_t, int(chunk_size), 1.0 / float(temperature), tp_group, vocab_start, want_u
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

    def __init__(self, chunk_size: int = 4096, temperature: float = 1.0, tp_group: dist.ProcessGroup | None = None):
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

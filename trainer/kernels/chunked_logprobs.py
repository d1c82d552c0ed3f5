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

LoRA on the unembedding (``LogitLora``, from trainer/lora/unembed_lora.py): segment k of the tokens
(one slot) gets ``z[t] @ B_k^T`` added to its logits before the log-softmax, in every chunk the
segment overlaps (a chunk boundary may fall anywhere inside a segment); z = scale * x A^T [T, R]
comes in with its graph, B [N, V or V/tp, R] is the stacked parameter (split over the vocabulary
like the weight). Their gradients need the upstream gradient inside the vocabulary sum
(dB_k = sum_t g_t (onehot_t - p_t)^T z_t), so backward recomputes the logits of the chunks that
hold such tokens (one more vocabulary GEMM there, from the saved log-sum-exp) and forms dB and dz
chunk by chunk; dz is all-reduced over TP with the hidden-state gradient, dB is each rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

IGNORE_TARGET = -100


@dataclass
class LogitLora:
    """A per-slot LoRA delta on the logits: token t of ``segments`` entry (k, start, end) gets
    ``z[t] @ lora_b[k]^T``; tokens in no segment get nothing.

    z [T, R] (already scaled, differentiable), lora_b [N, V_local, R] (the stacked parameter),
    segments (slot, start, end) over the flattened tokens, ascending and disjoint."""

    z: torch.Tensor
    lora_b: torch.Tensor
    segments: list[tuple[int, int, int]]

    def in_chunk(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(slot, lo, hi): the rows [lo, hi) of chunk [start, end) that each segment covers."""
        return [(k, max(s, start) - start, min(e, end) - start) for k, s, e in self.segments if s < end and e > start]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_temperature: float,
                  delta: list[tuple[torch.Tensor, torch.Tensor, int, int]] = ()) -> torch.Tensor:
    """Logits in the compute dtype (the LoRA ``delta`` rows added: (z rows, B_k, lo, hi) each);
    fp32 when a temperature scales them."""
    logits = h @ weight.t()
    for z, b, lo, hi in delta:
        logits[lo:hi] += z @ b.t()
    if inv_temperature != 1.0:
        logits = logits.float() * inv_temperature
    return logits


def _chunk_delta(lora: LogitLora | None, start: int, end: int, dtype: torch.dtype) -> list:
    """The chunk's LoRA rows for _chunk_logits, B cast to the compute dtype per use (no copy of
    every slot's B is kept)."""
    if lora is None:
        return []
    return [(lora.z[start + lo : start + hi].to(dtype), lora.lora_b[k].to(dtype), lo, hi)
            for k, lo, hi in lora.in_chunk(start, end)]


def _chunk_forward(h, weight, tgt, inv_temperature, tp_group, vocab_start, want_u, delta=()):
    """(logprobs fp32 [c], lse fp32 [c], u [c, H] or None) for one chunk of tokens.

    u = (softmax - onehot(target)) @ W: minus the gradient of the log-prob w.r.t. h
    (before the temperature factor) through the base weight; rows of ignored targets are left
    as they come. ``delta``: the LoRA rows of the chunk (_chunk_delta).
    """
    vocab_local = weight.shape[0]
    logits = _chunk_logits(h, weight, inv_temperature, delta)
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
        # softmax - onehot: the target column becomes p_t - 1, taken from the fp32 log-prob.
        _set_at_targets(probs, idx.squeeze(1), owned, lambda cur: (torch.exp(lp) - 1.0).to(probs.dtype))
        u = probs.to(h.dtype) @ weight
        del probs
    return lp, lse, u


def _set_at_targets(m: torch.Tensor, col: torch.Tensor, owned: torch.Tensor, value) -> None:  # noqa: ANN001
    """m[t, col[t]] = value(m[t, col[t]]) for the rows t whose target this rank ``owned``, in place;
    the other rows are written back unchanged. Every row is indexed (``col`` clamped into the
    shard), so no ``nonzero`` of the owned rows: its output size would need a host sync per chunk.
    One (row, column) pair per row: the writes never collide."""
    rows = torch.arange(m.shape[0], device=m.device)
    cur = m[rows, col]
    m[rows, col] = torch.where(owned, value(cur), cur)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, inv_temperature, tp_group, vocab_start, want_u,
                lora_z, lora_b, lora):
        total = hidden.shape[0]
        lse = torch.empty(total, dtype=torch.float32, device=hidden.device)
        logprobs = torch.empty(total, dtype=torch.float32, device=hidden.device)
        u_all = torch.empty_like(hidden) if want_u else None
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            tgt = targets[start:end]
            lp, chunk_lse, u = _chunk_forward(
                hidden[start:end], weight, tgt, inv_temperature, tp_group, vocab_start, want_u,
                _chunk_delta(lora, start, end, hidden.dtype),
            )
            lse[start:end] = chunk_lse
            logprobs[start:end] = torch.where(tgt != IGNORE_TARGET, lp, torch.zeros_like(lp))
            if want_u:
                u_all[start:end] = u
        need_w = weight.requires_grad
        need_lora = lora is not None and (lora_z.requires_grad or lora_b.requires_grad)
        recompute = need_w or need_lora  # the backward passes that rebuild chunk logits
        keep_lora = lora is not None and recompute
        ctx.save_for_backward(
            u_all,
            hidden if recompute else None,
            weight if recompute else None,
            targets,
            lse if recompute else None,
            lora_z if keep_lora else None,
            lora_b if keep_lora else None,
        )
        ctx.lora_segments = lora.segments if keep_lora else None
        ctx.need_lora = need_lora
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        ctx.tp_group = tp_group
        ctx.vocab_start = vocab_start
        ctx.mark_non_differentiable(lse)
        return logprobs, lse

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_lse):
        u_all, hidden, weight, targets, lse, lora_z, lora_b = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = torch.where(targets != IGNORE_TARGET, grad_logprobs.float(), 0.0)
        lora = None if ctx.lora_segments is None else LogitLora(z=lora_z, lora_b=lora_b, segments=ctx.lora_segments)
        grad_h = grad_w = grad_z = grad_b = None
        if ctx.need_lora:
            grad_z, grad_b = _lora_grads(hidden, weight, targets, lse, g, lora, ctx)
        if need_h:
            if u_all is None:
                raise RuntimeError("chunked_token_logprobs ran without a hidden-state gradient; cannot backprop to it")
            grad_h = (u_all.float() * (-ctx.inv_temperature * g).unsqueeze(1)).to(u_all.dtype)
        if ctx.tp_group is not None and (grad_h is not None or grad_z is not None):
            # Both are sums over the vocabulary, of which this rank holds a shard: one all-reduce.
            parts = [t for t in (grad_h, grad_z) if t is not None]
            flat = torch.cat([t.reshape(-1).float() for t in parts])
            dist.all_reduce(flat, group=ctx.tp_group)
            if grad_h is not None:
                grad_h = flat[: grad_h.numel()].view_as(grad_h).to(grad_h.dtype)
            if grad_z is not None:
                grad_z = flat[flat.numel() - grad_z.numel() :].view_as(grad_z).to(grad_z.dtype)
        if need_w:
            grad_w = _weight_grad(hidden, weight, targets, lse, g, ctx, lora)
        return (grad_h, grad_w, None, None, None, None, None, None,
                grad_z if ctx.needs_input_grad[8] else None, grad_b if ctx.needs_input_grad[9] else None, None)


def _grad_logits(h, weight, targets, lse, gc, start, end, ctx, delta=()) -> torch.Tensor:
    """d(sum_t g_t log p_t)/d logits of chunk [start, end): g_t (onehot_t - p_t) / temperature,
    fp32, from the chunk's logits recomputed (with the LoRA ``delta`` rows) and the saved lse."""
    vocab_local = weight.shape[0]
    probs = torch.exp(_chunk_logits(h, weight, ctx.inv_temperature, delta).float() - lse[start:end].unsqueeze(1))
    grad_logits = probs.mul_(-gc.unsqueeze(1))
    local_tgt = targets[start:end] - ctx.vocab_start
    owned = (local_tgt >= 0) & (local_tgt < vocab_local)
    _set_at_targets(grad_logits, local_tgt.clamp(0, vocab_local - 1), owned, lambda cur: cur + gc)
    return grad_logits.mul_(ctx.inv_temperature)


def _weight_grad(hidden, weight, targets, lse, g, ctx, lora: LogitLora | None) -> torch.Tensor:
    """dW = sum_t g_t (onehot_t - p_t)^T h_t / temperature, recomputing each chunk's logits."""
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, hidden.shape[0], ctx.chunk_size):
        end = min(start + ctx.chunk_size, hidden.shape[0])
        h = hidden[start:end]
        delta = _chunk_delta(lora, start, end, h.dtype)
        grad_logits = _grad_logits(h, weight, targets, lse, g[start:end], start, end, ctx, delta).to(hidden.dtype)
        grad_w += (grad_logits.t() @ h).float()
        del grad_logits
    return grad_w.to(weight.dtype)


def _lora_grads(hidden, weight, targets, lse, g, lora: LogitLora, ctx) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dz [T, R], dB [N, V_local, R] or None) of sum_t g_t log p_t: per chunk holding LoRA tokens,
    the logits are recomputed and each segment's rows give dB_k += grad_logits^T z and
    dz = grad_logits @ B_k (compute dtype GEMMs, accumulated in fp32). dz is this rank's part
    under TP (the caller all-reduces it). A leaf B (the trainer's stacked parameter) gets dB
    accumulated into its ``.grad`` in place, only the rows of the segments' slots (None is
    returned: no dense [N, V, R] gradient is made, as the fused LoRA node does, fused_lora.py);
    another B gets the dense gradient returned."""
    z, lora_b = lora.z, lora.lora_b
    grad_z = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    in_place = lora_b.requires_grad and lora_b.is_leaf
    if in_place:
        if lora_b.grad is None:  # as autograd would; the trainer presets it (SlotBuffers)
            lora_b.grad = torch.zeros_like(lora_b)
        grad_b = lora_b.grad
    else:
        grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=lora_b.device)
    for start in range(0, hidden.shape[0], ctx.chunk_size):
        end = min(start + ctx.chunk_size, hidden.shape[0])
        rows = lora.in_chunk(start, end)
        if not rows:
            continue  # no LoRA token here: nothing to recompute
        h = hidden[start:end]
        delta = _chunk_delta(lora, start, end, h.dtype)
        grad_logits = _grad_logits(h, weight, targets, lse, g[start:end], start, end, ctx, delta).to(h.dtype)
        for (k, lo, hi), (zc, bc, _, _) in zip(rows, delta):
            gl = grad_logits[lo:hi]
            grad_b[k] += (gl.t() @ zc).to(grad_b.dtype)
            grad_z[start + lo : start + hi] = (gl @ bc).float()
        del grad_logits
    return grad_z.to(z.dtype), None if in_place else grad_b.to(lora_b.dtype)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    lora: LogitLora | None = None,
) -> torch.Tensor:
    """log p(targets[t] | hidden[t]) for every token, fp32, shape of ``targets``.

    hidden: [..., H] final (normed) hidden states; weight: [V or V/tp, H] output weight;
    targets: [...] token ids, IGNORE_TARGET (-100) where there is no target (those
    positions get 0 and no gradient). ``temperature`` divides the logits, as a sampler
    with that temperature did. ``lora``: a per-slot LoRA delta on the logits (module doc),
    over the flattened tokens. Differentiable in hidden and weight (and lora's z and B).
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
    if lora is not None:
        if lora.z.shape[0] != flat_h.shape[0] or lora.lora_b.shape[1] != weight.shape[0]:
            raise ValueError(f"lora z {tuple(lora.z.shape)} / B {tuple(lora.lora_b.shape)} do not fit "
                             f"{flat_h.shape[0]} tokens and a vocabulary shard of {weight.shape[0]}")
        ends = [0] + [e for seg in lora.segments for e in seg[1:]]
        if ends != sorted(ends) or ends[-1] > flat_h.shape[0] or any(not 0 <= k < lora.lora_b.shape[0] for k, _, _ in lora.segments):
            raise ValueError(f"lora segments {lora.segments[:4]}...: need ascending, disjoint (slot, start, end) within "
                             f"{flat_h.shape[0]} tokens and slots 0..{lora.lora_b.shape[0] - 1}")
        if not lora.segments:
            lora = None
    want_u = torch.is_grad_enabled() and hidden.requires_grad
    z = lora.z if lora is not None else None
    b = lora.lora_b if lora is not None else None
    logprobs, _ = _ChunkedTokenLogprobs.apply(
        flat_h, weight, flat_t, int(chunk_size), 1.0 / float(temperature), tp_group, vocab_start, want_u, z, b, lora
    )
    return logprobs.reshape(targets.shape)


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
        # hidden_states: [s, b, h] -> [b, s, h] to line up with the [b, s] targets (sample-major
        # tokens, the LoRA routing's order).
        hidden = hidden_states.transpose(0, 1)
        lora = None
        logit_lora = getattr(output_layer, "logit_lora", None)  # the unembedding's LoRA slots (unembed_lora.py)
        if logit_lora is not None:
            lora = logit_lora(hidden.reshape(-1, hidden.shape[-1]))
        return chunked_token_logprobs(hidden, weight, context, self.chunk_size, self.temperature, self.tp_group,
                                      lora=lora)

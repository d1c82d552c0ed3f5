"""Chunked log-probs == full-logits log-probs: values and gradients (fp32, CPU).

Also the vocab-parallel form (two gloo processes, each holding half the vocabulary)
against the unsharded result, and the unembedding LoRA delta (LogitLora: per-slot segments
of tokens get z @ B_k^T on their logits) against a reference written from its definition
(tests/reference/token_logprobs.py): full logits x W^T plus, token by token, z_t B_{slot(t)}^T,
then log_softmax; chunk boundaries before, inside and after the segments; under TP with B split
over the vocabulary.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.reference.token_logprobs import full_token_logprobs
from trainer.kernels.chunked_logprobs import IGNORE_TARGET, LogitLora, chunked_token_logprobs

pytestmark = pytest.mark.unit


def _problem(tokens=37, hidden=24, vocab=101, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[[0, 5, tokens - 1]] = IGNORE_TARGET  # positions without a next token
    up = torch.randn(tokens, generator=g)
    return h, w, t, up


def _value_and_grads(fn, h, w, t, up, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    lp = fn(h, w, t, **kw)
    (lp * up).sum().backward()
    return lp.detach(), h.grad, w.grad


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("chunk_size", [1, 7, 36, 37, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_matches_full_fp32(chunk_size, temperature):
    h, w, t, up = _problem()
    ref = _value_and_grads(full_token_logprobs, h, w, t, up, temperature=temperature)
    got = _value_and_grads(chunked_token_logprobs, h, w, t, up, chunk_size=chunk_size, temperature=temperature)
    assert got[0].dtype == torch.float32
    assert (got[0] - ref[0]).abs().max().item() <= 2e-6
    assert got[0][t == IGNORE_TARGET].eq(0).all()
    for name, a, b in zip(("dh", "dw"), got[1:], ref[1:]):
        assert rel_err(a, b) <= 2e-6, name
    assert ref[0].abs().max() > 1.0  # a real distribution, not a flat one


def test_batched_shapes_and_frozen_weight():
    """[b, s, h] hidden with [b, s] targets; a frozen weight gets no gradient."""
    h, w, t, up = _problem(tokens=36)
    h3, t3 = h.reshape(4, 9, -1).requires_grad_(), t.reshape(4, 9)
    lp = chunked_token_logprobs(h3, w, t3, chunk_size=5)
    assert lp.shape == (4, 9)
    lp.sum().backward()
    assert h3.grad is not None and w.grad is None
    assert torch.allclose(lp.reshape(-1), full_token_logprobs(h, w, t), atol=2e-6)


def test_bf16_matches_the_bf16_full_path():
    h, w, t, up = _problem(dtype=torch.bfloat16)
    ref = _value_and_grads(full_token_logprobs, h, w, t, up)
    got = _value_and_grads(chunked_token_logprobs, h, w, t, up, chunk_size=8)
    assert rel_err(got[0], ref[0]) <= 1e-6  # same bf16 logits, same fp32 softmax
    assert got[1].dtype == torch.bfloat16
    for a, b in zip(got[1:], ref[1:]):
        assert rel_err(a, b) <= 1e-2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunk_size=0), "chunk_size"),
        (dict(temperature=0.0), "temperature"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    h, w, t, _ = _problem()
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(h, w, t, **kwargs)


def test_bad_shapes_and_targets_are_refused():
    h, w, t, _ = _problem()
    with pytest.raises(ValueError, match="disagree"):
        chunked_token_logprobs(h, w, t[:-1])
    with pytest.raises(ValueError, match="hidden size"):
        chunked_token_logprobs(h[:, :-1], w, t)
    bad = t.clone()
    bad[3] = w.shape[0]
    with pytest.raises(ValueError, match=r"targets must be in \[0, 101\)"):
        chunked_token_logprobs(h, w, bad)


# ---- vocab-parallel (tensor parallel 2, gloo) ------------------------------------------


def _tp_worker(rank, port, result_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        h, w, t, up = _problem(vocab=100)
        shard = w[rank * 50 : (rank + 1) * 50]
        hh = h.detach().clone().requires_grad_()
        ww = shard.detach().clone().requires_grad_()
        lp = chunked_token_logprobs(hh, ww, t, chunk_size=6, tp_group=dist.group.WORLD)
        (lp * up).sum().backward()
        torch.save({"lp": lp.detach(), "dh": hh.grad, "dw": ww.grad}, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def _two_ranks(worker, tmp_path) -> list[dict]:
    """Run ``worker(rank, port, path)`` on two gloo processes; their saved results, by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    mp.start_processes(worker, args=(port, str(tmp_path / "r")), nprocs=2, start_method="spawn", join=True)
    return [torch.load(tmp_path / f"r.{r}") for r in range(2)]


def test_vocab_parallel_two_ranks_match_unsharded(tmp_path):
    outs = _two_ranks(_tp_worker, tmp_path)
    h, w, t, up = _problem(vocab=100)
    ref_lp, ref_dh, ref_dw = _value_and_grads(full_token_logprobs, h, w, t, up)
    for out in outs:  # every rank has the full log-probs and the full hidden gradient
        assert (out["lp"] - ref_lp).abs().max().item() <= 2e-6
        assert rel_err(out["dh"], ref_dh) <= 2e-6
    assert rel_err(torch.cat([outs[0]["dw"], outs[1]["dw"]]), ref_dw) <= 2e-6


def test_weight_only_gradient_and_no_grad_mode():
    """A trainable output weight with frozen hidden states (the classic recompute route),
    and a forward under no_grad (no gradient state is built)."""
    h, w, t, up = _problem()
    ref = _value_and_grads(full_token_logprobs, h, w, t, up)
    ww = w.detach().clone().requires_grad_()
    lp = chunked_token_logprobs(h, ww, t, chunk_size=9)
    (lp * up).sum().backward()
    assert rel_err(ww.grad, ref[2]) <= 2e-6
    with torch.no_grad():
        lp0 = chunked_token_logprobs(h.requires_grad_(), w, t, chunk_size=9)
    assert lp0.grad_fn is None and (lp0 - ref[0]).abs().max().item() <= 2e-6


# ---- LoRA on the unembedding ----------------------------------------------------------------

SEGMENTS = [(0, 0, 9), (2, 9, 25)]  # tokens 25.. belong to a slot without unembedding LoRA (slot 1)
LP_TOL = 1e-5  # log-probs down to -20: a few fp32 ulps, summed in another order


def _lora_problem(tokens=37, rank=4, slots=3, vocab=101, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(tokens, rank, generator=g) * 0.7).to(dtype)
    b = (torch.randn(slots, vocab, rank, generator=g) * 0.8).to(dtype)
    return z, b


def _reference_logprobs(h, w, t, z, b, segments, temperature=1.0):
    """From the definition, token by token: logits_t = W h_t (+ z_t B_k^T for t in slot k's segment)."""
    slot_of = {}
    for k, s, e in segments:
        for i in range(s, e):
            slot_of[i] = k
    rows = []
    for i in range(h.shape[0]):
        logits = w @ h[i]
        if i in slot_of:
            logits = logits + b[slot_of[i]] @ z[i]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        rows.append(logp[t[i]] if t[i] != IGNORE_TARGET else logp.new_zeros(()))
    return torch.stack(rows)


def _lora_value_and_grads(fn, h, w, t, up, z, b, segments, **kw):
    h, w, z, b = (x.detach().clone().requires_grad_() for x in (h, w, z, b))
    if fn is _reference_logprobs:
        lp = fn(h, w, t, z, b, segments, **kw)
    else:
        lp = fn(h, w, t, lora=LogitLora(z=z, lora_b=b, segments=segments), **kw)
    (lp * up).sum().backward()
    return lp.detach(), h.grad, w.grad, z.grad, b.grad


@pytest.mark.parametrize("chunk_size", [1, 7, 9, 10, 25, 26, 36, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_unembed_lora_chunked_matches_the_definition(chunk_size, temperature):
    h, w, t, up = _problem()
    z, b = _lora_problem()
    ref = _lora_value_and_grads(_reference_logprobs, h, w, t, up, z, b, SEGMENTS, temperature=temperature)
    got = _lora_value_and_grads(chunked_token_logprobs, h, w, t, up, z, b, SEGMENTS, chunk_size=chunk_size,
                                temperature=temperature)
    full = _lora_value_and_grads(full_token_logprobs, h, w, t, up, z, b, SEGMENTS, temperature=temperature)
    assert (got[0] - ref[0]).abs().max().item() <= LP_TOL
    assert (full[0] - ref[0]).abs().max().item() <= LP_TOL
    for name, a, c, r in zip(("dh", "dw", "dz", "dB"), got[1:], full[1:], ref[1:]):
        assert rel_err(a, r) <= 2e-6, name
        assert rel_err(c, r) <= 2e-6, name
    assert got[4][1].abs().max() == 0  # slot 1 trains no unembedding: its B gets no gradient
    assert got[3][25:].abs().max() == 0 and got[3][:25].abs().max() > 0  # z rows of LoRA tokens only
    plain = _value_and_grads(full_token_logprobs, h, w, t, up, temperature=temperature)
    assert (plain[0] - ref[0])[:25].abs().max() > 0.1  # the delta really changes the log-probs
    assert (plain[0] - ref[0])[25:].abs().max() <= LP_TOL  # ...and only of the segments' tokens


def test_unembed_lora_bf16_matches_the_bf16_full_path():
    h, w, t, up = _problem(dtype=torch.bfloat16)
    z, b = _lora_problem(dtype=torch.bfloat16)
    ref = _lora_value_and_grads(full_token_logprobs, h, w, t, up, z, b, SEGMENTS)
    got = _lora_value_and_grads(chunked_token_logprobs, h, w, t, up, z, b, SEGMENTS, chunk_size=8)
    assert rel_err(got[0], ref[0]) <= 1e-2
    for name, a, r in zip(("dh", "dw", "dz", "dB"), got[1:], ref[1:]):
        assert a.dtype == torch.bfloat16, name
        assert rel_err(a, r) <= 2e-2, name


def test_unembed_lora_with_frozen_b_and_bad_shapes():
    """B without a gradient (z only), an empty segment list (the plain path), and shapes that
    do not fit are refused."""
    h, w, t, up = _problem()
    z, b = _lora_problem()
    ref = _lora_value_and_grads(_reference_logprobs, h, w, t, up, z, b, SEGMENTS)
    zz = z.clone().requires_grad_()
    lp = chunked_token_logprobs(h, w, t, chunk_size=5, lora=LogitLora(z=zz, lora_b=b, segments=SEGMENTS))
    (lp * up).sum().backward()
    assert rel_err(zz.grad, ref[3]) <= 2e-6
    none = chunked_token_logprobs(h, w, t, lora=LogitLora(z=z, lora_b=b, segments=[]))
    assert torch.equal(none, chunked_token_logprobs(h, w, t))
    with pytest.raises(ValueError, match="do not fit"):
        chunked_token_logprobs(h, w, t, lora=LogitLora(z=z[:-1], lora_b=b, segments=SEGMENTS))
    with pytest.raises(ValueError, match="do not fit"):
        chunked_token_logprobs(h, w, t, lora=LogitLora(z=z, lora_b=b[:, :-1], segments=SEGMENTS))
    for bad in ([(3, 0, 9)], [(0, 9, 20), (1, 0, 9)], [(0, 0, 38)]):
        with pytest.raises(ValueError, match="need ascending, disjoint"):
            chunked_token_logprobs(h, w, t, lora=LogitLora(z=z, lora_b=b, segments=bad))


def _tp_lora_worker(rank, port, result_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        h, w, t, up = _problem(vocab=100)
        z, b = _lora_problem(vocab=100)
        sl = slice(rank * 50, (rank + 1) * 50)  # B split over the vocabulary like W
        hh, ww, zz, bb = (x.detach().clone().requires_grad_() for x in (h, w[sl], z, b[:, sl]))
        lp = chunked_token_logprobs(hh, ww, t, chunk_size=6, tp_group=dist.group.WORLD,
                                    lora=LogitLora(z=zz, lora_b=bb, segments=SEGMENTS))
        (lp * up).sum().backward()
        torch.save({"lp": lp.detach(), "dh": hh.grad, "dw": ww.grad, "dz": zz.grad, "db": bb.grad}, f"{result_path}.{rank}")
    finally:
        dist.destroy_process_group()


def test_unembed_lora_vocab_parallel_two_ranks_match_unsharded(tmp_path):
    outs = _two_ranks(_tp_lora_worker, tmp_path)
    h, w, t, up = _problem(vocab=100)
    z, b = _lora_problem(vocab=100)
    ref_lp, ref_dh, ref_dw, ref_dz, ref_db = _lora_value_and_grads(_reference_logprobs, h, w, t, up, z, b, SEGMENTS)
    for out in outs:  # every rank: the full log-probs, hidden gradient and z gradient (summed over TP)
        assert (out["lp"] - ref_lp).abs().max().item() <= LP_TOL
        assert rel_err(out["dh"], ref_dh) <= 2e-6
        assert rel_err(out["dz"], ref_dz) <= 2e-6
    assert rel_err(torch.cat([outs[0]["dw"], outs[1]["dw"]]), ref_dw) <= 2e-6
    assert rel_err(torch.cat([outs[0]["db"], outs[1]["db"]], dim=1), ref_db) <= 2e-6  # each rank its shard of B

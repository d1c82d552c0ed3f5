"""Fused core attention == Megatron's local DotProductAttention (fp32, CPU).

Module level (random q/k/v, GQA): causal, explicit masks, packed document masks;
outputs and q/k/v gradients. Model level (the tiny world's Qwen3 converted by
Megatron-Bridge): the fused layer spec gives the local spec's logits and gradients,
and activation recomputation (full, selective) changes no gradient.

CPU adjustments come from trainer/platform/cpu_compat.py (through trainer.platform.distributed and
trainer.base.base_model). One more is needed for recomputation and applied here, in the
test only: megatron-core's checkpoint saves and restores the CUDA RNG state, which
does not exist without CUDA (see ``no_cuda_rng``).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_base(tiny_world):
    from trainer.base.base_model import build_frozen_base
    from trainer.platform.distributed import init_parallel

    init_parallel(tp=1, dp=1, seed=0)
    base = build_frozen_base(tiny_world / "model", tp=1, dtype="float32", layer_spec="local")
    base.rope_theta = json.loads((tiny_world / "model" / "config.json").read_text())["rope_parameters"]["rope_theta"]
    return base


def rebuild(base, spec_fn, **config_overrides):
    """A GPTModel with ``spec_fn``'s layer spec, the base's config (+ overrides) and weights."""
    from megatron.core.models.gpt import GPTModel

    src = base.model
    cfg = copy.copy(src.config)
    for key, value in config_overrides.items():
        setattr(cfg, key, value)
    model = GPTModel(
        cfg,
        spec_fn(cfg),
        vocab_size=src.vocab_size,
        max_sequence_length=src.max_sequence_length,
        position_embedding_type=src.position_embedding_type,
        rotary_base=base.rope_theta,
        share_embeddings_and_output_weights=src.share_embeddings_and_output_weights,
    )
    model.load_state_dict(src.state_dict(), strict=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


@pytest.fixture
def no_cuda_rng(monkeypatch):
    """megatron-core's activation checkpoint saves/restores the CUDA RNG state; without
    CUDA there is none to save (the CPU generator is still saved and restored)."""
    import megatron.core.tensor_parallel.random as mrandom

    if not torch.cuda.is_available():
        monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0))
        monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- module level -------------------------------------------------------------------


def _attention_pair(config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from trainer.base.fused_attention import FusedCoreAttention

    kw = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    return DotProductAttention(**kw), FusedCoreAttention(**kw)


def _qkv(seq, batch, config, seed):
    g = torch.Generator().manual_seed(seed)
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    q = torch.randn(seq, batch, heads, dim, generator=g, requires_grad=True)
    k = torch.randn(seq, batch, groups, dim, generator=g, requires_grad=True)
    v = torch.randn(seq, batch, groups, dim, generator=g, requires_grad=True)
    return q, k, v


def _run(module, q, k, v, grad_out, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, **kwargs)
    out.backward(grad_out.reshape(out.shape))
    return out.detach().reshape(grad_out.shape), q.grad, k.grad, v.grad


def _check_same(ref, got, tol=2e-6):
    for name, r, o in zip(("out", "dq", "dk", "dv"), ref, got):
        assert r.shape == o.shape, name
        err = rel_err(o, r)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def test_causal_and_explicit_masks_match_local(tiny_base):
    cfg = tiny_base.config
    assert cfg.num_attention_heads != cfg.num_query_groups  # GQA is exercised
    local, fused = _attention_pair(cfg)
    s, b = 19, 3
    q, k, v = _qkv(s, b, cfg, seed=1)
    grad = torch.randn(s, b, cfg.num_attention_heads * cfg.kv_channels, generator=torch.Generator().manual_seed(2))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    ref = _run(local, q, k, v, grad, attention_mask=causal)
    # No mask: the fused module makes the causal mask itself (SDPA is_causal).
    _check_same(ref, _run(fused, q, k, v, grad, attention_mask=None))
    _check_same(ref, _run(fused, q, k, v, grad, attention_mask=causal))
    # An explicit mask replaces the causal one: causal + per-row key padding.
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    pad[0, ..., 15:] = True
    pad[2, ..., 7:] = True
    mask = causal | pad
    mask[..., :, 0] = False  # keep every row attending somewhere
    _check_same(_run(local, q, k, v, grad, attention_mask=mask), _run(fused, q, k, v, grad, attention_mask=mask))


@pytest.mark.parametrize("view", ["thd", "documents", "plain_params"])
def test_packed_document_mask_matches_local_block_diagonal(tiny_base, view):
    from megatron.core.packed_seq_params import PackedSeqParams

    from trainer.base.fused_attention import DocumentsView
    from trainer.base.packing import DocumentLayout

    cfg = tiny_base.config
    local, fused = _attention_pair(cfg)
    lengths = [5, 1, 11, 8]
    total = sum(lengths)
    layout = DocumentLayout.from_lengths(lengths)
    q, k, v = _qkv(total, 1, cfg, seed=3)
    grad = torch.randn(total, 1, cfg.num_attention_heads * cfg.kv_channels, generator=torch.Generator().manual_seed(4))
    doc = layout.document_ids
    t = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (t[:, None] >= t[None, :])
    ref = _run(local, q, k, v, grad, attention_mask=~allowed[None, None])
    if view == "documents":  # what PackedSelfAttention hands over: [T, 1, heads, dim]
        got = _run(fused, q, k, v, grad, attention_mask=None, packed_seq_params=DocumentsView(layout))
    else:  # Megatron's thd: [T, heads, dim]
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=layout.cu_seqlens, cu_seqlens_kv=layout.cu_seqlens,
            max_seqlen_q=layout.max_seqlen, max_seqlen_kv=layout.max_seqlen,
        )
        if view == "thd":
            from trainer.base.packing import PackedSequenceParams

            params = PackedSequenceParams(**{f: getattr(params, f) for f in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv")}, layout=layout)
        got = _run(fused, q.squeeze(1), k.squeeze(1), v.squeeze(1), grad, attention_mask=None, packed_seq_params=params)
        got = (got[0], got[1].unsqueeze(1), got[2].unsqueeze(1), got[3].unsqueeze(1))
    _check_same(ref, got)


def test_flex_backend_matches_dense_forward():
    """flex_attention's document block mask (forward only: flex has no CPU backward;
    tests/gpu/test_speed_gpu.py checks its gradients on the GPU)."""
    from trainer.base.fused_attention import packed_attention_dense, packed_attention_flex
    from trainer.base.packing import DocumentLayout

    layout = DocumentLayout.from_lengths([7, 3, 12])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(22, 4, 16, generator=g)
    k = torch.randn(22, 2, 16, generator=g)
    v = torch.randn(22, 2, 16, generator=g)
    ref = packed_attention_dense(q, k, v, layout, 0.25)
    got = packed_attention_flex(q, k, v, layout, 0.25)
    assert layout.flex_block_mask is not None  # built once, kept for the other layers
    assert rel_err(got, ref) <= 1e-5


def test_bad_settings_are_refused(tiny_base):
    from megatron.core.transformer.enums import AttnMaskType

    from trainer.base.fused_attention import FusedCoreAttention, recompute_overrides

    with pytest.raises(ValueError, match="packed_backend"):
        FusedCoreAttention(tiny_base.config, 1, AttnMaskType.causal, "self", packed_backend="xformers")
    fused = FusedCoreAttention(tiny_base.config, 1, AttnMaskType.causal, "self")
    q = torch.zeros(4, 1, 4, 16)
    kv = torch.zeros(4, 1, 2, 16)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        fused(q, kv, kv, None, attention_bias=torch.zeros(1))
    with pytest.raises(TypeError, match="bool"):
        fused(q, kv, kv, torch.zeros(1, 1, 4, 4))
    with pytest.raises(ValueError, match="allowed are none, full, selective"):
        recompute_overrides("everything")


# ---- model level --------------------------------------------------------------------


def _forward_backward(model, ids, train=False):
    """Logits and the gradient w.r.t. the decoder input (the frozen-base backward)."""
    model.train(train)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    emb = model.embedding(ids, pos).detach().requires_grad_()
    logits = model(ids, pos, None, decoder_input=emb)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * weights).sum().backward()
    return logits.detach(), emb.grad


def install_fused_attention(model: torch.nn.Module) -> int:
    """Switch an already-built local-spec model to fused attention, in place: every ``SelfAttention``
    whose core attention is Megatron's ``DotProductAttention`` becomes a ``PackedSelfAttention`` with a
    ``FusedCoreAttention`` (neither holds parameters, so weights and state-dict names stay). Returns
    how many layers were switched."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from trainer.base.fused_attention import FusedCoreAttention, PackedSelfAttention

    switched = 0
    for module in model.modules():
        if type(module) is SelfAttention and type(module.core_attention) is DotProductAttention:
            old = module.core_attention
            module.core_attention = FusedCoreAttention(
                config=old.config, layer_number=old.layer_number, attn_mask_type=old.attn_mask_type,
                attention_type=old.attention_type, softmax_scale=module.config.softmax_scale,
                pg_collection=old.pg_collection,
            ).to(next((p.device for p in module.parameters()), None) or "cpu")
            module.__class__ = PackedSelfAttention  # adds behaviour only, no state
            switched += 1
    return switched


def test_fused_spec_model_matches_local_spec(tiny_base):
    from trainer.base.base_model import causal_mask
    from trainer.base.fused_attention import (
        FusedCoreAttention,
        PackedSelfAttention,
        fused_gpt_layer_spec,
        lorafleet_gpt_layer_spec,
    )

    # No TE here: the trainer's spec is the fused local one.
    spec = lorafleet_gpt_layer_spec(tiny_base.config)
    assert spec.submodules.self_attention.module is PackedSelfAttention
    fused = rebuild(tiny_base, fused_gpt_layer_spec)
    assert all(isinstance(layer.self_attention.core_attention, FusedCoreAttention) for layer in fused.decoder.layers)
    local = tiny_base.model
    ids = torch.randint(0, local.vocab_size, (3, 29), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(29).expand_as(ids)

    with torch.no_grad():
        ref = local(ids, pos, causal_mask(29, ids.device))
    logits, demb = _forward_backward(fused, ids)
    assert rel_err(logits, ref) <= 1e-6

    # Reference gradient: the local spec with its explicit causal mask.
    emb = local.embedding(ids, pos).detach().requires_grad_()
    out = local(ids, pos, causal_mask(29, ids.device), decoder_input=emb)
    out.mul(torch.randn(out.shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    assert rel_err(demb, emb.grad) <= 1e-5

    # Switching an already-built local model in place gives the same model.
    switched = rebuild(tiny_base, lambda cfg: spec_local(cfg))
    assert install_fused_attention(switched) == len(switched.decoder.layers)
    logits2, demb2 = _forward_backward(switched, ids)
    assert torch.equal(logits2, logits) and torch.equal(demb2, demb)


def spec_local(cfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)


def test_recompute_changes_no_gradient(tiny_base, no_cuda_rng):
    """Full and selective recomputation: same logits, same input gradient, and the same
    gradient for a trainable weight inside a layer (what a LoRA weight sees)."""
    from trainer.base.fused_attention import fused_gpt_layer_spec, recompute_overrides

    ids = torch.randint(0, tiny_base.model.vocab_size, (2, 23), generator=torch.Generator().manual_seed(8))
    results = {}
    for mode in ("none", "full", "selective"):
        model = rebuild(tiny_base, fused_gpt_layer_spec, **recompute_overrides(mode))
        assert model.config.recompute_granularity == (None if mode == "none" else mode)
        trainable = model.decoder.layers[0].mlp.linear_fc2.weight
        trainable.requires_grad_(True)
        logits, demb = _forward_backward(model, ids, train=True)
        results[mode] = (logits, demb, trainable.grad.clone())
    ref = results["none"]
    assert ref[2].abs().sum() > 0
    for mode in ("full", "selective"):
        for r, o in zip(ref, results[mode]):
            assert rel_err(o, r) <= 1e-6, mode

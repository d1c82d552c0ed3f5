"""Packed sequences: layout invariants, and packed == padded through the model (fp32, CPU).

The model tests run the tiny world's Qwen3 (converted by Megatron-Bridge, CPU
adjustments from trainer/platform/cpu_compat.py) with the fused layer spec: per-sample
log-probs, per-sample losses and every parameter gradient agree between one packed
stream and the right-padded batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.padded_batch import pad_sequences
from tests.unit.test_fused_attention import rebuild, rel_err, spec_local, tiny_base  # noqa: F401  (fixture)
from trainer.kernels.chunked_logprobs import IGNORE_TARGET
from trainer.base.packing import DocumentLayout, pack_sequences

pytestmark = pytest.mark.unit


def pack_values(packed, per_sample) -> torch.Tensor:
    """Per-sample per-token arrays (the caller's order) concatenated in the packed stream's order."""
    if len(per_sample) != packed.num_samples:
        raise ValueError(f"expected {packed.num_samples} per-sample arrays, got {len(per_sample)}")
    parts = []
    for j, i in enumerate(packed.sample_order):
        v = torch.as_tensor(per_sample[i])
        if v.shape[0] != packed.layout.lengths[j]:
            raise ValueError(f"sample {i} has {packed.layout.lengths[j]} tokens but its array has {v.shape[0]} rows")
        parts.append(v)
    return torch.cat(parts, 0).to(packed.tokens.device)


def _seqs(lengths, seed=0, vocab=400):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


def test_pack_orders_by_slot_and_inverts():
    lengths = [5, 17, 9, 1, 12, 3]
    slots = [2, 0, 2, 1, 0, 2]
    seqs = _seqs(lengths)
    packed = pack_sequences(seqs, slots, num_slots=4)
    assert packed.sample_order == (1, 4, 3, 0, 2, 5)  # by slot, stable inside a slot
    assert packed.sample_slots == (0, 0, 1, 2, 2, 2)
    assert packed.num_tokens == sum(lengths) == packed.tokens.shape[1]  # no padding
    assert packed.slot_token_counts.tolist() == [29, 1, 17, 0]
    assert packed.slot_offsets.dtype == torch.int32 and packed.slot_offsets.tolist() == [29, 30, 47, 47]
    # every slot's tokens are one contiguous segment ending at its offset
    start = 0
    for slot, end in enumerate(packed.slot_offsets.tolist()):
        assert (packed.token_slots[start:end] == slot).all()
        start = end
    assert packed.layout.cu_seqlens.tolist() == [0, 17, 29, 30, 35, 44, 47]
    assert packed.layout.max_seqlen == 17
    # positions restart in every sequence
    for j, n in enumerate(packed.layout.lengths):
        a = packed.layout.cu_seqlens[j].item()
        assert packed.position_ids[0, a : a + n].tolist() == list(range(n))
    # unpack inverts the permutation (caller's order)
    back = packed.unpack(packed.tokens)
    assert all(torch.equal(b, s) for b, s in zip(back, seqs))
    assert torch.equal(pack_values(packed, seqs), packed.tokens[0])
    padded = packed.to_padded(packed.tokens[0], pad_value=-1)
    assert padded.shape == (6, 17) and padded[3, 1:].eq(-1).all() and padded[3, 0] == seqs[3][0]
    assert packed.token_samples.tolist() == sum(([i] * lengths[i] for i in packed.sample_order), [])
    # Megatron params: thd, carrying the precomputed layout
    params = packed.packed_seq_params
    assert params.qkv_format == "thd" and params.layout is packed.layout
    assert params.max_seqlen_q == params.max_seqlen_kv == 17


def test_slot_offsets_drive_grouped_mm():
    """The contract with the multi-LoRA layer: slot_offsets is grouped_mm's ``offs``."""
    packed = pack_sequences(_seqs([4, 6, 3, 5]), [3, 1, 3, 0], num_slots=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(packed.num_tokens, 8, generator=g)
    w = torch.randn(5, 8, 12, generator=g)
    ref = torch.einsum("ti,tio->to", x, w[packed.token_slots])
    if not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no grouped_mm")
    got = torch.nn.functional.grouped_mm(x, w, offs=packed.slot_offsets)
    assert rel_err(got, ref) <= 1e-6


def test_next_token_targets_stay_inside_each_sequence():
    seqs = _seqs([3, 1, 4])
    packed = pack_sequences(seqs, [1, 0, 1], num_slots=2)
    targets, valid = packed.next_token_targets()
    # packed order: sample 1 (len 1), sample 0 (len 3), sample 2 (len 4)
    expect = [IGNORE_TARGET, *seqs[0][1:].tolist(), IGNORE_TARGET, *seqs[2][1:].tolist(), IGNORE_TARGET]
    assert targets.tolist() == expect
    assert valid.sum().item() == 2 + 3
    padded = pad_sequences(seqs)
    pt, pv = padded.next_token_targets()
    assert pt[0].tolist() == [*seqs[0][1:].tolist(), IGNORE_TARGET, IGNORE_TARGET]  # row length 4
    assert pv.sum().item() == valid.sum().item()


@pytest.mark.parametrize(
    "sequences, slots, num_slots, message",
    [
        ([[1, 2]], [0, 1], 2, "one slot id per sequence"),
        ([], [], 2, "empty batch"),
        ([[1], [2]], [0, 2], 2, "outside 0..1"),
        ([[1], []], [0, 1], 2, "no tokens"),
        ([[1]], [-1], 2, "outside 0..1"),
    ],
)
def test_bad_batches_are_refused(sequences, slots, num_slots, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(sequences, slots, num_slots=num_slots)


def test_layout_from_cu_seqlens_and_bad_lengths():
    layout = DocumentLayout.from_cu_seqlens(torch.tensor([0, 2, 7], dtype=torch.int32))
    assert layout.lengths == (2, 5) and layout.document_ids.tolist() == [0, 0, 1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="at least one token"):
        DocumentLayout.from_lengths([3, 0])
    with pytest.raises(ValueError, match="longest"):
        DocumentLayout.from_cu_seqlens(torch.tensor([0, 2, 7], dtype=torch.int32), max_seqlen=4)


# ---- through the model --------------------------------------------------------------


def _token_logprobs(model, batch_tokens, position_ids, targets, packed_seq_params):
    """The trainer's forward: chunked log-probs straight from the final hidden states."""
    from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

    return model(
        batch_tokens, position_ids, None,
        packed_seq_params=packed_seq_params,
        output_processor=LogprobOutputProcessor(chunk_size=13),
        output_processor_context=targets,
    )


def test_packed_equals_padded_logprobs_losses_and_grads(tiny_base):
    from megatron.core.packed_seq_params import PackedSeqParams

    from trainer.base.fused_attention import fused_gpt_layer_spec

    model = rebuild(tiny_base, fused_gpt_layer_spec)
    for p in model.parameters():
        p.requires_grad_(True)
    lengths = [9, 23, 1, 14, 6]
    slots = [1, 0, 1, 2, 0]
    seqs = _seqs(lengths, seed=3, vocab=model.vocab_size)
    weights = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25])

    def run(kind):
        model.zero_grad(set_to_none=True)
        if kind == "padded":
            batch = pad_sequences(seqs)
            targets, valid = batch.next_token_targets()
            lp = _token_logprobs(model, batch.tokens, batch.position_ids, targets, None)
            per_token = [lp[i, : n - 1] for i, n in enumerate(lengths)]
        else:
            batch = pack_sequences(seqs, slots, num_slots=3)
            targets, valid = batch.next_token_targets()
            params = batch.packed_seq_params
            if kind == "packed_plain_params":  # no precomputed layout: derived from cu_seqlens
                params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv, max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv)
            lp = _token_logprobs(model, batch.tokens, batch.position_ids, targets.unsqueeze(0), params)
            per_token = [x[: n - 1] for x, n in zip(batch.unpack(lp[0]), lengths)]
        losses = torch.stack([-x.mean() if x.numel() else x.sum() for x in per_token])
        (weights * losses).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return [x.detach() for x in per_token], losses.detach(), grads

    ref_lp, ref_loss, ref_grads = run("padded")
    assert len(ref_grads) == len(list(model.parameters()))
    for kind in ("packed", "packed_plain_params"):
        lp, loss, grads = run(kind)
        for a, b in zip(lp, ref_lp):
            assert a.shape == b.shape
            if b.numel():
                assert (a - b).abs().max().item() <= 1e-5
        assert rel_err(loss, ref_loss) <= 1e-6
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) <= 1e-5, (kind, name)


def test_megatron_thd_rope_path_agrees_with_per_token_rope(tiny_base):
    """Megatron's own thd path (plain SelfAttention: per-sequence RoPE loop) with the fused
    core attention gives what PackedSelfAttention's one-shot per-token RoPE gives."""
    import functools

    from trainer.base.fused_attention import FusedCoreAttention, fused_gpt_layer_spec

    def megatron_thd_spec(cfg):
        spec = spec_local(cfg)
        spec.submodules.self_attention.submodules.core_attention = functools.partial(FusedCoreAttention)
        return spec

    seqs = _seqs([7, 12, 3], seed=4, vocab=tiny_base.model.vocab_size)
    batch = pack_sequences(seqs, [0, 1, 1], num_slots=2)
    with torch.no_grad():
        outs = [
            rebuild(tiny_base, spec)(batch.tokens, batch.position_ids, None, packed_seq_params=batch.packed_seq_params)
            for spec in (megatron_thd_spec, fused_gpt_layer_spec)
        ]
    assert rel_err(outs[1], outs[0]) <= 1e-6


def test_chunked_output_processor_matches_megatron_logits_path(tiny_base):
    """The chunked log-prob hook equals helper-built token_logprobs (full logits +
    megatron-core's vocab-parallel cross entropy)."""
    from trainer.base.base_model import causal_mask, token_logprobs
    from trainer.kernels.chunked_logprobs import LogprobOutputProcessor

    ids = torch.randint(0, tiny_base.model.vocab_size, (2, 17), generator=torch.Generator().manual_seed(9))
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(17).expand_as(ids)
    with torch.no_grad():
        ref = token_logprobs(tiny_base, ids, labels)
        got = tiny_base.model(
            ids, pos, causal_mask(17, ids.device),
            output_processor=LogprobOutputProcessor(chunk_size=5), output_processor_context=labels,
        )
    assert got.shape == ref.shape == (2, 17)
    assert (got - ref).abs().max().item() <= 1e-5


def test_split_by_token_budget():
    from trainer.base.packing import split_by_token_budget

    lengths = [5, 9, 3, 20, 4, 4]
    slots = [1, 0, 1, 2, 0, 1]
    batches = split_by_token_budget(lengths, slots, max_tokens=12)
    # slot order: 1(9) 4(4) | 0(5) 2(3) 5(4) | 3(20, alone, over budget)
    assert batches == [[1], [4, 0, 2], [5], [3]]
    assert sorted(sum(batches, [])) == list(range(6))
    for b in batches:
        assert sum(lengths[i] for i in b) <= 12 or len(b) == 1
    with pytest.raises(ValueError, match="max_tokens"):
        split_by_token_budget(lengths, slots, 0)

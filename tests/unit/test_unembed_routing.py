"""The trainer's unembedding LoRA (trainer/lora/unembed_lora.py) gives every token its OWN slot's
delta, from the micro-batch's routing to the logits, on the CPU.

tests/unit/test_chunked_logprobs.py checks the chunked kernel for given segments; this checks
what the trainer hands it: ``SlotRouting.segments_training`` (which slots train the unembedding,
where their tokens are), ``UnembedLora.logit_lora`` (z = s_k x A_k^T of each token's slot) through
the trainer's output-processor hook (``LogprobOutputProcessor``), and the full-logits path
(``UnembedLora.forward``). Slots train different target sets: one all three, one attention and MLP
only (between the others in the batch), one the unembedding only, one resident but without
samples; padded (set) and packed (set_packed) routing.

The reference is the definition, token by token: logits_t = W h_t + s_k B_k A_k h_t for token t of
slot k, s_k the slot's unembedding scale (0, and zero weights, for a slot that does not train it),
then log_softmax. The output layer's base is a stand-in (``_OutputLayer``: Megatron's calling
convention over a plain weight). Plants this catches: tests/reference/plant_mutation.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.base.packing import pack_sequences
from trainer.config import TARGET_GROUPS
from trainer.kernels.chunked_logprobs import LogprobOutputProcessor
from trainer.lora.multi_lora import SlotRouting, SlotScales
from trainer.lora.unembed_lora import UnembedLora

pytestmark = pytest.mark.unit

N, RANK, HIDDEN, VOCAB = 5, 4, 16, 37
# slot: (scale in each of TARGET_GROUPS, rank); slot 1 does not train the unembedding, slot 3 only
# it; slots 2 and 4 are resident but have no samples in the micro-batch.
SLOTS = {0: ((1.5, 1.5, 1.5), 4), 1: ((2.0, 2.0, 0.0), 2), 2: ((1.0, 1.0, 1.0), 3), 3: ((0.0, 0.0, 0.75), 3),
         4: ((0.5, 0.5, 0.5), 4)}
UNEMBED = TARGET_GROUPS.index("unembed")


class _OutputLayer(nn.Module):
    """Stand-in for Megatron's output layer: (x W^T, None); the weight comes with the call (tied)."""

    gather_output = False

    def forward(self, x, weight=None, runtime_gather_output=None):  # noqa: ANN001, ANN201
        return x @ weight.t(), None


def _unembed():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g) * 0.5
    routing = SlotRouting(N, kernel="loop")
    layer = UnembedLora(_OutputLayer(), output_weight=lambda: weight, hf_module="lm_head", num_slots=N, max_rank=RANK,
                        routing=routing, tp_group=None, device=torch.device("cpu"))
    scales = SlotScales(N, torch.device("cpu"))
    with torch.no_grad():
        for slot, (per_group, rank) in SLOTS.items():
            scales.set(slot, list(per_group))
            if per_group[UNEMBED]:  # a slot that does not train the unembedding has zero weights there
                layer.lora_A[slot, :rank] = torch.randn(rank, HIDDEN, generator=g)
                layer.lora_B[slot, :, :rank] = torch.randn(VOCAB, rank, generator=g)
    return layer, routing, scales, weight


def reference_logits(layer: UnembedLora, weight: torch.Tensor, hidden: torch.Tensor, slot_of_token: list[int]) -> torch.Tensor:
    """[T, V]: token by token, W h_t + s_k B_k A_k h_t of its slot k (module doc)."""
    a, b = layer.lora_A.detach(), layer.lora_B.detach()
    rows = []
    for h, k in zip(hidden, slot_of_token):
        s = SLOTS[k][0][UNEMBED]
        rows.append(weight @ h + s * (b[k] @ (a[k] @ h)))
    return torch.stack(rows)


def _reference_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_padded_micro_batch_tokens_get_their_own_slots_delta():
    """Samples of slots 0, 0, 1, 3, 3, 3 (sorted, as the trainer routes them), 6 positions each:
    the chunked log-prob hook (chunks of 7 tokens: boundaries inside segments) and the full logits
    equal the definition at every token."""
    layer, routing, scales, weight = _unembed()
    slots, seq_len = [0, 0, 1, 3, 3, 3], 6
    routing.set(torch.tensor(slots), seq_len, scales)
    assert routing.segments_training(UNEMBED) == [(0, 0, 12), (3, 18, 36)]
    g = torch.Generator().manual_seed(1)
    hidden_sbh = torch.randn(seq_len, len(slots), HIDDEN, generator=g)  # Megatron's [s, b, h]
    targets = torch.randint(0, VOCAB, (len(slots), seq_len), generator=g)
    tokens = hidden_sbh.transpose(0, 1).reshape(-1, HIDDEN)  # sample-major: token j * s + p
    want = reference_logits(layer, weight, tokens, [k for k in slots for _ in range(seq_len)])
    got = LogprobOutputProcessor(chunk_size=7)(hidden_states=hidden_sbh, output_layer=layer, output_weight=weight,
                                               context=targets)
    assert torch.allclose(got.reshape(-1), _reference_logprobs(want, targets.reshape(-1)), atol=1e-5)
    logits, _ = layer(hidden_sbh, weight=weight, runtime_gather_output=False)  # [s, b, V]
    assert torch.allclose(logits.transpose(0, 1).reshape(-1, VOCAB), want, atol=1e-5)


def test_packed_stream_tokens_get_their_own_slots_delta():
    """One packed stream (the trainer's default): sequences of slots 3, 0, 1, 3, 0 in the caller's
    order, packed by slot; every token's log-prob equals the definition for its sequence's slot."""
    layer, routing, scales, weight = _unembed()
    lengths, slot_ids = [5, 3, 7, 4, 6], [3, 0, 1, 3, 0]
    packed = pack_sequences([list(range(n)) for n in lengths], slot_ids, N)
    routing.set_packed(packed, scales)
    order = sorted(range(len(lengths)), key=lambda i: slot_ids[i])  # by slot, stable (the packing's definition)
    slot_of_token = [slot_ids[i] for i in order for _ in range(lengths[i])]
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(len(slot_of_token), 1, HIDDEN, generator=g)  # [T, 1, h]
    targets = torch.randint(0, VOCAB, (1, len(slot_of_token)), generator=g)
    want = _reference_logprobs(reference_logits(layer, weight, hidden[:, 0], slot_of_token), targets[0])
    got = LogprobOutputProcessor(chunk_size=5)(hidden_states=hidden, output_layer=layer, output_weight=weight,
                                               context=targets)
    assert torch.allclose(got[0], want, atol=1e-5)
    plain = _reference_logprobs(hidden[:, 0] @ weight.t(), targets[0])
    learned = torch.tensor([SLOTS[k][0][UNEMBED] != 0 for k in slot_of_token])
    moved = (got[0] - plain).abs()
    assert moved[learned].min() > 0.1 and moved[~learned].max() <= 1e-5  # the delta only on its slots' tokens

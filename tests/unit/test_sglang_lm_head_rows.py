"""The unembedding's pruned rows reach their own adapter on SGLang's CPU LoRA backend
(rollout/engines/sglang_lm_head_rows.py), without a server.

SGLang's own pieces, built small: a ``ForwardBatch`` of a mixed extend batch (several sequences,
different adapters, one with no adapter, with and without prompt log-probs), the ``torch_native``
backend patched as every CPU server process patches it, its ``prepare_lora_batch``, and the real
``ParallelLMHeadWithLoRA`` over a small output weight, called pass by pass as SGLang's log-prob
processor calls it (``set_lm_head_pass``; passes of 16 rows, SGLANG_LOGPROB_CHUNK_SIZE).

The reference is the definition (sglang/srt/layers/logits_processor.py ``_get_pruned_states``): an
extend batch hands ``lm_head`` the rows of each sequence from its log-prob start to its end (at
least its last token; only its last token when the batch asks no log-probs), in sequence order,
and the log-prob processor cuts them into consecutive passes of the chunk size. Each row belongs
to its sequence's adapter, and its logits are W h + s_a B_a A_a h. Checked: the tables' rows, pass
by pass, and the logits of every row.

The one global change SGLang needs on a machine without a GPU, pinned host memory as a no-op
(rollout/engines/sglang_server.py does it in every server process), is made here for each test
only. Real server: tests/integration/test_logprob_parity.py. Plants this catches:
tests/unit/off_by_one_mutations.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from rollout.engines import sglang_lm_head_rows
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.layers import ParallelLMHeadWithLoRA
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

pytestmark = pytest.mark.unit

PASS_ROWS = 16
HIDDEN, VOCAB = 8, 50
# adapter index (in SGLang's LoRA buffers): (rank, scaling); adapter 3 is the base (rank 0: no LoRA)
ADAPTERS = {0: (4, 2.0), 1: (2, 0.5), 2: (3, 1.25), 3: (0, 0.0)}
# sequence: (adapter, tokens in this extend, log-prob start); a start equal to the length asks no
# prompt log-probs (one row: its last token). Same-adapter neighbours merge into one segment; the
# rows cross both pass boundaries inside sequences.
BATCH = [(1, 5, 5), (2, 9, 0), (2, 3, 1), (3, 7, 2), (0, 12, 0), (1, 4, 4), (0, 6, 3), (2, 2, 0)]


def definition_rows(batch: list[tuple[int, int, int]], logprobs: bool) -> list[int]:
    """The adapter of every row lm_head gets, in order (module doc)."""
    rows = []
    for adapter, length, start in batch:
        first = min(start, length - 1) if logprobs else length - 1
        rows += [adapter] * (length - first)
    return rows


def table_rows(info) -> list[int]:  # noqa: ANN001 - a SGLang LoRABatchInfo
    """The adapter of every row a segment table routes, in order."""
    weights, lens = info.weight_indices_cpu.tolist(), info.seg_lens_cpu.tolist()
    assert info.seg_indptr_cpu.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert info.expected_tokens == sum(lens) and info.bs == info.num_segments == len(lens)
    return [w for w, n in zip(weights, lens) for _ in range(n)]


def _drop_pin(fn):  # noqa: ANN001, ANN202
    @functools.wraps(fn)
    def call(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return call


@pytest.fixture
def patched(monkeypatch):
    """The backend class patched as a CPU server process patches it; undone after the test."""
    monkeypatch.setenv("SGLANG_LOGPROB_CHUNK_SIZE", str(PASS_ROWS))
    monkeypatch.setenv("SGLANG_ENABLE_LOGPROB_CHUNK", "1")
    for name in ("tensor", "zeros", "empty"):
        monkeypatch.setattr(torch, name, _drop_pin(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    for name in ("prepare_lora_batch", "run_lora_a_sgemm", "run_lora_b_sgemm"):
        monkeypatch.setattr(TorchNativeLoRABackend, name, getattr(TorchNativeLoRABackend, name))  # restored after
    monkeypatch.setattr(TorchNativeLoRABackend, sglang_lm_head_rows.PATCHED_FLAG, False, raising=False)
    sglang_lm_head_rows.route_lm_head_rows_by_adapter()


def _prepared(batch: list[tuple[int, int, int]], mode: ForwardMode, logprobs: bool) -> TorchNativeLoRABackend:
    lens = [length for _, length, _ in batch] if mode == ForwardMode.EXTEND else [1] * len(batch)
    total = sum(lens)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(batch), input_ids=torch.zeros(total, dtype=torch.long),
        req_pool_indices=torch.arange(len(batch)), seq_lens=torch.tensor([n for _, n, _ in batch]),
        out_cache_loc=torch.zeros(total, dtype=torch.long), seq_lens_sum=sum(n for _, n, _ in batch),
        return_logprob=logprobs, extend_seq_lens=torch.tensor(lens, dtype=torch.int32), extend_seq_lens_cpu=lens,
        extend_logprob_start_lens_cpu=[start for _, _, start in batch])
    backend = TorchNativeLoRABackend(max_loras_per_batch=len(ADAPTERS), device=torch.device("cpu"))
    backend.prepare_lora_batch(fb, [a for a, _, _ in batch], [r for r, _ in ADAPTERS.values()],
                               [s for _, s in ADAPTERS.values()], use_cuda_graph=False)
    return backend


@pytest.mark.parametrize("logprobs", [True, False])
def test_the_pruned_rows_tables_route_each_row_to_its_sequences_adapter(patched, logprobs):
    backend = _prepared(BATCH, ForwardMode.EXTEND, logprobs)
    want = definition_rows(BATCH, logprobs)
    assert table_rows(backend.lm_head_batch_info) == want
    passes = backend.lm_head_pass_batch_infos
    if len(want) <= PASS_ROWS:
        assert passes is None and not logprobs
        return
    assert len(want) == 35 and len(passes) == 3  # 16 + 16 + 3
    for p, info in enumerate(passes):
        assert table_rows(info) == want[p * PASS_ROWS : (p + 1) * PASS_ROWS], f"pass {p}"


def test_a_decode_batch_needs_no_pruned_table(patched):
    backend = _prepared(BATCH, ForwardMode.DECODE, False)
    assert backend.lm_head_batch_info is None and backend.lm_head_pass_batch_infos is None


class _OutputWeight(nn.Module):
    """What ParallelLMHeadWithLoRA reads of its base layer (one rank: no vocabulary split)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.embedding_dim, self.org_vocab_size = weight.shape[1], weight.shape[0]


@pytest.mark.parametrize("logprobs", [True, False])
def test_each_rows_logits_get_its_own_adapters_delta(patched, logprobs):
    """SGLang's lm_head LoRA layer over the pruned rows, pass by pass as the log-prob processor
    calls it: every row's logits are W h + s_a B_a A_a h of its own sequence's adapter a."""
    g = torch.Generator().manual_seed(0)
    backend = _prepared(BATCH, ForwardMode.EXTEND, logprobs)
    layer = ParallelLMHeadWithLoRA(_OutputWeight(torch.randn(VOCAB, HIDDEN, generator=g)), backend)
    max_rank = max(r for r, _ in ADAPTERS.values())
    a_buf, b_buf = torch.zeros(len(ADAPTERS), max_rank, HIDDEN), torch.zeros(len(ADAPTERS), VOCAB, max_rank)
    for k, (rank, _) in ADAPTERS.items():
        a_buf[k, :rank] = torch.randn(rank, HIDDEN, generator=g)
        b_buf[k, :, :rank] = torch.randn(VOCAB, rank, generator=g)
    layer.set_lora_info(a_buf, b_buf)
    rows = definition_rows(BATCH, logprobs)
    hidden = torch.randn(len(rows), HIDDEN, generator=g)
    passes = [(p, slice(p * PASS_ROWS, (p + 1) * PASS_ROWS)) for p in range(-(-len(rows) // PASS_ROWS))]
    if len(passes) == 1:
        got = layer(hidden)
    else:
        got = []
        for p, cut in passes:
            layer.set_lm_head_pass(p)
            got.append(layer(hidden[cut]))
        layer.reset_lm_head_pass()
        got = torch.cat(got)
    for i, adapter in enumerate(rows):
        rank, scaling = ADAPTERS[adapter]
        want = layer.weight @ hidden[i] + scaling * (b_buf[adapter, :, :rank] @ (a_buf[adapter, :rank] @ hidden[i]))
        assert torch.allclose(got[i], want, rtol=1e-5, atol=1e-5), f"row {i} (adapter {adapter}) got another adapter's delta"

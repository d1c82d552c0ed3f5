"""The unembedding's LoRA rows routed by adapter on SGLang's CPU LoRA backend (a fix of SGLang 0.5.23).

In an extend (prefill) batch the logits processor hands ``lm_head`` only the *pruned* rows: one
per sequence (its last token), or the tokens from each sequence's log-prob start. SGLang's LoRA
layer on ``lm_head`` therefore routes those rows by a second segment table, ``lm_head_batch_info``,
which the Triton and chunked backends (the GPU ones) build in ``prepare_lora_batch``. The
``torch_native`` backend, the only one that runs on a CPU, never builds it, and its
``run_lora_a_sgemm`` / ``run_lora_b_sgemm`` drop the ``pruned_batch_info`` argument: the pruned
rows are routed by the *whole* sequences' lengths. In a batch whose sequences use different
adapters, a row then gets another sequence's adapter (or none). Measured before this fix
(tests/integration/test_logprob_parity.py): log-prob errors up to 0.53 for an adapter with LoRA on
``lm_head`` and 0.099 for the sequences beside it, and the first sampled token of each sequence was
drawn from those wrong logits. A batch of one adapter is unaffected: every segment is the same.

The fix gives ``torch_native`` what the GPU backends do, from SGLang's own helpers: the pruned
lengths of the batch (``get_lm_head_pruned_lens``, kept in step with the logits processor by
SGLang), merged into per-adapter segments (``merge_and_chunk_segments``), also per chunk when the
logits processor splits the log-probs into passes; and the two GEMMs honour the table they are
handed. Decode batches need no table (one row per sequence either way). Applied in every CPU
server process by rollout/engines/sglang_server.py; GPU engines use the Triton backend and are untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
# Imported with the module (which only SGLang server processes import, when the patch is applied):
# a SGLang without these names stops the server at its start, not at its first prefill batch.
from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
from sglang.srt.lora.utils import get_lm_head_pruned_lens, merge_and_chunk_segments

PATCHED_FLAG = "_lorafleet_lm_head_rows"


def route_lm_head_rows_by_adapter() -> None:
    """Patch SGLang's TorchNativeLoRABackend in this process (idempotent)."""
    if not hasattr(TorchNativeLoRABackend, "_get_lm_head_pass_segments"):
        raise RuntimeError("this SGLang's LoRA backend has no _get_lm_head_pass_segments: "
                           "rollout/engines/sglang_lm_head_rows.py was written against SGLang 0.5.23")
    if getattr(TorchNativeLoRABackend, PATCHED_FLAG, False):
        return
    prepare, run_a, run_b = (TorchNativeLoRABackend.prepare_lora_batch, TorchNativeLoRABackend.run_lora_a_sgemm,
                             TorchNativeLoRABackend.run_lora_b_sgemm)

    def prepare_lora_batch(self, forward_batch, weight_indices, *args, **kwargs):  # noqa: ANN001 - SGLang's signature
        prepare(self, forward_batch, weight_indices, *args, **kwargs)
        self.lm_head_batch_info, self.lm_head_pass_batch_infos = pruned_row_tables(self, forward_batch, weight_indices)

    def run_lora_a_sgemm(self, x, weights, *args, pruned_batch_info=None, **kwargs):  # noqa: ANN001
        with _routed_by(self, pruned_batch_info):
            return run_a(self, x, weights, *args, **kwargs)

    def run_lora_b_sgemm(self, x, weights, *args, pruned_batch_info=None, **kwargs):  # noqa: ANN001
        with _routed_by(self, pruned_batch_info):
            return run_b(self, x, weights, *args, **kwargs)

    TorchNativeLoRABackend.prepare_lora_batch = prepare_lora_batch
    TorchNativeLoRABackend.run_lora_a_sgemm = run_lora_a_sgemm
    TorchNativeLoRABackend.run_lora_b_sgemm = run_lora_b_sgemm
    setattr(TorchNativeLoRABackend, PATCHED_FLAG, True)


def pruned_row_tables(backend, forward_batch, weight_indices: list[int]):  # noqa: ANN001, ANN201
    """(the table of all pruned rows, one table per log-prob pass or None); (None, None) when the
    batch is not pruned (decode)."""
    pruned = get_lm_head_pruned_lens(forward_batch)
    if pruned is None:
        return None, None

    def table(adapters: list[int], lens: list[int]):  # noqa: ANN202 - one table over these sequences' rows
        return _table(backend.batch_info, merge_and_chunk_segments(adapters, lens, chunk_size=sum(lens)), sum(lens))

    passes = backend._get_lm_head_pass_segments(weight_indices, pruned)
    return table(weight_indices, pruned), None if passes is None else [table(w, lens) for w, lens in passes]


def _table(batch_info, segments: tuple[list[int], list[int]], rows: int):  # noqa: ANN001, ANN202
    """``batch_info`` with its segments replaced by ``segments`` (adapter index, row count) over ``rows`` rows."""
    weights, lens = segments
    lens_t = torch.tensor(lens, dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(lens_t, 0)
    weights_t = torch.tensor(weights, dtype=torch.int32)
    return dataclasses.replace(
        batch_info, use_cuda_graph=False, bs=len(lens), num_segments=len(lens), max_len=max(lens),
        seg_lens=lens_t, seg_indptr=indptr, weight_indices=weights_t, expected_tokens=rows,
        seg_lens_cpu=lens_t, seg_indptr_cpu=indptr, weight_indices_cpu=weights_t)


@contextlib.contextmanager
def _routed_by(backend, table) -> Iterator[None]:  # noqa: ANN001
    """Within the block, the backend's GEMMs read ``table`` instead of the batch's own (no-op for None)."""
    if table is None:
        yield
        return
    saved, backend.batch_info = backend.batch_info, table
    try:
        yield
    finally:
        backend.batch_info = saved

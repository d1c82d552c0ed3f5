"""The optimizer step by decoder layer (trainer/optim/step_overlap.py): the chunk plan over the real
SlotBuffers row layout, the AdamW kernel over a block table (Triton's interpreter on the CPU, the
kernel source the GPU compiles) against the whole-row launch, and the CPU's plain path. The
stream overlap itself runs only on CUDA: tests/gpu/test_step_overlap_gpu.py."""

import pytest
import torch
from torch import nn

from trainer.kernels import triton_adamw
from trainer.optim.per_slot_optim import AdamwColumns, adamw_apply
from trainer.lora.slot_buffers import SlotBuffers
from trainer.optim.step_overlap import StepOverlap, decoder_index, merged, plan_chunks

pytestmark = pytest.mark.unit


class _Lora(nn.Module):
    """What SlotBuffers reads of a LoRA layer: its stacked A/B and which of them TP splits."""

    def __init__(self, name: str, n: int, r: int, d_in: int, d_out: int, parallel: str) -> None:
        super().__init__()
        self.name = name
        self.lora_A = nn.Parameter(torch.randn(n, r, d_in))
        self.lora_B = nn.Parameter(torch.randn(n, d_out, r))
        self.a_is_tp_split, self.b_is_tp_split = parallel == "row", parallel == "column"


def _layers(n: int = 3) -> list[_Lora]:
    # the trainer's order: every dense layer, then the output layer, then the expert layers
    out = []
    for i in range(3):
        out += [_Lora(f"decoder.layers.{i}.self_attention.linear_qkv", n, 4, 24, 40, "column"),
                _Lora(f"decoder.layers.{i}.mlp.linear_fc2", n, 4, 56, 24, "row")]
    out.append(_Lora("output_layer", n, 4, 24, 97, "column"))
    out += [_Lora(f"decoder.layers.{i}.mlp.experts.linear_fc1", n, 4, 24, 64, "column") for i in range(3)]
    return out


def test_decoder_index_and_merge():
    assert decoder_index("decoder.layers.12.self_attention.linear_proj") == 12
    assert decoder_index("layers.0.mlp.linear_fc1") == 0
    assert decoder_index("output_layer") == float("inf")
    assert merged([(10, 20), (0, 5), (5, 8), (19, 30)]) == [(0, 8), (10, 30)]


def test_chunks_follow_forward_order_and_cover_each_column_once():
    layers = _layers()
    buf = SlotBuffers(layers, 3, torch.device("cpu"))
    ranges, chunk_of = plan_chunks([layer.name for layer in layers], buf.layer_columns())
    assert len(ranges) == 4  # decoder layers 0, 1, 2, then the output layer
    assert [chunk_of[i] for i in (0, 1, 6, 7)] == [0, 0, 3, 0]  # experts of layer 0 join its chunk
    covered = torch.zeros(buf.weight.shape[1], dtype=torch.int64)
    for chunk in ranges:
        for lo, hi in chunk:
            covered[lo:hi] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    for layer, chunk, cols in zip(layers, chunk_of, buf.layer_columns()):
        for param, (lo, hi) in zip((layer.lora_A, layer.lora_B), cols):  # the layer's views start there
            assert param.data_ptr() == buf.weight[0, lo:].data_ptr() and param[0].numel() == hi - lo, layer.name
            assert any(a <= lo and hi <= b for a, b in ranges[chunk]), (layer.name, lo, hi)


def test_kernel_by_chunks_equals_whole_rows(kernel_device):
    """The step launched chunk by chunk (interleaved column ranges, a partial block in each) gives
    bit-identical rows to one whole-row launch, and touches no row that does not step."""
    torch.manual_seed(0)
    n, p = 5, 2 * triton_adamw.BLOCK + 300
    w, g, m, v = (torch.randn(n, p, device=kernel_device) for _ in range(4))
    v = v.abs()
    slots = [0, 2, 3]
    coef = torch.rand(len(slots), 8, device=kernel_device) * 0.4 + 0.05
    whole = [t.clone() for t in (w, g, m, v)]
    triton_adamw.adamw_rows(*whole, slots, coef)
    chunks = [[(0, 100), (3000, p)], [(100, 3000)]]
    ids = torch.tensor(slots, dtype=torch.int32, device=kernel_device)
    for ranges in chunks:
        triton_adamw.adamw_rows(w, g, m, v, ids, coef, triton_adamw.BlockTable(ranges, kernel_device))
    for name, got, want in zip(("weight", "grad", "exp_avg", "exp_avg_sq"), (w, g, m, v), whole):
        assert torch.equal(got, want), name


def test_block_tables_refuse_what_they_cannot_update(kernel_device):
    with pytest.raises(ValueError, match="empty or negative"):
        triton_adamw.BlockTable([(5, 5)], kernel_device)
    w = torch.zeros(2, 8, device=kernel_device)
    coef = torch.zeros(1, 8, device=kernel_device)
    with pytest.raises(ValueError, match="reach column 9; rows have 8"):
        triton_adamw.adamw_rows(w, w.clone(), w.clone(), w.clone(), [0], coef, triton_adamw.BlockTable([(0, 9)], kernel_device))
    with pytest.raises(ValueError, match="int32"):
        triton_adamw.adamw_rows(w, w.clone(), w.clone(), w.clone(), torch.tensor([0], device=kernel_device), coef)


def test_cpu_step_is_the_plain_update_and_waits_are_noops():
    layers = _layers()
    buf = SlotBuffers(layers, 3, torch.device("cpu"))
    overlap = StepOverlap(layers, buf, torch.device("cpu"), enabled=True)
    assert not overlap.active and all(layer.step_overlap is None for layer in layers)
    buf.grad.normal_()
    ref = [t.clone() for t in (buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq)]
    cols = lambda: AdamwColumns(*(torch.full((2,), 0.1 * (i + 1)) for i in range(8)))  # noqa: E731
    overlap.apply(buf, [0, 2], cols)
    adamw_apply(*ref, [0, 2], cols())
    for got, want in zip((buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq), ref):
        assert torch.equal(got, want)
    overlap.wait(layers[0])
    overlap.settle()
    assert not overlap.pending()


def test_steps_below_min_params_run_in_order():
    """A step of fewer LoRA parameters than ``min_params`` takes the plain update even where the
    overlap is on (forced here: on the CPU the stream path would fail, so taking it shows)."""
    layers = _layers()
    buf = SlotBuffers(layers, 3, torch.device("cpu"))
    width = buf.weight.shape[1]
    overlap = StepOverlap(layers, buf, torch.device("cpu"), enabled=True, min_params=2 * width + 1)
    overlap.active, overlap.chunks = True, ["the stream path"]  # as on CUDA
    buf.grad.normal_()
    ref = [t.clone() for t in (buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq)]
    cols = lambda: AdamwColumns(*(torch.full((2,), 0.1 * (i + 1)) for i in range(8)))  # noqa: E731
    overlap.apply(buf, [0, 2], cols)  # 2 x width < min_params: in order
    adamw_apply(*ref, [0, 2], cols())
    assert all(torch.equal(got, want) for got, want in zip((buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq), ref))
    overlap.min_params = 2 * width
    with pytest.raises((AssertionError, RuntimeError, AttributeError)):  # at the threshold: the stream path
        overlap.apply(buf, [0, 2], cols)

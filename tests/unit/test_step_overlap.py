"""The optimizer step by decoder layer (trainer/optim/step_overlap.py): the chunk plan over the real
SlotBuffers row layout, the AdamW kernel over a block table (Triton's interpreter on the CPU, the
kernel source the GPU compiles) against the whole-row launch, fp32 and compact (bf16) moments, and
the CPU's plain path. The order of the stream path (what each layer's forward waits for, what the
step stream waits for, where each event is recorded) with stand-in streams and events (named
fakes: CUDA events cannot exist on the CPU) around the real kernel; the overlap on real streams:
tests/gpu/test_step_overlap_gpu.py."""

import contextlib
import re

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


def test_compact_kernel_by_chunks_equals_whole_rows(kernel_device):
    """The same for slots with bf16 moments (adamw_rows_compact): the stochastic rounding is per
    element, so any partition of the columns gives the same bits."""
    torch.manual_seed(1)
    n, p = 5, 2 * triton_adamw.BLOCK + 300
    w, g = torch.randn(n, p, device=kernel_device), torch.randn(n, p, device=kernel_device)
    mv = torch.randn(n, 2 * p, device=kernel_device).abs().to(torch.bfloat16)
    ids = torch.tensor([1, 2, 4], dtype=torch.int32, device=kernel_device)
    coef = torch.rand(3, 8, device=kernel_device) * 0.4 + 0.05
    keys = torch.tensor([5, -7, 2**30], dtype=torch.int32, device=kernel_device)
    whole = [t.clone() for t in (w, g, mv)]
    triton_adamw.adamw_rows_compact(*whole, ids, coef, keys)
    for ranges in [[(0, 100), (3000, p)], [(100, 3000)]]:
        triton_adamw.adamw_rows_compact(w, g, mv, ids, coef, keys, triton_adamw.BlockTable(ranges, kernel_device))
    for name, got, want in zip(("weight", "grad", "moments"), (w, g, mv), whole):
        assert torch.equal(got, want), name
    assert not torch.equal(mv[1], mv.clone()[1].zero_())


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


# -- the stream path's order, with stand-in streams and events ------------------------------------


class _FakeEvent:
    """Stand-in for torch.cuda.Event (a named fake: CUDA events cannot exist on the CPU): where in
    the log it was recorded, and on which stream."""

    def __init__(self, log: list) -> None:
        self.log, self.at = log, None

    def record(self, stream: "_FakeStream") -> None:
        self.at = len(self.log)
        self.log.append(("record", stream.name, self))

    def __repr__(self) -> str:
        return f"<event recorded at log[{self.at}]>"

    def query(self) -> bool:
        return True


class _FakeStream:
    """Stand-in for a CUDA stream: its waits go to the log."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event))

    def wait_stream(self, other: "_FakeStream") -> None:
        self.log.append(("wait_stream", self.name, other.name))


@pytest.fixture
def fake_streams(monkeypatch):
    """torch.cuda's streams and events replaced by the stand-ins above; the AdamW launches (the real
    kernels, Triton's interpreter) logged with the stream they were issued on and their columns."""
    log: list = []
    current = [_FakeStream(log, "main")]
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream(log, "step"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])

    @contextlib.contextmanager
    def on(stream):  # noqa: ANN001, ANN202
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "stream", on)
    for name in ("adamw_rows", "adamw_rows_compact"):
        real = getattr(triton_adamw, name)

        def logged(*args, _real=real, _name=name):
            log.append(("launch", current[-1].name, _name, list(args[6].ranges) if len(args) > 6 else "whole rows"))
            return _real(*args)

        monkeypatch.setattr(triton_adamw, name, logged)
    return log


def _switched_on(layers: list, buf: SlotBuffers, device: torch.device) -> StepOverlap:
    """A StepOverlap on its stream path, switched there as its constructor does on CUDA (on the CPU
    it would not; streams and events: the stand-ins)."""
    overlap = StepOverlap(layers, buf, device, enabled=True)
    ranges, _ = plan_chunks([layer.name for layer in layers], buf.layer_columns())
    overlap.active, overlap.stream = True, torch.cuda.Stream()
    overlap.chunks = [triton_adamw.BlockTable(r, device) for r in ranges]
    for layer in layers:
        layer.step_overlap = overlap
    return overlap


def _layer_columns(layer: _Lora, buf: SlotBuffers) -> set[int]:
    """The row columns a layer's A and B occupy, from where their views point into the buffer."""
    cols: set[int] = set()
    for param in (layer.lora_A, layer.lora_B):
        start = (param.data_ptr() - buf.weight.data_ptr()) // buf.weight.element_size()
        cols |= set(range(start, start + param[0].numel()))
    return cols


def _covers(launch: tuple, cols: set[int]) -> bool:
    return any(lo <= c < hi for lo, hi in launch[3] for c in (min(cols), max(cols)))


def test_each_layer_waits_for_the_event_after_its_own_rows(fake_streams, monkeypatch, kernel_device):
    """The stream path, in order: the step stream first waits for the main stream (the gradients
    and norms); per decoder layer (forward order, the output layer last), one launch per state
    dtype on the step stream, then one event; a layer's forward waits for exactly the event
    recorded right after the launches that wrote its rows (not an earlier one: its rows would not
    be written yet; not a later one: the forward would wait for more than it reads); ``settle``
    waits for the last. The rows equal the whole-row update's (float32 and bfloat16 slots)."""
    log = fake_streams
    layers = _layers()
    buf = SlotBuffers(layers, 3, kernel_device)
    buf.weight.normal_()
    buf.grad.normal_()
    overlap = _switched_on(layers, buf, kernel_device)
    cols = lambda: AdamwColumns.build(  # noqa: E731
        torch.float32, kernel_device, grad_scale=torch.tensor([0.5, 2.0], dtype=torch.float64),
        lr=torch.tensor([1e-2, 3e-3], dtype=torch.float64), weight_decay=torch.tensor([0.1, 0.0], dtype=torch.float64),
        beta1=torch.tensor([0.9, 0.8], dtype=torch.float64), beta2=torch.tensor([0.99, 0.95], dtype=torch.float64),
        eps=torch.tensor([1e-6, 1e-8], dtype=torch.float64), step=torch.tensor([1.0, 1.0], dtype=torch.float64),
        state_dtypes=("float32", "bfloat16"), noise_keys=(0, 12345))
    whole = [t.clone() for t in (buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq)]
    monkeypatch.setattr(triton_adamw, "available", lambda t: True)
    adamw_apply(*whole, [0, 2], cols(), whole[2].view(torch.bfloat16))  # the kernels over whole rows
    del log[:]
    overlap.apply(buf, [0, 2], cols)
    for got, want in zip((buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq), whole):
        assert torch.equal(got, want)

    assert log[0] == ("wait_stream", "step", "main")  # before any launch
    launches = [i for i, e in enumerate(log) if e[0] == "launch"]
    records = [i for i, e in enumerate(log) if e[0] == "record"]
    assert all(log[i][1] == "step" for i in launches + records)
    decoder = lambda name: int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", name)) else 99  # noqa: E731
    groups = sorted({decoder(layer.name) for layer in layers})
    assert len(records) == len(groups) == 4 and len(launches) == 2 * len(groups)  # fp32 and bf16 launches per layer
    waited = {}
    for layer in layers:
        written = [i for i in launches if _covers(log[i], _layer_columns(layer, buf))]
        assert len(written) == 2, layer.name  # its columns: one fp32 and one bf16 launch
        after = min(r for r in records if r > max(written))
        end = len(log)
        overlap.wait(layer)
        assert log[end:] == [("wait_event", "main", log[after][2])], layer.name
        waited.setdefault(decoder(layer.name), set()).add(after)
    assert [next(iter(waited[k])) for k in groups] == records  # one event per decoder layer, in forward order
    end = len(log)
    overlap.settle()
    assert log[end:] == [("wait_event", "main", log[records[-1]][2])]

"""The compact optimizer state (bf16 moments with stochastic rounding: trainer/optim/compact_state.py)
against its reference (tests/reference/compact_adamw.py: the definition in numpy, torch.optim.AdamW
for the fp32 update), step by step, on the real slot buffers (trainer/lora/slot_buffers.py), by the
torch ops and by the Triton kernel (Triton's interpreter on the CPU, compiled on a GPU): float32
and bfloat16 slots stepping together, slot sets changing, untouched rows, zero padding; a tenant
gets the same bits in any slot and any company; the wiring of seeds and update numbers through
the trainer's step functions; the rounding's definition and its statistics; refused inputs.

Planted bugs, one at a time (python -m tests.unit.compact_state_mutations): see that runner."""

import numpy as np
import pytest
import torch

from tests.numerics import max_rel_err
from tests.reference import compact_adamw as ref
from tests.unit.test_step_overlap import _layers
from trainer.config import SlotHyperParams
from trainer.kernels import triton_adamw
from trainer.lora.slot_buffers import SlotBuffers, row_kinds, state_kind
from trainer.optim import compact_state
from trainer.optim.per_slot_optim import AdamwColumns, adamw_apply

pytestmark = pytest.mark.unit

# slot: (state dtype, seed, reference hyper-parameters); slot 2 never steps
TENANTS = {
    0: ("float32", 11, ref.Hyper(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_scale=1.0)),
    1: ("bfloat16", 2**40 + 5, ref.Hyper(lr=3e-3, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.1, grad_scale=0.25)),
    2: ("bfloat16", 3, ref.Hyper(lr=1e-3, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0)),
    3: ("bfloat16", 7, ref.Hyper(lr=2e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.02, grad_scale=4.0)),
    4: ("float32", 12, ref.Hyper(lr=5e-3, betas=(0.95, 0.99), eps=1e-5, weight_decay=0.3, grad_scale=0.5)),
}
STEPPING = [[0, 1, 3, 4], [1, 3], [0, 3, 4], [1], [0, 1, 3, 4], [3, 4], [1, 3]]
PAD = 50  # columns kept at zero weight and gradient: they must stay exactly zero


@pytest.fixture(params=["torch", "kernel"])
def path(request, monkeypatch, kernel_device):
    """Where the update runs: torch ops on the CPU, or the Triton kernel (forced on the CPU: the
    interpreter; on a GPU taken anyway)."""
    if request.param == "kernel":
        monkeypatch.setattr(triton_adamw, "available", lambda t: True)
        return kernel_device
    return torch.device("cpu")


def _buffers(device: torch.device, seed: int = 0) -> SlotBuffers:
    torch.manual_seed(seed)
    buf = SlotBuffers(_layers(len(TENANTS)), len(TENANTS), device)
    buf.weight.normal_()
    buf.weight[:, :PAD] = 0
    return buf


def _columns(slots: list[int], steps: dict[int, int], device: torch.device, tenants: dict = TENANTS) -> AdamwColumns:
    f64 = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    h = [tenants[s][2] for s in slots]
    return AdamwColumns.build(
        torch.float32, device, grad_scale=f64([x.grad_scale for x in h]), lr=f64([x.lr for x in h]),
        weight_decay=f64([x.weight_decay for x in h]), beta1=f64([x.betas[0] for x in h]),
        beta2=f64([x.betas[1] for x in h]), eps=f64([x.eps for x in h]), step=f64([float(steps[s]) for s in slots]),
        state_dtypes=tuple(tenants[s][0] for s in slots),
        noise_keys=tuple(compact_state.noise_key(tenants[s][1], steps[s]) for s in slots))


def _moments(buf: SlotBuffers, slot: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype == "float32":
        return buf.exp_avg[slot], buf.exp_avg_sq[slot]
    width = buf.weight.shape[1]
    return buf.compact_moments[slot, :width], buf.compact_moments[slot, width:]


def _step(buf: SlotBuffers, slots: list[int], cols: AdamwColumns) -> None:
    adamw_apply(buf.weight, buf.grad, buf.exp_avg, buf.exp_avg_sq, slots, cols, buf.compact_moments)


def test_steps_match_the_reference_step_by_step(path):
    """Seven steps, float32 and bfloat16 slots together, every slot its own hyper-parameters and
    seed: after each, every stepping slot's weight, moments and gradient against the reference
    from the state before the step; every other row bit for bit as it was."""
    buf = _buffers(path)
    steps = {s: 0 for s in TENANTS}
    flips = compared = 0
    for k, slots in enumerate(STEPPING):
        g = torch.Generator().manual_seed(100 + k)
        buf.grad.copy_(torch.randn(buf.grad.shape, generator=g))
        buf.grad[:, :PAD] = 0
        before = {kind: t.clone() for kind, t in buf.by_kind().items()}
        before_mv = buf.compact_moments.clone()
        for s in slots:
            steps[s] += 1
        _step(buf, slots, _columns(slots, steps, path))
        for s in slots:
            dtype, seed, hyper = TENANTS[s]
            width = buf.weight.shape[1]
            m0, v0 = ((before["exp_avg"][s], before["exp_avg_sq"][s]) if dtype == "float32"
                      else (before_mv[s, :width], before_mv[s, width:]))
            want = ref.adamw_row(before["weight"][s], before["grad"][s], m0, v0, hyper, step=steps[s],
                                 seed=seed if dtype == "bfloat16" else None)
            m, v = _moments(buf, s, dtype)
            assert max_rel_err(buf.weight[s].cpu(), want.weight) <= 2e-6, (k, s)
            if dtype == "float32":
                assert max_rel_err(m.cpu(), want.m) <= 2e-6 and max_rel_err(v.cpu(), want.v) <= 2e-6, (k, s)
            else:
                flips += ref.rounding_mismatches(m, want.m32, want.h >> np.uint32(16))
                flips += ref.rounding_mismatches(v, want.v32, want.h & np.uint32(0xFFFF))
                compared += 2 * width
                assert torch.count_nonzero(buf.exp_avg_sq[s]) == 0, "a bf16 slot's exp_avg_sq row stays unused"
            assert torch.count_nonzero(buf.grad[s]) == 0  # consumed
            assert torch.count_nonzero(buf.weight[s, :PAD]) == 0 and torch.count_nonzero(m[:PAD]) == 0
            assert torch.count_nonzero(v[:PAD]) == 0
        for s in set(TENANTS) - set(slots):
            for kind, t in buf.by_kind().items():
                assert torch.equal(t[s], before[kind][s]), (k, s, kind)
    assert steps[1] == 5 and steps[3] == 6 and compared > 0
    assert flips <= 1e-3 * compared, f"{flips} of {compared} roundings flipped"  # measured: 0 (torch and kernel)


def test_a_tenant_gets_the_same_bits_in_any_slot_and_any_company(path):
    """A bfloat16 tenant in slot 1 stepping with slots 0 and 3, and the same tenant in slot 4 of
    other buffers stepping alone: bit-identical weight, moments and gradient (the rounding noise is
    the tenant's: seed, update number, column; never the slot or the other slots)."""
    tenant = TENANTS[1]
    a, b = _buffers(path, seed=1), _buffers(path, seed=2)
    b.weight[4].copy_(a.weight[1])
    for step in (1, 2, 3):
        grad = torch.randn(a.weight.shape[1], generator=torch.Generator().manual_seed(step))
        a.grad.normal_()
        a.grad[1] = grad
        b.grad[4] = grad
        _step(a, [0, 1, 3], _columns([0, 1, 3], {0: step, 1: step, 3: step}, path))
        _step(b, [4], _columns([4], {4: step}, path, {4: tenant}))
        assert torch.equal(a.weight[1], b.weight[4]) and torch.equal(a.grad[1], b.grad[4])
        assert torch.equal(a.compact_moments[1], b.compact_moments[4]), step
    assert torch.count_nonzero(a.compact_moments[1]) > 0


def test_kernel_and_torch_ops_round_alike(kernel_device, monkeypatch):
    """The kernel's and the torch ops' compact updates of the same rows: weights within an ulp or
    two, stored moments identical except roundings the two fp32 results put on either side of a
    boundary (reference.rounding_mismatches; measured on the CPU: none)."""
    cpu = _buffers(torch.device("cpu"))
    dev = _buffers(kernel_device)
    dev.weight.copy_(cpu.weight)  # the same start: CUDA's generator draws other numbers than the CPU's
    cpu.grad.normal_()
    dev.grad.copy_(cpu.grad)
    slots, steps = [1, 2, 3], {1: 4, 2: 1, 3: 9}
    _step(cpu, slots, _columns(slots, steps, torch.device("cpu")))
    monkeypatch.setattr(triton_adamw, "available", lambda t: True)
    calls = []
    real = triton_adamw.adamw_rows_compact
    monkeypatch.setattr(triton_adamw, "adamw_rows_compact", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    _step(dev, slots, _columns(slots, steps, kernel_device))
    assert calls == [slots]  # the kernel ran, on these rows
    for s in slots:
        assert max_rel_err(dev.weight[s].cpu(), cpu.weight[s]) <= 1e-6
        steps_apart = (dev.compact_moments[s].cpu().view(torch.int16).int() - cpu.compact_moments[s].view(torch.int16).int()).abs()
        assert steps_apart.max() <= 1 and int(steps_apart.count_nonzero()) <= 1e-3 * steps_apart.numel()
    assert torch.equal(dev.compact_moments[0].cpu(), cpu.compact_moments[0]) and torch.equal(dev.grad[0].cpu(), cpu.grad[0])


def test_seed_and_update_number_reach_the_rounding(monkeypatch):
    """The trainer's two step functions (slot_steps.step_due_slots, the loop's; adam_step, the Tinker
    API's) give a bfloat16 slot the noise of its own seed and update number, and a float32 slot its
    plain update: against the reference from the state before each step."""
    from trainer.lora.slots import NUM, SAMPLES, SlotState, zero_stats
    from trainer.optim.slot_steps import adam_step, step_due_slots
    from trainer.optim.step_overlap import StepOverlap
    from trainer.platform.distributed import ParallelLayout

    layers = _layers(len(TENANTS))
    buf = SlotBuffers(layers, len(TENANTS), torch.device("cpu"))
    buf.weight.normal_()
    overlap = StepOverlap(layers, buf, torch.device("cpu"), enabled=False)
    layout = ParallelLayout(rank=0, world_size=1, tp_rank=0, tp_size=1, dp_rank=0, dp_size=1)
    states = {s: SlotState(hyper=SlotHyperParams(lr=h.lr, betas=h.betas, eps=h.eps, weight_decay=h.weight_decay,
                                                 max_grad_norm=None, samples_per_step=1, state_dtype=dtype),
                           rank=4, scale=1.0, seed=seed, registration=None) for s, (dtype, seed, h) in TENANTS.items()}
    width = buf.weight.shape[1]
    for k, due in enumerate([[0, 1, 3], [1, 2], [1]]):
        buf.grad.copy_(torch.randn(buf.grad.shape, generator=torch.Generator().manual_seed(k)))
        before_w, before_g, before_mv = buf.weight.clone(), buf.grad.clone(), buf.compact_moments.clone()
        before_m, before_v = buf.exp_avg.clone(), buf.exp_avg_sq.clone()
        for s in due:
            states[s].pending = zero_stats()
            states[s].pending[SAMPLES], states[s].pending[NUM] = 1.0, 0.5  # sequence_mean over 1 sample: scale 1
        if k < 2:
            step_due_slots(buf, due, [states[s] for s in due], layout, torch.device("cpu"), overlap)
        else:  # the Tinker step: the call's own parameters
            h = TENANTS[1][2]
            adam_step(buf, 1, states[1], layout, torch.device("cpu"), lr=h.lr, beta1=h.betas[0], beta2=h.betas[1],
                      eps=h.eps, weight_decay=h.weight_decay, max_grad_norm=None)
        for s in due:
            dtype, seed, h = TENANTS[s]
            hyper = ref.Hyper(h.lr, h.betas, h.eps, h.weight_decay)
            m0, v0 = ((before_m[s], before_v[s]) if dtype == "float32" else (before_mv[s, :width], before_mv[s, width:]))
            want = ref.adamw_row(before_w[s], before_g[s], m0, v0, hyper, step=states[s].step,
                                 seed=seed if dtype == "bfloat16" else None)
            assert max_rel_err(buf.weight[s], want.weight) <= 2e-6
            m, v = _moments(buf, s, dtype)
            if dtype == "bfloat16":
                ref.rounding_mismatches(m, want.m32, want.h >> np.uint32(16))
                ref.rounding_mismatches(v, want.v32, want.h & np.uint32(0xFFFF))
    assert [states[s].step for s in range(5)] == [1, 3, 1, 1, 0]


def test_rounding_is_its_definition_and_unbiased():
    """The product's noise and rounding equal the reference's (seeds above 2^32 and negative,
    values of both signs, zero, subnormals, inf), and the rounding is unbiased: over many keys the
    mean of round(x) is x (four standard errors), each result one of x's two bf16 neighbours."""
    for seed, step in ((0, 1), (2**40 + 5, 17), (-3, 2**33 + 1), (123456789, 0)):
        assert compact_state.noise_key(seed, step) == int(ref.key(seed, step))
        got = compact_state.row_noise([compact_state.noise_key(seed, step)], 4099, torch.device("cpu"))[0]
        assert np.array_equal(got.numpy().astype(np.uint32), ref.noise(seed, step, 4099))
    x = torch.cat([torch.randn(3000) * 10.0 ** torch.randint(-30, 30, (3000,)),
                   torch.tensor([0.0, -0.0, 1e-40, -1e-42, float("inf"), -float("inf"), 3.0e38])])
    r = ref.noise(5, 3, x.numel()) >> np.uint32(16)
    got = compact_state.round_stochastic(x, torch.from_numpy(r.astype(np.int64)))
    assert torch.equal(got.view(torch.int16), ref.round_with(x, r).view(torch.int16))
    values = torch.tensor([1.0 + 2**-9, 1.0 + 3 * 2**-10, -(1.0 + 2**-12), 0.3, 1e-3, -7.7])
    n = 4096
    keys = [compact_state.noise_key(9, t) for t in range(n)]
    noise = compact_state.row_noise(keys, 1, torch.device("cpu"))[:, 0] & compact_state.LOW16
    rounded = compact_state.round_stochastic(values.repeat(n, 1), noise.unsqueeze(1)).float()
    down = ref.round_with(values, np.zeros(len(values), dtype=np.uint32)).float()  # |x| rounded down
    up = ref.round_with(values, np.full(len(values), 0xFFFF, dtype=np.uint32)).float()  # and up
    assert ((rounded == down) | (rounded == up)).all() and (down != up).all()
    spread = (rounded - values).std(dim=0)
    assert ((rounded.mean(dim=0) - values).abs() <= 4 * spread / n**0.5).all()


def test_bf16_second_moment_decays_where_nearest_rounding_stalls():
    """Why the rounding is stochastic (compact_state.py): after large gradients then 500 small ones,
    beta2 = 0.999, a bf16 second moment stored with this rounding stays within 1% of the fp32 one
    on average; stored with round-to-nearest it stays where the large gradients left it."""
    g = torch.Generator().manual_seed(0)
    n, beta2 = 4096, 0.999
    v32 = torch.zeros(n)
    v_sr = torch.zeros(n, dtype=torch.bfloat16)
    v_rn = torch.zeros(n, dtype=torch.bfloat16)
    for t in range(1, 521):
        grad = torch.randn(n, generator=g) * (1.0 if t <= 20 else 1e-3)
        v32 = v32 * beta2 + (1 - beta2) * grad * grad
        h = compact_state.row_noise([compact_state.noise_key(1, t)], n, torch.device("cpu"))[0]
        v_sr = compact_state.round_stochastic(v_sr.float() * beta2 + (1 - beta2) * grad * grad, h & compact_state.LOW16)
        v_rn = (v_rn.float() * beta2 + (1 - beta2) * grad * grad).to(torch.bfloat16)
    assert abs(v_sr.float().mean() / v32.mean() - 1) < 0.01
    assert v_rn.float().mean() / v32.mean() > 1.3  # measured 1.6: v never decays


def test_buffers_place_bf16_moments_in_the_slots_exp_avg_row():
    """views('exp_avg.bfloat16') / ('exp_avg_sq.bfloat16') are each parameter's block of the first
    / second half of a slot's exp_avg row bytes; writing them touches no other row, and no
    exp_avg_sq row."""
    layers = _layers(3)
    buf = SlotBuffers(layers, 3, torch.device("cpu"))
    width = buf.weight.shape[1]
    assert buf.compact_moments.shape == (3, 2 * width) and buf.compact_moments.dtype == torch.bfloat16
    assert buf.compact_moments.data_ptr() == buf.exp_avg.data_ptr()
    for kind, half in (("exp_avg", 0), ("exp_avg_sq", 1)):
        for view, (start, shape, _) in zip(buf.views(state_kind(kind, "bfloat16")), buf.row_layout):
            view[1].fill_(1.5)
            assert torch.equal(buf.compact_moments[1, half * width + start:][: shape.numel()],
                               torch.full((shape.numel(),), 1.5, dtype=torch.bfloat16))
    assert torch.count_nonzero(buf.compact_moments[1]) == 2 * width  # every column of both halves, once
    assert torch.count_nonzero(buf.exp_avg[[0, 2]]) == 0 and torch.count_nonzero(buf.exp_avg_sq) == 0
    assert state_kind("weight", "bfloat16") == "weight" and state_kind("exp_avg", "float32") == "exp_avg"
    assert row_kinds("bfloat16") == ("weight", "grad", "exp_avg") and len(row_kinds("float32")) == 4


def test_an_adapters_config_chooses_its_slots_state():
    """adam_state_dtype of a tenant's adapter config (REST body, job file) becomes its slot's
    state_dtype; float32 unless asked; anything else refused naming the two choices."""
    from pydantic import ValidationError

    from service.config.adapter import AdapterConfig

    base = dict(data={"path": "x.jsonl"}, reward={"name": "target_share"}, num_step=5)
    assert AdapterConfig(**base).slot_hyper_params(None).state_dtype == "float32"
    assert AdapterConfig(**base, adam_state_dtype="bfloat16").slot_hyper_params(None).state_dtype == "bfloat16"
    with pytest.raises(ValidationError, match="'float32' or 'bfloat16'"):
        AdapterConfig(**base, adam_state_dtype="int8")


def test_refused_inputs_say_what_is_allowed(kernel_device):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="float32.*bfloat16"):
        SlotHyperParams(state_dtype="int8")
    with pytest.raises(ValueError, match="allowed are float32, bfloat16"):
        state_kind("exp_avg", "float16")
    w = torch.zeros(2, 8)
    cols = AdamwColumns(*(torch.full((1,), 0.1) for _ in range(8)), state_dtypes=("bfloat16",), noise_keys=(1,))
    with pytest.raises(ValueError, match="bf16 \\[N, 2P\\] moment rows"):
        adamw_apply(w, w.clone(), w.clone(), w.clone(), [0], cols)  # no compact moments given
    with pytest.raises(ValueError, match="rounding key"):
        adamw_apply(w, w.clone(), w.clone(), w.clone(), [0], AdamwColumns(*cols.kernel_table().unbind(1), state_dtypes=("bfloat16",)),
                    torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="each must be float32 or bfloat16"):
        adamw_apply(w, w.clone(), w.clone(), w.clone(), [0], AdamwColumns(*cols.kernel_table().unbind(1), state_dtypes=("int8",)))
    dev = torch.zeros(2, 8, device=kernel_device)
    coef, keys = torch.zeros(1, 8, device=kernel_device), torch.zeros(1, dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="moments must be bf16 \\[2, 16\\]"):
        triton_adamw.adamw_rows_compact(dev, dev.clone(), torch.zeros(2, 16, device=kernel_device), [0], coef, keys)
    with pytest.raises(ValueError, match="keys must be int32 \\[1\\]"):
        triton_adamw.adamw_rows_compact(dev, dev.clone(), torch.zeros(2, 16, dtype=torch.bfloat16, device=kernel_device),
                                        [0], coef, keys.long())

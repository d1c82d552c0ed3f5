"""The fused LoRA node (trainer/lora/fused_lora.py) under tensor parallel 2: two gloo processes,
real Megatron ColumnParallelLinear / RowParallelLinear, fp32 on the CPU.

For column-parallel (plain and gate_up layouts) and row-parallel layers, one packed stream
over several slots of different ranks (and one of a single slot), the fused node at TP=2
gives the same output, input gradient and slot gradients (A and B, accumulated into preset
buffers) as:
* the definition, y = x W^T + s(t) B_g A_g x, differentiated by torch autograd in fp64;
* the general path at TP=2 (Megatron's linear and its own communication, then the delta);
* the general path at TP=1 (one process's whole layer).
The replicated half of each layer's LoRA (A of a column-parallel layer, B of a row-parallel
one) gets the same gradient on both ranks, bit for bit, as the optimizer assumes.

All cases run in one spawn of two processes (module fixture); each test checks one case.
tests/gpu/test_parallel_bf16_gpu.py runs the same worker over NCCL in bf16.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration

N, R, IN, OUT, TP = 6, 8, 32, 48, 2
SLOT_RANKS = [4, 8, 2, 8, 3, 5]
SLOT_SCALES = [2.0, 0.5, 1.0, 3.0, 1.5, 0.75]
STREAMS = {"multi": ([5, 9, 7, 4], [1, 1, 3, 4]),  # slots 0, 2, 5 absent (2 empty inside the span)
           "single": ([6, 5], [3, 3])}  # one segment: the node's plain-GEMM branch
LAYOUTS = {"column": ("column", "plain"), "gate_up": ("column", "gate_up"), "row": ("row", "plain")}
# (lora_kernel, lora_rank_kernels, stream, x needs grad)
VARIANTS = {
    "auto-library-multi": ("auto", "library", "multi", True),
    "loop-library-multi": ("loop", "library", "multi", True),
    "auto-triton-multi": ("auto", "triton", "multi", True),
    "auto-library-single": ("auto", "library", "single", True),
    "auto-library-multi-nodx": ("auto", "library", "multi", False),  # the first layer: no input gradient
}
CASES = [f"{layout}/{variant}" for layout in LAYOUTS for variant in VARIANTS]
TOL = 1e-6
GRAD_PRESET_A, GRAD_PRESET_B = 0.25, -0.5


def _full_tensors(case: str):
    """The case's whole (TP=1) tensors in fp64, the same on every rank."""
    g = torch.Generator().manual_seed(CASES.index(case))
    w = torch.randn(OUT, IN, generator=g, dtype=torch.float64) / IN**0.5
    a = torch.zeros(N, R, IN, dtype=torch.float64)
    b = torch.zeros(N, OUT, R, dtype=torch.float64)
    for i, r in enumerate(SLOT_RANKS):
        a[i, :r] = torch.randn(r, IN, generator=g, dtype=torch.float64)
        b[i, :, :r] = torch.randn(OUT, r, generator=g, dtype=torch.float64)
    lengths, slots = STREAMS[VARIANTS[case.split("/")[1]][2]]
    tokens = [torch.randint(0, 50, (n,), generator=g) for n in lengths]
    t = sum(lengths)
    x = torch.randn(t, IN, generator=g, dtype=torch.float64)
    gy = torch.randn(t, OUT, generator=g, dtype=torch.float64)
    return w, a, b, x, gy, tokens, slots


def _definition(w, a, b, x, gy, token_slots):
    """Output and gradients from the definition, by torch autograd in fp64 (the independent
    reference): y[t] = x[t] W^T + s(g) B_g A_g x[t], g = slot of token t."""
    a, b, x = (v.clone().requires_grad_() for v in (a, b, x))
    scale = torch.tensor(SLOT_SCALES, dtype=torch.float64)[token_slots]
    h = torch.einsum("ti,tri->tr", x, a[token_slots]) * scale[:, None]
    y = x @ w.t() + torch.einsum("tr,tor->to", h, b[token_slots])
    y.backward(gy)
    return {"y": y.detach(), "dx": x.grad, "dA": a.grad + GRAD_PRESET_A, "dB": b.grad + GRAD_PRESET_B}


def _made_by_fused_node(y: torch.Tensor) -> bool:
    fns, seen = [y.grad_fn], 0
    while fns and seen < 4:
        if any(f is not None and "FusedLoraLinear" in f.name() for f in fns):
            return True
        fns = [n for f in fns if f is not None for n, _ in f.next_functions]
        seen += 1
    return False


class _FrozenLinear(torch.nn.Module):
    """The whole (TP=1) base for the TP=1 general path: x @ W^T with Megatron's (out, bias) return."""

    def __init__(self, w):
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.bias = None

    def forward(self, x):
        return x @ self.weight.t(), None


def _megatron_linear(parallel: str, dtype: torch.dtype, device: torch.device):
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=TP, params_dtype=dtype,
                                 use_cpu_initialization=device.type == "cpu")
    init = torch.nn.init.zeros_  # the case's weights are copied in below
    if parallel == "column":  # as Megatron's GPT layer builds linear_qkv / linear_fc1
        return ColumnParallelLinear(IN, OUT, config=config, init_method=init, bias=False, gather_output=False)
    return RowParallelLinear(IN, OUT, config=config, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=True)


def _run_layer(case, *, tp_group, fused, dtype=torch.float32, device=torch.device("cpu")):
    """(whole-layout results, the layer, whether the fused node ran) of one case on this rank:
    TP=2 over ``tp_group``, or the whole layer when ``tp_group`` is None. Activations and the
    frozen base in ``dtype``, LoRA masters in fp32 (as the trainer keeps them)."""
    from trainer.lora.multi_lora import MultiLoraLinear, SlotRouting
    from trainer.base.packing import pack_sequences

    parallel, kind = LAYOUTS[case.split("/")[0]]
    kernel, rank_kernels, _, x_grad = VARIANTS[case.split("/")[1]]
    w, a, b, x, gy, tokens, slots = (v.to(device, torch.float32) if isinstance(v, torch.Tensor) else v
                                     for v in _full_tensors(case))
    w, x, gy = w.to(dtype), x.to(dtype), gy.to(dtype)
    routing = SlotRouting(N, kernel=kernel, fused=fused, rank_kernels=rank_kernels)
    base = _megatron_linear(parallel, dtype, device) if tp_group is not None else _FrozenLinear(w.clone())
    layer = MultiLoraLinear(base, name=case, kind=kind, parallel=parallel, num_slots=N, max_rank=R,
                            routing=routing, tp_group=tp_group, device=device)
    # Megatron's W is split like B (column: output rows) or like A (row: input columns).
    w_local = layer.local_b(w) if parallel == "column" else layer.local_a(w)
    with torch.no_grad():
        base.weight.copy_(w_local)
        base.weight.requires_grad_(False)
        for i in range(N):
            layer.lora_A[i] = layer.local_a(a[i])
            layer.lora_B[i] = layer.local_b(b[i])
    layer.lora_A.grad = torch.full_like(layer.lora_A, GRAD_PRESET_A)
    layer.lora_B.grad = torch.full_like(layer.lora_B, GRAD_PRESET_B)
    if fused and not layer.fusable:
        raise AssertionError(f"{case}: the layer did not take the fused node")

    packed = pack_sequences(tokens, slots, N)
    routing.set_packed(packed, torch.tensor(SLOT_SCALES, device=device))
    x_local = (x if parallel == "column" else layer.local_a(x)).clone().requires_grad_(x_grad)
    gy_local = layer.local_b(gy.t()).t() if parallel == "column" else gy
    y, bias = layer(x_local.view(x_local.shape[0], 1, -1))
    assert bias is None
    took_fused = _made_by_fused_node(y)
    y.backward(gy_local.reshape(y.shape))
    routing.disable()
    y = y.detach().reshape(y.shape[0], -1)
    out = {
        "y": layer.full_b(y.t()).t() if parallel == "column" else y,
        "dx": None if not x_grad else (x_local.grad if parallel == "column" else layer.full_a(x_local.grad)),
        "dA": torch.stack([layer.full_a(layer.lora_A.grad[i]) for i in range(N)]),
        "dB": torch.stack([layer.full_b(layer.lora_B.grad[i]) for i in range(N)]),
    }
    return {k: None if v is None else v.double().cpu() for k, v in out.items()}, layer, took_fused


def _replicated_grad_spread(layer) -> float:
    """Largest difference between the ranks' gradients of the replicated LoRA half."""
    import torch.distributed as dist

    grad = layer.lora_A.grad if layer.parallel == "column" else layer.lora_B.grad
    parts = [torch.empty_like(grad) for _ in range(TP)]
    dist.all_gather(parts, grad.contiguous(), group=layer.tp_group)
    return max((p - parts[0]).abs().max().item() for p in parts)


def _worker(rank, port, out_path, dtype_name="float32", cases=None):
    """Every case on this rank (TP=2 over gloo on the CPU, NCCL on GPUs); rank 0 saves
    {case: errors and checks}."""
    import torch.distributed as dist

    from tests.numerics import max_rel_err
    from trainer.platform.distributed import init_parallel, tp_group

    torch.set_num_threads(1)
    layout = init_parallel(tp=TP, dp=1, rank=rank, master_port=port)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert layout.tp_size == TP
    dtype = getattr(torch, dtype_name)
    results = {}
    for case in cases or CASES:
        w, a, b, x, gy, tokens, slots = _full_tensors(case)
        lengths = [len(t) for t in tokens]
        token_slots = torch.tensor(slots).repeat_interleave(torch.tensor(lengths))
        ref = _definition(w, a, b, x, gy, token_slots)
        run = dict(dtype=dtype, device=device)
        fused, fused_layer, fused_took = _run_layer(case, tp_group=tp_group(), fused=True, **run)
        general, general_layer, general_took = _run_layer(case, tp_group=tp_group(), fused=False, **run)
        tp1, _, _ = _run_layer(case, tp_group=None, fused=False, **run)
        errs = {}
        for name in ("y", "dx", "dA", "dB"):
            if fused[name] is None:
                assert general[name] is None
                continue
            errs[f"fused_tp2_vs_definition/{name}"] = max_rel_err(fused[name], ref[name])
            errs[f"fused_tp2_vs_general_tp2/{name}"] = max_rel_err(fused[name], general[name])
            errs[f"fused_tp2_vs_general_tp1/{name}"] = max_rel_err(fused[name], tp1[name])
            errs[f"general_tp2_vs_definition/{name}"] = max_rel_err(general[name], ref[name])
            errs[f"general_tp1_vs_definition/{name}"] = max_rel_err(tp1[name], ref[name])
        results[case] = {
            "errs": errs,
            "took_fused": (fused_took, general_took),
            "replicated_spread": (_replicated_grad_spread(fused_layer), _replicated_grad_spread(general_layer)),
            "has_dx": fused["dx"] is not None,
        }
    results["refusals"] = _refusals(dtype, device)
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _refusals(dtype, device) -> dict:
    """What the fused node says of Megatron linears whose TP communication it does not do
    (those keep the general path), built for real at TP=2."""
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from trainer.platform.distributed import tp_group
    from trainer.lora.multi_lora import MultiLoraLinear, SlotRouting, fused_tp_refusal

    def config(**kw):
        return ModelParallelConfig(tensor_model_parallel_size=TP, params_dtype=dtype,
                                   use_cpu_initialization=device.type == "cpu", **kw)

    init = torch.nn.init.zeros_
    bases = {
        "gathered": ("column", ColumnParallelLinear(IN, OUT, config=config(), init_method=init, bias=False,
                                                    gather_output=True)),
        "sequence_parallel": ("column", ColumnParallelLinear(IN, OUT, config=config(sequence_parallel=True),
                                                             init_method=init, bias=False)),
        "row_input_whole": ("row", RowParallelLinear(IN, OUT, config=config(), init_method=init, bias=False,
                                                     input_is_parallel=False, skip_bias_add=True)),
        "column_plain": ("column", _megatron_linear("column", dtype, device)),
        "row_plain": ("row", _megatron_linear("row", dtype, device)),
    }
    out = {}
    for name, (parallel, base) in bases.items():
        layer = MultiLoraLinear(base, name=name, kind="plain", parallel=parallel, num_slots=N, max_rank=R,
                                routing=SlotRouting(N), tp_group=tp_group(), device=device)
        out[name] = (fused_tp_refusal(base, parallel, TP), layer.fusable)
    return out


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    out = tmp_path_factory.mktemp("fused_tp") / "results.pt"
    mp.spawn(_worker, args=(free_loopback_port(), str(out)), nprocs=TP, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", CASES)
def test_fused_node_at_tp2_equals_definition_and_general_paths(tp2_results, case):
    res = tp2_results[case]
    assert res["took_fused"] == (True, False), f"{case}: fused node taken (fused run, general run) = {res['took_fused']}"
    assert res["has_dx"] == VARIANTS[case.split("/")[1]][3]
    worst = max(res["errs"], key=res["errs"].get)
    assert res["errs"][worst] <= TOL, f"{case}: {worst} relative error {res['errs'][worst]:.2e} > {TOL:.0e}"
    print(f"{case}: worst {worst} {res['errs'][worst]:.2e}")


@pytest.mark.parametrize("case", CASES)
def test_replicated_lora_half_gets_the_same_gradient_on_every_rank(tp2_results, case):
    fused_spread, general_spread = tp2_results[case]["replicated_spread"]
    assert fused_spread == 0.0, f"{case}: the replicated LoRA half's gradient differs across ranks by {fused_spread:.2e}"
    assert general_spread == 0.0


def test_linears_whose_tp_communication_differs_keep_the_general_path(tp2_results):
    refusals = tp2_results["refusals"]
    assert refusals["gathered"] == ("gathered output", False)
    assert refusals["sequence_parallel"] == ("sequence parallelism", False)
    assert refusals["row_input_whole"] == ("row-parallel input not split", False)
    assert refusals["column_plain"] == (None, True) and refusals["row_plain"] == (None, True)

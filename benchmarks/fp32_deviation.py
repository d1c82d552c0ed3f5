"""Where does the fp32 mixed-vs-alone deviation on CUDA come from? One run, one suspect off at a time.

The proof scenario of tests/integration/test_trainer_equivalence.py (4 slots, 3 calls, mixed
batches, accumulation, phases) runs in fp32 on the device under each variant below; for each it
measures, mixed vs each adapter alone (max relative error, max over slots; the slot in brackets):

* 3 calls, smooth Adam eps (the scenario's SMOOTH_ADAM): losses, grad norms, weights, moments;
* 1 call, tiny eps (DEFAULT_ADAM): losses, grad norms, moments, pending gradients (nothing
  there passes through Adam's division, so Adam's amplification of near-zero gradients
  shows as the difference between the two blocks);
* the 3-call mixed run repeated: run-to-run nondeterminism (atomics, autotuned kernels).

Suspects (issue 13): Triton's tl.dot precision (trainer/kernels/triton_lora.py, ``lora_rank_kernels``),
cuBLAS/cuDNN TF32 flags (shown both ways), grouped_mm (``lora_kernel=loop``), the fused LoRA
node, flash/varlen vs SDPA vs dense attention in fp32, Triton RoPE and AdamW, chunked
log-probs, deterministic algorithms (atomic accumulation order), and the trainer's dtype
left at ``auto`` (bf16 on CUDA: what the CPU test measures when run unchanged on a GPU).

With 2 GPUs (``--parallel``), TP=2 and DP=2 over NCCL for the default and the all-off
variant: mixed vs alone inside the run, and the TP/DP mixed run vs the 1-GPU one.

Its CPU sibling, benchmarks/fp32_cpu_orders.py, runs the default tier's proofs under the kernel
profiles of several x86 CPUs; the CPU tests' bounds are derived from it.

Usage (repo root on the device, wheels installed as in benchmarks/gpu_suite.sh):
    python3 -m benchmarks.fp32_deviation --out fp32_deviation.json [--parallel]
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.failures import describe_failure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MULTI = ("loss", "grad_norm", "weight", "exp_avg", "exp_avg_sq")
FIRST = ("loss", "grad_norm", "exp_avg", "exp_avg_sq", "grad")


def scenario_module():
    path = REPO / "tests" / "integration" / "test_trainer_equivalence.py"
    spec = importlib.util.spec_from_file_location("trainer_equivalence_scenario", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the suspects ------------------------------------------------------------------------------


@contextlib.contextmanager
def tf32(on: bool):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    torch.set_float32_matmul_precision("high" if on else "highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[0], before[1]
        torch.set_float32_matmul_precision(before[2])


@contextlib.contextmanager
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def patched(module_name: str, attr: str, value):
    import importlib

    module = importlib.import_module(module_name)
    before = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, before)


def no_triton_rope():
    return patched("trainer.base.base_model", "triton_rope_enabled", lambda: False)


def no_triton_adamw():
    return patched("trainer.kernels.triton_adamw", "available", lambda *a, **k: False)


def attention_backend(name: str):
    def hook(trainer):
        for layer in trainer.base.model.decoder.layers:
            core = layer.self_attention.core_attention
            if hasattr(core, "packed_backend"):
                core.packed_backend = name
    return hook


@contextlib.contextmanager
def stacked(*cms):
    with contextlib.ExitStack() as stack:
        for cm in cms:
            stack.enter_context(cm)
        yield


ALL_OFF = dict(lora_rank_kernels="library", lora_kernel="loop", fused_lora=False, chunked_logprobs=False)

# name -> (TrainerConfig overrides, context manager factory or None, post-build hook or None)
VARIANTS = {
    "default fp32": ({}, None, None),
    "dtype auto (bf16 on CUDA)": ({"dtype": "auto"}, None, None),
    "TF32 on (cuBLAS + cuDNN)": ({}, lambda: tf32(True), None),
    "TF32 off explicitly": ({}, lambda: tf32(False), None),
    "lora_rank_kernels=library (no Triton LoRA)": ({"lora_rank_kernels": "library"}, None, None),
    "lora_rank_kernels=triton (Triton LoRA always)": ({"lora_rank_kernels": "triton"}, None, None),
    "lora_kernel=loop (no grouped_mm)": ({"lora_kernel": "loop"}, None, None),
    "fused_lora=False": ({"fused_lora": False}, None, None),
    "attention: packed dense (per-doc SDPA)": ({}, None, attention_backend("dense")),
    "attention: packed varlen (flash)": ({}, None, attention_backend("varlen")),
    "attention: padded + local spec (unfused)": ({"packed": False, "layer_spec": "local"}, None, None),
    "chunked_logprobs=False": ({"chunked_logprobs": False}, None, None),
    "Triton RoPE off": ({}, no_triton_rope, None),
    "Triton AdamW off": ({}, no_triton_adamw, None),
    "deterministic algorithms": ({}, deterministic, None),
    "all suspects off": ({**ALL_OFF, "packed": False, "layer_spec": "local"},
                         lambda: stacked(tf32(False), deterministic(), no_triton_rope(), no_triton_adamw()), None),
}


# -- measuring ---------------------------------------------------------------------------------


QUANTITY_KIND = {"losses": "loss", "grad norms": "grad_norm"}  # equivalence_errors' names -> the table's


def worst(scn, got: dict, ref: dict, kinds: tuple[str, ...]) -> dict[str, tuple[float, int]]:
    """Max relative error per quantity over slots, with the slot where it is largest (the tests'
    own measure: test_trainer_equivalence.equivalence_errors)."""
    out = {k: (0.0, -1) for k in kinds}
    for e, slot, what in scn.equivalence_errors(got, ref, kinds=tuple(k for k in scn.KINDS if k in kinds)):
        k = QUANTITY_KIND.get(what, what.split(" ")[0])
        if k in out and e > out[k][0]:
            out[k] = (e, slot)
    return out


def build_trainer(scn, tiny, overrides: dict, tp: int = 1, dp: int = 1, rank: int = 0, port: int | None = None):
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(scn.scenario_config(tiny, tp=tp, dp=dp, **overrides), rank=rank, master_port=port)


def measure(scn, trainer, batches, objectives: str) -> dict:
    multi = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives]), batches)
    first = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives], eps=scn.DEFAULT_ADAM), batches[:1])
    again = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives]), batches)
    return {
        "multi": worst(scn, multi["mixed"], multi["alone"], MULTI),
        "first": worst(scn, first["mixed"], first["alone"], FIRST),
        "repeat": worst(scn, again["mixed"], multi["mixed"], ("weight",)),
        "_mixed": multi["mixed"],
    }


def describe(trainer) -> str:
    from trainer.base.fused_attention import resolve_packed_backend

    core = trainer.base.model.decoder.layers[0].self_attention.core_attention
    backend = getattr(core, "packed_backend", "-")
    if backend == "auto":
        backend = "auto->" + resolve_packed_backend("auto", trainer.device, 0.0, trainer.base.dtype)
    return f"{str(trainer.base.dtype).removeprefix('torch.')}, attention {type(core).__name__}/{backend}"


def _parallel_worker(rank, port, overrides, tp, dp, batches, objectives, out_path):
    import torch.distributed as dist

    scn = scenario_module()
    from examples.tiny.build import ensure_tiny_world

    trainer = build_trainer(scn, ensure_tiny_world(), overrides, tp=tp, dp=dp, rank=rank, port=port)
    run = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives]), batches)
    if rank == 0:
        torch.save(run, out_path)
    dist.barrier()
    dist.destroy_process_group()


def run_parallel(scn, name, overrides, tp, dp, batches, objectives, tp1_mixed, tmp: Path) -> dict:
    import torch.multiprocessing as mp

    from trainer.platform.distributed import free_loopback_port

    out = tmp / f"par-{tp}-{dp}.pt"
    mp.spawn(_parallel_worker, args=(free_loopback_port(), overrides, tp, dp, batches, objectives, str(out)),
             nprocs=tp * dp, join=True)
    run = torch.load(out, weights_only=False)
    return {"inside": worst(scn, run["mixed"], run["alone"], MULTI), "vs_1gpu": worst(scn, run["mixed"], tp1_mixed, MULTI)}


def fmt(cell: tuple[float, int]) -> str:
    e, slot = cell
    return f"{e:.1e}[{slot}]" if slot >= 0 else "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fp32_deviation.json")
    ap.add_argument("--objectives", default="rl", choices=["rl", "sft", "mixed"])
    ap.add_argument("--only", default="", help="comma list of variant names (default: all)")
    ap.add_argument("--parallel", action="store_true", help="also TP=2 and DP=2 over NCCL (needs 2 GPUs)")
    args = ap.parse_args()

    from examples.tiny.build import ensure_tiny_world

    scn = scenario_module()
    tiny = ensure_tiny_world()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; "
          f"start flags: matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32} "
          f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} "
          f"float32_matmul_precision={torch.get_float32_matmul_precision()}", flush=True)
    base = build_trainer(scn, tiny, {})
    batches = scn.make_batches(base)  # one data set for every variant
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    results: dict = {}
    tp1_mixed = {}
    for name in names:
        overrides, cm, hook = VARIANTS[name]
        t0 = time.perf_counter()
        try:
            with (cm() if cm else contextlib.nullcontext()):
                trainer = base if not overrides and cm is None and hook is None else build_trainer(scn, tiny, overrides)
                if hook:
                    hook(trainer)
                res = measure(scn, trainer, batches, args.objectives)
                res["setup"] = describe(trainer)
                if hook:
                    attention_backend("auto")(trainer)
        except Exception as err:  # noqa: BLE001 - one failing variant must not end the survey
            res = {"error": describe_failure(err)}
            traceback.print_exc()
        res["seconds"] = round(time.perf_counter() - t0, 1)
        if name in ("default fp32", "all suspects off") and "_mixed" in res:
            tp1_mixed[name] = res["_mixed"]
        res.pop("_mixed", None)
        results[name] = res
        print(f"{name}: {json.dumps(res, default=str)}", flush=True)

    if args.parallel:
        if torch.cuda.device_count() < 2:
            print("--parallel: fewer than 2 GPUs, skipped")
        else:
            tmp = Path(args.out).resolve().parent
            for name in ("default fp32", "all suspects off"):
                if name not in tp1_mixed:
                    continue
                overrides = {k: v for k, v in VARIANTS[name][0].items() if k not in ("packed", "layer_spec")}
                for tp, dp in ((2, 1), (1, 2)):
                    key = f"{name} (config part), tp={tp} dp={dp}"
                    t0 = time.perf_counter()
                    try:
                        results[key] = run_parallel(scn, name, overrides, tp, dp, batches, args.objectives,
                                                    tp1_mixed[name], tmp)
                    except Exception as err:  # noqa: BLE001
                        results[key] = {"error": describe_failure(err)}
                        traceback.print_exc()
                    results[key]["seconds"] = round(time.perf_counter() - t0, 1)
                    print(f"{key}: {json.dumps(results[key], default=str)}", flush=True)

    Path(args.out).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"\nmixed vs alone, fp32, objectives={args.objectives}: max relative error [slot]")
    print("| variant | setup | 3 calls: loss | grad norm | weight | exp_avg | exp_avg_sq | 1 call eps~0: loss "
          "| grad norm | exp_avg | exp_avg_sq | grad | repeat: weight | s |")
    print("|---" * 14 + "|")
    for name, res in results.items():
        if "error" in res:
            print(f"| {name} | error: {res['error']} |" + " |" * 11 + f" {res['seconds']} |")
        elif "inside" in res:
            cells = [fmt(res["inside"][k]) for k in MULTI]
            print(f"| {name} | mixed vs alone (vs 1 GPU weight {fmt(res['vs_1gpu']['weight'])}) | "
                  + " | ".join(cells) + " |" * 7 + f" {res['seconds']} |")
        else:
            cells = [fmt(res["multi"][k]) for k in MULTI] + [fmt(res["first"][k]) for k in FIRST] + [fmt(res["repeat"]["weight"])]
            print(f"| {name} | {res['setup']} | " + " | ".join(cells) + f" | {res['seconds']} |")


if __name__ == "__main__":
    main()

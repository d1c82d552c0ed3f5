"""How far apart the two sides of each fp32 equivalence proof land, across the kernels x86 CPUs pick.

The default tier's equivalence proofs (tests/integration/test_trainer_equivalence.py, dense;
tests/integration/test_moe_trainer.py, MoE) compare two fp32 runs of the same math. Where the
two runs take different reduction orders (mixed vs alone: another micro-batch, so another row
position in every GEMM and another split of each slot's gradient sum), their distance is
rounding noise, and its size depends on the kernels the CPU runs. Those are picked at run time
from the CPU: numpy's OpenBLAS (the Triton interpreter's ``tl.dot``: ``np.matmul``) by its core
type, MKL (torch's GEMMs) by its code path, ATen's vectorized kernels (softmax, attention,
reductions) by the CPU capability. Each can be forced by an environment variable, so one machine
can run the kernels of others: every profile below is one child process with that environment.

Per profile and per proof it prints the worst relative error over every compared quantity
(slot, quantity), as the tests measure it (``equivalence_errors``); a proof whose two sides share
the reduction order must show 0 on every profile. The tests' bounds are derived from this table
(their docstrings give the rule and the numbers).

Usage (repo root, PYTHONPATH=.):
    python -m benchmarks.fp32_cpu_orders --out fp32_cpu_orders.json [--groups dense,moe,triton,parallel]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> environment (None: unset). OpenBLAS picks SkylakeX (AVX-512) on a Zen 4/5 EPYC when
# nothing is set; Zen 1-3 get its Haswell kernels (AVX2), as do machines that pin them. MKL runs
# its AVX2 path on AMD (its AVX-512 kernels are Intel-only: not reachable here); COMPATIBLE is its
# portable path. ATen: avx512 where the CPU has it, avx2 on Zen 1-3, default = no vector ISA.
PROFILES: dict[str, dict[str, str | None]] = {
    "detected": {"OPENBLAS_CORETYPE": None, "ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None},
    "openblas-haswell": {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None},
    "openblas-sandybridge": {"OPENBLAS_CORETYPE": "Sandybridge", "ATEN_CPU_CAPABILITY": None, "MKL_CBWR": None},
    "zen3-like": {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": None},
    "mkl-compatible": {"OPENBLAS_CORETYPE": None, "ATEN_CPU_CAPABILITY": None, "MKL_CBWR": "COMPATIBLE"},
    "aten-scalar": {"OPENBLAS_CORETYPE": None, "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": None},
}
GROUPS = ("dense", "moe", "triton", "parallel")


# -- the child: one profile, every proof of the chosen groups ----------------------------------


def _record(out: dict, case: str, errors: list[tuple[float, int, str]]) -> None:
    worst = errors[0] if errors else (0.0, -1, "-")
    out[case] = [worst[0], worst[1], worst[2]]
    print(f"  {case}: {worst[0]:.3e} (slot {worst[1]}, {worst[2]})", flush=True)


def _logits_case(out: dict, case: str, diff: float) -> None:
    out[case] = [diff, -1, "max |logits difference|"]
    print(f"  {case}: {diff:.3e}", flush=True)


def dense_group(out: dict) -> None:
    from examples.tiny.build import ensure_tiny_world
    from tests.integration import test_trainer_equivalence as scn
    from trainer.core import MultiLoraTrainer

    trainer = MultiLoraTrainer(scn.scenario_config(ensure_tiny_world()))
    batches = scn.make_batches(trainer)
    runs = {}
    for objectives in ("rl", "sft", "mixed"):
        runs[objectives] = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives]), batches)
        _record(out, f"dense mixed vs alone ({objectives})",
                scn.equivalence_errors(runs[objectives]["mixed"], runs[objectives]["alone"]))
    for objectives in ("rl", "sft"):
        first = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES[objectives], eps=scn.DEFAULT_ADAM), batches[:1])
        _record(out, f"dense first step ({objectives})",
                scn.equivalence_errors(first["mixed"], first["alone"], kinds=("exp_avg", "exp_avg_sq", "grad")))
    trainer.routing.kernel = "loop"
    loop = scn.run_scenario(trainer, scn.make_hypers(scn.OBJECTIVES["mixed"]), batches)
    trainer.routing.kernel = "auto"
    _record(out, "dense loop vs grouped_mm", scn.equivalence_errors(loop["mixed"], runs["mixed"]["mixed"]))
    # padded rows, as test_trainer_speed_paths.py's padded variant runs them (16-token log-prob chunks)
    padded = MultiLoraTrainer(scn.scenario_config(ensure_tiny_world(), packed=False, logprob_chunk_tokens=16))
    run = scn.run_scenario(padded, scn.make_hypers(scn.OBJECTIVES["mixed"]), batches)
    _record(out, "dense padded mixed vs alone", scn.equivalence_errors(run["mixed"], run["alone"]))


def moe_group(out: dict, triton: bool) -> None:
    import torch

    from examples.tiny_moe.build import ensure_tiny_moe_world
    from tests.integration import test_moe_trainer as moe
    from tests.integration import test_trainer_equivalence as scn
    from tests.trainer_probes import forward_logits
    from trainer.core import MultiLoraTrainer

    world = ensure_tiny_moe_world()
    trainer = MultiLoraTrainer(scn.scenario_config(world))
    batches = scn.make_batches(trainer)
    if triton:
        reference = scn.run_scenario(trainer, moe.moe_hypers("mixed"), batches[:2])
        trainer.routing.rank_kernels = "triton"
        run = scn.run_scenario(trainer, moe.moe_hypers("mixed"), batches[:2])
        trainer.routing.rank_kernels = "auto"
        _record(out, "moe triton vs grouped_mm (2 calls)", scn.equivalence_errors(run["mixed"], reference["mixed"]))
        _record(out, "moe triton mixed vs alone (2 calls)", scn.equivalence_errors(run["mixed"], run["alone"]))
        _record(out, "moe grouped_mm mixed vs alone (2 calls)", scn.equivalence_errors(reference["mixed"], reference["alone"]))
        return
    runs = {}
    for objectives in ("rl", "sft", "mixed"):
        runs[objectives] = scn.run_scenario(trainer, moe.moe_hypers(objectives), batches)
        _record(out, f"moe mixed vs alone ({objectives})",
                scn.equivalence_errors(runs[objectives]["mixed"], runs[objectives]["alone"]))
    trainer.routing.kernel = "loop"
    loop = scn.run_scenario(trainer, moe.moe_hypers("mixed"), batches)
    trainer.routing.kernel = "auto"
    _record(out, "moe loop vs grouped_mm", scn.equivalence_errors(loop["mixed"], runs["mixed"]["mixed"]))
    padded = scn.run_scenario(MultiLoraTrainer(scn.scenario_config(world, packed=False)), moe.moe_hypers("mixed"), batches)
    _record(out, "moe padded mixed vs alone", scn.equivalence_errors(padded["mixed"], padded["alone"]))
    _record(out, "moe padded vs packed", scn.equivalence_errors(padded["mixed"], runs["mixed"]["mixed"]))
    # the export proofs: trained slots against HF+peft, and a slot started from the export
    import tempfile

    from transformers import AutoModelForCausalLM

    moe.fresh_slots(trainer, moe.moe_hypers("mixed"))
    for batch in batches:
        trainer.train(batch)
    hf = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        for slot in (0, moe.ATTENTION_ONLY_SLOT):
            folder = trainer.export.export_peft(slot, Path(tmp) / f"slot{slot}")
            diff = (forward_logits(trainer, moe.export_ids(), slot) - moe.hf_peft_logits(hf, folder, moe.export_ids())).abs().max().item()
            _logits_case(out, f"moe export slot {slot} vs HF+peft", diff)
        trainer.clear_slot(3)  # a slot started from slot 0's export computes what slot 0 computes
        trainer.init_slot(3, moe.moe_hypers("mixed")[0], seed=0, init_from=Path(tmp) / "slot0")
        diff = (forward_logits(trainer, moe.export_ids(), 3) - forward_logits(trainer, moe.export_ids(), 0)).abs().max().item()
        _logits_case(out, "moe slot started from the export vs the exported slot", diff)


def parallel_group(out: dict) -> None:
    import tempfile

    import torch
    import torch.multiprocessing as mp

    from examples.tiny.build import ensure_tiny_world
    from examples.tiny_moe.build import ensure_tiny_moe_world
    from tests.integration import test_moe_trainer as moe
    from tests.integration import test_trainer_equivalence as scn
    from trainer.core import MultiLoraTrainer
    from trainer.platform.distributed import free_loopback_port

    def spawn(worker, cfg_kwargs, hypers, batches, path):  # noqa: ANN001, ANN202
        mp.spawn(worker, args=(free_loopback_port(), cfg_kwargs, hypers, batches, str(path)), nprocs=2, join=True)
        return torch.load(path, weights_only=False)

    with tempfile.TemporaryDirectory() as tmp:
        trainer = MultiLoraTrainer(scn.scenario_config(ensure_tiny_world()))
        batches = scn.make_batches(trainer)
        hypers = scn.make_hypers(scn.OBJECTIVES["mixed"])
        one = scn.run_scenario(trainer, hypers, batches)
        tp2 = spawn(scn.tp_worker, trainer.config.model_dump() | {"tp": 2}, hypers, batches, Path(tmp) / "tp2.pt")
        _record(out, "dense tp2 mixed vs alone", scn.equivalence_errors(tp2["mixed"], tp2["alone"]))
        _record(out, "dense tp2 vs tp1", scn.equivalence_errors(tp2["mixed"], one["mixed"]))
        del trainer
        trainer = MultiLoraTrainer(scn.scenario_config(ensure_tiny_moe_world()))
        batches = scn.make_batches(trainer)
        hypers = moe.moe_hypers("mixed")
        one = scn.run_scenario(trainer, hypers, batches)
        for layout in ("tp", "dp"):
            run = spawn(moe.two_rank_worker, trainer.config.model_dump() | {layout: 2}, hypers, batches,
                        Path(tmp) / f"{layout}.pt")
            _record(out, f"moe {layout}2 mixed vs alone", scn.equivalence_errors(run["mixed"], run["alone"]))
            _record(out, f"moe {layout}2 vs one rank", scn.equivalence_errors(run["mixed"], one["mixed"]))


def child(groups: list[str]) -> dict:
    import torch

    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)  # as tests/conftest.py
    out: dict = {}
    for group in groups:
        t0 = time.perf_counter()
        if group == "dense":
            dense_group(out)
        elif group in ("moe", "triton"):
            moe_group(out, triton=group == "triton")
        else:
            parallel_group(out)
        print(f"  [{group}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return out


# -- the parent: one child per profile, then the table ---------------------------------------


def openblas_core() -> str:
    """The OpenBLAS core type numpy runs here (what the profile's environment made of the CPU)."""
    import ctypes
    import glob

    import numpy

    libs = glob.glob(str(Path(numpy.__file__).parent.parent / "numpy.libs" / "*openblas*"))
    for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
        for lib in libs:
            fn = getattr(ctypes.CDLL(lib), name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return "?"


def run_profile(name: str, groups: list[str]) -> dict:
    env = dict(os.environ)
    for key, value in PROFILES[name].items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "benchmarks.fp32_cpu_orders", "--child", "--groups", ",".join(groups)]
    print(f"== {name}: {PROFILES[name]}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    print("\n".join(line for line in lines if line.startswith("  ")), flush=True)
    result = next((json.loads(line[7:]) for line in reversed(lines) if line.startswith("RESULT ")), None)
    if proc.returncode or result is None:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fp32_cpu_orders.json")
    ap.add_argument("--groups", default="dense,moe,triton", help=f"comma list of {GROUPS}")
    ap.add_argument("--profiles", default="", help="comma list of profile names (default: all)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    groups = [g for g in args.groups.split(",") if g]
    if any(g not in GROUPS for g in groups):
        raise SystemExit(f"--groups: each of {GROUPS}, got {groups}")
    if args.child:
        result = child(groups)
        result["_openblas_core"] = openblas_core()
        print("RESULT " + json.dumps(result), flush=True)
        return
    names = [n for n in PROFILES if not args.profiles or n in args.profiles.split(",")]
    results = {name: run_profile(name, groups) for name in names}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    cases = list(dict.fromkeys(c for r in results.values() for c in r if not c.startswith("_") and c != "error"))
    print("\nworst relative error [slot] per profile (OpenBLAS core in the header); last column: worst of all")
    print("| proof | " + " | ".join(f"{n} ({results[n].get('_openblas_core', 'error')})" for n in names) + " | worst |")
    print("|---" * (len(names) + 2) + "|")
    for case in cases:
        cells = [results[n].get(case) for n in names]
        worst = max((c[0] for c in cells if c), default=0.0)
        print(f"| {case} | " + " | ".join(f"{c[0]:.2e} [{c[1]}]" if c else "-" for c in cells) + f" | {worst:.2e} |")
    for n in names:
        if "error" in results[n]:
            print(f"{n}: error: {results[n]['error']}")


if __name__ == "__main__":
    main()

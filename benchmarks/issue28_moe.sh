#!/usr/bin/env bash
# Issue 28's MoE runs on the device machine, in one call (docs/benchmarks-history.md, "MoE step at the
# limit"). Usage (repo root, megatron wheels on PYTHONPATH): bash benchmarks/issue28_moe.sh OUT [PARTS]
# The GPU tier needs the tiny world: carry .cache/tiny (built here by examples/tiny/build.py; building
# it there needs the datasets package, which the device lacks).
# PARTS: comma list of
#   tests    the GPU tier (tests/gpu) and the Triton kernels' unit tests compiled on the device
#   moetests only the MoE / Triton unit tests and tests/gpu/test_moe_kernels_gpu.py (after a kernel change)
#   after    bench_moe_step, mixed and frozen base, N = 1, 8, 32, with profiles and the host-sync census
#   before   the same without profiles from BEFORE (a copy of an older tree with trainer/ and benchmarks/)
#   kernels  bench_expert_kernels: the expert-LoRA Triton kernels over tile and launch variants
#   overlap  the optimizer step on its own stream (trainer/optim/step_overlap.py): its GPU test, then MoE
#            (N = 1, 8, 32) and dense (N = 16, 64) rounds back to back, step overlapped and in order
#   compacttests  the compact optimizer state (bf16 moments, trainer/optim/compact_state.py): its GPU test
#            (dense and MoE, overlapped vs in order) and its unit tests compiled on the device (carry .cache/tiny_moe too)
#   compact  MoE N = 8, 32 (COMPACT_N) with every adapter's moments fp32, then bf16, each run with its own frozen
#            base: round by round (the step phase's ms and bytes/s: "# step" lines) and back to back, step
#            overlapped and in order; 2 repeats alternating; then both runs side by side against the target
#            (benchmarks/state_dtype_table.py: mixed / base <= 1.15 at N = 32). About 2 min a run on one H200.
# BENCH_EXTRA: arguments appended to the compact part's benchmark runs (the CPU smoke test:
#   BENCH_EXTRA="--tiny --iters 1 --warmup 0 --repeats 1" PATH=.venv/bin:$PATH bash benchmarks/issue28_moe.sh OUT compact)
set -uo pipefail
out=${1:?output folder}
parts=${2:-tests,after,before,kernels}
before=${BEFORE:-.before}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
has() { [[ ",$parts," == *",$1,"* ]]; }
quiet() { grep -v -i -E "warn|deprecat|^\s*$|megatron\.|transformers\]|import_utils|Traceback|^\s+(File|return|\^)|AttributeError: module|FlexAttention|Evict LRU" ; }
# the Triton kernels' unit tests compiled on the device (TRITON_UNITS to run fewer)
triton_units=${TRITON_UNITS:-"tests/unit/test_triton_adamw.py tests/unit/test_triton_rope.py tests/unit/test_triton_lora.py
  tests/unit/test_triton_expert_lora.py tests/unit/test_moe_lora.py"}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
if has overlap; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_step_overlap_gpu.py -rf 2>&1 \
    | tee "$out/overlap_tests.log" | grep -E "passed|failed|error|^FAILED" | tail -8
  b2b=mixed_b2b,mixed_b2b_in_order,base_b2b,mixed,base
  timeout 200 python3 -m benchmarks.bench_moe_step --only $b2b --iters 10 --warmup 2 --out "$out/moe_b2b.json" 2>&1 \
    | quiet | tee "$out/moe_b2b.log" | grep -E "^\|" | cut -c1-220
  timeout 150 python3 -m benchmarks.bench_mixed_step --n 16,64 --only $b2b --iters 10 --warmup 2 --out "$out/dense_b2b.json" 2>&1 \
    | quiet | tee "$out/dense_b2b.log" | grep -E "^\|" | cut -c1-220
fi
if has compacttests; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m "gpu or unit" tests/gpu/test_compact_state_gpu.py \
    tests/unit/test_compact_adamw.py tests/unit/test_step_overlap.py tests/unit/test_triton_adamw.py -rf 2>&1 \
    | tee "$out/compact_tests.log" | grep -E "passed|failed|error|^FAILED" | tail -8
fi
if has compact; then
  for sd in float32 bfloat16; do
    timeout 280 python3 -m benchmarks.bench_moe_step --n "${COMPACT_N:-8,32}" --only mixed,base,mixed_b2b,mixed_b2b_in_order,base_b2b \
      --iters 10 --warmup 2 --repeats 2 --state-dtype $sd --out "$out/moe_state_$sd.json" ${BENCH_EXTRA:-} 2>&1 \
      | quiet | tee "$out/moe_state_$sd.log" | grep -E "^\||^# step|^reproduce" | cut -c1-260
  done
  python3 -m benchmarks.state_dtype_table "$out/moe_state_float32.json" "$out/moe_state_bfloat16.json" 2>&1 | tee "$out/moe_state_table.md"
fi
if has tests; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --durations=5 -rf 2>&1 | tee "$out/gpu_tests.log" \
    | grep -E "passed|failed|error|^[0-9.]+s |^FAILED" | cut -c1-400 | tail -12
  timeout 120 python3 -m pytest -q -p no:cacheprovider $triton_units 2>&1 | tee "$out/triton_tests.log" | grep -E "passed|failed|error" | tail -3
fi
if has moetests; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m "gpu or unit" tests/gpu/test_moe_kernels_gpu.py $triton_units 2>&1 \
    | tee "$out/moe_tests.log" | grep -E "passed|failed|error" | tail -3
fi
if has after; then
  timeout 240 python3 -m benchmarks.bench_moe_step --only mixed,base --iters 10 --warmup 2 --out "$out/moe_after.json" --profile-out /tmp/prof 2>&1 \
    | quiet | tee "$out/moe_after.log" | grep -E "^\||^# syncs|^# profile|^# device span|^#   " | cut -c1-260
  tar czf "$out/prof_after.tgz" -C /tmp --exclude='trace_moe_n8*' --exclude='trace_moe_n32*' prof
fi
if has before; then
  (cd "$before" && timeout 150 python3 -m benchmarks.bench_moe_step --only mixed,base --iters 10 --warmup 2 --out "$out/moe_before.json" 2>&1) \
    | quiet | tee "$out/moe_before.log" | grep -E "^\|"
fi
if has kernels; then
  timeout 200 python3 -m benchmarks.bench_expert_kernels --out "$out/kernels.json" 2>&1 | tee "$out/kernels.log" \
    | grep -E "sum|reproduce" | sed -E 's/  fc1 .*//'
fi

#!/usr/bin/env bash
# The trainer's GPU tier and benchmarks in one go, on the device machine (docs/BENCHMARKS.md).
# Usage (repo root, megatron wheels installed on PYTHONPATH): bash benchmarks/gpu_suite.sh OUTDIR [PARTS]
# PARTS: comma list of tests,fp32dev,lora,mixed16k,mixed8k,frozen,packed,parallel (default: all),
# or tp2,dp2,tp2general,single,tinkerround,tinkerdp,cutlass,tp2cutlass (not in the default).
#   cutlass    issue 45 item 1: LoRA in the GEMM (trainer/kernels/cutlass_lora; needs nvidia-cutlass's headers,
#              pip install --no-deps nvidia-cutlass==4.2.0.0): the extension built (ptxas report), its GPU test,
#              the kernel against cuBLAS and today's path (bench_lora_epilogue), then the dense mixed step with
#              lora_gemm library and cutlass side by side in one process, 16 x 1024 and 64 x 256, back to back
#   tp2cutlass issue 46 item 2: bench_parallel_step --layout tp2 --n 1,16,64 --only mixed,base with lora_gemm
#              library, then cutlass (2 GPUs; the TP=2 case of tests/gpu/test_lora_gemm_gpu.py runs under cutlass)
#   tinkerround  issue 45 item 4: benchmarks/bench_tinker_round.py, the Tinker round (64 models' datums and
#              optim_steps, coalesced) against a dataset round of the same tokens, 64 x 256 and 16 x 1024: the
#              overhead in ms and its phases, syncs and profile (one GPU; TINKER_CASES to change)
#   tinkerdp   issue 46 item 1: tests/gpu/test_tinker_dp_gpu.py, a Tinker model's rounds in fp32 at DP=2 over
#              NCCL against one GPU and against HF+peft+AdamW (2 GPUs; skipped with one)
# parallel is benchmarks/bench_parallel_step.py (Qwen3-8B shape, TP=2 then DP=2, fused LoRA node; needs 2 GPUs, ~8 min).
# The issue-18 rows one part at a time (each its own command, to stay inside a 10-minute limit;
# N=1,16,64 unless N=... is set, e.g. N=64 bash benchmarks/gpu_suite.sh OUT tp2):
#   tp2        TP=2 on the fused node: mixed, frozen base, serialized (N=1,16, SERIALIZED_N to change)
#   dp2        DP=2 (fused node): the same
#   tp2general TP=2 on the general path (fused_lora off): mixed and frozen base, the comparison
#   single     one GPU: the largest slot count beside the 8B base at 16k tokens (about 1 min per slot count
#              tried; recompute none, or SINGLE_RECOMPUTE=full)
# tests includes tests/gpu/test_fp32_gpu.py (fp32 mixed == alone on CUDA; TP=2 and DP=2 over
# NCCL when 2 GPUs are present); fp32dev is benchmarks/fp32_deviation.py (which kernel makes
# fp32 deviate; with 2 GPUs also TP=2 / DP=2).
set -uo pipefail
out=${1:?output folder}
parts=${2:-tests,fp32dev,lora,mixed16k,mixed8k,frozen,packed,parallel}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
has() { [[ ",$parts," == *",$1,"* ]]; }
quiet() { grep -v -i -E "warn|deprecat|^\s*$|megatron\.|transformers\]" ; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw,memory.used --format=csv,noheader
if has tests; then
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out/gpu_tests.log" | grep -E "passed|failed|error" | tail -3
  # the Triton kernels' unit tests (marked unit) compiled on the device instead of interpreted
  python3 -m pytest -q -p no:cacheprovider tests/unit/test_triton_adamw.py tests/unit/test_triton_rope.py tests/unit/test_triton_lora.py \
    tests/unit/test_triton_expert_lora.py tests/unit/test_moe_lora.py 2>&1 \
    | tee "$out/triton_tests.log" | grep -E "passed|failed|error" | tail -3
fi
if has fp32dev; then
  par=""; if [ "$ngpu" -ge 2 ]; then par="--parallel"; fi
  python3 -m benchmarks.fp32_deviation --out "$out/fp32_deviation.json" $par > "$out/fp32_deviation.log" 2>&1
  sed -n '/^mixed vs alone, fp32/,$p' "$out/fp32_deviation.log"
fi
if has lora; then python3 -m benchmarks.bench_lora_layer --out "$out/lora_layer.json" 2>&1 | tail -14; fi
if has mixed16k; then
  python3 -m benchmarks.bench_mixed_step --micro-batch-tokens 16384 --only mixed,mixed_library,base --out "$out/mixed16k.json" 2>&1 | quiet | tail -9
fi
if has mixed8k; then
  python3 -m benchmarks.bench_mixed_step --serialized-n 32 --serialized-iters 1 --out "$out/mixed8k.json" 2>&1 | quiet | tail -9
fi
if has frozen; then
  python3 -m benchmarks.bench_frozen_base --warmup 2 --iters 5 --variants hf_sdpa,mcore_fused_chunked,trainer \
    --out "$out/frozen.json" 2>&1 | quiet | tail -6
fi
if has packed; then
  python3 -m benchmarks.bench_packed_step --iters 2 --out "$out/packed_step.json" 2>&1 | quiet | tail -12
fi
if has parallel; then
  if [ "$ngpu" -ge 2 ]; then
    if python3 -m benchmarks.bench_parallel_step --layout tp2,dp2 --out "$out/parallel_step.json" > "$out/parallel_step.log" 2>&1; then
      sed -n '/tokens per round; MFU/,$p' "$out/parallel_step.log"
    else
      echo "parallel: FAILED"; tail -20 "$out/parallel_step.log"
    fi
  else
    echo "parallel: skipped ($ngpu GPU; needs 2)"
  fi
fi
# one bench_parallel_step run: NAME then its arguments; the table and the reproducing line are printed
bench_parallel() {
  local name=$1; shift
  if python3 -m benchmarks.bench_parallel_step "$@" --out "$out/$name.json" > "$out/$name.log" 2>&1; then
    awk '/tokens per round; MFU|^one GPU, recompute/{p=1} p' "$out/$name.log"
  else
    echo "$name: FAILED"; tail -20 "$out/$name.log"
  fi
}
for part in tp2 dp2 tp2general; do
  if has $part; then
    if [ "$ngpu" -lt 2 ]; then echo "$part: skipped ($ngpu GPU; needs 2)"; continue; fi
    case $part in
      tp2) bench_parallel parallel_tp2_fused --layout tp2 --lora-path fused --n "${N:-1,16,64}" --serialized-n "${SERIALIZED_N:-1,16}" ;;
      dp2) bench_parallel parallel_dp2_fused --layout dp2 --lora-path fused --n "${N:-1,16,64}" --serialized-n "${SERIALIZED_N:-1,16}" ;;
      tp2general) bench_parallel parallel_tp2_general --layout tp2 --lora-path general --n "${N:-1,16,64}" --only mixed,base ;;
    esac
  fi
done
if has cutlass; then
  timeout 900 python3 -m trainer.kernels.cutlass_lora.build > "$out/cutlass_build.log" 2>&1 || { echo "cutlass: BUILD FAILED"; tail -30 "$out/cutlass_build.log"; }
  grep -E "compiled|registers|spill" "$out/cutlass_build.log" | tail -12
  timeout 600 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_lora_gemm_gpu.py -rf 2>&1 | tee "$out/lora_gemm_gpu.log" \
    | grep -E "passed|failed|error|^FAILED" | tail -5
  timeout 400 python3 -m benchmarks.bench_lora_epilogue --modes triton,cutlass_lora --groups 16,64 --out "$out/cutlass_epilogue.json" 2>&1 | quiet | tail -12
  timeout 500 python3 -m benchmarks.bench_mixed_step --n 16,64 --only mixed,mixed_cutlass,base,mixed_b2b,mixed_b2b_cutlass,base_b2b \
    --iters 10 --warmup 2 --repeats 2 --out "$out/mixed_cutlass.json" 2>&1 | quiet | grep -E "^\||^N=|^reproduce" | cut -c1-300
fi
if has tp2cutlass; then
  if [ "$ngpu" -ge 2 ]; then
    for g in library cutlass; do
      bench_parallel "parallel_tp2_$g" --layout tp2 --n 1,16,64 --only mixed,base --recompute none --lora-gemm $g
    done
  else
    echo "tp2cutlass: skipped ($ngpu GPU; needs 2)"
  fi
fi
if has tinkerround; then
  if timeout 400 python3 -m benchmarks.bench_tinker_round --cases "${TINKER_CASES:-64x256,16x1024}" --iters 10 --warmup 2 \
      --repeats 2 --profile-out "$out/tinker_prof" --out "$out/tinker_round.json" > "$out/tinker_round.log" 2>&1; then
    grep -E "^# (phases|syncs|profile|[0-9]+ x)|^\||^reproduce" "$out/tinker_round.log" | cut -c1-400
  else
    echo "tinkerround: FAILED"; tail -20 "$out/tinker_round.log"
  fi
fi
if has tinkerdp; then
  if [ "$ngpu" -ge 2 ]; then
    timeout 400 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_tinker_dp_gpu.py -rf --durations=3 2>&1 \
      | tee "$out/tinker_dp_gpu.log" | grep -E "passed|failed|error|^FAILED|dp=2|^[0-9.]+s " | cut -c1-400
  else
    echo "tinkerdp: skipped ($ngpu GPU; needs 2)"
  fi
fi
if has single; then
  if [ "$ngpu" -ge 1 ]; then
    bench_parallel "parallel_single_${SINGLE_RECOMPUTE:-none}" --layout single --single-recompute "${SINGLE_RECOMPUTE:-none}"
  else
    echo "single: skipped (no GPU)"
  fi
fi

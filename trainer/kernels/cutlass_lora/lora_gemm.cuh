// The LoRA-in-the-GEMM kernels: CUTLASS 3.x GemmUniversal (Hopper, TMA + WGMMA, warp-specialized,
// persistent) with the LoraMainloop (lora_mainloop.hpp) and the stock TMA epilogue, bf16 in and out,
// fp32 accumulation. One instantiation per (operand layout, kConfigs entry), each in a translation unit
// of its own (build.py writes them), so the eight build in parallel.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "lora_gemm_args.h"
#include "lora_mainloop.hpp"

namespace lorafleet {

template <class LayoutB, int Config>
struct LoraGemm {
  static constexpr ConfigInfo kInfo = kConfigs[Config];
  using Element = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlign = 8;  // 16 bytes of bf16: TMA
  using TileShape = Shape<Int<kInfo.tile_m>, Int<kInfo.tile_n>, Int<kInfo.tile_k>>;
  using ClusterShape = Shape<_1, Int<kInfo.cluster_n>, _1>;
  using KernelSchedule = cute::conditional_t<kInfo.pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                             cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kInfo.pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;

  // D = acc (alpha 1, no C operand: the LoRA delta is already in the accumulator)
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlign, Element, LayoutD, kAlign, EpilogueSchedule>::CollectiveOp;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlign, Element, LayoutB, kAlign, float,
      TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Mainloop = LoraMainloop<BaseMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, CollectiveEpilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(LoraGemmArgs const& a) {
    using StrideA = typename Kernel::StrideA;
    using StrideB = typename Kernel::StrideB;
    using StrideD = typename Kernel::StrideD;
    int lora_k = Mainloop::lora_k_blocks(a.rank, a.pairs_per_tile) * Mainloop::BlockK;
    auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(a.m, a.k, 1));
    auto stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(a.n, a.k, 1));
    auto stride_h = cutlass::make_cute_packed_stride(StrideA{}, make_shape(a.h_rows, a.rank, 1));
    auto stride_f = cutlass::make_cute_packed_stride(StrideB{}, make_shape(a.n, a.rank, a.slots));
    auto stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(a.m, a.n, 1));
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = a.device;
    hw_info.sm_count = a.sm_count;

    typename Mainloop::Arguments mainloop{
        {static_cast<Element const*>(a.a), stride_a, static_cast<Element const*>(a.w), stride_b},
        a.k,
        static_cast<Element const*>(a.hblk), stride_h, a.h_rows,
        static_cast<Element const*>(a.factor), stride_f, a.slots,
        a.rank, a.tiles, a.pairs_per_tile};
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {a.m, a.n, a.k + lora_k, 1},
                                  mainloop,
                                  {{}, nullptr, stride_d, static_cast<Element*>(a.out), stride_d},
                                  hw_info};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    return args;
  }

  static size_t workspace(LoraGemmArgs const& a) { return Gemm::get_workspace_size(arguments(a)); }

  static cudaError_t run(LoraGemmArgs const& a, cudaStream_t stream) {
    Gemm gemm;
    auto args = arguments(a);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return cudaErrorInvalidValue;
    }
    if (Gemm::get_workspace_size(args) > a.workspace_bytes) {
      return cudaErrorInvalidValue;
    }
    if (gemm.initialize(args, a.workspace, stream) != cutlass::Status::kSuccess) {
      return cudaErrorLaunchFailure;
    }
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorLaunchFailure;
    }
    return cudaGetLastError();
  }
};

// The two operand layouts (lora_gemm_args.h): forward "nk" (w [N, K] and LoRA B [G, N, R], K-major:
// CUTLASS's column-major B) and input gradient "kn" (w [K, N] and LoRA A [G, R, N], N-major: row-major B).
using layout_nk = cutlass::layout::ColumnMajor;
using layout_kn = cutlass::layout::RowMajor;

}  // namespace lorafleet

// One (layout, config) kernel's entry points (declared in lora_gemm_args.h); build.py writes one
// translation unit per pair, each `LORAFLEET_INSTANTIATE(nk, 0)` or the like.
#define LORAFLEET_INSTANTIATE(LAYOUT, CONFIG)                                                          \
  namespace lorafleet {                                                                              \
  size_t workspace_##LAYOUT##_c##CONFIG(LoraGemmArgs const& a) {                                     \
    return LoraGemm<layout_##LAYOUT, CONFIG>::workspace(a);                                          \
  }                                                                                                  \
  cudaError_t run_##LAYOUT##_c##CONFIG(LoraGemmArgs const& a, cudaStream_t stream) {                 \
    return LoraGemm<layout_##LAYOUT, CONFIG>::run(a, stream);                                        \
  }                                                                                                  \
  size_t smem_##LAYOUT##_c##CONFIG() {                                                               \
    return LoraGemm<layout_##LAYOUT, CONFIG>::Kernel::SharedStorageSize;                             \
  }                                                                                                  \
  }

// The host-side contract of the LoRA-in-the-GEMM kernels (lora_gemm.cuh): plain C++, shared by the
// torch bindings (bindings.cpp, compiled by the host compiler) and the CUDA instantiations.
//
//   out[m, n] = sum_k a[m, k] B(k, n)  +  sum over the LoRA blocks of row tile m/BM of
//               hblk[tile rows, r] F_g(r, n)                                  (fp32 accumulation, one rounding)
//
// layout "nk" (the forward):  B(k, n) = w[n, k]  (w [N, K], nn.Linear layout), F_g(r, n) = factor[g, n, r]
//                             (LoRA B stacked [G, N, R]);
// layout "kn" (input grad):   B(k, n) = w[k, n]  (w [K, N]: the same nn.Linear weight read as W),
//                             F_g(r, n) = factor[g, r, n]  (LoRA A stacked [G, R, N]).
// tiles[t, j] = (g, block): the j-th LoRA block of row tile t reads rows block*BM .. block*BM+BM-1 of
// hblk (rows of other segments already zeroed by the planner, plan.py) against slot g of the factor.
// Every row tile has the same number of blocks (pairs_per_tile); a tile with fewer points the rest
// at an all-zero hblk block.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace lorafleet {

struct LoraGemmArgs {
  int m = 0, n = 0, k = 0;       // base GEMM: a [m, k], out [m, n]
  int rank = 0;                  // R: columns of hblk, the factor's rank dim (R % 8 == 0: TMA strides)
  int slots = 0;                 // G: slots in the factor
  int h_rows = 0;                // rows of hblk (blocks of BM rows; rows past the end read as zeros)
  int pairs_per_tile = 0;        // LoRA blocks of rank R per row tile (>= 1)
  void const* a = nullptr;       // bf16 [m, k], row-major
  void const* w = nullptr;       // bf16 [n, k] ("nk") or [k, n] ("kn"), row-major
  void const* hblk = nullptr;    // bf16 [h_rows, rank]
  void const* factor = nullptr;  // bf16 [slots, n, rank] ("nk") or [slots, rank, n] ("kn")
  void* out = nullptr;           // bf16 [m, n]
  int32_t const* tiles = nullptr;  // int32 [ceil(m / BM), pairs_per_tile, 2]
  int device = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The kernel configurations: every one is instantiated for both layouts (lora_gemm.cuh checks its
// template against this table at compile time; Python's CONFIGS, cutlass_lora/kernels.py, is
// checked against it when the extension loads).
struct ConfigInfo {
  char const* name;
  int tile_m, tile_n, tile_k;
  int cluster_n;      // CTAs of a cluster along N (x and hblk multicast among them); along M always 1
  bool pingpong;      // ping-pong schedule (else cooperative: two consumer warp groups on one tile)
};
constexpr ConfigInfo kConfigs[] = {
    {"coop_128x256_c1", 128, 256, 64, 1, false},
    {"coop_128x256_c2", 128, 256, 64, 2, false},
    {"coop_256x128_c2", 256, 128, 64, 2, false},
    {"pingpong_128x128_c2", 128, 128, 64, 2, true},
};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
static_assert(kNumConfigs == 4, "LORAFLEET_FOR_EACH_CONFIG and build.py's CONFIG_COUNT list every kConfigs entry");

// Every (layout, config) kernel's entry points, LORAFLEET_INSTANTIATE in lora_gemm.cuh: the workspace it
// needs, the launch (cudaSuccess, cudaErrorInvalidValue when CUTLASS's can_implement refuses the
// problem, else the launch error), and its shared memory per CTA.
#define LORAFLEET_FOR_EACH_CONFIG(X) X(0) X(1) X(2) X(3)
#define LORAFLEET_DECLARE_KERNEL(LAYOUT, CONFIG)                                      \
  size_t workspace_##LAYOUT##_c##CONFIG(LoraGemmArgs const& args);                    \
  cudaError_t run_##LAYOUT##_c##CONFIG(LoraGemmArgs const& args, cudaStream_t stream); \
  size_t smem_##LAYOUT##_c##CONFIG();
#define LORAFLEET_DECLARE_NK(CONFIG) LORAFLEET_DECLARE_KERNEL(nk, CONFIG)
#define LORAFLEET_DECLARE_KN(CONFIG) LORAFLEET_DECLARE_KERNEL(kn, CONFIG)
LORAFLEET_FOR_EACH_CONFIG(LORAFLEET_DECLARE_NK)
LORAFLEET_FOR_EACH_CONFIG(LORAFLEET_DECLARE_KN)

}  // namespace lorafleet

// A CUTLASS 3.x Hopper mainloop that runs the LoRA expand as extra K blocks of the base GEMM.
//
// y = x W^T + h_g B_g^T is one GEMM over the concatenated K dimension [x | h] . [W | B_g]^T. The
// stock warp-specialized TMA mainloop (sm90_mma_tma_gmma_ss_warpspecialized.hpp) streams
// K / BK blocks of (A tile, B tile) through a shared-memory pipeline into WGMMA; this one
// streams K / BK base blocks and then `lora_blocks` more, each an (hblk tile, factor tile) pair
// loaded by two more TMA descriptors into the SAME pipeline stages. The consumer warps (the
// stock `mma`, unchanged) cannot tell the blocks apart, the accumulator stays in registers in
// fp32, and the stock epilogue stores it once. So the LoRA delta never exists as a [T, N]
// tensor, and no second pass reads it back (today's path: fused_lora.py's addmm_ with the delta
// as C).
//
// Per-segment adapters: row tile t's LoRA block j reads hblk rows tiles[t][j].block * BM ... (the
// tile's h rows with every row outside segment g zeroed, built by plan.py) against slot
// g = tiles[t][j].slot of the factor. A tile spanning several segments has one block per
// segment; all tiles run the same count (the kernel's K is uniform), padded with an all-zero
// hblk block. R < BK is zero-filled by TMA (the descriptors' K extent is R), so a rank-16
// block costs the MMA of a 64-wide one: 1/32 of a K = 2048 GEMM.
//
// Invariants this relies on:
//  * the problem shape handed to the kernel has K' = K + lora_blocks * BK (k_tile_count counts
//    every block); the base descriptors are built with the real K;
//  * the factor is never multicast: every CTA of a cluster has its own row tile's slot. The
//    cluster is therefore 1 along M (B operands are multicast along M); along N the A side
//    (x and hblk, which depend on the row tile only) is multicast as the stock mainloop does;
//  * the TMA transaction bytes of a LoRA stage equal a base stage's (full boxes; out-of-bounds
//    elements are filled with zeros and counted).
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cute/tensor.hpp"

namespace lorafleet {

using namespace cute;

// Base: a cutlass::gemm::collective::CollectiveMma<MainloopSm90TmaGmmaWarpSpecialized<...>, ...>
// (what the CollectiveBuilder makes for bf16 with a cooperative or ping-pong schedule).
template <class Base>
struct LoraMainloop : Base {
  using typename Base::TileShape;
  using typename Base::ElementA;
  using typename Base::ElementB;
  using typename Base::StrideA;
  using typename Base::StrideB;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyA;
  using typename Base::GmemTiledCopyB;
  using typename Base::InternalElementA;
  using typename Base::InternalElementB;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::DispatchPolicy;
  using ClusterShape = typename DispatchPolicy::ClusterShape;

  static_assert(size<0>(ClusterShape{}) == 1,
                "the LoRA factor tile depends on the row tile's slot: no multicast of B along M");
  static constexpr int BlockK = size<2>(TileShape{});

  struct Arguments {
    typename Base::Arguments base;     // x (A) and W (B) with the real K
    int k_base;                        // K of the base GEMM (a multiple of BK)
    ElementA const* ptr_h;             // hblk [h_rows, rank], row-major
    StrideA dH;
    int h_rows;
    ElementB const* ptr_factor;        // the stacked LoRA factor, layout as StrideB says
    StrideB dF;
    int slots;
    int rank;
    int32_t const* tiles;              // [m_tiles, pairs_per_tile, 2] = (slot, hblk block)
    int pairs_per_tile;
  };

  struct Params : Base::Params {
    using TMA_H = typename Base::Params::TMA_A;  // same types as x / W: same strides and smem
    using TMA_F = typename Base::Params::TMA_B;
    TMA_H tma_load_h;
    TMA_F tma_load_f;
    int k_tiles_base;
    int h_rows;
    int slots;
    int rank;
    int rank_blocks;                   // ceil(rank / BK): K blocks per (tile, segment) pair
    int32_t const* tiles;
    int pairs_per_tile;
  };

  static int lora_k_blocks(int rank, int pairs_per_tile) {
    return pairs_per_tile * ((rank + BlockK - 1) / BlockK);
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(make_shape(M, N, args.k_base, L), args.base, workspace);
    auto ptr_h = reinterpret_cast<InternalElementA const*>(args.ptr_h);
    auto ptr_f = reinterpret_cast<InternalElementB const*>(args.ptr_factor);
    Tensor tensor_h = make_tensor(ptr_h, make_layout(make_shape(args.h_rows, args.rank, 1), args.dH));
    Tensor tensor_f = make_tensor(ptr_f, make_layout(make_shape(static_cast<int>(N), args.rank, args.slots), args.dF));
    params.tma_load_h = make_tma_copy_A_sm90(GmemTiledCopyA{}, tensor_h, SmemLayoutA{}(_, _, cute::Int<0>{}),
                                             TileShape{}, ClusterShape{});
    params.tma_load_f = make_tma_copy_B_sm90(GmemTiledCopyB{}, tensor_f, SmemLayoutB{}(_, _, cute::Int<0>{}),
                                             TileShape{}, ClusterShape{});
    params.k_tiles_base = args.k_base / BlockK;
    params.h_rows = args.h_rows;
    params.slots = args.slots;
    params.rank = args.rank;
    params.rank_blocks = (args.rank + BlockK - 1) / BlockK;
    params.tiles = args.tiles;
    params.pairs_per_tile = args.pairs_per_tile;
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    auto [M, N, K, L] = append<4>(problem_shape, 1);
    constexpr int align_a = 128 / cutlass::sizeof_bits<ElementA>::value;
    constexpr int align_b = 128 / cutlass::sizeof_bits<ElementB>::value;
    bool ok = args.k_base > 0 && args.k_base % BlockK == 0 && args.pairs_per_tile >= 1 && args.rank > 0
              && K == args.k_base + lora_k_blocks(args.rank, args.pairs_per_tile) * BlockK
              && args.h_rows > 0 && args.slots >= 1 && args.tiles != nullptr;
    ok = ok && Base::can_implement(make_shape(M, N, args.k_base, L), args.base);
    ok = ok && cutlass::detail::check_alignment<align_a>(make_shape(args.h_rows, args.rank, 1), args.dH);
    ok = ok && cutlass::detail::check_alignment<align_b>(make_shape(static_cast<int>(N), args.rank, args.slots), args.dF);
    return ok;
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    cute::prefetch_tma_descriptor(params.tma_load_h.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_load_f.get_tma_descriptor());
  }

  // (gA_mkl, gB_nkl) as the kernel expects them (K' = K + LoRA blocks: the kernel reads only
  // their m / n / k tile counts), then the tiled hblk and factor.
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_MNKL, Params const& params) const {
    using X = Underscore;
    auto [M, N, K, L] = problem_shape_MNKL;
    Tensor mA_mkl = params.tma_load_a.get_tma_tensor(make_shape(M, K, L));
    Tensor mB_nkl = params.tma_load_b.get_tma_tensor(make_shape(N, K, L));
    Tensor gA_mkl = local_tile(mA_mkl, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,m,k,l)
    Tensor gB_nkl = local_tile(mB_nkl, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BN,BK,n,k,l)
    Tensor mH = params.tma_load_h.get_tma_tensor(make_shape(params.h_rows, params.rank, 1));
    Tensor mF = params.tma_load_f.get_tma_tensor(make_shape(static_cast<int>(N), params.rank, params.slots));
    Tensor gH = local_tile(mH, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{});  // (BM,BK,block,kb,1)
    Tensor gF = local_tile(mF, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{});  // (BN,BK,n,kb,slot)
    return cute::make_tuple(gA_mkl, gB_nkl, gH, gF);
  }

  // Producer: the stock K loop over the base blocks, then the row tile's LoRA blocks.
  template <class TensorA, class TensorB, class TensorH, class TensorF, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorH, TensorF> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    int lane_predicate = cute::elect_one_sync();
    if (!lane_predicate) {
      return;
    }
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BM,BK,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BN,BK,PIPE)

    constexpr uint32_t cluster_shape_x = get<0>(ClusterShape{});
    uint2 cluster_local_block_id = {block_rank_in_cluster % cluster_shape_x, block_rank_in_cluster / cluster_shape_x};
    auto block_tma_a = params.tma_load_a.get_slice(cluster_local_block_id.y);
    auto block_tma_b = params.tma_load_b.get_slice(cluster_local_block_id.x);
    auto block_tma_h = params.tma_load_h.get_slice(cluster_local_block_id.y);
    auto block_tma_f = params.tma_load_f.get_slice(cluster_local_block_id.x);

    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor gA = get<0>(load_inputs)(_, _, m_coord, _, l_coord);  // (BM,BK,k)
    Tensor gB = get<1>(load_inputs)(_, _, n_coord, _, l_coord);  // (BN,BK,k)
    Tensor gH = get<2>(load_inputs)(_, _, _, _, 0);              // (BM,BK,block,kb)
    Tensor gF = get<3>(load_inputs)(_, _, n_coord, _, _);        // (BN,BK,kb,slot)
    Tensor tAgA = block_tma_a.partition_S(gA);
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    Tensor tHgH = block_tma_h.partition_S(gH);                   // (TMA,TMA_M,TMA_K,block,kb)
    Tensor tHsA = block_tma_h.partition_D(sA);
    Tensor tFgF = block_tma_f.partition_S(gF);                   // (TMA,TMA_N,TMA_K,kb,slot)
    Tensor tFsB = block_tma_f.partition_D(sB);

    uint16_t mcast_mask_a = 0;
    uint16_t mcast_mask_b = 0;
    if constexpr (cute::is_same_v<GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShape>{};
      for (int n = 0; n < size<1>(block_layout); ++n) {
        mcast_mask_a |= (uint16_t(1) << block_layout(cluster_local_block_id.x, n, Int<0>{}));
      }
    }
    if constexpr (cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShape>{};
      for (int m = 0; m < size<0>(block_layout); ++m) {
        mcast_mask_b |= (uint16_t(1) << block_layout(m, cluster_local_block_id.y, Int<0>{}));
      }
    }

    int32_t const* tile_row = params.tiles + static_cast<int64_t>(m_coord) * params.pairs_per_tile * 2;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      int write_stage = smem_pipe_write.index();
      int k_tile = *k_tile_iter;
      if (k_tile < params.k_tiles_base) {
        copy(params.tma_load_a.with(*tma_barrier, mcast_mask_a), tAgA(_, _, _, k_tile), tAsA(_, _, _, write_stage));
        copy(params.tma_load_b.with(*tma_barrier, mcast_mask_b), tBgB(_, _, _, k_tile), tBsB(_, _, _, write_stage));
      } else {
        int lora_block = k_tile - params.k_tiles_base;  // the tile's j-th LoRA block
        int pair = lora_block / params.rank_blocks;
        int kb = lora_block - pair * params.rank_blocks;
        int slot = tile_row[2 * pair];
        int block = tile_row[2 * pair + 1];
        copy(params.tma_load_h.with(*tma_barrier, mcast_mask_a), tHgH(_, _, _, block, kb), tHsA(_, _, _, write_stage));
        copy(params.tma_load_f.with(*tma_barrier, mcast_mask_b), tFgF(_, _, _, kb, slot), tFsB(_, _, _, write_stage));
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace lorafleet

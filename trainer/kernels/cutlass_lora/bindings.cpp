// torch bindings of the LoRA-GEMM kernels (lora_gemm.cuh): operand checks with clear refusals, the
// stream and workspace, and the kernel table. Compiled by the host compiler (no CUTLASS here).
#include <torch/extension.h>

// c10's stream and guard only: ATen/cuda/CUDAContext.h would pull in the cuBLAS / cuSPARSE / cuSOLVER
// headers, which a bare CUDA toolkit (nvcc and the runtime) does not have.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "lora_gemm_args.h"

namespace lorafleet {
namespace {

struct KernelEntry {
  size_t (*workspace)(LoraGemmArgs const&);
  cudaError_t (*run)(LoraGemmArgs const&, cudaStream_t);
  size_t (*smem)();
};

#define LORAFLEET_ENTRY_NK(CONFIG) KernelEntry{workspace_nk_c##CONFIG, run_nk_c##CONFIG, smem_nk_c##CONFIG},
#define LORAFLEET_ENTRY_KN(CONFIG) KernelEntry{workspace_kn_c##CONFIG, run_kn_c##CONFIG, smem_kn_c##CONFIG},
const KernelEntry kNK[kNumConfigs] = {LORAFLEET_FOR_EACH_CONFIG(LORAFLEET_ENTRY_NK)};
const KernelEntry kKN[kNumConfigs] = {LORAFLEET_FOR_EACH_CONFIG(LORAFLEET_ENTRY_KN)};

void check_operand(torch::Tensor const& t, char const* name, int64_t dims, torch::Device device) {
  TORCH_CHECK(t.device() == device, "lora_gemm: ", name, " is on ", t.device(), ", a on ", device);
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "lora_gemm: ", name, " must be bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, "lora_gemm: ", name, " must have ", dims, " dims, got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "lora_gemm: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "lora_gemm: ", name,
              " must start on a 16-byte boundary (TMA)");
}

}  // namespace

// out = a B + sum over each row tile's LoRA blocks of hblk F_g (lora_gemm_args.h), bf16 in and out.
// layout "nk": w [N, K], factor [G, N, R] (forward); "kn": w [K, N], factor [G, R, N] (input gradient).
torch::Tensor lora_gemm(torch::Tensor a, torch::Tensor w, torch::Tensor hblk, torch::Tensor factor,
                        torch::Tensor tiles, std::string const& layout, int64_t config,
                        std::optional<torch::Tensor> out) {
  TORCH_CHECK(layout == "nk" || layout == "kn", "lora_gemm: layout must be 'nk' or 'kn', got '", layout, "'");
  TORCH_CHECK(config >= 0 && config < kNumConfigs, "lora_gemm: config must be in [0, ", kNumConfigs, "), got ",
              config);
  TORCH_CHECK(a.is_cuda(), "lora_gemm: operands must be CUDA tensors");
  auto device = a.device();
  check_operand(a, "a", 2, device);
  check_operand(w, "w", 2, device);
  check_operand(hblk, "hblk", 2, device);
  check_operand(factor, "factor", 3, device);
  bool nk = layout == "nk";
  int64_t m = a.size(0), k = a.size(1);
  int64_t n = nk ? w.size(0) : w.size(1);
  int64_t rank = hblk.size(1);
  TORCH_CHECK((nk ? w.size(1) : w.size(0)) == k, "lora_gemm: w ", w.sizes(), " does not match a's K = ", k);
  TORCH_CHECK(nk ? (factor.size(1) == n && factor.size(2) == rank) : (factor.size(1) == rank && factor.size(2) == n),
              "lora_gemm: factor ", factor.sizes(), " does not match N = ", n, ", R = ", rank, " (layout ", layout, ")");
  ConfigInfo const& info = kConfigs[config];
  TORCH_CHECK(m >= 1 && k % info.tile_k == 0 && n % 8 == 0 && rank % 8 == 0 && rank >= 8,
              "lora_gemm: needs M >= 1, K a multiple of ", info.tile_k, ", N and R multiples of 8; got M = ", m,
              ", K = ", k, ", N = ", n, ", R = ", rank);
  int64_t m_tiles = (m + info.tile_m - 1) / info.tile_m;
  TORCH_CHECK(tiles.device() == device && tiles.scalar_type() == torch::kInt32 && tiles.is_contiguous() &&
                  tiles.dim() == 3 && tiles.size(0) == m_tiles && tiles.size(1) >= 1 && tiles.size(2) == 2,
              "lora_gemm: tiles must be contiguous int32 [", m_tiles, ", pairs, 2] on ", device, ", got ",
              tiles.sizes(), " ", tiles.scalar_type());
  torch::Tensor result = out.has_value() ? *out : torch::empty({m, n}, a.options());
  check_operand(result, "out", 2, device);
  TORCH_CHECK(result.size(0) == m && result.size(1) == n, "lora_gemm: out must be [", m, ", ", n, "]");

  c10::cuda::CUDAGuard guard(device);
  LoraGemmArgs args;
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.k = static_cast<int>(k);
  args.rank = static_cast<int>(rank);
  args.slots = static_cast<int>(factor.size(0));
  args.h_rows = static_cast<int>(hblk.size(0));
  args.pairs_per_tile = static_cast<int>(tiles.size(1));
  args.a = a.data_ptr();
  args.w = w.data_ptr();
  args.hblk = hblk.data_ptr();
  args.factor = factor.data_ptr();
  args.out = result.data_ptr();
  args.tiles = tiles.data_ptr<int32_t>();
  args.device = device.index();
  int sm_count = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device.index()) == cudaSuccess,
              "lora_gemm: cannot read the device's SM count");
  args.sm_count = sm_count;
  KernelEntry const& entry = (nk ? kNK : kKN)[config];
  size_t workspace_bytes = entry.workspace(args);
  torch::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = torch::empty({static_cast<int64_t>(workspace_bytes)}, a.options().dtype(torch::kUInt8));
    args.workspace = workspace.data_ptr();
    args.workspace_bytes = workspace_bytes;
  }
  cudaError_t err = entry.run(args, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err != cudaErrorInvalidValue, "lora_gemm: CUTLASS refused the problem (M = ", m, ", N = ", n,
              ", K = ", k, ", R = ", rank, ", config ", info.name, ")");
  TORCH_CHECK(err == cudaSuccess, "lora_gemm: launch failed: ", cudaGetErrorString(err));
  return result;
}

// (name, tile_m, tile_n, tile_k, cluster_n, pingpong, shared memory bytes nk, kn) of every config.
std::vector<std::tuple<std::string, int, int, int, int, bool, int64_t, int64_t>> configs() {
  std::vector<std::tuple<std::string, int, int, int, int, bool, int64_t, int64_t>> rows;
  for (int i = 0; i < kNumConfigs; ++i) {
    ConfigInfo const& c = kConfigs[i];
    rows.emplace_back(c.name, c.tile_m, c.tile_n, c.tile_k, c.cluster_n, c.pingpong,
                      static_cast<int64_t>(kNK[i].smem()), static_cast<int64_t>(kKN[i].smem()));
  }
  return rows;
}

}  // namespace lorafleet

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_gemm", &lorafleet::lora_gemm, "base GEMM with the LoRA expand as extra K blocks (CUTLASS, sm_90a)",
        pybind11::arg("a"), pybind11::arg("w"), pybind11::arg("hblk"), pybind11::arg("factor"), pybind11::arg("tiles"),
        pybind11::arg("layout"), pybind11::arg("config"), pybind11::arg("out") = pybind11::none());
  m.def("configs", &lorafleet::configs, "the kernel configurations and their shared memory per CTA");
}

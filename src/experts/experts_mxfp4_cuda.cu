// experts/experts_mxfp4_cuda.cu: tensor-core grouped GEMMs for MXFP4 experts on sm_90a, with the
// fp8_block experts of the same object in the same launch (FHMoE: FP8 shared + MXFP4 routed).
// The device code is in experts_mxfp4_kernels.cuh; this file instantiates the 256-thread kernels
// and holds the host API; experts_mxfp4_debug_cuda.cu the kernels of set_mixed_debug.
//
// Structure as experts_fp8_cuda.cu (read it first): weights in wgmma's M slot, tokens in N (BN = 16
// or 64 per tile, chosen on the device), one CTA of 2 warpgroups computes 256 weight rows x BN
// tokens per (row tile, weight tile) item, persistent grid over the device-side tile list (counts
// read on the device, graph-safe). Every item picks its path from its expert's format (CTA-uniform):
//   fp8_block  as experts_fp8_cuda.cu: e4m3 weights cp.async'd straight into the 128B-swizzled
//              operand tile, 128x128 block scales promoted per 128-deep K block, FP8 1x128 h.
//   mxfp4      the packed e2m1 codes (half the bytes of FP8) and their e8m0 scales stream into a
//              raw ring (cp.async, 5-7 stages); each thread expands its own weight row of a stage
//              into one of two swizzled operand tiles while the tensor cores run the previous
//              stage, then wgmma reads it:
//     gate_up  e4m3 wgmma against the FP8 x. Per (weight row, 128-deep K block) the block exponent
//              E = max of the row's 4 group exponents e_g; each element is written as the e4m3
//              value e2m1 * 2^(e_g - E + 6) (<= 6 * 64 = 384 < 448) and 2^(E - 127 - 6) * x_scale
//              is applied at the block's promotion (a per-row scale instead of the 128x128 block
//              scale). Exact while e_g - E >= -14 (e4m3 subnormals reach 2^-9); groups more than
//              11 binades below their row's largest use an RNE float path (exact down to -14,
//              then rounded to e4m3 / flushed to zero: a group 2^14 below its neighbours). h =
//              silu(g) * u is rounded to bf16 (the mxfp4 rule of epx/experts.h).
//     down     bf16 wgmma: h bf16 against the weights expanded to bf16 with the e8m0 scale folded
//              in (e2m1 * 2^(e - 127) is exact in bf16 for 2 <= e <= 252; other scales take an RNE
//              float path), fp32 accumulation across the whole K, no promotion.
//   Both expansions are byte permutes (prmt) through per-group 8-entry tables, ~1.5-2.5 integer
//   operations per weight.
#include "experts/experts_mxfp4_cuda.h"

#include <mutex>
#include <vector>

#include "cuda/check.h"
#include "epx/error.h"
#include "experts/experts_mxfp4_kernels.cuh"

namespace epx::experts_cuda {

bool mxfp4_tensor_cores_available(int device) {
  if (!fp8_tensor_cores_available(device)) return false;
  static std::mutex mu;
  static std::vector<int> done;  // per device: 1 = attribute set
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(done.size())) done.resize(device + 1, 0);
  if (done[device] == 0) {
    cuda::DeviceGuard guard(device);
    cudaDeviceProp prop{};
    EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    if (prop.sharedMemPerBlockOptin < static_cast<size_t>(kSmemBytes)) {
      done[device] = -1;
    } else {
      allow_smem<true, 0, kThreads>();
      allow_smem<false, 0, kThreads>();
      for (auto* k : {mixed_gemm_epi_kernel<true>, mixed_gemm_epi_kernel<false>})
        EPX_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      mx_debug_allow_smem();
      done[device] = 1;
    }
  }
  return done[device] == 1;
}

namespace {
// set_mixed_debug's state: process-wide, for the bench only (the default is 0: the normal kernels).
unsigned long long* g_debug_buffer = nullptr;
int g_debug_mode = 0;

template <bool kGateUp>
void launch_mixed(const MixedGemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  const int mode = g_debug_buffer != nullptr ? g_debug_mode : 0;
  if (epi != nullptr) mixed_gemm_epi_kernel<kGateUp><<<grid, kThreads, kSmemBytes, stream>>>(p, epi);
  else if (mode > 0) mx_debug_launch(kGateUp, mode, p, grid, stream, g_debug_buffer);
  else launch_kernel<kGateUp, 0, kThreads>(p, grid, stream, nullptr);
  cuda::check_launch(kGateUp ? "mixed_gemm_kernel (gate_up)" : "mixed_gemm_kernel (down)");
}
}  // namespace

void set_mixed_debug(unsigned long long* buffer, int mode) {
  require_arg("set_mixed_debug", "mode", mode, mode >= 0 && mode <= 3,
              "must be 0 (off), 1 (stamps), 2 (stamps, no expansion) or 3 (stamps, weight loads with the .L2::256B hint)");
  g_debug_buffer = mode > 0 ? buffer : nullptr;
  g_debug_mode = mode;
}

void launch_mixed_gate_up(const MixedGemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  launch_mixed<true>(p, grid, stream, epi);
}
void launch_mixed_down(const MixedGemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  launch_mixed<false>(p, grid, stream, epi);
}

}  // namespace epx::experts_cuda

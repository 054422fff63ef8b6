// experts/experts_mxfp4_wide_cuda.cu: the 512-thread variant of the MXFP4 / mixed grouped GEMMs
// (MixedGemmParams::wide, Config::experts_mxfp4_tc = 2): 4 warpgroups, each the wgmma consumer of
// one 64-row sub-tile, every thread loading and expanding half a weight row. Device code:
// experts_mxfp4_kernels.cuh; a file of its own so its kernels compile beside the others.
#include "experts/experts_mxfp4_kernels.cuh"

namespace epx::experts_cuda {

void mx_wide_launch(bool gate_up, bool stamped, const MixedGemmParams& p, int grid, cudaStream_t stream, unsigned long long* dbg) {
  if (gate_up) {
    if (stamped) launch_kernel<true, 1, kThreadsWide>(p, grid, stream, dbg);
    else launch_kernel<true, 0, kThreadsWide>(p, grid, stream, nullptr);
  } else {
    if (stamped) launch_kernel<false, 1, kThreadsWide>(p, grid, stream, dbg);
    else launch_kernel<false, 0, kThreadsWide>(p, grid, stream, nullptr);
  }
}

void mx_wide_allow_smem() {
  allow_smem<true, 0, kThreadsWide>();
  allow_smem<false, 0, kThreadsWide>();
  allow_smem<true, 1, kThreadsWide>();
  allow_smem<false, 1, kThreadsWide>();
}

}  // namespace epx::experts_cuda

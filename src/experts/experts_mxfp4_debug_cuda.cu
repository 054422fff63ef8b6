// experts/experts_mxfp4_debug_cuda.cu: the debug kernels of set_mixed_debug (experts_mxfp4_cuda.h;
// the bench's --stamps): the 256-thread kernels with per-phase clock64 stamps (mode 1), without the
// expansion (mode 2, timing only) and with the .L2::256B load hint (mode 3). Device code:
// experts_mxfp4_kernels.cuh; a file of its own so these never slow the library's own kernels' build.
#include "experts/experts_mxfp4_kernels.cuh"

namespace epx::experts_cuda {

void mx_debug_launch(bool gate_up, int mode, const MixedGemmParams& p, int grid, cudaStream_t stream, unsigned long long* dbg) {
  if (gate_up) {
    if (mode == 1) launch_kernel<true, 1, kThreads>(p, grid, stream, dbg);
    else if (mode == 2) launch_kernel<true, 2, kThreads>(p, grid, stream, dbg);
    else launch_kernel<true, 3, kThreads>(p, grid, stream, dbg);
  } else {
    if (mode == 1) launch_kernel<false, 1, kThreads>(p, grid, stream, dbg);
    else if (mode == 2) launch_kernel<false, 2, kThreads>(p, grid, stream, dbg);
    else launch_kernel<false, 3, kThreads>(p, grid, stream, dbg);
  }
}

void mx_debug_allow_smem() {
  allow_smem<true, 1, kThreads>();
  allow_smem<false, 1, kThreads>();
  allow_smem<true, 2, kThreads>();
  allow_smem<false, 2, kThreads>();
  allow_smem<true, 3, kThreads>();
  allow_smem<false, 3, kThreads>();
}

}  // namespace epx::experts_cuda

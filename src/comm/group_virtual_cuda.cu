// comm/group_virtual_cuda.cu: the device barrier of virtual ranks (group_virtual.h).
#include "comm/group_virtual.h"
#include "cuda/check.h"
#include "cuda/primitives.cuh"

namespace epx::comm {
namespace {

__global__ void virtual_barrier_kernel(VirtualBarrierArgs a) {
  using namespace epx::cuda::dev;
  if (ld_relaxed_sys(a.aborted)) return;
  const uint64_t e = a.epoch[a.rank] + 1;
  a.epoch[a.rank] = e;
  const int R = a.num_ranks;
  for (int q = 0; q < R; ++q) st_release_sys(&a.flags[static_cast<int64_t>(q) * R + a.rank], e);
  const uint64_t t0 = globaltimer();
  for (int q = 0; q < R; ++q) {
    const uint64_t* f = &a.flags[static_cast<int64_t>(a.rank) * R + q];
    while (ld_acquire_sys(f) < e) {
      if (ld_relaxed_sys(a.aborted)) return;
      if (static_cast<long long>(globaltimer() - t0) > a.timeout_ns) {
        if (atomicCAS(&a.record->claimed, 0, 1) == 0) {
          a.record->rank = a.rank;
          a.record->peer = q;
          __threadfence_system();
          atomicExch(&a.record->done, 1);
        }
        atomicExch(a.aborted, 1);
        return;
      }
      __nanosleep(200);
    }
  }
}

}  // namespace

void launch_virtual_barrier(const VirtualBarrierArgs& args, cudaStream_t stream) {
  virtual_barrier_kernel<<<1, 1, 0, stream>>>(args);
  cuda::check_launch("virtual_barrier_kernel");
}

}  // namespace epx::comm

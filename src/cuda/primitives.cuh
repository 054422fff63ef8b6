// cuda/primitives.cuh: device primitives shared by the kernel families: acquire / release loads and
// stores, the global timer behind bounded waits. Inline PTX lives here (and in a family's own
// device header), not in each kernel file.
#pragma once

#include <cstdint>

namespace epx::cuda::dev {

/// %globaltimer in ns (bounded waits).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

/// ld.acquire.sys: later loads of this thread see what the releasing store published.
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/// st.release.sys: earlier stores of this thread (and what happens-before them, such as earlier
/// kernels on its stream) are visible to a thread that acquires `v`.
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

}  // namespace epx::cuda::dev

// cuda/primitives.cuh: device primitives shared by the kernel families: acquire / release / relaxed
// loads and stores at system and GPU scope, coherent and volatile vector loads and stores, fences,
// the global timer behind bounded waits, named barriers, programmatic dependent launch and the L2
// prefetch. Inline PTX lives here (and in a family's own device header), not in each kernel file.
//
// "Coherent" loads (ld16, ld32) are plain weak loads of data a peer wrote, issued after an acquire:
// never ld.global.nc, whose cache may hold a stale line. Volatile vector loads and stores (ldv16,
// stv16) are single-copy atomic per 32-bit word, for protocols that poll the data itself.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace epx::cuda::dev {

// ---- time ------------------------------------------------------------------------------------------

/// %globaltimer in ns (bounded waits, traces).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/// The same with a memory clobber: the read keeps its place among memory accesses (debug stamps).
__device__ __forceinline__ uint64_t globaltimer_ordered() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)::"memory");
  return t;
}
/// The SM this thread runs on (%smid).
__device__ __forceinline__ uint32_t smid() {
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  return sm;
}

// ---- system scope (peers over NVLink / another process's memory) ----------------------------------

/// ld.acquire.sys: later loads of this thread see what the releasing store published.
__device__ __forceinline__ uint64_t ld_acquire_sys(const void* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

/// st.release.sys: earlier stores of this thread (and what happens-before them, such as earlier
/// kernels on its stream) are visible to a thread that acquires `v`.
__device__ __forceinline__ void st_release_sys(void* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int ld_relaxed_sys(const int* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys_u64(const void* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_relaxed_sys_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(void* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys_u32(void* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// ---- GPU scope -------------------------------------------------------------------------------------

__device__ __forceinline__ void st_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// ---- coherent and volatile loads and stores -----------------------------------------------------

/// Coherent 4-byte load (see the file comment).
__device__ __forceinline__ int32_t ld32(const void* p) {
  int32_t v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
/// Coherent 16-byte load of data a peer wrote (after an acquire): a plain weak load, never .nc.
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
/// Plain 16-byte store (p 16-byte aligned).
__device__ __forceinline__ void st16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }
__device__ __forceinline__ uint4 ldv16(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void stv16(void* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const void* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ---- warps, barriers, ordering ----------------------------------------------------------------------

/// Bits of the lanes below this one.
__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
/// bar.sync kId over `nthreads` threads (a multiple of 32): a barrier for part of the block.
template <int kId>
__device__ __forceinline__ void named_barrier_sync(int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "r"(nthreads) : "memory");
}
/// Barrier `id` (1..15) among `n` threads (a multiple of 32).
__device__ __forceinline__ void named_bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
/// Keeps the compiler from moving memory accesses across this point (no instruction).
__device__ __forceinline__ void compiler_barrier() { asm volatile("" ::: "memory"); }

// ---- sm_90: programmatic dependent launch, L2 prefetch --------------------------------------------

/// Programmatic dependent launch (sm_90): let the dependent grid be scheduled / wait until the grids
/// this one depends on have completed and their memory is visible. No-ops without such a launch.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/// Asks the TMA unit to bring `bytes` (a multiple of 16, 16-byte aligned) at `src` into L2; no-op before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}

}  // namespace epx::cuda::dev

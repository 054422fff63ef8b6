// dispatch/ht/ht_device.cuh: device code of the ht backend on CUDA shared by its kernels (contract
// and buffer layout: ht_cuda.h; launchers: ht_cuda.cu; kernels: ht_layout_kernels.cuh,
// ht_dispatch_kernels.cuh, ht_combine_kernels.cuh).
//
// Memory order (NCCL-DEVICE-API.md §3): data stores into a peer are weak; each CTA's threads meet
// at __syncthreads, one thread fences at system scope and then publishes with st.release.sys; the
// consumer polls with ld.acquire.sys and meets its CTA at __syncthreads before reading. Peer-written
// data is never read through the non-coherent path. Every poll is bounded by %globaltimer.
//
// Bit-exactness: bf16 rows are copied; fp8 follows quant_cuda.cu (amax with fmaxf, scale =
// max(amax, 1e-4) / 448 with IEEE division, UE8M0 rounding from the bits, cvt.rn.satfinite.e4m3x2)
// except that x / scale is computed as Markstein's correction of x * RN(1/scale):
//   q0 = RN(x * r), rem = fma(-q0, scale, x) (exact), q = RN(q0 + rem * r)
// which equals RN(x / scale) whenever r = RN(1/scale) and nothing under/overflows (|x / scale| <=
// 448 here), at 3 operations instead of an IEEE division per element: the division was the
// bottleneck of an fp8 dispatch on a 24-SM budget. The tests compare every code with the CPU.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/primitives.cuh"
#include "dispatch/block_primitives.cuh"
#include "dispatch/ht/ht_cuda.h"
#include "epx/dtype.h"

namespace epx::dispatch::ht {

constexpr int kLayoutThreads = 1024;
/// Dispatch/combine CTAs: at most 16 warps (ht_warps_per_block <= 16), so up to 128 registers per thread
/// stay available for the bytes a warp keeps in flight (a 1024-thread CTA would cap them at 64 and spill).
constexpr int kMaxThreads = 512;
constexpr float kAmaxFloor = 1e-4f;  // quant_cpu.cpp

enum Op : int32_t { kOpLayout = 0, kOpDispatch = 1, kOpCombine = 2 };
/// Flag words [3][R] (uint64 epochs) in each rank's buffer, word (f, s) written by source s:
/// counts published (layout), dispatch rows stored, and combine done: s has finished reading its own
/// `back` block for that combine epoch, so its peers may overwrite it (the next combine's sends).
enum Flag : int { kFlagCounts = 0, kFlagDispatch = 1, kFlagCombineDone = 2 };

using cuda::dev::globaltimer;
using cuda::dev::ld_acquire_gpu;
using cuda::dev::ld_acquire_sys;
using cuda::dev::pdl_launch_dependents;
using cuda::dev::pdl_wait;
using cuda::dev::prefetch_l2;
using cuda::dev::st_release_gpu;
using cuda::dev::st_release_sys;

__device__ __forceinline__ HtState& state_of(const HtParams& p) { return *reinterpret_cast<HtState*>(p.state); }
template <class T>
__device__ __forceinline__ T* arr(const HtParams& p, int64_t off) {
  return reinterpret_cast<T*>(p.state + off);
}
__device__ __forceinline__ uint64_t* flag_ptr(const HtParams& p, int rank, int f, int s) {
  return reinterpret_cast<uint64_t*>(p.peers[rank] + p.l.off_flags) + p.l.flag_index(f, s);
}

/// Records the first device-side failure (sticky) in the host-mapped record.
__device__ __forceinline__ void report_timeout(const HtParams& p, int peer, int op) {
  if (atomicCAS_system(&p.record->error_code, 0, 1) == 0) {
    p.record->error_peer = peer;
    p.record->error_op = op;
  }
  __threadfence_system();
}

/// Polls flag f of source s in this rank's buffer until >= target; false after the deadline.
__device__ __forceinline__ bool wait_flag(const HtParams& p, int f, int s, uint64_t target, uint64_t deadline) {
  const uint64_t* flag = flag_ptr(p, p.l.rank, f, s);
  while (ld_acquire_sys(flag) < target) {
    if (globaltimer() > deadline) return false;
  }
  return true;
}

using device::load_id;

/// Index of this warp with consecutive indices in different CTAs (warp w of CTA b -> w * gridDim + b):
/// work dealt round-robin by this index spreads over every SM of the budget, not over the first CTAs.
__device__ __forceinline__ int64_t spread_warp_index() {
  return static_cast<int64_t>(threadIdx.x >> 5) * gridDim.x + blockIdx.x;
}


/// device::block_exclusive_scan (block_primitives.cuh) followed by a __syncthreads, so that s_warp is
/// free again when it returns; every thread calls it.
__device__ __forceinline__ int block_exclusive_scan(int value, int* s_warp, int& total) {
  const int result = device::block_exclusive_scan(value, s_warp, total);
  __syncthreads();
  return result;
}

/// The low / high bf16 of a 32-bit word as fp32.
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

}  // namespace epx::dispatch::ht

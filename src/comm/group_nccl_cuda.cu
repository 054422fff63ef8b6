// comm/group_nccl_cuda.cu: the small kernels of the NCCL group (launchers declared in group_nccl.h).
//
// LSA-only code: GDAKI (GPU-initiated networking through mlx5 NICs) is compiled out, which NCCL
// allows for kernels that never call ncclGin (NCCL-DEVICE-API.md §4) and which halves compile time.
#define NCCL_GIN_GDAKI_ENABLE 0
#include <nccl_device.h>

#include "comm/group_nccl.h"
#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/error.h"

namespace epx::comm {
namespace {

__global__ void lsa_peer_pointers_kernel(ncclWindow_t window, int lsa_size, void** out) {
  const int p = static_cast<int>(threadIdx.x);
  if (p < lsa_size) out[p] = ncclGetLsaPointer(window, 0, p);
}

// One CTA. The fence makes stores of earlier kernels on this stream (e.g. LSA stores into a peer)
// part of what the barrier's release publishes; the acquire side covers later kernels on the peers'
// streams (NCCL-DEVICE-API.md §3, rules 2, 4 and 8).
__global__ void lsa_barrier_kernel(ncclDevComm dev_comm, int index) {
  __threadfence_system();
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), dev_comm, ncclTeamLsa(dev_comm), dev_comm.lsaBarrier,
                                         static_cast<uint32_t>(index)};
  bar.sync(ncclCoopCta(), ::cuda::memory_order_acq_rel);
}

template <class T>
__device__ __forceinline__ float load_as_float(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load_as_float<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float load_as_float<uint16_t>(const uint16_t* p, int64_t i) {
  return bf16_bits_to_float(p[i]);
}
__device__ __forceinline__ void store_from_float(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_from_float(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16_bits(v); }

// Rank-order fp32 accumulation starting from 0.0f, one rounding: the CPU group's arithmetic.
template <class T>
__global__ void sum_ranks_kernel(const T* in, int num_ranks, int64_t n, T* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int r = 0; r < num_ranks; ++r) acc += load_as_float(in, r * n + i);
    store_from_float(out, i, acc);
  }
}

__global__ void fill_pattern_kernel(uint32_t* dst, int64_t num_words, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = pattern_word(seed, static_cast<uint64_t>(i));
}

__global__ void count_pattern_mismatches_kernel(const uint32_t* src, int64_t num_words, uint32_t seed, int* mismatches) {
  int bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    bad += src[i] != pattern_word(seed, static_cast<uint64_t>(i));
  if (bad) atomicAdd(mismatches, bad);
}

constexpr int kThreads = 256;

}  // namespace

void launch_lsa_peer_pointers(ncclWindow_t window, int lsa_size, void** out, cudaStream_t stream) {
  EPX_ASSERT(lsa_size >= 1 && lsa_size <= 1024, "lsa_size=", lsa_size);
  lsa_peer_pointers_kernel<<<1, 1024, 0, stream>>>(window, lsa_size, out);
  cuda::check_launch("lsa_peer_pointers_kernel");
}

void launch_lsa_barrier(const ncclDevComm& dev_comm, int index, cudaStream_t stream) {
  EPX_ASSERT(index >= 0 && index < kNumLsaBarriers, "index=", index);
  lsa_barrier_kernel<<<1, 128, 0, stream>>>(dev_comm, index);
  cuda::check_launch("lsa_barrier_kernel");
}

void launch_sum_ranks(const void* in, int num_ranks, int64_t n, DType dtype, void* out, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned blocks = cuda::grid_for(n, kThreads, 4096);
  if (dtype == DType::fp32) {
    sum_ranks_kernel<float><<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(in), num_ranks, n, static_cast<float*>(out));
  } else {
    EPX_ASSERT(dtype == DType::bf16, "dtype=", dtype_name(dtype));
    sum_ranks_kernel<uint16_t><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(in), num_ranks, n,
                                                                static_cast<uint16_t*>(out));
  }
  cuda::check_launch("sum_ranks_kernel");
}

void launch_fill_pattern(uint32_t* dst, int64_t num_words, uint32_t seed, cudaStream_t stream) {
  if (num_words <= 0) return;
  fill_pattern_kernel<<<cuda::grid_for(num_words, kThreads, 1024), kThreads, 0, stream>>>(dst, num_words, seed);
  cuda::check_launch("fill_pattern_kernel");
}

void launch_count_pattern_mismatches(const uint32_t* src, int64_t num_words, uint32_t seed, int* mismatches,
                                     cudaStream_t stream) {
  if (num_words <= 0) return;
  count_pattern_mismatches_kernel<<<cuda::grid_for(num_words, kThreads, 1024), kThreads, 0, stream>>>(src, num_words, seed,
                                                                                                     mismatches);
  cuda::check_launch("count_pattern_mismatches_kernel");
}

}  // namespace epx::comm

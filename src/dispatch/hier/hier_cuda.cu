// dispatch/hier/hier_cuda.cu: kernels of the hierarchical ll / ht (hier.h, hier_cuda.h). The host twins
// are in hier.cpp (pack_host, unpack_host, sum_host): same steps, same order, same results.
//   pack:   one CTA, one warp per destination node: the warp walks the tokens 32 at a time, a ballot
//           over "has an expert on my node" gives each token its row in the node's block (source
//           token order), and the warp writes the row's source token, ids and weights and the count.
//   rows:   CTAs take tokens; each copies the token's bf16 row into every block that holds it.
//   unpack: CTAs take the N * M rows of the node backend's input: a live row copies x and renumbers
//           the ids to the node's experts; rows beyond a block's count get ids -1.
//   sum:    CTAs take tokens; fp32 sum of the nodes' returned rows in node order, then the addend
//           (FinalizeArgs::addend) when given, one rounding.
#include <cuda_runtime.h>

#include <cstring>

#include "cuda/check.h"
#include "dispatch/hier/hier_cuda.h"

namespace epx::dispatch {
namespace {

__device__ __forceinline__ int64_t load_id(const HierPackParams& p, int64_t i) {
  return p.idx64 ? static_cast<const int64_t*>(p.idx)[i] : static_cast<const int32_t*>(p.idx)[i];
}

__device__ __forceinline__ void copy_row(uint16_t* dst, const uint16_t* src, int64_t H) {
  // dst is 16-byte aligned (block / tensor rows of 2H bytes, H % 8 == 0); src maybe not.
  if ((reinterpret_cast<uintptr_t>(src) & 15) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x) d[i] = s[i];
  } else {
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void hier_pack_kernel(HierPackParams p) {
  const HierLayout& L = p.lay;
  const int M = L.max_tokens, K = L.top_k;
  int T = static_cast<int>(p.num_tokens_host);
  if (p.num_tokens_dev != nullptr) {
    const int v = *p.num_tokens_dev;
    T = v >= 0 && v <= T ? v : 0;  // a bad device count sends nothing (as ll: T = 0)
  }
  if (threadIdx.x == 0) *p.num_tokens_out = T;
  const int n = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (n >= L.num_nodes) return;
  uint8_t* b = p.send + n * L.block_bytes;
  int32_t* src = reinterpret_cast<int32_t*>(b + L.off_src);
  int32_t* ids = reinterpret_cast<int32_t*>(b + L.off_idx);
  float* w = reinterpret_cast<float*>(b + L.off_w);
  const unsigned lt = (1u << lane) - 1u;
  int base = 0;
  for (int t0 = 0; t0 < M; t0 += 32) {
    const int t = t0 + lane;
    bool in = false;
    if (t < T) {
      for (int k = 0; k < K; ++k) {
        const int64_t v = load_id(p, static_cast<int64_t>(t) * K + k);
        if (!L.valid_id(v, k)) {
          if (n == 0 && p.report != nullptr) {  // one warp reports (any bad id; the host names it)
            p.report->bad_token = t;
            p.report->bad_column = k;
            p.report->bad_value = v;
            __threadfence_system();
            p.report->bad_count = 1;
          }
          continue;
        }
        if (L.node_of(static_cast<int32_t>(v)) == n) in = true;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, in);
    const int j = in ? base + __popc(ballot & lt) : -1;
    if (t < M) p.pos[static_cast<int64_t>(n) * M + t] = j;
    if (in) {
      src[j] = t;
      for (int k = 0; k < K; ++k) {
        const int64_t v = load_id(p, static_cast<int64_t>(t) * K + k);
        ids[static_cast<int64_t>(j) * K + k] = L.valid_id(v, k) ? static_cast<int32_t>(v) : -1;
        w[static_cast<int64_t>(j) * K + k] = p.weights[static_cast<int64_t>(t) * K + k];
      }
    }
    base += __popc(ballot);
  }
  if (lane == 0) *reinterpret_cast<int32_t*>(b) = base;
}

__global__ void hier_rows_kernel(HierPackParams p) {
  const HierLayout& L = p.lay;
  const int T = *p.num_tokens_out, M = L.max_tokens;
  const int64_t H = L.hidden;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    for (int n = 0; n < L.num_nodes; ++n) {
      const int j = p.pos[static_cast<int64_t>(n) * M + t];
      if (j < 0) continue;
      uint16_t* dst = reinterpret_cast<uint16_t*>(p.send + n * L.block_bytes + L.off_x) + static_cast<int64_t>(j) * H;
      copy_row(dst, p.x + static_cast<int64_t>(t) * H, H);
    }
  }
}

__global__ void hier_unpack_kernel(HierLayout L, const uint8_t* recv, uint16_t* x_in, int32_t* idx_in, float* w_in) {
  const int64_t M = L.max_tokens, H = L.hidden, K = L.top_k, rows = static_cast<int64_t>(L.num_nodes) * M;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int n = static_cast<int>(r / M);
    const int64_t j = r % M;
    const uint8_t* b = recv + n * L.block_bytes;
    const int32_t count = *reinterpret_cast<const int32_t*>(b);
    const bool live = j < count;
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      idx_in[r * K + k] = live ? L.node_id(reinterpret_cast<const int32_t*>(b + L.off_idx)[j * K + k], n) : -1;
      w_in[r * K + k] = live ? reinterpret_cast<const float*>(b + L.off_w)[j * K + k] : 0.0f;
    }
    if (live) copy_row(x_in + r * H, reinterpret_cast<const uint16_t*>(b + L.off_x) + j * H, H);
  }
}

__global__ void hier_sum_kernel(HierLayout L, const uint16_t* ret, const int32_t* pos, const int32_t* num_tokens, const float* addend,
                                uint16_t* out) {
  __shared__ int32_t js[32];
  const int T = *num_tokens, M = L.max_tokens, N = L.num_nodes;
  const int64_t H = L.hidden;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    __syncthreads();
    if (threadIdx.x < N) js[threadIdx.x] = pos[static_cast<int64_t>(threadIdx.x) * M + t];
    __syncthreads();
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
      float acc = 0.0f;
      for (int n = 0; n < N; ++n)
        if (js[n] >= 0) acc += bf16_bits_to_float(ret[(static_cast<int64_t>(n) * M + js[n]) * H + i]);
      if (addend) acc += addend[static_cast<int64_t>(t) * H + i];  // after the nodes, as sum_host
      out[static_cast<int64_t>(t) * H + i] = float_to_bf16_bits(acc);
    }
  }
}

int grid_for_rows(int64_t rows) { return static_cast<int>(rows < 1 ? 1 : rows > 2048 ? 2048 : rows); }

}  // namespace

void launch_hier_pack(const HierPackParams& p, void* stream) {
  cuda::DeviceGuard guard(p.device);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  hier_pack_kernel<<<1, 32 * p.lay.num_nodes, 0, s>>>(p);
  cuda::check_launch("hier_pack_kernel");
  hier_rows_kernel<<<grid_for_rows(p.lay.max_tokens), 128, 0, s>>>(p);
  cuda::check_launch("hier_rows_kernel");
}

void launch_hier_unpack(int device, const HierLayout& lay, const uint8_t* recv, uint16_t* x_in, int32_t* idx_in, float* w_in, void* stream) {
  cuda::DeviceGuard guard(device);
  hier_unpack_kernel<<<grid_for_rows(static_cast<int64_t>(lay.num_nodes) * lay.max_tokens), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      lay, recv, x_in, idx_in, w_in);
  cuda::check_launch("hier_unpack_kernel");
}

void launch_hier_sum(int device, const HierLayout& lay, const uint16_t* ret, const int32_t* pos, const int32_t* num_tokens,
                     const float* addend, uint16_t* out, void* stream) {
  cuda::DeviceGuard guard(device);
  hier_sum_kernel<<<grid_for_rows(lay.max_tokens), 256, 0, static_cast<cudaStream_t>(stream)>>>(lay, ret, pos, num_tokens, addend, out);
  cuda::check_launch("hier_sum_kernel");
}

HierErrorReport* hier_report_alloc(int device, HierErrorReport** dev) {
  cuda::DeviceGuard guard(device);
  void* host = nullptr;
  EPX_CUDA_CHECK(cudaHostAlloc(&host, sizeof(HierErrorReport), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(HierErrorReport));
  void* d = nullptr;
  EPX_CUDA_CHECK(cudaHostGetDevicePointer(&d, host, 0));
  *dev = static_cast<HierErrorReport*>(d);
  return static_cast<HierErrorReport*>(host);
}

void hier_report_free(HierErrorReport* host) noexcept {
  if (host) (void)cudaFreeHost(host);
}

}  // namespace epx::dispatch

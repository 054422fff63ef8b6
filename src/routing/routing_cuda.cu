// routing/routing_cuda.cu: softmax top-k and DeepSeek noaux_tc routing on CUDA; see routing_cuda.h
// for how it matches the CPU router (routing_cpu.cpp) bit for bit.
//
// One warp per token. The token's scores live in the warp's slice of shared memory; selection is
// K rounds of a warp-wide arg-max under the order "higher key first, then lower expert id", with
// NaN keys ranked as -inf (the CPU's order_key), which gives exactly the CPU's partial_sort result.
#include <cmath>
#include <string>

#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "routing/routing_cuda.h"

namespace epx::routing {
namespace {

constexpr int kMaxWarpsPerBlock = 8;
constexpr int kSharedBytesLimit = 48 * 1024;  // default dynamic shared memory limit, no opt-in needed

struct RouteParams {
  const void* logits;
  int64_t logits_stride_t, logits_stride_e;
  const float* bias;  // nullptr: no correction bias
  int64_t bias_stride;
  void* topk_idx;
  int64_t idx_stride_t, idx_stride_k;
  float* topk_weights;
  int64_t w_stride_t, w_stride_k;
  int64_t num_tokens;
  int num_experts, top_k, n_group, topk_group;
  bool softmax, renormalize, group_limited;
  float routed_scaling_factor;
  int warp_smem_bytes;
};

/// Per-warp shared memory: score[E] f32 (what weights come from), select[E] f32 (what selection
/// ranks), group_score[G] f32, chosen[K] i32, flags[E] u8 (1 eligible, 3 taken), group_flags[G] u8.
struct WarpSmem {
  float* score;
  float* select;
  float* group_score;
  int* chosen;
  uint8_t* flags;
  uint8_t* group_flags;
};

EPX_HOST_DEVICE int64_t align16(int64_t n) { return (n + 15) / 16 * 16; }
EPX_HOST_DEVICE int64_t warp_smem_bytes(int E, int G, int K) {
  return align16(4LL * E) * 2 + align16(4LL * G) + align16(4LL * K) + align16(E) + align16(G);
}

__device__ WarpSmem carve(char* base, int E, int G, int K) {
  WarpSmem s;
  s.score = reinterpret_cast<float*>(base);
  base += align16(4LL * E);
  s.select = reinterpret_cast<float*>(base);
  base += align16(4LL * E);
  s.group_score = reinterpret_cast<float*>(base);
  base += align16(4LL * G);
  s.chosen = reinterpret_cast<int*>(base);
  base += align16(4LL * K);
  s.flags = reinterpret_cast<uint8_t*>(base);
  base += align16(E);
  s.group_flags = reinterpret_cast<uint8_t*>(base);
  return s;
}

__device__ __forceinline__ float order_key(float v) { return isnan(v) ? -INFINITY : v; }
__device__ __forceinline__ bool ranks_before(float ka, int ia, float kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

/// Warp-wide arg-max of (key, id) under ranks_before; every lane gets the winner.
__device__ __forceinline__ void warp_argmax(float& key, int& id) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float ok = __shfl_xor_sync(0xffffffffu, key, m);
    const int oi = __shfl_xor_sync(0xffffffffu, id, m);
    if (ranks_before(ok, oi, key, id)) key = ok, id = oi;
  }
}

__device__ __forceinline__ float load_logit(const float* p) { return *p; }
__device__ __forceinline__ float load_logit(const uint16_t* p) { return __uint_as_float(static_cast<uint32_t>(*p) << 16); }

// Correctly rounded float exp (see routing_cuda.h).
__device__ __forceinline__ float exp_f32(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

template <class LogitT, class IdxT>
__global__ void __launch_bounds__(kMaxWarpsPerBlock * 32) route_kernel(RouteParams p) {
  extern __shared__ __align__(16) char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int E = p.num_experts, K = p.top_k, G = p.n_group;
  const WarpSmem s = carve(smem + static_cast<int64_t>(warp) * p.warp_smem_bytes, E, G, K);
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);

  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + warp; t < p.num_tokens; t += warps_total) {
    const LogitT* row = static_cast<const LogitT*>(p.logits) + t * p.logits_stride_t;
    for (int e = lane; e < E; e += 32) s.score[e] = load_logit(row + e * p.logits_stride_e);

    if (p.softmax) {
      float mx = -INFINITY;
      for (int e = lane; e < E; e += 32) mx = fmaxf(mx, s.score[e]);
#pragma unroll
      for (int m = 16; m > 0; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
      for (int e = lane; e < E; e += 32) s.score[e] = exp_f32(__fsub_rn(s.score[e], mx));
      __syncwarp();
      float inv = 0.0f;
      if (lane == 0) {  // sequential in expert order, like the CPU
        float sum = 0.0f;
        for (int e = 0; e < E; ++e) sum = __fadd_rn(sum, s.score[e]);
        inv = __fdiv_rn(1.0f, sum);
      }
      inv = __shfl_sync(0xffffffffu, inv, 0);
      __syncwarp();
      for (int e = lane; e < E; e += 32) {
        const float v = __fmul_rn(s.score[e], inv);
        s.score[e] = v;
        s.select[e] = v;
      }
    } else {
      for (int e = lane; e < E; e += 32) {
        const float v = __fdiv_rn(1.0f, __fadd_rn(1.0f, exp_f32(-s.score[e])));
        s.score[e] = v;
        s.select[e] = __fadd_rn(v, p.bias ? p.bias[e * p.bias_stride] : 0.0f);
      }
    }
    __syncwarp();

    // Eligibility: the topk_group groups with the best sum of their top-2 selection scores.
    if (p.group_limited) {
      const int per_group = E / G;
      for (int g = lane; g < G; g += 32) {
        float best0 = -INFINITY, best1 = -INFINITY;
        for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
          const float v = order_key(s.select[e]);
          if (v > best0) best1 = best0, best0 = v;
          else if (v > best1) best1 = v;
        }
        s.group_score[g] = per_group >= 2 ? __fadd_rn(best0, best1) : best0;
        s.group_flags[g] = 0;
      }
      __syncwarp();
      for (int i = 0; i < p.topk_group; ++i) {
        float key = -INFINITY;
        int id = 0x7fffffff;
        for (int g = lane; g < G; g += 32) {
          const float k = order_key(s.group_score[g]);
          if (!s.group_flags[g] && ranks_before(k, g, key, id)) key = k, id = g;
        }
        warp_argmax(key, id);
        if (lane == 0) s.group_flags[id] = 1;
        __syncwarp();
      }
      for (int e = lane; e < E; e += 32) s.flags[e] = s.group_flags[e / per_group];
    } else {
      for (int e = lane; e < E; e += 32) s.flags[e] = 1;
    }
    __syncwarp();

    for (int k = 0; k < K; ++k) {
      float key = -INFINITY;
      int id = 0x7fffffff;
      for (int e = lane; e < E; e += 32) {
        const float v = order_key(s.select[e]);
        if (s.flags[e] == 1 && ranks_before(v, e, key, id)) key = v, id = e;
      }
      warp_argmax(key, id);
      if (lane == 0) {
        s.flags[id] = 3;
        s.chosen[k] = id;
      }
      __syncwarp();
    }

    float norm = 1.0f;
    if (lane == 0 && p.renormalize) {  // sequential in k order; DeepSeek's +1e-20 like the CPU
      float sum = 0.0f;
      for (int k = 0; k < K; ++k) sum = __fadd_rn(sum, s.score[s.chosen[k]]);
      norm = __fdiv_rn(1.0f, __fadd_rn(sum, 1e-20f));
    }
    norm = __shfl_sync(0xffffffffu, norm, 0);
    for (int k = lane; k < K; k += 32) {
      const int e = s.chosen[k];
      static_cast<IdxT*>(p.topk_idx)[t * p.idx_stride_t + k * p.idx_stride_k] = static_cast<IdxT>(e);
      p.topk_weights[t * p.w_stride_t + k * p.w_stride_k] =
          __fmul_rn(__fmul_rn(s.score[e], norm), p.routed_scaling_factor);
    }
    __syncwarp();
  }
}

void check_on(std::string_view op, std::string_view arg, const TensorView& t, Device device) {
  check_device(op, arg, t, device);
}

}  // namespace

void route_cuda(const RouterConfig& cfg, const TensorView& logits, const TensorView& correction_bias,
                const TensorView& topk_idx, const TensorView& topk_weights, Stream stream) {
  constexpr std::string_view op = "route";
  cuda::ensure_runtime();
  validate_router_config(cfg);
  const int E = cfg.num_experts, K = cfg.top_k;
  check_dtype(op, "logits", logits, {DType::fp32, DType::bf16});
  check_shape(op, "logits", logits, {-1, E});
  const int64_t T = logits.shape[0];
  check_dtype(op, "topk_idx", topk_idx, {DType::int32, DType::int64});
  check_shape(op, "topk_idx", topk_idx, {T, K});
  check_dtype(op, "topk_weights", topk_weights, {DType::fp32});
  check_shape(op, "topk_weights", topk_weights, {T, K});
  require_arg(op, "logits.device", logits.device.str(), logits.device.is_cuda(), "must be a CUDA device");
  check_on(op, "topk_idx", topk_idx, logits.device);
  check_on(op, "topk_weights", topk_weights, logits.device);
  if (cfg.use_correction_bias) {
    check_dtype(op, "correction_bias", correction_bias, {DType::fp32});
    check_shape(op, "correction_bias", correction_bias, {E});
    check_on(op, "correction_bias", correction_bias, logits.device);
  }
  const int64_t per_warp = warp_smem_bytes(E, cfg.n_group, K);
  if (per_warp > kSharedBytesLimit)
    throw Unsupported(arg_message(op, "num_experts", E, "must be <= 3072 on CUDA (one warp's scores fit in 48 KiB of shared memory)"));
  if (T == 0) return;

  RouteParams p;
  p.logits = logits.data;
  p.logits_stride_t = logits.strides[0];
  p.logits_stride_e = logits.strides[1];
  p.bias = cfg.use_correction_bias ? static_cast<const float*>(correction_bias.data) : nullptr;
  p.bias_stride = cfg.use_correction_bias ? correction_bias.strides[0] : 0;
  p.topk_idx = topk_idx.data;
  p.idx_stride_t = topk_idx.strides[0];
  p.idx_stride_k = topk_idx.strides[1];
  p.topk_weights = static_cast<float*>(topk_weights.data);
  p.w_stride_t = topk_weights.strides[0];
  p.w_stride_k = topk_weights.strides[1];
  p.num_tokens = T;
  p.num_experts = E;
  p.top_k = K;
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  p.softmax = cfg.scoring == ScoringFunc::softmax;
  p.renormalize = cfg.renormalize;
  p.group_limited = cfg.n_group > 1 && cfg.topk_group < cfg.n_group;
  p.routed_scaling_factor = cfg.routed_scaling_factor;
  p.warp_smem_bytes = static_cast<int>(per_warp);

  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarpsPerBlock, std::max<int64_t>(1, kSharedBytesLimit / per_warp)));
  const unsigned blocks = cuda::grid_for(T, warps, 132 * 16);
  const size_t smem = static_cast<size_t>(per_warp) * warps;
  const cudaStream_t s = cuda::native(stream);
  cuda::DeviceGuard guard(logits.device.index);
  const bool bf16 = logits.dtype == DType::bf16, i64 = topk_idx.dtype == DType::int64;
  if (!bf16 && !i64) route_kernel<float, int32_t><<<blocks, warps * 32, smem, s>>>(p);
  else if (!bf16 && i64) route_kernel<float, int64_t><<<blocks, warps * 32, smem, s>>>(p);
  else if (bf16 && !i64) route_kernel<uint16_t, int32_t><<<blocks, warps * 32, smem, s>>>(p);
  else route_kernel<uint16_t, int64_t><<<blocks, warps * 32, smem, s>>>(p);
  cuda::check_launch("route_kernel");
}

}  // namespace epx::routing

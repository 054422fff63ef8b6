// experts/experts_fp8_cuda.cu: tensor-core grouped GEMMs for fp8_block experts on sm_90a.
//
// Both GEMMs put the weights in wgmma's M slot and the tokens in N ("swap A/B"): a decode tile of
// a few tokens per expert then costs an N=16 wgmma instead of a 64-row tile that is mostly padding,
// and the weight rows stream at full width. One CTA = 2 warpgroups (256 threads) computes a tile
// of 256 weight rows x BN tokens (BN = 16 for tiles of <= 16 rows, else 64, chosen per tile on the
// device), every warpgroup two m64nBNk32 e4m3 wgmmas per 32-deep K step:
//   gate_up: rows = gate [i0, i0+128) and up [I+i0, I+i0+128) of w13, so a thread holds gate and up
//            of the same (h column, token) and the epilogue computes h = silu(g) * u, the FP8 1x128
//            amax over the CTA's 128 h columns (one FP8 group), and writes h as FP8 + fp32 scale
//            (the CPU's quantize_fp8_row rule);
//   down:    rows = output columns [n0, n0+256) of w2; the epilogue rounds to bf16 once.
// K is consumed 128 at a time (one FP8 scale block): the 4 wgmmas of a 128-block accumulate in the
// tensor core from zero, then the block result is multiplied by w_scale * x_scale and added to
// fp32 registers (block-scale promotion, DeepSeek-V3 / DeepGEMM's recipe).
// Operands move global -> shared with 16-byte cp.async into a kStages-deep ring of 128-byte-swizzled
// K-major tiles (the layout wgmma's 128B-swizzle descriptors read); every thread loads and every
// warpgroup computes. The work list is (row tile, weight tile) pairs, row tiles from the schedule
// kernels (device-side counts, no host sync), walked by a persistent grid in an order that keeps
// all weight tiles of one row tile, and all row tiles of one expert, close in time (L2 reuse).
#include "experts/experts_fp8_cuda.h"

#include <algorithm>
#include <mutex>
#include <vector>

#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "experts/experts_epilogue.cuh"
#include "experts/experts_fp8_wgmma.cuh"

namespace epx::experts_cuda {
namespace {

using namespace wg;

constexpr int kThreads = 256;
constexpr int kStages = 5;
constexpr int kMaxBN = 64;
constexpr int kSubBytes = 64 * kBK;             // one m64 weight sub-tile (8 KiB)
constexpr int kAStageBytes = kFp8TileWeightRows * kBK;  // 32 KiB
constexpr int kBStageBytes = kMaxBN * kBK;              // 8 KiB
constexpr int kStageBytes = kAStageBytes + kBStageBytes;
constexpr int kScaleFloats = 4 + kMaxBN;        // per stage: 4 weight sub-tile scales + BN token scales
constexpr int kScaleOff = kStages * kStageBytes;
constexpr int kRowsOff = kScaleOff + kStages * kScaleFloats * 4;
constexpr int kRedOff = kRowsOff + kMaxBN * 4;
constexpr int kSmemUsed = kRedOff + 8 * kMaxBN * 4;
constexpr int kSmemBytes = kSmemUsed + 1024;    // + alignment of the base to 1024 (swizzle atom)
constexpr int kHStageStride = kBK + 16;         // gate_up epilogue: FP8 h rows (bytes), padded
constexpr int kOutStageStride = kFp8TileWeightRows + 8;  // down epilogue: bf16 out rows (elements), padded
static_assert(kMaxBN * kOutStageStride * 2 <= kStages * kStageBytes, "epilogue staging fits the ring");

__global__ void probe_kernel(int* ok) {
#ifdef EPX_FP8_WGMMA
  *ok = 1;
#else
  *ok = 0;
#endif
}

#ifdef EPX_FP8_WGMMA

/// One (row tile, weight tile) item with BN token columns. smem: 1024-aligned base.
/// kEpi: the expert's biases and activation from *ep (experts_epilogue.cuh; fp8_gemm_epi_kernel).
template <int BN, bool kGateUp, bool kEpi = false>
__device__ __forceinline__ void run_item(const Fp8GemmParams& p, const Item& it, uint8_t* smem, uint32_t smem_s,
                                         const ExpertEpi* ep = nullptr) {
  constexpr int kFrag = BN / 2;  // accumulator floats per thread per m64nBN
  const int tid = threadIdx.x, wg = tid >> 7, warp_in_wg = (tid >> 5) & 3, lane = tid & 31;
  int32_t* rows = reinterpret_cast<int32_t*>(smem + kRowsOff);  // B row source (x row or h row)
  float* scales = reinterpret_cast<float*>(smem + kScaleOff);
  const int64_t nk = it.K / kBK;
  const int64_t b_stride = kGateUp ? p.hidden : p.h_stride;  // bytes per B row
  const int64_t bs_stride = kGateUp ? p.hidden / kBK : p.hs_stride;
  const uint8_t* b_base = kGateUp ? p.x : p.hq;
  const float* bs_base = kGateUp ? p.x_scales : p.hs;
  const int64_t ws_stride = it.K / kBK;

  auto load_stage = [&](int s, int64_t kb) {
    const uint32_t a_s = smem_s + s * kStageBytes, b_s = a_s + kAStageBytes;
    const int64_t k0 = kb * kBK;
#pragma unroll
    for (int i = 0; i < (kFp8TileWeightRows * 8) / kThreads; ++i) {
      // chunk q = tid + 256 i: row r = tid / 8 + 32 i, sub-tile r / 64 = i / 2 (compile-time)
      const int t = i >> 1, r = (tid >> 3) + 32 * i, c = tid & 7;
      const bool v = sub_valid<kGateUp>(it, t);
      const uint8_t* src = v ? it.w + (sub_row<kGateUp>(it, t) + (r & 63)) * it.K + k0 + c * 16 : it.w;
      cp_async16(a_s + swz(r, c), src, v);
    }
#pragma unroll
    for (int i = 0; i < (BN * 8 + kThreads - 1) / kThreads; ++i) {
      const int q = tid + i * kThreads;
      if (q < BN * 8) {
        const int j = q >> 3, c = q & 7;
        const bool v = j < it.num_rows;
        const uint8_t* src = v ? b_base + static_cast<int64_t>(rows[j]) * b_stride + k0 + c * 16 : b_base;
        cp_async16(b_s + swz(j, c), src, v);
      }
    }
    const uint32_t sc = smem_s + kScaleOff + s * kScaleFloats * 4;
    if (tid < 4) {
      const bool v = sub_valid<kGateUp>(it, tid);
      const float* src = v ? it.w_scale + (sub_row<kGateUp>(it, tid) / kBK) * ws_stride + kb : it.w_scale;
      cp_async4(sc + tid * 4, src, v);
    } else if (tid >= 32 && tid < 32 + BN) {
      const int j = tid - 32;
      const bool v = j < it.num_rows;
      const float* src = v ? bs_base + static_cast<int64_t>(rows[j]) * bs_stride + kb : bs_base;
      cp_async4(sc + (4 + j) * 4, src, v);
    }
  };

  float acc[2][kFrag], tmp[2][kFrag];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int i = 0; i < kFrag; ++i) acc[s][i] = 0.0f, tmp[s][i] = 0.0f;

  // The 8 wgmmas of K block kb (stage kb % kStages) into t, committed as one group.
  auto issue = [&](int64_t kb, float (&t)[2][kFrag]) {
    const uint32_t a_s = smem_s + static_cast<int>(kb % kStages) * kStageBytes, b_s = a_s + kAStageBytes;
    const uint64_t da0 = smem_desc(a_s + wg * kSubBytes), da1 = smem_desc(a_s + (2 + wg) * kSubBytes);
    const uint64_t db = smem_desc(b_s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kBK / 32; ++k) {
      Wgmma<BN>::mma(t[0], da0 + 2 * k, db + 2 * k, k);  // +32 bytes along K = +2 in the descriptor
      Wgmma<BN>::mma(t[1], da1 + 2 * k, db + 2 * k, k);
    }
    wgmma_commit();
  };
  // acc += t * (w_scale * x_scale) with the scales of K block kb (after its wgmmas completed).
  auto promote = [&](int64_t kb, float (&t)[2][kFrag]) {
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int i = 0; i < kFrag; ++i) fence_operand(t[sub][i]);
    const float* sc = scales + static_cast<int>(kb % kStages) * kScaleFloats;
    const float wsc0 = sc[wg], wsc1 = sc[2 + wg];
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      const float xs = sc[4 + col];
      acc[0][i] = fmaf(t[0][i], wsc0 * xs, acc[0][i]);
      acc[1][i] = fmaf(t[1][i], wsc1 * xs, acc[1][i]);
    }
  };
  auto wait_stage = [&](int64_t kb, int distance) {
    cp_async_wait_dyn(distance);
    fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
    __syncthreads();
    if (kb + distance + 1 < nk) load_stage(static_cast<int>((kb + distance + 1) % kStages), kb + distance + 1);
    cp_async_commit();
  };

  // Prefetch distance kStages - 1; each K block's wgmmas complete before its promotion.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }
  for (int64_t kb = 0; kb < nk; ++kb) {
    wait_stage(kb, kStages - 2);
    issue(kb, tmp);
    wgmma_wait<0>();
    promote(kb, tmp);
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the epilogue staging

  if constexpr (kGateUp) {
    // h for (h column wg*64 + row, token col): gate in acc[0], up in acc[1].
    float* red = reinterpret_cast<float*>(smem + kRedOff);  // [8 warps][BN] amax
    float hv[kFrag];
    float cmax[kFrag / 2];  // per distinct column: index (i >> 2) * 2 + (i & 1)
#pragma unroll
    for (int j = 0; j < kFrag / 2; ++j) cmax[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const float g = acc[0][i], u = acc[1][i];
      if constexpr (kEpi)
        hv[i] = expert_glu(*ep, g, u, it.col0 + wg * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1), it.inter);
      else hv[i] = g / (1.0f + expf(-g)) * u;  // silu(g) * u in fp32, the CPU's expression
      const int j = (i >> 2) * 2 + (i & 1);
      cmax[j] = fmaxf(cmax[j], fabsf(hv[i]));
    }
#pragma unroll
    for (int j = 0; j < kFrag / 2; ++j) {
#pragma unroll
      for (int m = 4; m < 32; m <<= 1) cmax[j] = fmaxf(cmax[j], __shfl_xor_sync(0xffffffffu, cmax[j], m));
    }
    const int warp = tid >> 5;
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < kFrag / 2; ++j) red[warp * kMaxBN + 8 * (j >> 1) + 2 * lane + (j & 1)] = cmax[j];
    }
    __syncthreads();
    uint8_t* stage = smem;  // [BN][kHStageStride] FP8 h
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      float amax = 0.0f;
#pragma unroll
      for (int w = 0; w < 8; ++w) amax = fmaxf(amax, red[w * kMaxBN + col]);
      const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
      const int hrow = wg * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1);
      stage[col * kHStageStride + hrow] = float_to_fp8_e4m3_bits(__fdiv_rn(hv[i], scale));
    }
    if (tid < it.num_rows) {
      float amax = 0.0f;
      for (int w = 0; w < 8; ++w) amax = fmaxf(amax, red[w * kMaxBN + tid]);
      p.hs[static_cast<int64_t>(it.row0 + tid) * p.hs_stride + it.col0 / kBK] = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
    }
    __syncthreads();
    for (int q = tid; q < it.num_rows * 8; q += kThreads) {
      const int j = q >> 3, c = q & 7;
      *reinterpret_cast<uint4*>(p.hq + static_cast<int64_t>(it.row0 + j) * p.h_stride + it.col0 + c * 16) =
          *reinterpret_cast<const uint4*>(stage + j * kHStageStride + c * 16);
    }
  } else {
    uint16_t* stage = reinterpret_cast<uint16_t*>(smem);  // [BN][kOutStageStride] bf16
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      const int t = sub * 2 + wg;
#pragma unroll
      for (int i = 0; i < kFrag; ++i) {
        const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
        const int wrow = t * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1);
        if constexpr (kEpi) {
          if (it.col0 + wrow < p.hidden) acc[sub][i] = expert_out_bias(*ep, acc[sub][i], it.col0 + wrow);
        }
        stage[col * kOutStageStride + wrow] = float_to_bf16_bits(acc[sub][i]);
      }
    }
    __syncthreads();
    constexpr int kChunks = kFp8TileWeightRows / 8;  // 16-byte chunks per output row
    for (int q = tid; q < it.num_rows * kChunks; q += kThreads) {
      const int j = q / kChunks, c = q % kChunks;
      const int64_t n = it.col0 + c * 8;
      if (n < p.hidden)
        *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(it.row0 + j) * p.hidden + n) =
            *reinterpret_cast<const uint4*>(stage + j * kOutStageStride + c * 8);
    }
  }
  __syncthreads();  // staging and rows[] are reused by the next item
}

/// The kernel body; kEpi (fp8_gemm_epi_kernel): the experts' biases and activations from epi [L].
template <bool kGateUp, bool kEpi>
__device__ __forceinline__ void fp8_gemm_body(const Fp8GemmParams& p, const ExpertEpi* epi, uint8_t* smem_raw) {
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  int32_t* rows = reinterpret_cast<int32_t*>(smem + kRowsOff);

  // Tiles [0, *num_small) when the prefill kernel takes the rest (Fp8GemmParams::num_small).
  const int32_t num_tiles = p.num_small != nullptr ? *p.num_small : *p.num_tiles;
  const int64_t num_items = static_cast<int64_t>(num_tiles) * p.max_weight_tiles;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    const Tile tile = p.tiles[item / p.max_weight_tiles];
    const int wt = static_cast<int>(item % p.max_weight_tiles);
    const ExpertDesc e = p.experts[tile.expert];
    if (e.format != static_cast<int32_t>(WeightFormat::fp8_block)) continue;  // CTA-uniform
    Item it;
    const int64_t inter = e.intermediate;
    it.row0 = tile.row0;
    it.num_rows = tile.num_rows;
    it.inter = inter;
    it.hidden = p.hidden;
    if constexpr (kGateUp) {
      if (static_cast<int64_t>(wt) * kBK >= inter) continue;
      it.w = static_cast<const uint8_t*>(e.w13);
      it.w_scale = static_cast<const float*>(e.w13_scale);
      it.K = p.hidden;
      it.col0 = static_cast<int64_t>(wt) * kBK;
    } else {
      it.col0 = static_cast<int64_t>(wt) * kFp8TileWeightRows;
      if (it.col0 >= p.hidden) continue;
      it.w = static_cast<const uint8_t*>(e.w2);
      it.w_scale = static_cast<const float*>(e.w2_scale);
      it.K = inter;
    }
    if (threadIdx.x < kMaxBN) {
      const int j = threadIdx.x;
      int32_t r = 0;
      if (j < tile.num_rows) r = kGateUp && p.gather != nullptr ? p.gather[tile.row0 + j] : tile.row0 + j;
      rows[j] = r;
    }
    __syncthreads();
    if constexpr (kEpi) {
      if (tile.num_rows <= 16) run_item<16, kGateUp, true>(p, it, smem, smem_s, epi + tile.expert);
      else run_item<64, kGateUp, true>(p, it, smem, smem_s, epi + tile.expert);
    } else {
      if (tile.num_rows <= 16) run_item<16, kGateUp>(p, it, smem, smem_s);
      else run_item<64, kGateUp>(p, it, smem, smem_s);
    }
  }
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) fp8_gemm_kernel(Fp8GemmParams p) {
  extern __shared__ uint8_t smem_raw[];
  fp8_gemm_body<kGateUp, false>(p, nullptr, smem_raw);
}

/// fp8_gemm_kernel with the experts' biases and activations (epi [L]: ExpertEpi).
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) fp8_gemm_epi_kernel(Fp8GemmParams p, const ExpertEpi* epi) {
  extern __shared__ uint8_t smem_raw[];
  fp8_gemm_body<kGateUp, true>(p, epi, smem_raw);
}

#else  // not sm_90a: the host never launches these (fp8_tensor_cores_available is false)

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) fp8_gemm_kernel(Fp8GemmParams) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) fp8_gemm_epi_kernel(Fp8GemmParams, const ExpertEpi*) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

#endif  // EPX_FP8_WGMMA

template <bool kGateUp>
void launch(const Fp8GemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  // The shared-memory limit was raised on this device by fp8_tensor_cores_available().
  if (epi != nullptr) fp8_gemm_epi_kernel<kGateUp><<<grid, kThreads, kSmemBytes, stream>>>(p, epi);
  else fp8_gemm_kernel<kGateUp><<<grid, kThreads, kSmemBytes, stream>>>(p);
  cuda::check_launch(kGateUp ? "fp8_gemm_kernel (gate_up)" : "fp8_gemm_kernel (down)");
}

}  // namespace

bool fp8_tensor_cores_available(int device) {
  static std::mutex mu;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  std::lock_guard<std::mutex> lock(mu);
  if (device >= static_cast<int>(known.size())) known.resize(device + 1, -1);
  if (known[device] >= 0) return known[device] == 1;
  cuda::DeviceGuard guard(device);
  cudaDeviceProp prop{};
  EPX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int ok = 0;
  if (prop.major == 9 && prop.minor == 0 &&
      prop.sharedMemPerBlockOptin >=
          static_cast<size_t>(std::max({kSmemBytes, fp8_prefill_smem_bytes(), fp8_prefill_tma_smem_bytes()}))) {
    int* d = nullptr;
    EPX_CUDA_CHECK(cudaMalloc(&d, sizeof(int)));
    probe_kernel<<<1, 1>>>(d);
    const cudaError_t launched = cudaGetLastError();
    if (launched == cudaSuccess) EPX_CUDA_CHECK(cudaMemcpy(&ok, d, sizeof(int), cudaMemcpyDeviceToHost));
    EPX_CUDA_CHECK(cudaFree(d));
    if (ok == 1) {  // once per device, outside any graph capture: the kernels' shared-memory limit
      for (auto* k : {fp8_gemm_kernel<true>, fp8_gemm_kernel<false>})
        EPX_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      for (auto* k : {fp8_gemm_epi_kernel<true>, fp8_gemm_epi_kernel<false>})
        EPX_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      fp8_prefill_set_smem_limits();
      fp8_prefill_tma_set_smem_limits();
    }
  }
  known[device] = ok;
  return ok == 1;
}

void launch_fp8_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  launch<true>(p, grid, stream, epi);
}
void launch_fp8_down(const Fp8GemmParams& p, int grid, cudaStream_t stream, const ExpertEpi* epi) {
  launch<false>(p, grid, stream, epi);
}

}  // namespace epx::experts_cuda

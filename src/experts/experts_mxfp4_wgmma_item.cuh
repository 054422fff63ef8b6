// experts/experts_mxfp4_wgmma_item.cuh: run_item, one (row tile, weight tile) item of the MXFP4 /
// mixed-format GEMMs on the wgmma path (a ring of weight stages expanded to e4m3 or bf16 operand tiles).
// Part of experts_mxfp4_kernels.cuh (include that one).
#pragma once

#include "experts/experts_epilogue.cuh"
#include "experts/experts_mxfp4_device.cuh"

namespace epx::experts_cuda {
namespace {

#ifdef EPX_MX_WGMMA

/// One (row tile, weight tile) item of kind kK with BN token columns. smem: 1024-aligned base.
/// NT threads: kThreads (2 warpgroups, each the consumer of sub-tiles wg and 2 + wg, one weight row
/// per thread).
/// kEpi (mixed_gemm_epi_kernel): the expert's biases and activation from *ep (experts_epilogue.cuh).
template <int kK, int BN, int kDbg, int NT, bool kEpi = false>
__device__ __forceinline__ void run_item(const MixedGemmParams& p, const Item& it, uint8_t* smem, uint32_t smem_s,
                                         Stamps<kDbg>& sp, const ExpertEpi* ep = nullptr) {
  using T = KT<kK>;
  constexpr bool kGateUp = T::kGateUp;
  constexpr int kSubs = 2;  // 64-row sub-tiles per warpgroup
  constexpr int kFrag = BN / 2;
  constexpr int S = T::kStages;
  const int tid = threadIdx.x, wg = tid >> 7, warp_in_wg = (tid >> 5) & 3, lane = tid & 31;
  int32_t* rows = reinterpret_cast<int32_t*>(smem + kRowsOff);
  float* scales = reinterpret_cast<float*>(smem + kScaleOff);
  float* row_scales = reinterpret_cast<float*>(smem + kRowScaleOff);
  const int64_t nk = it.K / T::kKPerStage;
  // B operand: 128 bytes per row per stage
  const uint8_t* b_base = kGateUp ? p.x : (T::kMx ? reinterpret_cast<const uint8_t*>(p.hb) : p.hq);
  const int64_t b_stride = kGateUp ? p.hidden : (T::kMx ? p.hb_stride * 2 : p.h_stride);  // bytes
  const float* bs_base = kGateUp ? p.x_scales : p.hs;
  const int64_t bs_stride = kGateUp ? p.hidden / 128 : p.hs_stride;
  // mxfp4: this thread's weight row (row r = tid of the 256-row tile)
  const int my_r = tid;
  const int my_t = my_r >> 6;
  const bool my_valid = sub_valid<kGateUp>(it, my_t);
  const int64_t my_row = sub_row<kGateUp>(it, my_t) + (my_r & 63);
  // sub-tile of this warpgroup's s-th accumulator
  auto sub_of = [&](int s) { return 2 * s + wg; };
  const int64_t my_scale0 = T::kMx ? my_row * (it.K / 32) : 0;  // byte of this row's first e8m0 scale

  auto load_stage = [&](int s, int64_t kb) {
    const uint32_t st = smem_s + s * T::kStageBytes;
#pragma unroll
    for (int i = 0; i < (BN * 8 + NT - 1) / NT; ++i) {
      const int q = tid + i * NT;
      if (q < BN * 8) {
        const int j = q >> 3, c = q & 7;
        const bool v = j < it.num_rows;
        const uint8_t* src = v ? b_base + static_cast<int64_t>(rows[j]) * b_stride + kb * 128 + c * 16 : b_base;
        cp_async16(st + T::kBOff + swz(j, c), src, v);
      }
    }
    if constexpr (!T::kMx) {
#pragma unroll
      for (int i = 0; i < (kRows * 8) / NT; ++i) {
        const int r = (tid >> 3) + (NT / 8) * i, t = r >> 6, c = tid & 7;
        const bool v = sub_valid<kGateUp>(it, t);
        const uint8_t* src = v ? it.w + (sub_row<kGateUp>(it, t) + (r & 63)) * it.K + kb * 128 + c * 16 : it.w;
        cp_async16(st + T::kAOff + swz(r, c), src, v);
      }
    } else {
      constexpr int kChunks = T::kKPerStage / 32;  // 16-byte code chunks per row per stage
      const uint8_t* src_row = it.w + my_row * (it.K / 2) + kb * (T::kKPerStage / 2);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if constexpr (kDbg == 3) cp_async16_pf256(st + T::kRawOff + tid * T::kRawStride + c * 16, my_valid ? src_row + c * 16 : it.w, my_valid);
        else cp_async16(st + T::kRawOff + tid * T::kRawStride + c * 16, my_valid ? src_row + c * 16 : it.w, my_valid);
      }
      // the aligned word holding this stage's scale bytes (gate_up: 4 at a multiple of 4; down: 2 at an even byte)
      const int64_t sb = my_scale0 + kb * (T::kKPerStage / 32);
      const uint8_t* ssrc = static_cast<const uint8_t*>(it.w_scale) + (sb & ~int64_t{3});
      if constexpr (kDbg == 3) cp_async4_pf256(st + T::kRawScaleOff + tid * 4, my_valid ? ssrc : it.w_scale, my_valid);
      else cp_async4(st + T::kRawScaleOff + tid * 4, my_valid ? ssrc : it.w_scale, my_valid);
    }
    if constexpr (!T::kBf16) {
      const uint32_t sc = smem_s + kScaleOff + s * kScaleFloats * 4;
      if constexpr (!T::kMx) {
        if (tid < 4) {
          const bool v = sub_valid<kGateUp>(it, tid);
          const float* ws = static_cast<const float*>(it.w_scale);
          const float* src = v ? ws + (sub_row<kGateUp>(it, tid) / 128) * (it.K / 128) + kb : ws;
          cp_async4(sc + tid * 4, src, v);
        }
      }
      if (tid >= 32 && tid < 32 + BN) {
        const int j = tid - 32;
        const bool v = j < it.num_rows;
        const float* src = v ? bs_base + static_cast<int64_t>(rows[j]) * bs_stride + kb : bs_base;
        cp_async4(sc + (4 + j) * 4, src, v);
      }
    }
  };
  auto convert = [&](int64_t kb) {
    if constexpr (T::kMx && kDbg != 2) {  // kDbg 2: debug ablation without the expansion
      const int64_t step = kb * (T::kKPerStage / 32);
      const int64_t sbs[1] = {my_scale0 + step};
      convert_row<kK, NT>(smem + static_cast<int>(kb % S) * T::kStageBytes, smem + T::kConvOff + static_cast<int>(kb & 1) * kConvBytes,
                      row_scales + static_cast<int>(kb & 1) * kRows, sbs);
    }
  };

  float acc[kSubs][kFrag], tmp[kSubs][kFrag];
#pragma unroll
  for (int s = 0; s < kSubs; ++s)
#pragma unroll
    for (int i = 0; i < kFrag; ++i) acc[s][i] = 0.0f, tmp[s][i] = 0.0f;

  // The 4 wgmmas per sub-tile of K block kb into t (kMxDown: into acc, accumulating after the first).
  auto issue = [&](int64_t kb, float (&t)[kSubs][kFrag]) {
    const uint32_t st = smem_s + static_cast<int>(kb % S) * T::kStageBytes;
    const uint32_t a_s = T::kMx ? smem_s + T::kConvOff + static_cast<int>(kb & 1) * kConvBytes : st + T::kAOff;
    uint64_t da[kSubs];
#pragma unroll
    for (int s = 0; s < kSubs; ++s) da[s] = smem_desc(a_s + sub_of(s) * kSubBytes);
    const uint64_t db = smem_desc(st + T::kBOff);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // 4 steps of 32 bytes along K (+2 in the descriptor)
      const int accumulate = T::kBf16 ? (kb > 0 || k > 0) : k;
#pragma unroll
      for (int s = 0; s < kSubs; ++s) Mma<T::kBf16, BN>::run(t[s], da[s] + 2 * k, db + 2 * k, accumulate);
    }
    wgmma_commit();
  };
  // acc += t * (w_scale * token_scale) for K block kb (its wgmmas completed).
  auto promote = [&](int64_t kb, float (&t)[kSubs][kFrag]) {
#pragma unroll
    for (int sub = 0; sub < kSubs; ++sub)
#pragma unroll
      for (int i = 0; i < kFrag; ++i) fence_operand(t[sub][i]);
    const float* sc = scales + static_cast<int>(kb % S) * kScaleFloats;
    float w[kSubs][2];
    if constexpr (T::kMx) {
      const float* rs = row_scales + static_cast<int>(kb & 1) * kRows;
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) {
        const int r = sub_of(sub) * 64 + 16 * warp_in_wg + (lane >> 2);
        w[sub][0] = rs[r];
        w[sub][1] = rs[r + 8];
      }
    } else {
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) w[sub][0] = w[sub][1] = sc[sub_of(sub)];
    }
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
      const float xs = sc[4 + col];
      const int h = (i >> 1) & 1;
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) acc[sub][i] = fmaf(t[sub][i], w[sub][h] * xs, acc[sub][i]);
    }
  };

  // Prologue: blocks 0 .. S-2 in flight, block 0 expanded, block S-1 issued.
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nk) load_stage(s, s);
    cp_async_commit();
  }
  cp_async_wait<S - 2>();
  convert(0);
  fence_proxy_async();
  __syncthreads();
  if (S - 1 < nk) load_stage(S - 1, S - 1);
  cp_async_commit();
  // Invariant at the top of iteration kb: block kb is expanded and visible, blocks kb+1 .. kb+S-1
  // are in flight (one cp.async group each), and no wgmma is outstanding.
  sp.mark(kDbgPrologue);
  for (int64_t kb = 0; kb < nk; ++kb) {
    if constexpr (T::kBf16) issue(kb, acc);
    else issue(kb, tmp);
    sp.mark(kDbgIssue);
    if (kb + 1 < nk) {
      cp_async_wait<S - 2>();  // this thread's copies of block kb + 1
      sp.mark(kDbgLoadWait);
      convert(kb + 1);         // into the other operand tile, under the wgmmas of block kb
      sp.mark(kDbgConvert);
    }
    wgmma_wait<0>();
    sp.mark(kDbgMmaWait);
    if constexpr (!T::kBf16) promote(kb, tmp);
    sp.mark(kDbgPromote);
    fence_proxy_async();  // generic-proxy writes (cp.async, expansion) before wgmma's async-proxy reads
    sp.mark(kDbgFence);
    __syncthreads();      // block kb + 1 visible; stage kb and operand tile kb & 1 free
    sp.mark(kDbgBarrier);
    if (kb + S < nk) load_stage(static_cast<int>(kb % S), kb + S);
    cp_async_commit();
    sp.mark(kDbgLoadIssue);
  }
  sp.count(kDbgStages, nk);
  sp.count(T::kMx ? kDbgMxItems : kDbgFp8Items, 1);
  cp_async_wait<0>();
  __syncthreads();  // the ring is free for the epilogue staging

  if constexpr (kGateUp) {
    float hv[kFrag];
    const bool h_owner = true;  // every thread holds gate (sub-tile wg) and up (2 + wg) of its rows
#pragma unroll
    for (int i = 0; i < kFrag; ++i) {
      const float g = acc[0][i], u = acc[kSubs - 1][i];
      if constexpr (kEpi)
        hv[i] = expert_glu(*ep, g, u, it.col0 + wg * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1), it.inter);
      else hv[i] = g / (1.0f + expf(-g)) * u;  // silu(g) * u in fp32, the CPU's expression
    }
    if constexpr (T::kMx) {
      uint16_t* stage = reinterpret_cast<uint16_t*>(smem);  // [BN][kHbStageStride] bf16 h
      if (h_owner) {
#pragma unroll
        for (int i = 0; i < kFrag; ++i) {
          const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
          const int hrow = wg * 64 + 16 * warp_in_wg + (lane >> 2) + 8 * ((i >> 1) & 1);
          stage[col * kHbStageStride + hrow] = float_to_bf16_bits(hv[i]);
        }
      }
      __syncthreads();
      for (int q = tid; q < it.num_rows * 16; q += NT) {
        const int j = q >> 4, c = q & 15;
        *reinterpret_cast<uint4*>(p.hb + static_cast<int64_t>(it.row0 + j) * p.hb_stride + it.col0 + c * 8) =
            *reinterpret_cast<const uint4*>(stage + j * kHbStageStride + c * 8);
      }
    } else {
      // FP8 1x128 h over the CTA's 128 h columns, as experts_fp8_cuda.cu.
      float* red = reinterpret_cast<float*>(smem + kRedOff);  // [8 warps][BN] amax
      if (h_owner) {
        float cmax[kFrag / 2];
#pragma unroll
        for (int j = 0; j < kFrag / 2; ++j) cmax[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < kFrag; ++i) {
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
      }
      __syncthreads();
      uint8_t* stage = smem;  // [BN][kHStageStride] FP8 h
      if (h_owner) {
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
      }
      if (tid < it.num_rows) {
        float amax = 0.0f;
        for (int w = 0; w < 8; ++w) amax = fmaxf(amax, red[w * kMaxBN + tid]);
        p.hs[static_cast<int64_t>(it.row0 + tid) * p.hs_stride + it.col0 / 128] = __fdiv_rn(fmaxf(amax, 1e-4f), kFp8E4m3Max);
      }
      __syncthreads();
      for (int q = tid; q < it.num_rows * 8; q += NT) {
        const int j = q >> 3, c = q & 7;
        *reinterpret_cast<uint4*>(p.hq + static_cast<int64_t>(it.row0 + j) * p.h_stride + it.col0 + c * 16) =
            *reinterpret_cast<const uint4*>(stage + j * kHStageStride + c * 16);
      }
    }
  } else {
    uint16_t* stage = reinterpret_cast<uint16_t*>(smem);  // [BN][kOutStageStride] bf16
#pragma unroll
    for (int sub = 0; sub < kSubs; ++sub) {
      const int t = sub_of(sub);
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
    constexpr int kChunks = kRows / 8;  // 16-byte chunks per output row
    for (int q = tid; q < it.num_rows * kChunks; q += NT) {
      const int j = q / kChunks, c = q % kChunks;
      const int64_t n = it.col0 + c * 8;
      if (n < p.hidden)
        *reinterpret_cast<uint4*>(p.out + static_cast<int64_t>(it.row0 + j) * p.hidden + n) =
            *reinterpret_cast<const uint4*>(stage + j * kOutStageStride + c * 8);
    }
  }
  __syncthreads();  // staging and rows[] are reused by the next item
  sp.mark(kDbgEpilogue);
}

#endif  // EPX_MX_WGMMA

}  // namespace
}  // namespace epx::experts_cuda

// experts/experts_mxfp4_kernels.cuh: the MXFP4 / mixed-format grouped GEMM kernels (design and precision:
// experts_mxfp4_cuda.cu), shared by the translation units that instantiate
// its kernels, so they compile in parallel (ptxas takes tens of seconds per instantiation set):
//   experts_mxfp4_cuda.cu        the 256-thread kernels and the host API (experts_mxfp4_cuda.h);
//   experts_mxfp4_debug_cuda.cu  the stamped / ablation kernels of set_mixed_debug.
// Include only from those files: the kernels live in an anonymous namespace (one copy per file,
// each instantiating its own).
#pragma once

#include "experts/experts_mxfp4_decode_bulk.cuh"

// The device code in order: experts_mxfp4_device.cuh (shared), experts_mxfp4_wgmma_item.cuh (the wgmma
// path), experts_mxfp4_decode.cuh and experts_mxfp4_decode_bulk.cuh (the decode paths).

namespace epx::experts_cuda {
namespace {

#ifdef EPX_MX_WGMMA

template <bool kGateUp, int kDbg = 0, int NT = kThreads>
__global__ void __launch_bounds__(NT, 1) mixed_gemm_kernel(MixedGemmParams p, unsigned long long* dbg) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  int32_t* rows = reinterpret_cast<int32_t*>(smem + kRowsOff);
  Stamps<kDbg> sp;
  const long long k_start = kDbg > 0 ? clock64() : 0;
  const int64_t num_items = static_cast<int64_t>(*p.num_tiles) * p.max_weight_tiles;
  BulkState bulk;
  if constexpr (kDbg <= 2 && NT == kThreads) {
    decode_bulk_init(smem_s);
    __syncthreads();
  }

  // Items walk the tile list from its end: the last local expert (the FHMoE shared expert, with a
  // row for every token and twice the weight bytes of an MXFP4 expert) starts first instead of
  // forming the tail of the persistent grid (longest items first).
  for (int64_t walk = blockIdx.x; walk < num_items; walk += gridDim.x) {
    Item it;
    Tile tile;
    bool mx;
    if (!resolve_item<kGateUp>(p, num_items, walk, it, tile, mx)) continue;
    sp.start();
    if (threadIdx.x < kMaxBN) {
      const int j = threadIdx.x;
      int32_t r = 0;
      if (j < tile.num_rows) r = kGateUp && p.gather != nullptr ? p.gather[tile.row0 + j] : tile.row0 + j;
      rows[j] = r;
    }
    __syncthreads();
    constexpr int kFp8 = kGateUp ? kFp8GateUp : kFp8Down, kMx = kGateUp ? kMxGateUp : kMxDown;
    if constexpr (kDbg > 0) {  // debug kernels (set_mixed_debug): mxfp4 items of <= 16 rows only
      if constexpr (kDbg <= 2 && NT == kThreads) {  // modes 1 and 2: the decode path when it is on
        if (mx && decode_bulk_ok<kGateUp>(p, it)) decode_item_bulk<kGateUp, kDbg>(p, it, smem, bulk, sp);
        else if (mx && tile.num_rows <= 8 && p.decode) decode_item_ring2<kGateUp, kDbg>(p, it, smem, sp);
        else if (mx && tile.num_rows <= 16 && p.decode) decode_item_ring<kGateUp, 2, kDbg>(p, it, smem, sp);
        else if (mx && tile.num_rows <= 16) run_item<kMx, 16, kDbg, NT>(p, it, smem, smem_s, sp);
      } else {
        if (mx && tile.num_rows <= 16) run_item<kMx, 16, kDbg, NT>(p, it, smem, smem_s, sp);
      }
    } else if (mx) {
      if constexpr (kDbg == 0 && NT == kThreads) {  // the decode path (decode_item_ring) for <= 16 rows
        if (decode_bulk_ok<kGateUp>(p, it)) decode_item_bulk<kGateUp, kDbg>(p, it, smem, bulk, sp);
        else if (tile.num_rows <= 8 && p.decode) decode_item_ring2<kGateUp, kDbg>(p, it, smem, sp);
        else if (tile.num_rows <= 16 && p.decode) decode_item_ring<kGateUp, 2, kDbg>(p, it, smem, sp);
        else if (tile.num_rows <= 16) run_item<kMx, 16, kDbg, NT>(p, it, smem, smem_s, sp);
        else run_item<kMx, 64, kDbg, NT>(p, it, smem, smem_s, sp);
      } else {
        if (tile.num_rows <= 16) run_item<kMx, 16, kDbg, NT>(p, it, smem, smem_s, sp);
        else run_item<kMx, 64, kDbg, NT>(p, it, smem, smem_s, sp);
      }
    } else {
      if (tile.num_rows <= 16) run_item<kFp8, 16, kDbg, NT>(p, it, smem, smem_s, sp);
      else run_item<kFp8, 64, kDbg, NT>(p, it, smem, smem_s, sp);
    }
  }
  if constexpr (kDbg > 0) {
    sp.count(kDbgKernel, clock64() - k_start);
    sp.count(kDbgCtas, 1);
    sp.flush(dbg, kGateUp);
  }
}

/// mixed_gemm_kernel with the experts' biases and activations (epi [L]: ExpertEpi), every item on the wgmma
/// path (run_item; the decode paths carry no epilogue variant): same results within fp32 summation order.
template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) mixed_gemm_epi_kernel(MixedGemmParams p, const ExpertEpi* epi) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  int32_t* rows = reinterpret_cast<int32_t*>(smem + kRowsOff);
  Stamps<0> sp;
  const int64_t num_items = static_cast<int64_t>(*p.num_tiles) * p.max_weight_tiles;
  for (int64_t walk = blockIdx.x; walk < num_items; walk += gridDim.x) {
    Item it;
    Tile tile;
    bool mx;
    if (!resolve_item<kGateUp>(p, num_items, walk, it, tile, mx)) continue;
    if (threadIdx.x < kMaxBN) {
      const int j = threadIdx.x;
      int32_t r = 0;
      if (j < tile.num_rows) r = kGateUp && p.gather != nullptr ? p.gather[tile.row0 + j] : tile.row0 + j;
      rows[j] = r;
    }
    __syncthreads();
    constexpr int kFp8 = kGateUp ? kFp8GateUp : kFp8Down, kMx = kGateUp ? kMxGateUp : kMxDown;
    const ExpertEpi* ep = epi + it.expert;
    if (mx) {
      if (tile.num_rows <= 16) run_item<kMx, 16, 0, kThreads, true>(p, it, smem, smem_s, sp, ep);
      else run_item<kMx, 64, 0, kThreads, true>(p, it, smem, smem_s, sp, ep);
    } else {
      if (tile.num_rows <= 16) run_item<kFp8, 16, 0, kThreads, true>(p, it, smem, smem_s, sp, ep);
      else run_item<kFp8, 64, 0, kThreads, true>(p, it, smem, smem_s, sp, ep);
    }
  }
}

#else  // not sm_90a: the host never launches these (mxfp4_tensor_cores_available is false)

template <bool kGateUp, int kDbg = 0, int NT = kThreads>
__global__ void __launch_bounds__(NT, 1) mixed_gemm_kernel(MixedGemmParams, unsigned long long*) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

template <bool kGateUp>
__global__ void __launch_bounds__(kThreads, 1) mixed_gemm_epi_kernel(MixedGemmParams, const ExpertEpi*) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

#endif  // EPX_MX_WGMMA

/// Launches mixed_gemm_kernel<kGateUp, kDbg, NT> (NT threads, the full shared-memory plan).
template <bool kGateUp, int kDbg, int NT>
void launch_kernel(const MixedGemmParams& p, int grid, cudaStream_t stream, unsigned long long* dbg) {
  mixed_gemm_kernel<kGateUp, kDbg, NT><<<grid, NT, kSmemBytes, stream>>>(p, dbg);
}
/// Raises the dynamic shared-memory limit of mixed_gemm_kernel<kGateUp, kDbg, NT> on the current device.
template <bool kGateUp, int kDbg, int NT>
void allow_smem() {
  EPX_CUDA_CHECK(cudaFuncSetAttribute(mixed_gemm_kernel<kGateUp, kDbg, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
}

}  // namespace
}  // namespace epx::experts_cuda

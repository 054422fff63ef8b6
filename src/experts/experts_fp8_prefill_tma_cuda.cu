// experts/experts_fp8_prefill_tma_cuda.cu: a variant of the FP8 prefill grouped GEMMs of
// experts_fp8_prefill_cuda.cu (same tiles, same epilogue, experts_fp8_prefill.cuh; bit-identical
// output) whose operands come by TMA: since the tenth session the default's kernels for every GEMM
// whose token rows are contiguous (ExpertMajor gate_up, every down), with the lean consumer that loads
// the next K block's operands under the last promotion (lean_item_prefetch; producer 40 / consumers 232
// registers), bench/NOTES.md tenth session; opt-in: mode 17's consumer (Config::experts_fp8_prefill 10),
// the lean consumer without the prefetch (23), with it (27), 27 with the Flat gate_up's token rows
// permuted into row-space order first (29, eleventh session: permute_x_kernel below). (With the mode-8
// consumer, sixth session:
// 4 % faster than the cp.async kernels on ExpertMajor and 9 % slower on Flat.) Its 2-CTA cluster launch
// multicasting the weight tile (11) was slower in every run, with the mode-17 consumer too (eighth
// session: 4618 / 5037 us against 17's 3464 / 3519), and was removed.
//
// One CTA per SM, 384 threads, warp-specialized:
//   warpgroup 0 (producer, 64 registers): streams each K block's operands into a kStages-deep ring
//     of 128-byte-swizzled K-major tiles: thread 0 loads the 256 x 128-byte weight tile as two
//     128-row boxes of the expert's tensor map (Fp8GemmParams::w_maps; cp.async.bulk.tensor, 128B
//     swizzle = the layout smem_desc reads) and, where the tile's token rows are contiguous
//     (ExpertMajor gate_up; down's hq), the 128 x 128-byte token tile from a per-launch map of x /
//     hq, all completing on the stage's `full` mbarrier (expect_tx); the 128 threads still
//     cp.async the token scales (strided: [rows, K/128]) and the Flat gate_up token rows (a
//     gather: 8 lanes per 128-byte row; with Fp8GemmParams::x_perm, mode 29, the rows permuted into
//     row-space order beforehand come as one TMA box like ExpertMajor's) and arrive with
//     cp.async.mbarrier.arrive, so `full` completes when the TMA bytes and all 128 threads' copies
//     landed. The weight maps are required (the launches check; without them, when the driver cannot
//     encode them, upload leaves w_maps null and apply runs the cp.async kernels of
//     experts_fp8_prefill_cuda.cu instead: this kernel's own cp.async weight path, which only that case
//     reached, was removed in the twelfth session);
//   warpgroups 1, 2 (consumers, 216 registers): experts_fp8_prefill.cuh's kblock and epilogue (tokens
//     in wgmma's A), the consumer of mode 17 of experts_fp8_prefill_cuda.cu (until the eighth session
//     that of mode 8; same bits); the producer runs up to kStages blocks
//     ahead, across work items, so the next item's first stages load under the current epilogue.
// Work items: (128-row tile, weight tile) pairs over the tile list's prefill section, walked by a
// persistent grid in tile-major order (all weight tiles of one row tile, then the expert's next row
// tile: the weight tile's second reader hits L2).
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime's driver entry point)
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/check.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "experts/experts_fp8_cuda.h"
#include "experts/experts_fp8_prefill.cuh"
#include "experts/experts_fp8_wgmma.cuh"

namespace epx::experts_cuda {
namespace {

using namespace wg;

using namespace pf;

static_assert(sizeof(CUtensorMap) == sizeof(Fp8TmaMap) && alignof(CUtensorMap) <= alignof(Fp8TmaMap), "opaque map fits");
constexpr int kTmaBox = 128;  // TMA box: 128 rows x 128 bytes (one 16 KiB half of the weight tile, or the token tile)

#ifdef EPX_FP8_WGMMA

// ---- TMA (cp.async.bulk.tensor) and mbarrier transaction counts; PTX ISA 8.0 ----
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
/// Box (x = K byte offset, y = row) of the 2-D map `map` into shared `dst` (1024-byte aligned);
/// completes `bytes` of the box on mbarrier `bar`. Rows past the map's extent land as zeros.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t x, int32_t y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

/// Work item q (row tile q / max_weight_tiles, weight tile q % max_weight_tiles) of the prefill
/// section, or nk == 0 when this CTA-uniform item has nothing to do (resolve_tile).
struct Work {
  Item it{};
  int32_t expert = -1;
  int64_t nk = 0;  // K blocks
};

template <bool kGateUp>
__device__ __forceinline__ Work work_at(const Fp8GemmParams& p, int32_t tile0, int64_t q) {
  Work w;
  if (resolve_tile<kGateUp>(p, tile0 + static_cast<int32_t>(q / p.max_weight_tiles), static_cast<int>(q % p.max_weight_tiles), w.it,
                            w.expert))
    w.nk = w.it.K / kBK;
  return w;
}

/// The weight tile: two 128-row TMA boxes of the expert's map (thread 0). Token loads by cp.async are
/// coalesced: thread pt copies 16-byte chunk pt % 8 of rows pt / 8 + 16 i, so 8 consecutive lanes read
/// one row's 128 contiguous bytes (a thread per row would split every 32-byte sector between two
/// instructions: twice the L2 -> SM traffic, measured slower than the 64-row kernels).
/// tma_b: the token tile by one TMA box of `bmap` at the tile's first row (contiguous rows: ExpertMajor
/// gate_up, down's hq, the Flat gate_up's x_perm), else the gather / copy by cp.async; the token scales
/// come by cp.async either way (through p.gather for the Flat gate_up).
template <bool kGateUp>
__device__ __forceinline__ void producer(const Fp8GemmParams& p, const CUtensorMap* bmap, bool tma_b, int32_t tile0, int64_t num_steps,
                                         uint32_t stages, uint8_t* smem, uint32_t smem_s) {
  using L = Layout<kGateUp>;
  const int pt = threadIdx.x;  // 0..127
  const int c = pt & 7, r8 = pt >> 3;
  const int64_t b_stride = kGateUp ? p.hidden : p.h_stride;  // bytes per B row
  const int64_t bs_stride = kGateUp ? p.hidden / kBK : p.hs_stride;
  const uint8_t* b_base = kGateUp ? p.x : p.hq;
  const float* bs_base = kGateUp ? p.x_scales : p.hs;
  int64_t* rows = reinterpret_cast<int64_t*>(smem + L::kRowsOff);  // byte offset of token j's B row
  const uint32_t full0 = smem_s + L::kBarOff, empty0 = full0 + L::kStages * 8;
  const uint32_t tx_bytes = kABytes + (tma_b ? kBBytes : 0);
  RingPos pos;
  bool wrapped = false;  // every stage was filled once (from then on, wait for its release)
  for (int64_t q = blockIdx.x; q < num_steps; q += gridDim.x) {
    const Work w = work_at<kGateUp>(p, tile0, q);
    if (w.nk == 0) continue;
    const Item& it = w.it;
    // The weight tile's two 128-row boxes: gate_up gate rows col0.. and up rows I + col0..;
    // down output rows col0.. and col0 + 128.. (past H: zero-filled, as sub_valid's zeros).
    const CUtensorMap* amap = static_cast<const CUtensorMap*>(p.w_maps) + 2 * w.expert + (kGateUp ? 0 : 1);
    const int32_t ar0 = static_cast<int32_t>(sub_row<kGateUp>(it, 0)), ar1 = static_cast<int32_t>(sub_row<kGateUp>(it, 2));
    // Token pt's B row (gather for Flat gate_up); its scale row stays in this thread.
    const bool bv = pt < it.num_rows;
    int64_t brow = 0;
    if (bv) brow = kGateUp && p.gather != nullptr ? p.gather[it.row0 + pt] : it.row0 + pt;
    const float* bssrc = bs_base + brow * bs_stride;
    named_bar_sync(2, 128);  // every producer thread is past the previous item's reads of rows[]
    rows[pt] = brow * b_stride;
    named_bar_sync(2, 128);
    const bool wsv = pt < 4 && sub_valid<kGateUp>(it, pt & 3);
    const float* wssrc = it.w_scale + (wsv ? (sub_row<kGateUp>(it, pt & 3) / kBK) * (it.K / kBK) : 0);
    for (int64_t kb = 0; kb < w.nk; ++kb) {
      const uint32_t s = pos.stage;
      if (wrapped) mbar_wait(empty0 + s * 8, pos.phase ^ 1u);  // the consumers released the previous use
      const uint32_t a_s = smem_s + s * kStageBytes, b_s = a_s + kABytes;
      const int64_t k0 = kb * kBK;
      if (pt == 0) {
        const uint32_t full = full0 + s * 8;
        mbar_arrive_expect_tx(full, tx_bytes);  // the barrier's 129th arrival; TMA bytes complete it
        tma_load_2d(a_s, amap, static_cast<int32_t>(k0), ar0, full);
        tma_load_2d(a_s + kTmaBox * kBK, amap, static_cast<int32_t>(k0), ar1, full);
        if (tma_b) tma_load_2d(b_s, bmap, static_cast<int32_t>(k0), it.row0, full);
      }
      if (!tma_b) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int j = r8 + 16 * i;
          const bool v = j < it.num_rows;
          cp_async16(b_s + swz(j, c), b_base + (v ? rows[j] + k0 + c * 16 : 0), v);
        }
      }
      const uint32_t sc = smem_s + L::kScaleOff + s * kScaleFloats * 4;
      cp_async4(sc + (4 + pt) * 4, bssrc + kb, bv);  // token scale; 0 for rows past the tile
      if (pt < 4) cp_async4(sc + pt * 4, wssrc + kb, wsv);
      cp_async_mbar_arrive(full0 + s * 8);
      pos.advance(stages);
      wrapped = wrapped || pos.stage == 0;
    }
  }
  cp_async_wait<0>();
}

/// The consumer warpgroups (experts_fp8_prefill.cuh: kblock, epilogue), as mode 17 of
/// experts_fp8_prefill_cuda.cu since the eighth session: the scales read before the wgmmas, the
/// stage released before the last promotion, wgmma's A (tokens) in registers, bulk-copy row stores.
/// The weight tiles come by TMA (async proxy), the only operand wgmma reads from shared memory: no proxy
/// fence, however the token tile came (every consumer here reads it with ldmatrix, a generic-proxy read
/// like cp.async's writes; until the eleventh session the fence also ran for the Flat gate_up's cp.async
/// gather, and until the twelfth for the cp.async weight path the kernel then had).
template <bool kGateUp, bool kLean, bool kPrefetch>
__device__ __forceinline__ void consumer(const Fp8GemmParams& p, int32_t tile0, int64_t num_steps, uint32_t stages,
                                         uint8_t* smem, uint32_t smem_s) {
  using L = Layout<kGateUp>;
  const Who w;
  const std::conditional_t<kLean, LeanOffsets, NoOffsets> lo(w);  // only the lean consumers keep them
  const float* scales = reinterpret_cast<const float*>(smem + L::kScaleOff);
  const uint32_t full0 = smem_s + L::kBarOff, empty0 = full0 + L::kStages * 8;
  float acc[2][kFrag], tmp[kFrag];
#pragma unroll
  for (int i = 0; i < kFrag; ++i) tmp[i] = 0.0f;
  RingPos pos;
  for (int64_t q = blockIdx.x; q < num_steps; q += gridDim.x) {
    const Work wk = work_at<kGateUp>(p, tile0, q);
    if (wk.nk == 0) continue;
    const Item& it = wk.it;
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = 0.0f;
    if constexpr (kPrefetch) {  // mode 27: the next K block's operands loaded under the second promotion
      lean_item_prefetch(lo, wk.nk, pos, stages, smem_s, smem_s + L::kScaleOff, full0, empty0, smem_s + L::kDoneOff, acc, tmp, [] {});
    } else {
      for (int64_t kb = 0; kb < wk.nk; ++kb) {
        const uint32_t s = pos.stage;
        mbar_wait(full0 + s * 8, pos.phase);  // no proxy fence: the weights came by TMA, the tokens go by ldmatrix
        const uint32_t a_s = smem_s + s * kStageBytes;
        auto release = [&] { mbar_arrive(empty0 + s * 8); };  // every consumer thread releases the stage (kEmptyArrivals)
        if constexpr (kLean) kblock_lean(lo, a_s, a_s + kABytes, smem_s + L::kScaleOff + s * (kScaleFloats * 4), acc, tmp, release);
        else kblock<true, true>(w, a_s, a_s + kABytes, scales + s * kScaleFloats, acc, tmp, release);
        pos.advance(stages);
      }
    }
    epilogue<kGateUp, 1>(p, it, w, acc, smem);
  }
  bulk_end(w);
}

/// kLean: the consumer of kblock_lean (Config::experts_fp8_prefill 23) with kPrefetch: lean_item_prefetch
/// (27, and the default's TMA GEMMs); registers 40 / 232 then.
template <bool kGateUp, bool kLean, bool kPrefetch>
__global__ void __launch_bounds__(kPfThreads, 1) fp8_prefill_tma_kernel(Fp8GemmParams p, const __grid_constant__ CUtensorMap bmap, int tma_b) {
  using L = Layout<kGateUp>;
  // tma_b: the token tile comes by TMA from `bmap` (the launch encoded it)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      // full: every producer thread's cp.async arrival + thread 0's expect_tx arrival (the TMA bytes)
      mbar_init(smem_s + L::kBarOff + s * 8, 129);
      mbar_init(smem_s + L::kBarOff + (L::kStages + s) * 8, kEmptyArrivals);  // empty: every consumer thread
    }
    mbar_init(smem_s + L::kDoneOff, 1);  // done: completed once here (lean_item_prefetch)
    mbar_arrive(smem_s + L::kDoneOff);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int32_t tile0 = *p.num_small, tile1 = *p.num_tiles;
  // Ring depth: Fp8GemmParams::prefill_stages clamped to [2, kStages] (0 = kStages).
  const uint32_t stages = p.prefill_stages <= 0 ? L::kStages : min(max(p.prefill_stages, 2), L::kStages);
  const int64_t num_steps = static_cast<int64_t>(max(tile1 - tile0, 0)) * p.max_weight_tiles;
  // Registers: 384 x 168 at launch = 128 x 64 + 256 x 216 (kLean: 128 x 40 + 256 x 232).
  if (threadIdx.x < 128) {
    if constexpr (kLean) setmaxnreg_dec<40>();
    else setmaxnreg_dec<64>();
    producer<kGateUp>(p, &bmap, tma_b != 0, tile0, num_steps, stages, smem, smem_s);
  } else {
    if constexpr (kLean) setmaxnreg_inc<232>();
    else setmaxnreg_inc<216>();
    consumer<kGateUp, kLean, kPrefetch>(p, tile0, num_steps, stages, smem, smem_s);
  }
}

#else  // not sm_90a: the host never launches these (fp8_tensor_cores_available is false)

template <bool kGateUp, bool kLean, bool kPrefetch>
__global__ void __launch_bounds__(kPfThreads, 1) fp8_prefill_tma_kernel(Fp8GemmParams, const __grid_constant__ CUtensorMap, int) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

#endif  // EPX_FP8_WGMMA

/// cuTensorMapEncodeTiled from the driver (through the runtime: no libcuda link), or null.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

/// 2-D map of FP8 codes [rows, cols] (row stride `stride` bytes), 128 x 128-byte boxes, 128B swizzle.
bool encode_fp8_map(CUtensorMap& m, const void* base, uint64_t cols, uint64_t rows, uint64_t stride) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = tensor_map_encoder();
  if (fn == nullptr || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || stride % 16 != 0 || cols < kBK ||
      rows < 1 || rows > (uint64_t{1} << 31) || cols > stride)
    return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride};
  const cuuint32_t box[2] = {kBK, kTmaBox};
  const cuuint32_t elem[2] = {1, 1};
  return fn(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// 2-D map of bytes [rows, cols] (row stride `stride` bytes) in boxes of box_rows x box_cols bytes.
bool encode_byte_map(CUtensorMap& m, const void* base, uint64_t cols, uint64_t rows, uint64_t stride, uint32_t box_cols,
                     uint32_t box_rows, CUtensorMapSwizzle swizzle) {
  const PFN_cuTensorMapEncodeTiled_v12000 fn = tensor_map_encoder();
  if (fn == nullptr || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || stride % 16 != 0 || cols < box_cols ||
      rows < box_rows || rows > (uint64_t{1} << 31) || cols > stride)
    return false;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {stride};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem[2] = {1, 1};
  return fn(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool mxfp4_decode_maps(const ExpertDesc& e, int64_t hidden, Fp8TmaMap (&maps)[4]) {
  const auto inter = static_cast<uint64_t>(e.intermediate), h = static_cast<uint64_t>(hidden);
  CUtensorMap m[4]{};
  if (h % 512 == 0 && (!encode_byte_map(m[0], e.w13, h / 2, 2 * inter, h / 2, 128, 16, CU_TENSOR_MAP_SWIZZLE_128B) ||
                       !encode_byte_map(m[1], e.w13_scale, h / 32, 2 * inter, h / 32, 16, 16, CU_TENSOR_MAP_SWIZZLE_NONE)))
    return false;
  if (inter % 512 == 0 && (!encode_byte_map(m[2], e.w2, inter / 2, h, inter / 2, 128, 16, CU_TENSOR_MAP_SWIZZLE_128B) ||
                           !encode_byte_map(m[3], e.w2_scale, inter / 32, h, inter / 32, 16, 16, CU_TENSOR_MAP_SWIZZLE_NONE)))
    return false;
  for (int i = 0; i < 4; ++i) std::memcpy(maps[i].bytes, &m[i], sizeof(m[i]));
  return true;
}

bool fp8_prefill_weight_maps(const ExpertDesc& e, int64_t hidden, Fp8TmaMap& w13_map, Fp8TmaMap& w2_map) {
  const auto inter = static_cast<uint64_t>(e.intermediate), h = static_cast<uint64_t>(hidden);
  CUtensorMap m13{}, m2{};
  if (!encode_fp8_map(m13, e.w13, h, 2 * inter, h) || !encode_fp8_map(m2, e.w2, inter, h, inter)) return false;
  std::memcpy(w13_map.bytes, &m13, sizeof(m13));
  std::memcpy(w2_map.bytes, &m2, sizeof(m2));
  return true;
}

namespace {

/// The kernel of the gate_up (kGateUp) or down GEMM of Fp8GemmParams::prefill_fast `fast`
/// (Config::experts_fp8_prefill 10: 0; lean 23: 3; lean with prefetch, 27 and the default: 5).
template <bool kGateUp>
auto tma_kernel(int fast) {
  return fast == 5   ? fp8_prefill_tma_kernel<kGateUp, true, true>
         : fast == 3 ? fp8_prefill_tma_kernel<kGateUp, true, false>
                     : fp8_prefill_tma_kernel<kGateUp, false, false>;
}

/// The TMA kernels load every weight tile through p.w_maps: a launch without them is a caller's error.
void require_weight_maps(const Fp8GemmParams& p, const char* launcher) {
  if (p.w_maps == nullptr)
    throw InvalidArgument(std::string(launcher) + ": Fp8GemmParams::w_maps is null, but the TMA prefill kernels load every "
                          "weight tile through the weight tensor maps (fp8_prefill_weight_maps); without them run the cp.async "
                          "kernels (launch_fp8_prefill_gate_up / launch_fp8_prefill_down)");
}

template <bool kGateUp>
void launch_prefill(const Fp8GemmParams& p, const CUtensorMap& bmap, bool tb, int grid, cudaStream_t stream, const char* what) {
  tma_kernel<kGateUp>(p.prefill_fast)<<<grid, kPfThreads, Layout<kGateUp>::kSmemBytes, stream>>>(p, bmap, tb ? 1 : 0);
  cuda::check_launch(what);
}

}  // namespace

int fp8_prefill_tma_smem_bytes() { return std::max(Layout<true>::kSmemBytes, Layout<false>::kSmemBytes); }

void fp8_prefill_tma_set_smem_limits() {
  for (int fast : {0, 3, 5}) {
    EPX_CUDA_CHECK(cudaFuncSetAttribute(tma_kernel<true>(fast), cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<true>::kSmemBytes));
    EPX_CUDA_CHECK(cudaFuncSetAttribute(tma_kernel<false>(fast), cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<false>::kSmemBytes));
  }
}

// The token tile's map is built per launch (x, x_perm and hq change between calls; a captured graph
// keeps the parameter by value, like the pointers in p): x [row space, H] for ExpertMajor gate_up,
// x_perm [row space, H] (row stride x_perm_stride) for the Flat gate_up when permute_x_kernel copied
// its rows there (Config::experts_fp8_prefill 29), hq [row space, h_stride] for down; otherwise the
// Flat gate_up gathers by cp.async. Rows past the row space land as zeros; rows of the box past the
// tile's num_rows feed only output rows the epilogue never stores.
void launch_fp8_prefill_tma_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream) {
  require_weight_maps(p, "launch_fp8_prefill_tma_gate_up");
  CUtensorMap bmap{};
  const bool perm = p.gather != nullptr && p.x_perm != nullptr;
  const bool tb = (p.gather == nullptr || perm) &&
                  encode_fp8_map(bmap, perm ? p.x_perm : p.x, static_cast<uint64_t>(p.hidden), static_cast<uint64_t>(p.row_space),
                                 static_cast<uint64_t>(perm ? p.x_perm_stride : p.hidden));
  launch_prefill<true>(p, bmap, tb, grid, stream, "fp8_prefill_tma_kernel (gate_up)");
}

namespace {

constexpr int kPermuteThreads = 512;  // 16 warps: a warp per token row
constexpr int kPermuteUnroll = 14;    // 16-byte chunks per lane in flight (DeepSeek-V3's H 7168: 448 chunks = 14 x 32)

/// The Flat gate_up's token rows in row-space order (Config::experts_fp8_prefill 29): for every tile of
/// the prefill section ([*num_small, *num_tiles) of p.tiles) of an fp8_block expert, row r = row0 + j
/// (j < num_rows) of x_perm (row stride x_perm_stride bytes) gets x row gather[r] (H FP8 bytes), so the
/// TMA gate_up loads each tile's tokens as one box, as for ExpertMajor. A block per tile, a warp per
/// row, 16-byte loads (read-only path) and stores; H % 16 == 0, x and x_perm 16-byte aligned (the launch
/// checks). The scales stay where they are: the producer reads them through p.gather.
__global__ void __launch_bounds__(kPermuteThreads) permute_x_kernel(Fp8GemmParams p) {
  const int32_t tile0 = *p.num_small, tile1 = *p.num_tiles;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t chunks = p.hidden / 16;
  for (int32_t t = tile0 + static_cast<int32_t>(blockIdx.x); t < tile1; t += static_cast<int32_t>(gridDim.x)) {
    const Tile tile = p.tiles[t];
    if (p.experts[tile.expert].format != static_cast<int32_t>(WeightFormat::fp8_block)) continue;  // not a prefill GEMM row
    for (int j = warp; j < tile.num_rows; j += kPermuteThreads / 32) {
      const int64_t r = tile.row0 + j;
      const uint4* src = reinterpret_cast<const uint4*>(p.x + static_cast<int64_t>(p.gather[r]) * p.hidden);
      uint4* dst = reinterpret_cast<uint4*>(p.x_perm + r * p.x_perm_stride);
      for (int64_t c0 = 0; c0 < chunks; c0 += 32 * kPermuteUnroll) {
        uint4 v[kPermuteUnroll];
#pragma unroll
        for (int u = 0; u < kPermuteUnroll; ++u) {
          const int64_t c = c0 + u * 32 + lane;
          if (c < chunks) v[u] = __ldg(src + c);
        }
#pragma unroll
        for (int u = 0; u < kPermuteUnroll; ++u) {
          const int64_t c = c0 + u * 32 + lane;
          if (c < chunks) dst[c] = v[u];
        }
      }
    }
  }
}

}  // namespace

void launch_fp8_prefill_permute_x(const Fp8GemmParams& p, int grid, cudaStream_t stream) {
  if (p.hidden % 16 != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 != 0 || reinterpret_cast<uintptr_t>(p.x_perm) % 16 != 0 ||
      p.x_perm_stride % 16 != 0 || p.x_perm_stride < p.hidden)
    throw InvalidArgument("launch_fp8_prefill_permute_x: x / x_perm must be 16-byte aligned with H % 16 == 0 and x_perm_stride >= H "
                          "(H " + std::to_string(p.hidden) + ", x_perm_stride " + std::to_string(p.x_perm_stride) + ")");
  permute_x_kernel<<<grid, kPermuteThreads, 0, stream>>>(p);
  cuda::check_launch("permute_x_kernel");
}

void launch_fp8_prefill_tma_down(const Fp8GemmParams& p, int grid, cudaStream_t stream) {
  require_weight_maps(p, "launch_fp8_prefill_tma_down");
  CUtensorMap bmap{};
  const bool tb = encode_fp8_map(bmap, p.hq, static_cast<uint64_t>(p.h_stride),
                                                        static_cast<uint64_t>(p.row_space), static_cast<uint64_t>(p.h_stride));
  launch_prefill<false>(p, bmap, tb, grid, stream, "fp8_prefill_tma_kernel (down)");
}

}  // namespace epx::experts_cuda

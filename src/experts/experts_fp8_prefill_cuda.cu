// experts/experts_fp8_prefill_cuda.cu: the prefill (many rows per expert) FP8 block-scaled grouped
// GEMMs on sm_90a: the same two GEMMs as experts_fp8_cuda.cu (128x128 weight block scales x 1x128
// activation scales promoted in fp32 registers after every 128-deep K block, DeepSeek-V3 /
// DeepGEMM's recipe; gate_up fuses silu(g) * u and the FP8 1x128 requantization of h, down rounds
// to bf16 once), over tiles of up to 128 tokens (tokens in wgmma's M slot, below).
//
// One CTA per SM, 384 threads, warp-specialized:
//   warpgroup 0 (producer, 64 registers): streams each K block's operands into a kStages-deep ring
//     of 128-byte-swizzled K-major tiles with 16-byte cp.async (each thread: 2 weight rows and 1
//     token row, 8 chunks each, plus its token's scale) and hands a stage over with
//     cp.async.mbarrier.arrive (the `full` barrier completes when all 128 threads' copies landed);
//     the gather of the Flat layout is a per-thread row index, so Flat and ExpertMajor cost the same;
//   warpgroups 1, 2 (consumers, 216 registers; experts_fp8_prefill.cuh: kblock, epilogue): per K
//     block the scales read first, the tokens (wgmma's A) loaded into registers, two batches of 4
//     m64n128k32 wgmmas into a temporary, each waited for and promoted (acc += tmp * w_scale *
//     x_scale), every consumer thread arriving on the stage's `empty` barrier before the last
//     promotion (kEmptyArrivals, experts_fp8_prefill.cuh: the form compute-sanitizer racecheck
//     follows); the epilogue's rows go out by bulk copies. Tokens in wgmma's A (warpgroup c: tokens
//     64 c ..), weights in B (batch 0: gate rows / output columns 0-127, batch 1: up rows / output
//     columns 128-255), so a thread's accumulators hold 2 tokens and the promotion needs 2 scale
//     products. The producer runs up to kStages blocks ahead, across work items, so the next item's
//     first stages load under the current epilogue.
// These kernels run where the TMA kernels (experts_fp8_prefill_tma_cuda.cu) cannot: when the driver
// cannot encode the weights' tensor maps.
// Work items: (128-row tile, weight tile) pairs over the tile list's prefill section, walked by a
// persistent grid in tile-major order (all weight tiles of one row tile, then the expert's next row
// tile: the weight tile's second reader hits L2).
#include <algorithm>

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

#ifdef EPX_FP8_WGMMA

/// Work item `item` of the prefill section (row tile item / max_weight_tiles, weight tile
/// item % max_weight_tiles), or false when this CTA-uniform item has nothing to do (resolve_tile).
template <bool kGateUp>
__device__ __forceinline__ bool resolve(const Fp8GemmParams& p, int32_t tile0, int64_t item, Item& it) {
  int32_t expert;
  return resolve_tile<kGateUp>(p, tile0 + static_cast<int32_t>(item / p.max_weight_tiles),
                               static_cast<int>(item % p.max_weight_tiles), it, expert);
}

/// This CTA's words of the debug buffer (kDbg: set_fp8_prefill_debug), or null.
template <bool kGateUp>
__device__ __forceinline__ uint32_t* dbg_cta(const Fp8GemmParams& p) {
  return p.debug != nullptr && blockIdx.x < kPfDbgCtas
             ? p.debug + (static_cast<int64_t>(kGateUp ? 0 : 1) * kPfDbgCtas + blockIdx.x) * kPfDbgCtaWords
             : nullptr;
}
/// Role `role`'s stamp words of K block `kb_seen` (counted over the CTA's walk), or null outside
/// the window or for a thread other than lane 0 of the role's warp 0.
__device__ __forceinline__ uint32_t* dbg_rec(uint32_t* cta, int role, int64_t kb_seen, bool recorder) {
  const int64_t j = kb_seen - kPfDbgWin0;
  if (cta == nullptr || !recorder || j < 0 || j >= kPfDbgWin) return nullptr;
  return cta + kPfDbgHeader + (role * kPfDbgWin + j) * kPfDbgStamps;
}

/// Loads are coalesced: thread pt copies 16-byte chunk pt % 8 of rows pt / 8 + 16 i, so 8
/// consecutive lanes read one row's 128 contiguous bytes (a thread per row would split every
/// 32-byte sector between two instructions: twice the L2 -> SM traffic, measured slower than the
/// 64-row kernels).
template <bool kGateUp, bool kDbg>
__device__ __forceinline__ void producer(const Fp8GemmParams& p, int32_t tile0, int64_t num_items, uint32_t stages,
                                         uint8_t* smem, uint32_t smem_s) {
  using L = Layout<kGateUp>;
  const int pt = threadIdx.x;  // 0..127
  const int c = pt & 7, r8 = pt >> 3;
  const int64_t b_stride = kGateUp ? p.hidden : p.h_stride;  // bytes per B row
  const int64_t bs_stride = kGateUp ? p.hidden / kBK : p.hs_stride;
  const uint8_t* b_base = kGateUp ? p.x : p.hq;
  const float* bs_base = kGateUp ? p.x_scales : p.hs;
  int64_t* rows = reinterpret_cast<int64_t*>(smem + L::kRowsOff);  // byte offset of token j's B row
  const uint32_t full0 = smem_s + L::kBarOff, empty0 = full0 + L::kStages * 8;
  RingPos pos;
  bool wrapped = false;  // every stage was filled once (from then on, wait for its release)
  uint32_t* const dcta = kDbg ? dbg_cta<kGateUp>(p) : nullptr;
  const bool no_a = kDbg && (p.debug_flags & (kPfDbgNoLoads | kPfDbgNoWeights)) != 0;
  const bool no_b = kDbg && (p.debug_flags & kPfDbgNoLoads) != 0;
  int64_t seen = 0;  // kDbg: K blocks so far
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    Item it;
    if (!resolve<kGateUp>(p, tile0, item, it)) continue;
    const int64_t nk = it.K / kBK;
    // Token pt's B row (gather for Flat gate_up); its scale row stays in this thread.
    const bool bv = pt < it.num_rows;
    int64_t brow = 0;
    if (bv) brow = kGateUp && p.gather != nullptr ? p.gather[it.row0 + pt] : it.row0 + pt;
    const float* bssrc = bs_base + brow * bs_stride;
    named_bar_sync(2, 128);  // every producer thread is past the previous item's reads of rows[]
    rows[pt] = brow * b_stride;
    named_bar_sync(2, 128);
    // Weight rows r8 + 16 i, i = 0..15: sub-tile i / 4, row (r8 + 16 (i % 4)) inside it.
    const uint8_t* abase[4];
    bool av[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      av[t] = sub_valid<kGateUp>(it, t);
      abase[t] = it.w + (av[t] ? (sub_row<kGateUp>(it, t) + r8) * it.K : 0) + c * 16;
    }
    const int64_t k16 = 16 * it.K;
    const bool wsv = pt < 4 && sub_valid<kGateUp>(it, pt & 3);
    const float* wssrc = it.w_scale + (wsv ? (sub_row<kGateUp>(it, pt & 3) / kBK) * (it.K / kBK) : 0);
    for (int64_t kb = 0; kb < nk; ++kb) {
      const uint32_t s = pos.stage;
      Stamps<kDbg> st;
      if constexpr (kDbg) st.rec = dbg_rec(dcta, 0, seen++, pt == 0);
      st.at(0);
      if (wrapped) mbar_wait(empty0 + s * 8, pos.phase ^ 1u);  // the consumers released the previous use
      st.at(1);
      const uint32_t a_s = smem_s + s * kStageBytes, b_s = a_s + kABytes;
      const int64_t k0 = kb * kBK;
      if (!no_a) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int t = i >> 2;
          cp_async16(a_s + swz(r8 + 16 * i, c), abase[t] + (av[t] ? (i & 3) * k16 + k0 : 0), av[t]);
        }
      }
      const uint32_t sc = smem_s + L::kScaleOff + s * kScaleFloats * 4;
      if (!no_b) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int j = r8 + 16 * i;
          const bool v = j < it.num_rows;
          cp_async16(b_s + swz(j, c), b_base + (v ? rows[j] + k0 + c * 16 : 0), v);
        }
        cp_async4(sc + (4 + pt) * 4, bssrc + kb, bv);  // token scale; 0 for rows past the tile
        if (pt < 4) cp_async4(sc + pt * 4, wssrc + kb, wsv);
      }
      cp_async_mbar_arrive(full0 + s * 8);
      st.at(2);
      pos.advance(stages);
      wrapped = wrapped || pos.stage == 0;
    }
  }
  cp_async_wait<0>();
  if (kDbg && dcta != nullptr && pt == 0) {
    const uint64_t g = globaltimer_ordered();
    dcta[4] = static_cast<uint32_t>(g), dcta[5] = static_cast<uint32_t>(g >> 32);
  }
}


/// The consumer warpgroups: per K block kblock (experts_fp8_prefill.cuh), with every consumer thread's
/// arrive on the stage's `empty` barrier inside it, before the last promotion; per item the epilogue
/// (bulk-copy row stores).
template <bool kGateUp, bool kDbg>
__device__ __forceinline__ void consumer(const Fp8GemmParams& p, int32_t tile0, int64_t num_items, uint32_t stages,
                                         uint8_t* smem, uint32_t smem_s) {
  using L = Layout<kGateUp>;
  const Who w;
  const float* scales = reinterpret_cast<const float*>(smem + L::kScaleOff);
  const uint32_t full0 = smem_s + L::kBarOff, empty0 = full0 + L::kStages * 8;
  float acc[2][kFrag], tmp[kFrag];
#pragma unroll
  for (int i = 0; i < kFrag; ++i) tmp[i] = 0.0f;
  RingPos pos;
  uint32_t* const dcta = kDbg ? dbg_cta<kGateUp>(p) : nullptr;
  const bool recorder = w.lane == 0 && w.warp_in_wg == 0;
  int64_t seen = 0, items = 0;  // kDbg: K blocks and items so far
  uint32_t* ditem = nullptr;
  for (int64_t item = blockIdx.x; item < num_items; item += gridDim.x) {
    Item it;
    if (!resolve<kGateUp>(p, tile0, item, it)) continue;
    const int64_t nk = it.K / kBK;
    if constexpr (kDbg) {
      ditem = dcta != nullptr && w.ct == 0 && items < kPfDbgItems
                  ? dcta + kPfDbgHeader + 3 * kPfDbgWin * kPfDbgStamps + 3 * items : nullptr;
      ++items;
      if (ditem != nullptr) ditem[0] = clock32();
    }
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = 0.0f;
    for (int64_t kb = 0; kb < nk; ++kb) {
      const uint32_t s = pos.stage;
      Stamps<kDbg> st;
      if constexpr (kDbg) {
        st.rec = dbg_rec(dcta, 1 + w.cwg, seen++, recorder);
        st.flags = p.debug_flags;
      }
      st.at(0);
      mbar_wait(full0 + s * 8, pos.phase);
      fence_proxy_async();  // cp.async wrote through the generic proxy; wgmma reads through the async one
      st.at(1);
      const uint32_t a_s = smem_s + s * kStageBytes;
      // Every consumer thread releases the stage (kEmptyArrivals), behind __syncwarp and a branch on an opaque true
      // value: the block boundary a lane-0 arrive would have. Without a branch there (a plain arrive, or one behind a
      // condition ptxas folds) ptxas 13.0 schedules the K block differently and its kernels spill 28 bytes
      // (ptxas -v), 10 % slower (bench/NOTES.md, 'gpufix batch 1'); with it the SASS instruction counts of all four
      // kernels equal those of a lane-0 arrive.
      auto release = [&] {
        __syncwarp();
        if (opaque_one()) mbar_arrive(empty0 + s * 8);
      };
      kblock<kDbg>(w, a_s, a_s + kABytes, scales + s * kScaleFloats, acc, tmp, release, st);
      pos.advance(stages);
    }
    if (kDbg && ditem != nullptr) ditem[1] = clock32();
    epilogue<kGateUp>(p, it, w, acc, smem);
    if (kDbg && ditem != nullptr) ditem[2] = clock32();
  }
  bulk_end(w);
  if (kDbg && dcta != nullptr && w.ct == 0) {
    const uint64_t g = globaltimer_ordered();
    dcta[2] = static_cast<uint32_t>(g), dcta[3] = static_cast<uint32_t>(g >> 32);
    dcta[6] = static_cast<uint32_t>(seen), dcta[7] = static_cast<uint32_t>(items), dcta[9] = clock32();
  }
}

template <bool kGateUp, bool kDbg = false>
__global__ void __launch_bounds__(kPfThreads, 1) fp8_prefill_kernel(Fp8GemmParams p) {
  using L = Layout<kGateUp>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  const uint32_t smem_s = raw_s + pad;
  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbar_init(smem_s + L::kBarOff + s * 8, 128);                  // full: every producer thread's copies
      mbar_init(smem_s + L::kBarOff + (L::kStages + s) * 8, kEmptyArrivals);  // empty: every consumer thread
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if constexpr (kDbg) {
    uint32_t* d = dbg_cta<kGateUp>(p);
    if (d != nullptr && threadIdx.x == 0) {
      const uint64_t g = globaltimer_ordered();
      const uint32_t sm = cuda::dev::smid();
      d[0] = static_cast<uint32_t>(g), d[1] = static_cast<uint32_t>(g >> 32), d[8] = clock32(), d[10] = sm;
    }
  }
  const int32_t tile0 = *p.num_small, tile1 = *p.num_tiles;
  // Ring depth: Fp8GemmParams::prefill_stages clamped to [2, kStages] (0 = kStages).
  const uint32_t stages = p.prefill_stages <= 0 ? L::kStages : min(max(p.prefill_stages, 2), L::kStages);
  const int64_t num_items = static_cast<int64_t>(max(tile1 - tile0, 0)) * p.max_weight_tiles;
  if (threadIdx.x < 128) {
    setmaxnreg_dec<64>();
    producer<kGateUp, kDbg>(p, tile0, num_items, stages, smem, smem_s);
  } else {
    setmaxnreg_inc<216>();
    consumer<kGateUp, kDbg>(p, tile0, num_items, stages, smem, smem_s);
  }
}

#else  // not sm_90a: the host never launches these (fp8_tensor_cores_available is false)

template <bool kGateUp, bool kDbg = false>
__global__ void __launch_bounds__(kPfThreads, 1) fp8_prefill_kernel(Fp8GemmParams) {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

#endif  // EPX_FP8_WGMMA

/// The library's kernel instance of the gate_up (kGateUp) or down GEMM.
template <bool kGateUp>
auto prefill_kernel() {
  return fp8_prefill_kernel<kGateUp>;
}

// set_fp8_prefill_debug's state: process-wide, for the bench only (null: the library's kernels).
uint32_t* g_debug_buffer = nullptr;
uint32_t g_debug_flags = 0;

/// The kernel of launch_fp8_prefill_gate_up / _down: the stamped instance while a debug buffer is set
/// (p gets the buffer and flags), else prefill_kernel().
template <bool kGateUp>
void launch_prefill(Fp8GemmParams p, int grid, cudaStream_t stream) {
#ifdef EPX_FP8_PREFILL_STAMPS
  if (g_debug_buffer != nullptr) {
    p.debug = g_debug_buffer;
    p.debug_flags = g_debug_flags;
    fp8_prefill_kernel<kGateUp, true><<<grid, kPfThreads, Layout<kGateUp>::kSmemBytes, stream>>>(p);
    return;
  }
#endif
  {
    prefill_kernel<kGateUp>()<<<grid, kPfThreads, Layout<kGateUp>::kSmemBytes, stream>>>(p);
  }
}

}  // namespace

bool fp8_prefill_stamps_built() {
#ifdef EPX_FP8_PREFILL_STAMPS
  return true;
#else
  return false;
#endif
}

void set_fp8_prefill_debug(uint32_t* buffer, uint32_t flags) {
  if (buffer != nullptr && !fp8_prefill_stamps_built())
    throw Unsupported("set_fp8_prefill_debug: this build lacks the stamped FP8 prefill kernels (configure with -DEPX_FP8_PREFILL_STAMPS=ON)");
  g_debug_buffer = buffer;
  g_debug_flags = buffer != nullptr ? flags : 0;
}

int fp8_prefill_smem_bytes() { return std::max(Layout<true>::kSmemBytes, Layout<false>::kSmemBytes); }

void fp8_prefill_set_smem_limits() {
  EPX_CUDA_CHECK(cudaFuncSetAttribute(prefill_kernel<true>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<true>::kSmemBytes));
  EPX_CUDA_CHECK(cudaFuncSetAttribute(prefill_kernel<false>(), cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<false>::kSmemBytes));
#ifdef EPX_FP8_PREFILL_STAMPS
  EPX_CUDA_CHECK(cudaFuncSetAttribute(fp8_prefill_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Layout<true>::kSmemBytes));
  EPX_CUDA_CHECK(cudaFuncSetAttribute(fp8_prefill_kernel<false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Layout<false>::kSmemBytes));
#endif
}

void launch_fp8_prefill_gate_up(const Fp8GemmParams& p, int grid, cudaStream_t stream) {
  launch_prefill<true>(p, grid, stream);
  cuda::check_launch("fp8_prefill_kernel (gate_up)");
}

void launch_fp8_prefill_down(const Fp8GemmParams& p, int grid, cudaStream_t stream) {
  launch_prefill<false>(p, grid, stream);
  cuda::check_launch("fp8_prefill_kernel (down)");
}

}  // namespace epx::experts_cuda

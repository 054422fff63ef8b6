// experts/experts_fp8_prefill_tma_cuda.cu: a variant of the FP8 prefill grouped GEMMs of
// experts_fp8_prefill_cuda.cu (same tiles, same epilogue, experts_fp8_prefill.cuh; bit-identical
// output) whose operands come by TMA. The default (Config::experts_fp8_prefill 1) runs every
// GEMM here: the lean consumer that loads the next K block's operands under the last promotion
// (lean_item_prefetch; producer 40 / consumers 232 registers), the Flat gate_up's token rows permuted into
// row-space order first (permute_x_kernel below) so that every GEMM's token rows are contiguous, and 2-CTA
// clusters whose CTAs take the two 128-token tiles of one expert at the same weight tile and share it (each TMA
// multicasts one 128-row half into both; Fp8GemmParams::prefill_cluster, kCluster below): the pair reads each
// weight tile from DRAM once, L2 is less busy and the SM clock runs higher at the same tensor-pipe activity, the
// fastest form measured (bench/NOTES.md, 'the weight tile shared by a 2-CTA cluster'; the forms it was measured
// against: 'Variants removed from the product'). Where no 2-CTA cluster fits, the same consumer runs as one CTA.
// A CTA releases its peer's stage with a CTA-scope arrive (mbar_arrive_cluster): a cluster-scope release
// (`mbarrier.arrive.release.cluster`) is a fence on the consumers' chain in every K block, ~45 % slower.
//
// One CTA per SM, 384 threads, warp-specialized:
//   warpgroup 0 (producer, 64 registers): streams each K block's operands into a kStages-deep ring
//     of 128-byte-swizzled K-major tiles: thread 0 loads the 256 x 128-byte weight tile as two
//     128-row boxes of the expert's tensor map (Fp8GemmParams::w_maps; cp.async.bulk.tensor, 128B
//     swizzle = the layout smem_desc reads) and, where the tile's token rows are contiguous
//     (ExpertMajor gate_up; down's hq), the 128 x 128-byte token tile from a per-launch map of x /
//     hq, all completing on the stage's `full` mbarrier (expect_tx); the 128 threads still
//     cp.async the token scales (strided: [rows, K/128]) and the Flat gate_up token rows (a
//     gather: 8 lanes per 128-byte row; with Fp8GemmParams::x_perm the rows permuted into
//     row-space order beforehand come as one TMA box like ExpertMajor's) and arrive with
//     cp.async.mbarrier.arrive, so `full` completes when the TMA bytes and all 128 threads' copies
//     landed. The weight maps are required (the launches check; without them, when the driver cannot
//     encode them, upload leaves w_maps null and apply runs the cp.async kernels of
//     experts_fp8_prefill_cuda.cu instead);
//   warpgroups 1, 2 (consumers, 232 registers; the producer then gets 40): experts_fp8_prefill.cuh's
//     lean_item_prefetch and epilogue (tokens in wgmma's A; the same bits as the cp.async kernels);
//     the producer runs up to kStages blocks ahead, across work items, so the next item's first stages
//     load under the current epilogue.
// Work items: (128-row tile, weight tile) pairs over the tile list's prefill section, walked by a
// persistent grid in tile-major order (all weight tiles of one row tile, then the expert's next row
// tile: the weight tile's second reader hits L2).
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder comes through the runtime's driver entry point)
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
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

// TMA boxes, mbarrier transaction counts, cluster barriers: cuda/tma.cuh (through experts_fp8_wgmma.cuh).

/// Work item q (row tile q / max_weight_tiles, weight tile q % max_weight_tiles) of the prefill
/// section, or nk == 0 when this CTA-uniform item has nothing to do (resolve_tile).
struct Work {
  Item it{};
  int32_t expert = -1;
  int64_t nk = 0;      // K blocks this step takes through the ring
  int64_t my_nk = 0;   // of which this CTA computes `it` (the first my_nk; the one-CTA kernels: nk)
  bool mcast = false;  // 2-CTA clusters: the weight tile is shared with the other CTA (multicast halves)
};

template <bool kGateUp>
__device__ __forceinline__ Work work_at(const Fp8GemmParams& p, int32_t tile0, int64_t q) {
  Work w;
  if (resolve_tile<kGateUp>(p, tile0 + static_cast<int32_t>(q / p.max_weight_tiles), static_cast<int>(q % p.max_weight_tiles), w.it,
                            w.expert))
    w.nk = w.my_nk = w.it.K / kBK;
  return w;
}

/// Step q of a 2-CTA cluster (Fp8GemmParams::prefill_cluster): tile-list entries 2 (q / max_weight_tiles) + {0, 1} of
/// the prefill section (cluster rank 0, 1) at weight tile q % max_weight_tiles. Both CTAs take nk = the larger of
/// their K block counts through their rings in lockstep (a CTA without an item, or with fewer K blocks, runs empty
/// stages: the section's last tile, a weight tile past one expert's width, two experts of different I in down); the
/// weight tile is multicast where both tiles are the same expert's. Both CTAs compute the same nk and mcast. The
/// schedule kernels order the section for these pairs (ScheduleParams::pair_big, order_big_tiles_for_pairs in
/// experts_schedule_kernels.cuh): each expert's tiles come in pairs, and only the last tiles of two odd-count
/// experts share a pair (each expert's tiles still in one stretch of the walk); in plain expert order an odd-count
/// expert would shift every later pair onto two experts until the next odd one.
template <bool kGateUp>
__device__ __forceinline__ Work work_pair(const Fp8GemmParams& p, int32_t tile0, int32_t num_tiles, int64_t q, uint32_t rank) {
  Work w;
  const int wt = static_cast<int>(q % p.max_weight_tiles);
  const int64_t t = 2 * (q / p.max_weight_tiles) + rank, u = t ^ 1;
  const bool mine = t < num_tiles && resolve_tile<kGateUp>(p, tile0 + static_cast<int32_t>(t), wt, w.it, w.expert);
  Item o;
  int32_t eo = -1;
  const bool theirs = u < num_tiles && resolve_tile<kGateUp>(p, tile0 + static_cast<int32_t>(u), wt, o, eo);
  w.my_nk = mine ? w.it.K / kBK : 0;
  w.nk = max(w.my_nk, theirs ? o.K / kBK : int64_t{0});
  w.mcast = mine && theirs && eo == w.expert && p.prefill_cluster == 1;
  if (!mine) w.it.num_rows = 0;  // (resolve_tile may have filled part of it)
  return w;
}

/// The walk of the prefill section by this CTA: steps q0, q0 + q_step, .. < num_steps.
struct Walk {
  int32_t tile0, num_tiles;
  int64_t q0, q_step, num_steps;
  uint32_t rank;
};

template <bool kGateUp, bool kCluster>
__device__ __forceinline__ Work step_at(const Fp8GemmParams& p, const Walk& wk, int64_t q) {
  if constexpr (kCluster) return work_pair<kGateUp>(p, wk.tile0, wk.num_tiles, q, wk.rank);
  else return work_at<kGateUp>(p, wk.tile0, q);
}

/// The weight tile: two 128-row TMA boxes of the expert's map (thread 0). Token loads by cp.async are
/// coalesced: thread pt copies 16-byte chunk pt % 8 of rows pt / 8 + 16 i, so 8 consecutive lanes read
/// one row's 128 contiguous bytes (a thread per row would split every 32-byte sector between two
/// instructions: twice the L2 -> SM traffic, measured slower than the 64-row kernels).
/// tma_b: the token tile by one TMA box of `bmap` at the tile's first row (contiguous rows: ExpertMajor
/// gate_up, down's hq, the Flat gate_up's x_perm), else the gather / copy by cp.async; the token scales
/// come by cp.async either way (through p.gather for the Flat gate_up).
/// kCluster (2-CTA clusters, TMA weights only): a stage is refilled when the consumers of both CTAs released it (its
/// `empty` counts both); on a multicast step thread 0 loads its rank's 128-row half of the weight tile into both CTAs
/// (the other half comes from the other CTA's producer and completes on this CTA's `full` as well: the same 48 KiB of
/// expected bytes either way); past this CTA's K blocks (Work::my_nk) a stage is filled with nothing, 129 arrivals.
template <bool kGateUp, bool kCluster>
__device__ __forceinline__ void producer(const Fp8GemmParams& p, const CUtensorMap* bmap, bool tma_b, const Walk& walk, uint32_t stages,
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
  const uint32_t tx_bytes = kABytes + (tma_b ? kBBytes : 0);
  RingPos pos;
  bool wrapped = false;  // every stage was filled once (from then on, wait for its release)
  for (int64_t q = walk.q0; q < walk.num_steps; q += walk.q_step) {
    const Work w = step_at<kGateUp, kCluster>(p, walk, q);
    if (w.nk == 0) continue;
    const Item& it = w.it;
    // The weight tile's two 128-row boxes: gate_up gate rows col0.. and up rows I + col0..;
    // down output rows col0.. and col0 + 128.. (past H: zero-filled, as sub_valid's zeros).
    const CUtensorMap* amap = nullptr;  // (a cluster step without this CTA's item has no expert)
    if (w.my_nk > 0) amap = static_cast<const CUtensorMap*>(p.w_maps) + 2 * w.expert + (kGateUp ? 0 : 1);
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
      if (wrapped) {  // the consumers released the previous use (kCluster: those of both CTAs; the wait's default acquire.cta)
        mbar_wait(empty0 + s * 8, pos.phase ^ 1u);
      }
      const uint32_t a_s = smem_s + s * kStageBytes, b_s = a_s + kABytes;
      const int64_t k0 = kb * kBK;
      if constexpr (kCluster) {
        if (kb >= w.my_nk) {  // lockstep: an empty stage (no bytes), its 129 arrivals as usual
          if (pt == 0) mbar_arrive(full0 + s * 8);
          cp_async_mbar_arrive(full0 + s * 8);
          pos.advance(stages);
          wrapped = wrapped || pos.stage == 0;
          continue;
        }
      }
      if (pt == 0) {
        const uint32_t full = full0 + s * 8;
        mbar_arrive_expect_tx(full, tx_bytes);  // the barrier's 129th arrival; TMA bytes complete it
        if (kCluster && w.mcast) {  // this rank's half into both CTAs; the other CTA's half lands here too
          tma_load_2d_multicast(a_s + walk.rank * (kTmaBox * kBK), amap, static_cast<int32_t>(k0), walk.rank != 0 ? ar1 : ar0, full, 3);
        } else {
          tma_load_2d(a_s, amap, static_cast<int32_t>(k0), ar0, full);
          tma_load_2d(a_s + kTmaBox * kBK, amap, static_cast<int32_t>(k0), ar1, full);
        }
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

/// The consumer warpgroups (experts_fp8_prefill.cuh: lean_item_prefetch, epilogue): as the cp.async kernels' consumer,
/// the scales read before the wgmmas, the stage released before the last promotion, wgmma's A (tokens) in
/// registers, bulk-copy row stores; the next K block's operands loaded under the second promotion.
/// The weight tiles come by TMA (async proxy), the only operand wgmma reads from shared memory: no proxy
/// fence, however the token tile came (every consumer here reads it with ldmatrix, a generic-proxy read
/// like cp.async's writes, the Flat gate_up's cp.async gather included).
/// kCluster: a stage is released to both CTAs' producers (each thread arrives on its own
/// CTA's `empty`, lane 0 of each warp after __syncwarp also on the other CTA's), and the steps past this CTA's K
/// blocks (Work::my_nk) are waited for and released without wgmmas (before the epilogue, so the other CTA's ring does
/// not wait for it).
template <bool kGateUp, bool kCluster>
__device__ __forceinline__ void consumer(const Fp8GemmParams& p, const Walk& walk, uint32_t stages, uint8_t* smem, uint32_t smem_s) {
  using L = Layout<kGateUp>;
  const Who w;
  const LeanOffsets lo(w);
  const uint32_t full0 = smem_s + L::kBarOff, empty0 = full0 + L::kStages * 8;
  float acc[2][kFrag], tmp[kFrag];
#pragma unroll
  for (int i = 0; i < kFrag; ++i) tmp[i] = 0.0f;
  RingPos pos;
  auto release = [&](uint32_t s) {
    mbar_arrive(empty0 + s * 8);  // every consumer thread releases the stage (kEmptyArrivals)
    if constexpr (kCluster) {
      __syncwarp();
      if (w.lane == 0) mbar_arrive_cluster(empty0 + s * 8, walk.rank ^ 1u);
    }
  };
  for (int64_t q = walk.q0; q < walk.num_steps; q += walk.q_step) {
    const Work wk = step_at<kGateUp, kCluster>(p, walk, q);
    if (wk.nk == 0) continue;
    const Item& it = wk.it;
    if constexpr (kCluster) {
      if (wk.my_nk == 0) {  // the other CTA's item only: its stages, released unread
        for (int64_t kb = 0; kb < wk.nk; ++kb) {
          mbar_wait(full0 + pos.stage * 8, pos.phase);
          release(pos.stage);
          pos.advance(stages);
        }
        continue;
      }
    }
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int i = 0; i < kFrag; ++i) acc[sub][i] = 0.0f;
    // the next K block's operands loaded under the second promotion; no proxy fence (above)
    lean_item_prefetch(lo, wk.my_nk, pos, stages, smem_s, smem_s + L::kScaleOff, full0, smem_s + L::kDoneOff, acc, tmp,
                       [] {}, release);
    if constexpr (kCluster) {
      for (int64_t kb = wk.my_nk; kb < wk.nk; ++kb) {  // the other CTA's longer item: empty stages
        mbar_wait(full0 + pos.stage * 8, pos.phase);
        release(pos.stage);
        pos.advance(stages);
      }
    }
    epilogue<kGateUp>(p, it, w, acc, smem);
  }
  bulk_end(w);
}

/// The TMA prefill kernel of the gate_up (kGateUp) or down GEMM; kCluster: launched as 2-CTA clusters
/// (Fp8GemmParams::prefill_cluster), else one CTA per work item.
template <bool kGateUp, bool kCluster>
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
      // empty: every consumer thread (kCluster: + every consumer warp of the other CTA)
      mbar_init(smem_s + L::kBarOff + (L::kStages + s) * 8, kEmptyArrivals + (kCluster ? kEmptyArrivals / 32 : 0));
    }
    mbar_init(smem_s + L::kDoneOff, 1);  // done: completed once here (lean_item_prefetch)
    mbar_arrive(smem_s + L::kDoneOff);
    fence_mbarrier_init();
  }
  if constexpr (kCluster) cluster_sync_all();  // both CTAs' barriers exist before any remote arrival or multicast
  else __syncthreads();
  const int32_t tile0 = *p.num_small, tile1 = *p.num_tiles;
  // Ring depth: Fp8GemmParams::prefill_stages clamped to [2, kStages] (0 = kStages).
  const uint32_t stages = p.prefill_stages <= 0 ? L::kStages : min(max(p.prefill_stages, 2), L::kStages);
  Walk walk{};
  walk.tile0 = tile0;
  walk.num_tiles = max(tile1 - tile0, 0);
  if constexpr (kCluster) {  // cluster blockIdx.x / 2 of gridDim.x / 2 (cluster dims 2, 1, 1), steps over tile pairs
    walk.rank = cluster_ctarank();
    walk.q0 = blockIdx.x / 2;
    walk.q_step = gridDim.x / 2;
    walk.num_steps = static_cast<int64_t>((walk.num_tiles + 1) / 2) * p.max_weight_tiles;
  } else {
    walk.rank = 0;
    walk.q0 = blockIdx.x;
    walk.q_step = gridDim.x;
    walk.num_steps = static_cast<int64_t>(walk.num_tiles) * p.max_weight_tiles;
  }
  // Registers: 384 x 168 at launch = 128 x 40 + 256 x 232.
  if (threadIdx.x < 128) {
    setmaxnreg_dec<40>();
    producer<kGateUp, kCluster>(p, &bmap, tma_b != 0, walk, stages, smem, smem_s);
  } else {
    setmaxnreg_inc<232>();
    consumer<kGateUp, kCluster>(p, walk, stages, smem, smem_s);
  }
  // kCluster: neither CTA leaves while the other may still multicast into it or arrive on its barriers
  if constexpr (kCluster) cluster_sync_all();
}

#else  // not sm_90a: the host never launches these (fp8_tensor_cores_available is false)

template <bool kGateUp, bool kCluster>
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

namespace {
bool g_refuse_weight_maps = false;  // set_fp8_prefill_refuse_weight_maps (tests only)
}  // namespace

void set_fp8_prefill_refuse_weight_maps(bool refuse) { g_refuse_weight_maps = refuse; }

bool fp8_prefill_weight_maps(const ExpertDesc& e, int64_t hidden, Fp8TmaMap& w13_map, Fp8TmaMap& w2_map) {
  if (g_refuse_weight_maps) return false;
  const auto inter = static_cast<uint64_t>(e.intermediate), h = static_cast<uint64_t>(hidden);
  CUtensorMap m13{}, m2{};
  if (!encode_fp8_map(m13, e.w13, h, 2 * inter, h) || !encode_fp8_map(m2, e.w2, inter, h, inter)) return false;
  std::memcpy(w13_map.bytes, &m13, sizeof(m13));
  std::memcpy(w2_map.bytes, &m2, sizeof(m2));
  return true;
}

namespace {

/// The one-CTA kernel of the gate_up (kGateUp) or down GEMM, where no 2-CTA cluster fits.
template <bool kGateUp>
auto tma_kernel() {
  return fp8_prefill_tma_kernel<kGateUp, false>;
}

/// The 2-CTA cluster kernel of the gate_up (kGateUp) or down GEMM (the same consumer,
/// Fp8GemmParams::prefill_cluster).
template <bool kGateUp>
auto cluster_kernel() {
  return fp8_prefill_tma_kernel<kGateUp, true>;
}

/// The launch configuration of cluster_kernel<kGateUp>: `grid` CTAs (even) in clusters of 2 along x, kPfThreads
/// threads, Layout<kGateUp>::kSmemBytes of dynamic shared memory, on `stream`. The cluster dimension goes in
/// `attr`, which the returned config points to (it must outlive the config's use).
template <bool kGateUp>
cudaLaunchConfig_t cluster_config(unsigned grid, cudaStream_t stream, cudaLaunchAttribute& attr) {
  attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kPfThreads);
  cfg.dynamicSmemBytes = Layout<kGateUp>::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

/// Raises the dynamic shared-memory limit of every gate_up (kGateUp) or down TMA kernel (the one-CTA and the
/// cluster kernel) to Layout<kGateUp>::kSmemBytes on the current device.
template <bool kGateUp>
void raise_smem_limits() {
  for (auto* k : {tma_kernel<kGateUp>(), cluster_kernel<kGateUp>()})
    EPX_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout<kGateUp>::kSmemBytes));
}

/// Device ordinals with a cached cluster count (g_max_clusters); a larger ordinal is an error.
constexpr int kMaxDevices = 64;

/// Per device ordinal d: the most 2-CTA clusters of the cluster kernel resident at once on d ([d][0] down,
/// [d][1] gate_up), stored as count + 1 (0: not measured on d yet). Filled by max_clusters on first use on d.
std::atomic<int> g_max_clusters[kMaxDevices][2];
std::mutex g_max_clusters_mu;

/// The most 2-CTA clusters of cluster_kernel<kGateUp> resident at once on the current device (0: none fit, or
/// the query failed; the launch then takes the one-CTA kernel). The first call for a device raises the kernels'
/// shared-memory limits there and asks cudaOccupancyMaxActiveClusters, once (under a mutex); later calls read the
/// cached figure. Throws InvalidArgument for a device ordinal >= kMaxDevices.
template <bool kGateUp>
int max_clusters() {
  int device = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&device));
  require_arg("fp8_prefill_tma max_clusters", "current device", device, device >= 0 && device < kMaxDevices,
              "the cached 2-CTA cluster counts cover device ordinals 0..63");
  std::atomic<int>& slot = g_max_clusters[device][kGateUp ? 1 : 0];
  if (const int v = slot.load(std::memory_order_acquire); v > 0) return v - 1;
  const std::lock_guard<std::mutex> lock(g_max_clusters_mu);
  if (const int v = slot.load(std::memory_order_relaxed); v > 0) return v - 1;
  raise_smem_limits<kGateUp>();
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config<kGateUp>(2, nullptr, attr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, cluster_kernel<kGateUp>(), &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  slot.store(n + 1, std::memory_order_release);
  return n;
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
  const int maxc = p.prefill_cluster != 0 && p.prefill_fast == 5 && p.w_maps != nullptr ? max_clusters<kGateUp>() : 0;
  if (maxc > 0) {
    // 2-CTA clusters: as many as fit at once, each walks tile pairs
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config<kGateUp>(static_cast<unsigned>(2 * std::min((grid + 1) / 2, maxc)), stream, attr);
    EPX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, cluster_kernel<kGateUp>(), p, bmap, tb ? 1 : 0));
  } else {
    tma_kernel<kGateUp>()<<<grid, kPfThreads, Layout<kGateUp>::kSmemBytes, stream>>>(p, bmap, tb ? 1 : 0);
  }
  cuda::check_launch(what);
}

}  // namespace

int fp8_prefill_tma_smem_bytes() { return std::max(Layout<true>::kSmemBytes, Layout<false>::kSmemBytes); }

int fp8_prefill_tma_max_clusters(bool gate_up) { return gate_up ? max_clusters<true>() : max_clusters<false>(); }

void fp8_prefill_tma_set_smem_limits() {
  raise_smem_limits<true>();
  raise_smem_limits<false>();
  max_clusters<true>();  // measured here, outside any graph capture, once per device
  max_clusters<false>();
}

// The token tile's map is built per launch (x, x_perm and hq change between calls; a captured graph
// keeps the parameter by value, like the pointers in p): x [row space, H] for ExpertMajor gate_up,
// x_perm [row space, H] (row stride x_perm_stride) for the Flat gate_up when permute_x_kernel copied
// its rows there, hq [row space, h_stride] for down; otherwise the
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

/// The Flat gate_up's token rows in row-space order: for every tile of
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

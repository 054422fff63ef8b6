// experts/experts_schedule_kernels.cuh: the schedule step of the reference grouped expert MLP (step 1 of the
// pipeline in experts_cuda_kernels.cuh, whose ScheduleParams and ErrorRecord it fills): one CTA reads the
// per-expert row counts on the device (ExpertMajor / Contiguous: recv_count or expert_offsets; Flat: a
// histogram of topk_idx, then a scatter that groups the (row, k) pairs by expert) and writes the tile list,
// with the prefill section ordered for 2-CTA pairs (order_big_tiles_for_pairs). Included by experts_cuda.cu only.
#pragma once

#include <cstdint>

#include "experts/experts_cuda_kernels.cuh"

namespace epx::experts_cuda {

// ---- schedule ---------------------------------------------------------------------------------

/// Records the first bad input of this launch (one CTA) unless an earlier one is still unread.
__device__ __forceinline__ void report_error(int* claimed, ErrorRecord* rec, int32_t code, int32_t row, int32_t col,
                                             int64_t value) {
  if (atomicCAS(claimed, 0, 1) != 0) return;
  volatile ErrorRecord* r = rec;
  if (r->code != kNoError) return;
  r->row = row;
  r->col = col;
  r->value = value;
  __threadfence_system();
  r->code = code;
}

/// Exclusive prefix sums of a[0, n) and b[0, n) in place (shared memory), with the totals; all
/// kScheduleThreads threads call it. Each thread scans a contiguous chunk; the chunk sums are
/// scanned with warp shuffles, then across the 32 warps. b (with total_b) may be null: a alone.
__device__ void block_exclusive_scan2(int32_t* a, int32_t* b, int n, int32_t* total_a, int32_t* total_b) {
  static_assert(kScheduleThreads == 32 * 32, "one warp scans the 32 warp sums");
  __shared__ int2 warp_sums[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int per = (n + kScheduleThreads - 1) / kScheduleThreads;
  const int begin = min(n, tid * per), end = min(n, begin + per);
  int32_t sa = 0, sb = 0;
  for (int i = begin; i < end; ++i) {
    const int32_t va = a[i], vb = b != nullptr ? b[i] : 0;
    a[i] = sa;
    if (b != nullptr) b[i] = sb;
    sa += va;
    sb += vb;
  }
  int32_t ia = sa, ib = sb;  // inclusive scan over the warp
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t ua = __shfl_up_sync(0xffffffffu, ia, o), ub = __shfl_up_sync(0xffffffffu, ib, o);
    if (lane >= o) ia += ua, ib += ub;
  }
  if (lane == 31) warp_sums[warp] = make_int2(ia, ib);
  __syncthreads();
  if (warp == 0) {
    int2 w = warp_sums[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t ux = __shfl_up_sync(0xffffffffu, w.x, o), uy = __shfl_up_sync(0xffffffffu, w.y, o);
      if (lane >= o) w.x += ux, w.y += uy;
    }
    warp_sums[lane] = w;
  }
  __syncthreads();
  const int2 base = warp == 0 ? make_int2(0, 0) : warp_sums[warp - 1];
  const int32_t ea = base.x + ia - sa, eb = base.y + ib - sb;
  for (int i = begin; i < end; ++i) {
    a[i] += ea;
    if (b != nullptr) b[i] += eb;
  }
  if (tid == 0) {
    *total_a = warp_sums[31].x;
    if (total_b != nullptr) *total_b = warp_sums[31].y;
  }
  __syncthreads();
}

/// Shared memory of the schedule kernels: 5 int arrays of L.
constexpr int64_t schedule_smem_bytes(int num_local) { return 5LL * 4 * num_local; }

/// The positions of the prefill section's tiles for 2-CTA pairs (ScheduleParams::pair_big); all kScheduleThreads
/// threads call it. nb(l): expert l's tiles in the section (0 for an expert outside it). The cluster kernels pair
/// section entries 2 j, 2 j + 1, so the order is built from blocks that start at even positions:
///   - an expert with an even tile count: its tiles in row order (all its pairs are its own);
///   - the odd-count experts, coupled in expert order (the 1st with the 2nd, the 3rd with the 4th, ...): the first
///     one's tiles in row order, its last tile (the partial one) at an even position, then at once the second one's
///     last tile (the pair of two experts: no multicast), then the second one's other tiles in row order; so each
///     expert's tiles stay together and each expert's weight tiles are read in one stretch of the walk;
///   - an odd-count expert left without a partner (an odd number of them): its tiles last, the final one alone.
/// The blocks come in expert order, each coupled second expert moved up behind its first. Out: pos[l] = the section
/// position of expert l's first block entry; lead[l] = 1 where that entry is the expert's last tile (its other tiles
/// follow in row order), else 0; *total = sum of nb. Scratch: pos and lead only ([L] each, shared memory); five
/// barriers and two block scans (a microsecond or two on the one-CTA schedule kernel).
template <class Nb>
__device__ void order_big_tiles_for_pairs(const Nb& nb, int L, int32_t* pos, int32_t* lead, int32_t* total) {
  __shared__ int32_t total_odd, total_blocks;
  const int tid = threadIdx.x;
  for (int l = tid; l < L; l += kScheduleThreads) lead[l] = nb(l) & 1;
  __syncthreads();
  block_exclusive_scan2(lead, nullptr, L, &total_odd, nullptr);  // lead[l]: rank of odd expert l among the odd ones
  for (int l = tid; l < L; l += kScheduleThreads)
    if (nb(l) & 1) pos[lead[l]] = l;  // pos[r]: the odd expert of rank r
  __syncthreads();
  for (int l = tid; l < L; l += kScheduleThreads) {  // lead[l]: the partner (odd experts; -1: none), -2 (even count)
    const int32_t r = lead[l];
    lead[l] = (nb(l) & 1) == 0 ? -2 : (r ^ 1) < total_odd ? pos[r ^ 1] : -1;
  }
  __syncthreads();
  for (int l = tid; l < L; l += kScheduleThreads) {  // block sizes: a couple's block is its first expert's
    const int32_t pa = lead[l];
    pos[l] = pa == -2 ? nb(l) : pa > l ? nb(l) + nb(pa) : 0;
  }
  __syncthreads();
  block_exclusive_scan2(pos, nullptr, L, &total_blocks, nullptr);
  for (int l = tid; l < L; l += kScheduleThreads) {
    const int32_t pa = lead[l];
    if (pa >= 0 && pa < l) pos[l] = pos[pa] + nb(pa);  // the couple's second expert: behind the first one's tiles
    else if (pa == -1) pos[l] = total_blocks, *total = total_blocks + nb(l);  // the odd one out: last
    lead[l] = pa >= 0 && pa < l ? 1 : 0;
  }
  if (tid == 0 && (total_odd & 1) == 0) *total = total_blocks;
  __syncthreads();
}

/// Section position (from the first block entry) of tile j (row order, of n) of an expert whose block leads with its
/// last tile (order_big_tiles_for_pairs' lead) or not.
__device__ __forceinline__ int32_t big_tile_slot(int32_t j, int32_t n, bool lead) { return !lead ? j : j == n - 1 ? 0 : j + 1; }

/// ExpertMajor (p.expert_offsets null): tiles over rows [0, clamp(recv_count[l], 0, cap)) of every
/// expert, row l * cap + j. Contiguous: tiles over every expert's rows of ExpertsInput::expert_offsets
/// ([L]: [expert_offsets[l - 1] (0 for l = 0), expert_offsets[l]); [L + 1]: [expert_offsets[l],
/// expert_offsets[l + 1])); offsets that decrease or leave [0, num_rows] are reported and no tile is
/// made (the apply writes nothing: a clamped reading could give two experts the same rows).
__global__ void __launch_bounds__(kScheduleThreads) schedule_expert_major_kernel(ScheduleParams p) {
  extern __shared__ int32_t smem[];
  int32_t* counts = smem;                    // [L] rows
  int32_t* big_off = counts + p.num_local;   // [L] big tiles per expert -> first big tile (big_rows > 0)
  int32_t* tile_off = big_off + p.num_local; // [L] tiles per expert -> first tile
  int32_t* first = tile_off + p.num_local;   // [L] Contiguous: the expert's first row
  int32_t* lead = first + p.num_local;       // [L] pair_big: order_big_tiles_for_pairs' lead
  __shared__ int claimed, bad;
  __shared__ int32_t total_big, total_tiles, want_big;
  const int tid = threadIdx.x, L = p.num_local;
  if (tid == 0) claimed = 0, bad = 0, want_big = 0;
  __syncthreads();
  for (int l = tid; l < L; l += kScheduleThreads) {
    int64_t c;
    if (p.expert_offsets != nullptr) {
      const int lead = p.offsets_lead ? 1 : 0;
      const int64_t end = p.expert_offsets[l + lead], begin = lead || l > 0 ? p.expert_offsets[l + lead - 1] : 0;
      if (begin < 0 || begin > p.num_rows) {  // (entry l + lead - 1: only the [L + 1] form's first start is not another's end)
        report_error(&claimed, p.error, kBadExpertOffsets, l + lead - 1, 0, begin);
        bad = 1;
      } else if (end < 0 || end > p.num_rows || end < begin) {
        report_error(&claimed, p.error, kBadExpertOffsets, l + lead, 0, end);
        bad = 1;
      }
      c = end - begin;
      first[l] = static_cast<int32_t>(begin);
    } else {
      c = p.recv_count[l];
      if (c < 0 || c > p.cap) {
        report_error(&claimed, p.error, kBadRecvCount, l, 0, c);
        c = c < 0 ? 0 : p.cap;
      }
    }
    counts[l] = static_cast<int32_t>(c);
    if (p.big_rows > 0 && c > kTileRows) atomicAdd(&want_big, static_cast<int32_t>((c + p.big_rows - 1) / p.big_rows));
  }
  __syncthreads();
  if (bad) {
    if (tid == 0) p.num_tiles[0] = 0, p.num_tiles[1] = 0;
    return;
  }
  const int32_t big_rows = want_big >= p.big_min_tiles ? p.big_rows : 0;  // the section pays off (ScheduleParams)
  for (int l = tid; l < L; l += kScheduleThreads) {
    const int32_t c = counts[l];
    const bool big = big_rows > 0 && c > kTileRows;
    big_off[l] = big ? (c + big_rows - 1) / big_rows : 0;
    tile_off[l] = big ? 0 : (c + kTileRows - 1) / kTileRows;
  }
  __syncthreads();
  block_exclusive_scan2(big_off, tile_off, L, &total_big, &total_tiles);
  const bool pairs = p.pair_big && big_rows > 0;
  if (pairs)  // big_off: the blocks' first positions instead (the same tiles, placed for 2-CTA pairs)
    order_big_tiles_for_pairs(
        [&](int l) { return big_rows > 0 && counts[l] > kTileRows ? (counts[l] + big_rows - 1) / big_rows : 0; }, L, big_off, lead,
        &total_big);
  for (int l = tid; l < L; l += kScheduleThreads) {
    const int32_t c = counts[l];
    const bool big = big_rows > 0 && c > kTileRows;
    const int32_t step = big ? big_rows : kTileRows, n = (c + step - 1) / step;
    const bool lead_last = pairs && big && lead[l] != 0;
    for (int32_t j = 0; j < n; ++j)
      p.tiles[big ? total_tiles + big_off[l] + big_tile_slot(j, n, lead_last) : tile_off[l] + j] =
          Tile{l, static_cast<int32_t>((p.expert_offsets != nullptr ? first[l] : l * p.cap) + j * step), min(step, c - j * step), 0};
  }
  if (tid == 0) p.num_tiles[0] = total_tiles + total_big, p.num_tiles[1] = total_tiles;
}

/// Flat: groups the valid (n, k) pairs by expert (order inside an expert is arbitrary: results do
/// not depend on it), fills pair_row/slot, and tiles every expert's group.
__global__ void __launch_bounds__(kScheduleThreads) schedule_flat_kernel(ScheduleParams p) {
  extern __shared__ int32_t smem[];
  int32_t* counts = smem;                      // [L] pairs per expert, then fill cursor
  int32_t* row_off = counts + p.num_local;     // [L] first grouped position
  int32_t* tile_off = row_off + p.num_local;   // [L] first tile
  int32_t* fill = tile_off + p.num_local;      // [L]
  int32_t* lead = fill + p.num_local;          // [L] pair_big: order_big_tiles_for_pairs' lead
  __shared__ int claimed;
  __shared__ int32_t total_rows, total_tiles;
  const int tid = threadIdx.x, L = p.num_local;
  if (tid == 0) claimed = 0;
  for (int l = tid; l < L; l += kScheduleThreads) counts[l] = 0, fill[l] = 0;
  __syncthreads();
  auto expert_of = [&](int64_t i) -> int64_t {
    return p.idx_int64 ? static_cast<const int64_t*>(p.topk_idx)[i] : static_cast<const int32_t*>(p.topk_idx)[i];
  };
  for (int64_t i = tid; i < p.num_pairs; i += kScheduleThreads) {
    const int64_t e = expert_of(i);
    if (e >= 0 && e < L) atomicAdd(&counts[e], 1);
    else if (e != -1) report_error(&claimed, p.error, kBadTopkIdx, static_cast<int32_t>(i / p.top_k),
                                   static_cast<int32_t>(i % p.top_k), e);
  }
  __shared__ int32_t total_big, total_rows2, want_big;
  if (tid == 0) want_big = 0;
  __syncthreads();
  for (int l = tid; l < L; l += kScheduleThreads)
    if (p.big_rows > 0 && counts[l] > kTileRows) atomicAdd(&want_big, (counts[l] + p.big_rows - 1) / p.big_rows);
  __syncthreads();
  const int32_t big_rows = want_big >= p.big_min_tiles ? p.big_rows : 0;  // the section pays off (ScheduleParams)
  for (int l = tid; l < L; l += kScheduleThreads) {
    const bool big = big_rows > 0 && counts[l] > kTileRows;
    row_off[l] = counts[l];
    tile_off[l] = big ? 0 : (counts[l] + kTileRows - 1) / kTileRows;
    fill[l] = big ? (counts[l] + big_rows - 1) / big_rows : 0;  // big tiles (big_rows > 0)
  }
  __syncthreads();
  block_exclusive_scan2(row_off, tile_off, L, &total_rows, &total_tiles);
  // The big tiles' offsets, scanned in `fill` (reset to the pair cursor below); `counts` is scanned
  // alongside (it becomes row_off; the counts are recovered from row_off's differences).
  block_exclusive_scan2(fill, counts, L, &total_big, &total_rows2);
  auto count_of = [&](int l) { return (l + 1 < L ? row_off[l + 1] : total_rows) - row_off[l]; };
  const bool pairs = p.pair_big && big_rows > 0;
  if (pairs)  // fill: the blocks' first positions instead (the same tiles, placed for 2-CTA pairs)
    order_big_tiles_for_pairs(
        [&](int l) {
          const int32_t c = count_of(l);
          return c > kTileRows ? (c + big_rows - 1) / big_rows : 0;
        },
        L, fill, lead, &total_big);
  for (int l = tid; l < L; l += kScheduleThreads) {
    const int32_t c = count_of(l);
    const bool big = big_rows > 0 && c > kTileRows;
    const int32_t step = big ? big_rows : kTileRows, n = (c + step - 1) / step;
    const bool lead_last = pairs && big && lead[l] != 0;
    for (int32_t j = 0; j < n; ++j)
      p.tiles[big ? total_tiles + fill[l] + big_tile_slot(j, n, lead_last) : tile_off[l] + j] =
          Tile{l, row_off[l] + j * step, min(step, c - j * step), 0};
  }
  __syncthreads();
  for (int l = tid; l < L; l += kScheduleThreads) fill[l] = 0;
  __syncthreads();
  for (int64_t i = tid; i < p.num_pairs; i += kScheduleThreads) {
    const int64_t e = expert_of(i);
    if (e >= 0 && e < L) {
      const int32_t pos = row_off[e] + atomicAdd(&fill[e], 1);
      p.pair_row[pos] = static_cast<int32_t>(i / p.top_k);
      p.slot[i] = pos;
    } else {
      p.slot[i] = -1;
    }
  }
  if (tid == 0) p.num_tiles[0] = total_tiles + total_big, p.num_tiles[1] = total_tiles;
}

}  // namespace epx::experts_cuda

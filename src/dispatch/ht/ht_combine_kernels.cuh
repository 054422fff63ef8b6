// dispatch/ht/ht_combine_kernels.cuh: the ht combine kernel: partials sent back to their sources and the
// per-token reduction in rank order (device helpers: ht_device.cuh).
#pragma once

#include "dispatch/ht/ht_device.cuh"

namespace epx::dispatch::ht {

// ---- combine --------------------------------------------------------------------------------------

/// One warp copies one bf16 row (16-byte vectors, U per lane in flight, when both ends allow).
__device__ __forceinline__ void copy_row_bf16(uint16_t* dst, const uint16_t* src, int64_t H, bool aligned, int lane) {
  if (aligned) {
    const int64_t n16 = H / 8;
    constexpr int U = 8;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < n16) v[u] = reinterpret_cast<const uint4*>(src)[i];
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i < n16) reinterpret_cast<uint4*>(dst)[i] = v[u];
      }
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) dst[i] = src[i];
  }
}

/// reduce_token for exactly two rows (16-byte aligned): both rows' U vectors per lane are loaded
/// before any is summed (2U loads in flight, one memory latency per step instead of two); the sums are
/// the same operations in the same order as the general path (acc = 0.0f, += row 0, += row 1).
template <int U>
__device__ __forceinline__ void reduce_two_rows(const uint4* r0, const uint4* r1, uint4* out, int64_t n16, int lane) {
  for (int64_t base = 0; base < n16; base += 32 * U) {
    uint4 a[U], b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) {
        a[u] = r0[i];
        b[u] = r1[i];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i >= n16) continue;
      const uint32_t wa[4] = {a[u].x, a[u].y, a[u].z, a[u].w}, wb[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float lo = 0.0f, hi = 0.0f;
        lo += lo_f(wa[q]);
        hi += hi_f(wa[q]);
        lo += lo_f(wb[q]);
        hi += hi_f(wb[q]);
        o[q] = static_cast<uint32_t>(float_to_bf16_bits(lo)) | (static_cast<uint32_t>(float_to_bf16_bits(hi)) << 16);
      }
      out[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

/// out[t] = round_bf16(sum over destinations d in rank order that token t went to of partial_d), fp32
/// from 0.0f (DedupCpu::finalize); `rows` in destination-rank order.
__device__ __forceinline__ void reduce_token(const uint16_t* const* rows, int n, uint16_t* out, int64_t H, bool aligned, int lane) {
  if (aligned && n == 2) {  // the common case at 2 ranks (Flat: self + peer; expert-contiguous: both)
    reduce_two_rows<4>(reinterpret_cast<const uint4*>(rows[0]), reinterpret_cast<const uint4*>(rows[1]), reinterpret_cast<uint4*>(out), H / 8, lane);
    return;
  }
  if (aligned) {
    const int64_t n16 = H / 8;
    constexpr int U = 2;
    for (int64_t base = 0; base < n16; base += 32 * U) {
      float acc[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
      for (int j = 0; j < n; ++j) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t i = base + u * 32 + lane;
          if (i < n16) v[u] = reinterpret_cast<const uint4*>(rows[j])[i];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[u][2 * q] += lo_f(w[q]);
            acc[u][2 * q + 1] += hi_f(w[q]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t i = base + u * 32 + lane;
        if (i >= n16) continue;
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[u][2 * q])) |
                 (static_cast<uint32_t>(float_to_bf16_bits(acc[u][2 * q + 1])) << 16);
        reinterpret_cast<uint4*>(out)[i] = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
  } else {
    for (int64_t i = lane; i < H; i += 32) {
      float acc = 0.0f;
      for (int j = 0; j < n; ++j) acc += bf16_bits_to_float(rows[j][i]);
      out[i] = float_to_bf16_bits(acc);
    }
  }
}

/// reduce_token with fp32 partials (flat_combine partial_fp32) and/or an addend: out = round_bf16(sum over
/// the rows in order, fp32 from 0.0f, then + addend), as DedupCpu::finalize; bf16 rows with an addend:
/// the sum is rounded to bf16 before the addend joins (partial_bf16, CpuPrepareFinalize::finish_rows).
/// aligned: every row, addend and out 16-byte aligned and H % 8 == 0 (8 elements per lane and step).
__device__ __forceinline__ void reduce_token_any(const uint16_t* const* rows, int n, bool f32, const float* addend, uint16_t* out,
                                                 int64_t H, bool aligned, int lane) {
  if (aligned) {
    const int64_t n8 = H / 8;
    for (int64_t i = lane; i < n8; i += 32) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
      for (int j = 0; j < n; ++j) {
        if (f32) {
          const float4* r = reinterpret_cast<const float4*>(rows[j]) + 2 * i;
          const float4 a = r[0], b = r[1];
          acc[0] += a.x, acc[1] += a.y, acc[2] += a.z, acc[3] += a.w;
          acc[4] += b.x, acc[5] += b.y, acc[6] += b.z, acc[7] += b.w;
        } else {
          const uint4 v = reinterpret_cast<const uint4*>(rows[j])[i];
          const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            acc[2 * q] += lo_f(w[q]);
            acc[2 * q + 1] += hi_f(w[q]);
          }
        }
      }
      if (addend) {
        const float4* a4 = reinterpret_cast<const float4*>(addend) + 2 * i;
        const float4 a = a4[0], b = a4[1];
        const float av[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          if (!f32) acc[q] = bf16_bits_to_float(float_to_bf16_bits(acc[q]));
          acc[q] += av[q];
        }
      }
      uint32_t o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q + 1])) << 16);
      reinterpret_cast<uint4*>(out)[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    return;
  }
  for (int64_t i = lane; i < H; i += 32) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc += f32 ? reinterpret_cast<const float*>(rows[j])[i] : bf16_bits_to_float(rows[j][i]);
    if (addend) {
      if (!f32) acc = bf16_bits_to_float(float_to_bf16_bits(acc));
      acc += addend[i];
    }
    out[i] = float_to_bf16_bits(acc);
  }
}

/// expert-contiguous: the partial of received row n at vector index i, 8 fp32 values = sum over k in
/// order with pair_row[n,k] >= 0 of w[n,k] * y[pair_row[n,k]] in fp32 from 0.0f (products and sums
/// rounded separately, no contraction: HtCpu); w = 1 unweighted.
__device__ __forceinline__ void partial8_f32(const HtParams& p, int64_t n, int64_t i, float* acc) {
  const int64_t H = p.l.hidden;
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
  const int K = p.l.top_k;
  for (int k = 0; k < K; ++k) {
    const int32_t m = p.pair_row[n * K + k];
    if (m < 0) continue;
    const float w = p.combine_weights ? p.combine_weights[n * K + k] : 1.0f;
    const uint4 v = reinterpret_cast<const uint4*>(p.expert_out + m * H)[i];
    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, lo_f(wv[q])));
      acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, hi_f(wv[q])));
    }
  }
}

/// Partial row of received row n, 8 bf16 at vector index i (16 bytes): Flat = expert_out[n] as is;
/// expert-contiguous = round_bf16(sum over k in order with pair_row[n,k] >= 0 of w[n,k] * y[pair_row[n,k]])
/// in fp32 from 0.0f (products and sums rounded separately, no contraction: HtCpu); w = 1 unweighted.
__device__ __forceinline__ uint4 partial8(const HtParams& p, int64_t n, int64_t i) {
  const int64_t H = p.l.hidden;
  if (!p.pair_row) return reinterpret_cast<const uint4*>(p.expert_out + n * H)[i];
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.0f;
  const int K = p.l.top_k;
  for (int k = 0; k < K; ++k) {
    const int32_t m = p.pair_row[n * K + k];
    if (m < 0) continue;
    const float w = p.combine_weights ? p.combine_weights[n * K + k] : 1.0f;
    const uint4 v = reinterpret_cast<const uint4*>(p.expert_out + m * H)[i];
    const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, lo_f(wv[q])));
      acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, hi_f(wv[q])));
    }
  }
  uint32_t o[4];
#pragma unroll
  for (int q = 0; q < 4; ++q)
    o[q] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * q + 1])) << 16);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

/// One warp stores the partial row of received row n to dst: Flat = a copy (copy_row_bf16, 8 vectors
/// per lane in flight); expert-contiguous = partial8, 2 vectors per lane in flight (it reads K rows
/// per vector, so fewer are needed to cover the latency, and registers stay free).
/// fp32 partials (partial_f32): the row is 2H uint16 words, the expert-contiguous partial stays fp32.
__device__ __forceinline__ void send_partial(const HtParams& p, int64_t n, uint16_t* dst, int lane) {
  const int64_t H = p.l.hidden, ew = p.partial_f32 ? 2 : 1;
  if (!p.pair_row) {
    copy_row_bf16(dst, p.expert_out + n * H * ew, H * ew, p.io_aligned16, lane);
    return;
  }
  const int64_t n16 = H / 8;
  if (p.partial_f32) {
    for (int64_t i = lane; i < n16; i += 32) {
      float acc[8];
      partial8_f32(p, n, i, acc);
      float4* d = reinterpret_cast<float4*>(dst) + 2 * i;
      d[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      d[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    return;
  }
  constexpr int U = 2;
  for (int64_t base = 0; base < n16; base += 32 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) v[u] = partial8(p, n, i);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = base + u * 32 + lane;
      if (i < n16) reinterpret_cast<uint4*>(dst)[i] = v[u];
    }
  }
}

/// Combine destinations of one token: which ranks' rows are summed, in rank order.
struct CombineCtx {
  int R, me, nt;             ///< ranks, this rank, targets
  int target_slot[kHtMaxRanks];  ///< slot of rank d among the targets (-1: not a target)
  int64_t C;                 ///< flags per source in chunk_flags
  int chunk_rows;
  uint64_t epoch, deadline;
};

/// Reduces token t: its rows from every destination d in rank order; rows from a target d (a rank
/// whose rows travel through `back`) wait for their chunk flag first (bounded). False on timeout.
/// ready[d]: the chunk of source d last seen released (a chunk's flag is polled once per warp).
__device__ __forceinline__ bool reduce_one(const HtParams& p, const CombineCtx& cx, int64_t t, int64_t* ready, int lane) {
  const HtLayout& l = p.l;
  const HtState& st = state_of(p);
  const int64_t H = l.hidden, HW = H * (p.partial_f32 ? 2 : 1);  // HW: a partial row in uint16 words
  const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  const uint16_t* back = reinterpret_cast<const uint16_t*>(p.peers[cx.me] + l.off_back);
  const uint64_t* chunk_flags = reinterpret_cast<const uint64_t*>(p.peers[cx.me] + l.off_chunk_flags);
  const uint16_t* rows[kHtMaxRanks];
  int n = 0;
  for (int d = 0; d < cx.R; ++d) {
    const int32_t pos = send_pos[t * cx.R + d];
    if (pos < 0) continue;
    if (cx.target_slot[d] < 0) {  // Flat, d == me: read in place
      rows[n++] = p.expert_out + (st.recv_offset[cx.me] + pos) * HW;
      continue;
    }
    const int64_t chunk = pos / cx.chunk_rows;
    if (ready[d] == chunk) {
      rows[n++] = back + (d * l.capacity + pos) * HW;
      continue;
    }
    int ok = 1;
    if (lane == 0) {
      const uint64_t* flag = chunk_flags + d * cx.C + chunk;
      while (ld_acquire_sys(flag) < cx.epoch) {
        if (globaltimer() > cx.deadline) {
          ok = 0;
          break;
        }
      }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    __syncwarp();
    if (!ok) {
      if (lane == 0) {
        report_timeout(p, d, kOpCombine);
        state_of(p).failed = 1;
      }
      return false;
    }
    ready[d] = chunk;
    rows[n++] = back + (d * l.capacity + pos) * HW;
  }
  if (p.partial_f32 || p.addend)
    reduce_token_any(rows, n, p.partial_f32, p.addend ? p.addend + t * H : nullptr, p.out + t * H, H, p.io_aligned16, lane);
  else
    reduce_token(rows, n, p.out + t * H, H, p.io_aligned16, lane);
  return true;
}

/// Combine (one kernel, every warp does both halves; file comment of ht_cuda.h).
/// Targets: the ranks whose partial rows come back through `back` (every remote rank; this rank too
/// with the expert-contiguous layout, whose partials are computed, not read in place). Items: (chunk
/// c of chunk_rows rows, target slot), item = c * nt + slot; item i's send half stores the partials of
/// received rows [c * chunk_rows, ...) of source `target` into target's back block and releases that
/// chunk's flag there; its reduce half sums this rank's tokens whose first target row lies in the
/// same chunk (send_tok: the inverse of send_pos). Warps are numbered CTA-major (spread_warp_index).
/// Every warp sends all its items, then reduces all its items (no wait on its own GPU before its
/// sends are out).
/// Then tokens with no target row (Flat: only this rank, or nowhere) are reduced by contiguous ranges.
/// Waits assume the grid is resident on every rank (grid <= SMs); a wait that expires reports Timeout.
/// The last CTA (ticket) advances the combine epoch.
__global__ void __launch_bounds__(kMaxThreads) combine_kernel(HtParams p) {
  HtState& st = state_of(p);
  if (st.failed || st.any_bad) return;
  const HtLayout& l = p.l;
  const int R = l.num_ranks, me = l.rank;
  const int64_t H = l.hidden;
  const int lane = threadIdx.x & 31;
  const int64_t W = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t wi = spread_warp_index();
  if (threadIdx.x == 0) atomicMin(&st.timeline[kTlCombineStart], globaltimer());
  CombineCtx cx;
  cx.R = R;
  cx.me = me;
  cx.nt = 0;
  const bool contig = p.pair_row != nullptr;
  for (int d = 0; d < R; ++d) cx.target_slot[d] = (d != me || contig) ? cx.nt++ : -1;
  cx.C = l.capacity;  // one flag per row: chunk index < ceil(cap / chunk_rows) <= cap
  cx.chunk_rows = p.chunk_rows;
  cx.epoch = st.epoch_combine + 1;
  cx.deadline = globaltimer() + p.timeout_ns;
  const int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  const int32_t* send_tok = arr<int32_t>(p, p.a.send_tok);
  // Before any store into a peer's `back`: that peer has finished reading it in the previous combine
  // (its "combine done" flag, published by its last CTA). One poll per CTA; in the prepare/finalize
  // sequence it passed long ago (the dispatch handshake already orders it), so this costs one load.
  {
    __shared__ int s_fail;
    if (threadIdx.x == 0) s_fail = 0;
    __syncthreads();
    if (threadIdx.x < R && static_cast<int>(threadIdx.x) != me &&
        !wait_flag(p, kFlagCombineDone, threadIdx.x, cx.epoch - 1, cx.deadline)) {
      report_timeout(p, threadIdx.x, kOpCombine);
      st.failed = 1;
      s_fail = 1;
    }
    __syncthreads();
    if (s_fail) return;
  }
  int64_t max_rows = 0;
  for (int d = 0; d < R; ++d)
    if (cx.target_slot[d] >= 0)
      max_rows = max(max_rows, static_cast<int64_t>(max(st.recv_offset[d + 1] - st.recv_offset[d], st.rows_to[d])));
  const int64_t CR = cx.chunk_rows;
  const int64_t items = (max_rows + CR - 1) / CR * cx.nt;
  int target_of_slot[kHtMaxRanks];
  for (int d = 0; d < R; ++d)
    if (cx.target_slot[d] >= 0) target_of_slot[cx.target_slot[d]] = d;

  auto send_item = [&](int64_t i) {
    const int64_t c = i / cx.nt;
    const int s = target_of_slot[i % cx.nt];
    const int64_t count = st.recv_offset[s + 1] - st.recv_offset[s];
    const int64_t j_end = min(count, (c + 1) * CR);
    if (c * CR >= j_end) return;
    const int64_t HW = H * (p.partial_f32 ? 2 : 1);  // a partial row in uint16 words (fp32: two per element)
    if (!p.pair_row) {
      // Flat: the chunk's rows are contiguous on both sides (expert_out rows recv_offset[s] + j, back
      // rows me * cap + j): one copy of (j_end - c * CR) rows keeps every lane's vectors in flight.
      uint16_t* dst = reinterpret_cast<uint16_t*>(p.peers[s] + l.off_back) + (me * l.capacity + c * CR) * HW;
      copy_row_bf16(dst, p.expert_out + (st.recv_offset[s] + c * CR) * HW, (j_end - c * CR) * HW, p.io_aligned16, lane);
    } else {
      for (int64_t j = c * CR; j < j_end; ++j) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(p.peers[s] + l.off_back) + (me * l.capacity + j) * HW;
        send_partial(p, st.recv_offset[s] + j, dst, lane);
      }
    }
    __syncwarp();
    if (lane == 0) {
      __threadfence_system();
      st_release_sys(reinterpret_cast<uint64_t*>(p.peers[s] + l.off_chunk_flags) + me * cx.C + c, cx.epoch);
    }
  };
  bool ok = true;
  int64_t ready[kHtMaxRanks];
  for (int d = 0; d < R; ++d) ready[d] = -1;
  auto reduce_item = [&](int64_t i) {
    const int64_t c = i / cx.nt;
    const int d = target_of_slot[i % cx.nt];
    const int64_t j_end = min(static_cast<int64_t>(st.rows_to[d]), (c + 1) * CR);
    for (int64_t j = c * CR; j < j_end && ok; ++j) {
      const int64_t t = send_tok[d * l.capacity + j];
      int first = -1;  // the token's first target in rank order owns it
      for (int e = 0; e < R && first < 0; ++e)
        if (cx.target_slot[e] >= 0 && send_pos[t * R + e] >= 0) first = e;
      if (first == d) ok = reduce_one(p, cx, t, ready, lane);
    }
  };

  // Every item sent, then every item reduced: a reduce waits only for chunks the peers send
  // unconditionally, so no two warps wait on each other.
  for (int64_t i = wi; i < items; i += W) send_item(i);
  for (int64_t i = wi; i < items && ok; i += W) reduce_item(i);
  if (lane == 0) atomicMax(&st.timeline[kTlCombineSent], globaltimer());

  // Tokens without a target row: Flat rows that stayed on this rank (or went nowhere: zeros).
  const int64_t T = st.num_tokens;
  const int64_t per = (T + W - 1) / W;
  const int64_t t_begin = wi * per, t_end = min(T, t_begin + per);
  for (int64_t t = t_begin; t < t_end && ok; ++t) {
    bool any = false;
    for (int e = 0; e < R; ++e) any |= cx.target_slot[e] >= 0 && send_pos[t * R + e] >= 0;
    if (!any) ok = reduce_one(p, cx, t, ready, lane);
  }

  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMax(&st.timeline[kTlCombineEnd], globaltimer());
    __threadfence();
    s_last = atomicAdd(&st.ticket_combine, 1u) == gridDim.x - 1;
    if (s_last) {
      st.ticket_combine = 0;
      st.epoch_combine = cx.epoch;
      // Every CTA has finished reading `back` (the ticket): the peers' next combine may overwrite it.
      __threadfence_system();
      for (int d = 0; d < R; ++d)
        if (d != me) st_release_sys(flag_ptr(p, d, kFlagCombineDone, me), cx.epoch);
    }
  }
}

}  // namespace epx::dispatch::ht

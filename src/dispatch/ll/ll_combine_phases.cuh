// dispatch/ll/ll_combine_phases.cuh: the parts of ll_combine_kernel (ll_cuda_kernels.cu) in the
// partial modes: the send runs, the receive runs with block signals, and the receive of
// ll.combine_wait = data (rows polled for their poison words), with their load / store helpers.
// Included by ll_cuda_kernels.cu only.
#pragma once

#include "dispatch/ll/ll_device.cuh"

namespace epx::dispatch {
namespace {

// ---- combine -----------------------------------------------------------------------------------

/// Partial modes, one lane's 8 elements of a partial row: fp32 (two 16-byte vectors) or bf16 (one).
template <bool kF32>
__device__ __forceinline__ void load_partial(const uint8_t* row, int64_t h, float (&v)[8]) {
  if constexpr (kF32) {
    const uint4 a = ld16(row + 4 * h), b = ld16(row + 4 * h + 16);
    const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __uint_as_float(w[i]);
  } else {
    bf16x8_to_float(ld16(row + 2 * h), v);
  }
}

/// Partial combine send: items are (message slot, run of cpr consecutive 256-element
/// chunks) over the capacity R x max_T; a warp loads its message's routing, the source's message
/// count and the call number in one round trip, then kG local rows x cpr chunks of loads in flight
/// per round trip, sums them in column order in fp32 (the arithmetic of gather_columns: acc + w_k *
/// y_k, separate roundings, column order), and stores the run's partial row to the source: fp32 rows
/// as whole 128-byte lines per warp instruction (the halves of two lanes' 8 elements exchanged by
/// shuffles; weak stores, or volatile with kData; bench/NOTES.md, 'LL combine, where the first ~6 us go').
template <int kG, int kRun, bool kData>
__device__ __forceinline__ void combine_send_runs(const LlCombineParams& p, int W, int warp, int lane, bool* gave_up) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const bool f32 = lay.combine == 1;
  if (c.num_local == 0) return;  // no local experts: nothing to send
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W, nmsg = static_cast<int64_t>(R) * max_t;
  const int cpr = chunks_per_run(nch, nmsg, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = nmsg * runs;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += warps) {
    const int64_t mi = udiv(item, runs);  // = s max_T + j
    const int run = static_cast<int>(item - mi * runs);
    const int s = udiv(mi, max_t), j = static_cast<int>(mi - static_cast<int64_t>(s) * max_t);
    int32_t my_row = -1, v0 = 0;
    float my_w = 0.0f;
    unsigned long long ctr = 0;
    if (lane < K) {  // every load of the item's routing at once
      my_row = p.msg_rows[mi * K + lane];
      my_w = p.msg_weights[mi * K + lane];
    }
    if (lane == K) v0 = p.msg_count[s];
    if (lane == K + 1) v0 = p.msg_src_token[mi];
    if (lane == 0) ctr = *reinterpret_cast<const volatile unsigned long long*>(&c.state->combine_send_blocks);
    // ll.combine_wait = data: how many combine receives destination s has finished (its word here).
    const int kd = K + 2 < 32 ? K + 2 : 31;
    unsigned long long done = ~0ull;
    if (kData && s != rank && lane == kd) done = ld_acquire_sys(c.local + lay.combine_flag_offset(s, 0));
    const int kc = K < 32 ? K : 0, kt = K + 1 < 32 ? K + 1 : 0;  // K = 31 / 32: lanes reused below
    int cnt = __shfl_sync(0xffffffffu, v0, kc), t = __shfl_sync(0xffffffffu, v0, kt);
    if (K >= 31) {  // no spare lanes: plain loads (K <= 32)
      cnt = p.msg_count[s];
      t = p.msg_src_token[mi];
    }
    if (j >= cnt) continue;  // beyond the messages s sent (warp-uniform)
    ctr = __shfl_sync(0xffffffffu, ctr, 0);
    const unsigned long long call = div_blocks(ctr, gridDim.x);
    const int parity = static_cast<int>(call & 1);
    if (kData && s != rank) {  // call n overwrites the region that s read in its receive n - 2
      if (lane == kd && done + 1 < call && !*gave_up) {
        const unsigned long long t0 = globaltimer();
        const void* f = c.local + lay.combine_flag_offset(s, 0);
        while ((done = ld_acquire_sys(f)) + 1 < call) {
          if (static_cast<long long>(globaltimer() - t0) > c.timeout_ns) {
            report(c, LlErrorReport::timeout, s, LlErrorReport::combine, static_cast<long long>(call), static_cast<long long>(done));
            *gave_up = true;
            break;
          }
        }
      }
      if (__any_sync(0xffffffffu, *gave_up)) *gave_up = true;  // warp-uniform (the receive part's polls read it)
    }
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    unsigned live = __ballot_sync(0xffffffffu, my_row >= 0);
    while (live) {  // kG columns per round trip, in column order
      uint4 y[kG][kRun];
      int f[kG];
      float w[kG];
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        const int k = live ? __ffs(live) - 1 : 0;
        f[g] = __shfl_sync(0xffffffffu, my_row, k);
        w[g] = __shfl_sync(0xffffffffu, my_w, k);
        if (!live) f[g] = -1;
        live &= live - 1;
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          const int64_t h = hbase + i * 256;
          y[g][i] = make_uint4(0, 0, 0, 0);
          if (f[g] >= 0 && i < cpr && h < H) y[g][i] = __ldg(reinterpret_cast<const uint4*>(p.expert_out + static_cast<int64_t>(f[g]) * H + h));
        }
      }
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        if (f[g] < 0) continue;  // select, not multiply: a -1 column adds nothing
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          float yf[8];
          bf16x8_to_float(y[g][i], yf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], __fmul_rn(w[g], yf[e]));
        }
      }
    }
    const bool stamp0 = item == static_cast<int64_t>(blockIdx.x) * W + warp && warp == 0;  // block 0 via trace_at
    if (stamp0 && __float_as_uint(acc[0][0]) != 0x7fc00001u) trace_at(c, kTrCombLoaded0);  // after the sums (data-dependent)
    uint8_t* dst = c.peers[s] + lay.combine_partial_offset(parity, t, rank);
#pragma unroll
    for (int i = 0; i < kRun; ++i) {
      const int64_t h = hbase + i * 256;
      if (i >= cpr) continue;  // warp-uniform
      if constexpr (kData) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] = canon_nan(acc[i][e]);
      }
      {
        if (f32) {
          // Whole lines per instruction (512 contiguous bytes): the chunk's elements [4 lane, +4), then
          // [128 + 4 lane, +4), i.e. half (lane & 1) of lane (lane >> 1)'s eight and of lane 16 + (lane >> 1)'s.
          // H % 8 == 0: a group of 4 is valid exactly when its source lane's h is.
          const int64_t hc = hbase - lane * 8 + i * 256;  // the chunk's first element
          float lo[8], hi[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            lo[e] = __shfl_sync(0xffffffffu, acc[i][e], lane >> 1);
            hi[e] = __shfl_sync(0xffffffffu, acc[i][e], 16 + (lane >> 1));
          }
          const bool odd = lane & 1;
          const int64_t ha = hc + 4 * lane, hb2 = hc + 128 + 4 * lane;
          const uint4 va = odd ? make_uint4(__float_as_uint(lo[4]), __float_as_uint(lo[5]), __float_as_uint(lo[6]), __float_as_uint(lo[7]))
                               : make_uint4(__float_as_uint(lo[0]), __float_as_uint(lo[1]), __float_as_uint(lo[2]), __float_as_uint(lo[3]));
          const uint4 vb = odd ? make_uint4(__float_as_uint(hi[4]), __float_as_uint(hi[5]), __float_as_uint(hi[6]), __float_as_uint(hi[7]))
                               : make_uint4(__float_as_uint(hi[0]), __float_as_uint(hi[1]), __float_as_uint(hi[2]), __float_as_uint(hi[3]));
          if constexpr (kData) {
            if (ha < H) stv16(dst + 4 * ha, va);
            if (hb2 < H) stv16(dst + 4 * hb2, vb);
          } else {
            if (ha < H) st16(dst + 4 * ha, va);
            if (hb2 < H) st16(dst + 4 * hb2, vb);
          }
          continue;
        }
      }
      if (h >= H) continue;
      {  // bf16 partial rows
        uint32_t o[4];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          o[e] = static_cast<uint32_t>(float_to_bf16_bits(acc[i][2 * e])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[i][2 * e + 1])) << 16);
        if constexpr (kData) stv16(dst + 2 * h, make_uint4(o[0], o[1], o[2], o[3]));
        else st16(dst + 2 * h, make_uint4(o[0], o[1], o[2], o[3]));
      }
    }
    if (stamp0) {
      compiler_barrier();  // after the stores are issued
      trace_at(c, kTrCombStored0);
    }
  }
}

/// The token's addend (FinalizeArgs::addend) joins 8 fp32 sums at column h before their rounding
/// (LlCpu::finalize: after the ranks' partials or the columns); addend_row null: nothing.
__device__ __forceinline__ void add_addend8(float* acc, const float* addend_row, int64_t h) {
  if (!addend_row) return;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = __fadd_rn(acc[e], addend_row[h + e]);
}

/// The receive items' epilogue: a lane's kRun x 8 fp32 sums (chunk i at column hbase + 256 i of the
/// token's bf16 output row out_row, chunks past cpr or H skipped), plus the token's addend row when
/// given, rounded once to bf16, 16-byte stores.
template <int kRun>
__device__ __forceinline__ void store_bf16_run(uint16_t* out_row, const float (&sums)[kRun][8], int64_t hbase, int cpr, int64_t H,
                                               const float* addend_row) {
#pragma unroll
  for (int i = 0; i < kRun; ++i) {
    const int64_t h = hbase + i * 256;
    if (i >= cpr || h >= H) continue;
    float acc[1][8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[0][e] = sums[i][e];
    add_addend8(acc[0], addend_row, h);
    uint32_t o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o[e] = static_cast<uint32_t>(float_to_bf16_bits(acc[0][2 * e])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[0][2 * e + 1])) << 16);
    st16(out_row + h, make_uint4(o[0], o[1], o[2], o[3]));
  }
}

/// Partial combine receive (flag): items are (token, run of cpr 256-element chunks); the
/// first item's routing (dest_mask) is loaded before the wait; then the partial rows of every rank
/// in the token's mask, all of the run's loads in flight, are added in rank order in fp32 and
/// rounded once to bf16. Block-wide (the wait). s_bad: the caller's shared [kLlMaxRanks].
template <int kRun>
__device__ __forceinline__ void combine_recv_runs(const LlCombineParams& p, int W, int warp, int lane, const unsigned long long* s_call,
                                                  int* s_bad) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks;
  const int64_t H = lay.hidden;
  const bool f32 = lay.combine == 1;
  const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W;
  const int cpr = chunks_per_run(nch, T, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = p.rejected ? 0 : static_cast<int64_t>(T) * runs;  // rejected: out is not written
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint32_t mask = first_item < items ? p.dest_mask[udiv(first_item, runs)] : 0u;
  if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
  __syncthreads();  // s_call (thread 0 read it at the kernel's start), s_bad
  const unsigned long long call = *s_call;
  const int parity = static_cast<int>(call & 1);
  wait_all_flags(c, [&](int s) { return c.local + lay.combine_flag_offset(s, 0); }, call + 1, LlErrorReport::combine, call, s_bad, [](int) {});
  __syncthreads();
  trace_at(c, 6);
  trace_max(c, 11);
  const float acc0 = combine_rejected_source(p, s_bad, call) >= 0 ? __uint_as_float(0x7fc00000u) : 0.0f;  // a peer rejected: NaN
  for (int64_t item = first_item; item < items; item += warps) {
    const int t = udiv(item, runs), run = static_cast<int>(item - static_cast<int64_t>(t) * runs);
    if (item != first_item) mask = p.dest_mask[t];
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = acc0;
    for (int r0 = 0; r0 < R; r0 += 2) {  // 2 ranks x the run's chunks in flight
      float v[2][kRun][8];
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          const int64_t h = hbase + i * 256;
          if (r0 + q < R && ((mask >> (r0 + q)) & 1u) && i < cpr && h < H) {
            const uint8_t* row = c.local + lay.combine_partial_offset(parity, t, r0 + q);
            if (f32) load_partial<true>(row, h, v[q][i]);
            else load_partial<false>(row, h, v[q][i]);
          }
        }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (r0 + q >= R || !((mask >> (r0 + q)) & 1u)) continue;
#pragma unroll
        for (int i = 0; i < kRun; ++i)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], v[q][i][e]);
      }
    }
    const bool stamp0 = item == first_item;  // block 0's warp 0 (trace_at): the phases of its first item
    if (stamp0 && __float_as_uint(acc[0][0]) != 0x7fc00001u) trace_at(c, kTrCombRecvLoaded0);  // after the sums (data-dependent)
    store_bf16_run<kRun>(p.out + static_cast<int64_t>(t) * H, acc, hbase, cpr, H, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr);
    if (stamp0) {
      compiler_barrier();  // after the stores are issued
      trace_at(c, kTrCombRecvStored0);
    }
  }
  if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
}

/// Partial combine receive, ll.combine_wait = data (ll_cuda.h): items are (token, run of cpr
/// 256-element chunks) as in combine_recv_runs, but no flag is waited for: every partial row of the
/// item is loaded (volatile), and while a lane's vectors still hold kLlPoison they are loaded again
/// (a row of which nothing arrived yet: only its last vector, to keep the polling traffic small); then
/// the rows are added in rank order in fp32, rounded once to bf16, and the poison is stored back into
/// every vector read (the region is ready for call n + 2). A warp's waits together are bounded by
/// timeout_s (then reported, naming the rank whose row is missing). Block-wide (one __syncthreads).
template <int kRun, bool kF32>
__device__ __forceinline__ void combine_recv_data(const LlCombineParams& p, int W, int warp, int lane, const unsigned long long* s_call,
                                                  bool* gave_up) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks;
  const int64_t H = lay.hidden;
  constexpr int kV = kF32 ? 2 : 1, kN = kRun * kV;  // 16-byte vectors per lane and row
  const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
  const int nch = static_cast<int>((H + 255) / 256);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * W;
  const int cpr = chunks_per_run(nch, T, warps, kRun);
  const int runs = (nch + cpr - 1) / cpr;
  const int64_t items = static_cast<int64_t>(T) * runs;
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint32_t mask = first_item < items ? p.dest_mask[udiv(first_item, runs)] : 0u;
  __syncthreads();  // s_call (thread 0 read it at the kernel's start)
  const unsigned long long call = *s_call;
  const int parity = static_cast<int>(call & 1);
  trace_at(c, kTrCombWaited0);
  trace_max(c, kTrCombWaitedLast);
  unsigned long long t_wait = 0;  // the warp's first not-ready poll (0: none yet)
  for (int64_t item = first_item; item < items; item += warps) {
    const int t = udiv(item, runs), run = static_cast<int>(item - static_cast<int64_t>(t) * runs);
    if (item != first_item) mask = p.dest_mask[t];
    const int64_t hbase = static_cast<int64_t>(run) * cpr * 256 + lane * 8;
    float acc[kRun][8];
#pragma unroll
    for (int i = 0; i < kRun; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[i][e] = 0.0f;
    unsigned live_n = 0;  // vectors n = i kV + v of this lane inside the row (i < cpr, h < H)
#pragma unroll
    for (int n = 0; n < kN; ++n)
      if (n / kV < cpr && hbase + (n / kV) * 256 < H) live_n |= 1u << n;
    auto vec_at = [&](int r, int n) -> uint8_t* {
      const int64_t h = hbase + (n / kV) * 256;
      return c.local + lay.combine_partial_offset(parity, t, r) + (kF32 ? 4 * h + 16 * (n % kV) : 2 * h);
    };
    for (int r0 = 0; r0 < R; r0 += 2) {  // 2 ranks x the run's vectors in flight
      uint4 raw[2][kN];
      unsigned need[2], pend[2];
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        need[q] = r0 + q < R && ((mask >> (r0 + q)) & 1u) ? live_n : 0u;
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if ((need[q] >> n) & 1u) raw[q][n] = ldv16(vec_at(r0 + q, n));
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        pend[q] = 0;
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if (((need[q] >> n) & 1u) && poisoned(raw[q][n])) pend[q] |= 1u << n;
      }
      // (*gave_up and every branch below are warp-uniform: the votes decide.)
      while (!*gave_up && __any_sync(0xffffffffu, (pend[0] | pend[1]) != 0u)) {
        if (t_wait == 0) t_wait = globaltimer();
        if (__any_sync(0xffffffffu, static_cast<long long>(globaltimer() - t_wait) > c.timeout_ns)) {
          const int miss = pend[0] ? r0 : pend[1] ? r0 + 1 : -1;
          if (miss >= 0) report(c, LlErrorReport::timeout, miss, LlErrorReport::combine, static_cast<long long>(call), t);
          *gave_up = true;  // this warp waits no more (the object is broken: every later call throws)
          break;
        }
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const bool none_yet = pend[q] == need[q];  // nothing of this row yet: poll its last vector only
          const int last = need[q] ? 31 - __clz(need[q]) : 0;
#pragma unroll
          for (int n = 0; n < kN; ++n)
            if (((pend[q] >> n) & 1u) && (!none_yet || n == last)) raw[q][n] = ldv16(vec_at(r0 + q, n));
#pragma unroll
          for (int n = 0; n < kN; ++n)
            if (((pend[q] >> n) & 1u) && !poisoned(raw[q][n])) pend[q] &= ~(1u << n);
        }
      }
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (!need[q]) continue;
#pragma unroll
        for (int i = 0; i < kRun; ++i) {
          if (!((need[q] >> (i * kV)) & 1u)) continue;
          float v[8];
          if constexpr (kF32) {
            const uint32_t w[8] = {raw[q][i * kV].x, raw[q][i * kV].y, raw[q][i * kV].z, raw[q][i * kV].w,
                                   raw[q][i * kV + kV - 1].x, raw[q][i * kV + kV - 1].y, raw[q][i * kV + kV - 1].z, raw[q][i * kV + kV - 1].w};
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = __uint_as_float(w[e]);
          } else {
            bf16x8_to_float(raw[q][i * kV], v);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[i][e] = __fadd_rn(acc[i][e], v[e]);
        }
#pragma unroll
        for (int n = 0; n < kN; ++n)
          if ((need[q] >> n) & 1u) stv16(vec_at(r0 + q, n), make_uint4(kLlPoison, kLlPoison, kLlPoison, kLlPoison));
      }
    }
    store_bf16_run<kRun>(p.out + static_cast<int64_t>(t) * H, acc, hbase, cpr, H, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr);
  }
  if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
}

// kData: ll.combine_wait = data with a partial mode (LlCommon::combine_data; its own register
// allocation, so the flag protocol's kernel keeps its spill-free budget).
}  // namespace
}  // namespace epx::dispatch

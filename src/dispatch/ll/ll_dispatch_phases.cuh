// dispatch/ll/ll_dispatch_phases.cuh: the phases of ll_dispatch_kernel (ll_cuda_kernels.cu), each a
// forceinline device function the kernel calls in order: the front (every first load out, the token
// masks and per-id bitmaps, T), the send part (slot scan, chunk signals, the payload stores, the
// flags), and the receive part of either expansion (the message expansion with chunk signals, or the
// expert expansion with block signals). Included by ll_cuda_kernels.cu only.
#pragma once

#include "dispatch/ll/ll_device.cuh"

namespace epx::dispatch {
namespace {

// ---- dispatch ----------------------------------------------------------------------------------

/// The dispatch kernel's __shared__ words, which its phases read and write (references: each phase
/// loads them after its own barriers, as one kernel body would).
struct LlDispatchShared {
  unsigned long long &call_send, &call_recv;
  int &T, &total;
  int *count, *n, *bad, *mp;
  unsigned long long &tr_ns0, &tr_clk0;  // block 0's start (trace_clk; shared: no registers held)
};
/// What the front leaves in registers for the send part: the first bad id seen (reported once T is
/// known) and the warp's first item, loaded before T.
struct LlDispatchFront {
  int bad_t, bad_k;
  int64_t bad_id;
  int64_t first_item;
  uint4 pre_v0, pre_v1;
  int64_t pre_k;
  float pre_w;
};

/// The front: the loads every later step needs, the token masks (and per-id bitmaps), T and the call
/// numbers in shared memory; ends at the barrier that publishes them.
template <bool kMessage>
__device__ __forceinline__ void ll_dispatch_front(const LlDispatchParams& p, uint8_t* smem, const LlDispatchShared& sh, LlDispatchFront& f) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int nchunks = static_cast<int>((H + kLlChunkElems - 1) / kLlChunkElems);
  unsigned long long &s_call_send = sh.call_send, &s_call_recv = sh.call_recv, &tr_ns0 = sh.tr_ns0, &tr_clk0 = sh.tr_clk0;
  int& s_T = sh.T;
  int* s_bad = sh.bad;
  constexpr bool by_message = kMessage;
  const int NI = lay.num_ids, Wm = (max_t + 31) / 32;
  uint32_t* s_bm = reinterpret_cast<uint32_t*>(smem) + max_t + static_cast<int64_t>(max_t) * R;  // after s_mask, s_slot
  // Masks, per-id bitmaps and destinations are then computed lane-parallel (the token's mask ORed over
  // its G lanes with shuffles); rows >= T are masked out after the barrier that publishes T, and their
  // ids are never reported. One dependent round trip and two barriers before the slot scan.
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    tr_ns0 = globaltimer();
    tr_clk0 = clock64();
    c.state->trace[0] = tr_ns0;
  }
  trace_max(c, 8);
  unsigned long long ctr_send = 0, ctr_recv = 0;
  int32_t dev_T = 0;
  if (threadIdx.x == 0) {
    ctr_send = ld_volatile_u64(&c.state->dispatch_send_blocks);
    ctr_recv = ld_volatile_u64(&c.state->dispatch_recv_blocks);
    if (p.send && p.num_tokens) dev_T = ld32(p.num_tokens);
  }
  int G = 1;
  while (G < K) G <<= 1;  // K <= 32
  const int gk = static_cast<int>(threadIdx.x) & (G - 1), tpp = static_cast<int>(blockDim.x) / G;
  const int rows = p.send ? static_cast<int>(p.x_rows < max_t ? p.x_rows : max_t) : 0;
  constexpr int kIdPasses = 4;  // passes of tpp tokens whose ids are loaded up front
  int64_t idv[kIdPasses];
#pragma unroll
  for (int i = 0; i < kIdPasses; ++i) {
    const int t = i * tpp + static_cast<int>(threadIdx.x) / G;
    idv[i] = t < rows && gk < K ? load_id(p, static_cast<int64_t>(t) * K + gk) : -1;
  }
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
  uint4 pre_v0 = make_uint4(0, 0, 0, 0), pre_v1 = make_uint4(0, 0, 0, 0);
  int64_t pre_k = -1;
  float pre_w = 0.0f;
  if (p.send && first_item < p.x_rows * nchunks) {
    const int t = udiv(first_item, nchunks), ch = umod(first_item, nchunks);
    const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
    const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
    if (h0 < H) pre_v0 = __ldg(reinterpret_cast<const uint4*>(xr + h0));
    if (h0 + 8 < H) pre_v1 = __ldg(reinterpret_cast<const uint4*>(xr + h0 + 8));
    if (ch == 0 && lane < K) {
      pre_k = load_id(p, static_cast<int64_t>(t) * K + lane);
      pre_w = p.topk_weights[static_cast<int64_t>(t) * K + lane];
    }
  }
  const unsigned long long rt_start = load_round_trip(&c.state->combine_recv_blocks);
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem);          // [max_t]
  if (p.send && by_message) {
    for (int i = threadIdx.x; i < NI * Wm; i += blockDim.x) s_bm[i] = 0;
    __syncthreads();  // zeroed before the atomicOr below
  }
  int bad_t = -1, bad_k = 0;
  int64_t bad_id = 0;
  auto mask_pass = [&](int t, int64_t id) {  // block-uniform call (shuffles over the whole warp)
    const bool mine = t < rows && gk < K;
    if (mine && !c.placement.valid_id(id, gk, K)) {
      if (bad_t < 0) bad_t = t, bad_k = gk, bad_id = id;
      id = -1;  // treated as -1
    }
    const int d = mine ? c.placement.dest_rank(static_cast<int32_t>(id), rank) : -1;
    uint32_t bit = d >= 0 ? 1u << d : 0u;
    for (int o = 1; o < G; o <<= 1) bit |= __shfl_xor_sync(0xffffffffu, bit, o);
    if (t < rows && gk == 0) s_mask[t] = bit;
    if (by_message && mine && id >= 0) atomicOr(&s_bm[id * Wm + (t >> 5)], 1u << (t & 31));  // duplicates: the same bit
  };
#pragma unroll
  for (int i = 0; i < kIdPasses; ++i)
    if (i * tpp < rows) mask_pass(i * tpp + static_cast<int>(threadIdx.x) / G, idv[i]);
  for (int i = kIdPasses; i * tpp < rows; ++i) {
    const int t = i * tpp + static_cast<int>(threadIdx.x) / G;
    mask_pass(t, t < rows && gk < K ? load_id(p, static_cast<int64_t>(t) * K + gk) : -1);
  }
  if (threadIdx.x == 0) {
    s_call_send = div_blocks(ctr_send, gridDim.x);
    s_call_recv = div_blocks(ctr_recv, gridDim.x);
    int64_t T = p.num_tokens ? static_cast<int64_t>(dev_T) : p.x_rows;
    if (T < 0 || T > p.x_rows || T > max_t) {
      if (p.send && blockIdx.x == 0) report(c, LlErrorReport::bad_num_tokens, -1, LlErrorReport::dispatch, T, p.x_rows);
      T = 0;  // send nothing: the peers still get their signals, nothing hangs
    }
    s_T = static_cast<int>(T);
  }
  if (kMessage && threadIdx.x < kLlMaxRanks) s_bad[threadIdx.x] = 0;  // chunk signals: no barrier of its own
  __syncthreads();
  trace_at(c, kTrDispT);
  trace_at(c, kTrDispMasks);  // the masks are done at the same barrier now
  if (threadIdx.x == blockDim.x - 1 && blockIdx.x == 0) c.state->trace[kTrDispLoadStart] = tr_ns0 + rt_start;
  trace_clk(c, kTrDispMasksCyc, tr_ns0, tr_clk0);
  f = LlDispatchFront{bad_t, bad_k, bad_id, first_item, pre_v0, pre_v1, pre_k, pre_w};
}

/// The send part: the slot scan, the chunk signals (message expansion), the payload stores into the
/// peers' slots, the counts and the flags.
template <bool kFp8, bool kMessage>
__device__ __forceinline__ void ll_dispatch_send(const LlDispatchParams& p, uint8_t* smem, const LlDispatchShared& sh, const LlDispatchFront& f) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int nchunks = static_cast<int>((H + kLlChunkElems - 1) / kLlChunkElems);
  unsigned long long &s_call_send = sh.call_send, &tr_ns0 = sh.tr_ns0, &tr_clk0 = sh.tr_clk0;
  int& s_T = sh.T;
  int* s_count = sh.count;
  constexpr bool by_message = kMessage;
  const int NI = lay.num_ids, Wm = (max_t + 31) / 32;
  uint32_t* s_bm = reinterpret_cast<uint32_t*>(smem) + max_t + static_cast<int64_t>(max_t) * R;  // after s_mask, s_slot
  int32_t* s_pre = reinterpret_cast<int32_t*>(s_bm + static_cast<int64_t>(NI) * Wm);
  int32_t* s_tot = s_pre + static_cast<int64_t>(NI) * Wm;
  const int bad_t = f.bad_t, bad_k = f.bad_k;
  const int64_t bad_id = f.bad_id, first_item = f.first_item, pre_k = f.pre_k;
  const uint4 pre_v0 = f.pre_v0, pre_v1 = f.pre_v1;
  const float pre_w = f.pre_w;
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem);          // [max_t]
  int32_t* s_slot = reinterpret_cast<int32_t*>(s_mask + max_t);  // [max_t][R]
  const int T = s_T;
  const int parity = static_cast<int>(s_call_send & 1);
  if (bad_t >= 0 && bad_t < T && blockIdx.x == 0)
    report(c, LlErrorReport::bad_topk_id, -1, LlErrorReport::dispatch, bad_id, static_cast<int64_t>(bad_t) * K + bad_k);
  if (by_message) {  // per id, the running count of its tokens (< T) by 32-token word
    const int WT = (T + 31) / 32;
    const uint32_t last_bits = (T & 31) ? (1u << (T & 31)) - 1u : 0xffffffffu;
    for (int id = threadIdx.x; id < NI; id += blockDim.x) {
      int running = 0;
      for (int w = 0; w < WT; ++w) {
        s_pre[id * Wm + w] = running;
        running += __popc(s_bm[id * Wm + w] & (w == WT - 1 ? last_bits : 0xffffffffu));
      }
      s_tot[id] = running;
    }
  }
  // Slot of token t at destination d = tokens before t that go to d (source token order).
  for (int d = warp; d < R; d += W) {
    int running = 0;
    for (int t0 = 0; t0 < T; t0 += 32) {
      const int t = t0 + lane;
      const bool bit = t < T && ((s_mask[t] >> d) & 1u);
      const unsigned b = __ballot_sync(0xffffffffu, bit);
      if (bit) s_slot[t * R + d] = running + __popc(b & lanemask_lt());
      running += __popc(b);
    }
    if (lane == 0) s_count[d] = running;
  }
  __syncthreads();
  trace_at(c, kTrDispScanned);
  constexpr bool chunk_sig = kMessage;
  const bool debug_delay = chunk_sig && blockIdx.x == 0 && c.debug_block0_delay_ns > 0;  // tests only (block-uniform)
  if (debug_delay) debug_block_delay(c.debug_block0_delay_ns);
  if (chunk_sig && blockIdx.x == 0) {  // chunk signals: the tagged counts and slot tokens first, ahead of the payload
    const uint32_t tag = count_tag(s_call_send), tmask = c.debug_token_tag_mask;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {  // message slot -> source token, per destination
      const uint32_t mt = s_mask[t];
      for (int d = 0; d < R; ++d)
        if ((mt >> d) & 1u)
          st_relaxed_sys_u64(c.peers[d] + lay.slot_token_offset(parity, rank, s_slot[t * R + d]), slot_token_word(s_call_send, static_cast<uint32_t>(t), tmask));
    }
    for (int d = threadIdx.x; d < R; d += blockDim.x) {  // the scrubbed slot, where no message fills it (slot_token_word)
      const int j = ll_scrub_slot(s_call_send, max_t);
      if (j >= s_count[d]) st_relaxed_sys_u64(c.peers[d] + lay.slot_token_offset(parity, rank, j), slot_token_word(s_call_send, kLlNoToken, tmask));
    }
    for (int d = 0; d < R; ++d) {
      const int Ld = c.placement.num_local(d);
      for (int l = threadIdx.x; l < Ld; l += blockDim.x) {
        const int id = c.placement.shared_route && l == Ld - 1 ? c.placement.num_experts : c.placement.range_begin(d) + l;
        const int n = c.placement.local_index(id, rank, d) == l ? s_tot[id] : 0;
        st_relaxed_sys_u32(c.peers[d] + lay.expert_count_offset(parity, rank, l), tag << 30 | static_cast<uint32_t>(n));
      }
    }
    for (int d = threadIdx.x; d < R; d += blockDim.x)
      st_relaxed_sys_u64(c.peers[d] + lay.dispatch_count_offset(parity, rank), static_cast<unsigned long long>(tag) << 32 | static_cast<uint32_t>(s_count[d]));
  }
  if (debug_delay) debug_block_delay(c.debug_block0_delay_ns);

  const int64_t items = static_cast<int64_t>(T) * nchunks;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
    const int t = udiv(item, nchunks), ch = umod(item, nchunks);
    const uint32_t m = s_mask[t];
    const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
    const bool ok0 = h0 < H, ok1 = h0 + 8 < H;
    const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
    const bool pre = item == first_item;  // loaded before T
    uint4 v0 = pre_v0, v1 = pre_v1;
    if (!pre && ok0) v0 = __ldg(reinterpret_cast<const uint4*>(xr + h0));
    if (!pre && ok1) v1 = __ldg(reinterpret_cast<const uint4*>(xr + h0 + 8));
    // Header, ids and the combine's copy of the routing: the chunk-0 warp of each token.
    int32_t my_id = -1, my_first = -1, my_u = -1;
    float my_w = 0.0f;
    if (ch == 0) {
      if (lane < K) {
        const int64_t id = pre ? pre_k : load_id(p, static_cast<int64_t>(t) * K + lane);
        my_id = c.placement.valid_id(id, lane, K) ? static_cast<int32_t>(id) : -1;
        my_w = pre ? pre_w : p.topk_weights[static_cast<int64_t>(t) * K + lane];
      }
      my_first = my_id >= 0 ? lane : -1;
      for (int k = 0; k < K; ++k) {
        const int32_t other = __shfl_sync(0xffffffffu, my_id, k);
        if (k < lane && my_first == lane && other == my_id) my_first = k;
      }
      if (!lay.partial() && lane < K) {
        p.first_col[static_cast<int64_t>(t) * K + lane] = my_first;
        p.weights[static_cast<int64_t>(t) * K + lane] = my_w;
      }
      if (lay.partial() && lane == 0) p.dest_mask[t] = m;
      if (by_message && my_id >= 0)  // this token's rank among the source's tokens selecting my_id
        my_u = s_pre[my_id * Wm + (t >> 5)] + __popc(s_bm[my_id * Wm + (t >> 5)] & lanemask_of(t & 31));
    }
    uint4 q = make_uint4(0, 0, 0, 0);
    float scale = 0.0f;
    if constexpr (kFp8) {
      float f[16];
      bf16x8_to_float(v0, f);
      bf16x8_to_float(v1, f + 8);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(f[i]));
      // 8 lanes x 16 elements = one 1x128 group.
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
      scale = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
      if (p.ue8m0 && isfinite(scale)) scale = round_up_pow2(scale);
      // f / scale, the quotients of quant_cpu.cpp's IEEE division: one correctly rounded reciprocal
      // and two fma corrections per element (fp8_quotients_rn), __fdiv_rn itself where that is not
      // proven equal (a non-finite scale or element).
      float qv[16];
      bool finite = isfinite(scale);
#pragma unroll
      for (int i = 0; i < 16; ++i) finite = finite && isfinite(f[i]);
      if (finite) {
        const float y = __frcp_rn(scale);
#pragma unroll
        for (int i = 0; i < 16; ++i) qv[i] = quotient_rn(f[i], scale, y);
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) qv[i] = __fdiv_rn(f[i], scale);
      }
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = fp8x2(qv[4 * i], qv[4 * i + 1]) | (fp8x2(qv[4 * i + 2], qv[4 * i + 3]) << 16);
      q = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int d = 0; d < R; ++d) {
      if (!((m >> d) & 1u)) continue;
      uint8_t* msg = c.peers[d] + lay.dispatch_msg_offset(parity, rank, s_slot[t * R + d]);
      if constexpr (kFp8) {
        if (ok0) {
          st16(msg + lay.msg_payload_offset() + h0, q);
          if ((lane & 7) == 0) *reinterpret_cast<float*>(msg + lay.msg_scales_offset() + h0 / 128 * 4) = scale;
        }
      } else {
        if (ok0) st16(msg + lay.msg_payload_offset() + 2 * h0, v0);
        if (ok1) st16(msg + lay.msg_payload_offset() + 2 * (h0 + 8), v1);
      }
      if (ch == 0) {
        if (lane == 0) st16(msg, make_uint4(static_cast<uint32_t>(t), 0, 0, 0));
        if (lane < K) *reinterpret_cast<int32_t*>(msg + lay.msg_topk_offset() + 4 * lane) = my_id;
        if (lay.partial() && lane < K) *reinterpret_cast<float*>(msg + lay.msg_weights_offset() + 4 * lane) = my_w;
        if (by_message && lane < K) *reinterpret_cast<int32_t*>(msg + lay.msg_slots_offset() + 4 * lane) = my_u;
      }
    }
  }
  if (warp == 0) trace_at(c, kTrDispWarp0Items);
  if (warp == 0) trace_clk(c, kTrDispWarp0ItemsCyc, tr_ns0, tr_clk0);
  __syncthreads();
  trace_max(c, kTrDispItems);
  if (blockIdx.x == 0 && threadIdx.x == 0) c.state->num_tokens = T;
  // The block that stores the counts after its payload: block 0 (the expert expansion; with the message
  // expansion block 0 stored them tagged ahead of the payload).
  const bool counter = chunk_sig ? false : blockIdx.x == 0;
  if (by_message && counter) {  // tokens per (destination, local expert) for the receivers' slot bases
    for (int d = 0; d < R; ++d) {
      const int Ld = c.placement.num_local(d);
      for (int l = threadIdx.x; l < Ld; l += blockDim.x) {
        const int id = c.placement.shared_route && l == Ld - 1 ? c.placement.num_experts : c.placement.range_begin(d) + l;
        const int n = c.placement.local_index(id, rank, d) == l ? s_tot[id] : 0;
        *reinterpret_cast<int32_t*>(c.peers[d] + lay.expert_count_offset(parity, rank, l)) = n;
      }
    }
    __syncthreads();
  }
  trace_at(c, kTrDispCounts);
  // chunk signals: the block's last warp releases the flags and takes no receive work, so the other
  // warps go on to the counts and their expansion items while its release waits for the acknowledgements.
  const bool rel_warp = chunk_sig && W > 1;
  if (rel_warp ? warp == W - 1 && lane < R : threadIdx.x < R) {  // flags after all the block's stores (cumulative release)
    const int d = rel_warp ? lane : static_cast<int>(threadIdx.x);
    if (counter) st_relaxed_sys_u64(c.peers[d] + lay.dispatch_count_offset(parity, rank), static_cast<unsigned long long>(s_count[d]));
    st_release_sys(c.peers[d] + lay.dispatch_flag_offset(rank, blockIdx.x), s_call_send + 1);
  }
  if (threadIdx.x == 0) atomicAdd(&c.state->dispatch_send_blocks, 1ull);
  trace_max(c, 1);
}

/// The message expansion's receive (chunk signals): per source the tagged message counts and slot
/// bases, then (message, run of chunks) items, each waiting on its own chunks' send blocks before its
/// loads, stored into the slot of every local expert the message selects. Warps [0, Wr) only.
template <bool kFp8>
__device__ __forceinline__ void ll_dispatch_recv_messages(const LlDispatchParams& p, uint8_t* smem, const LlDispatchShared& sh, unsigned long long call,
                                                          int parity, bool split, int Wr, int nthr) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nchunks = static_cast<int>((H + kLlChunkElems - 1) / kLlChunkElems);
  unsigned long long &tr_ns0 = sh.tr_ns0, &tr_clk0 = sh.tr_clk0;
  int *s_n = sh.n, *s_bad = sh.bad;
  constexpr bool chunk_sig = true;  // the message expansion always runs with chunk signals
  auto recv_barrier = [&] {
    if (split) named_barrier_sync<1>(nthr);
    else __syncthreads();
  };
  const int L = c.num_local;
  const int64_t cap = static_cast<int64_t>(R) * max_t, gpr = H / 128;
  // (message, 512-element chunk) items over the whole grid: the chunk is loaded once and stored
  // into the slot of each local expert the message selects (its first column naming it). The
  // warp's first item is loaded before the slot bases (its loads overlap the counts' round trip).
  // Runs: (message, run of up to kRunD consecutive chunks) items, so one round covers
  // more of the grid's work (ll-v3: 256 messages x 7 runs of 2 chunks on 2112 warps).
  constexpr int kRunD = 2;
  struct Item {
    int s = 0, j = 0, ch = 0;  // ch: the run's first chunk
    int32_t id = -1, u = -1, hdr = 0;
    float wk = 0.0f, sc[kRunD] = {};
    uint4 a[kRunD] = {}, b2[kRunD] = {};
  };
  // Items over the capacity R x max_T: a warp knows its first item's message before
  // the counts, so its loads, the message counts and the slot-base counts are one round trip after
  // the wait; items of slots j >= the source's count are skipped (their speculative loads unused).
  const int64_t gwarps = static_cast<int64_t>(gridDim.x) * Wr;
  const int cprd = chunks_per_run(nchunks, cap, gwarps, kRunD);
  const int runsd = (nchunks + cprd - 1) / cprd;
  auto load_item = [&](int64_t item, Item& m) {  // all loads of the item at once (one round trip)
    const int flat = udiv(item, runsd);  // = s max_T + j
    m.ch = umod(item, runsd) * cprd;
    m.s = udiv(flat, max_t);
    m.j = flat - m.s * max_t;
    const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, m.s, m.j);
    m.id = -1, m.u = -1, m.hdr = 0, m.wk = 0.0f;
    if (lane < K) {
      m.id = ld32(msg + lay.msg_topk_offset() + 4 * lane);
      m.u = ld32(msg + lay.msg_slots_offset() + 4 * lane);
      if (lay.partial() && m.ch == 0) m.wk = __int_as_float(ld32(msg + lay.msg_weights_offset() + 4 * lane));
    }
    if (m.ch == 0 && lane == 0) m.hdr = ld32(msg);
#pragma unroll
    for (int i = 0; i < kRunD; ++i) {
      const int64_t h0 = static_cast<int64_t>(m.ch + i) * kLlChunkElems + lane * 16;
      if (i >= cprd || m.ch + i >= nchunks) break;
      if constexpr (kFp8) {
        if (h0 < H) m.a[i] = ld16(msg + lay.msg_payload_offset() + h0);
        if (h0 < H && (lane & 7) == 0) m.sc[i] = __int_as_float(ld32(msg + lay.msg_scales_offset() + h0 / 128 * 4));
      } else {
        if (h0 < H) m.a[i] = ld16(msg + lay.msg_payload_offset() + 2 * h0);
        if (h0 + 8 < H) m.b2[i] = ld16(msg + lay.msg_payload_offset() + 2 * (h0 + 8));
      }
    }
  };
  const int64_t items = cap * runsd;
  const int64_t first_recv = static_cast<int64_t>(blockIdx.x) * Wr + warp;
  Item m;
  if (!chunk_sig && first_recv < items) load_item(first_recv, m);
  unsigned long long first_tok = 0;  // chunk signals: the first item's slot-token word, loaded before the counts' round trip
  if (chunk_sig && lane == 0 && first_recv < items) {
    const int flat = udiv(first_recv, runsd), s = udiv(flat, max_t);
    first_tok = ld_relaxed_sys_u64(c.local + lay.slot_token_offset(parity, s, flat - s * max_t));
  }
  if (threadIdx.x == blockDim.x - 1 && blockIdx.x == 0)
    c.state->trace[kTrDispLoadWaited] = tr_ns0 + load_round_trip(c.local + lay.dispatch_count_offset(parity, rank));
  // The message counts (block 0's flag of s was released after them; timed-out sources count 0).
  auto msg_count_of = [&](int s) {
    long long n = static_cast<long long>(ld_relaxed_sys_u64(c.local + lay.dispatch_count_offset(parity, s)));
    return s_bad[s] || n < 0 || n > max_t ? 0 : static_cast<int>(n);
  };
  int32_t* s_base = reinterpret_cast<int32_t*>(smem);  // [L][R]
  if (chunk_sig) {
    // chunk signals: the senders stored their tagged counts before their payload, so they are
    // normally here already: the message counts (s_n) and the slot bases, each word polled until it
    // carries call n's tag (timed-out sources count 0); block 0 writes recv_count and layout_range.
    const uint32_t tag = count_tag(call);
    for (int s = threadIdx.x; s < R; s += nthr) {
      const void* f = c.local + lay.dispatch_count_offset(parity, s);
      unsigned long long v = ld_relaxed_sys_u64(f);
      const bool ok = poll_word(
          c, [&] { return ld_relaxed_sys_u64(f); }, [&](unsigned long long x) { return (x >> 32) == tag; }, s, LlErrorReport::dispatch, call,
          s_bad, v);
      const long long n = ok ? static_cast<long long>(v & 0xffffffffull) : 0;
      s_n[s] = n > max_t ? 0 : static_cast<int>(n);
      if (lay.partial() && blockIdx.x == 0) p.msg_count[s] = s_n[s];
    }
    for (int l = threadIdx.x; l < L; l += nthr) {
      int running = 0;
      for (int s0 = 0; s0 < R; s0 += 8) {  // 8 sources' counts loaded at once
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s0 + i < R ? ld_relaxed_sys_u32(c.local + lay.expert_count_offset(parity, s0 + i, l)) : 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int s = s0 + i;
          if (s >= R) break;
          const void* f = c.local + lay.expert_count_offset(parity, s, l);
          unsigned long long v = w[i];
          const bool ok = poll_word(
              c, [&] { return static_cast<unsigned long long>(ld_relaxed_sys_u32(f)); }, [&](unsigned long long x) { return (x >> 30) == tag; }, s,
              LlErrorReport::dispatch, call, s_bad, v);
          int cnt = ok ? static_cast<int>(v & 0x3fffffffull) : 0;
          if (cnt > max_t) cnt = 0;
          s_base[l * R + s] = running;
          if (blockIdx.x == 0) p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(running) << 32) | cnt;
          running += cnt;
        }
      }
      if (blockIdx.x == 0) p.recv_count[l] = running;
    }
  } else {
  if (threadIdx.x < R) {
    const int n = msg_count_of(threadIdx.x);
    s_n[threadIdx.x] = n;
    if (lay.partial() && blockIdx.x == 0) p.msg_count[threadIdx.x] = n;
  }
  // Slot bases: s_base[l][s] = tokens of sources < s for local expert l (the senders' counts,
  // released with their flags); block 0 also writes recv_count and layout_range.
  for (int l = threadIdx.x; l < L; l += blockDim.x) {
    int running = 0;
    for (int s0 = 0; s0 < R; s0 += 8) {  // 8 sources' counts loaded at once
      int n[8], nm[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) n[i] = s0 + i < R ? ld32(c.local + lay.expert_count_offset(parity, s0 + i, l)) : 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) nm[i] = s0 + i < R ? msg_count_of(s0 + i) : 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int s = s0 + i;
        if (s >= R) break;
        const int cnt = n[i] < 0 || n[i] > nm[i] ? 0 : n[i];
        s_base[l * R + s] = running;
        if (blockIdx.x == 0) p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(running) << 32) | cnt;
        running += cnt;
      }
    }
    if (blockIdx.x == 0) p.recv_count[l] = running;
  }
  }
  recv_barrier();
  trace_at(c, kTrDispBases);
  trace_clk(c, kTrDispBasesCyc, tr_ns0, tr_clk0);
  for (int64_t item = first_recv; item < items; item += gwarps) {
    if (chunk_sig) {
      const int flat = udiv(item, runsd), s = udiv(flat, max_t), j = flat - s * max_t;
      if (j >= s_n[s]) continue;  // beyond the messages s sent (warp-uniform)
      // The source token t of slot j (tagged, stored before the payload) names the send blocks of
      // the message's chunks (the sender's item t * nchunks + c runs on block (item / W_s) % B_s);
      // lane 0 then waits for the flag of chunk 0's block (header, ids, slot ranks), lane 1 + i for
      // chunk ch + i's (acquire), and the warp barrier orders every lane's loads after them.
      const int ch0 = umod(item, runsd) * cprd, fc = lane == 0 ? 0 : ch0 + lane - 1;
      bool ok = true;
      int tok = 0;
      if (lane == 0) {
        const void* f = c.local + lay.slot_token_offset(parity, s, j);
        unsigned long long v = item == first_recv ? first_tok : ld_relaxed_sys_u64(f);
        ok = poll_word(
            c, [&] { return ld_relaxed_sys_u64(f); }, [&](unsigned long long x) { return slot_token_current(x, call, c.debug_token_tag_mask); }, s,
            LlErrorReport::dispatch, call, s_bad, v);
        const uint32_t t32 = static_cast<uint32_t>(v & 0xffffffffull);
        if (t32 >= static_cast<uint32_t>(max_t)) ok = false;  // malformed (or kLlNoToken): the message is dropped
        tok = ok ? static_cast<int>(t32) : 0;
      }
      tok = __shfl_sync(0xffffffffu, tok, 0);
      ok = __shfl_sync(0xffffffffu, ok, 0);
      if (ok && lane <= cprd && fc < nchunks) {
        const int ws = c.src_warps[s] > 0 ? c.src_warps[s] : 1, bs = c.src_blocks[s] > 0 ? c.src_blocks[s] : 1;
        const int b = udiv(static_cast<int64_t>(tok) * nchunks + fc, ws) % bs;
        const void* f = c.local + lay.dispatch_flag_offset(s, b);
        unsigned long long v = ld_acquire_sys(f);
        ok = poll_word(
            c, [&] { return ld_acquire_sys(f); }, [&](unsigned long long x) { return x >= call + 1; }, s, LlErrorReport::dispatch, call, s_bad,
            v);
      }
      ok = __all_sync(0xffffffffu, ok);
      __syncwarp();
      if (!ok) continue;  // timed out (reported): the message is dropped
      load_item(item, m);
    } else if (item != first_recv) {
      const int flat = udiv(item, runsd), s = udiv(flat, max_t);
      if (flat - s * max_t >= s_n[s]) continue;  // beyond the messages s sent (warp-uniform)
      load_item(item, m);
    } else if (m.j >= s_n[m.s]) {
      continue;
    }
    const int s = m.s, ch = m.ch;
    int l = m.id >= 0 ? c.placement.local_index(m.id, s, rank) : -1;
    int slot = l >= 0 ? s_base[l * R + s] + m.u : -1;
    if (l >= 0 && (m.u < 0 || slot >= cap)) l = -1, slot = -1;  // a malformed message: dropped, never out of bounds
    bool first = true;  // no earlier column names the same id
    for (int k = 0; k < K; ++k) {
      const int32_t other = __shfl_sync(0xffffffffu, m.id, k);
      if (k < lane && other == m.id) first = false;
    }
    const int32_t hdr = __shfl_sync(0xffffffffu, m.hdr, 0);
    if (ch == 0 && lay.partial()) {  // the handle's per-message rows (duplicates share the row)
      const int64_t mi = static_cast<int64_t>(s) * max_t + m.j;
      if (lane < K) {
        p.msg_rows[mi * K + lane] = l >= 0 ? static_cast<int32_t>(l * cap + slot) : -1;
        p.msg_weights[mi * K + lane] = m.wk;
      }
      if (lane == 0) p.msg_src_token[mi] = hdr;
    }
    unsigned sel = __ballot_sync(0xffffffffu, lane < K && l >= 0 && first);
    while (sel) {
      const int k = __ffs(sel) - 1;
      sel &= sel - 1;
      const int lk = __shfl_sync(0xffffffffu, l, k), sk = __shfl_sync(0xffffffffu, slot, k);
      const int64_t row = static_cast<int64_t>(lk) * cap + sk;
#pragma unroll
      for (int i = 0; i < kRunD; ++i) {
        const int64_t h0 = static_cast<int64_t>(ch + i) * kLlChunkElems + lane * 16;
        if (i >= cprd || ch + i >= nchunks) break;
        if constexpr (kFp8) {
          if (h0 < H) st16(p.out_x + row * H + h0, m.a[i]);
          if (h0 < H && (lane & 7) == 0) p.out_scales[row * gpr + h0 / 128] = m.sc[i];
        } else {
          if (h0 < H) st16(p.out_x + (row * H + h0) * 2, m.a[i]);
          if (h0 + 8 < H) st16(p.out_x + (row * H + h0 + 8) * 2, m.b2[i]);
        }
      }
      if (ch == 0 && lane == 0) {
        p.src_rank[row] = s;
        p.src_token[row] = hdr;
        p.topk_column[row] = k;
      }
    }
  }
}

/// The expert expansion's receive (block signals, after the wait on every source's flags): per local
/// expert, the messages that select it (ballots over the ids staged in shared memory), their slots by
/// a scan, the handle's rows, then the copy of every selected message into its slot.
template <bool kFp8>
__device__ __forceinline__ void ll_dispatch_recv_experts(const LlDispatchParams& p, uint8_t* smem, const LlDispatchShared& sh, int parity) {
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank;
  const int64_t H = lay.hidden;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int nchunks = static_cast<int>((H + kLlChunkElems - 1) / kLlChunkElems);
  int& s_total = sh.total;
  int* s_n = sh.n;
  const int CPS = (max_t + 31) / 32, Q = R * CPS;
  const int64_t cap = static_cast<int64_t>(R) * max_t;  // slots per expert
  int16_t* s_loc = reinterpret_cast<int16_t*>(smem);                                    // [R * max_t * K]
  uint32_t* s_qmask = reinterpret_cast<uint32_t*>(smem + ll_align_up(2 * cap * K, 16)); // [Q]
  int32_t* s_qbase = reinterpret_cast<int32_t*>(s_qmask + Q);                           // [Q]
  int32_t* s_info = s_qbase + Q;                                                        // [R * max_t]
  int8_t* s_sel = reinterpret_cast<int8_t*>(s_info + cap);                              // [Q * 32]
  const int64_t gpr = H / 128;  // scale groups per row (fp8)
  // 0. Every block: the local expert index of every column of every message, into shared memory
  //    (16-byte id loads, one round trip for R * max_t * K / 4 <= blockDim ids vectors).
  if (blockIdx.x < c.num_local) {
    const int nvec = (K + 3) / 4, per_src = max_t * nvec;
    for (int v = threadIdx.x; v < R * per_src; v += blockDim.x) {
      const int s = v / per_src, r = v - s * per_src, j = r / nvec, i = r - j * nvec;
      if (j >= s_n[s]) continue;
      const uint4 q = ld16(c.local + lay.dispatch_msg_offset(parity, s, j) + lay.msg_topk_offset() + 16 * i);
      const int32_t w4[4] = {static_cast<int32_t>(q.x), static_cast<int32_t>(q.y), static_cast<int32_t>(q.z), static_cast<int32_t>(q.w)};
      int16_t* dst = s_loc + (static_cast<int64_t>(s) * max_t + j) * K + 4 * i;
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (4 * i + u < K) dst[u] = static_cast<int16_t>(c.placement.local_index(w4[u], s, rank));
    }
  }
  if (lay.partial() && blockIdx.x == 0 && threadIdx.x < R) p.msg_count[threadIdx.x] = s_n[threadIdx.x];
  __syncthreads();
  for (int l = blockIdx.x; l < c.num_local; l += gridDim.x) {
    // 1. Which messages select l (first column naming it), 32 messages per ballot, from shared memory.
    for (int qi = warp; qi < Q; qi += W) {
      const int s = qi / CPS, j = (qi % CPS) * 32 + lane;
      int sel = -1;
      if (j < s_n[s]) {
        const int16_t* loc = s_loc + (static_cast<int64_t>(s) * max_t + j) * K;
        for (int k = 0; k < K; ++k)
          if (loc[k] == l) {
            sel = k;
            break;
          }
      }
      const unsigned b = __ballot_sync(0xffffffffu, sel >= 0);
      if (lane == 0) s_qmask[qi] = b;
      s_sel[qi * 32 + lane] = static_cast<int8_t>(sel);
    }
    __syncthreads();
    // 2. Exclusive scan of the ballot counts: slots in (source rank, source token) order.
    if (warp == 0) {
      int running = 0;
      for (int q0 = 0; q0 < Q; q0 += 32) {
        const int qi = q0 + lane;
        const int cnt = qi < Q ? __popc(s_qmask[qi]) : 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (qi < Q) s_qbase[qi] = running + incl - cnt;
        running += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) s_total = running;
    }
    __syncthreads();
    for (int qi = warp; qi < Q; qi += W) {
      const unsigned b = s_qmask[qi];
      if ((b >> lane) & 1u) s_info[s_qbase[qi] + __popc(b & lanemask_lt())] = (qi * 32 + lane) | (static_cast<int>(s_sel[qi * 32 + lane]) << 24);
    }
    const int total = s_total;
    if (threadIdx.x < R) {
      const int s = threadIdx.x;
      const int begin = s_qbase[s * CPS], end = s + 1 < R ? s_qbase[(s + 1) * CPS] : total;
      p.layout_range[static_cast<int64_t>(l) * R + s] = (static_cast<int64_t>(begin) << 32) | static_cast<int64_t>(end - begin);
    }
    if (threadIdx.x == 0) p.recv_count[l] = total;
    __syncthreads();
    if (lay.partial()) {
      // The handle's per-message rows: every column naming l (duplicates too) -> l's slot.
      for (int slot = threadIdx.x; slot < total; slot += blockDim.x) {
        const int code = s_info[slot] & 0xffffff;
        const int s = code / (CPS * 32), j = code % (CPS * 32);
        const int64_t mi = static_cast<int64_t>(s) * max_t + j;
        for (int k = 0; k < K; ++k)
          if (s_loc[mi * K + k] == l) p.msg_rows[mi * K + k] = static_cast<int32_t>(l * cap + slot);
      }
      if (l == 0) {  // one block writes the rest: -1 rows, weights, source tokens
        const int nvec = (K + 3) / 4;
        for (int v = threadIdx.x; v < R * max_t; v += blockDim.x) {
          const int s = v / max_t, j = v - s * max_t;
          if (j >= s_n[s]) continue;
          const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, s, j);
          uint4 wv[8];
          ld16_batch(msg + lay.msg_weights_offset(), nvec, wv);
          const int32_t src_token = static_cast<int32_t>(ld16(msg).x);
          p.msg_src_token[v] = src_token;
#pragma unroll
          for (int k = 0; k < kLlMaxTopK; ++k) {  // unrolled: wv stays in registers
            if (k >= K) break;
            p.msg_weights[static_cast<int64_t>(v) * K + k] = __int_as_float(word_of(wv, k));
            if (s_loc[static_cast<int64_t>(v) * K + k] < 0) p.msg_rows[static_cast<int64_t>(v) * K + k] = -1;
          }
        }
      }
    }
    // 3. Copy every selected message into its slot: (slot, chunk) items, kInFlight per warp with
    //    all their loads issued before the stores.
    constexpr int kInFlight = kFp8 ? 4 : 2;
    const int copy_items = total * nchunks;
    for (int base = warp; base < copy_items; base += kInFlight * W) {
      uint4 a[kInFlight], b2[kInFlight];
      float sc[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int item = base + u * W;
        if (item >= copy_items) continue;
        const int slot = item / nchunks, ch = item - slot * nchunks;
        const int code = s_info[slot] & 0xffffff;
        const uint8_t* msg = c.local + lay.dispatch_msg_offset(parity, code / (CPS * 32), code % (CPS * 32));
        const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
        if constexpr (kFp8) {
          if (h0 < H) a[u] = ld16(msg + lay.msg_payload_offset() + h0);
          if (h0 < H && (lane & 7) == 0) sc[u] = *reinterpret_cast<const float*>(msg + lay.msg_scales_offset() + h0 / 128 * 4);
        } else {
          if (h0 < H) a[u] = ld16(msg + lay.msg_payload_offset() + 2 * h0);
          if (h0 + 8 < H) b2[u] = ld16(msg + lay.msg_payload_offset() + 2 * (h0 + 8));
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int item = base + u * W;
        if (item >= copy_items) continue;
        const int slot = item / nchunks, ch = item - slot * nchunks;
        const int info = s_info[slot];
        const int code = info & 0xffffff, sel = info >> 24;
        const int s = code / (CPS * 32), j = code % (CPS * 32);
        const int64_t row = static_cast<int64_t>(l) * cap + slot;
        const int64_t h0 = static_cast<int64_t>(ch) * kLlChunkElems + lane * 16;
        if constexpr (kFp8) {
          if (h0 < H) st16(p.out_x + row * H + h0, a[u]);
          if (h0 < H && (lane & 7) == 0) p.out_scales[row * gpr + h0 / 128] = sc[u];
        } else {
          if (h0 < H) st16(p.out_x + (row * H + h0) * 2, a[u]);
          if (h0 + 8 < H) st16(p.out_x + (row * H + h0 + 8) * 2, b2[u]);
        }
        if (ch == 0 && lane == 0) {
          p.src_rank[row] = s;
          p.src_token[row] = static_cast<int32_t>(ld16(c.local + lay.dispatch_msg_offset(parity, s, j)).x);
          p.topk_column[row] = sel;
        }
      }
    }
    __syncthreads();  // shared arrays are reused for the next expert
  }
}

}  // namespace
}  // namespace epx::dispatch

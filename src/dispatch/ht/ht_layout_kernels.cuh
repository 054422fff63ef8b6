// dispatch/ht/ht_layout_kernels.cuh: the ht layout kernel: the cached-routing check, the plan (DedupCpu::plan),
// the count exchange with every rank and the derived offsets (device helpers: ht_device.cuh).
#pragma once

#include "dispatch/ht/ht_device.cuh"

namespace epx::dispatch::ht {

// ---- layout + count exchange ----------------------------------------------------------------------

/// Step 3 of layout_kernel: this rank's slot in every rank's buffer (itself included): rows to each
/// destination, the status word, 0, then the destination's per-local-expert counts. CTA-wide.
__device__ __forceinline__ void layout_publish(const HtParams& p, uint64_t epoch, int32_t status, const int32_t* expert_counts) {
  const HtLayout& l = p.l;
  const int R = l.num_ranks, me = l.rank, Lmax = l.max_local;
  HtState& st = state_of(p);
for (int d = 0; d < R; ++d) {
  int32_t* slot = reinterpret_cast<int32_t*>(p.peers[d] + l.slot_offset(epoch, me));
  const int n = R + 2 + Lmax;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    int32_t v;
    if (i < R) v = st.rows_to[i];
    else if (i == R) v = status;
    else if (i == R + 1) v = 0;
    else v = expert_counts[d * Lmax + (i - R - 2)];
    slot[i] = v;
  }
}
}

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(HtParams p) {
  const HtLayout& l = p.l;
  const int R = l.num_ranks, K = l.top_k, me = l.rank, Lmax = l.max_local;
  HtState& st = state_of(p);
  int32_t* expert_counts = arr<int32_t>(p, p.a.expert_counts);
  int32_t* cached_idx = arr<int32_t>(p, p.a.cached_idx);
  int32_t* send_pos = arr<int32_t>(p, p.a.send_pos);
  int32_t* send_tok = arr<int32_t>(p, p.a.send_tok);
  uint8_t* in_rank = arr<uint8_t>(p, p.a.is_token_in_rank);

  __shared__ int s_warp[32];
  __shared__ unsigned long long s_bad;
  __shared__ int s_rows[kHtMaxRanks];
  __shared__ int s_valid, s_fail, s_differs, s_contig, s_bad_tokens, s_bad_tokens_value;
  __shared__ int64_t s_T;
  __shared__ uint64_t s_epoch;
  extern __shared__ int s_counts[];  // [R * Lmax], then the slots' copy [R, R + 2 + Lmax] (step 5)

  if (threadIdx.x == 0) {
    // The dispatch kernel (programmatic dependent launch) may start once this CTA has passed
    // pdl_launch_dependents below; it polls layout_ready, so clear it first.
    st.layout_ready = 0;
    for (int i = 0; i < kTlCount; ++i)
      st.timeline[i] = (i == kTlDispatchStart || i == kTlCombineStart || i == kTlDispatchReady) ? ~0ull : 0ull;
    st.timeline[kTlLayoutStart] = globaltimer();
    __threadfence();
    s_epoch = st.epoch_dispatch + 1;
    s_bad = ULLONG_MAX;
    s_valid = 0;
    s_fail = 0;
    s_contig = 0;
    // T: the device token count when given (0 <= value <= x.shape[0], else a bad argument: nothing moves).
    int64_t t_now = p.num_tokens;
    s_bad_tokens = 0;
    s_bad_tokens_value = 0;
    if (p.num_tokens_dev) {
      const int32_t v = *p.num_tokens_dev;
      s_bad_tokens = v < 0 || v > p.num_tokens;
      s_bad_tokens_value = v;
      t_now = s_bad_tokens ? 0 : v;
    }
    s_T = t_now;
    st.num_tokens = static_cast<int32_t>(t_now);
    s_differs = !(st.cache_valid && st.cache_tokens == t_now) || p.local_status != 0 || s_bad_tokens;
  }
  __syncthreads();
  pdl_launch_dependents();
  const int64_t T = s_T;
  const uint64_t epoch = s_epoch;
  const uint64_t deadline = globaltimer() + p.timeout_ns;

  // 1. Same routing as the cached layout? (ids are compared as the cache stores them: int32)
  if (!s_differs) {
    bool differs = false;
    if (!p.idx_is_i64 && reinterpret_cast<uintptr_t>(p.topk_idx) % 16 == 0 && (T * K) % 4 == 0) {
      // int32 ids, 16-byte vectors: 8 loads per thread at ht-v3 (32 K ids), all in flight at once.
      const int4* a = reinterpret_cast<const int4*>(p.topk_idx);
      const int4* b = reinterpret_cast<const int4*>(cached_idx);
#pragma unroll 8
      for (int64_t i = threadIdx.x; i < T * K / 4; i += blockDim.x) {
        const int4 x = a[i], y = b[i];
        differs |= x.x != y.x || x.y != y.y || x.z != y.z || x.w != y.w;
      }
    } else {
#pragma unroll 8
      for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) differs |= load_id(p.topk_idx, p.idx_is_i64, i) != cached_idx[i];
    }
    if (__syncthreads_or(differs) && threadIdx.x == 0) s_differs = 1;
    __syncthreads();
  }
  const bool hit = !s_differs;
  int32_t status = s_bad_tokens ? 1 : p.local_status;

  // 2. Validate and plan (DedupCpu::plan), unless cached.
  if (!hit && status == 0) {
    for (int64_t i = threadIdx.x; i < T * K; i += blockDim.x) {
      const int64_t v = load_id(p.topk_idx, p.idx_is_i64, i);
      if (!l.placement.valid_id(v, i % K, K)) atomicMin(&s_bad, static_cast<unsigned long long>(i));
    }
    __syncthreads();
    if (s_bad != ULLONG_MAX) status = 1;
  }
  if (!hit && status == 0) {
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) s_counts[i] = 0;
    if (threadIdx.x < R) s_rows[threadIdx.x] = 0;
    __syncthreads();
    int valid = 0;
    for (int64_t chunk = 0; chunk < T; chunk += blockDim.x) {
      const int64_t t = chunk + threadIdx.x;
      const bool live = t < T;
      int32_t ids[32];  // K <= 32 checked at create; a larger K takes the reload path below
      unsigned dest_mask = 0;
      if (live) {
        for (int k = 0; k < K; ++k) {
          const int32_t id = static_cast<int32_t>(load_id(p.topk_idx, p.idx_is_i64, t * K + k));
          if (k < 32) ids[k] = id;
          cached_idx[t * K + k] = id;
          if (id < 0) continue;
          ++valid;
          const int d = l.placement.dest_rank(id, me);
          dest_mask |= 1u << d;
          bool first = true;  // a duplicate expert counts its row once
          for (int j = 0; j < k && first; ++j) first = (j < 32 ? ids[j] : cached_idx[t * K + j]) != id;
          if (first) atomicAdd(&s_counts[d * Lmax + l.placement.local_index(id, me, d)], 1);
        }
      }
      for (int d = 0; d < R; ++d) {
        const int goes = live && ((dest_mask >> d) & 1u);
        const int base = s_rows[d];  // read before the scan's barriers; thread 0 updates it after them
        int total = 0;
        const int before = block_exclusive_scan(goes, s_warp, total);
        if (live) {
          send_pos[t * R + d] = goes ? base + before : -1;
          if (goes) send_tok[d * l.capacity + base + before] = static_cast<int32_t>(t);
          in_rank[t * R + d] = static_cast<uint8_t>(goes);
        }
        if (threadIdx.x == 0) s_rows[d] = base + total;
        __syncthreads();
      }
    }
    atomicAdd(&s_valid, valid);
    __syncthreads();
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) expert_counts[i] = s_counts[i];
    if (threadIdx.x == 0) {
      int dedup = 0;
      for (int d = 0; d < R; ++d) {
        st.rows_to[d] = s_rows[d];
        dedup += s_rows[d];
      }
      st.valid_selections = s_valid;
      st.dedup_rows = dedup;
      st.cache_valid = 1;
      st.cache_tokens = static_cast<int32_t>(T);
    }
  } else if (!hit) {
    // Bad arguments: publish zero rows; the cache no longer describes anything.
    if (threadIdx.x == 0) {
      for (int d = 0; d < R; ++d) st.rows_to[d] = 0;
      st.valid_selections = 0;
      st.dedup_rows = 0;
      st.cache_valid = 0;
    }
    for (int i = threadIdx.x; i < R * Lmax; i += blockDim.x) expert_counts[i] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) st.timeline[kTlLayoutPlanned] = globaltimer();

  // 3. Publish this rank's slot to every rank (itself included), then the counts flag.
  layout_publish(p, epoch, status, expert_counts);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    for (int d = 0; d < R; ++d) st_release_sys(flag_ptr(p, d, kFlagCounts, me), epoch);
    st.timeline[kTlLayoutPublished] = globaltimer();
  }
  // 4. Wait for every source's slot.
  if (threadIdx.x < R && !wait_flag(p, kFlagCounts, threadIdx.x, epoch, deadline)) {
    report_timeout(p, threadIdx.x, kOpLayout);
    s_fail = 1;
  }
  __syncthreads();
  if (s_fail) {
    if (threadIdx.x == 0) {
      st.failed = 1;
      st.epoch_dispatch = epoch;
      __threadfence();
      st_release_gpu(&st.layout_ready, 1);
      __threadfence_system();
      *reinterpret_cast<volatile uint64_t*>(&p.record->layout_epoch) = epoch;
    }
    return;
  }
  if (threadIdx.x == 0) st.timeline[kTlLayoutCountsSeen] = globaltimer();

  // 5. Derive: count matrix, rank prefix matrix, offsets, N_recv, aligned per-expert counts, from a
  // copy of the R slots in shared memory (one parallel load instead of thread 0's chain of loads).
  const int32_t* my_slots = reinterpret_cast<const int32_t*>(p.peers[me] + l.slot_offset(epoch, 0));
  const int slot_words = R + 2 + Lmax;
  int* s_slots = s_counts + R * Lmax;  // [R, slot_words]
  for (int i = threadIdx.x; i < R * slot_words; i += blockDim.x) s_slots[i] = my_slots[(i / slot_words) * (l.slot_bytes / 4) + i % slot_words];
  __syncthreads();
  auto slot_word = [&](int s, int i) { return s_slots[s * slot_words + i]; };
  int32_t* recv_count = arr<int32_t>(p, p.a.recv_count);
  const int L = l.placement.num_local(me);
  int any_bad = 0, bad_rank = -1;
  for (int s = 0; s < R; ++s)
    if (slot_word(s, R) != 0 && bad_rank < 0) bad_rank = s;
  any_bad = bad_rank >= 0;
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += slot_word(s, R + 2 + e);
    const int a = p.expert_alignment;
    recv_count[e] = any_bad ? 0 : (sum + a - 1) / a * a;
    atomicAdd(&s_contig, recv_count[e]);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int d = 0; d < R; ++d) {
      int acc = 0;
      for (int s = 0; s < R; ++s) {
        const int n = any_bad ? 0 : slot_word(s, d);
        acc += n;
        st.rank_prefix_matrix[s * R + d] = acc;
      }
      int off = 0;
      for (int s = 0; s < me; ++s) off += any_bad ? 0 : slot_word(s, d);
      st.dst_offset[d] = off;
    }
    int off = 0;
    for (int s = 0; s < R; ++s) {
      st.recv_offset[s] = off;
      off += any_bad ? 0 : slot_word(s, me);
    }
    st.recv_offset[R] = off;
    st.num_recv = off;
    st.any_bad = any_bad;
    *arr<int32_t>(p, p.a.num_recv_device) = off;
    st.epoch_dispatch = epoch;
    st.timeline[kTlLayoutEnd] = globaltimer();
    // Everything the dispatch kernel reads is in place: release it (gpu scope), then the host record
    // (host-mapped writes and their system fence, off the dispatch's critical path).
    __threadfence();
    st_release_gpu(&st.layout_ready, 1);
    HtHostRecord* rec = p.record;
    // The bad-argument details are written only by a bad layout, and stay until the next bad one (bad_epoch
    // below): a later good layout must not erase a verdict the host has not read yet (worst-case mode reads
    // it after a later launch, or after graph replays).
    if (any_bad) {
      rec->bad_num_tokens = s_bad_tokens;
      rec->bad_num_tokens_value = s_bad_tokens_value;
      rec->bad_rank = bad_rank;
      rec->bad_index = s_bad == ULLONG_MAX ? -1 : static_cast<int64_t>(s_bad);
    }
    rec->num_recv = off;
    rec->any_bad = any_bad;
    rec->cache_hit = hit;
    rec->valid_selections = any_bad ? 0 : st.valid_selections;
    rec->dedup_rows = any_bad ? 0 : st.dedup_rows;
    rec->rows_to_self = any_bad ? 0 : st.rows_to[me];
    rec->rows_from_others = any_bad ? 0 : off - slot_word(me, me);
    rec->contig_rows = s_contig;
    st.timeline[kTlLayoutRecord] = globaltimer();
    __threadfence_system();
    if (any_bad) *reinterpret_cast<volatile uint64_t*>(&rec->bad_epoch) = epoch;
    *reinterpret_cast<volatile uint64_t*>(&rec->layout_epoch) = epoch;
  }
}

}  // namespace epx::dispatch::ht

// dispatch/ll/ll_cuda_kernels.cu: the LL dispatch and combine kernels (one kernel per phase, all
// blocks resident, warps on 512-element chunks of a row, 16-byte loads and stores straight into the
// peers' symmetric buffers through their LSA pointers). Protocol: ll_cuda.h; layout: ll_layout.h.
// The kernels call their phases in order (ll_dispatch_phases.cuh, ll_combine_phases.cuh; helpers:
// ll_device.cuh; memory-order primitives: cuda/primitives.cuh).
//
// Memory ordering (NCCL-DEVICE-API.md §3): payload stores are weak; each block ends its send part
// with __syncthreads() and then one thread per destination issues st.release.sys on the block's own
// flag word there (cumulative release, as NCCL's own barrier does). Receivers poll with
// ld.acquire.sys, one flag per thread (wait_all_flags), __syncthreads(), then read the payload with
// ordinary (coherent) loads, never ld.global.nc.
// Arithmetic matches the CPU reference bit for bit: the FP8 1x128 quantization of quant_cpu.cpp
// (fmaxf amax, IEEE divisions, UE8M0 from the bits, RNE + saturation) and the combine's
// acc = acc + w * y in fp32 with separate roundings (__fmul_rn / __fadd_rn: no FMA contraction).

#include "cuda/check.h"
#include "dispatch/ll/ll_cuda_kernels.h"
#include "dispatch/ll/ll_combine_phases.cuh"
#include "dispatch/ll/ll_dispatch_phases.cuh"
#include "epx/error.h"

namespace epx::dispatch {
namespace {

// kMaxThreads: 1024 (64 registers per thread, a few spilled) or 512 (128 registers); the launch picks
// the smallest that holds the block.
// kMessage: the message expansion with chunk signals (LlCommon::expand_message, ll_cuda.h); false: the
// expert expansion with block signals, the fallback where the message expansion's bitmaps do not fit in
// shared memory. The other's code is compiled out (a smaller kernel: its instructions are fetched cold on
// every SM at every launch).
template <bool kFp8, int kMaxThreads, bool kMessage>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_dispatch_kernel(const __grid_constant__ LlDispatchParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, max_t = lay.max_tokens;
  const int warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  __shared__ unsigned long long s_call_send, s_call_recv;
  __shared__ int s_T, s_total;
  __shared__ int s_count[kLlMaxRanks], s_n[kLlMaxRanks], s_bad[kLlMaxRanks], s_mp[kLlMaxRanks + 1];
  __shared__ unsigned long long tr_ns0, tr_clk0;  // block 0's start (trace_clk; shared: no registers held)
  const LlDispatchShared sh{s_call_send, s_call_recv, s_T, s_total, s_count, s_n, s_bad, s_mp, tr_ns0, tr_clk0};
  constexpr bool by_message = kMessage;
  LlDispatchFront f;
  ll_dispatch_front<kMessage>(p, smem, sh, f);

  if (p.send) ll_dispatch_send<kFp8, kMessage>(p, smem, sh, f);

  if (p.recv) {
    const unsigned long long call = s_call_recv;
    const int parity = static_cast<int>(call & 1);
    constexpr bool chunk_sig = kMessage;  // chunk signals: per-item waits on the send blocks' flags
    // chunk signals: warps [0, Wr) receive (the last one released the flags, the chunk signals above;
    // their barrier is the named barrier 1); s_bad was cleared at the front.
    const bool split = chunk_sig && W > 1;
    const int Wr = split ? W - 1 : W, nthr = 32 * Wr;
    auto recv_barrier = [&] {
      if (split) named_barrier_sync<1>(nthr);
      else __syncthreads();
    };
    if (!chunk_sig) {
      if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
      __syncthreads();
    }
    if (!chunk_sig) wait_all_flags(
        c, [&](int s) { return c.local + lay.dispatch_flag_offset(s, 0); }, call + 1, LlErrorReport::dispatch, call, s_bad,
        [&](int s) {  // block 0's flag of s was released after the count
          if constexpr (!by_message) {  // (the message expansion loads the counts after the wait, with the rest)
            long long n = static_cast<long long>(ld_relaxed_sys_u64(c.local + lay.dispatch_count_offset(parity, s)));
            if (n < 0 || n > max_t) n = 0;
            s_n[s] = static_cast<int>(n);
          }
        });
    if (!chunk_sig) __syncthreads();
    if constexpr (!by_message) {
      if (threadIdx.x == 0) {  // timed-out sources count 0; s_mp: prefix of the message counts
        s_mp[0] = 0;
        for (int s = 0; s < R; ++s) {
          if (s_bad[s]) s_n[s] = 0;
          s_mp[s + 1] = s_mp[s] + s_n[s];
        }
      }
      __syncthreads();
    }
    trace_at(c, 2);
    trace_max(c, 10);
    if constexpr (by_message) {
      if (warp < Wr) ll_dispatch_recv_messages<kFp8>(p, smem, sh, call, parity, split, Wr, nthr);  // the releasing warp skips the receive work
    } else {
      ll_dispatch_recv_experts<kFp8>(p, smem, sh, parity);
    }
    if (threadIdx.x == 0) atomicAdd(&c.state->dispatch_recv_blocks, 1ull);
    __syncthreads();  // the whole block is done
    trace_max(c, kTrDispDone);
  }
}

// ---- combine -----------------------------------------------------------------------------------

template <int kMaxThreads, bool kData>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_combine_kernel(const __grid_constant__ LlCombineParams p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const LlCommon& c = p.c;
  const LlLayout& lay = c.lay;
  const int R = lay.num_ranks, K = lay.top_k, max_t = lay.max_tokens, rank = c.rank, L = c.num_local;
  const int64_t H = lay.hidden, cap = static_cast<int64_t>(R) * max_t;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const bool partial = lay.partial(), f32 = lay.combine == 1;
  __shared__ unsigned long long s_call_send, s_call_recv;
  __shared__ int s_bad[kLlMaxRanks];
  __shared__ unsigned long long tr_ns0, tr_clk0;  // block 0's start (trace_clk; shared: no registers held)
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    tr_ns0 = globaltimer();
    tr_clk0 = clock64();
    c.state->trace[4] = tr_ns0;
  }
  trace_max(c, 9);
  // Partial modes: the send part's warps take runs and read the call number themselves with their
  // first item's routing (one round trip less); s_call_send is read by the flags only, after a sync.
  constexpr bool data = kData;  // ll.combine_wait = data (partial modes)
  const bool run_send = partial;
  bool gave_up = false;  // ll.combine_wait = data: this thread's waits timed out
  if (threadIdx.x == 0) {  // both loads out before either division waits
    const unsigned long long cs = ld_volatile_u64(&c.state->combine_send_blocks), cr = ld_volatile_u64(&c.state->combine_recv_blocks);
    s_call_send = div_blocks(cs, gridDim.x);
    s_call_recv = div_blocks(cr, gridDim.x);
    // ll.combine_wait = data: tell every peer how many combine receives this rank has finished (all
    // of them before this kernel, stream order), so its sends may reuse those regions.
    if (data && p.send && blockIdx.x == 0)
      for (int d = 0; d < R; ++d)
        if (d != rank) st_release_sys(c.peers[d] + lay.combine_flag_offset(rank, 0), s_call_recv);
  }
  if (!(p.send && run_send)) __syncthreads();

  if (!kData && p.send && p.rejected) {  // this rank refused its finalize arguments: no rows, marked flags
    if (run_send) __syncthreads();  // s_call_send (the sync above was skipped)
    const unsigned long long flag = (s_call_send + 1) | kLlFlagRejected;
    if (threadIdx.x < R) st_release_sys(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), flag);
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
  } else if (p.send && run_send) {
    combine_send_runs<kMaxThreads <= 512 ? 4 : 2, kMaxThreads <= 512 ? 4 : 2, kData>(p, W, warp, lane, &gave_up);
    __syncthreads();
    trace_max(c, kTrCombItems);
    if constexpr (data) {  // no flags: the rows are the signal; the counter numbers the calls
      if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    } else {
      if (threadIdx.x < R) st_release_sys(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), s_call_send + 1);
      if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    }
    trace_max(c, 5);
  } else if (!kData && p.send) {  // column mode
    const int parity = static_cast<int>(s_call_send & 1);
    // Items are (slot, chunk), a slot of some local expert (prefix over recv_count[L]).
    const int G = L;
    int32_t* s_pref = reinterpret_cast<int32_t*>(smem);  // [G + 1]
    // All threads load the counts at once (one memory latency), then warp 0 scans in shared memory.
    for (int g = threadIdx.x; g < G; g += blockDim.x) s_pref[g] = p.recv_count[g];
    __syncthreads();
    if (warp == 0) {
      int running = 0;
      for (int g0 = 0; g0 < G; g0 += 32) {
        const int g = g0 + lane;
        const int cnt = g < G ? s_pref[g] : 0;
        int incl = cnt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int v = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += v;
        }
        if (g < G) s_pref[g] = running + incl - cnt;
        running += __shfl_sync(0xffffffffu, incl, 31);
      }
      if (lane == 0) s_pref[G] = running;
    }
    __syncthreads();
    trace_at(c, kTrCombCounts);
    // (slot, 1024-element chunk) items: 4 independent 16-byte loads per lane, then 4 stores.
    const int nch = static_cast<int>((H + 1023) / 1024);
    const int64_t items = static_cast<int64_t>(s_pref[L]) * nch;
    for (int64_t item = static_cast<int64_t>(blockIdx.x) * W + warp; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
      const int flat = static_cast<int>(item / nch), ch = static_cast<int>(item % nch);
      int lo = 0, hi = L;  // largest l with s_pref[l] <= flat
      while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (s_pref[mid] <= flat) lo = mid;
        else hi = mid;
      }
      const int64_t row = static_cast<int64_t>(lo) * cap + (flat - s_pref[lo]);
      const int s = p.src_rank[row], t = p.src_token[row], k = p.topk_column[row];
      const uint16_t* src = p.expert_out + row * H;
      uint8_t* dst = c.peers[s] + lay.combine_row_offset(parity, t, k);
      uint4 v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t h = static_cast<int64_t>(ch) * 1024 + i * 256 + lane * 8;
        if (h < H) v[i] = __ldg(reinterpret_cast<const uint4*>(src + h));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int64_t h = static_cast<int64_t>(ch) * 1024 + i * 256 + lane * 8;
        if (h < H) st16(dst + 2 * h, v[i]);
      }
    }
    __syncthreads();
    trace_max(c, kTrCombItems);
    if (threadIdx.x < R) st_release_sys(c.peers[threadIdx.x] + lay.combine_flag_offset(rank, blockIdx.x), s_call_send + 1);
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_send_blocks, 1ull);
    trace_max(c, 5);
  }

  if constexpr (kData) {
    if (p.recv) {
      if (f32) combine_recv_data<2, true>(p, W, warp, lane, &s_call_recv, &gave_up);
      else combine_recv_data<2, false>(p, W, warp, lane, &s_call_recv, &gave_up);
      __syncthreads();
      trace_at(c, kTrCombReduced0);
      trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
      trace_max(c, 7);
    }
    return;
  }
  if (p.recv && partial) {
    combine_recv_runs<2>(p, W, warp, lane, &s_call_recv, s_bad);
    __syncthreads();
    trace_at(c, kTrCombReduced0);
    trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
    trace_max(c, 7);
  } else if (p.recv) {  // column mode
    if (threadIdx.x < R) s_bad[threadIdx.x] = 0;
    __syncthreads();  // s_call_recv (read before a sync that the send part may have skipped)
    const unsigned long long call = s_call_recv;
    const int parity = static_cast<int>(call & 1);
    // This rank's own routing (written by its dispatch, an earlier kernel) is loaded before the wait
    // on the peers, for the warp's first item: its latency hides behind the wait.
    const int T = *reinterpret_cast<const volatile int32_t*>(&c.state->num_tokens);
    const int nch = static_cast<int>((H + 255) / 256);
    const int64_t items = p.rejected ? 0 : static_cast<int64_t>(T) * nch;  // rejected: out is not written
    const int64_t first_item = static_cast<int64_t>(blockIdx.x) * W + warp;
    int32_t my_first = -1;
    float my_w = 0.0f;
    auto load_routing = [&](int t) {
      if (lane < K) {
        my_first = p.first_col[static_cast<int64_t>(t) * K + lane];
        my_w = p.weights[static_cast<int64_t>(t) * K + lane];
      }
    };
    if (first_item < items) load_routing(static_cast<int>(first_item / nch));
    wait_all_flags(c, [&](int s) { return c.local + lay.combine_flag_offset(s, 0); }, call + 1, LlErrorReport::combine, call, s_bad, [](int) {});
    __syncthreads();
    trace_at(c, 6);
    trace_max(c, 11);
    const float acc0 = combine_rejected_source(p, s_bad, call) >= 0 ? __uint_as_float(0x7fc00000u) : 0.0f;  // a peer rejected: NaN
    // (token, 256-element chunk) items: a lane owns 8 elements; 4 rows are loaded at once, then added
    // in column order.
    for (int64_t item = first_item; item < items; item += static_cast<int64_t>(gridDim.x) * W) {
      const int t = static_cast<int>(item / nch), ch = static_cast<int>(item % nch);
      if (item != first_item) load_routing(t);
      const int64_t h = static_cast<int64_t>(ch) * 256 + lane * 8;
      const bool ok = h < H;
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = acc0;
      // valid columns, 4 at a time in column order
      gather_columns(my_first, my_w, ok, [&](int f) { return c.local + lay.combine_row_offset(parity, t, f) + 2 * h; }, acc);
      if (ok) add_addend8(acc, p.addend ? p.addend + static_cast<int64_t>(t) * H : nullptr, h);
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = static_cast<uint32_t>(float_to_bf16_bits(acc[2 * i])) | (static_cast<uint32_t>(float_to_bf16_bits(acc[2 * i + 1])) << 16);
      if (ok) st16(p.out + static_cast<int64_t>(t) * H + h, make_uint4(o[0], o[1], o[2], o[3]));
    }
    if (threadIdx.x == 0) atomicAdd(&c.state->combine_recv_blocks, 1ull);
    __syncthreads();
    trace_at(c, kTrCombReduced0);
    trace_clk(c, kTrCombReducedCyc, tr_ns0, tr_clk0);
    trace_max(c, 7);
  }
}

__global__ void delay_kernel(long long ns) {
  const unsigned long long start = globaltimer();
  while (static_cast<long long>(globaltimer() - start) < ns) __nanosleep(1000);
}

__global__ void stamp_kernel(unsigned long long* dst) { *dst = globaltimer(); }

template <int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads, 1) ll_empty_kernel() {}

}  // namespace

void launch_gpu_stamp(unsigned long long* dst, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(dst);
  cuda::check_launch("stamp_kernel");
}

void launch_ll_empty(size_t smem, int blocks, int threads, cudaStream_t stream) {
  // (Above 48 KiB the attribute is set once here: call it eagerly before a capture.)
  if (threads > 512) {
    if (smem > 48 * 1024)
      EPX_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&ll_empty_kernel<1024>), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    ll_empty_kernel<1024><<<blocks, threads, smem, stream>>>();
  } else {
    if (smem > 48 * 1024)
      EPX_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(&ll_empty_kernel<512>), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    ll_empty_kernel<512><<<blocks, threads, smem, stream>>>();
  }
  cuda::check_launch("ll_empty_kernel");
}

void launch_gpu_delay(long long ns, cudaStream_t stream) {
  delay_kernel<<<1, 32, 0, stream>>>(ns);
  cuda::check_launch("delay_kernel");
}

size_t ll_dispatch_smem_bytes(const LlLayout& lay, bool expand_message, int num_local) {
  const size_t R = static_cast<size_t>(lay.num_ranks), max_t = static_cast<size_t>(lay.max_tokens), K = static_cast<size_t>(lay.top_k);
  const size_t NI = static_cast<size_t>(lay.num_ids), Wm = (max_t + 31) / 32;
  const size_t send = 4 * max_t + 4 * max_t * R + (expand_message ? 8 * NI * Wm + 4 * NI : 0);
  const size_t Q = R * ((max_t + 31) / 32);
  const size_t recv = expand_message ? 4 * static_cast<size_t>(num_local) * R
                                     : static_cast<size_t>(ll_align_up(static_cast<int64_t>(2 * R * max_t * K), 16)) + 4 * Q + 4 * Q + 4 * R * max_t + 32 * Q;
  return (send > recv ? send : recv) + 16;
}

size_t ll_combine_smem_bytes(int num_local, int num_ranks) {
  return 4 * (static_cast<size_t>(num_local > num_ranks ? num_local : num_ranks) + 1) + 16;
}

int ll_max_resident_blocks(int threads, size_t dispatch_smem, size_t combine_smem) {
  int dev = 0, sms = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  EPX_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int worst = 1 << 30;
  auto check = [&](const void* fn, size_t smem) {
    // Never lowered: objects of one process with other layouts / modes keep what they need.
    cudaFuncAttributes attr{};
    EPX_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
    const int want = static_cast<int>(smem) > attr.maxDynamicSharedSizeBytes ? static_cast<int>(smem) : attr.maxDynamicSharedSizeBytes;
    EPX_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, want));
    int n = 0;
    EPX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem));
    worst = n < worst ? n : worst;
  };
  if (threads > 512) {
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 1024, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 1024, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 1024, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 1024, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<1024, false>), combine_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<1024, true>), combine_smem);
  } else {
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 512, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 512, true>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<true, 512, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_dispatch_kernel<false, 512, false>), dispatch_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<512, false>), combine_smem);
    check(reinterpret_cast<const void*>(&ll_combine_kernel<512, true>), combine_smem);
  }
  return worst * sms;
}

void launch_ll_dispatch(const LlDispatchParams& p, int blocks, int threads, cudaStream_t stream) {
  const size_t smem = ll_dispatch_smem_bytes(p.c.lay, p.c.expand_message, p.c.num_local);
  const bool fp8 = p.c.lay.use_fp8, msg = p.c.expand_message;
  if (threads > 512) {
    if (fp8 && msg) ll_dispatch_kernel<true, 1024, true><<<blocks, threads, smem, stream>>>(p);
    else if (msg) ll_dispatch_kernel<false, 1024, true><<<blocks, threads, smem, stream>>>(p);
    else if (fp8) ll_dispatch_kernel<true, 1024, false><<<blocks, threads, smem, stream>>>(p);
    else ll_dispatch_kernel<false, 1024, false><<<blocks, threads, smem, stream>>>(p);
  } else {
    if (fp8 && msg) ll_dispatch_kernel<true, 512, true><<<blocks, threads, smem, stream>>>(p);
    else if (msg) ll_dispatch_kernel<false, 512, true><<<blocks, threads, smem, stream>>>(p);
    else if (fp8) ll_dispatch_kernel<true, 512, false><<<blocks, threads, smem, stream>>>(p);
    else ll_dispatch_kernel<false, 512, false><<<blocks, threads, smem, stream>>>(p);
  }
  cuda::check_launch("ll_dispatch_kernel");
}

void launch_ll_combine(const LlCombineParams& p, int blocks, int threads, cudaStream_t stream) {
  const size_t smem = ll_combine_smem_bytes(p.c.num_local, p.c.lay.num_ranks);
  const bool data = p.c.combine_data && p.c.lay.partial();
  if (threads > 512 && data) ll_combine_kernel<1024, true><<<blocks, threads, smem, stream>>>(p);
  else if (threads > 512) ll_combine_kernel<1024, false><<<blocks, threads, smem, stream>>>(p);
  else if (data) ll_combine_kernel<512, true><<<blocks, threads, smem, stream>>>(p);
  else ll_combine_kernel<512, false><<<blocks, threads, smem, stream>>>(p);
  cuda::check_launch("ll_combine_kernel");
}

}  // namespace epx::dispatch

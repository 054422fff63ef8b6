// dispatch/ht/ht_cuda.cu: buffer layout and kernel launchers of the ht backend on CUDA (contract:
// ht_cuda.h; device code: ht_device.cuh and ht_*_kernels.cuh).
#include "cuda/check.h"
#include "dispatch/ht/ht_combine_kernels.cuh"
#include "dispatch/ht/ht_dispatch_kernels.cuh"
#include "dispatch/ht/ht_layout_kernels.cuh"
#include "epx/error.h"

namespace epx::dispatch {
namespace {

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

}  // namespace

HtLayout HtLayout::make(const DispatchConfig& cfg, int num_ranks, int rank) {
  HtLayout l;
  l.num_ranks = num_ranks;
  l.rank = rank;
  l.top_k = cfg.top_k;
  l.hidden = cfg.hidden;
  l.capacity = cfg.num_max_dispatch_tokens_per_rank;
  l.use_fp8 = cfg.dispatch_dtype == DType::fp8_e4m3;
  l.use_ue8m0 = cfg.use_ue8m0;
  l.partial_bytes = cfg.flat_combine == FlatCombine::partial_fp32 ? 4 : 2;
  l.placement = {cfg.num_experts, num_ranks, cfg.shared_route};
  l.max_local = 1;
  for (int r = 0; r < num_ranks; ++r) l.max_local = std::max(l.max_local, l.placement.num_local(r));
  const int64_t rows = l.rows(), K = l.top_k;
  l.slot_bytes = round_up(4 * (num_ranks + 2 + l.max_local), 128);
  int64_t off = 0;
  l.off_slots = off;
  off = round_up(off + 2 * num_ranks * l.slot_bytes, 4096);  // two sets (HtLayout::slot_offset)
  l.off_flags = off;
  off = round_up(off + 3 * num_ranks * 64, 4096);
  l.off_chunk_flags = off;
  off = round_up(off + num_ranks * l.chunks() * 8, 4096);
  l.off_x = off;
  off = round_up(off + rows * l.payload_bytes(), 4096);
  l.off_scales = off;
  off = round_up(off + (l.use_fp8 ? rows * l.groups() * 4 : 0), 4096);
  l.off_idx = off;
  off = round_up(off + rows * K * 4, 4096);
  l.off_weights = off;
  off = round_up(off + rows * K * 4, 4096);
  l.off_src_idx = off;
  off = round_up(off + rows * 4, 4096);
  l.off_back = off;
  off = round_up(off + rows * l.partial_bytes * l.hidden, 4096);
  l.symmetric_bytes = off;
  return l;
}

HtDeviceArrays HtDeviceArrays::make(const HtLayout& l) {
  HtDeviceArrays a;
  int64_t off = round_up(static_cast<int64_t>(sizeof(HtState)), 256);
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off = round_up(off + std::max<int64_t>(bytes, 4), 256);
    return at;
  };
  a.expert_counts = take(4LL * l.num_ranks * l.max_local);
  a.recv_count = take(4LL * l.max_local);
  a.cached_idx = take(4 * l.capacity * l.top_k);
  a.send_pos = take(4 * l.capacity * l.num_ranks);
  a.send_tok = take(4 * l.capacity * l.num_ranks);
  a.is_token_in_rank = take(l.capacity * l.num_ranks);
  a.num_recv_device = take(4);
  a.bytes = off;
  return a;
}

void launch_ht_layout(const HtParams& p, Stream stream) {
  // s_counts [R, Lmax] and the slots' copy [R, R + 2 + Lmax] (ht_layout_kernels.cuh, layout_kernel)
  const size_t smem = sizeof(int) * static_cast<size_t>(p.l.num_ranks) * static_cast<size_t>(2 * p.l.max_local + p.l.num_ranks + 2);
  if (smem > 48 * 1024)  // very many local experts: opt in to more than the default 48 KiB
    EPX_CUDA_CHECK(cudaFuncSetAttribute(ht::layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  ht::layout_kernel<<<1, ht::kLayoutThreads, smem, cuda::native(stream)>>>(p);
  cuda::check_launch("ht layout_kernel");
}

void launch_ht_dispatch(const HtParams& p, int blocks, int warps, bool pdl, Stream stream) {
  if (!pdl) {
    ht::dispatch_kernel<<<blocks, warps * 32, 0, cuda::native(stream)>>>(p);
    cuda::check_launch("ht dispatch_kernel");
    return;
  }
  // Programmatic dependent launch: the grid may start once every layout CTA has executed
  // griddepcontrol.launch_dependents (ht_layout_kernels.cuh); it then polls HtState::layout_ready.
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(static_cast<unsigned>(blocks));
  lc.blockDim = dim3(static_cast<unsigned>(warps * 32));
  lc.dynamicSmemBytes = 0;
  lc.stream = cuda::native(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = 1;
  EPX_CUDA_CHECK(cudaLaunchKernelEx(&lc, ht::dispatch_kernel, p));
  cuda::check_launch("ht dispatch_kernel (programmatic dependent launch)");
}

void launch_ht_contiguous(const HtParams& p, int blocks, int warps, Stream stream) {
  ht::contig_map_kernel<<<std::max(p.num_local, 1), ht::kContigThreads, 0, cuda::native(stream)>>>(p);
  cuda::check_launch("ht contig_map_kernel");
  ht::contig_copy_kernel<<<blocks, warps * 32, 0, cuda::native(stream)>>>(p);
  cuda::check_launch("ht contig_copy_kernel");
}

void launch_ht_combine(const HtParams& p, int blocks, int warps, Stream stream) {
  ht::combine_kernel<<<blocks, warps * 32, 0, cuda::native(stream)>>>(p);
  cuda::check_launch("ht combine_kernel");
}

}  // namespace epx::dispatch

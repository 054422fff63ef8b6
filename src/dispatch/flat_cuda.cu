// dispatch/flat_cuda.cu: host launchers of the flat CUDA backends' kernels (flat_kernels.cuh):
// grid shape and launch checks only; the backends (prepare_finalize_cuda.cpp) validate arguments
// and make the device current.
#include "cuda/check.h"
#include "dispatch/flat_cuda.h"
#include "dispatch/flat_kernels.cuh"
#include "epx/error.h"

namespace epx::dispatch {
namespace {

// Enough CTAs to cover 132 SMs several times over; the kernels stride over the rest.
constexpr int64_t kMaxRowBlocks = 132 * 16;

}  // namespace

void launch_plan(const PlanParams& p, Stream stream) {
  EPX_ASSERT(p.record != nullptr && p.placement.num_ranks >= 1, "record=", p.record, " R=", p.placement.num_ranks);
  const size_t smem = sizeof(long long) * static_cast<size_t>(p.placement.num_ranks);
  kernels::plan_kernel<<<1, kernels::kPlanThreads, smem, cuda::native(stream)>>>(p);
  cuda::check_launch("plan_kernel");
}

void launch_pack_rows(const PackParams& p, Stream stream) {
  if (p.num_tokens == 0) return;
  kernels::pack_rows_kernel<<<cuda::grid_for(p.num_tokens, 1, kMaxRowBlocks), kernels::kRowThreads, 0, cuda::native(stream)>>>(p);
  cuda::check_launch("pack_rows_kernel");
}

void launch_scatter_rows(const ScatterParams& p, Stream stream) {
  if (p.num_tokens == 0 && p.block_bytes == 0) return;  // padded: the records go out also without tokens
  const unsigned grid = p.num_tokens == 0 ? 1u : cuda::grid_for(p.num_tokens, 1, kMaxRowBlocks);
  kernels::scatter_rows_kernel<<<grid, kernels::kRowThreads, 0, cuda::native(stream)>>>(p);
  cuda::check_launch("scatter_rows_kernel");
}

void launch_unpack_rows(const UnpackParams& p, Stream stream) {
  const cudaStream_t s = cuda::native(stream);
  if (p.num_local > 0) EPX_CUDA_CHECK(cudaMemsetAsync(p.recv_count, 0, sizeof(int32_t) * static_cast<size_t>(p.num_local), s));
  if (p.rows_per_block > 0) {  // padded: one CTA at least reads the records (call_bad, the report)
    const unsigned grid = p.num_rows == 0 ? 1u : cuda::grid_for(p.num_rows, 1, kMaxRowBlocks);
    kernels::unpack_padded_kernel<<<grid, kernels::kRowThreads, 0, s>>>(p);
    cuda::check_launch("unpack_padded_kernel");
    return;
  }
  if (p.num_rows == 0) return;
  kernels::unpack_rows_kernel<<<cuda::grid_for(p.num_rows, 1, kMaxRowBlocks), kernels::kRowThreads, 0, s>>>(p);
  cuda::check_launch("unpack_rows_kernel");
}

void launch_combine_rows(const CombineParams& p, Stream stream) {
  if (p.num_tokens == 0) return;
  const bool vec = !p.back_f32 && !p.addend && p.hidden % 8 == 0 && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.back) % 16 == 0;
  kernels::combine_rows_kernel<<<cuda::grid_for(p.num_tokens, 1, kMaxRowBlocks), kernels::kCombineThreads, 0, cuda::native(stream)>>>(p, vec);
  cuda::check_launch("combine_rows_kernel");
}

void launch_finish_rows(const FinishParams& p, Stream stream) {
  if (p.n == 0) return;
  kernels::finish_rows_kernel<<<cuda::grid_for(p.n, kernels::kCombineThreads, kMaxRowBlocks), kernels::kCombineThreads, 0,
                                cuda::native(stream)>>>(p);
  cuda::check_launch("finish_rows_kernel");
}

}  // namespace epx::dispatch

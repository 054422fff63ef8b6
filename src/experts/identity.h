// experts/identity.h: the identity expert, for communication benchmarks and dispatch checks: every
// local expert returns its input, y = round_bf16(x~) (x~ = the dispatched row, dequantized when the
// wire is FP8), so a layer's output is out[t] = sum over valid k of w[t,k] * x~[t]. It follows the
// Experts contract of experts.h exactly (ExpertMajor: rows >= recv_count untouched, unweighted;
// Flat: weighted sum over local columns in column order, fp32, rounded once to a bf16 out or kept in
// an fp32 out (the partial of DispatchConfig::flat_combine partial_fp32), zeros without a local
// selection), at a cost of one pass over x, so `epx bench` times dispatch and combine, not GEMMs.
// The Contiguous layout (no dispatch backend produces it) is refused with Unsupported.
#pragma once

#include <memory>

#include "epx/experts.h"

namespace epx {

/// Identity experts: `num_local_experts` of hidden size `hidden` on `device` (CPU, or CUDA when
/// built with it; Unsupported otherwise). CUDA apply() is stream-ordered, reads recv_count and
/// topk_idx on the device only (no host sync) and treats ids outside [-1, L) as no selection.
std::unique_ptr<Experts> make_identity_experts(int num_local_experts, int64_t hidden, Device device);

namespace experts_detail {
/// The CUDA half of make_identity_experts (identity_cuda.cu); same contract.
void identity_apply_cuda(const ExpertsInput& in, const TensorView& out, int num_local_experts, Stream stream);
}  // namespace experts_detail

}  // namespace epx

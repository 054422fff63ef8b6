// experts/contiguous.h: what the CPU and CUDA Experts share for ActivationLayout::Contiguous (epx/experts.h).
#pragma once

#include <cstdint>
#include <string_view>

#include "epx/tensor.h"

namespace epx::experts_detail {

/// The number of entries of ExpertsInput::expert_offsets for `num_local` experts: L (cumulative ends, torch's
/// `offs`) or L + 1 (starts, then the end). Throws InvalidArgument naming expert_offsets.ndim / .shape[0] when it
/// is neither; the dtype, device and contiguity are the caller's check (experts_cpu.cpp).
int64_t contiguous_offsets_count(std::string_view op, const TensorView& offsets, int64_t num_local);

}  // namespace epx::experts_detail

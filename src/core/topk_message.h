// core/topk_message.h: the one way every check names a bad routing entry (STYLE.md §4), so the
// dispatch backends (CPU and CUDA), the layer, the no-EP reference and the trace loader say the same:
//   "<op>: topk_idx[t, k] = <value>: must be -1 (no selection) or an expert id in [0, num_experts = E)"
// (the deepep shim's get_dispatch_layout, python/epx/deepep.py, writes the same sentence).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace epx::detail {

/// "<name>[t, k]": one element of a [T, K] routing tensor (topk_idx, topk_weights).
inline std::string topk_elem(std::string_view name, int64_t t, int64_t k) {
  return std::string(name) + "[" + std::to_string(t) + ", " + std::to_string(k) + "]";
}

/// The rule of a routed topk_idx entry without the shared route.
inline std::string topk_id_rule(int64_t num_experts) {
  return "must be -1 (no selection) or an expert id in [0, num_experts = " + std::to_string(num_experts) + ")";
}

}  // namespace epx::detail

// dispatch/all2allv_cpu.cpp: "all2allv" backend, rank-deduplicated all_to_allv both ways over host
// collectives (vLLM's all2allv manager shape). Layout and byte accounting: dispatch/dedup_cpu.h.
#include "dispatch/backends.h"
#include "dispatch/dedup_cpu.h"

namespace epx::dispatch {

std::unique_ptr<PrepareFinalize> make_all2allv_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg) {
  return std::make_unique<DedupCpu>("all2allv", std::move(group), cfg, /*cache_layout=*/false);
}

}  // namespace epx::dispatch

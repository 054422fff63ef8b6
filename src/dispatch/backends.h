// dispatch/backends.h: factories of the CPU and CUDA backends, called only by the table in
// registry.cpp. Each factory runs after the group agreed on `cfg` and validate_config accepted it.
// The CUDA factories exist in EPX_CUDA builds only and take a CUDA group (NCCL, or virtual ranks).
#pragma once

#include <memory>

#include "epx/dispatch.h"

namespace epx::dispatch {

std::unique_ptr<PrepareFinalize> make_naive_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_agrs_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_all2allv_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ll_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ht_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);

std::unique_ptr<PrepareFinalize> make_naive_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_agrs_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_all2allv_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
/// ht over NCCL symmetric memory (ht_cuda.h); SM budget, warps, chunk rows and launch order from
/// `config` (ht_num_sms, ht_warps_per_block, ht_chunk_rows, ht_pdl), or Config::load().
std::unique_ptr<PrepareFinalize> make_ht_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ht_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config);
/// ll on CUDA (ll_cuda.h): launch shape from `config` or Config::load() (ll_warps_per_block,
/// ll_num_blocks, ll_combine_wait), device wait bound = the group's timeout_s.
std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ll_cuda(std::shared_ptr<Group> group, const DispatchConfig& cfg, const Config& config);

}  // namespace epx::dispatch

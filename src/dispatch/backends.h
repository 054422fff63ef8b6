// dispatch/backends.h: factories of the CPU backends, called only by the table in registry.cpp.
// Each factory runs after the group agreed on `cfg` and validate_config accepted it.
#pragma once

#include <memory>

#include "epx/dispatch.h"

namespace epx::dispatch {

std::unique_ptr<PrepareFinalize> make_naive_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_agrs_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_all2allv_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ll_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);
std::unique_ptr<PrepareFinalize> make_ht_cpu(std::shared_ptr<Group> group, const DispatchConfig& cfg);

}  // namespace epx::dispatch

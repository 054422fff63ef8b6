// comm/group_cpu.h: internals of the CPU group (ranks = threads of one process) visible to tests.
//
// The public entry points are make_cpu_groups and run_ranks in epx/group.h. A "world" is the shared
// state of the R CpuGroups made by one make_cpu_groups call; it lives as long as any of them.
#pragma once

#include <cstdint>

namespace epx::comm {

/// Number of CPU worlds alive in this process (for leak tests: create, destroy, re-create).
int64_t cpu_world_live_count();

}  // namespace epx::comm

// comm/group_virtual.h: the device side of virtual ranks (make_virtual_cuda_groups, epx/group.h):
// R ranks as threads of one process on one GPU. Host-only declarations; the kernel lives in
// group_virtual_cuda.cu, the group in group_virtual_cuda.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace epx::comm {

/// Most ranks make_virtual_cuda_groups places on one device.
constexpr int kMaxVirtualRanks = 64;

/// Where a device barrier that timed out says so (host-mapped; the first one wins).
struct VirtualTimeoutRecord {
  int claimed = 0;  ///< 0 until a barrier claims the record
  int rank = -1;    ///< the rank whose barrier waited
  int peer = -1;    ///< the rank it waited for
  int done = 0;     ///< 1 once rank / peer are written
};

/// One rank's view of the world's device barrier state (device memory unless noted).
struct VirtualBarrierArgs {
  uint64_t* flags = nullptr;   ///< [R * R]: flags[r * R + q] = the last barrier epoch rank q announced to rank r
  uint64_t* epoch = nullptr;   ///< [R]: barriers rank r has entered (advanced by the kernel: graph replays advance it too)
  int* aborted = nullptr;      ///< set by a barrier that timed out: every later barrier returns at once
  VirtualTimeoutRecord* record = nullptr;  ///< host-mapped, device pointer
  int rank = 0, num_ranks = 1;
  long long timeout_ns = 0;
};

/// One thread on `stream`: announces this rank's next epoch to every rank, then waits (acquire,
/// bounded by timeout_ns) until every rank has announced it. Work queued on `stream` before it and
/// on every peer's stream before theirs happens-before work queued after it on any of them.
void launch_virtual_barrier(const VirtualBarrierArgs& args, cudaStream_t stream);

}  // namespace epx::comm

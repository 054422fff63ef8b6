// src/cuda/check.h: return-code checks for CUDA and NCCL calls, and small host helpers every CUDA
// file shares. Library code throws (STYLE.md §4): CudaError for a failed CUDA/NCCL runtime call,
// CommError for a failed collective (src/comm/group_nccl.cpp maps NCCL results itself).
//
// Message form: "<statement>: <error text> (<error name>) at <file>:<line> on cuda:<device>", e.g.
//   "cudaMalloc(&p, bytes): out of memory (cudaErrorMemoryAllocation) at src/cuda/runtime.cpp:41 on cuda:0"
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <source_location>
#include <string>

#include "epx/tensor.h"

namespace epx::detail {

/// Throws CudaError unless `status` is cudaSuccess; also clears CUDA's sticky "last error".
void check_cuda(cudaError_t status, const char* statement, std::source_location loc);
/// Throws CudaError unless `status` is ncclSuccess (or ncclInProgress, which the caller polls).
void check_nccl(ncclResult_t status, const char* statement, std::source_location loc);
/// "<statement>: <what> at <file>:<line> on cuda:<current device>": the shared message tail.
std::string cuda_error_context(const char* statement, std::source_location loc);

}  // namespace epx::detail

#define EPX_CUDA_CHECK(expr) ::epx::detail::check_cuda((expr), #expr, std::source_location::current())
#define EPX_NCCL_CHECK(expr) ::epx::detail::check_nccl((expr), #expr, std::source_location::current())

namespace epx::cuda {

/// The cudaStream_t behind an epx::Stream (nullptr = the legacy default stream).
inline cudaStream_t native(Stream s) { return static_cast<cudaStream_t>(s.handle); }

/// cudaSetDevice(device), and notes that epx has initialised CUDA in this process (device_count()
/// then asks the driver directly instead of a child process). Throws CudaError.
void set_device(int device);

/// While virtual ranks are live in this process (between begin and end, counted), Tensor frees are
/// held back: cudaFree waits for the whole device, and a rank's peers may have kernels in flight
/// that wait for this rank's next one. free_deferred() frees them; call it only where no rank has
/// work in flight (the virtual group's barrier does, between its phases); the last end() calls it.
void virtual_ranks_begin();
void virtual_ranks_end();
void free_deferred();

/// Makes `device` current for its scope and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

/// Throws CudaError naming `what` if the last kernel launch failed (launch configuration errors).
void check_launch(const char* what, std::source_location loc = std::source_location::current());

/// Blocks `threads` up to a grid size: ceil(n / per_block), clamped to [1, max_blocks].
inline unsigned grid_for(int64_t n, int64_t per_block, int64_t max_blocks = 65535LL * 16) {
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b);
}

}  // namespace epx::cuda

// epx/cuda.h: what the CUDA runtime of this build offers, queryable from any build.
//
// In a CPU-only build (EPX_CUDA=OFF) every function here still links: device_count() returns 0,
// built_with_cuda() false, and ensure_runtime() throws Unsupported.
#pragma once

namespace epx::cuda {

/// True when this build has the CUDA runtime (configured with EPX_CUDA=ON).
bool built_with_cuda();

/// Number of CUDA devices this process may use (honours CUDA_VISIBLE_DEVICES); 0 without a GPU,
/// a driver or a CUDA build. Safe before fork(): unless this process has already initialised CUDA
/// through epx, it asks a short-lived child process, so the caller's CUDA stays uninitialised and
/// its children can still use their GPUs. The result is cached for the life of the process.
int device_count();

/// Registers the CUDA DeviceAllocator for epx::Tensor (epx/tensor.h) and checks, once per process,
/// that the NCCL library loaded at run time is the one whose headers epx was built with
/// (ncclGetVersion == NCCL_VERSION_CODE; the device API structs are compiled into kernels, so a
/// mismatch corrupts memory instead of failing, NCCL-DEVICE-API.md §4). Does not initialise CUDA.
/// Every CUDA entry point calls it; calling it again is cheap.
/// Throws CudaError on a version mismatch; Unsupported in a CPU-only build.
void ensure_runtime();

/// NCCL_VERSION_CODE of the headers this build used (e.g. 22809), 0 in a CPU-only build.
int nccl_header_version();
/// ncclGetVersion() of the loaded library, 0 in a CPU-only build.
int nccl_runtime_version();

}  // namespace epx::cuda

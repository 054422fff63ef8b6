// src/cuda/runtime_stub.cpp: epx/cuda.h in a CPU-only build (EPX_CUDA=OFF). CMake compiles this file
// instead of runtime.cpp when CUDA is off.
#include "epx/cuda.h"
#include "epx/error.h"

namespace epx::cuda {

bool built_with_cuda() { return false; }
int device_count() { return 0; }
void ensure_runtime() { throw Unsupported("cuda.runtime: this build has no CUDA runtime (configure with EPX_CUDA=ON)"); }
int nccl_header_version() { return 0; }
int nccl_runtime_version() { return 0; }

}  // namespace epx::cuda

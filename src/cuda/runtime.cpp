// src/cuda/runtime.cpp: the CUDA side of core: error checks, the Tensor allocator, the device count
// and the NCCL header/library version check (NCCL-DEVICE-API.md §4).
//
// Linking: libepx is a static archive, and an archive member nobody references is dropped with its
// static initialisers. CMake therefore makes every target that links epx also ask the linker for
// `epx_cuda_runtime_anchor` (defined here), so this file, and with it the allocator registration
// below, is always part of the program.
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "epx/cuda.h"
#include "epx/error.h"
#include "epx/log.h"
#include "epx/tensor.h"

extern "C" void epx_cuda_runtime_anchor() {}

namespace epx {
namespace detail {

namespace {
std::string short_file(const char* path) {
  std::string p(path);
  auto pos = p.rfind("/src/");
  return pos == std::string::npos ? p : p.substr(pos + 1);
}
}  // namespace

std::string cuda_error_context(const char* statement, std::source_location loc) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  return std::string(" at ") + short_file(loc.file_name()) + ":" + std::to_string(loc.line()) + " on cuda:" +
         (device >= 0 ? std::to_string(device) : std::string("?"));
}

void check_cuda(cudaError_t status, const char* statement, std::source_location loc) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error so the next check reports its own failure
  throw CudaError(std::string(statement) + ": " + cudaGetErrorString(status) + " (" + cudaGetErrorName(status) + ")" +
                  cuda_error_context(statement, loc));
}

void check_nccl(ncclResult_t status, const char* statement, std::source_location loc) {
  if (status == ncclSuccess || status == ncclInProgress) return;
  throw CudaError(std::string(statement) + ": " + ncclGetErrorString(status) + " (ncclResult " + std::to_string(status) +
                  ")" + cuda_error_context(statement, loc));
}

}  // namespace detail

namespace cuda {
namespace {

std::atomic<bool> g_cuda_used{false};  // set once epx itself has initialised CUDA in this process

void mark_used() { g_cuda_used.store(true, std::memory_order_relaxed); }

void* device_alloc(int64_t bytes, int device) {
  DeviceGuard guard(device);
  void* p = nullptr;
  EPX_CUDA_CHECK(cudaMalloc(&p, static_cast<size_t>(bytes)));
  return p;
}

// Frees held back while virtual ranks are live (free_deferred below).
struct Deferred {
  std::mutex mu;
  std::vector<std::pair<void*, int>> list;
};
Deferred& deferred() {
  static Deferred* d = new Deferred();  // never destroyed: frees may come during static destruction
  return *d;
}
std::atomic<int> g_virtual_worlds{0};

void free_now(void* p, int device);

// Runs inside shared_ptr deleters: never throws, reports failures in the log.
//
// cudaFree waits for the whole device. With virtual ranks (several ranks' threads on one GPU) a
// rank that frees between two of its kernels would wait for a peer's kernel that waits for this
// rank's next one; a free on another thread may hold the driver while it waits, stalling the
// peers' launches. So while virtual ranks are live, frees are held back until a point where no
// rank has work in flight (free_deferred: the virtual group's barrier, the last world's end).
void device_free(void* p, int device) {
  if (g_virtual_worlds.load(std::memory_order_acquire) > 0) {
    Deferred& d = deferred();
    std::lock_guard<std::mutex> lk(d.mu);
    d.list.emplace_back(p, device);
    return;
  }
  free_now(p, device);
}

void free_now(void* p, int device) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device) (void)cudaSetDevice(device);
  const cudaError_t e = cudaFree(p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    log::warn(std::string("cudaFree on cuda:") + std::to_string(device) + " failed: " + cudaGetErrorString(e));
  }
  if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
}

// Both complete before they return (DeviceAllocator's contract), so the result can be used on any
// stream: cudaMemcpy returns before its DMA lands for a pageable host -> device copy and does not wait
// at all device -> device, and cudaMemset is asynchronous; both run on the legacy default stream,
// which a cudaStreamNonBlocking stream (the caller's, say) does not wait for. Hence the wait on it.
void device_copy(void* dst, const void* src, int64_t bytes, int /*kind: unified addressing tells*/) {
  mark_used();
  EPX_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault));
  EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void device_memset(void* p, int value, int64_t bytes) {
  cudaPointerAttributes attr{};
  EPX_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  DeviceGuard guard(attr.device);
  EPX_CUDA_CHECK(cudaMemset(p, value, static_cast<size_t>(bytes)));
  EPX_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

void register_allocator() {
  DeviceAllocator a;
  a.alloc = &device_alloc;
  a.free = &device_free;
  a.copy = &device_copy;
  a.memset = &device_memset;
  register_device_allocator(DeviceKind::cuda, a);
}

// Static registration (see the linking note at the top). Touches no CUDA API: a process that only
// forks GPU workers must keep its own CUDA uninitialised.
const bool g_registered = (register_allocator(), true);

// Asks a child process, so that this process's CUDA stays uninitialised (a child forked after its
// parent initialised CUDA cannot use the GPU).
int probe_device_count_in_child() {
  int fds[2];
  if (pipe(fds) != 0) return 0;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return 0;
  }
  if (pid == 0) {
    close(fds[0]);
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    ssize_t w = write(fds[1], &n, sizeof n);
    (void)w;
    _exit(0);
  }
  close(fds[1]);
  int n = 0;
  pollfd pfd{fds[0], POLLIN, 0};
  // Driver start-up takes well under a second; 60 s only guards against a wedged driver.
  if (poll(&pfd, 1, 60000) == 1) {
    if (read(fds[0], &n, sizeof n) != static_cast<ssize_t>(sizeof n)) n = 0;
  } else {
    kill(pid, SIGKILL);
    log::warn("cuda::device_count: the probe process did not answer within 60 s; reporting 0 devices");
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return n;
}

}  // namespace

void virtual_ranks_begin() { g_virtual_worlds.fetch_add(1, std::memory_order_acq_rel); }
void virtual_ranks_end() {
  if (g_virtual_worlds.fetch_sub(1, std::memory_order_acq_rel) == 1) free_deferred();
}
void free_deferred() {
  std::vector<std::pair<void*, int>> list;
  {
    Deferred& d = deferred();
    std::lock_guard<std::mutex> lk(d.mu);
    list.swap(d.list);
  }
  for (const auto& [p, device] : list) free_now(p, device);
}

DeviceGuard::DeviceGuard(int device) {
  mark_used();
  EPX_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    EPX_CUDA_CHECK(cudaSetDevice(device));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) (void)cudaSetDevice(previous_);
}

void check_launch(const char* what, std::source_location loc) { detail::check_cuda(cudaGetLastError(), what, loc); }

bool built_with_cuda() { return true; }

int device_count() {
  static std::once_flag once;
  static int count = 0;
  std::call_once(once, [] {
    if (g_cuda_used.load(std::memory_order_relaxed)) {
      if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        count = 0;
      }
    } else {
      count = probe_device_count_in_child();
    }
  });
  return count;
}

int nccl_header_version() { return NCCL_VERSION_CODE; }

int nccl_runtime_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return 0;
  return v;
}

void ensure_runtime() {
  static std::once_flag once;
  std::call_once(once, [] {
    const int runtime = nccl_runtime_version();
    if (runtime != NCCL_VERSION_CODE) {
      throw CudaError("cuda.runtime: ncclGetVersion() = " + std::to_string(runtime) +
                      ": must equal NCCL_VERSION_CODE = " + std::to_string(NCCL_VERSION_CODE) +
                      " of the headers epx was built with (another libnccl.so.2 was loaded first: put the lib/ "
                      "of the NCCL that configured EPX_NCCL_ROOT first in LD_LIBRARY_PATH, or load it before "
                      "any other; a header/library mismatch corrupts device-API structs silently)");
    }
  });
  if (!g_registered || device_allocator(DeviceKind::cuda) == nullptr) register_allocator();
}

void set_device(int device) {
  mark_used();
  EPX_CUDA_CHECK(cudaSetDevice(device));
}

}  // namespace cuda
}  // namespace epx

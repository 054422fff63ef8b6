// tests/forked_ranks.h: multi-rank GPU tests with one forked process per GPU, as NCCL expects.
//
// The gtest process itself never initialises CUDA (cuda::device_count() asks a child), so the ranks
// it forks can each open their GPU; data the parent computed before the fork (inputs, CPU oracles)
// is there in every child. A rank reports through its exit status and stderr; the parent kills every
// rank still running after a deadline, so a hang fails the test instead of the suite.
#pragma once

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "epx/tensor.h"
#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace epx::test {

/// A fresh directory for one test's rendezvous files.
inline std::string fresh_dir() {
  char tmpl[] = "/tmp/epx_gpu_test_XXXXXX";
  const char* d = mkdtemp(tmpl);
  if (!d) throw std::runtime_error("mkdtemp failed");
  return d;
}

/// Forks `world` ranks running fn(rank); returns "" when all exit 0 within deadline_s, else a
/// description of the failed ranks (their own messages went to stderr).
inline std::string run_ranks_forked(int world, double deadline_s, const std::function<void(int)>& fn) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    if (pid < 0) return "fork failed";
    if (pid == 0) {
      int code = 0;
      try {
        fn(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[rank %d] FAILED: %s\n", r, e.what());
        code = 1;
      } catch (...) {
        std::fprintf(stderr, "[rank %d] FAILED: unknown exception\n", r);
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  std::string failures;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_s);
  std::vector<bool> done(pids.size(), false);
  size_t remaining = pids.size();
  while (remaining > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --remaining;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
          failures += "rank " + std::to_string(r) + " exited with status " + std::to_string(status) + "; ";
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (done[r]) continue;
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        failures += "rank " + std::to_string(r) + " still running after " + std::to_string(deadline_s) + " s (killed); ";
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return failures;
}

/// The bytes of `v` (any device) on the host; empty for an undefined or empty view.
inline std::vector<uint8_t> host_bytes(const TensorView& v) {
  std::vector<uint8_t> b(static_cast<size_t>(v.defined() ? v.nbytes() : 0));
  if (b.empty()) return b;
  TensorView dst(b.data(), v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
  copy(dst, v);
  return b;
}

/// "" when equal, else "<what>: byte i is g, want w; " for the first byte that differs (or the sizes).
inline std::string first_diff(const std::string& what, const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
  if (got.size() != want.size()) return what + ": " + std::to_string(got.size()) + " bytes, want " + std::to_string(want.size()) + "; ";
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return what + ": byte " + std::to_string(i) + " is " + std::to_string(got[i]) + ", want " + std::to_string(want[i]) + "; ";
  return "";
}

#ifdef EPX_WITH_CUDA
/// Throws std::runtime_error "<what>: <CUDA error string>" unless e is cudaSuccess.
inline void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

/// cudaMemset(p, byte, bytes), then waits for it. cudaMemset runs on the legacy default stream, which a
/// cudaStreamNonBlocking stream does not wait for: without the wait, a launch there can run first and
/// have its output overwritten by the poison. The wait is on the legacy stream, not the device: on
/// virtual ranks (cuda_ranks.h) a peer's kernel on this GPU may wait for work this rank has yet to queue.
inline void poison_device(void* p, size_t bytes, const char* what, int byte = 0xFF) {
  if (bytes > 0) cuda_ok(cudaMemset(p, byte, bytes), what);
  cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), what);
}

/// cudaMemcpy host -> device, then waits (on the legacy stream, as poison_device): from pageable
/// memory it may return before the DMA lands.
inline void upload_device(void* dst, const void* src, size_t bytes, const char* what) {
  if (bytes > 0) cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), what);
  cuda_ok(cudaStreamSynchronize(cudaStreamLegacy), what);
}
#endif

}  // namespace epx::test

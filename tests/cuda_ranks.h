// tests/cuda_ranks.h: multi-rank CUDA tests on whatever GPUs the machine has.
//
// run_cuda_ranks(R, ...) runs fn(rank, group) on R ranks:
//   - real form, when the machine has >= R GPUs: one forked process per GPU, an NCCL group each
//     (forked_ranks.h; rank r on device r);
//   - virtual ranks otherwise (or when EPX_TEST_VIRTUAL_RANKS=1): one forked process whose R threads
//     are the ranks of make_virtual_cuda_groups on device 0.
// Either way the gtest process never initialises CUDA, a hang is killed at the deadline, and a rank
// reports failure by throwing (its message goes to stderr; the returned text names the failure).
//
// A body that runs on virtual ranks shares one GPU with its peers, so it must not wait for the whole
// device while a peer may wait for it: work on the rank's own cudaStreamNonBlocking stream, wait
// with cudaStreamSynchronize(stream) (or the legacy-stream helpers below), never cudaDeviceSynchronize
// between a peer's kernels and this rank's matching ones. Per-rank state lives in the body (threads,
// not processes: nothing written from the body is private to the rank).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "epx/cuda.h"
#include "epx/group.h"
#include "forked_ranks.h"

#ifdef EPX_WITH_CUDA
namespace epx::test {

/// Virtual ranks need eager kernel loading (make_virtual_cuda_groups refuses lazy loading, the CUDA
/// default): set before main, so before CUDA starts; a CUDA_MODULE_LOADING already given is kept.
inline const bool kEagerKernelLoading = [] { return ::setenv("CUDA_MODULE_LOADING", "EAGER", 0) == 0; }();

/// This rank's stream, created cudaStreamNonBlocking (it never waits for another rank's work on the
/// legacy stream) and destroyed at scope exit.
struct RankStream {
  cudaStream_t s = nullptr;
  RankStream() { cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream"); }
  ~RankStream() {
    if (s) (void)cudaStreamDestroy(s);
  }
  RankStream(const RankStream&) = delete;
  RankStream& operator=(const RankStream&) = delete;
};

/// True when R ranks run as virtual ranks here: fewer than R GPUs, or EPX_TEST_VIRTUAL_RANKS=1.
inline bool virtual_ranks_for(int R) {
  const char* force = std::getenv("EPX_TEST_VIRTUAL_RANKS");
  if (force && std::strcmp(force, "1") == 0) return true;
  return cuda::device_count() < R;
}

/// True when the machine has a GPU (virtual ranks need one).
inline bool has_gpu() { return cuda::device_count() >= 1; }

/// Tokens per rank for R ranks: `pattern` repeated from rank 0.
inline std::vector<int64_t> per_rank(int R, const std::vector<int64_t>& pattern) {
  std::vector<int64_t> T(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) T[static_cast<size_t>(r)] = pattern[static_cast<size_t>(r) % pattern.size()];
  return T;
}

/// One line naming where R ranks run (in the test log).
inline void say_where(int R) {
  std::printf("%d rank%s: %s\n", R, R == 1 ? "" : "s", virtual_ranks_for(R) ? "virtual ranks on GPU 0" : "one GPU per rank (NCCL)");
  std::fflush(stdout);
}

/// Throws this rank's failures ("" = none), after printing them: on virtual ranks only the first
/// rank's exception comes back from run_ranks, so every rank's own list goes to stderr too.
inline void throw_failures(int rank, const std::string& failures) {
  if (failures.empty()) return;
  std::fprintf(stderr, "[rank %d] %s\n", rank, failures.c_str());
  std::fflush(stderr);
  throw std::runtime_error("rank " + std::to_string(rank) + ": " + failures);
}

/// "" when every rank of R returned within deadline_s, else what failed. timeout_s bounds the
/// group's waits (< 0: EPX_TIMEOUT_S, else 60 s); ranks_per_node > 0 gives virtual ranks that many ranks per (virtual) node, and in
/// the real form is ignored (the node layout then comes from NCCL's environment, as in production).
inline std::string run_cuda_ranks(int R, double deadline_s, const std::function<void(int rank, const std::shared_ptr<Group>& g)>& fn,
                                  double timeout_s = -1.0, int ranks_per_node = 0) {
  if (timeout_s < 0) {
    const char* env = std::getenv("EPX_TIMEOUT_S");
    timeout_s = env != nullptr && std::atof(env) > 0 ? std::atof(env) : 60.0;
  }
  if (!virtual_ranks_for(R)) {
    const std::string path = fresh_dir() + "/uid";
    return run_ranks_forked(R, deadline_s, [&](int rank) {
      auto g = make_nccl_group(path, rank, R, rank, timeout_s);
      cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
      fn(rank, g);
    });
  }
  const std::string failed = run_ranks_forked(1, deadline_s, [&](int) {
    auto groups = make_virtual_cuda_groups(R, 0, timeout_s, ranks_per_node);
    run_ranks(groups, [&](int rank) {
      cuda_ok(cudaSetDevice(0), "cudaSetDevice");
      fn(rank, groups[static_cast<size_t>(rank)]);
    });
  });
  return failed.empty() ? failed : "virtual ranks (" + std::to_string(R) + " on one GPU): " + failed;
}

}  // namespace epx::test
#endif  // EPX_WITH_CUDA

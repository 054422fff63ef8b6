// ModularMoE on CUDA with a rank in error, through tests/cuda_ranks.h run_cuda_ranks (one forked process per
// GPU where the machine has enough GPUs, else R virtual ranks on GPU 0), at 2, 4 and 8 ranks on the mini
// presets: a bad id on one rank stopping every rank at the next call (ll, ht worst-case, hierarchical ll),
// the call after it within the tolerance of moe_reference_cpu; a stopped rank named in every other rank's
// error, never a hang. Shared: moe_cuda_testing.h.
//
// Rank bodies work on their own cudaStreamNonBlocking stream and wait on it (or on the legacy stream),
// never on the whole device, never touch the environment (set before run_cuda_ranks), and only read
// what the parent built (weights, inputs, references): on virtual ranks they are threads.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "epx/routing.h"
#include "forked_ranks.h"
#include "test_util.h"

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda_ranks.h"
#endif

using namespace epx;

#ifdef EPX_WITH_CUDA

#include "moe_cuda_testing.h"

// ll finds a bad id on the device (no host sync): the selection is dropped and the rank's next prepare
// threw, while the other ranks' next dispatch waited for it until timeout_s (Timeout, object unusable).
// The layer now folds the backend's pending device error into its all-gather of T: in the next call
// every rank throws InvalidArgument (rank 0 naming topk_idx[0, 0] = 999, every other rank naming rank
// 0), nothing moves, and the call after it is exact on every rank.
namespace {

/// A bad topk id (999) on rank 0 in call 1 through the layer on `backend` at R ranks: call 1 throws
/// nowhere (the backend finds it on the device, no host sync; the stream is synchronized after it),
/// call 2 throws InvalidArgument at once on every rank (rank 0 naming `rank0_wants`, the others "rank 0
/// rejected its arguments"), not Timeout after the group's 10 s, and call 3 is within kTol of the
/// reference. worst_case: DispatchConfig::use_worst_case_sizing (ht). virtual_nodes: every rank its own
/// node, so ll / ht take the hierarchical path (dispatch/hier/hier.h): in the real form NCCL over sockets
/// (NCCL_P2P_DISABLE / NCCL_SHM_DISABLE, set here before the ranks start), on virtual ranks
/// ranks_per_node = 1. Returns the failures ("" when it passed).
std::string bad_id_on_one_rank(int R, const std::string& backend, bool worst_case, bool virtual_nodes, const std::string& rank0_wants) {
  say_where(R);
  const std::vector<int64_t> tokens = per_rank(R, {5, 4, 0, 2});
  auto w = weights_for("deepseek-v3-mini");
  const int K = w->config.router.top_k;
  const Inputs in = make_inputs(*w, tokens, 93, DType::fp8_e4m3);
  Tensor bad = Tensor::empty({tokens[0], K}, DType::int32);
  std::copy_n(in.idx[0].ptr<int32_t>(), tokens[0] * K, bad.ptr<int32_t>());
  bad.ptr<int32_t>()[0] = 999;
  const char* nccl_no_p2p = virtual_nodes ? "1" : nullptr;
  const test::ScopedEnv p2p("NCCL_P2P_DISABLE", nccl_no_p2p), shm("NCCL_SHM_DISABLE", nccl_no_p2p);
  return run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const RankStream rs;
        const cudaStream_t stream = rs.s;
        const Device dev = g->device();
        const size_t me = static_cast<size_t>(rank);
        const int64_t H = w->config.hidden, T = tokens[me];
        const Tensor x = in.x[me].to(dev), idx = in.idx[me].to(dev), wts = in.wts[me].to(dev);
        const Tensor idx_bad = rank == 0 ? bad.to(dev) : idx;
        DispatchConfig dc;
        dc.num_max_dispatch_tokens_per_rank = 16;
        dc.dispatch_dtype = DType::fp8_e4m3;
        dc.use_worst_case_sizing = worst_case;
        const std::string name = backend + (worst_case ? " worst-case" : "") + (virtual_nodes ? " virtual nodes" : "");
        std::string failures;
        if (g->num_nodes() != (virtual_nodes ? R : 1)) failures += name + ": num_nodes " + std::to_string(g->num_nodes()) + "; ";
        ModularMoE layer(w, g, backend, dc, Config{});
        Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
        std::string error;
        try {
          layer.forward_routed(x, idx_bad, wts, out, Stream{stream});  // found on the device: no throw here
          cuda_ok(cudaStreamSynchronize(stream), "sync");
        } catch (const Error& e) {
          failures += name + " rank " + std::to_string(rank) + " call 1 threw: '" + e.what() + "'; ";
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
          layer.forward_routed(x, idx, wts, out, Stream{stream});
          cuda_ok(cudaStreamSynchronize(stream), "sync");
        } catch (const Error& e) {
          error = std::string(dynamic_cast<const InvalidArgument*>(&e) ? "InvalidArgument: " : "other: ") + e.what();
        }
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const std::string want = rank == 0 ? rank0_wants : "rank 0 rejected its arguments";
        if (error.rfind("InvalidArgument: ", 0) != 0 || error.find(want) == std::string::npos || s > 5.0)
          failures += name + " rank " + std::to_string(rank) + " call 2: want InvalidArgument naming '" + want + "' at once, got '" + error +
                      "' after " + std::to_string(s) + " s; ";
        std::printf("%s: rank %d, call 2 (%.3f s): %s\n", name.c_str(), rank, s, error.c_str());
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
        try {
          layer.forward_routed(x, idx, wts, out, Stream{stream});
          cuda_ok(cudaStreamSynchronize(stream), "sync");
          const double e = rel_l2_rows(out, in.reference, in.offset[me], T);
          if (!(e <= kTol)) failures += name + " rank " + std::to_string(rank) + " call 3: rel L2 " + std::to_string(e) + "; ";
          if (rank == 0) std::printf("%s: call 3: rank 0 rel L2 %.2e\n", name.c_str(), e);
        } catch (const Error& e) {
          failures += name + " rank " + std::to_string(rank) + " call 3 threw: '" + e.what() + "'; ";
        }
        std::fflush(stdout);
        g->barrier();
        throw_failures(rank, failures);
      },
      10.0,  // a hang shows as Timeout after 10 s, not 60
      virtual_nodes ? 1 : 0);
}

}  // namespace

TEST_P(ModularMoECuda, LlBadIdOnOneRankStopsEveryRankAtTheNextCall) {
  EXPECT_EQ(bad_id_on_one_rank(GetParam(), "ll", false, false, "topk_idx[0, 0] = 999"), "");
}

// The same on ht with use_worst_case_sizing (no host sync: the layout kernel's verdict reaches the host
// later) and on hierarchical ll across virtual nodes (one rank each): the layer's take_device_error
// fold, and the backends' prepare / finalize leave the error to it (defer_device_errors), so no rank
// throws alone.
TEST_P(ModularMoECuda, HtWorstCaseBadIdOnOneRankStopsEveryRankAtTheNextCall) {
  EXPECT_EQ(bad_id_on_one_rank(GetParam(), "ht", true, false, "topk_idx[0, 0] out of range"), "");
}

TEST_P(ModularMoECuda, HierarchicalLlBadIdOnOneRankStopsEveryRankAtTheNextCall) {
  EXPECT_EQ(bad_id_on_one_rank(GetParam(), "ll", false, true, "topk_idx[0, 0] = 999"), "");
}

// A stopped rank: every rank builds the layer (ll, collective), then rank R-1 stops (on virtual ranks
// its body returns: it never calls forward; in the real form its process sleeps past the others'
// timeout, then exits without teardown). Every other rank's forward ends within the group's timeout
// (+ slack) with an error naming the stopped rank: Timeout on the rank whose wait ran out first; the
// group is then aborted, and the ranks still waiting get CommError carrying that reason. NCCL cannot
// tell which peer never called, so in the real form the error names the operation only. Never a hang.
TEST_P(ModularMoECuda, AStoppedRankIsNamedInEveryOtherRanksError) {
  const int R = GetParam();
  say_where(R);
  const bool real = !virtual_ranks_for(R);
  const int stopped = R - 1;
  const double timeout = real ? 15.0 : 3.0;  // NCCL's start-up of R processes runs under this bound too
  auto w = weights_for("deepseek-v3-mini");
  const std::vector<int64_t> tokens = per_rank(R, {4, 3});
  const Inputs in = make_inputs(*w, tokens, 95, DType::fp8_e4m3);
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const RankStream rs;
        const cudaStream_t stream = rs.s;
        const Device dev = g->device();
        const size_t me = static_cast<size_t>(rank);
        std::string failures;
        {
          DispatchConfig dc;
          dc.num_max_dispatch_tokens_per_rank = 16;
          dc.dispatch_dtype = DType::fp8_e4m3;
          ModularMoE layer(w, g, "ll", dc, Config{});
          if (rank == stopped) {
            if (real) {  // alive, but never calls; then gone without teardown
              std::this_thread::sleep_for(std::chrono::duration<double>(timeout + 3.0));
              std::fflush(stdout);
              _exit(0);
            }
            return;  // never calls forward
          }
          const Tensor x = in.x[me].to(dev), idx = in.idx[me].to(dev), wts = in.wts[me].to(dev);
          Tensor out = Tensor::empty({tokens[me], w->config.hidden}, DType::bf16, dev);
          const auto t0 = std::chrono::steady_clock::now();
          std::string what;
          try {
            layer.forward_routed(x, idx, wts, out, Stream{stream});
            cuda_ok(cudaStreamSynchronize(stream), "sync");
          } catch (const Timeout& e) {
            what = std::string("Timeout: ") + e.what();
          } catch (const CommError& e) {
            what = std::string("CommError: ") + e.what();
          }
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::printf("rank %d: after %.2f s (timeout %.1f s): %s\n", rank, secs, timeout, what.c_str());
          if (what.empty()) failures += "forward without " + who + " did not throw Timeout or CommError; ";
          else if (!real && what.find(who) == std::string::npos) failures += "the error does not name " + who + ": '" + what + "'; ";
          if (secs < timeout * 0.9 || secs > timeout + 5.0) failures += "the error came after " + std::to_string(secs) + " s; ";
        }
        std::fflush(stdout);
        if (real) {  // the group is aborted: exit without teardown
          if (!failures.empty()) std::fprintf(stderr, "[rank %d] FAILED: %s\n", rank, failures.c_str());
          std::fflush(stderr);
          _exit(failures.empty() ? 0 : 1);
        }
        throw_failures(rank, failures);
      },
      timeout);
  EXPECT_EQ(failed, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, ModularMoECuda, ::testing::Values(2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });

#endif  // EPX_WITH_CUDA

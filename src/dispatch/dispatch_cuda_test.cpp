// dispatch/dispatch_cuda_test.cpp: every dispatch backend on CUDA groups against the CPU backends run
// on the same inputs, through tests/cuda_ranks.h (one forked process per GPU with an NCCL group where
// the machine has R GPUs, else R virtual ranks as threads on one GPU), at R = 1, 2, 4 and 8:
//   - naive, allgather_reducescatter and all2allv: every prepare output (x, x_scales, local topk_idx,
//     topk_weights, recv_count) and every finalize output bit for bit, and the same DispatchStats;
//   - ll and ht on one node (their flat path): the valid rows of every prepare output and every
//     finalize output bit for bit against LlCpu / HtCpu; across nodes only the path they take;
//   - the node layout every group reports and the path (flat or hierarchical) ll and ht take on it;
//   - a bad id on one rank (InvalidArgument on every rank, the object usable after), and a rank that
//     stops taking part (its peers get Timeout naming it, naive / agrs / all2allv).
//
// Inputs are fresh random tokens (never zeros) with uneven T per rank (0, 1, 7 and 128 included), -1
// selections, duplicate experts, the shared route, int32 and int64 ids, bf16 and fp8 (incl. UE8M0)
// dispatch, hidden 7168 and 2048 (2048 only at R >= 4), ranks holding no expert; two rounds per
// backend object with different shapes (the second on the legacy default stream, or on virtual ranks
// for ll / ht, whose kernels wait on peers, a second stream of the rank's own; x and out 2 bytes off
// alignment, except for flat ll, which needs them 16-byte aligned), and device outputs poisoned (NaN)
// before each call. The experts step is the harness's
// deterministic TestExperts run on the host on copies of the prepare outputs, so this test does not
// depend on the CUDA experts. The CPU oracles run in the gtest process before the ranks are forked;
// every rank reads them (shared read-only by the threads of virtual ranks). The hierarchical path:
// dispatch_hier_cuda_test.cpp; the padded form: dispatch_padded_cuda_test.cpp; shared: dispatch_cuda_testing.h.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_ranks.h"
#include "test_util.h"
#include "dispatch/hier/hier.h"
#include "dispatch_harness.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/dispatch_cuda_testing.h"

namespace {

/// Runs every backend on every case on the ranks of placement p and compares with the CPU snapshots:
/// naive / agrs / all2allv always; ll and ht against LlCpu / HtCpu when p is one node (across nodes
/// they take the hierarchical path, which run_hier_world checks; here only the path is checked).
void run_world(const Placement& pl) {
  const int R = pl.R;
  const bool one_node = pl.num_nodes() == 1;
  std::vector<GpuCase> cases = make_cases(R);
  for (GpuCase& gc : cases)
    for (const std::string& name : kBackends) gc.want.push_back(run_cpu(name, gc.c, gc.rounds));
  std::vector<std::vector<std::vector<std::vector<HierSnap>>>> node_want(cases.size());  // [case][ll, ht][round][rank]
  if (one_node)
    for (size_t i = 0; i < cases.size(); ++i)
      for (const std::string& name : kNodeBackends) node_want[i].push_back(run_hier_cpu(name, cases[i].c, cases[i].rounds, 0));
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr, odd_stream = nullptr;  // odd_stream: see run_node_gpu
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    if (pl.virt) cuda_ok(cudaStreamCreateWithFlags(&odd_stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    if (rank == 0)
      std::printf("node layout: %s (LSA team %d)%s\n", g->node_layout().describe().c_str(), g->node_layout().lsa_size,
                  failures.empty() ? "" : (" WRONG: " + failures).c_str());
    // Which path ll and ht take: hierarchical across nodes, the flat backend (the single-node fast
    // path) on one node. Proven by the object's capabilities and its node backend.
    for (const std::string& name : kNodeBackends) {
      auto pf = make_prepare_finalize(name, g, cases[0].c.config());
      const bool hier = pf->capabilities().hierarchical, inner = dispatch::hierarchical_node_backend(*pf) != nullptr;
      const bool want = !one_node;
      if (hier != want || inner != want)
        failures += name + ": hierarchical = " + (hier ? "true" : "false") + ", want " + (want ? "true" : "false") + "; ";
      else if (rank == 0)
        std::printf("%s on %s: %s path\n", name.c_str(), g->node_layout().describe().c_str(), hier ? "hierarchical" : "single-node (flat)");
    }
    int checked = 0;
    for (const GpuCase& gc : cases) {
      for (size_t b = 0; b < kBackends.size(); ++b) {
        const auto got = run_gpu(kBackends[b], gc.c, gc.rounds, g, stream);
        for (size_t i = 0; i < got.size(); ++i) {
          const Snapshot& want = gc.want[b][i][static_cast<size_t>(rank)];
          const std::string d = compare(got[i], want);
          if (!d.empty()) failures += kBackends[b] + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + gc.c.describe() + ": " + d + "\n";
          ++checked;
          if (rank == 0 && i + 1 == got.size())
            std::printf("%-24s %s: N=%lld %s, prepare + finalize %s vs CPU (out rel_l2 %.1e)\n", kBackends[b].c_str(),
                        gc.c.describe().c_str(), static_cast<long long>(got[i].num_recv_tokens), got[i].layout.c_str(),
                        d.empty() ? "bit-exact" : "DIFFER", rel_l2_bf16(got[i].out, want.out));
        }
      }
    }
    // ll and ht on one node against LlCpu / HtCpu (their protocols in depth: ll_cuda_test.cpp, ht_cuda_test.cpp).
    if (one_node) {
      for (size_t ci = 0; ci < cases.size(); ++ci) {
        const GpuCase& gc = cases[ci];
        for (size_t b = 0; b < kNodeBackends.size(); ++b) {
          const auto got = run_node_gpu(kNodeBackends[b], gc.c, gc.rounds, g, stream, odd_stream, false);
          for (size_t i = 0; i < got.size(); ++i) {
            const std::string d = compare_hier(got[i], node_want[ci][b][i][static_cast<size_t>(rank)]);
            if (!d.empty()) failures += kNodeBackends[b] + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + gc.c.describe() + ": " + d + "\n";
            ++checked;
            if (rank == 0 && i + 1 == got.size())
              std::printf("%-24s %s: prepare + finalize %s vs %s\n", kNodeBackends[b].c_str(), gc.c.describe().c_str(),
                          d.empty() ? "bit-exact" : "DIFFER", kNodeBackends[b] == "ll" ? "LlCpu" : "HtCpu");
          }
        }
      }
    }
    for (const std::string& name : kBackends) check_bad_id_throws_everywhere(name, cases[1], g, stream, failures);
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (odd_stream) cuda_ok(cudaStreamDestroy(odd_stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
    if (rank == 0) std::printf("dispatch CUDA OK on %s: %d rounds bit-exact vs the CPU backends\n", pl.describe().c_str(), checked);
  });
  EXPECT_EQ(failed, "") << pl.describe();
}

/// Rank `stopped` of R stops taking part in backend `name` after create (its body returns before
/// prepare): every other rank's prepare throws within about the group's timeout (3 s), and the next
/// call throws CommError. On virtual ranks the error names the stopped rank: Timeout ("rank S did not
/// arrive"), or CommError where a peer's Timeout aborted the group first (its reason names rank S
/// too). NCCL cannot tell which peer of a collective is missing, so the real form checks the kind
/// and the time only; there the stopped rank stays alive (a silent peer, not a dead process) until
/// its peers are done, and the group and backend are leaked (no teardown that could wait on a peer).
void run_stopped_rank(int R, const std::string& name, int stopped) {
  Case c;
  c.R = R;
  c.E = 2 * R;
  c.K = 2;
  c.H = 256;
  c.cap = 16;
  c.seed = 91;
  const std::vector<RankInput> in = make_inputs(c);  // T = cap/2 + r
  const bool virt = virtual_ranks_for(R);
  const double kGroupTimeoutS = 3.0, kMaxS = 20.0;
  const std::string failed = run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        auto pf = make_prepare_finalize(name, g, c.config());
        if (rank == stopped) {
          if (!virt) {
            static_cast<void>(new std::shared_ptr<Group>(g));
            static_cast<void>(pf.release());
            std::this_thread::sleep_for(std::chrono::duration<double>(3 * kGroupTimeoutS));
          }
          return;
        }
        cudaStream_t stream = nullptr;
        cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
        const Device dev = g->device();
        const RankInput& ri = in[static_cast<size_t>(rank)];
        const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
        auto call = [&](std::string& what) {
          try {
            pf->prepare({x, idx, w, Stream{stream}});
          } catch (const Timeout& e) {
            what = e.what();
            return std::string("Timeout");
          } catch (const CommError& e) {
            what = e.what();
            return std::string("CommError");
          }
          return std::string("no error");
        };
        const auto t0 = std::chrono::steady_clock::now();
        std::string what, again;
        const std::string kind = call(what);
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const std::string kind_again = call(again);
        std::string failures;
        const bool kind_ok = kind == "Timeout" || (kind == "CommError" && (!virt || what.find("timed out") != std::string::npos));
        if (!kind_ok || s > kMaxS || (virt && !names_rank(what, stopped)))
          failures += name + ": rank " + std::to_string(rank) + " got " + kind + " after " + std::to_string(s) + " s: '" + what +
                      "' (want Timeout naming rank " + std::to_string(stopped) + " within " + std::to_string(kMaxS) + " s); ";
        if (kind_again != "CommError") failures += name + ": the call after the timeout gave " + kind_again + " '" + again + "', want CommError; ";
        if (failures.empty())
          std::printf("%s, rank %d stopped: rank %d got %s after %.1f s: %s\n", name.c_str(), stopped, rank, kind.c_str(), s, what.c_str());
        if (virt) {
          cuda_ok(cudaStreamDestroy(stream), "stream destroy");
        } else {
          static_cast<void>(new std::shared_ptr<Group>(g));
          static_cast<void>(pf.release());
        }
        if (!failures.empty()) throw std::runtime_error(failures);
      },
      kGroupTimeoutS);
  EXPECT_EQ(failed, "") << name << ", R = " << R << ", rank " << stopped << " stopped";
}

// ---- the tests: every multi-rank case at R = 2, 4 and 8 (virtual ranks where GPUs are short) ----

TEST(DispatchCuda, FlatBackendsMatchCpuOneRank) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU";
  run_world(place(1, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(2, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(4, Nodes::one_host));
}

TEST(DispatchCuda, FlatBackendsMatchCpuEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(8, Nodes::one_host));
}

// The same backends across nodes: in the real form every GPU its own node (NCCL_P2P_DISABLE=1
// NCCL_SHM_DISABLE=1: NCCL's socket transport between the GPUs; per-node communicators, host
// collectives across), on virtual ranks 2 nodes of R / 2 ranks.
TEST(DispatchCuda, FlatBackendsMatchCpuTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, FlatBackendsMatchCpuVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, FlatBackendsMatchCpuVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_world(place(8, Nodes::virtual_nodes, 4));
}

// One rank stops taking part: naive stops the last rank, allgather_reducescatter rank 0, all2allv
// rank R / 2.
void run_stopped_ranks(int R) {
  run_stopped_rank(R, "naive", R - 1);
  run_stopped_rank(R, "allgather_reducescatter", 0);
  run_stopped_rank(R, "all2allv", R / 2);
}

TEST(DispatchCuda, StoppedRankTimesOutTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(2);
}

TEST(DispatchCuda, StoppedRankTimesOutFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(4);
}

TEST(DispatchCuda, StoppedRankTimesOutEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_ranks(8);
}

}  // namespace

#else

TEST(DispatchCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

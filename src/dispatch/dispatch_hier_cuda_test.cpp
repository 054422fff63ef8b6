// dispatch/dispatch_hier_cuda_test.cpp: ll and ht across nodes on CUDA groups (the hierarchical path,
// src/dispatch/hier/hier.h), through tests/cuda_ranks.h: in the real form every GPU is its own node (NCCL's
// variables, NodeEnv), on virtual ranks the group reports nodes of ranks_per_node ranks (2 nodes of 1, 2
// and 4 ranks at R = 2, 4 and 8); bit for bit against the CPU twin of the hierarchical path, and against
// the flat CPU backends (rows bit for bit with one rank per node, the combine within bf16 noise); bad
// arguments on one rank throw InvalidArgument on every rank, the object usable after. Inputs, oracles and
// snapshots: dispatch_cuda_testing.h (the cases: the file comment of dispatch_cuda_test.cpp).
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

// ---- ll / ht across nodes (the hierarchical path: src/dispatch/hier/hier.h) ----------------------------

/// ll and ht across the nodes of placement pl (real form: one GPU per node, NCCL over sockets;
/// virtual ranks: nodes of pl.per_node ranks) against (a) the CPU twin of the hierarchical path (CPU
/// groups of the same node layout), bit for bit, and (b) the flat CPU backends (LlCpu / HtCpu): with
/// one rank per node the same rows bit for bit (it keeps the slot order), and the combine within bf16
/// noise (one extra rounding of each node's partial, hier.h).
void run_hier_world(const Placement& pl) {
  const int R = pl.R, P = pl.per_node;
  struct HierCase {
    std::string name;
    GpuCase g;
    std::vector<std::vector<HierSnap>> twin, flat;  // [round][rank]
    bool unsupported = false;                     // a node holds no routed expert
  };
  std::vector<HierCase> hcs;
  for (const std::string& name : kNodeBackends) {
    std::vector<GpuCase> cases = make_cases(R);
    for (size_t i = 0; i < cases.size(); ++i) {
      HierCase h{name, cases[i], {}, {}, false};
      h.unsupported = dispatch::why_no_hierarchical(name, *make_cpu_groups(R, 30.0, P)[0], h.g.c.config()).has_value();
      hcs.push_back(std::move(h));
      if (name == "ll" && i == 0) {  // the default combine mode too
        HierCase p{name, cases[i], {}, {}, false};
        p.g.c.ll_combine = LlCombine::partial_fp32;
        hcs.push_back(std::move(p));
      }
    }
  }
  for (HierCase& h : hcs) {
    if (h.unsupported) continue;
    h.twin = run_hier_cpu(h.name, h.g.c, h.g.rounds, P);
    h.flat = run_hier_cpu(h.name, h.g.c, h.g.rounds, 0);
  }
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr, odd_stream = nullptr;  // odd_stream: see run_node_gpu
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    if (pl.virt) cuda_ok(cudaStreamCreateWithFlags(&odd_stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    if (rank == 0) std::printf("node layout: %s (LSA team %d)\n", g->node_layout().describe().c_str(), g->node_layout().lsa_size);
    int checked = 0;
    for (const HierCase& h : hcs) {
      const Case& c = h.g.c;
      const std::string what = h.name + (c.ll_combine != LlCombine::column && h.name == "ll" ? std::string("/") + ll_combine_name(c.ll_combine) : "") +
                               " " + c.describe();
      if (h.unsupported) {
        std::string msg;
        try {
          make_prepare_finalize(h.name, g, c.config());
        } catch (const Unsupported& e) {
          msg = e.what();
        }
        if (msg.find("node layout = " + g->node_layout().describe()) == std::string::npos)
          failures += what + ": want Unsupported naming the node layout, got '" + msg + "'\n";
        else if (rank == 0)
          std::printf("%s: Unsupported as expected: %s\n", what.c_str(), msg.c_str());
        continue;
      }
      const auto got = run_node_gpu(h.name, c, h.g.rounds, g, stream, odd_stream, true);
      for (size_t i = 0; i < got.size(); ++i) {
        const HierSnap& twin = h.twin[i][static_cast<size_t>(rank)];
        const HierSnap& flat = h.flat[i][static_cast<size_t>(rank)];
        const std::string d = compare_hier(got[i], twin);
        // Rows against the flat backend: with one rank per node only (several reorder the slots).
        HierSnap flat_rows = flat, got_rows = got[i];
        flat_rows.out.clear();
        got_rows.out.clear();
        const std::string df = P == 1 ? compare_hier(got_rows, flat_rows) : "";
        const double rel = rel_l2_bf16(got[i].out, flat.out);
        const int64_t T = h.g.rounds[i][static_cast<size_t>(rank)].x.size(0);
        if (!d.empty()) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " vs CPU twin: " + d + "\n";
        if (!df.empty()) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " rows vs flat CPU: " + df + "\n";
        if (T > 0 && !(rel < 1e-2)) failures += what + " round " + std::to_string(i) + " rank " + std::to_string(rank) + " out vs flat CPU rel_l2 " + std::to_string(rel) + "\n";
        ++checked;
        if (rank == 0 && i + 1 == got.size())
          std::printf("%-28s: prepare + finalize %s vs the CPU twin; rows %s vs flat %s, out rel_l2 %.1e\n", what.c_str(),
                      d.empty() ? "bit-exact" : "DIFFER", P != 1 ? "not compared" : df.empty() ? "bit-exact" : "DIFFER",
                      h.name == "ll" ? "LlCpu" : "HtCpu", rel);
      }
    }
    // A bad id on the last rank of graph-safe hierarchical ll: the device sends nothing for it and that
    // rank's finalize reports it after enqueuing all its work, so the other ranks' rounds complete
    // (no rank is left in an inter-node step), and the object stays usable.
    {
      const GpuCase& gc = hcs[2].g;  // ll, bf16, shared route, int64 ids, T > 0 on the last rank
      const Case& c = gc.c;
      if (hcs[2].name != "ll" || !c.idx64 || c.tokens(R - 1) < 1) throw std::runtime_error("bad-id case: " + hcs[2].name + " " + c.describe());
      const RankInput& ri = gc.rounds[0][static_cast<size_t>(rank)];
      const Device dev = g->device();
      auto pf = make_prepare_finalize("ll", g, c.config());
      Tensor idx = Tensor::empty({ri.x.size(0), c.K}, DType::int64);
      std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
      if (rank == R - 1) idx.ptr<int64_t>()[0] = c.E + 1;
      const Tensor x = ri.x.to(dev), idx_d = idx.to(dev), w = ri.topk_weights.to(dev);
      const Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
      auto round = [&](const Tensor& ids) {
        const PrepareResult p = pf->prepare({x, ids, w, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
        Tensor eo = Tensor::zeros(std::vector<int64_t>(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim), DType::bf16, dev);
        std::string what;
        try {
          pf->finalize({eo, out, Stream{stream}});
        } catch (const InvalidArgument& e) {
          what = e.what();
        }
        cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
        return what;
      };
      const std::string what = round(idx_d);
      const bool want = rank == R - 1;
      if (want != (what.find("topk_idx[0, 0]") != std::string::npos) || (!want && !what.empty()))
        failures += "hierarchical ll bad id: rank " + std::to_string(rank) + " got '" + what + "'\n";
      else if (want)
        std::printf("hierarchical ll bad id on rank %d: %s\n", rank, what.c_str());
      const std::string again = round(ri.topk_idx.to(dev));
      if (!again.empty()) failures += "hierarchical ll after a bad id: rank " + std::to_string(rank) + " threw '" + again + "'\n";
    }
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (odd_stream) cuda_ok(cudaStreamDestroy(odd_stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("mismatches:\n" + failures);
    if (rank == 0) std::printf("hierarchical ll/ht OK on %s: %d rounds checked\n", pl.describe().c_str(), checked);
  });
  EXPECT_EQ(failed, "") << pl.describe();
}

/// Bad arguments on ONE rank of an eager hierarchical call across the nodes of pl: every rank throws
/// InvalidArgument quickly (the verdict is shared over the whole group before the inter-node
/// ncclSend/ncclRecv, hier.cpp), none is left waiting; the object stays usable and its next rounds
/// equal the CPU twin bit for bit. Per backend (ll, ht): (1) prepare with T = cap + 1 on the last rank,
/// (2) finalize with out [T + 1, H] on the last rank, then the same finalize with the right out.
/// The group's timeout is short (10 s) and every throwing call must return within 5 s, so a hang
/// fails the test (or the ranks' 120 s deadline) instead of stalling the run.
void run_hier_bad_args(const Placement& pl) {
  const int R = pl.R;
  Case c;
  c.R = R;
  c.E = 8;
  c.K = 3;
  c.H = 2048;
  c.cap = 16;
  c.dtype = DType::bf16;
  c.dups = true;
  c.masked = 0.1;
  c.seed = 77;
  const Rounds good = {make_inputs(c)};  // T = cap/2 + r
  Case big = c;
  big.T.assign(static_cast<size_t>(R), 0);
  for (int r = 0; r < R; ++r) big.T[static_cast<size_t>(r)] = r == R - 1 ? c.cap + 1 : c.tokens(r);
  big.seed = 78;
  const std::vector<RankInput> too_many = make_inputs(big);
  const std::vector<std::string> names = {"ll", "ht"};
  std::vector<std::vector<std::vector<HierSnap>>> twin;  // [backend][round][rank]
  for (const std::string& name : names) twin.push_back(run_hier_cpu(name, c, good, pl.per_node));
  const double kGroupTimeoutS = 10.0, kMaxThrowS = 5.0;
  std::printf("%s\n", pl.describe().c_str());
  const std::string failed = run_placed(pl, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    cudaStream_t stream = nullptr;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
    std::string failures = check_node_layout(*g, pl);
    const Device dev = g->device();
    const bool bad_rank = rank == R - 1;
    const RankInput& ri = good[0][static_cast<size_t>(rank)];
    const int64_t T = ri.x.size(0);
    const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
    const RankInput& rb = too_many[static_cast<size_t>(rank)];
    const Tensor xb = rb.x.to(dev), idxb = rb.topk_idx.to(dev), wb = rb.topk_weights.to(dev);
    using clock = std::chrono::steady_clock;
    // Runs f, which must throw InvalidArgument naming `want` (this rank's own sentence on the bad rank,
    // "rank R-1 rejected its arguments" elsewhere) within kMaxThrowS.
    auto expect_throw = [&](const std::string& what, const std::string& want, const std::function<void()>& f) {
      const auto t0 = clock::now();
      std::string msg;
      bool threw = false;
      try {
        f();
      } catch (const InvalidArgument& e) {
        threw = true;
        msg = e.what();
      } catch (const Error& e) {
        msg = std::string("wrong type: ") + e.what();
      }
      const double s = std::chrono::duration<double>(clock::now() - t0).count();
      const std::string need = bad_rank ? want : "rank " + std::to_string(R - 1) + " rejected its arguments";
      if (!threw || msg.find(need) == std::string::npos || s > kMaxThrowS)
        failures += what + ": rank " + std::to_string(rank) + (threw ? " threw" : " did not throw InvalidArgument") + " after " +
                    std::to_string(s) + " s: '" + msg + "' (want '" + need + "')\n";
      else
        std::printf("rank %d %s: InvalidArgument after %.3f s: %s\n", rank, what.c_str(), s, msg.c_str());
    };
    for (size_t b = 0; b < names.size(); ++b) {
      const std::string& name = names[b];
      auto pf = make_prepare_finalize(name, g, c.config());
      if (!pf->capabilities().hierarchical) {
        failures += name + " did not take the hierarchical path\n";
        continue;
      }
      const HierSnap& want = twin[b][0][static_cast<size_t>(rank)];
      // One good round; its output must equal the CPU twin's. bad_out: finalize first with out
      // [T + 1, H] on the last rank (error (2)), then with the right out.
      auto round = [&](const std::string& what, bool bad_out) {
        HierSnap s;
        const PrepareResult p = pf->prepare({x, idx, w, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after prepare");
        const Tensor eo = hier_take(c, rank, p, s).to(dev);
        if (bad_out) {
          const Tensor wrong = Tensor::empty({T + 1, c.H}, DType::bf16, dev);
          const Tensor right = Tensor::empty({T, c.H}, DType::bf16, dev);
          const TensorView o = bad_rank ? wrong.view() : right.view();
          expect_throw(name + " finalize, out [T + 1, H] on rank " + std::to_string(R - 1), ": out = ",
                       [&] { pf->finalize({eo, o, Stream{stream}}); });
        }
        const Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison out");
        pf->finalize({eo, out, Stream{stream}});
        cuda_ok(cudaStreamSynchronize(stream), "sync after finalize");
        s.out = host_bytes(out);
        const std::string d = compare_hier(s, want);
        if (!d.empty()) failures += name + " " + what + ": rank " + std::to_string(rank) + " vs the CPU twin: " + d + "\n";
      };
      round("round before the errors", false);
      expect_throw(name + " prepare, T = cap + 1 on rank " + std::to_string(R - 1), "num_max_dispatch_tokens_per_rank",
                   [&] { pf->prepare({xb, idxb, wb, Stream{stream}}); });
      round("round after a bad prepare (its finalize first given a bad out)", true);
      round("round after a bad finalize", false);
    }
    g->barrier();
    cuda_ok(cudaStreamDestroy(stream), "stream destroy");
    if (!failures.empty()) throw std::runtime_error("failures:\n" + failures);
    if (rank == 0) std::printf("hierarchical ll/ht on %s: bad arguments on one rank throw on every rank\n", pl.describe().c_str());
  }, kGroupTimeoutS);
  EXPECT_EQ(failed, "") << pl.describe();
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, HierarchicalLlHtMatchCpuVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_world(place(8, Nodes::virtual_nodes, 4));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankTwoVirtualNodes) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(2, Nodes::virtual_nodes, 1));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankVirtualNodesFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(4, Nodes::virtual_nodes, 2));
}

TEST(DispatchCuda, HierarchicalBadArgsThrowOnEveryRankVirtualNodesEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_bad_args(place(8, Nodes::virtual_nodes, 4));
}

}  // namespace

#endif  // EPX_WITH_CUDA

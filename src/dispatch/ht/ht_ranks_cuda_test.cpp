// dispatch/ht/ht_ranks_cuda_test.cpp: the ht backend on CUDA with ranks out of step and the caller's Config,
// against HtCpu (ht.h) through tests/cuda_ranks.h (one forked process per GPU where the machine has enough,
// else virtual ranks on GPU 0): on 2 ranks a late rank is not overrun (two finalizes per prepare); at 2, 4
// and 8 ranks the caller's Config and the SM share on virtual ranks, and the hierarchical ht takes the
// caller's Config (2 ranks, and 4 ranks in 2 nodes); a stopped rank (created the object, never calls
// prepare, or never calls finalize): every other rank gets Timeout naming it within the short group
// timeout, no hang; a disabled timeline diagnostic. Harness and cases: ht_cuda_testing.h, the file comment
// of ht_cuda_test.cpp.
// Rank bodies work on their own cudaStreamNonBlocking stream and wait on it or on the legacy stream,
// never on the whole device between multi-rank calls (cuda_ranks.h), and never touch the environment
// (set before run_cuda_ranks).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>  // setenv (the test bodies' callers only)
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_ranks.h"
#include "test_util.h"
#include "dispatch/ht/ht.h"
#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/hier/hier.h"
#include "dispatch/ht/ht_cuda.h"
#include "dispatch/ht/ht_cuda_testing.h"

namespace {

/// A late rank must not be overrun (the ordering bug that compute-sanitizer's slow-down exposed:
/// bench/NOTES.md "ht ordering bug"). Rank 1 has no tokens, so its combines wait for nothing; rank 0
/// sleeps before its first finalize of every round; each prepare is finalized twice (expert_contiguous:
/// weighted, then unweighted; Flat: two expert_out). Without the "combine done" wait rank 1's second
/// combine stores into rank 0's `back` before rank 0 has reduced the first one, deterministically: rank
/// 0's first out comes out of the second combine's rows.
void run_late_rank() {
  struct LateSpec {
    bool contig;
    DType dtype;
    int64_t H;
  };
  const std::vector<LateSpec> specs = {{true, DType::bf16, 2048}, {false, DType::fp8_e4m3, 2048}, {false, DType::bf16, 7168}};
  std::vector<HtCase> cases;
  uint64_t seed = 90;
  for (const LateSpec& sp : specs) {
    HtCase g;
    g.contig = sp.contig;
    Case& c = g.c;
    c.R = 2;
    c.E = 16;
    c.K = 4;
    c.H = sp.H;
    c.cap = 512;
    c.T = {512, 0};
    c.dtype = sp.dtype;
    c.masked = 0.1;
    c.align = sp.contig ? 8 : 1;
    c.seed = seed++;
    Case c2 = c;
    c2.seed = c.seed + 1000;
    g.rounds = {make_inputs(c), make_inputs(c2)};
    cases.push_back(std::move(g));
  }
  Drive drive;
  drive.twice = true;
  drive.late_rank = 0;
  drive.late_ms = 300;
  for (HtCase& hc : cases) hc.want = run_cpu(hc.c, hc.rounds, hc.contig, drive);
  say_where(2);
  const std::string failed = run_cuda_ranks(2, 200.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    std::string failures;
    for (const HtCase& hc : cases) {
      const auto got = run_gpu(hc.c, hc.rounds, hc.contig, g, stream, drive);
      std::string case_failures;
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string d = compare(got[i], hc.want[i][static_cast<size_t>(rank)]);
        if (!d.empty()) case_failures += "round " + std::to_string(i) + " rank " + std::to_string(rank) + " " + hc.c.describe() + ": " + d + "\n";
      }
      failures += case_failures;
      if (rank == 0)
        std::printf("late rank 0 (%d ms), two finalizes per prepare, ht%s %s: %s\n", drive.late_ms, hc.contig ? " expert_contiguous" : "",
                    hc.c.describe().c_str(), case_failures.empty() ? "bit-exact vs HtCpu (rank 0)" : "DIFFER");
      std::fflush(stdout);
    }
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

/// make_prepare_finalize(name, group, cfg, config): HtCuda takes its launch settings from the caller's
/// Config (ModularMoE passes its own), not from a Config::load() of its own, at most the rank's share of
/// the SMs (SMs / ranks_per_gpu: all of them with one rank per GPU, 1/R on R virtual ranks); and still
/// round-trips.
void run_callers_config(int R) {
  say_where(R);
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  c.T = per_rank(R, {20, 32, 0, 1});
  c.seed = 7;
  const auto in = make_inputs(c);
  const auto want = run_cpu(c, {in}, false);
  const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const int sms = device_sms(g), share = g->ranks_per_gpu() > 1 ? sms / g->ranks_per_gpu() - 1 : sms;  // the layout CTA counts
    if (g->ranks_per_gpu() != (virtual_ranks_for(R) ? R : 1))
      throw std::runtime_error("ranks_per_gpu " + std::to_string(g->ranks_per_gpu()) + " on rank " + std::to_string(rank));
    std::string failures;
    Config config;  // defaults, then two fields: whatever EPX_HT_* says must not matter
    config.ht_num_sms = 5;
    config.ht_warps_per_block = 3;
    auto pf = make_prepare_finalize("ht", g, c.config(), config);
    auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
    const int want_sms = std::min(5, share);
    if (!ht) failures += "not HtCuda; ";
    else if (ht->num_sms() != want_sms || ht->warps_per_block() != 3)
      failures += "num_sms " + std::to_string(ht->num_sms()) + " warps " + std::to_string(ht->warps_per_block()) + ", want " +
                  std::to_string(want_sms) + " and 3; ";
    pf.reset();
    config.ht_num_sms = sms;  // every SM asked for: the rank gets its share
    pf = make_prepare_finalize("ht", g, c.config(), config);
    ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
    if (ht && ht->num_sms() != share)
      failures += "ht_num_sms = " + std::to_string(sms) + " (all SMs) gave num_sms " + std::to_string(ht->num_sms()) + ", want the share " +
                  std::to_string(share) + "; ";
    if (rank == 0) std::printf("ht num_sms: %d of %d SMs asked for 5, %d asked for all (%d ranks per GPU)\n", want_sms, sms, share, g->ranks_per_gpu());
    pf.reset();
    const auto got = run_gpu(c, {in}, false, g, stream);  // the default object still matches HtCpu
    failures += compare(got[0], want[0][static_cast<size_t>(rank)]);
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

/// Sets the NCCL variables that make every GPU its own node, in this (the gtest) process before the real
/// form's ranks are forked (NCCL reads its environment once per process; a rank's thread must not set
/// it), and restores the previous values when it goes.
class NcclNodesEnv {
 public:
  NcclNodesEnv() : p2p_("NCCL_P2P_DISABLE", "1"), shm_("NCCL_SHM_DISABLE", "1") {}

 private:
  test::ScopedEnv p2p_, shm_;
};

/// The same across nodes (the hierarchical ht of hier.h): in the real form every GPU its own node (NCCL
/// without P2P / SHM), on virtual ranks nodes of `virtual_per_node` ranks; the caller's Config reaches
/// the node backend (HtCuda on the node group).
void run_hier_callers_config(int R, int virtual_per_node) {
  say_where(R);
  const bool virt = virtual_ranks_for(R);
  const int want_nodes = virt ? R / virtual_per_node : R;
  std::optional<NcclNodesEnv> env;
  if (!virt) env.emplace();
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 32;
  const std::string failed = run_cuda_ranks(
      R, 120.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        std::string failures;
        if (g->num_nodes() != want_nodes) failures += "num_nodes " + std::to_string(g->num_nodes()) + ", want " + std::to_string(want_nodes) + "; ";
        const int want_sms = std::min(5, device_sms(g) / std::max(1, g->ranks_per_gpu()));
        Config config;
        config.ht_num_sms = 5;
        config.ht_warps_per_block = 3;
        auto pf = make_prepare_finalize("ht", g, c.config(), config);
        const auto* node = dynamic_cast<const dispatch::HtCuda*>(dispatch::hierarchical_node_backend(*pf));
        if (!pf->capabilities().hierarchical || !node) failures += "not hierarchical ht over HtCuda; ";
        else if (node->num_sms() != want_sms || node->warps_per_block() != 3)
          failures += "node backend num_sms " + std::to_string(node->num_sms()) + " warps " + std::to_string(node->warps_per_block()) + ", want " +
                      std::to_string(want_sms) + " and 3; ";
        g->barrier();
        throw_failures(rank, failures);
      },
      60.0, virt ? virtual_per_node : 0);
  EXPECT_EQ(failed, "");
}

// ---- a stopped rank ------------------------------------------------------------------------------

/// The group timeout of the stopped-rank tests: every device wait of ht is bounded by it.
constexpr double kStopTimeout = 3.0;

/// The stopped rank's part: on virtual ranks its body returns at once (its thread ends; the buffers its
/// peers store into are co-owned and stay); in the real form its process sleeps past its peers' timeouts
/// (a process that exits while its peers still store into its memory over NVLink is not what this tests).
void stopped_rank(bool real) {
  if (real) std::this_thread::sleep_for(std::chrono::duration<double>(kStopTimeout + 4.0));
}

/// The end of a stopped-rank test's body. Real form (one process per GPU): the process exits here without
/// teardown (the stopped rank never consumed what its peers sent); on virtual ranks the body returns (or
/// throws the failures) like any other, and its objects are destroyed: their waits are over.
void end_stopped_test(int rank, const std::string& failures, bool real) {
  std::fflush(stdout);
  if (real) {
    if (!failures.empty()) std::fprintf(stderr, "[rank %d] FAILED: %s\n", rank, failures.c_str());
    std::fflush(stderr);
    _exit(failures.empty() ? 0 : 1);
  }
  throw_failures(rank, failures);
}

/// Rank `stopped` creates the object with the others but never calls prepare (at_finalize false), or
/// prepares with them and never calls finalize (at_finalize true: every rank's token 0 selects one of its
/// experts, so every other rank's combine waits for its rows). Every other rank gets Timeout naming the
/// stopped rank within about the group timeout (prepare: from that call; finalize: once the combine has
/// given up, from the next call), then CommError from the call after; nothing hangs.
void run_stopped_rank(int R, int stopped, bool at_finalize) {
  say_where(R);
  const bool real = !virtual_ranks_for(R);
  std::printf("rank %d stops before its %s (%s)\n", stopped, at_finalize ? "finalize" : "prepare", real ? "sleeps" : "returns at once");
  Case c;
  c.R = R;
  c.E = std::max(8, 2 * R);
  c.K = 2;
  c.H = 256;
  c.cap = 16;
  c.T = per_rank(R, {8, 5, 1, 7});
  c.masked = 0.0;
  c.seed = 51;
  std::vector<RankInput> in = make_inputs(c);
  const ExpertRange sr = expert_range(c.E, c.R, stopped);
  for (RankInput& ri : in) {  // token 0 of every rank: column 0 := an expert of the stopped rank that it does not name yet
    int32_t* id = ri.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false), T >= 1 everywhere
    bool there = false;
    for (int k = 0; k < c.K; ++k) there = there || (id[k] >= sr.begin && id[k] < sr.end);
    for (int e = sr.begin; !there && e < sr.end; ++e) {
      bool named = false;
      for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
      if (!named) id[0] = e, there = true;
    }
  }
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 90.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        auto pf = make_prepare_finalize("ht", g, c.config());
        const RankInput& ri = in[static_cast<size_t>(rank)];
        const Tensor x = ri.x.to(dev), idx = ri.topk_idx.to(dev), w = ri.topk_weights.to(dev);
        std::string failures;
        if (rank == stopped && !at_finalize) {
          stopped_rank(real);
          return end_stopped_test(rank, failures, real);
        }
        std::string what;
        auto t0 = std::chrono::steady_clock::now();
        try {
          const PrepareResult p = pf->prepare({x, idx, w, Stream{s}});
          cuda_ok(cudaStreamSynchronize(s), "sync prepare");
          if (at_finalize) {
            if (rank == stopped) {
              stopped_rank(real);
              return end_stopped_test(rank, failures, real);
            }
            const Tensor eo = Tensor::zeros({p.num_recv_tokens, c.H}, DType::bf16, dev), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16, dev);
            t0 = std::chrono::steady_clock::now();
            pf->finalize({eo, out, Stream{s}});
            cuda_ok(cudaStreamSynchronize(s), "sync finalize");  // the combine gives up after the timeout
            pf->prepare({x, idx, w, Stream{s}});                   // the next call reports it
          }
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kStopTimeout, what.c_str());
        const char* op = at_finalize ? "finalize" : "prepare";
        if (what.find(who) == std::string::npos || what.find(op) == std::string::npos)
          failures += "want Timeout naming " + who + " and the " + op + ": '" + what + "'; ";
        if (secs < kStopTimeout * 0.9 || secs > kStopTimeout + 15.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        bool comm_error = false;
        try {
          pf->prepare({x, idx, w, Stream{s}});
        } catch (const CommError&) {
          comm_error = true;
        }
        if (!comm_error) failures += "the call after a timeout did not throw CommError; ";
        cuda_ok(cudaStreamSynchronize(s), "sync");
        end_stopped_test(rank, failures, real);
      },
      kStopTimeout);
  EXPECT_EQ(failed, "");
}

/// Diagnostics (run with --gtest_also_run_disabled_tests): ht-v3 round trips aligned as `epx bench`
/// aligns them (host barrier, then a one-float all-reduce on the stream), CUDA-event times of prepare
/// and finalize and the device timeline (HtTimeline, us after the layout kernel's start), medians over
/// the iterations, per rank; no correctness claim. Real form only (one GPU per rank): it times NVLink, and
/// HtCuda::timeline_us synchronizes the whole device, which on virtual ranks waits for the peers' kernels.
void run_timeline() {
  Case c;
  c.R = 2;
  c.E = 256;
  c.K = 8;
  c.H = 7168;
  c.cap = 4096;
  c.T = {4096, 4096};
  c.masked = 0.0;
  c.flat_combine = FlatCombine::partial_fp32;  // the default combine: fp32 partials
  const auto in = make_inputs(c);
  const std::string failed = run_cuda_ranks(2, 200.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    const Tensor x = in[static_cast<size_t>(rank)].x.to(dev), idx = in[static_cast<size_t>(rank)].topk_idx.to(dev),
                 w = in[static_cast<size_t>(rank)].topk_weights.to(dev);
    const Tensor out = Tensor::empty({4096, c.H}, DType::bf16, dev), eo = Tensor::zeros({2 * 4096, c.H}, DType::fp32, dev);
    const Tensor word = Tensor::zeros({1}, DType::fp32, dev);
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    for (DType dt : {DType::fp8_e4m3, DType::bf16}) {
      Case cc = c;
      cc.dtype = dt;
      auto pf = make_prepare_finalize("ht", g, cc.config());
      auto* ht = dynamic_cast<dispatch::HtCuda*>(pf.get());
      cudaEvent_t ev[3];
      for (auto& e : ev) cuda_ok(cudaEventCreate(&e), "event");
      std::vector<double> disp, comb;
      std::vector<std::vector<double>> tls(dispatch::kTlCount);
      const int iters = 20;
      for (int i = 0; i < iters + 3; ++i) {
        g->barrier();
        g->all_reduce_sum(word.data(), word.data(), 1, DType::fp32, Stream{stream});
        cuda_ok(cudaEventRecord(ev[0], stream), "rec");
        const PrepareResult p = pf->prepare({x, idx, w, Stream{stream}});
        cuda_ok(cudaEventRecord(ev[1], stream), "rec");
        pf->finalize({eo.view().slice_rows(0, p.num_recv_tokens), out, Stream{stream}});
        cuda_ok(cudaEventRecord(ev[2], stream), "rec");
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        float a = 0, b = 0;
        cuda_ok(cudaEventElapsedTime(&a, ev[0], ev[1]), "elapsed");
        cuda_ok(cudaEventElapsedTime(&b, ev[1], ev[2]), "elapsed");
        if (i >= 3) {
          disp.push_back(a * 1000.0);
          comb.push_back(b * 1000.0);
          const std::vector<double> tl = ht->timeline_us();
          for (size_t j = 0; j < tls.size(); ++j) tls[j].push_back(tl[j]);
        }
      }
      std::vector<double> m(tls.size());
      for (size_t j = 0; j < tls.size(); ++j) m[j] = median(tls[j]);
      using namespace dispatch;
      std::printf("rank %d %s sms=%d warps=%d pdl=%d (medians of %d): prepare %.1f us, finalize %.1f us | layout planned %.1f published %.1f "
                  "counts seen %.1f end %.1f record %.1f | dispatch start %.1f ready %.1f arrive %.1f end %.1f | combine start %.1f sent %.1f end %.1f us\n",
                  rank, std::string(dtype_name(dt)).c_str(), ht->num_sms(), ht->warps_per_block(), Config::load().ht_pdl, iters, median(disp),
                  median(comb), m[kTlLayoutPlanned], m[kTlLayoutPublished], m[kTlLayoutCountsSeen], m[kTlLayoutEnd], m[kTlLayoutRecord],
                  m[kTlDispatchStart], m[kTlDispatchReady], m[kTlDispatchArrive], m[kTlDispatchEnd], m[kTlCombineStart], m[kTlCombineSent],
                  m[kTlCombineEnd]);
      std::fflush(stdout);
    }
    g->barrier();
  });
  EXPECT_EQ(failed, "");
}

}  // namespace

TEST(HtCuda, DISABLED_Timeline) {
  if (virtual_ranks_for(2)) GTEST_SKIP() << "needs 2 GPUs: times the kernels over NVLink, and timeline_us synchronizes the whole device";
  run_timeline();
}

TEST(HtCuda, LateRankIsNotOverrun) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_late_rank();
}

TEST(HtCuda, TakesTheCallersConfigTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(2);
}

TEST(HtCuda, TakesTheCallersConfigFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(4);
}

TEST(HtCuda, TakesTheCallersConfigEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_callers_config(8);
}

// Real form: 2 GPUs, each its own node; virtual ranks: 2 nodes of 1 rank.
TEST(HtCuda, HierarchicalTakesTheCallersConfigTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_callers_config(2, 1);
}

// Real form: 4 GPUs, each its own node; virtual ranks: 2 nodes of 2 ranks.
TEST(HtCuda, HierarchicalTakesTheCallersConfigFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_hier_callers_config(4, 2);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(2, 1, false);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(4, 2, false);
}

TEST(HtCuda, StoppedRankTimesOutInPrepareEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(8, 5, false);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeTwoRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(2, 0, true);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeFourRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(4, 3, true);
}

TEST(HtCuda, StoppedRankTimesOutInFinalizeEightRanks) {
  if (!has_gpu()) GTEST_SKIP() << "needs 1 GPU (virtual ranks run on one)";
  run_stopped_rank(8, 6, true);
}

#endif

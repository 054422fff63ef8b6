// dispatch/ll/ll_errors_cuda_test.cpp: the ll backend on CUDA under bad arguments and stopped peers:
// T > capacity (InvalidArgument before anything is written; the next round still works), a bad device
// num_tokens (reported, InvalidArgument from that finalize or check(), then usable), a finalize refused
// on one rank (every peer told at once), and a stopped rank that never calls (its body sleeps, or on
// virtual ranks returns early): every other rank gets Timeout within the bound, naming it. Harness:
// ll_cuda_testing.h.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>  // setenv (the test bodies' callers only)
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/cuda.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "cuda_ranks.h"
#include "test_util.h"
#include "forked_ranks.h"

using namespace epx;
using namespace epx::test;

#ifdef EPX_WITH_CUDA
#include <cuda_runtime_api.h>

#include "dispatch/ll/ll.h"
#include "dispatch/ll/ll_cuda.h"
#include "dispatch/ll/ll_cuda_testing.h"

namespace {

// ---- errors ------------------------------------------------------------------------------------

void run_errors(int R) {
  const Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 41);
  Case c8 = c;
  c8.T.assign(static_cast<size_t>(R), 8);
  const std::vector<RankInput> in = make_inputs(c8);
  Case c17 = c;
  c17.T.assign(static_cast<size_t>(R), 17);
  const std::vector<RankInput> big = make_inputs(c17);
  const auto want = run_cpu(c, {in, in});
  say_where(R);
  const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    auto pf = make_prepare_finalize("ll", g, c.config());
    auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
    std::string failures;
    // 1. T = 17 > capacity 16: InvalidArgument naming both numbers, nothing launched.
    {
      const DevInput d = upload(big[static_cast<size_t>(rank)], 17, dev);
      std::string what;
      try {
        pf->prepare({d.x, d.idx, d.w, Stream{s}});
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (what.find("17") == std::string::npos || what.find("16") == std::string::npos) failures += "capacity error: '" + what + "'; ";
      if (rank == 0) std::printf("capacity: %s\n", what.c_str());
    }
    // 2. The object still works (no call number was used by the failed call).
    {
      const Snap got = gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false);
      const std::string d = diff(got, want[0][static_cast<size_t>(rank)]);
      if (!d.empty()) failures += "after capacity error: " + d + "; ";
    }
    // 3. A device num_tokens beyond x.shape[0] on the last rank: that rank sends nothing, its finalize
    //    (after its launch) or check() throws InvalidArgument there, and the next round is exact again.
    {
      const DevInput d = upload(in[static_cast<size_t>(rank)], 8, dev);
      Tensor nt = Tensor::empty({1}, DType::int32, dev);
      const int32_t v = rank == R - 1 ? 9 : 8;
      test::upload_device(nt.data(), &v, 4, "nt");
      DispatchArgs a{d.x, d.idx, d.w, Stream{s}};
      a.num_tokens = nt;
      const PrepareResult p = pf->prepare(a);
      cuda_ok(cudaStreamSynchronize(s), "sync");
      const int64_t L = p.x.size(0);
      Tensor eo = Tensor::zeros({L, p.x.size(1), c.H}, DType::bf16, dev), out = Tensor::empty({8, c.H}, DType::bf16, dev);
      std::string what;
      try {  // thrown by the finalize after its launch when its host already sees the report, else by check()
        pf->finalize({eo, out, Stream{s}});
        ll->check(Stream{s});
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (rank == R - 1 && what.find("num_tokens") == std::string::npos) failures += "bad num_tokens: '" + what + "'; ";
      if (rank != R - 1 && !what.empty()) failures += "bad num_tokens on another rank threw here: '" + what + "'; ";
      if (rank == R - 1) std::printf("bad device num_tokens: %s\n", what.c_str());
      const Snap got = gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false);
      const std::string dd = diff(got, want[1][static_cast<size_t>(rank)]);
      if (!dd.empty()) failures += "after bad num_tokens: " + dd + "; ";
    }
    // 4. Another backend rejects num_tokens.
    if (rank == 0) {
      std::string what;
      try {
        auto groups = make_cpu_groups(1);
        auto cpu = make_prepare_finalize("ll", groups[0], c.config());
        DispatchArgs a{in[0].x, in[0].topk_idx, in[0].topk_weights};
        Tensor nt = Tensor::zeros({1}, DType::int32);
        a.num_tokens = nt;
        cpu->prepare(a);
      } catch (const InvalidArgument& e) {
        what = e.what();
      }
      if (what.find("num_tokens") == std::string::npos) failures += "CPU ll accepted num_tokens: '" + what + "'; ";
    }
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// ---- a stopped rank ------------------------------------------------------------------------------

/// How the stopped rank of the timeout tests does not take part.
enum class Stop {
  sleeps,   ///< alive, but never makes the call: sleeps past the others' timeout
  returns,  ///< its body returns at once (virtual ranks only: on real GPUs it sleeps, see stop_mode)
};

/// `want` where the ranks are virtual; on real GPUs always Stop::sleeps: a process that exits while its
/// peers still store into its symmetric memory over NVLink is not what these tests are about.
Stop stop_mode(int R, Stop want) { return virtual_ranks_for(R) ? want : Stop::sleeps; }

/// The group timeout of the stopped-rank tests: short on virtual ranks (every host wait of the test
/// ends within it); on real GPUs the NCCL start-up of R processes needs more.
double stop_group_timeout(int R) { return virtual_ranks_for(R) ? 5.0 : 60.0; }

/// The stopped rank's part: wait past `secs` (Stop::sleeps) or nothing (Stop::returns).
void stopped_rank(Stop stop, double secs) {
  if (stop == Stop::sleeps) std::this_thread::sleep_for(std::chrono::duration<double>(secs));  // alive, but never calls
}

/// The end of a stopped-rank test's body. Real form (one process per GPU): the process exits here
/// without teardown (messages to the stopped rank were never consumed); on virtual ranks the body
/// returns (or throws the failures) like any other, and its objects are destroyed: their waits are over.
void end_stopped_test(int rank, const std::string& failures, bool real) {
  std::fflush(stdout);
  if (real) {
    if (!failures.empty()) std::fprintf(stderr, "[rank %d] FAILED: %s\n", rank, failures.c_str());
    std::fflush(stderr);
    _exit(failures.empty() ? 0 : 1);
  }
  throw_failures(rank, failures);
}

/// Rank `stopped` never calls: every other rank's prepare fails within timeout_s (+ slack) with
/// Timeout naming the stopped rank, and its next call throws that too. Never a hang.
void run_timeout(int R, int stopped, Stop want_stop) {
  const Stop stop = stop_mode(R, want_stop);
  const bool real = !virtual_ranks_for(R);
  say_where(R);
  std::printf("rank %d stopped (%s)\n", stopped, stop == Stop::sleeps ? "sleeps" : "returns at once");
  const Case c = make_case(R, 2048, 16, 4, DType::bf16, false, false, false, false, 0.0, 8, std::vector<int64_t>(static_cast<size_t>(R), 4), 51);
  const std::vector<RankInput> in = make_inputs(c);
  constexpr double kTimeout = 3.0;
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 60.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlCuda ll(g, c.config(), {.warps_per_block = 8, .num_blocks = 0, .timeout_s = kTimeout});
        std::string failures;
        if (rank == stopped) {
          stopped_rank(stop, kTimeout + 2.0);
          return end_stopped_test(rank, failures, real);
        }
        const DevInput d = upload(in[static_cast<size_t>(rank)], 4, g->device());
        const auto t0 = std::chrono::steady_clock::now();
        std::string what;
        try {
          ll.prepare({d.x, d.idx, d.w, Stream{s}});
          ll.check(Stream{s});
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kTimeout, what.c_str());
        if (what.find(who) == std::string::npos || what.find("prepare") == std::string::npos)
          failures += "timeout message does not name " + who + " and the prepare: '" + what + "'; ";
        if (secs < kTimeout * 0.9 || secs > kTimeout + 5.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        std::string again;
        try {
          ll.prepare({d.x, d.idx, d.w, Stream{s}});
        } catch (const Timeout& e) {
          again = e.what();
        }
        if (again.find(who) == std::string::npos) failures += "the next call did not throw Timeout naming " + who + ": '" + again + "'; ";
        end_stopped_test(rank, failures, real);
      },
      stop_group_timeout(R));
  EXPECT_EQ(failed, "");
}

/// ll.combine_wait = data, partial_fp32: every rank prepares, rank `stopped` never finalizes: every
/// other rank's finalize (its receive polls the stopped rank's partial rows: each rank's token 0 is
/// routed there) ends within timeout_s (+ slack) and check() throws Timeout naming the stopped rank and
/// the finalize. Never a hang.
void run_combine_timeout(int R, int stopped, Stop want_stop) {
  const Stop stop = stop_mode(R, want_stop);
  const bool real = !virtual_ranks_for(R);
  say_where(R);
  std::printf("rank %d stopped after its prepare (%s)\n", stopped, stop == Stop::sleeps ? "sleeps" : "returns at once");
  Case c = make_case(R, 2048, 16, 4, DType::bf16, false, false, false, false, 0.0, 8, std::vector<int64_t>(static_cast<size_t>(R), 4), 52);
  c.ll_combine = LlCombine::partial_fp32;
  std::vector<RankInput> in = make_inputs(c);
  // Token 0 of every rank selects an expert of the stopped rank (column 0 := one it does not name yet),
  // so every other rank's combine waits for a row from it (combine_wait = data waits for rows only).
  const ExpertRange sr = expert_range(c.E, c.R, stopped);
  for (RankInput& ri : in) {
    int32_t* id = ri.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false)
    bool there = false;
    for (int k = 0; k < c.K; ++k) there = there || (id[k] >= sr.begin && id[k] < sr.end);
    for (int e = sr.begin; !there && e < sr.end; ++e) {
      bool named = false;
      for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
      if (!named) id[0] = e, there = true;
    }
  }
  constexpr double kTimeout = 3.0;
  const std::string who = "rank " + std::to_string(stopped);
  const std::string failed = run_cuda_ranks(
      R, 60.0,
      [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlLaunch launch;
        launch.timeout_s = kTimeout;
        launch.combine_data = true;
        dispatch::LlCuda ll(g, c.config(), launch);
        std::string failures;
        const DevInput d = upload(in[static_cast<size_t>(rank)], 4, dev);
        const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
        ll.check(Stream{s});
        if (rank == stopped) {
          stopped_rank(stop, kTimeout + 2.0);
          return end_stopped_test(rank, failures, real);
        }
        const int64_t L = p.x.size(0);
        Tensor eo = Tensor::zeros({L, p.x.size(1), c.H}, DType::bf16, dev), out = Tensor::empty({4, c.H}, DType::bf16, dev);
        const auto t0 = std::chrono::steady_clock::now();
        std::string what;
        try {
          ll.finalize({eo, out, Stream{s}});
          ll.check(Stream{s});
        } catch (const Timeout& e) {
          what = e.what();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("rank %d: combine timeout after %.2f s (bound %.1f s): %s\n", rank, secs, kTimeout, what.c_str());
        if (what.find(who) == std::string::npos || what.find("finalize") == std::string::npos)
          failures += "timeout message does not name " + who + " and the finalize: '" + what + "'; ";
        if (secs < kTimeout * 0.9 || secs > kTimeout + 5.0) failures += "timeout took " + std::to_string(secs) + " s; ";
        end_stopped_test(rank, failures, real);
      },
      stop_group_timeout(R));
  EXPECT_EQ(failed, "");
}

/// A finalize refused on one rank reaches every rank at once (the abort marker, kLlFlagRejected): rank 0
/// passes out with T + 1 rows, so it throws InvalidArgument at the call; every other rank's combine of that
/// call ends long before timeout_s with its out all NaN (poisoned with a finite pattern first), and each
/// gets one InvalidArgument naming rank 0: from that finalize (after its launch) or its check(); rank 0's
/// check() throws nothing; the rounds before and after are exact on every rank (every object stays usable).
/// `split`: all ranks use the hooks (rank 0's refused call is finalize_send). `peers_check` false: the
/// other ranks call no check() after the refused call (only a stream sync, so the report is on their host)
/// and go on to the next round: their prepare must not throw (that would leave rank 0's dispatch waiting),
/// the error comes from that round's finalize after its launch (or the check() after it), and the round is
/// exact. Without the marker the peers would get Timeout after timeout_s and every object would break.
std::string run_combine_rejected(int R, const std::string& name, LlCombine mode, const dispatch::LlLaunch& launch, bool split,
                                 bool peers_check = true) {
  say_where(R);
  Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 61);
  c.ll_combine = mode;
  Case ca = c, cb = c;
  ca.T = per_rank(R, {8, 5, 0, 1});
  cb.T = per_rank(R, {7, 16, 1, 0});  // rank 0's T >= 1 (its refused out has T + 1 rows)
  cb.seed = 62;
  const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
  const auto want = run_cpu(c, {in, in});
  const double timeout_s = launch.timeout_s;
  return run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlCuda ll(g, c.config(), launch);
    std::string failures;
    const std::string d0 = diff(gpu_round(c, ll, in[static_cast<size_t>(rank)], rank, s, split), want[0][static_cast<size_t>(rank)]);
    if (!d0.empty()) failures += "round before: " + d0 + "; ";
    std::string at_call, at_check;
    double secs = 0.0;
    {
      const RankInput& ri = mid[static_cast<size_t>(rank)];
      const int64_t T = ri.x.size(0);
      const DevInput d = upload(ri, T, dev);
      const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll.check(Stream{s});
      const Tensor eo = experts_out(c, rank, p).to(dev);
      Tensor out = Tensor::empty({T + (rank == 0 ? 1 : 0), c.H}, DType::bf16, dev);
      cuda_ok(cudaMemset(out.data(), 0x11, static_cast<size_t>(out.nbytes())), "poison out (finite)");
      sync_legacy("sync poison out");
      g->barrier();
      const auto t0 = std::chrono::steady_clock::now();
      try {
        if (split) {
          ll.finalize_send({eo, out, Stream{s}});
          ll.finalize_recv(Stream{s});
        } else {
          ll.finalize({eo, out, Stream{s}});
        }
      } catch (const InvalidArgument& e) {
        at_call = e.what();
      }
      try {
        if (peers_check || rank == 0) ll.check(Stream{s});
        else cuda_ok(cudaStreamSynchronize(s), "sync");  // the report is on the host before the next prepare
      } catch (const InvalidArgument& e) {
        at_check = std::string("InvalidArgument: ") + e.what();
      } catch (const Timeout& e) {
        at_check = std::string("Timeout: ") + e.what();
      }
      secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s rank %d after %.3f s (timeout_s %.0f): call '%s', check '%s'\n", name.c_str(), rank, secs, timeout_s, at_call.c_str(),
                  at_check.c_str());
      if (rank != 0) {
        const std::vector<uint8_t> bytes = host_bytes(out);
        int64_t finite = 0;
        for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
          const uint16_t v = static_cast<uint16_t>(bytes[i] | bytes[i + 1] << 8);
          if ((v & 0x7f80) != 0x7f80 || (v & 0x7f) == 0) ++finite;
        }
        if (finite != 0) failures += "out: " + std::to_string(finite) + " of " + std::to_string(bytes.size() / 2) + " not NaN; ";
      }
      if (secs > timeout_s / 2) failures += "took " + std::to_string(secs) + " s (timeout_s " + std::to_string(timeout_s) + "); ";
    }
    std::string late;
    const bool late_here = !peers_check && rank != 0;
    const std::string d1 = diff(gpu_round(c, ll, in[static_cast<size_t>(rank)], rank, s, split, nullptr, late_here ? &late : nullptr),
                                want[1][static_cast<size_t>(rank)]);
    if (!d1.empty()) failures += "round after: " + d1 + "; ";
    if (late_here) std::printf("%s rank %d, round after without a check before it: '%s'\n", name.c_str(), rank, late.c_str());
    if (rank == 0) {
      if (at_call.find("out.shape") == std::string::npos) failures += "rank 0's refusal: '" + at_call + "'; ";
      if (!at_check.empty()) failures += "rank 0's check threw: '" + at_check + "'; ";
    } else {
      const std::vector<std::string> got_all = {at_call, at_check, late};
      int n = 0;
      std::string got;
      for (const std::string& e : got_all)
        if (!e.empty()) ++n, got = e;
      if (n != 1) failures += "threw " + std::to_string(n) + " times: '" + at_call + "', '" + at_check + "', '" + late + "'; ";
      if (at_check.rfind("Timeout", 0) == 0 || got.find("rank 0") == std::string::npos ||
          got.find("refused its finalize arguments") == std::string::npos)
        failures += "error: '" + got + "'; ";
    }
    g->barrier();
    if (!failures.empty()) throw_failures(rank, name + ": " + failures);
  });
}

TEST(LlCuda, ErrorsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(2);
}

TEST(LlCuda, ErrorsFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(4);
}

TEST(LlCuda, ErrorsEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_errors(8);
}

// A finalize refused on one rank stops every rank's combine at once (kLlFlagRejected; ll_cuda.h "Errors"):
// column (fused), partial_fp32 through the hooks, and partial_bf16 after the fallback dispatch (expert
// expansion, block signals); on 4 and 8 ranks the column case.
TEST(LlCuda, CombineRefusedOnOneRankReachesEveryRankTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch dflt;
  dflt.timeout_s = 4.0;  // the refusal must arrive in well under timeout_s / 2; without the marker the peers wait 4 s
  dispatch::LlLaunch other = dflt;
  other.expand_message = false;
  EXPECT_EQ(run_combine_rejected(2, "column", LlCombine::column, dflt, false), "");
  EXPECT_EQ(run_combine_rejected(2, "partial_fp32 hooks", LlCombine::partial_fp32, dflt, true), "");
  EXPECT_EQ(run_combine_rejected(2, "partial_bf16 fallback expansion", LlCombine::partial_bf16, other, false), "");
  EXPECT_EQ(run_combine_rejected(2, "column, rank 1 without check", LlCombine::column, dflt, false, false), "");
}

TEST(LlCuda, CombineRefusedOnOneRankReachesEveryRankFourAndEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch dflt;
  dflt.timeout_s = 4.0;
  EXPECT_EQ(run_combine_rejected(4, "column", LlCombine::column, dflt, false), "");
  EXPECT_EQ(run_combine_rejected(4, "column, peers without check", LlCombine::column, dflt, false, false), "");
  EXPECT_EQ(run_combine_rejected(8, "column", LlCombine::column, dflt, false), "");
}

// A stopped rank (it never calls; ll timeout_s 3 s, the group's 5 s on virtual ranks): every other rank's
// call ends with Timeout naming it. Two ranks: the stopped one sleeps; four: it returns at once (on
// virtual ranks; on real GPUs it sleeps); eight: rank 5 of 8 sleeps.
TEST(LlCuda, TimeoutNamesThePeerTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(2, 1, Stop::sleeps);
}

TEST(LlCuda, TimeoutNamesThePeerFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(4, 2, Stop::returns);
}

TEST(LlCuda, TimeoutNamesThePeerEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_timeout(8, 5, Stop::sleeps);
}

TEST(LlCuda, CombineWaitDataTimeoutNamesThePeerTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_combine_timeout(2, 1, Stop::sleeps);
}

TEST(LlCuda, CombineWaitDataTimeoutNamesThePeerFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_combine_timeout(4, 1, Stop::returns);
}

}  // namespace

#else

TEST(LlCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

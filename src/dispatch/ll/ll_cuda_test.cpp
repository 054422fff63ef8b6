// dispatch/ll/ll_cuda_test.cpp: the ll backend on CUDA (ll_cuda.h) against the CPU reference LlCpu on
// the same inputs. Multi-rank cases run through tests/cuda_ranks.h run_cuda_ranks: one forked process
// per GPU where the machine has enough GPUs, else R virtual ranks (threads) on GPU 0; at 1 and 2 ranks,
// and at 4 and 8 ranks on small shapes where a case takes a rank count:
//   - prepare: recv_count, every valid row of x (bf16 bits / fp8 codes), x_scales, the handle
//     (src_rank, src_token, topk_column of every valid slot) and layout_range, bit for bit;
//   - finalize: out bit for bit (fp32 column-order sum, one rounding; with the expert-side partial
//     combine modes LlCombine::partial_fp32 / partial_bf16, LlCpu in the same mode, plus the
//     handle's per-message rows msg_count / msg_src_token / msg_rows / msg_weights);
// at the ll-v3 (H 7168, E 256, K 8, fp8) and ll-v4 (E 384, K 6, fp8) shapes and hidden 2048 / 4096
// (bf16, fp8, fp8 + UE8M0, shared route, duplicates, int64 ids) on 1 and 2 ranks, hidden 384 / 512 /
// 1024 on 4 and 8 ranks; T in {0, 1, 7, 128} with -1 selections and different T per rank, three
// rounds per object (both parities, one through the send/recv hooks);
// the fallback protocol (expert expansion, block signals: LlLaunch::expand_message = false, what large
// capacities take) on the partial_fp32 cases; ll.combine_wait = data;
// CUDA graphs (each rank captures on its own stream, cudaStreamCaptureModeThreadLocal): prepare and
// finalize captured separately, replayed with a device-side T that changes between replays and
// differs between ranks, the first replay equal to the eager call on the same inputs; two graphs on
// one object replayed interleaved; one buffer through 20 calls (eager, then graph replays of the
// same inputs, each replay equal to its eager call) with T per call and rank shrinking and growing,
// the fallback and the default, the default with a delayed send block 0 (the stale slot-token regression test) and its
// self-check; errors: T > capacity (InvalidArgument before anything is written; the next round still
// works), a bad device num_tokens (reported, InvalidArgument from that finalize or check(), then
// usable), a finalize refused on one rank (every peer told at once), and a stopped rank that never
// calls (its body sleeps, or on virtual ranks returns early): every other rank gets Timeout within
// the bound, naming it.
// The expert step is the harness's TestExperts on host copies of the prepare outputs. Outputs are
// poisoned before each call; inputs are fresh random values, never zeros. Rank bodies work on their
// own cudaStreamNonBlocking stream and wait on it or on the legacy stream, never on the whole device
// (cuda_ranks.h), and never touch the environment (set before run_cuda_ranks).
// Files: this one (eager cases, graphs, the other protocol and combine wait), ll_calls_cuda_test.cpp
// (many calls, refused and repeated finalize), ll_errors_cuda_test.cpp (bad arguments, stopped ranks);
// their shared harness ll_cuda_testing.h.
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

// ---- graphs ------------------------------------------------------------------------------------

/// Graph A: x [cap, H] with a device num_tokens; graph B: x [5, H] (host T = 5). Replays of A
/// with T per (replay, rank) from `ta`, interleaved with B; every replay checked against LlCpu, and
/// the first against an eager call on the same inputs made before the captures (bit for bit). Each
/// rank captures on its own stream (cudaStreamCaptureModeThreadLocal: the peers' threads go on).
/// The ll-v3 shape on 1 and 2 ranks, hidden 1024 with 4 experts per rank on 4 and 8.
void run_graphs(int R, LlCombine mode = LlCombine::column) {
  say_where(R);
  Case c = R <= 2 ? make_case(R, 7168, 256, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 31)
                  : make_case(R, 1024, 4 * R, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 31);
  c.ll_combine = mode;
  Case cb = c;
  cb.T.assign(static_cast<size_t>(R), 5);
  cb.seed = 32;
  const std::vector<std::vector<int64_t>> ta = {{128, 3}, {0, 128}, {7, 1}, {1, 0}, {64, 100}};  // [replay][rank], ranks 0 and 1
  const std::vector<int64_t> spread = {0, 1, 7, 128, 33};
  // T of graph A's replay `a` on rank r: ta for ranks 0 and 1, `spread` shifted per replay for the others.
  auto t_of = [&](int a, int r) -> int64_t {
    return r < 2 ? ta[static_cast<size_t>(a)][static_cast<size_t>(r)] : spread[static_cast<size_t>(a + r) % spread.size()];
  };
  Case cfull = c;
  cfull.T.assign(static_cast<size_t>(R), 128);
  const std::vector<RankInput> full = make_inputs(cfull), inb = make_inputs(cb);
  // Schedule: A0 B A1 A2 B A3 A4 (B replays with the same inputs)
  const std::vector<int> schedule = {0, -1, 1, 2, -1, 3, 4};
  std::vector<std::vector<RankInput>> rounds;
  for (int sidx : schedule) {
    std::vector<RankInput> ranks_in;
    for (int r = 0; r < R; ++r)
      ranks_in.push_back(sidx < 0 ? inb[static_cast<size_t>(r)] : head(full[static_cast<size_t>(r)], t_of(sidx, r)));
    rounds.push_back(std::move(ranks_in));
  }
  const auto want = run_cpu(c, rounds);
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    auto pf = make_prepare_finalize("ll", g, c.config());
    auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
    if (!ll) throw std::runtime_error("make_prepare_finalize(ll) on a CUDA group is not LlCuda");
    std::string failures;
    // The eager call on replay 0's inputs (schedule[0] is graph A): replay 0 must give the same bits.
    const Snap eager = gpu_round(c, *ll, rounds[0][static_cast<size_t>(rank)], rank, s, false);
    const std::string de = diff(eager, want[0][static_cast<size_t>(rank)]);
    if (!de.empty()) failures += "eager call before the captures: " + de + "\n";
    const DevInput a = upload(full[static_cast<size_t>(rank)], 128, dev), b = upload(inb[static_cast<size_t>(rank)], 5, dev);
    Tensor nt = Tensor::zeros({1}, DType::int32, dev);
    const int64_t L = num_local_experts(c.config(), R, rank), cap = static_cast<int64_t>(R) * c.cap;
    Tensor eo_a = Tensor::empty({L, cap, c.H}, DType::bf16, dev), eo_b = Tensor::empty({L, cap, c.H}, DType::bf16, dev);
    Tensor out_a = Tensor::empty({128, c.H}, DType::bf16, dev), out_b = Tensor::empty({5, c.H}, DType::bf16, dev);
    GraphPair ga, gb;
    PrepareResult pa, pb;
    DispatchArgs args_a{a.x, a.idx, a.w, Stream{s}};
    args_a.num_tokens = nt;
    capture(s, ga.prepare, [&] { pa = pf->prepare(args_a); });
    capture(s, ga.finalize, [&] { pf->finalize({eo_a, out_a, Stream{s}}); });
    capture(s, gb.prepare, [&] { pb = pf->prepare({b.x, b.idx, b.w, Stream{s}}); });
    capture(s, gb.finalize, [&] { pf->finalize({eo_b, out_b, Stream{s}}); });
    for (size_t i = 0; i < schedule.size(); ++i) {
      const bool is_a = schedule[i] >= 0;
      const int32_t T = is_a ? static_cast<int32_t>(t_of(schedule[i], rank)) : 5;
      if (is_a) cuda_ok(cudaMemcpyAsync(nt.data(), &T, 4, cudaMemcpyHostToDevice, s), "num_tokens");
      cuda_ok(cudaStreamSynchronize(s), "sync");
      cuda_ok(cudaGraphLaunch(is_a ? ga.prepare : gb.prepare, s), "replay prepare");
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll->check(Stream{s});
      const PrepareResult& p = is_a ? pa : pb;
      Snap snap = take(p, ll->handle().src_rank, ll->handle().src_token, ll->handle().topk_column, ll->handle().layout_range);
      if (mode != LlCombine::column) take_msgs(snap, ll->handle(), c.K);
      Tensor& eo = is_a ? eo_a : eo_b;
      copy(eo, experts_out(c, rank, p));
      Tensor& out = is_a ? out_a : out_b;
      cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
      sync_legacy("sync poison out");  // see gpu_round
      cuda_ok(cudaGraphLaunch(is_a ? ga.finalize : gb.finalize, s), "replay finalize");
      cuda_ok(cudaStreamSynchronize(s), "sync finalize");
      ll->check(Stream{s});
      std::vector<uint8_t> ob = host_bytes(out);
      // Rows >= T are not written (still poison); compare rows [0, T).
      for (size_t k = static_cast<size_t>(T) * c.H * 2; k < ob.size(); ++k)
        if (ob[k] != 0xff) {
          failures += "replay " + std::to_string(i) + ": out row beyond T written; ";
          break;
        }
      ob.resize(static_cast<size_t>(T) * c.H * 2);
      snap.out = ob;
      poison_outputs(p, *ll);
      std::string d = diff(snap, want[i][static_cast<size_t>(rank)]);
      if (i == 0) {
        const std::string dv = diff(snap, eager);
        if (!dv.empty()) d += "vs the eager call: " + dv;
      }
      if (!d.empty()) failures += "replay " + std::to_string(i) + (is_a ? " (graph A, T=" + std::to_string(T) + ")" : " (graph B)") + ": " + d + "\n";
      if (rank == 0) std::printf("graph replay %zu: graph %s, T = %d on rank 0: %s\n", i, is_a ? "A" : "B", T, d.empty() ? "bit-exact" : "DIFFERS");
    }
    for (cudaGraphExec_t e : {ga.prepare, ga.finalize, gb.prepare, gb.finalize}) cuda_ok(cudaGraphExecDestroy(e), "exec destroy");
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

TEST(LlCuda, MatchesCpuOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(1);
}

TEST(LlCuda, MatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(2);
}

// Small shapes (eager_cases): bf16 with duplicates, fp8, fp8 + UE8M0 with the shared route and int64 ids;
// T in {0, 1, 7, 128} across the ranks.
TEST(LlCuda, MatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(4);
}

TEST(LlCuda, MatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(8);
}

TEST(LlCuda, GraphsWithDeviceTokenCountOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(1);
}

TEST(LlCuda, GraphsWithDeviceTokenCountTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(2);
}

// Small shape (run_graphs), column and partial_fp32 combine.
TEST(LlCuda, GraphsWithDeviceTokenCountFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(4);
  run_graphs(4, LlCombine::partial_fp32);
}

TEST(LlCuda, GraphsWithDeviceTokenCountEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(8);
  run_graphs(8, LlCombine::partial_fp32);
}

// Expert-side partial combine (LlCombine::partial_fp32 / partial_bf16) against LlCpu in the same mode.
TEST(LlCuda, PartialCombineMatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(2, LlCombine::partial_fp32);
  run_eager(2, LlCombine::partial_bf16);
}

TEST(LlCuda, PartialCombineMatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(4, LlCombine::partial_fp32);
  run_eager(4, LlCombine::partial_bf16);
}

TEST(LlCuda, PartialCombineMatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_eager(8, LlCombine::partial_fp32);
  run_eager(8, LlCombine::partial_bf16);
}

// The fallback protocol (the expert expansion with block signals, LlLaunch::expand_message = false),
// which capacities whose message bitmaps do not fit in shared memory take: partial_fp32 cases, at R ranks.
void run_other_protocol(int R) {
  dispatch::LlLaunch launch;
  launch.expand_message = false;
  std::printf("ll: the expert expansion with block signals\n");
  run_eager(R, LlCombine::partial_fp32, &launch);
}

TEST(LlCuda, OtherProtocolMatchesCpuTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(2);
}

TEST(LlCuda, OtherProtocolMatchesCpuFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(4);
}

TEST(LlCuda, OtherProtocolMatchesCpuEightRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_protocol(8);
}

// ll.combine_wait, the value the Config does not choose (flag <-> data; ll_cuda.h): partial_fp32 and
// partial_bf16 eager (three rounds per object: both parities, a parity region reused, the hooks).
void run_other_combine_wait(int R) {
  const Config defaults;
  dispatch::LlLaunch launch;
  launch.combine_data = defaults.ll_combine_wait != "data";
  launch.timeout_s = Config::load().timeout_s;  // EPX_TIMEOUT_S bounds a hang
  std::printf("ll.combine_wait = %s\n", launch.combine_data ? "data" : "flag");
  run_eager(R, LlCombine::partial_fp32, &launch);
  run_eager(R, LlCombine::partial_bf16, &launch);
}

TEST(LlCuda, OtherCombineWaitTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_combine_wait(2);
}

TEST(LlCuda, OtherCombineWaitFourRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_other_combine_wait(4);
}

// The same, partial_fp32 graphs (seven replays on one object, T changing per replay and rank); the
// Config's value is set in this process before the ranks start (run_graphs builds through the Config).
TEST(LlCuda, OtherCombineWaitGraphsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const char* wait = Config().ll_combine_wait != "data" ? "data" : "flag";
  std::printf("ll.combine_wait = %s\n", wait);
  const test::ScopedEnv env("EPX_LL_COMBINE_WAIT", wait);
  run_graphs(2, LlCombine::partial_fp32);
}

TEST(LlCuda, PartialCombineGraphsTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  run_graphs(2, LlCombine::partial_fp32);
}

}  // namespace

#else

TEST(LlCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

// dispatch/ll/ll_calls_cuda_test.cpp: the ll backend on CUDA over many calls: one buffer through 20 calls
// (eager, then graph replays of the same inputs) with T per call and rank shrinking and growing, the
// fallback and the default, the default with a delayed send block 0 (the stale slot-token regression
// test) and its self-check; a refused finalize is not retried, finalize twice per prepare, a create
// without a caller config. Against LlCpu bit for bit; harness and cases: ll_cuda_testing.h, the
// file comment of ll_cuda_test.cpp.
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

// ---- many calls on one buffer ------------------------------------------------------------------

/// Per call, per rank T of the many-calls test: 0, 1, 7 and 128, different on the two ranks, dropping
/// back to 0 and up again, so a rank's message count to a peer shrinks and grows between calls of one
/// parity (calls 0 / 2 / 4 of rank 0: 128, 0, 128).
const std::vector<std::vector<int64_t>> kManyCallsT = {{128, 1}, {7, 128}, {0, 7}, {1, 0}, {128, 0},
                                                       {128, 128}, {0, 128}, {0, 1}, {7, 0}, {128, 7}};

/// Fresh random inputs for every call of kManyCallsT, with rank 0's first two
/// rows routed away from rank 1 in call 0 and its row 0 routed to rank 1 in call 4: message slot 0
/// from rank 0 at rank 1 then names a token of a later send block in call 0, nothing in call 2 (T = 0),
/// token 0 (send block 0) in call 4, the pattern in which a stale slot-token word could pass as current.
std::vector<std::vector<RankInput>> many_calls_inputs(const Case& c) {
  std::vector<std::vector<RankInput>> rounds;
  const ExpertRange r1 = expert_range(c.E, c.R, 1);
  for (size_t i = 0; i < kManyCallsT.size(); ++i) {
    Case ci = c;
    ci.T = kManyCallsT[i];
    ci.seed = c.seed + 100 * i;
    std::vector<RankInput> in = make_inputs(ci);
    RankInput& r0 = in[0];
    const int64_t T0 = r0.x.size(0);
    int32_t* id = r0.topk_idx.ptr<int32_t>();  // int32 ids (Case::idx64 false)
    if (i == 0)
      for (int64_t t = 0; t < 2 && t < T0; ++t)
        for (int k = 0; k < c.K; ++k)
          if (id[t * c.K + k] >= r1.begin && id[t * c.K + k] < r1.end) id[t * c.K + k] = -1;
    if (i == 4 && T0 > 0) {
      bool to_r1 = false;
      for (int k = 0; k < c.K; ++k) to_r1 = to_r1 || (id[k] >= r1.begin && id[k] < r1.end);
      for (int e = r1.begin; !to_r1 && e < r1.end; ++e) {  // column 0 := an expert of rank 1 the row does not name yet
        bool named = false;
        for (int k = 0; k < c.K; ++k) named = named || id[k] == e;
        if (!named) id[0] = e, to_r1 = true;
      }
    }
    rounds.push_back(std::move(in));
  }
  return rounds;
}

/// One ll buffer, kManyCallsT's calls eager (call 3 through the send/recv hooks), then the same
/// calls as replays of one captured prepare / finalize graph pair with the token count on the device:
/// 2 x 10 consecutive calls on one object, each checked bit for bit against LlCpu (outputs poisoned
/// before each call), and each replay against the eager call on the same inputs. `launch` per rank
/// (rank 0's may carry the debug delay). The ranks are aligned by a group barrier before each prepare.
/// Returns the failures of both ranks ("" = all exact, every rank finished) and prints one line per
/// call and rank.
std::string run_many_calls(const std::string& name, const std::vector<dispatch::LlLaunch>& launch) {
  constexpr int R = 2;
  // ll-v3's hidden size, dtype, top-k and capacity (so the send items map to blocks as at ll-v3: 14
  // chunks per token, 16 warps per block), 32 experts (16 local: the host's copies stay small).
  static const Case c = [] {
    Case k = make_case(R, 7168, 32, 8, DType::fp8_e4m3, false, false, false, false, 0.1, 128, {}, 61);
    k.ll_combine = LlCombine::partial_fp32;
    return k;
  }();
  static const std::vector<std::vector<RankInput>> rounds = many_calls_inputs(c);
  static const std::vector<std::vector<Snap>> want = run_cpu(c, rounds);  // all three: read-only in the ranks
  say_where(R);
  const std::string dir = fresh_dir();
  const std::string status = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlCuda ll(g, c.config(), launch[static_cast<size_t>(rank)]);
    std::string failures;
    auto record = [&](const std::string& what, size_t i, const std::string& d) {
      const int64_t T = kManyCallsT[i][static_cast<size_t>(rank)];
      if (!d.empty()) failures += name + " " + what + " call " + std::to_string(i) + " rank " + std::to_string(rank) + " T=" + std::to_string(T) + ": " + d + "\n";
      std::printf("%s %s call %zu rank %d T = %lld: %s\n", name.c_str(), what.c_str(), i, rank, static_cast<long long>(T),
                  d.empty() ? "bit-exact vs LlCpu" : "DIFFERS");
      std::fflush(stdout);  // a step cut by a time limit keeps its lines
    };
    // 1. Eager calls 0..9.
    std::vector<Snap> eager;
    for (size_t i = 0; i < rounds.size(); ++i) {
      eager.push_back(gpu_round(c, ll, rounds[i][static_cast<size_t>(rank)], rank, s, i == 3, g.get()));
      record("eager", i, diff(eager.back(), want[i][static_cast<size_t>(rank)]));
    }
    // 2. Calls 10..19: graph replays, x [cap, H] with the token count on the device, fresh inputs per replay.
    const int64_t L = num_local_experts(c.config(), R, rank), cap = static_cast<int64_t>(R) * c.cap;
    DevInput in;
    in.x = Tensor::empty({c.cap, c.H}, DType::bf16, dev);
    in.idx = Tensor::empty({c.cap, c.K}, DType::int32, dev);
    in.w = Tensor::empty({c.cap, c.K}, DType::fp32, dev);
    Tensor nt = Tensor::zeros({1}, DType::int32, dev);
    Tensor eo = Tensor::empty({L, cap, c.H}, DType::bf16, dev), out = Tensor::empty({c.cap, c.H}, DType::bf16, dev);
    GraphPair gp;
    PrepareResult p;
    DispatchArgs args{in.x, in.idx, in.w, Stream{s}};
    args.num_tokens = nt;
    capture(s, gp.prepare, [&] { p = ll.prepare(args); });
    capture(s, gp.finalize, [&] { ll.finalize({eo, out, Stream{s}}); });
    for (size_t i = 0; i < rounds.size(); ++i) {
      const RankInput& ri = rounds[i][static_cast<size_t>(rank)];
      const int32_t T = static_cast<int32_t>(ri.x.size(0));
      for (const Tensor* t : {&in.x, &in.idx, &in.w}) cuda_ok(cudaMemset(t->data(), 0x7f, static_cast<size_t>(t->nbytes())), "poison inputs");
      cuda_ok(cudaMemcpy(in.x.data(), ri.x.data(), static_cast<size_t>(ri.x.nbytes()), cudaMemcpyHostToDevice), "x");
      cuda_ok(cudaMemcpy(in.idx.data(), ri.topk_idx.data(), static_cast<size_t>(ri.topk_idx.nbytes()), cudaMemcpyHostToDevice), "idx");
      cuda_ok(cudaMemcpy(in.w.data(), ri.topk_weights.data(), static_cast<size_t>(ri.topk_weights.nbytes()), cudaMemcpyHostToDevice), "w");
      cuda_ok(cudaMemcpy(nt.data(), &T, 4, cudaMemcpyHostToDevice), "num_tokens");
      sync_legacy("sync inputs");  // legacy-stream memsets, pageable copies (see upload)
      g->barrier();
      cuda_ok(cudaGraphLaunch(gp.prepare, s), "replay prepare");
      cuda_ok(cudaStreamSynchronize(s), "sync prepare");
      ll.check(Stream{s});
      Snap snap = take(p, ll.handle().src_rank, ll.handle().src_token, ll.handle().topk_column, ll.handle().layout_range);
      take_msgs(snap, ll.handle(), c.K);
      copy(eo, experts_out(c, rank, p));
      cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
      sync_legacy("sync poison out");
      cuda_ok(cudaGraphLaunch(gp.finalize, s), "replay finalize");
      cuda_ok(cudaStreamSynchronize(s), "sync finalize");
      ll.check(Stream{s});
      std::vector<uint8_t> ob = host_bytes(out);
      std::string extra;
      for (size_t k = static_cast<size_t>(T) * c.H * 2; k < ob.size(); ++k)
        if (ob[k] != 0xff) {
          extra = "out row beyond T written; ";
          break;
        }
      ob.resize(static_cast<size_t>(T) * c.H * 2);
      snap.out = ob;
      poison_outputs(p, ll);
      cuda_ok(cudaMemset(p.x.data, 0xff, static_cast<size_t>(p.x.nbytes())), "poison x");
      cuda_ok(cudaMemset(p.x_scales.data, 0xff, static_cast<size_t>(p.x_scales.nbytes())), "poison scales");
      sync_legacy("sync poison");
      const std::string vs_eager = diff(snap, eager[i]);  // the replay of call i gives the eager call's bits
      record("graph", i, extra + diff(snap, want[i][static_cast<size_t>(rank)]) + (vs_eager.empty() ? "" : "vs the eager call: " + vs_eager));
    }
    for (cudaGraphExec_t e : {gp.prepare, gp.finalize}) cuda_ok(cudaGraphExecDestroy(e), "exec destroy");
    g->barrier();
    std::fflush(stdout);
    FILE* f = std::fopen((dir + "/failures-" + std::to_string(rank)).c_str(), "w");  // read by the parent
    if (!f) throw std::runtime_error("cannot write " + dir);
    std::fputs(failures.c_str(), f);
    std::fclose(f);
  });
  std::string failures;
  for (int r = 0; r < R; ++r) {
    FILE* f = std::fopen((dir + "/failures-" + std::to_string(r)).c_str(), "r");
    if (!f) {
      failures += "rank " + std::to_string(r) + " wrote no result; ";
      continue;
    }
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) failures.append(buf, n);
    std::fclose(f);
  }
  return status + failures;
}

dispatch::LlLaunch many_calls_launch(bool message) {
  dispatch::LlLaunch l;
  l.expand_message = message;
  l.timeout_s = Config::load().timeout_s;  // EPX_TIMEOUT_S bounds a hang
  return l;
}

// A refused finalize is that prepare's finalize (ll_cuda.h): retrying it with good arguments must be refused
// on the host ("no prepare to finalize") rather than launch a second combine for one dispatch (the call
// numbers would drift until a timeout), and the object must stay usable: the next round matches LlCpu.
// One rank, so it runs on the one-GPU machine too (the peers' side is CombineRefusedOnOneRank...TwoRanks).
TEST(LlCuda, RefusedFinalizeIsNotRetriedOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  Case c = make_case(1, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 63);
  Case ca = c, cb = c;
  ca.T = {8};
  cb.T = {7};
  cb.seed = 64;
  const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
  const auto want = run_cpu(c, {in, in});
  say_where(1);
  const std::string failed = run_cuda_ranks(1, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const Device dev = g->device();
    const RankStream rs;
    const cudaStream_t s = rs.s;
    dispatch::LlLaunch launch;
    launch.timeout_s = 4.0;
    dispatch::LlCuda ll(g, c.config(), launch);
    std::string failures;
    const std::string d0 = diff(gpu_round(c, ll, in[0], rank, s, false), want[0][0]);
    if (!d0.empty()) failures += "round before: " + d0 + "; ";
    const RankInput& ri = mid[0];
    const int64_t T = ri.x.size(0);
    const DevInput d = upload(ri, T, dev);
    const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
    cuda_ok(cudaStreamSynchronize(s), "sync prepare");
    ll.check(Stream{s});
    const Tensor eo = experts_out(c, rank, p).to(dev);
    Tensor bad = Tensor::empty({T + 1, c.H}, DType::bf16, dev), good = Tensor::empty({T, c.H}, DType::bf16, dev);
    std::string refused, retried;
    try {
      ll.finalize({eo, bad, Stream{s}});
    } catch (const InvalidArgument& e) {
      refused = e.what();
    }
    try {
      ll.finalize({eo, good, Stream{s}});
    } catch (const InvalidArgument& e) {
      retried = e.what();
    }
    cuda_ok(cudaStreamSynchronize(s), "sync");
    std::printf("refused: '%s'\nretried: '%s'\n", refused.c_str(), retried.c_str());
    if (refused.find("out.shape") == std::string::npos) failures += "the bad finalize: '" + refused + "'; ";
    if (retried.find("no prepare to finalize") == std::string::npos) failures += "the retried finalize: '" + retried + "'; ";
    const std::string d1 = diff(gpu_round(c, ll, in[0], rank, s, false), want[1][0]);
    if (!d1.empty()) failures += "round after: " + d1 + "; ";
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// Finalize twice for one prepare (dispatch.h: finalize is the combine "for the last prepare"; LlCpu, ht and the
// hierarchical backends give a correct second result): the combine's call numbers count combines, not
// dispatches, so a second combine of the same handle must give the CPU's answer for its own expert_out, and the
// next round must still match (the call sequence stayed the same on every rank: here the one rank). The second
// finalize takes -expert_out, so out2 = -out1 element by element (a stale out1 cannot pass). One rank (ll
// loopback), so it runs on the one-GPU machine; the column combine and the fp32 partial combine (fused and
// split finalize).
TEST(LlCuda, FinalizeTwicePerPrepareOneRank) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  for (const LlCombine mode : {LlCombine::column, LlCombine::partial_fp32}) {
    for (const bool split : {false, true}) {
      SCOPED_TRACE(std::string(mode == LlCombine::column ? "column" : "partial_fp32") + (split ? " split" : " fused"));
      Case c = make_case(1, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, {}, 71);
      c.ll_combine = mode;
      Case ca = c, cb = c;
      ca.T = {8};
      cb.T = {13};
      cb.seed = 72;
      const std::vector<RankInput> in = make_inputs(ca), mid = make_inputs(cb);
      const auto want = run_cpu(c, {in, mid, in});
      say_where(1);
      const std::string failed = run_cuda_ranks(1, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
        const Device dev = g->device();
        const RankStream rs;
        const cudaStream_t s = rs.s;
        dispatch::LlLaunch launch;
        launch.timeout_s = 4.0;
        dispatch::LlCuda ll(g, c.config(), launch);
        std::string failures;
        const std::string d0 = diff(gpu_round(c, ll, in[0], rank, s, split), want[0][0]);
        if (!d0.empty()) failures += "round before: " + d0 + "; ";
        const RankInput& ri = mid[0];
        const int64_t T = ri.x.size(0);
        const DevInput d = upload(ri, T, dev);
        const PrepareResult p = ll.prepare({d.x, d.idx, d.w, Stream{s}});
        cuda_ok(cudaStreamSynchronize(s), "sync prepare");
        ll.check(Stream{s});
        const Tensor eo_host = experts_out(c, rank, p);
        Tensor neg = Tensor::empty({eo_host.size(0), eo_host.size(1), eo_host.size(2)}, DType::bf16);
        for (int64_t i = 0; i < eo_host.numel(); ++i) neg.ptr<uint16_t>()[i] = eo_host.ptr<const uint16_t>()[i] ^ 0x8000u;
        const Tensor eo = eo_host.to(dev), eo_neg = neg.to(dev);
        std::vector<Tensor> outs;
        for (const Tensor* e : {&eo, &eo_neg}) {
          Tensor out = Tensor::empty({T, c.H}, DType::bf16, dev);
          cuda_ok(cudaMemset(out.data(), 0xff, static_cast<size_t>(out.nbytes())), "poison out");
          sync_legacy("sync poison out");
          try {
            if (split) {
              ll.finalize_send({*e, out, Stream{s}});
              ll.finalize_recv(Stream{s});
            } else {
              ll.finalize({*e, out, Stream{s}});
            }
            cuda_ok(cudaStreamSynchronize(s), "sync finalize");
            ll.check(Stream{s});
          } catch (const std::exception& ex) {
            failures += std::string(outs.empty() ? "first" : "second") + " finalize threw: " + ex.what() + "; ";
          }
          outs.push_back(out);
        }
        const std::vector<uint8_t> o1 = host_bytes(outs[0]), o2 = host_bytes(outs[1]);
        if (o1 != want[1][0].out) failures += "first finalize's out differs from LlCpu's; ";
        int64_t bad = 0, first_bad = -1;
        for (size_t i = 0; i + 1 < want[1][0].out.size() && i + 1 < o2.size(); i += 2) {
          uint16_t w16, g16;
          std::memcpy(&w16, want[1][0].out.data() + i, 2);
          std::memcpy(&g16, o2.data() + i, 2);
          const float wv = bf16_bits_to_float(w16), gv = bf16_bits_to_float(g16);
          if (!(gv == -wv)) {  // NaN (poison) fails; -0 / +0 compare equal (a sum to zero is +0 either way)
            if (first_bad < 0) first_bad = static_cast<int64_t>(i / 2);
            ++bad;
          }
        }
        if (o2.size() != want[1][0].out.size() || bad != 0)
          failures += "second finalize (-expert_out): " + std::to_string(bad) + " elements not -out1 (first " + std::to_string(first_bad) + "); ";
        const std::string d1 = diff(gpu_round(c, ll, in[0], rank, s, split), want[2][0]);
        if (!d1.empty()) failures += "round after: " + d1 + "; ";
        throw_failures(rank, failures);
      });
      EXPECT_EQ(failed, "");
    }
  }
}

// ll on CUDA made without a caller Config: make_prepare_finalize loads it (Config::load()) inside its verdict
// gather, so a bad EPX_* variable stops every rank there instead of one rank alone after the agreement. The bad
// variable is set in this process before the ranks start (a rank body never touches the environment), so every
// rank sees it: each refuses naming it, and the gather leaves the group usable: an ll made with the caller's
// Config (loaded before the variable was set) gives a round that matches LlCpu. On two ranks also one rank's
// bad caller Config (ll.combine_wait "flags", built in C++): that rank throws the rule's sentence, the other names it.
// The per-process difference of the environment itself (one process bad, its peer naming it) needs one
// process per GPU; the same gather is covered here through the caller's Config.
TEST(LlCuda, CreateWithoutACallerConfigLoadsItInTheVerdictGather) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const Config good = Config::load();
  for (const int R : {1, 2}) {
    SCOPED_TRACE(std::to_string(R) + " ranks");
    Case c = make_case(R, 2048, 16, 4, DType::fp8_e4m3, false, false, false, false, 0.1, 16, per_rank(R, {8, 3}), 81);
    const std::vector<RankInput> in = make_inputs(c);
    const auto want = run_cpu(c, {in});
    say_where(R);
    const test::ScopedEnv bad_env("EPX_LL_COMBINE_WAIT", "flags");
    const std::string failed = run_cuda_ranks(R, 120.0, [&](int rank, const std::shared_ptr<Group>& g) {
      const RankStream rs;
      const cudaStream_t s = rs.s;
      std::string failures;
      try {
        auto bad = make_prepare_finalize("ll", g, c.config());
        failures += "created with EPX_LL_COMBINE_WAIT=flags; ";
      } catch (const InvalidArgument& e) {
        if (std::string(e.what()).find("EPX_LL_COMBINE_WAIT") == std::string::npos) failures += std::string("the refusal: '") + e.what() + "'; ";
      }
      if (R == 2) {  // rank 1's caller Config breaks a rule; rank 0's is good
        Config mine = good;
        if (rank == 1) mine.ll_combine_wait = "flags";
        std::string what;
        try {
          auto bad = make_prepare_finalize("ll", g, c.config(), mine);
          failures += "created with rank 1's ll.combine_wait = flags; ";
        } catch (const InvalidArgument& e) {
          what = e.what();
        }
        if (rank == 1 && what.find("ll.combine_wait") == std::string::npos) failures += "rank 1's refusal: '" + what + "'; ";
        if (rank == 0 && what.find("rank 1") == std::string::npos) failures += "rank 0's refusal does not name rank 1: '" + what + "'; ";
      }
      auto pf = make_prepare_finalize("ll", g, c.config(), good);
      auto* ll = dynamic_cast<dispatch::LlCuda*>(pf.get());
      if (ll == nullptr) throw std::runtime_error("make_prepare_finalize(\"ll\") on a CUDA group is not an LlCuda");
      const std::string d = diff(gpu_round(c, *ll, in[static_cast<size_t>(rank)], rank, s, false), want[0][static_cast<size_t>(rank)]);
      if (!d.empty()) failures += "round: " + d + "; ";
      throw_failures(rank, failures);
    });
    EXPECT_EQ(failed, "");
  }
}

// One buffer, 20 consecutive calls (10 eager, 10 graph replays with the token count on the device), T
// per call and rank in {0, 1, 7, 128} shrinking and growing, fresh inputs, every call against LlCpu and
// every replay against its eager call: the fallback (block signals) and the default (chunk signals); the
// default also with rank 0's block 0
// delayed (3 ms before its tagged stores and again before its items), so rank 1 reads rank 0's
// slot-token words of call 4 while they still hold call 0's token (with a two-valued tag such a stale
// word passed as current and the expansion read message slot 0 before it was written). Two ranks: the
// inputs are built around rank 0's messages to rank 1.
TEST(LlCuda, ManyCallsVaryingTokensTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  const dispatch::LlLaunch block = many_calls_launch(false), chunk = many_calls_launch(true);
  dispatch::LlLaunch delayed = chunk;
  delayed.debug_block0_delay_ns = 3'000'000;
  EXPECT_EQ(run_many_calls("fallback (block signals)", {block, block}), "");
  EXPECT_EQ(run_many_calls("chunk signals", {chunk, chunk}), "");
  EXPECT_EQ(run_many_calls("chunk signals rank0-delayed", {delayed, chunk}), "");
}

// The self-check of the test above: with the slot-token tag cut to 2 bits (calls n and n - 4 share one)
// and rank 0's block 0 delayed, rank 1's call 4 (eager) and 14 (graph) must differ from LlCpu: the test
// catches the bug it is for.
TEST(LlCuda, ManyCallsCatchesAStaleSlotTokenTwoRanks) {
  if (gpus() < 1) GTEST_SKIP() << kNoGpu;
  dispatch::LlLaunch weak = many_calls_launch(true);
  weak.debug_token_tag_mask = 3;
  dispatch::LlLaunch delayed = weak;
  delayed.debug_block0_delay_ns = 3'000'000;
  const std::string failed = run_many_calls("chunk signals tag-mask-3 rank0-delayed", {delayed, weak});
  std::printf("self-check failures (expected on rank 1, eager and graph call 4):\n%s", failed.c_str());
  EXPECT_NE(failed.find("eager call 4 rank 1"), std::string::npos) << failed;
  EXPECT_NE(failed.find("graph call 4 rank 1"), std::string::npos) << failed;
}

}  // namespace

#else

TEST(LlCuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

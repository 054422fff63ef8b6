// ModularMoE on CUDA through tests/cuda_ranks.h run_cuda_ranks: one forked process per GPU with an
// NCCL group where the machine has enough GPUs, else R virtual ranks (threads) on GPU 0; every case
// at 2, 4 and 8 ranks on the mini presets, against moe_reference_cpu computed in the parent before
// the ranks start: the DP-sharded shared expert on allgather_reducescatter and naive (bf16 and fp8
// wires, a shared gate, an idle rank), the graph refusal of a backend that is not graph-safe, and the
// whole-layer CUDA graph on ll and on the padded form of naive / allgather_reducescatter / all2allv
// (use_worst_case_sizing; the DP-sharded shared expert on the gathering ones): captured once at T_max,
// replayed with different valid counts per rank (0 included), the shared expert fused and separate,
// every replay's valid rows against the reference of its path and bit for bit against an eager twin
// layer on the same rows; fused against separate
// against the CPU reference eagerly; int64 ids never narrowed. Outputs are NaN-poisoned first. Bad ids and
// stopped ranks: moe_errors_cuda_test.cpp; a gpt-oss-style layer: moe_gpt_oss_cuda_test.cpp; shared:
// moe_cuda_testing.h.
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

TEST_P(ModularMoECuda, ShardedSharedExpertOnGatheringBackendsMatchesTheReference) {
  const int R = GetParam();
  say_where(R);
  const std::vector<ShardCase> cases = {
      {"qwen1.5-moe-a2.7b-mini", "allgather_reducescatter", per_rank(R, {5, 0, 3, 8}), DType::bf16},
      {"qwen1.5-moe-a2.7b-mini", "allgather_reducescatter", per_rank(R, {6, 11, 0, 2}), DType::fp8_e4m3},
      {"qwen1.5-moe-a2.7b-mini", "naive", per_rank(R, {9, 4, 1, 0}), DType::bf16},
      {"deepseek-v3-mini-wide-shared", "allgather_reducescatter", per_rank(R, {7, 3, 0, 5}), DType::fp8_e4m3},
  };
  std::vector<std::shared_ptr<const MoEWeights>> weights;
  std::vector<Inputs> inputs;
  for (size_t i = 0; i < cases.size(); ++i) {
    weights.push_back(weights_for(cases[i].preset, R));
    inputs.push_back(make_inputs(*weights.back(), cases[i].tokens, 40 + i, cases[i].wire));
  }
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    std::string failures;
    for (size_t i = 0; i < cases.size(); ++i) {
      const ShardCase& c = cases[i];
      const int64_t T = c.tokens[static_cast<size_t>(rank)];
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 16;
      dc.dispatch_dtype = c.wire;
      ModularMoEOptions o;
      o.shared_mode = SharedExpertMode::fused;
      ModularMoE layer(weights[i], g, c.backend, dc, Config{}, o);
      const Tensor x = inputs[i].x[rank].to(dev), idx = inputs[i].idx[rank].to(dev), wts = inputs[i].wts[rank].to(dev);
      Tensor out = Tensor::empty({T, weights[i]->config.hidden}, DType::bf16, dev);
      test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
      layer.forward_routed(x, idx, wts, out, Stream{stream});
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      const double e = rel_l2_rows(out, inputs[i].reference, inputs[i].offset[rank], T);
      const PathCounters& pc = layer.counters();
      if (!(e <= kTol) || !layer.shared_expert_sharded() || pc.shared_sharded != 1)
        failures += c.preset + " " + c.backend + " rank " + std::to_string(rank) + ": rel L2 " + std::to_string(e) + " sharded " +
                    std::to_string(layer.shared_expert_sharded()) + " counter " + std::to_string(pc.shared_sharded) + "; ";
      if (rank == 0)
        std::printf("%s %s %s T=%s: rank 0 rel L2 %.2e (sharded)\n", c.preset.c_str(), c.backend.c_str(),
                    std::string(dtype_name(c.wire)).c_str(), list_text(c.tokens).c_str(), e);
      // Not graph-safe: the refusal names the backend and the reason, and capture throws.
      if (i == 0) {
        const auto why = layer.why_no_graph(16);
        if (!why || why->find("not graph-safe") == std::string::npos) failures += "why_no_graph: '" + why.value_or("nullopt") + "'; ";
        bool threw = false;
        try {
          Tensor gx = Tensor::zeros({16, 256}, DType::bf16, dev), go = Tensor::zeros({16, 256}, DType::bf16, dev);
          Tensor gn = Tensor::zeros({1}, DType::int32, dev);
          layer.capture_graph(gx, TensorView(), TensorView(), go, gn, Stream{stream});
        } catch (const Unsupported&) {
          threw = true;
        }
        if (!threw) failures += "capture_graph on " + c.backend + " did not throw Unsupported; ";
      }
    }
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// The whole layer on ll captured at T_max = 16 and replayed with valid counts per rank that differ
// between replays and ranks (0 included). Each replay's valid rows: against the CPU reference of its
// shared path, and bit for bit against an eager twin layer (same weights, options and Config) run on
// the same rows: the graph computes what the eager layer does.
TEST_P(ModularMoECuda, WholeLayerGraphOnLlReplaysWithDifferentCountsPerRankAndEqualsEager) {
  const int R = GetParam();
  say_where(R);
  constexpr int64_t kMax = 16;
  auto w = weights_for("deepseek-v3-mini");
  const int64_t H = w->config.hidden;
  const Inputs in = make_inputs(*w, std::vector<int64_t>(static_cast<size_t>(R), kMax), 77, DType::fp8_e4m3);
  // Valid rows per replay and rank: all, different, ranks idle.
  const std::vector<std::vector<int64_t>> replays = {std::vector<int64_t>(static_cast<size_t>(R), kMax), per_rank(R, {7, kMax, 0, 3}),
                                                     per_rank(R, {0, 5, kMax, 1}), per_rank(R, {kMax, 1, 9, 0})};
  // The shared expert fused (the default gate at T_max = 16) and separate (x~ on the FP8 tensor cores;
  // its recv_count is the graph's device count, so only the valid rows are computed).
  // separate: g * shared joins ll's fp32 sum (FinalizeArgs::addend), one rounding; the local slot adds the
  // shared rows to the combined bf16 rows, two roundings.
  std::vector<Tensor> refs, refs_separate, refs_local;
  std::vector<std::vector<int64_t>> firsts;  // first reference row of each rank, per replay
  for (const auto& v : replays) {
    refs.push_back(reference_of(*w, in, v, DType::fp8_e4m3));
    refs_separate.push_back(reference_of(*w, in, v, DType::fp8_e4m3, false));
    refs_local.push_back(reference_of(*w, in, v, DType::fp8_e4m3, false, true));
    std::vector<int64_t> f(static_cast<size_t>(R), 0);
    for (int r = 1; r < R; ++r) f[static_cast<size_t>(r)] = f[static_cast<size_t>(r - 1)] + v[static_cast<size_t>(r - 1)];
    firsts.push_back(f);
  }
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = kMax;
    dc.dispatch_dtype = DType::fp8_e4m3;
    std::string failures;
    const Tensor x = in.x[rank].to(dev), idx = in.idx[rank].to(dev), wts = in.wts[rank].to(dev);
    // auto (fused through the dispatch at T_max = 16), auto with the local shared slot (M > 0:
    // the shared rows written into slot L-1 by the layer; the separate path's rounding), separate.
    for (const auto& [mode, local] : std::vector<std::pair<SharedExpertMode, bool>>{
             {SharedExpertMode::auto_gate, false}, {SharedExpertMode::auto_gate, true}, {SharedExpertMode::separate, false}}) {
      const bool separate = mode == SharedExpertMode::separate;
      const char* what = separate ? "separate" : local ? "fused (local slot)" : "fused";
      ModularMoEOptions o;
      o.shared_mode = mode;
      Config cfg;
      if (local) cfg.fhmoe_local_shared_tokens = 0;
      ModularMoE layer(w, g, "ll", dc, cfg, o);
      ModularMoE eager(w, g, "ll", dc, cfg, o);  // the eager twin
      if (auto why = layer.why_no_graph(kMax)) throw std::runtime_error("ll not graph-capturable: " + *why);
      Tensor out = Tensor::empty({kMax, H}, DType::bf16, dev), count = Tensor::zeros({1}, DType::int32, dev);
      Tensor eager_out = Tensor::empty({kMax, H}, DType::bf16, dev);
      int32_t c = static_cast<int32_t>(kMax);
      test::upload_device(count.data(), &c, sizeof c, "count");
      layer.capture_graph(x, idx, wts, out, count, Stream{stream});
      for (size_t i = 0; i < replays.size(); ++i) {
        const int64_t n = replays[i][static_cast<size_t>(rank)];
        c = static_cast<int32_t>(n);
        test::upload_device(count.data(), &c, sizeof c, "count");
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
        layer.replay_graph(Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const Tensor& ref = separate ? refs_separate[i] : local ? refs_local[i] : refs[i];
        const double e = rel_l2_rows(out, ref, firsts[i][static_cast<size_t>(rank)], n);
        const std::string where = std::string(what) + " replay " + std::to_string(i) + " rank " + std::to_string(rank);
        if (!(e <= kTol)) failures += where + ": rel L2 " + std::to_string(e) + "; ";
        // The eager twin on the same rows (T = n on this rank).
        test::poison_device(eager_out.data(), static_cast<size_t>(eager_out.nbytes()), "poison");
        eager.forward_routed(x.view().slice_rows(0, n), idx.view().slice_rows(0, n), wts.view().slice_rows(0, n),
                             eager_out.view().slice_rows(0, n), Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const std::string diff = test::first_diff(where + " against eager", test::host_bytes(out.view().slice_rows(0, n)),
                                                  test::host_bytes(eager_out.view().slice_rows(0, n)));
        if (!diff.empty()) {
          const double ee = rel_l2_rows(eager_out, ref, firsts[i][static_cast<size_t>(rank)], n);
          failures += diff + "(eager rel L2 to the reference " + std::to_string(ee) + "); ";
        }
        if (rank == 0)
          std::printf("graph replay %zu (n = %s), shared expert %s: rank 0 rel L2 %.2e, %s eager\n", i, list_text(replays[i]).c_str(), what,
                      e, diff.empty() ? "equal to" : "DIFFERENT from");
      }
      const PathCounters& pc = layer.counters();
      if (pc.graph_replays != static_cast<int64_t>(replays.size())) failures += "graph_replays counter wrong; ";
      if ((separate ? pc.shared_separate : pc.shared_fused) != static_cast<int64_t>(replays.size()))
        failures += std::string("shared path counter wrong (") + (separate ? "separate" : "fused") + "); ";
      if (layer.shared_local_slot_tokens() != (local ? 0 : Config{}.fhmoe_local_shared_tokens))
        failures += "shared_local_slot_tokens " + std::to_string(layer.shared_local_slot_tokens()) + "; ";
      g->barrier();  // every rank's replays and eager calls are done before the layers go
    }
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// The whole layer on the padded form of naive, allgather_reducescatter and all2allv
// (DispatchConfig::use_worst_case_sizing: graph-safe) captured at T_max = C = 16 and replayed with
// valid counts per rank that differ between replays and ranks (0 included): each replay's valid rows
// against the CPU reference of its shared path, and bit for bit against an eager twin layer (the same
// padded form, T = n on each rank) run on the same rows. The DP-sharded shared expert with its gate
// (Qwen1.5-MoE) on allgather_reducescatter and naive, the shared route (DeepSeek-V3) on all2allv, and
// the separate shared expert joining agrs's fp32 sum (FinalizeArgs::addend).
TEST_P(ModularMoECuda, WholeLayerGraphOnPaddedGatherAndAll2allvReplaysWithDifferentCountsPerRankAndEqualsEager) {
  const int R = GetParam();
  say_where(R);
  constexpr int64_t kMax = 16;
  struct GraphCase {
    std::string preset, backend;
    DType wire;
    SharedExpertMode mode;
    bool sharded;  // the DP-sharded shared expert is expected
  };
  const std::vector<GraphCase> cases = {
      {"qwen1.5-moe-a2.7b-mini", "allgather_reducescatter", DType::bf16, SharedExpertMode::fused, true},
      {"qwen1.5-moe-a2.7b-mini", "naive", DType::fp8_e4m3, SharedExpertMode::fused, true},
      {"deepseek-v3-mini", "all2allv", DType::fp8_e4m3, SharedExpertMode::fused, false},
      {"deepseek-v3-mini", "allgather_reducescatter", DType::fp8_e4m3, SharedExpertMode::separate, false},
  };
  const std::vector<std::vector<int64_t>> replays = {std::vector<int64_t>(static_cast<size_t>(R), kMax), per_rank(R, {7, kMax, 0, 3}),
                                                     per_rank(R, {0, 5, kMax, 1}), per_rank(R, {kMax, 1, 9, 0})};
  std::vector<std::shared_ptr<const MoEWeights>> weights;
  std::vector<Inputs> inputs;
  std::vector<std::vector<Tensor>> refs;  // [case][replay]
  std::vector<std::vector<int64_t>> firsts;  // [replay][rank] first reference row
  for (const auto& v : replays) {
    std::vector<int64_t> f(static_cast<size_t>(R), 0);
    for (int r = 1; r < R; ++r) f[static_cast<size_t>(r)] = f[static_cast<size_t>(r - 1)] + v[static_cast<size_t>(r - 1)];
    firsts.push_back(f);
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    weights.push_back(weights_for(cases[i].preset, R));
    inputs.push_back(make_inputs(*weights.back(), std::vector<int64_t>(static_cast<size_t>(R), kMax), 120 + i, cases[i].wire));
    refs.emplace_back();
    // The separate path on agrs joins the combine's fp32 sum (combine_addend): one rounding.
    for (const auto& v : replays)
      refs.back().push_back(reference_of(*weights.back(), inputs.back(), v, cases[i].wire, cases[i].mode != SharedExpertMode::separate));
  }
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    std::string failures;
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const GraphCase& gc = cases[ci];
      const auto& w = weights[ci];
      const int64_t H = w->config.hidden;
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = kMax;
      dc.dispatch_dtype = gc.wire;
      dc.use_worst_case_sizing = true;
      ModularMoEOptions o;
      o.shared_mode = gc.mode;
      ModularMoE layer(w, g, gc.backend, dc, Config{}, o);
      ModularMoE eager(w, g, gc.backend, dc, Config{}, o);  // the eager twin
      const std::string name = gc.preset + " " + gc.backend + (gc.mode == SharedExpertMode::separate ? " separate" : " fused");
      if (auto why = layer.why_no_graph(kMax)) throw std::runtime_error(name + " (padded) not graph-capturable: " + *why);
      if (layer.shared_expert_sharded() != gc.sharded)
        failures += name + ": shared_expert_sharded " + std::to_string(layer.shared_expert_sharded()) + "; ";
      const Tensor x = inputs[ci].x[rank].to(dev), idx = inputs[ci].idx[rank].to(dev), wts = inputs[ci].wts[rank].to(dev);
      Tensor out = Tensor::empty({kMax, H}, DType::bf16, dev), count = Tensor::zeros({1}, DType::int32, dev);
      Tensor eager_out = Tensor::empty({kMax, H}, DType::bf16, dev);
      int32_t c = static_cast<int32_t>(kMax);
      test::upload_device(count.data(), &c, sizeof c, "count");
      layer.capture_graph(x, idx, wts, out, count, Stream{stream});
      for (size_t i = 0; i < replays.size(); ++i) {
        const int64_t n = replays[i][static_cast<size_t>(rank)];
        c = static_cast<int32_t>(n);
        test::upload_device(count.data(), &c, sizeof c, "count");
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
        layer.replay_graph(Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const std::string where = name + " replay " + std::to_string(i) + " rank " + std::to_string(rank);
        const double e = rel_l2_rows(out, refs[ci][i], firsts[i][static_cast<size_t>(rank)], n);
        if (!(e <= kTol)) failures += where + ": rel L2 " + std::to_string(e) + "; ";
        test::poison_device(eager_out.data(), static_cast<size_t>(eager_out.nbytes()), "poison");
        eager.forward_routed(x.view().slice_rows(0, n), idx.view().slice_rows(0, n), wts.view().slice_rows(0, n),
                             eager_out.view().slice_rows(0, n), Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const std::string diff = test::first_diff(where + " against eager", test::host_bytes(out.view().slice_rows(0, n)),
                                                  test::host_bytes(eager_out.view().slice_rows(0, n)));
        if (!diff.empty()) {
          const double ee = rel_l2_rows(eager_out, refs[ci][i], firsts[i][static_cast<size_t>(rank)], n);
          failures += diff + "(eager rel L2 to the reference " + std::to_string(ee) + "); ";
        }
        if (rank == 0)
          std::printf("%s (padded) graph replay %zu (n = %s): rank 0 rel L2 %.2e, %s eager\n", name.c_str(), i, list_text(replays[i]).c_str(), e,
                      diff.empty() ? "equal to" : "DIFFERENT from");
      }
      const PathCounters& pc = layer.counters();
      if (pc.graph_replays != static_cast<int64_t>(replays.size())) failures += name + ": graph_replays counter wrong; ";
      if (gc.sharded && pc.shared_sharded != static_cast<int64_t>(replays.size()))
        failures += name + ": shared_sharded counter " + std::to_string(pc.shared_sharded) + "; ";
      g->barrier();  // every rank's replays and eager calls are done before the layers go
    }
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// The shared expert fused (FHMoE: route id E inside the routed launch) against separate (x
// quantized to FP8 1x128 as the wire does, then a one-expert ExpertMajor layout on the FP8 tensor
// cores, joining the combine's fp32 sum as FinalizeArgs::addend) against the CPU reference of each path, on fresh random
// inputs: DeepSeek-V3 (fp8_block routed + shared) and V4-Pro (MXFP4 routed, fp8_block shared), ll
// (ExpertMajor) and all2allv (Flat) (on 4 and 8 ranks V3 on ll and V4-Pro on all2allv), rank 0 with
// 80 tokens (the shared expert's rows straddle 64-row tiles), then the auto gate below and above
// fhmoe_max_tokens (the counters show the path).
TEST_P(ModularMoECuda, SharedExpertFusedAndSeparateMatchTheReferenceAndEachOther) {
  const int R = GetParam();
  say_where(R);
  const std::vector<int64_t> tokens = per_rank(R, {80, 37, 12, 0});
  struct Case {
    std::string preset, backend;
  };
  std::vector<Case> cases = {{"deepseek-v3-mini", "ll"}, {"deepseek-v3-mini", "all2allv"},
                             {"deepseek-v4-pro-mini", "ll"}, {"deepseek-v4-pro-mini", "all2allv"}};
  if (R > 2) cases = {cases[0], cases[3]};
  std::vector<std::shared_ptr<const MoEWeights>> weights;
  std::vector<Inputs> inputs;
  std::vector<Tensor> ref_separate, ref_local;  // one rounding (the addend joins the combine's sum); two (the local slot)
  for (size_t i = 0; i < cases.size(); ++i) {
    weights.push_back(weights_for(cases[i].preset));
    inputs.push_back(make_inputs(*weights.back(), tokens, 60 + i, DType::fp8_e4m3));
    ref_separate.push_back(reference_of(*weights.back(), inputs.back(), tokens, DType::fp8_e4m3, false));
    ref_local.push_back(reference_of(*weights.back(), inputs.back(), tokens, DType::fp8_e4m3, false, true));
  }
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    std::string failures;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      const auto& w = weights[i];
      const int64_t H = w->config.hidden, T = tokens[static_cast<size_t>(rank)];
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 96;
      dc.dispatch_dtype = DType::fp8_e4m3;
      const Tensor x = inputs[i].x[rank].to(dev), idx = inputs[i].idx[rank].to(dev), wts = inputs[i].wts[rank].to(dev);
      // fused, separate, auto with the gate at 100 (M = 80: fused) and at 50 (separate); then fused
      // with the local shared slot for every M (fhmoe.local_shared_tokens = 0; ll only: the layer
      // writes the shared rows into slot L-1, the separate path's rounding).
      std::vector<std::pair<SharedExpertMode, int>> modes = {
          {SharedExpertMode::fused, -1}, {SharedExpertMode::separate, -1}, {SharedExpertMode::auto_gate, 100},
          {SharedExpertMode::auto_gate, 50}};
      if (c.backend == "ll") modes.push_back({SharedExpertMode::fused, -2});
      std::vector<Tensor> outs;
      for (const auto& [mode, gate_or_local] : modes) {
        const bool local = gate_or_local == -2;
        const int gate = local ? -1 : gate_or_local;
        ModularMoEOptions o;
        o.shared_mode = mode;
        o.fhmoe_max_tokens = gate;
        Config cfg;
        if (local) cfg.fhmoe_local_shared_tokens = 0;
        ModularMoE layer(w, g, c.backend, dc, cfg, o);
        Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
        layer.forward_routed(x, idx, wts, out, Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const bool fused = mode == SharedExpertMode::fused || (mode == SharedExpertMode::auto_gate && gate >= 80);
        const PathCounters& pc = layer.counters();
        const std::string what = c.preset + " " + c.backend + " mode " + std::to_string(static_cast<int>(mode)) + " gate " +
                                 std::to_string(gate) + " rank " + std::to_string(rank);
        if (pc.shared_fused != (fused ? 1 : 0) || pc.shared_separate != (fused ? 0 : 1))
          failures += what + ": counters fused " + std::to_string(pc.shared_fused) + " separate " + std::to_string(pc.shared_separate) + "; ";
        const Tensor& ref = local ? ref_local[i] : fused ? inputs[i].reference : ref_separate[i];
        const double e = rel_l2_rows(out, ref, inputs[i].offset[rank], T);
        if (!(e <= kTol)) failures += what + (local ? " local slot" : "") + ": rel L2 " + std::to_string(e) + "; ";
        if (rank == 0)
          std::printf("%s%s: rel L2 %.2e against the %s reference\n", what.c_str(), local ? " (local slot)" : "", e,
                      local ? "separate two-roundings" : fused ? "fused" : "separate");
        outs.push_back(std::move(out));
        g->barrier();  // every rank's call is done before the layer goes
      }
      if (T > 0) {  // fused against separate, directly
        const Tensor a = outs[0].to(Device::cpu()), b = outs[1].to(Device::cpu());
        const double e = test::rel_l2_error(a, b);
        if (!(e <= kTol)) failures += c.preset + " " + c.backend + " rank " + std::to_string(rank) + ": fused vs separate rel L2 " + std::to_string(e) + "; ";
        if (rank == 0) std::printf("%s %s: rank 0 fused vs separate rel L2 %.2e\n", c.preset.c_str(), c.backend.c_str(), e);
      }
      if (T > 0 && outs.size() > 4) {  // the local slot against separate: the same GEMMs, one rounding more
        const Tensor a = outs[4].to(Device::cpu()), b = outs[1].to(Device::cpu());
        const double e = test::rel_l2_error(a, b);
        if (!(e <= 4e-3)) failures += c.preset + " " + c.backend + " rank " + std::to_string(rank) + ": local slot vs separate rel L2 " + std::to_string(e) + "; ";
        if (rank == 0) std::printf("%s %s: rank 0 fused (local slot) vs separate rel L2 %.2e\n", c.preset.c_str(), c.backend.c_str(), e);
      }
    }
    g->barrier();
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

// int64 topk_idx on CUDA reaches the dispatch unnarrowed. In range, int64 routes give the reference
// on ll (ExpertMajor), ht and all2allv (Flat); DeepSeek-V3 with its shared expert fused, so the
// layer's route columns have K+1 columns. Out of int32's range, every rank's one bad id (even ranks
// 2^32 + 3 + r, narrowed: expert 3 + r; odd ranks -2^32 - r, narrowed: -r, no selection for rank 1)
// is rejected on every rank with InvalidArgument naming its topk_idx[t, k], the value and the rule:
// all2allv and ht in that call, ll (no host sync) in the next one, whose selection was dropped; then
// the layer runs again.
TEST_P(ModularMoECuda, Int64TopkIdxIsNeverNarrowed) {
  const int R = GetParam();
  say_where(R);
  const std::vector<int64_t> tokens = per_rank(R, {6, 5, 7, 5});
  auto w = weights_for("deepseek-v3-mini");
  const int K = w->config.router.top_k;
  const Inputs in = make_inputs(*w, tokens, 91, DType::fp8_e4m3);
  std::vector<int64_t> bad_value;
  std::vector<std::pair<int64_t, int64_t>> bad_at;  // (t, k) per rank
  std::vector<Tensor> idx64, bad64;
  for (int r = 0; r < R; ++r) {
    const int64_t T = tokens[static_cast<size_t>(r)];
    bad_value.push_back(r % 2 == 0 ? (int64_t{1} << 32) + 3 + r : -(int64_t{1} << 32) - r);
    bad_at.push_back(r == 0 ? std::pair<int64_t, int64_t>{1, 0} : r == 1 ? std::pair<int64_t, int64_t>{4, K - 1}
                                                                         : std::pair<int64_t, int64_t>{(1 + 3 * r) % T, (5 * r) % K});
    idx64.push_back(Tensor::empty({T, K}, DType::int64));
    for (int64_t i = 0; i < T * K; ++i) idx64.back().ptr<int64_t>()[i] = in.idx[static_cast<size_t>(r)].ptr<int32_t>()[i];
    bad64.push_back(Tensor::empty({T, K}, DType::int64));
    std::copy_n(idx64.back().ptr<int64_t>(), T * K, bad64.back().ptr<int64_t>());
    bad64.back().ptr<int64_t>()[bad_at.back().first * K + bad_at.back().second] = bad_value.back();
  }
  const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
    const RankStream rs;
    const cudaStream_t stream = rs.s;
    const Device dev = g->device();
    const size_t me = static_cast<size_t>(rank);
    const int64_t H = w->config.hidden, T = tokens[me];
    const Tensor x = in.x[me].to(dev), idx = idx64[me].to(dev), bad = bad64[me].to(dev), wts = in.wts[me].to(dev);
    const std::string want_elem = "topk_idx[" + std::to_string(bad_at[me].first) + ", " + std::to_string(bad_at[me].second) +
                                  "] = " + std::to_string(bad_value[me]);
    std::string failures;
    for (const std::string backend : {"all2allv", "ht", "ll"}) {
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 16;
      dc.dispatch_dtype = DType::fp8_e4m3;
      ModularMoE layer(w, g, backend, dc, Config{});
      Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
      auto run_good = [&](const char* when) {
        test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
        layer.forward_routed(x, idx, wts, out, Stream{stream});
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        const double e = rel_l2_rows(out, in.reference, in.offset[me], T);
        if (!(e <= kTol)) failures += backend + " int64 " + when + " rank " + std::to_string(rank) + ": rel L2 " + std::to_string(e) + "; ";
        if (rank == 0) std::printf("%s int64 topk_idx %s: rank 0 rel L2 %.2e\n", backend.c_str(), when, e);
      };
      run_good("in range");
      std::string error;
      int calls = 0;
      for (; calls < 2 && error.empty(); ++calls) {  // ll reports a device-side bad id in the next call
        try {
          layer.forward_routed(x, bad, wts, out, Stream{stream});
          cuda_ok(cudaStreamSynchronize(stream), "sync");
        } catch (const InvalidArgument& e) {
          error = e.what();
        }
      }
      if (rank == 0) std::printf("%s, call %d: %s\n", backend.c_str(), calls, error.c_str());
      if (error.find(want_elem) == std::string::npos || error.find("must be") == std::string::npos)
        failures += backend + " rank " + std::to_string(rank) + ": want InvalidArgument naming '" + want_elem + "', got '" + error + "'; ";
      if (calls != (backend == "ll" ? 2 : 1)) failures += backend + " threw in call " + std::to_string(calls) + "; ";
      run_good("after the rejection");
      g->barrier();  // every rank's calls are done before the layer goes
    }
    throw_failures(rank, failures);
  });
  EXPECT_EQ(failed, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, ModularMoECuda, ::testing::Values(2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });

#else

TEST(ModularMoECuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

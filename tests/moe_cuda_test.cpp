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
// against the CPU reference eagerly; int64 ids never narrowed; a bad id on one rank stopping every
// rank at the next call (ll, ht worst-case, hierarchical ll); a stopped rank named in every other
// rank's error; a gpt-oss-style layer (router bias, expert biases, clamped SwiGLU; MXFP4 and bf16
// experts) at R = 1 and 2. Outputs are NaN-poisoned first.
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

namespace {

using test::cuda_ok;
using test::run_cuda_ranks;
using test::virtual_ranks_for;

/// The weights of a preset, built in the gtest process before the ranks start: rank bodies only read
/// the shared_ptr they are handed (on virtual ranks they are threads, and this cache is not
/// thread-safe). "deepseek-v3-mini-wide-shared" is deepseek-v3-mini with a shared expert 128 * R wide:
/// one fp8_block 128-block per rank of R, the narrowest shared expert that still runs DP-sharded.
std::shared_ptr<const MoEWeights> weights_for(const std::string& name, int R = 2) {
  static std::map<std::string, std::shared_ptr<const MoEWeights>> cache;
  const bool wide = name == "deepseek-v3-mini-wide-shared";
  auto& w = cache[wide ? name + " R" + std::to_string(R) : name];
  if (!w && wide) {
    MoEConfig c = preset("deepseek-v3-mini");
    c.name = name;
    c.shared_intermediate = 128 * R;
    w = MoEWeights::random(c, 99);
  }
  if (!w) w = MoEWeights::random(preset(name), 2025);
  return w;
}

/// "{5,0,3,8}"
std::string list_text(const std::vector<int64_t>& v) {
  std::string s = "{";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "}";
}

using test::RankStream;
using test::per_rank;
using test::throw_failures;
using test::say_where;

/// Per-rank inputs [T_r rows] and the reference of the concatenated rows.
struct Inputs {
  std::vector<Tensor> x, idx, wts;
  Tensor reference;              // [sum T_r, H]
  std::vector<int64_t> offset;   // first reference row of each rank
};

/// Reference of rows [0, valid[r]) of each rank's inputs (`fused`: the shared path it models;
/// `two_roundings`: the separate path's routed sum rounded to bf16 before g * shared joins, as the
/// layer does where the shared rows are added after the combine: the local shared slot).
Tensor reference_of(const MoEWeights& w, const Inputs& in, const std::vector<int64_t>& valid, DType wire, bool fused = true,
                    bool two_roundings = false) {
  const int64_t H = w.config.hidden;
  const int K = w.config.router.top_k;
  const int64_t T = std::accumulate(valid.begin(), valid.end(), int64_t{0});
  Tensor x = Tensor::empty({T, H}, DType::bf16), idx = Tensor::empty({T, K}, DType::int32), wts = Tensor::empty({T, K}, DType::fp32);
  int64_t row = 0;
  for (size_t r = 0; r < valid.size(); ++r) {
    std::copy_n(in.x[r].ptr<uint16_t>(), valid[r] * H, x.ptr<uint16_t>() + row * H);
    std::copy_n(in.idx[r].ptr<int32_t>(), valid[r] * K, idx.ptr<int32_t>() + row * K);
    std::copy_n(in.wts[r].ptr<float>(), valid[r] * K, wts.ptr<float>() + row * K);
    row += valid[r];
  }
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  moe_reference_cpu(w, x, idx, wts, out, {.dispatch_dtype = wire, .shared_fused = fused, .two_roundings = two_roundings});
  return out;
}

Inputs make_inputs(const MoEWeights& w, const std::vector<int64_t>& tokens, uint64_t seed, DType wire) {
  Inputs in;
  const int K = w.config.router.top_k;
  for (size_t r = 0; r < tokens.size(); ++r) {
    in.x.push_back(test::random_bf16(tokens[r], w.config.hidden, seed * 17 + r));
    Tensor i, v;
    test::random_routing(tokens[r], K, w.config.router.num_experts, seed * 17 + 9 + r, {.masked_fraction = 0.1, .allow_duplicates = true},
                         i, v);
    in.idx.push_back(i);
    in.wts.push_back(v);
  }
  in.reference = reference_of(w, in, tokens, wire);
  int64_t off = 0;
  for (int64_t t : tokens) {
    in.offset.push_back(off);
    off += t;
  }
  return in;
}

/// rel L2 of `got` (device [>= n, H]) rows [0, n) against reference rows [first, first + n).
double rel_l2_rows(const TensorView& got_dev, const Tensor& reference, int64_t first, int64_t n) {
  const int64_t H = reference.size(1);
  Tensor got = Tensor::empty({n, H}, DType::bf16), want = Tensor::empty({n, H}, DType::bf16);
  if (n == 0) return 0.0;
  copy(got, got_dev.slice_rows(0, n));
  std::copy_n(reference.ptr<uint16_t>() + first * H, n * H, want.ptr<uint16_t>());
  return test::rel_l2_error(got, want);
}

constexpr double kTol = 1e-2;

struct ShardCase {
  std::string preset, backend;
  std::vector<int64_t> tokens;
  DType wire;
};

/// Every multi-rank case at R ranks: 2, and 4 and 8 on the mini presets.
class ModularMoECuda : public ::testing::TestWithParam<int> {};

}  // namespace

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

namespace {

/// A gpt-oss-style layer at the mini shape (H = I = 256, E = 16, top-4 softmax renormalised over the top-k, no shared
/// expert): experts of `format` with b13 / b2 and gpt_oss_glu (alpha 1.702, the limit at the median |gate_up| of
/// expert 0, so about half of the gate / up values are clamped), and a router bias of twice the logits' scale (it
/// changes most tokens' selections: the negative control below says so).
std::shared_ptr<const MoEWeights> gpt_oss_layer(WeightFormat format, uint64_t seed) {
  MoEConfig c;
  c.name = "gpt-oss-mini";
  c.hidden = 256;
  c.intermediate = 256;
  c.router.num_experts = 16;
  c.router.top_k = 4;
  c.router.scoring = ScoringFunc::softmax;
  c.router.renormalize = true;
  c.routed_format = format;
  auto w = MoEWeights::random(c, seed);
  const int64_t H = c.hidden, I = c.intermediate;
  const Tensor probe = test::random_bf16(4, H, seed + 1);
  std::vector<float> mags;
  const float* a = w->experts[0]->w13_f32();
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t o = 0; o < 2 * I; ++o) {
      float acc = 0;
      for (int64_t k = 0; k < H; ++k) acc += bf16_bits_to_float(probe.ptr<const uint16_t>()[r * H + k]) * a[o * H + k];
      mags.push_back(std::fabs(acc));
    }
  std::nth_element(mags.begin(), mags.begin() + mags.size() / 2, mags.end());
  const float limit = mags[mags.size() / 2];
  auto vec = [](int64_t n, uint64_t s, float scale) {
    const Tensor t = test::random_f32(1, n, s, scale);
    Tensor v = Tensor::empty({n}, DType::fp32);
    std::copy_n(t.ptr<const float>(), n, v.ptr<float>());
    return v;
  };
  for (size_t e = 0; e < w->experts.size(); ++e) {
    const ExpertWeights& s0 = *w->experts[e];
    auto x = std::make_shared<ExpertWeights>();
    x->format = s0.format, x->hidden = s0.hidden, x->intermediate = s0.intermediate;
    x->w13 = s0.w13, x->w13_scale = s0.w13_scale, x->w2 = s0.w2, x->w2_scale = s0.w2_scale;
    x->activation = ExpertActivation::gpt_oss(1.702f, limit);
    x->b13 = vec(2 * I, seed * 31 + e, limit);
    x->b2 = vec(H, seed * 37 + e, 0.05f);
    w->experts[e] = x;
  }
  Tensor logits = Tensor::empty({64, c.router.num_experts}, DType::fp32);
  router_logits_cpu(*w, test::random_bf16(64, H, seed + 2), logits);
  double sq = 0;
  for (int64_t i = 0; i < logits.numel(); ++i) sq += static_cast<double>(logits.ptr<float>()[i]) * logits.ptr<float>()[i];
  w->router_bias = vec(c.router.num_experts, seed * 41, 2.0f * static_cast<float>(std::sqrt(sq / logits.numel())));
  return w;
}

/// The CPU routing of x through w (router_logits_cpu with w's router bias, route) and, per token, whether the k-th and
/// (k+1)-th biased logits are more than 1e-3 apart (a selection the CUDA router's logits, cuBLAS's sums within a few
/// ulps of BLAS's, cannot flip).
void cpu_route(const MoEWeights& w, const Tensor& x, Tensor& idx, Tensor& wts, std::vector<bool>& clear) {
  const int64_t T = x.size(0), E = w.config.router.num_experts, K = w.config.router.top_k;
  Tensor logits = Tensor::empty({T, E}, DType::fp32);
  router_logits_cpu(w, x, logits);
  idx = Tensor::empty({T, K}, DType::int32), wts = Tensor::empty({T, K}, DType::fp32);
  route(w.config.router, logits, TensorView(), idx, wts);
  clear.assign(static_cast<size_t>(T), true);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> l(logits.ptr<const float>() + t * E, logits.ptr<const float>() + (t + 1) * E);
    std::sort(l.begin(), l.end(), std::greater<float>());
    clear[static_cast<size_t>(t)] = l[K - 1] - l[K] > 1e-3f;
  }
}

}  // namespace

// gpt-oss on CUDA: the router bias (logits + bias before the top-k, on the device), the expert biases and the clamped
// SwiGLU (the *_epi kernels) through ModularMoE at R = 1 and 2, MXFP4 and bf16 experts, bf16 and FP8 wires (FP8 x:
// the MXFP4 experts on the mixed tensor-core kernels), ll (ExpertMajor) and all2allv (Flat). forward_routed with the
// CPU's routing against moe_reference_cpu on every token; forward (the CUDA router) on every token whose top-k is
// clear of ties. Negative control: the reference without the router bias is far from the one with it.
TEST(ModularMoECudaGptOss, RouterBiasExpertBiasesAndClampedSwigluMatchTheCpuReference) {
  for (WeightFormat format : {WeightFormat::mxfp4, WeightFormat::bf16}) {
    const auto w = gpt_oss_layer(format, format == WeightFormat::mxfp4 ? 71 : 72);
    auto no_bias = std::make_shared<MoEWeights>(*w);
    no_bias->router_bias = Tensor();
    for (int R : {1, 2}) {
      say_where(R);
      const std::vector<int64_t> tokens = R == 1 ? std::vector<int64_t>{40} : std::vector<int64_t>{40, 23};
      for (DType wire : {DType::bf16, DType::fp8_e4m3}) {
        std::vector<Tensor> x, idx, wts, ref;
        std::vector<std::vector<bool>> clear;
        for (int r = 0; r < R; ++r) {
          x.push_back(test::random_bf16(tokens[r], 256, 700 + 10 * r + R));
          Tensor i, v, i0, v0, out = Tensor::empty({tokens[r], 256}, DType::bf16), out0 = Tensor::empty({tokens[r], 256}, DType::bf16);
          std::vector<bool> c, c0;
          cpu_route(*w, x.back(), i, v, c);
          moe_reference_cpu(*w, x.back(), i, v, out, {.dispatch_dtype = wire});
          cpu_route(*no_bias, x.back(), i0, v0, c0);
          moe_reference_cpu(*no_bias, x.back(), i0, v0, out0, {.dispatch_dtype = wire});
          EXPECT_GT(test::rel_l2_error(out, out0), 10 * kTol) << "the router bias barely changes the layer: the test could not fail";
          idx.push_back(i), wts.push_back(v), ref.push_back(out), clear.push_back(c);
        }
        for (const std::string backend : {"ll", "all2allv"}) {
          const std::string failed = run_cuda_ranks(R, 300.0, [&](int rank, const std::shared_ptr<Group>& g) {
            const RankStream rs;
            const Device dev = g->device();
            const int64_t T = tokens[static_cast<size_t>(rank)], H = 256;
            DispatchConfig dc;
            dc.num_max_dispatch_tokens_per_rank = 64;
            dc.dispatch_dtype = wire;
            ModularMoE layer(w, g, backend, dc, Config{}, ModularMoEOptions{});
            const Tensor xd = x[rank].to(dev), id = idx[rank].to(dev), wd = wts[rank].to(dev);
            std::string failures;
            for (int routed : {1, 0}) {
              Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
              test::poison_device(out.data(), static_cast<size_t>(out.nbytes()), "poison");
              if (routed) layer.forward_routed(xd, id, wd, out, Stream{rs.s});
              else layer.forward(xd, out, Stream{rs.s});
              cuda_ok(cudaStreamSynchronize(rs.s), "sync");
              const Tensor got = out.to(Device::cpu());
              std::vector<int64_t> rows;
              for (int64_t t = 0; t < T; ++t)
                if (routed || clear[rank][static_cast<size_t>(t)]) rows.push_back(t);
              Tensor a = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::bf16), b = Tensor::empty({static_cast<int64_t>(rows.size()), H}, DType::bf16);
              for (size_t j = 0; j < rows.size(); ++j) {
                std::copy_n(got.ptr<const uint16_t>() + rows[j] * H, H, a.ptr<uint16_t>() + j * H);
                std::copy_n(ref[rank].ptr<const uint16_t>() + rows[j] * H, H, b.ptr<uint16_t>() + j * H);
              }
              const double e = rows.empty() ? 0.0 : test::rel_l2_error(a, b);
              const std::string what = std::string(weight_format_name(format)) + " " + backend + " wire " +
                                       std::string(dtype_name(wire)) + (routed ? " forward_routed" : " forward") + " rank " +
                                       std::to_string(rank);
              if (!(e <= kTol)) failures += what + ": rel L2 " + std::to_string(e) + "; ";
              if (!routed && rows.size() * 2 < static_cast<size_t>(T)) failures += what + ": fewer than half the tokens clear of ties; ";
              if (rank == 0)
                std::printf("R=%d %s: rel L2 %.2e over %zu of %lld tokens\n", R, what.c_str(), e, rows.size(), static_cast<long long>(T));
              g->barrier();
            }
            throw_failures(rank, failures);
          });
          EXPECT_EQ(failed, "");
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ModularMoECuda, ::testing::Values(2, 4, 8), [](const auto& info) { return "R" + std::to_string(info.param); });

#else

TEST(ModularMoECuda, NeedsACudaBuild) { GTEST_SKIP() << "CPU-only build (EPX_CUDA=OFF)"; }

#endif  // EPX_WITH_CUDA

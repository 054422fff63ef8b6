// ModularMoE over R CPU ranks against moe_reference_cpu on the concatenated tokens: every "-mini"
// preset x every dispatch backend x R in {1, 2, 4}, bf16 and fp8 dispatch, DP chunking with uneven
// and zero token counts, the shared expert fused / separate / gated (counters prove the path), and
// the argument errors (capacity, bad routing) raised on every rank instead of a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "epx/routing.h"
#include "experts/identity.h"
#include "test_util.h"

using namespace epx;

namespace {

// Full-expert weights per preset, built once per process: the big minis (256/384 quantized
// experts) take about a second each to build, every case after that milliseconds.
std::shared_ptr<const MoEWeights> weights_for(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const MoEWeights>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& w = cache[name];
  if (!w && name == "mixtral-2-experts") {  // E = 2 < R = 4: ranks 2 and 3 hold no expert
    MoEConfig c = preset("mixtral-8x7b-mini");
    c.name = name;
    c.router.num_experts = 2;
    c.router.top_k = 1;
    w = MoEWeights::random(c, 2024);
  }
  if (!w) w = MoEWeights::random(preset(name), 2024);
  return w;
}

struct LayerCase {
  std::string preset;
  std::string backend;
  std::vector<int64_t> tokens;  // T per rank (R = tokens.size())
  DType dispatch_dtype = DType::bf16;
  ModularMoEOptions options{};
  int capacity = 64;
  bool given_routing = false;   // forward_routed with random routing (-1 and duplicates) instead of forward
  uint64_t seed = 1;
  bool expert_contiguous = false;  // DispatchConfig::expert_contiguous (ht only)
  int expert_alignment = 1;

  std::string describe() const {
    std::string t;
    for (int64_t v : tokens) t += (t.empty() ? "" : ",") + std::to_string(v);
    return preset + " backend=" + backend + " R=" + std::to_string(tokens.size()) + " T={" + t + "} dispatch=" +
           std::string(dtype_name(dispatch_dtype)) + " chunk=" + std::to_string(options.chunk_size) +
           " shared_mode=" + std::to_string(static_cast<int>(options.shared_mode)) +
           " fhmoe_max_tokens=" + std::to_string(options.fhmoe_max_tokens) + (given_routing ? " routed" : "") +
           (expert_contiguous ? " expert_contiguous align=" + std::to_string(expert_alignment) : "");
  }
};

struct LayerResult {
  double rel_l2 = 0;
  std::vector<PathCounters> counters;  // per rank
};

// Runs the case on R rank threads and compares the concatenated outputs with the reference.
// `shared_fused_reference`: what the reference assumes for the shared expert's input (matters for
// fp8 dispatch only: fused, the shared expert sees the dispatched FP8 x).
LayerResult run_case(const LayerCase& c, bool shared_fused_reference) {
  auto w = weights_for(c.preset);
  const MoEConfig& cfg = w->config;
  const int R = static_cast<int>(c.tokens.size());
  const int K = cfg.router.top_k;
  const int64_t H = cfg.hidden;
  std::vector<Tensor> x(R), idx(R), wts(R), out(R);
  for (int r = 0; r < R; ++r) {
    x[r] = test::random_bf16(c.tokens[r], H, c.seed * 100 + r);
    out[r] = Tensor::empty({c.tokens[r], H}, DType::bf16);
    test::poison(out[r]);
    if (c.given_routing) {
      test::random_routing(c.tokens[r], K, cfg.router.num_experts, c.seed * 100 + r + 50,
                           {.masked_fraction = 0.15, .allow_duplicates = true}, idx[r], wts[r]);
    } else {  // the layer's router on the same per-rank batch, so the reference sees identical routing
      Tensor logits = Tensor::empty({c.tokens[r], cfg.router.num_experts}, DType::fp32);
      idx[r] = Tensor::empty({c.tokens[r], K}, DType::int32);
      wts[r] = Tensor::empty({c.tokens[r], K}, DType::fp32);
      router_logits_cpu(*w, x[r], logits);
      route(cfg.router, logits, w->correction_bias.view(), idx[r], wts[r]);
    }
  }
  LayerResult res;
  res.counters.resize(R);
  auto groups = make_cpu_groups(R, 30.0);
  run_ranks(groups, [&](int rank) {
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = c.capacity;
    dc.dispatch_dtype = c.dispatch_dtype;
    dc.expert_contiguous = c.expert_contiguous;
    dc.expert_alignment = c.expert_alignment;
    ModularMoE layer(w, groups[rank], c.backend, dc, Config{}, c.options);
    if (c.given_routing) layer.forward_routed(x[rank], idx[rank], wts[rank], out[rank]);
    else layer.forward(x[rank], out[rank]);
    res.counters[rank] = layer.counters();
  });

  const int64_t T = std::accumulate(c.tokens.begin(), c.tokens.end(), int64_t{0});
  Tensor x_all = Tensor::empty({T, H}, DType::bf16), out_all = Tensor::empty({T, H}, DType::bf16);
  Tensor idx_all = Tensor::empty({T, K}, DType::int32), wts_all = Tensor::empty({T, K}, DType::fp32);
  int64_t row = 0;
  for (int r = 0; r < R; ++r) {
    const int64_t n = c.tokens[r];
    std::copy_n(x[r].ptr<uint16_t>(), n * H, x_all.ptr<uint16_t>() + row * H);
    std::copy_n(out[r].ptr<uint16_t>(), n * H, out_all.ptr<uint16_t>() + row * H);
    std::copy_n(idx[r].ptr<int32_t>(), n * K, idx_all.ptr<int32_t>() + row * K);
    std::copy_n(wts[r].ptr<float>(), n * K, wts_all.ptr<float>() + row * K);
    row += n;
  }
  Tensor want = Tensor::empty({T, H}, DType::bf16);
  moe_reference_cpu(*w, x_all, idx_all, wts_all, want,
                    {.dispatch_dtype = c.dispatch_dtype, .shared_fused = shared_fused_reference});
  res.rel_l2 = test::rel_l2_error(out_all, want);
  return res;
}

const std::vector<std::string>& mini_presets() {
  static const std::vector<std::string> names = {"mixtral-8x7b-mini", "qwen1.5-moe-a2.7b-mini", "qwen3-30b-a3b-mini",
                                                 "deepseek-v3-mini", "deepseek-v4-pro-mini"};
  return names;
}

constexpr double kTol = 1e-2;  // rel L2: bf16 operands land between 1e-3 and 1e-2

}  // namespace

// The cross product: every mini preset x backend x R, the layer's own router, default options but
// the replica's gate for every layer (auto gate with small T: the shared expert runs fused; the
// DP-sharded layers' own default gate, Config::fhmoe_max_tokens_sharded = 0, is moe_dp_test's).
TEST(ModularMoE, EveryPresetBackendAndRankCountMatchesTheReference) {
  const std::vector<std::vector<int64_t>> rank_tokens = {{9}, {7, 12}, {5, 0, 11, 3}};
  int cases = 0;
  for (const std::string& p : mini_presets()) {
    const bool has_shared = preset(p).num_shared_experts > 0;
    for (const std::string& b : backend_names()) {
      for (const auto& tokens : rank_tokens) {
        LayerCase c{.preset = p, .backend = b, .tokens = tokens, .seed = static_cast<uint64_t>(++cases)};
        c.options.fhmoe_max_tokens = Config{}.fhmoe_max_tokens;
        const LayerResult r = run_case(c, true);
        EXPECT_LE(r.rel_l2, kTol) << c.describe();
        for (size_t rank = 0; rank < tokens.size(); ++rank) {
          const PathCounters& pc = r.counters[rank];
          EXPECT_EQ(pc.backend, b);
          EXPECT_EQ(pc.calls, 1);
          EXPECT_EQ(pc.chunks, 1);
          EXPECT_EQ(pc.idle_chunks, tokens[rank] == 0 ? 1 : 0) << c.describe() << " rank " << rank;
          EXPECT_EQ(pc.shared_fused, has_shared ? 1 : 0) << c.describe();
          EXPECT_EQ(pc.shared_separate, 0) << c.describe();
        }
      }
    }
  }
}

// FP8 dispatch (1x128 scales on the wire) with given routing (-1 and duplicate experts), every
// backend, shared expert fused (it sees the dispatched FP8 x) and separate (it sees x quantized to
// FP8 1x128 the same way, and is added to the combined rows: a second bf16 rounding).
TEST(ModularMoE, Fp8DispatchWithMaskedAndDuplicateRoutingMatchesTheReference) {
  for (const std::string& p : {std::string("deepseek-v4-pro-mini"), std::string("qwen1.5-moe-a2.7b-mini")}) {
    for (const std::string& b : backend_names()) {
      for (SharedExpertMode mode : {SharedExpertMode::fused, SharedExpertMode::separate}) {
        LayerCase c{.preset = p, .backend = b, .tokens = {6, 13}, .dispatch_dtype = DType::fp8_e4m3,
                    .options = {.shared_mode = mode}, .given_routing = true, .seed = 77};
        const LayerResult r = run_case(c, mode == SharedExpertMode::fused);
        EXPECT_LE(r.rel_l2, kTol) << c.describe();
        const bool fused = mode == SharedExpertMode::fused;
        EXPECT_EQ(r.counters[0].shared_fused, fused ? 1 : 0) << c.describe();
        EXPECT_EQ(r.counters[0].shared_separate, fused ? 0 : 1) << c.describe();
      }
    }
  }
}

// ht with DispatchConfig::expert_contiguous: the layer runs its experts on prepare's expert-contiguous rows
// (ActivationLayout::Contiguous, [L + 1] offsets, padding rows from expert_alignment) and finalize weights them;
// the same reference as the Flat path, every mini preset (FHMoE's shared route among the local experts when fused),
// bf16 and FP8 wires, shared expert fused and separate, a rank without tokens.
TEST(ModularMoE, HtExpertContiguousLayoutMatchesTheReference) {
  int cases = 0;
  for (const std::string& p : mini_presets()) {
    for (DType d : {DType::bf16, DType::fp8_e4m3}) {
      for (SharedExpertMode mode : {SharedExpertMode::fused, SharedExpertMode::separate}) {
        LayerCase c{.preset = p, .backend = "ht", .tokens = {11, 0, 7}, .dispatch_dtype = d, .options = {.shared_mode = mode},
                    .given_routing = true, .seed = static_cast<uint64_t>(400 + ++cases), .expert_contiguous = true,
                    .expert_alignment = 4};
        const LayerResult r = run_case(c, mode == SharedExpertMode::fused);
        EXPECT_LE(r.rel_l2, kTol) << c.describe();
        EXPECT_EQ(r.counters[0].calls, 1) << c.describe();
      }
    }
  }
}

// A layer whose experts do not take the Contiguous layout (a factory's identity experts) is refused at
// construction on every rank, naming the layout.
TEST(ModularMoE, ExpertContiguousNeedsExpertsThatTakeIt) {
  auto w = weights_for("deepseek-v3-mini");
  auto groups = make_cpu_groups(2, 10.0);
  std::vector<std::string> errs(2);
  run_ranks(groups, [&](int rank) {
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = 16;
    dc.expert_contiguous = true;
    ModularMoEOptions o;
    o.make_experts = [&](std::vector<std::shared_ptr<const ExpertWeights>> local, Device dev) {
      return make_identity_experts(static_cast<int>(local.size()), w->config.hidden, dev);
    };
    try {
      ModularMoE layer(w, groups[rank], "ht", dc, Config{}, o);
    } catch (const Unsupported& e) {
      errs[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errs[r].find("contiguous"), std::string::npos) << "rank " << r << ": " << errs[r];
}

// The separate shared expert on an fp8 wire sees x~ (the wire's FP8 round trip), as the reference
// of the separate path says: tighter than kTol, so the bf16 x (a ~1e-2 change of the shared
// expert's output) would fail it. bf16 wire: x itself.
TEST(ModularMoE, SeparateSharedExpertSeesTheWireX) {
  for (const std::string& p : {std::string("deepseek-v3-mini"), std::string("deepseek-v4-pro-mini")}) {
    for (const std::string& b : {std::string("ll"), std::string("naive")}) {
      for (DType d : {DType::fp8_e4m3, DType::bf16}) {
        LayerCase c{.preset = p, .backend = b, .tokens = {9, 5}, .dispatch_dtype = d,
                    .options = {.shared_mode = SharedExpertMode::separate}, .given_routing = true, .seed = 31};
        const LayerResult r = run_case(c, false);
        EXPECT_LE(r.rel_l2, 3e-3) << c.describe();
        EXPECT_EQ(r.counters[0].shared_separate, 1) << c.describe();
      }
    }
  }
}

// DP chunking: chunk 4 over T = {10, 0, 3, 9} -> ceil(10/4) = 3 chunks on every rank; rank 1 idles
// in all three, rank 2 in the last two. Every backend, the replica's gate (fused) for every layer.
TEST(ModularMoE, ChunkingWithUnevenAndZeroTokenRanks) {
  const std::vector<int64_t> tokens = {10, 0, 3, 9};
  const std::vector<int64_t> idle = {0, 3, 2, 0};
  for (const std::string& p : {std::string("qwen1.5-moe-a2.7b-mini"), std::string("deepseek-v3-mini")}) {
    for (const std::string& b : backend_names()) {
      for (DType d : {DType::bf16, DType::fp8_e4m3}) {
        LayerCase c{.preset = p, .backend = b, .tokens = tokens, .dispatch_dtype = d,
                    .options = {.chunk_size = 4, .fhmoe_max_tokens = Config{}.fhmoe_max_tokens}, .capacity = 4, .seed = 5};
        const LayerResult r = run_case(c, true);
        EXPECT_LE(r.rel_l2, kTol) << c.describe();
        for (int rank = 0; rank < 4; ++rank) {
          EXPECT_EQ(r.counters[rank].chunks, 3) << c.describe();
          EXPECT_EQ(r.counters[rank].idle_chunks, idle[rank]) << c.describe() << " rank " << rank;
          EXPECT_EQ(r.counters[rank].shared_fused, 3) << c.describe();
        }
      }
    }
  }
}

// All ranks idle: one chunk of zero rows each, still collective, nothing written.
TEST(ModularMoE, AllRanksIdle) {
  for (const std::string& b : backend_names()) {
    LayerCase c{.preset = "qwen1.5-moe-a2.7b-mini", .backend = b, .tokens = {0, 0}};
    const LayerResult r = run_case(c, true);
    EXPECT_EQ(r.rel_l2, 0.0) << c.describe();
    EXPECT_EQ(r.counters[1].chunks, 1);
    EXPECT_EQ(r.counters[1].idle_chunks, 1);
  }
}

// Fewer experts than ranks: ranks without experts still dispatch their tokens and take part.
TEST(ModularMoE, RanksWithoutExperts) {
  for (const std::string& b : backend_names()) {
    LayerCase c{.preset = "mixtral-2-experts", .backend = b, .tokens = {4, 7, 0, 5}, .seed = 3};
    EXPECT_LE(run_case(c, true).rel_l2, kTol) << c.describe();
  }
}

// The capability gate: M = max over ranks of a chunk's tokens. chunk 4, T = {10, 0, 3, 9} gives
// M = 4, 4, 2; with fhmoe_max_tokens = 3 the first two chunks run the shared expert separately and
// the last fused, on every rank alike (also the idle one). Explicit modes ignore the gate.
TEST(ModularMoE, SharedExpertFusedSeparateAndGated) {
  const std::vector<int64_t> tokens = {10, 0, 3, 9};
  struct ModeCase {
    ModularMoEOptions options{};
    int64_t fused, separate;
  };
  const std::vector<ModeCase> modes = {
      {{.shared_mode = SharedExpertMode::auto_gate, .chunk_size = 4, .fhmoe_max_tokens = 3}, 1, 2},
      {{.shared_mode = SharedExpertMode::auto_gate, .chunk_size = 4, .fhmoe_max_tokens = 4}, 3, 0},
      {{.shared_mode = SharedExpertMode::auto_gate, .chunk_size = 4, .fhmoe_max_tokens = 0}, 0, 3},
      {{.shared_mode = SharedExpertMode::fused, .chunk_size = 4, .fhmoe_max_tokens = 0}, 3, 0},
      {{.shared_mode = SharedExpertMode::separate, .chunk_size = 4, .fhmoe_max_tokens = 1000}, 0, 3},
  };
  for (const std::string& p : {std::string("qwen1.5-moe-a2.7b-mini"), std::string("deepseek-v3-mini")}) {
    for (const std::string& b : {std::string("ll"), std::string("all2allv")}) {
      for (const ModeCase& m : modes) {
        LayerCase c{.preset = p, .backend = b, .tokens = tokens, .options = m.options, .capacity = 4, .seed = 9};
        const LayerResult r = run_case(c, true);  // bf16 dispatch: both paths see the same x
        EXPECT_LE(r.rel_l2, kTol) << c.describe();
        for (int rank = 0; rank < 4; ++rank) {
          EXPECT_EQ(r.counters[rank].shared_fused, m.fused) << c.describe() << " rank " << rank;
          EXPECT_EQ(r.counters[rank].shared_separate, m.separate) << c.describe() << " rank " << rank;
        }
      }
    }
  }
  // Without a shared expert neither counter moves.
  LayerCase c{.preset = "mixtral-8x7b-mini", .backend = "naive", .tokens = {3, 5}};
  const LayerResult r = run_case(c, true);
  EXPECT_EQ(r.counters[0].shared_fused + r.counters[0].shared_separate, 0);
}

TEST(ModularMoE, CapacityBelowChunkOrTokensIsAnErrorNamingBoth) {
  auto w = weights_for("mixtral-8x7b-mini");
  auto groups = make_cpu_groups(2, 10.0);
  // chunk 8 > capacity 4: rejected when the layer is built.
  try {
    run_ranks(groups, [&](int rank) {
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 4;
      ModularMoE layer(w, groups[rank], "ll", dc, Config{}, {.chunk_size = 8});
    });
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("num_max_dispatch_tokens_per_rank = 4"), std::string::npos) << m;
    EXPECT_NE(m.find("chunk_size = 8"), std::string::npos) << m;
  }
  // Unchunked, rank 1 brings 6 tokens > capacity 4: every rank throws before dispatching.
  groups = make_cpu_groups(2, 10.0);
  std::vector<int> threw(2, 0);
  try {
    run_ranks(groups, [&](int rank) {
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 4;
      ModularMoE layer(w, groups[rank], "all2allv", dc, Config{});
      Tensor x = test::random_bf16(rank == 1 ? 6 : 2, 256, 3), out = Tensor::empty({rank == 1 ? 6 : 2, 256}, DType::bf16);
      try {
        layer.forward(x, out);
      } catch (const InvalidArgument&) {
        threw[rank] = 1;
        throw;
      }
    });
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("= 6"), std::string::npos) << m;
    EXPECT_NE(m.find("num_max_dispatch_tokens_per_rank = 4"), std::string::npos) << m;
  }
  EXPECT_EQ(threw, (std::vector<int>{1, 1}));
}

TEST(ModularMoE, BadRoutingOnOneRankStopsEveryRank) {
  auto w = weights_for("mixtral-8x7b-mini");
  auto groups = make_cpu_groups(2, 10.0);
  std::vector<int> threw(2, 0);
  EXPECT_THROW(run_ranks(groups,
                         [&](int rank) {
                           DispatchConfig dc;
                           dc.num_max_dispatch_tokens_per_rank = 8;
                           ModularMoE layer(w, groups[rank], "naive", dc, Config{});
                           Tensor x = test::random_bf16(3, 256, 3), out = Tensor::empty({3, 256}, DType::bf16);
                           Tensor idx = Tensor::zeros({3, 2}, DType::int64), wts = Tensor::zeros({3, 2}, DType::fp32);
                           if (rank == 0) idx.ptr<int64_t>()[5] = 8;  // E = 8
                           try {
                             layer.forward_routed(x, idx, wts, out);
                           } catch (const InvalidArgument&) {
                             threw[rank] = 1;
                             throw;
                           }
                         }),
               InvalidArgument);
  EXPECT_EQ(threw, (std::vector<int>{1, 1}));
}

// int64 ids past int32 are checked as themselves (the CUDA path narrowed them to int32 before its
// check: 2^32 + 3 ran as expert 3; moe_cuda_test Int64TopkIdxIsNeverNarrowed). The CPU path reads the
// int64 value before its int32 copy; this keeps it so: rank 0's 2^32 + 3 and rank 1's -2^32 - 1 are named
// on their own rank, and the other rank stops too.
TEST(ModularMoE, Int64TopkIdxPastInt32IsRejectedAsItselfOnEveryRank) {
  auto w = weights_for("mixtral-8x7b-mini");
  auto groups = make_cpu_groups(2, 10.0);
  std::vector<std::string> errs(2);
  run_ranks(groups, [&](int rank) {
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = 8;
    ModularMoE layer(w, groups[rank], "all2allv", dc, Config{});
    Tensor x = test::random_bf16(3, 256, 3), out = Tensor::empty({3, 256}, DType::bf16);
    Tensor idx = Tensor::zeros({3, 2}, DType::int64), wts = Tensor::zeros({3, 2}, DType::fp32);
    idx.ptr<int64_t>()[rank == 0 ? 2 : 5] = rank == 0 ? (int64_t{1} << 32) + 3 : -(int64_t{1} << 32) - 1;
    try {
      layer.forward_routed(x, idx, wts, out);
    } catch (const InvalidArgument& e) {
      errs[rank] = e.what();
    }
  });
  EXPECT_NE(errs[0].find("topk_idx[1, 0] = 4294967299: must be -1 (no selection) or an expert id in [0, num_experts = 8)"),
            std::string::npos) << errs[0];
  EXPECT_NE(errs[1].find("topk_idx[2, 1] = -4294967297"), std::string::npos) << errs[1];
}

TEST(ModularMoE, HeterogeneousRoutesHandedInAreRejectedOnEveryRankAndTheLayerStaysUsable) {
  // FHMoE (issue 6): the layer appends the shared route (column K = E) itself, so forward_routed
  // takes the K routed columns only. Routes that already carry the shared column (K+1 columns) or
  // name the shared id E in a routed column are refused on every rank, naming the argument, the
  // value and the rule; the same layer then runs a good call (fused, counted) to the reference.
  const std::string p = "deepseek-v4-pro-mini";  // MXFP4 routed + FP8 shared expert
  auto w = weights_for(p);
  const int E = w->config.router.num_experts, K = w->config.router.top_k;
  const int64_t H = w->config.hidden, T = 3;
  for (const int fault : {0, 1}) {
    auto groups = make_cpu_groups(2, 10.0);
    std::vector<std::string> errs(2);
    std::vector<PathCounters> counters(2);
    std::vector<double> rel(2, 1.0);
    run_ranks(groups, [&](int rank) {
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 8;
      ModularMoE layer(w, groups[rank], "ll", dc, Config{}, {.shared_mode = SharedExpertMode::fused});
      Tensor x = test::random_bf16(T, H, 40 + rank), out = Tensor::empty({T, H}, DType::bf16);
      Tensor idx, wts;
      test::random_routing(T, K, E, 60 + rank, {}, idx, wts);
      const int cols = rank == 1 && fault == 0 ? K + 1 : K;
      Tensor bad_idx = Tensor::empty({T, cols}, DType::int32), bad_wts = Tensor::empty({T, cols}, DType::fp32);
      for (int64_t t = 0; t < T; ++t)
        for (int k = 0; k < cols; ++k) {
          bad_idx.ptr<int32_t>()[t * cols + k] = k < K ? idx.ptr<int32_t>()[t * K + k] : E;  // the shared route appended
          bad_wts.ptr<float>()[t * cols + k] = k < K ? wts.ptr<float>()[t * K + k] : 1.0f;
        }
      if (rank == 1 && fault == 1) bad_idx.ptr<int32_t>()[1 * cols + 0] = E;  // the shared id in a routed column
      try {
        layer.forward_routed(x, bad_idx, bad_wts, out);
      } catch (const InvalidArgument& e) {
        errs[rank] = e.what();
      }
      test::poison(out);
      layer.forward_routed(x, idx, wts, out);  // the layer is still usable
      counters[rank] = layer.counters();
      Tensor want = Tensor::empty({T, H}, DType::bf16);
      moe_reference_cpu(*w, x, idx, wts, want, {.shared_fused = true});
      rel[rank] = test::rel_l2_error(out, want);
    });
    for (int rank = 0; rank < 2; ++rank) {
      const std::string& m = errs[rank];
      if (rank == 1 && fault == 0) {
        EXPECT_NE(m.find("topk_idx.shape[1] = " + std::to_string(K + 1)), std::string::npos) << m;
        EXPECT_NE(m.find("must equal top_k = " + std::to_string(K) + ": the routed columns only (the shared route, id num_experts = " +
                         std::to_string(E) + ", is appended here as column " + std::to_string(K) + ")"),
                  std::string::npos)
            << m;
      } else if (rank == 1) {
        // The dispatch's sentence (core/topk_message.h): one format for topk_idx[t, k] everywhere.
        EXPECT_NE(m.find("topk_idx[1, 0] = " + std::to_string(E) + ": must be -1 (no selection) or an expert id in [0, num_experts = " +
                         std::to_string(E) + ")"),
                  std::string::npos)
            << m;
      } else {
        EXPECT_NE(m.find("rank 1 rejected its arguments"), std::string::npos) << m;
      }
      EXPECT_EQ(counters[rank].calls, 1) << "the refused call ran no chunk";
      EXPECT_EQ(counters[rank].shared_fused, 1);
      EXPECT_LE(rel[rank], kTol) << "fault " << fault << " rank " << rank;
    }
  }
}

TEST(ModularMoE, BadOrDisagreeingOptionsNameTheirValues) {
  auto w = weights_for("mixtral-8x7b-mini");
  DispatchConfig dc;
  dc.num_max_dispatch_tokens_per_rank = 8;
  // fhmoe_max_tokens: -1 = Config::fhmoe_max_tokens, >= 0 a bound; anything else is a mistake.
  auto groups = make_cpu_groups(1, 10.0);
  try {
    ModularMoE layer(w, groups[0], "ll", dc, Config{}, {.fhmoe_max_tokens = -7});
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("options.fhmoe_max_tokens = -7: must be"), std::string::npos) << e.what();
  }
  // Ranks disagreeing on the shared expert's mode hear the modes' names, not enum indices.
  groups = make_cpu_groups(2, 10.0);
  std::vector<std::string> what(2);
  run_ranks(groups, [&](int rank) {
    try {
      ModularMoE layer(w, groups[rank], "ll", dc, Config{},
                       {.shared_mode = rank ? SharedExpertMode::separate : SharedExpertMode::fused});
    } catch (const CommError& e) {
      what[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(what[r].find("shared_mode = fused on rank 0 but separate on rank 1: all ranks must agree"), std::string::npos) << what[r];
}

TEST(ModularMoE, OutOfRuleConfigStructIsRefusedOnEveryRank) {
  // The layer's Config reaches the backend's and the experts' launch settings: one built in C++ with a
  // field outside its rule (validate()'s) is refused with that rule on every rank, also when only rank 1's
  // is bad, instead of running a mode nobody asked for.
  auto w = weights_for("mixtral-8x7b-mini");
  DispatchConfig dc;
  dc.num_max_dispatch_tokens_per_rank = 8;
  for (const bool only_rank1 : {false, true}) {
    auto groups = make_cpu_groups(2, 10.0);
    std::vector<std::string> what(2);
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(groups, [&](int rank) {
      Config bad;
      if (!only_rank1 || rank == 1) bad.experts_fp8_prefill = 5;  // not 0 or 1
      try {
        ModularMoE layer(w, groups[rank], "all2allv", dc, bad);
      } catch (const InvalidArgument& e) {
        what[rank] = e.what();
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "a rank waited for a timeout";
    for (int r = 0; r < 2; ++r) {
      if (!only_rank1 || r == 1)
        EXPECT_NE(what[r].find("config: experts.fp8_prefill = 5: must be 0 or 1"), std::string::npos) << what[r];
      else
        EXPECT_NE(what[r].find("rank 1"), std::string::npos) << what[r];
    }
  }
}

TEST(ModularMoE, NullTensorDataIsAnErrorNotACrash) {
  // x / out / topk_* views with a null data pointer and a non-empty shape: InvalidArgument naming the
  // argument on the CPU path, before any rank reads them (this segfaulted in forward's routing / copies).
  auto w = weights_for("mixtral-8x7b-mini");
  DispatchConfig dc;
  dc.num_max_dispatch_tokens_per_rank = 8;
  auto groups = make_cpu_groups(1, 10.0);
  ModularMoE layer(w, groups[0], "ll", dc, Config{});
  const int64_t T = 4, H = w->config.hidden, K = w->config.router.top_k;
  Tensor x = test::random_bf16(T, H, 3), out = Tensor::empty({T, H}, DType::bf16);
  Tensor idx = Tensor::zeros({T, K}, DType::int32), wt = Tensor::zeros({T, K}, DType::fp32);
  const TensorView null_x(nullptr, DType::bf16, {T, H}), null_out(nullptr, DType::bf16, {T, H});
  const TensorView null_idx(nullptr, DType::int32, {T, K}), null_w(nullptr, DType::fp32, {T, K});
  EXPECT_NE(test::invalid_argument_message([&] { layer.forward(null_x, out); }).find("x.data = null"), std::string::npos);
  EXPECT_NE(test::invalid_argument_message([&] { layer.forward(x, null_out); }).find("out.data = null"), std::string::npos);
  EXPECT_NE(test::invalid_argument_message([&] { layer.forward_routed(x, null_idx, wt, out); }).find("topk_idx.data = null"), std::string::npos);
  EXPECT_NE(test::invalid_argument_message([&] { layer.forward_routed(x, idx, null_w, out); }).find("topk_weights.data = null"), std::string::npos);
  // The layer is still usable.
  layer.forward(x, out);
}

TEST(ModularMoE, OneRanksBadArgumentsStopEveryRankAtConstruction) {
  // The constructor checks each rank's own arguments (its experts built, the shared expert, options, capacity)
  // before the backend's collective creation. A failure on one rank threw there alone and its peers waited in
  // make_prepare_finalize until timeout_s (then a Timeout naming no cause). Now every rank throws at once.
  const MoEConfig cfg = preset("deepseek-v3-mini");
  auto all = weights_for("deepseek-v3-mini");
  auto first_half = MoEWeights::random(cfg, 1, 0, 100);  // rank 1 of 2 holds experts [128, 256)
  auto no_shared = std::make_shared<MoEWeights>(*all);
  no_shared->shared = nullptr;
  const std::vector<std::pair<int, std::string>> faults = {
      {0, "weights.experts[128] = null: must be built: rank 1 holds experts [128, 256)"},
      {1, "weights.shared = null: must be set"},
      {2, "options.chunk_size = -3: must be >= 0"},
      {3, "dispatch_cfg.num_max_dispatch_tokens_per_rank = -1: must be >= 0"},
      {4, "weights = null: must be set"}};
  for (const auto& [fault, text] : faults) {
    auto groups = make_cpu_groups(2, 10.0);
    std::vector<std::string> what(2);
    const auto t0 = std::chrono::steady_clock::now();
    run_ranks(groups, [&, fault = fault](int rank) {
      std::shared_ptr<const MoEWeights> w = all;
      ModularMoEOptions o;
      DispatchConfig dc;
      dc.num_max_dispatch_tokens_per_rank = 8;
      if (rank == 1) {
        if (fault == 0) w = first_half;
        if (fault == 1) w = no_shared;
        if (fault == 2) o.chunk_size = -3;
        if (fault == 3) dc.num_max_dispatch_tokens_per_rank = -1;
        if (fault == 4) w = nullptr;
      }
      try {
        ModularMoE layer(w, groups[rank], "all2allv", dc, Config{}, o);
      } catch (const Error& e) {
        what[rank] = e.what();
      }
    });
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "fault " << fault << ": a rank waited for timeout_s";
    EXPECT_NE(what[1].find(text), std::string::npos) << "fault " << fault << ": " << what[1];
    EXPECT_NE(what[0].find("rank 1 rejected its arguments"), std::string::npos) << "fault " << fault << ": " << what[0];
  }
}

TEST(ModularMoE, UnknownPresetOrBackendListsTheKnownNames) {
  try {
    preset("deepseek-v9");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    for (const std::string& n : preset_names()) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
  auto w = weights_for("mixtral-8x7b-mini");
  auto groups = make_cpu_groups(1, 10.0);
  try {
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = 8;
    ModularMoE layer(w, groups[0], "nccl-magic", dc, Config{});
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    for (const std::string& n : backend_names()) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

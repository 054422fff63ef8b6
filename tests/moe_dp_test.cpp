// ModularMoE composition and data-parallel handling over R CPU ranks: any backend with any experts
// implementation that takes its activation layout (incompatible pairs rejected on every rank with
// one sentence), the DP metadata of a call, the DP-sharded shared expert on the gathering backends
// (naive, allgather_reducescatter) against moe_reference_cpu with idle ranks, chunks, fp8 and a
// shared gate, the intermediate slicing it rests on, and the whole-layer graph's refusal on a CPU
// group. Outputs are poisoned first; inputs are fresh random values.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/moe.h"
#include "test_util.h"

using namespace epx;

namespace {

// Presets and variants, built once per process. "deepseek-v3-mini-wide-shared": the mini with a
// 256-wide fp8_block shared expert (two 128-blocks), so R = 2 shards it one block each, as the
// full-size DeepSeek-V3 (2048 = 16 blocks) is sharded.
std::shared_ptr<const MoEWeights> weights_for(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<const MoEWeights>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& w = cache[name];
  if (!w && name == "deepseek-v3-mini-wide-shared") {
    MoEConfig c = preset("deepseek-v3-mini");
    c.name = name;
    c.shared_intermediate = 256;
    w = MoEWeights::random(c, 99);
  }
  if (!w) w = MoEWeights::random(preset(name), 2025);
  return w;
}

/// Experts that take only `layout` (delegating to make_experts_cpu), counting their construction.
class OneLayoutExperts final : public Experts {
 public:
  OneLayoutExperts(std::unique_ptr<Experts> inner, ActivationLayout layout) : inner_(std::move(inner)), layout_(layout) {}
  int num_local_experts() const override { return inner_->num_local_experts(); }
  int64_t hidden() const override { return inner_->hidden(); }
  bool supports(ActivationLayout l) const override { return l == layout_; }
  void apply(const ExpertsInput& in, const TensorView& out, Stream stream) override {
    ASSERT_EQ(in.layout, layout_);
    inner_->apply(in, out, stream);
  }

 private:
  std::unique_ptr<Experts> inner_;
  ActivationLayout layout_;
};

ExpertsFactory only(ActivationLayout layout, std::atomic<int>* built) {
  return [layout, built](std::vector<std::shared_ptr<const ExpertWeights>> local, Device) -> std::unique_ptr<Experts> {
    ++*built;
    return std::make_unique<OneLayoutExperts>(make_experts_cpu(std::move(local)), layout);
  };
}

struct Case {
  std::string preset;
  std::string backend;
  std::vector<int64_t> tokens;  // T per rank
  DType dispatch_dtype = DType::bf16;
  ModularMoEOptions options{};
  int capacity = 64;
  uint64_t seed = 1;
  Config config{};
  std::string describe() const {
    std::string t;
    for (int64_t v : tokens) t += (t.empty() ? "" : ",") + std::to_string(v);
    return preset + " backend=" + backend + " T={" + t + "} dispatch=" + std::string(dtype_name(dispatch_dtype)) +
           " chunk=" + std::to_string(options.chunk_size) + " shared_mode=" + std::to_string(static_cast<int>(options.shared_mode)) +
           " shard=" + std::to_string(options.shard_shared_expert);
  }
};

struct Outcome {
  double rel_l2 = 0;
  std::vector<PathCounters> counters;
  std::vector<DPMetadata> dp;
  std::vector<int> sharded;
  std::vector<PhaseTimes> phases;
  std::vector<int64_t> gate;  // ModularMoE::fhmoe_max_tokens()
  std::vector<int> local_slot;
};

// Runs forward_routed with random routing (-1 and duplicate experts included) on R rank threads and
// compares the concatenated outputs with moe_reference_cpu (shared expert input as on the fused
// path: the dispatched x).
Outcome run_case(const Case& c) {
  auto w = weights_for(c.preset);
  const MoEConfig& cfg = w->config;
  const int R = static_cast<int>(c.tokens.size()), K = cfg.router.top_k;
  const int64_t H = cfg.hidden;
  std::vector<Tensor> x(R), idx(R), wts(R), out(R);
  for (int r = 0; r < R; ++r) {
    x[r] = test::random_bf16(c.tokens[r], H, c.seed * 131 + r);
    out[r] = Tensor::empty({c.tokens[r], H}, DType::bf16);
    test::poison(out[r]);
    test::random_routing(c.tokens[r], K, cfg.router.num_experts, c.seed * 131 + 60 + r,
                         {.masked_fraction = 0.1, .allow_duplicates = true}, idx[r], wts[r]);
  }
  Outcome res;
  res.counters.resize(R);
  res.dp.resize(R);
  res.sharded.resize(R);
  res.phases.resize(R);
  res.gate.resize(R);
  res.local_slot.resize(R);
  auto groups = make_cpu_groups(R, 30.0);
  run_ranks(groups, [&](int rank) {
    DispatchConfig dc;
    dc.num_max_dispatch_tokens_per_rank = c.capacity;
    dc.dispatch_dtype = c.dispatch_dtype;
    ModularMoE layer(w, groups[rank], c.backend, dc, c.config, c.options);
    layer.forward_routed(x[rank], idx[rank], wts[rank], out[rank]);
    res.counters[rank] = layer.counters();
    res.dp[rank] = layer.dp_metadata();
    res.sharded[rank] = layer.shared_expert_sharded();
    res.phases[rank] = layer.last_phase_times();
    res.gate[rank] = layer.fhmoe_max_tokens();
    res.local_slot[rank] = static_cast<int>(layer.shared_local_slot_tokens());
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
  moe_reference_cpu(*w, x_all, idx_all, wts_all, want, {.dispatch_dtype = c.dispatch_dtype, .shared_fused = true});
  res.rel_l2 = test::rel_l2_error(out_all, want);
  return res;
}

constexpr double kTol = 1e-2;

}  // namespace

// ---- composition ----

TEST(ModularMoECompose, AnyBackendWithExpertsThatTakeItsLayout) {
  for (const std::string& b : backend_names()) {
    std::atomic<int> built{0};
    // ll is ExpertMajor; every other backend Flat.
    const ActivationLayout layout = b == "ll" ? ActivationLayout::ExpertMajor : ActivationLayout::Flat;
    Case c{.preset = "deepseek-v4-pro-mini", .backend = b, .tokens = {6, 0, 9}, .seed = 4};
    c.options.make_experts = only(layout, &built);
    const Outcome r = run_case(c);
    EXPECT_LE(r.rel_l2, kTol) << c.describe();
    EXPECT_EQ(built.load(), 3) << c.describe();  // the factory built every rank's experts
  }
}

TEST(ModularMoECompose, IncompatiblePairIsRejectedOnEveryRankWithOneSentence) {
  auto w = weights_for("qwen3-30b-a3b-mini");
  for (const std::string& b : backend_names()) {
    const bool expert_major = b == "ll";
    // Experts that take the other layout.
    const ActivationLayout wrong = expert_major ? ActivationLayout::Flat : ActivationLayout::ExpertMajor;
    std::atomic<int> built{0};
    auto groups = make_cpu_groups(2, 10.0);
    std::vector<std::string> messages(2);
    EXPECT_THROW(run_ranks(groups,
                           [&](int rank) {
                             DispatchConfig dc;
                             dc.num_max_dispatch_tokens_per_rank = 8;
                             ModularMoEOptions o;
                             o.make_experts = only(wrong, &built);
                             try {
                               ModularMoE layer(w, groups[rank], b, dc, Config{}, o);
                             } catch (const Unsupported& e) {
                               messages[rank] = e.what();
                               throw;
                             }
                           }),
                 Unsupported)
        << b;
    for (int rank = 0; rank < 2; ++rank) {
      const std::string& m = messages[rank];
      EXPECT_NE(m.find("backend = " + b), std::string::npos) << m;
      EXPECT_NE(m.find(expert_major ? "expert_major" : "flat"), std::string::npos) << m;
      EXPECT_NE(m.find(expert_major ? "(flat)" : "(expert_major)"), std::string::npos) << m;
      EXPECT_EQ(m, messages[0]);  // the same sentence on every rank
    }
  }
}

// A factory whose Experts do not fit the slots it was handed (one expert short, another hidden), that returns
// null, or that throws, on rank 1 only: rank 1 threw alone (or only at its first forward) while rank 0 waited in
// the next collective until timeout_s; one expert short even ran silently while no token reached the missing slot.
// Now every rank throws at construction: rank 1 its own error, the others InvalidArgument naming rank 1.
TEST(ModularMoECompose, FactoryExpertsThatDoNotFitTheSlotsStopEveryRankAtConstruction) {
  auto w = weights_for("mixtral-8x7b-mini");
  const std::vector<std::pair<std::string, std::string>> faults = {
      {"short", "num_local_experts = 3: must equal the 4 local experts"},
      {"hidden", "hidden = 128: must equal the model's hidden = 256"},
      {"null", "a null Experts: must return an Experts object"},
      {"throws", "factory failed on purpose"}};
  for (const std::string b : {"ll", "all2allv"}) {
    for (const auto& [fault, text] : faults) {
      auto groups = make_cpu_groups(2, 10.0);
      std::vector<std::string> what(2);
      const auto t0 = std::chrono::steady_clock::now();
      run_ranks(groups, [&, fault = fault](int rank) {
        ModularMoEOptions o;
        o.make_experts = [&](std::vector<std::shared_ptr<const ExpertWeights>> local, Device) -> std::unique_ptr<Experts> {
          if (rank == 1) {
            if (fault == "short") local.pop_back();
            if (fault == "hidden") local.assign(local.size(), ExpertWeights::random(WeightFormat::bf16, 128, 128, 3));
            if (fault == "null") return nullptr;
            if (fault == "throws") throw InvalidArgument("factory failed on purpose");
          }
          return make_experts_cpu(std::move(local));
        };
        DispatchConfig dc;
        dc.num_max_dispatch_tokens_per_rank = 4;
        try {
          ModularMoE layer(w, groups[rank], b, dc, Config{}, o);
        } catch (const InvalidArgument& e) {
          what[rank] = e.what();
        }
      });
      EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << b << " " << fault << ": a rank waited for timeout_s";
      EXPECT_NE(what[1].find(text), std::string::npos) << b << " " << fault << ": " << what[1];
      EXPECT_NE(what[0].find("rank 1"), std::string::npos) << b << " " << fault << ": " << what[0];
    }
  }
}

// ---- DP metadata ----

TEST(DPMetadata, CountsMaxCumulativeAndChunks) {
  const DPMetadata d = DPMetadata::from_tokens({10, 0, 3, 9}, 4);
  EXPECT_EQ(d.cumulative, (std::vector<int64_t>{0, 10, 10, 13, 22}));
  EXPECT_EQ(d.max_tokens, 10);
  EXPECT_EQ(d.num_chunks, 3);
  EXPECT_EQ(d.chunk_counts(0), (std::vector<int64_t>{4, 0, 3, 4}));
  EXPECT_EQ(d.chunk_counts(2), (std::vector<int64_t>{2, 0, 0, 1}));
  EXPECT_EQ(d.chunk_max(2), 2);
  const DPMetadata u = DPMetadata::from_tokens({5, 7}, 0);  // unchunked: one chunk of max T
  EXPECT_EQ(u.chunk_size, 7);
  EXPECT_EQ(u.num_chunks, 1);
  const DPMetadata idle = DPMetadata::from_tokens({0, 0}, 0);  // all idle: still one chunk (collectives meet)
  EXPECT_EQ(idle.num_chunks, 1);
  EXPECT_EQ(idle.chunk_max(0), 0);
}

// Carried-over defect (c): max_tokens + chunk_size - 1 overflowed int64 near INT64_MAX (num_chunks
// came out 1 instead of 2^62), and the cumulative sums wrapped silently.
TEST(DPMetadata, ChunkPlanNearInt64MaxHasNoOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const DPMetadata d = DPMetadata::from_tokens({kMax, 0}, 2);
  EXPECT_EQ(d.max_tokens, kMax);
  EXPECT_EQ(d.num_chunks, int64_t{1} << 62);  // ceil((2^63 - 1) / 2)
  EXPECT_EQ(d.chunk_tokens(d.num_chunks - 1, 0), 1);
  EXPECT_EQ(d.chunk_tokens(d.num_chunks - 1, 1), 0);
  EXPECT_EQ(d.chunk_tokens(0, 0), 2);
  const DPMetadata big_chunk = DPMetadata::from_tokens({kMax - 11, 10}, kMax);  // max_tokens + chunk_size - 1 overflowed
  EXPECT_EQ(big_chunk.num_chunks, 1);
  EXPECT_EQ(big_chunk.chunk_tokens(0, 0), kMax - 11);
  EXPECT_EQ(big_chunk.chunk_tokens(0, 1), 10);
  const DPMetadata unchunked = DPMetadata::from_tokens({kMax, 0}, 0);
  EXPECT_EQ(unchunked.chunk_size, kMax);
  EXPECT_EQ(unchunked.num_chunks, 1);
  EXPECT_EQ(unchunked.cumulative, (std::vector<int64_t>{0, kMax, kMax}));
}

TEST(DPMetadata, BadTokensOrChunkNameTheArgumentValueAndRule) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const auto message = [](auto&& fn) { return test::invalid_argument_message(fn); };
  std::string m = message([&] { DPMetadata::from_tokens({kMax - 5, 3, 4}, 0); });  // the sum passes INT64_MAX at rank 2
  EXPECT_NE(m.find("tokens_per_rank[2] = 4"), std::string::npos) << m;
  EXPECT_NE(m.find("INT64_MAX"), std::string::npos) << m;
  m = message([&] { DPMetadata::from_tokens({5, -1}, 4); });
  EXPECT_NE(m.find("tokens_per_rank[1] = -1: must be >= 0"), std::string::npos) << m;
  m = message([&] { DPMetadata::from_tokens({5, 1}, -4); });
  EXPECT_NE(m.find("chunk_size = -4: must be >= 0"), std::string::npos) << m;
  const DPMetadata d = DPMetadata::from_tokens({10, 3}, 4);
  m = message([&] { d.chunk_tokens(kMax, 0); });  // chunk * chunk_size would overflow
  EXPECT_NE(m.find("chunk = 9223372036854775807: must be in [0, num_chunks = 3)"), std::string::npos) << m;
  m = message([&] { d.chunk_tokens(0, 2); });
  EXPECT_NE(m.find("rank = 2: must be in [0, R = 2)"), std::string::npos) << m;
}

TEST(DPMetadata, OneCallGathersItOnceAndEveryRankSeesTheSame) {
  Case c{.preset = "qwen1.5-moe-a2.7b-mini", .backend = "all2allv", .tokens = {10, 0, 3, 9}, .capacity = 4, .seed = 8};
  c.options.chunk_size = 4;
  const Outcome r = run_case(c);
  EXPECT_LE(r.rel_l2, kTol);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(r.dp[rank].tokens_per_rank, c.tokens);
    EXPECT_EQ(r.dp[rank].cumulative, (std::vector<int64_t>{0, 10, 10, 13, 22}));
    EXPECT_EQ(r.dp[rank].num_chunks, 3);
    EXPECT_EQ(r.counters[rank].chunks, 3);
  }
}

// Phase timing: one set of marks per chunk, idle ranks and chunks included; off by default.
TEST(ModularMoEPhases, OnePerChunkAndOnlyWhenAsked) {
  Case c{.preset = "qwen1.5-moe-a2.7b-mini", .backend = "all2allv", .tokens = {10, 0, 3}, .capacity = 4, .seed = 9};
  c.options.chunk_size = 4;
  c.options.time_phases = true;
  c.options.shared_mode = SharedExpertMode::separate;
  const Outcome r = run_case(c);
  EXPECT_LE(r.rel_l2, kTol);
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const PhaseTimes& p = r.phases[rank];
    EXPECT_EQ(p.chunks, 3);
    EXPECT_GE(p.prepare_us, 0.0);
    EXPECT_GE(p.finalize_us, 0.0);
    EXPECT_GT(p.experts_us, 0.0);  // every rank holds experts and runs them on what it receives
    EXPECT_GE(p.shared_us, 0.0);
    if (c.tokens[rank] > 0) {
      EXPECT_GT(p.shared_us, 0.0);
    }
  }
  c.options.time_phases = false;
  const Outcome off = run_case(c);
  for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(off.phases[rank].chunks, 0);
}

// ---- the DP-sharded shared expert ----

// Gathering backends shard when R > 1 and every rank gets a block; the output is the reference's,
// so each shard is counted once (R copies of the shared expert would be far off), on idle ranks
// too, chunked and unchunked, bf16 and fp8 wires, with and without a shared gate.
TEST(ModularMoESharedShard, GatheringBackendsMatchTheReference) {
  struct Shape {
    std::string preset;
    std::vector<int64_t> tokens;
  };
  const std::vector<Shape> shapes = {
      {"qwen1.5-moe-a2.7b-mini", {5, 0, 3, 7}},         // bf16 shared 256 wide, gated: 4 shards of 64
      {"qwen1.5-moe-a2.7b-mini", {6, 11}},               // 2 shards of 128
      {"deepseek-v3-mini-wide-shared", {7, 0}},          // fp8_block 256: 2 shards of one 128-block
  };
  for (const Shape& s : shapes) {
    for (const std::string b : {"allgather_reducescatter", "naive"}) {
      for (DType d : {DType::bf16, DType::fp8_e4m3}) {
        for (int chunk : {0, 4}) {
          Case c{.preset = s.preset, .backend = b, .tokens = s.tokens, .dispatch_dtype = d, .capacity = chunk ? 4 : 64, .seed = 21};
          c.options.shared_mode = SharedExpertMode::fused;
          c.options.chunk_size = chunk;
          const Outcome r = run_case(c);
          EXPECT_LE(r.rel_l2, kTol) << c.describe();
          for (size_t rank = 0; rank < s.tokens.size(); ++rank) {
            EXPECT_EQ(r.sharded[rank], 1) << c.describe();
            EXPECT_EQ(r.counters[rank].shared_sharded, r.counters[rank].chunks) << c.describe();
            EXPECT_EQ(r.counters[rank].shared_fused, r.counters[rank].chunks) << c.describe();
          }
        }
      }
    }
  }
}

// Not sharded: R = 1, a backend that does not gather every token, fewer blocks than ranks, or the
// option off. Separate chunks never use the shard.
TEST(ModularMoESharedShard, OnlyWhenDpAboveOneOnGatheringBackends) {
  struct NoShard {
    std::string preset, backend;
    std::vector<int64_t> tokens;
    bool option;
  };
  const std::vector<NoShard> cases = {
      {"qwen1.5-moe-a2.7b-mini", "allgather_reducescatter", {9}, true},     // R = 1
      {"qwen1.5-moe-a2.7b-mini", "all2allv", {4, 6}, true},                 // not gathering
      {"qwen1.5-moe-a2.7b-mini", "ll", {4, 6}, true},
      {"deepseek-v3-mini", "allgather_reducescatter", {4, 6}, true},        // 128 fp8: one block < R = 2
      {"qwen1.5-moe-a2.7b-mini", "allgather_reducescatter", {4, 6}, false}, // option off
  };
  for (const NoShard& n : cases) {
    Case c{.preset = n.preset, .backend = n.backend, .tokens = n.tokens, .seed = 5};
    c.options.shared_mode = SharedExpertMode::fused;
    c.options.shard_shared_expert = n.option;
    const Outcome r = run_case(c);
    EXPECT_LE(r.rel_l2, kTol) << c.describe();
    EXPECT_EQ(r.sharded[0], 0) << c.describe();
    EXPECT_EQ(r.counters[0].shared_sharded, 0) << c.describe();
    EXPECT_EQ(r.counters[0].shared_fused, 1) << c.describe();
    EXPECT_EQ(r.gate[0], Config{}.fhmoe_max_tokens) << c.describe();  // not sharded: the replica's gate
    EXPECT_EQ(r.local_slot[0], -1) << c.describe();                    // CPU: always through the dispatch
  }
  // Sharding-capable layer, separate chunks (auto gate, fhmoe_max_tokens 0): whole expert, locally.
  Case c{.preset = "qwen1.5-moe-a2.7b-mini", .backend = "allgather_reducescatter", .tokens = {4, 6}, .seed = 6};
  c.options.fhmoe_max_tokens = 0;
  const Outcome r = run_case(c);
  EXPECT_LE(r.rel_l2, kTol);
  EXPECT_EQ(r.sharded[0], 1);
  EXPECT_EQ(r.counters[0].shared_separate, 1);
  EXPECT_EQ(r.counters[0].shared_sharded, 0);
  EXPECT_EQ(r.gate[0], 0);  // the option overrides both gates
  // Default gate of a sharded layer: Config::fhmoe_max_tokens_sharded = 0 (bench/NOTES.md, the sharded gate sweep):
  // M = 6 > 0, so the chunk runs the shared expert separately, whole, not sharded.
  Case d{.preset = "qwen1.5-moe-a2.7b-mini", .backend = "allgather_reducescatter", .tokens = {4, 6}, .seed = 7};
  const Outcome q = run_case(d);
  EXPECT_LE(q.rel_l2, kTol);
  EXPECT_EQ(Config{}.fhmoe_max_tokens_sharded, 0);
  EXPECT_EQ(q.gate[0], 0);
  EXPECT_EQ(q.gate[1], 0);
  EXPECT_EQ(q.counters[0].shared_separate, 1);
  EXPECT_EQ(q.counters[0].shared_fused, 0);
  EXPECT_EQ(q.counters[0].shared_sharded, 0);
}

// The slices of an expert's intermediate dimension sum to the expert (down is linear in h).
// The gate of heterogeneous FHMoE (shared format != routed format, V4-Pro: FP8 shared + MXFP4 routed) is
// Config::fhmoe_max_tokens_mixed; homogeneous layers (V3: FP8 both) keep Config::fhmoe_max_tokens; an explicit
// ModularMoEOptions::fhmoe_max_tokens overrides both. M = 6 (the larger rank's T) against a mixed gate of 5: the
// mixed layer runs the shared expert separately, the homogeneous one fuses it; both match the reference.
TEST(ModularMoEGate, MixedFormatsTakeTheirOwnGate) {
  EXPECT_EQ(Config{}.fhmoe_max_tokens_mixed, 1024);
  for (const char* backend : {"naive", "ll"}) {
    Case mixed{.preset = "deepseek-v4-pro-mini", .backend = backend, .tokens = {4, 6}, .seed = 21};
    mixed.config.fhmoe_max_tokens_mixed = 5;
    const Outcome a = run_case(mixed);
    EXPECT_LE(a.rel_l2, kTol) << mixed.describe();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(a.gate[r], 5) << mixed.describe();
      EXPECT_EQ(a.counters[r].shared_separate, 1) << mixed.describe();
      EXPECT_EQ(a.counters[r].shared_fused, 0) << mixed.describe();
    }
    Case same = mixed;
    same.preset = "deepseek-v3-mini";
    const Outcome b = run_case(same);
    EXPECT_LE(b.rel_l2, kTol) << same.describe();
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(b.gate[r], Config{}.fhmoe_max_tokens) << same.describe();
      EXPECT_EQ(b.counters[r].shared_fused, 1) << same.describe();
    }
    Case forced = mixed;
    forced.options.fhmoe_max_tokens = 6;  // the option wins over the mixed gate
    const Outcome c = run_case(forced);
    EXPECT_LE(c.rel_l2, kTol) << forced.describe();
    EXPECT_EQ(c.gate[0], 6) << forced.describe();
    EXPECT_EQ(c.counters[0].shared_fused, 1) << forced.describe();
  }
}

TEST(ExpertWeightsSlice, SlicesSumToTheExpertInEveryFormat) {
  for (WeightFormat f : {WeightFormat::bf16, WeightFormat::fp8_block, WeightFormat::mxfp4}) {
    const int64_t H = 256, I = 384, M = 5;
    auto w = ExpertWeights::random(f, H, I, 17);
    const int64_t g = intermediate_granularity(f);
    const std::vector<int64_t> cuts = {0, g == 128 ? 128 : 96, g == 128 ? 256 : 224, I};
    Tensor xb = test::random_bf16(M, H, 3);
    std::vector<float> x = test::to_float(xb), whole(M * H), sum(M * H, 0.0f), part(M * H);
    expert_mlp_cpu(*w, x.data(), M, whole.data());
    for (size_t s = 0; s + 1 < cuts.size(); ++s) {
      auto slice = w->slice_intermediate(cuts[s], cuts[s + 1]);
      EXPECT_EQ(slice->intermediate, cuts[s + 1] - cuts[s]);
      expert_mlp_cpu(*slice, x.data(), M, part.data());
      for (int64_t i = 0; i < M * H; ++i) sum[i] += part[i];
    }
    double num = 0, den = 0;
    for (int64_t i = 0; i < M * H; ++i) {
      num += (sum[i] - whole[i]) * (sum[i] - whole[i]);
      den += whole[i] * whole[i];
    }
    EXPECT_LE(std::sqrt(num / den), 1e-2) << weight_format_name(f);  // bf16 rounding of each part's y
    EXPECT_GT(den, 0.0);
  }
  auto w = ExpertWeights::random(WeightFormat::fp8_block, 256, 256, 1);
  try {
    w->slice_intermediate(64, 256);
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("begin = 64: must be a multiple of 128"), std::string::npos) << e.what();
  }
  EXPECT_THROW(w->slice_intermediate(0, 0), InvalidArgument);
  EXPECT_THROW(w->slice_intermediate(0, 384), InvalidArgument);
}

// ---- the whole-layer graph on a CPU group ----

TEST(ModularMoEGraph, CpuGroupSaysWhyAndCaptureThrowsUnsupported) {
  auto w = weights_for("mixtral-8x7b-mini");
  auto groups = make_cpu_groups(1, 10.0);
  DispatchConfig dc;
  dc.num_max_dispatch_tokens_per_rank = 8;
  ModularMoE layer(w, groups[0], "ll", dc, Config{});
  const auto why = layer.why_no_graph(8);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("CUDA graphs need a group on a GPU"), std::string::npos) << *why;
  Tensor x = test::random_bf16(8, 256, 1), out = Tensor::empty({8, 256}, DType::bf16), n = Tensor::zeros({1}, DType::int32);
  EXPECT_THROW(layer.capture_graph(x, TensorView(), TensorView(), out, n, Stream{}), Unsupported);
  EXPECT_FALSE(layer.has_graph());
  EXPECT_THROW(layer.replay_graph(Stream{}), InvalidArgument);
}

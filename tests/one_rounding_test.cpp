// One rounding on every backend (DispatchConfig::flat_combine partial_fp32, FinalizeArgs::addend):
// each rank's weighted partial crosses ranks in fp32 and the token's sum is rounded to bf16 once.
//
// Cancellation: two ranks whose experts give 1 and 2^-9 (rank 0) and -1 (rank 1) must return 2^-9;
// a bf16 partial (two roundings) rounds 1 + 2^-9 to 1 and returns 0, which the partial_bf16 runs
// show, so the checks can fail. Random data: every backend bit-equal to its per-rank-partial fp32
// oracle and within 1 ulp of the no-EP one-rounding reference for >= 99.9 % of elements.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/moe.h"

namespace epx::test {
namespace {

constexpr float kTiny = 1.0f / 512.0f;  // 2^-9: below half a bf16 ulp of 1

/// Expert e outputs the constant value[e] in every element (unweighted rows for ExpertMajor, the
/// weighted sum in column order for Flat, fp32 or bf16 out as given).
class ConstExperts final : public Experts {
 public:
  ConstExperts(std::vector<float> values, int64_t hidden) : values_(std::move(values)), hidden_(hidden) {}
  int num_local_experts() const override { return static_cast<int>(values_.size()); }
  int64_t hidden() const override { return hidden_; }
  bool supports(ActivationLayout) const override { return true; }
  void apply(const ExpertsInput& in, const TensorView& out, Stream) override {
    const int64_t H = hidden_;
    if (in.layout == ActivationLayout::ExpertMajor) {
      const int64_t cap = in.x.size(1);
      for (int l = 0; l < num_local_experts(); ++l)
        for (int64_t j = 0; j < in.recv_count.ptr<const int32_t>()[l]; ++j)
          for (int64_t i = 0; i < H; ++i) out.ptr<uint16_t>()[(l * cap + j) * H + i] = float_to_bf16_bits(values_[static_cast<size_t>(l)]);
      return;
    }
    const int64_t N = in.x.size(0), K = in.topk_idx.size(1);
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t l = in.topk_idx.ptr<const int32_t>()[n * K + k];
        if (l >= 0) acc += in.topk_weights.ptr<const float>()[n * K + k] * values_[static_cast<size_t>(l)];
      }
      for (int64_t i = 0; i < H; ++i) {
        if (out.dtype == DType::fp32) out.ptr<float>()[n * H + i] = acc;
        else out.ptr<uint16_t>()[n * H + i] = float_to_bf16_bits(acc);
      }
    }
  }

 private:
  std::vector<float> values_;
  int64_t hidden_;
};

struct Mode {
  std::string backend;
  FlatCombine flat = FlatCombine::partial_fp32;
  LlCombine ll = LlCombine::partial_fp32;
  bool two_roundings() const {
    return backend == "ll" ? ll == LlCombine::partial_bf16 : flat == FlatCombine::partial_bf16;
  }
  std::string describe() const {
    return backend + "/" + (backend == "ll" ? ll_combine_name(ll) : flat_combine_name(flat));
  }
};

std::vector<Mode> all_modes() {
  std::vector<Mode> m;
  for (const char* b : {"naive", "allgather_reducescatter", "all2allv", "ht"}) {
    m.push_back({b, FlatCombine::partial_fp32});
    m.push_back({b, FlatCombine::partial_bf16});
  }
  for (LlCombine l : {LlCombine::column, LlCombine::partial_fp32, LlCombine::partial_bf16}) m.push_back({"ll", FlatCombine::partial_fp32, l});
  return m;
}

/// Runs the cancellation case on R = 2 CPU ranks (E = 4: experts 0, 1 on rank 0, 2, 3 on rank 1;
/// every token selects 0, 1 and 2 with weight 1). `addend`: a constant FinalizeArgs::addend instead
/// of expert 1 (then the routed experts give 2^-9 on rank 0 and -1 on rank 1, the addend 1).
/// `ranks_per_node` 1: two CPU nodes of one rank each, where ll and ht take their hierarchical path
/// (checked: Capabilities::hierarchical and combine_addend). Returns every element of both ranks' out, as floats.
std::vector<float> run_cancellation(const Mode& m, bool addend, int ranks_per_node = 0) {
  const int R = 2, E = 4, T = 3;
  const int64_t H = 8;
  auto groups = ranks_per_node > 0 ? make_cpu_groups(R, 20.0, ranks_per_node) : make_cpu_groups(R, 20.0);
  std::vector<std::vector<float>> outs(R);
  run_ranks(groups, [&](int r) {
    DispatchConfig cfg;
    cfg.hidden = H;
    cfg.num_experts = E;
    cfg.top_k = 3;
    cfg.num_max_dispatch_tokens_per_rank = 4;
    cfg.flat_combine = m.flat;
    cfg.ll_combine = m.ll;
    auto pf = make_prepare_finalize(m.backend, groups[static_cast<size_t>(r)], cfg);
    EXPECT_EQ(pf->capabilities().hierarchical, ranks_per_node == 1) << m.describe();
    EXPECT_TRUE(pf->capabilities().combine_addend) << m.describe();
    // Global expert values: 1, 2^-9 | -1, 0; with the addend expert 0 gives 2^-9 and expert 1 is unused.
    const std::vector<float> global = addend ? std::vector<float>{kTiny, 0.0f, -1.0f, 0.0f} : std::vector<float>{1.0f, kTiny, -1.0f, 0.0f};
    const ExpertRange range = expert_range(E, R, r);
    ConstExperts experts(std::vector<float>(global.begin() + range.begin, global.begin() + range.end), H);
    Tensor x = Tensor::zeros({T, H}, DType::bf16);
    for (int64_t i = 0; i < T * H; ++i) x.ptr<uint16_t>()[i] = float_to_bf16_bits(0.25f * static_cast<float>(i % 7));
    Tensor idx = Tensor::empty({T, 3}, DType::int32), wts = Tensor::empty({T, 3}, DType::fp32);
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < 3; ++k) {
        idx.ptr<int32_t>()[t * 3 + k] = addend && k == 1 ? -1 : k;
        wts.ptr<float>()[t * 3 + k] = 1.0f;
      }
    PrepareResult p = pf->prepare({x, idx, wts});
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    const bool f32 = p.layout == ActivationLayout::Flat && m.flat == FlatCombine::partial_fp32;
    Tensor eo = Tensor::zeros(shape, f32 ? DType::fp32 : DType::bf16);
    experts.apply(p.experts_input(), eo, {});
    Tensor out = Tensor::empty({T, H}, DType::bf16);
    FinalizeArgs fin{eo, out};
    Tensor add;
    if (addend) {
      add = Tensor::empty({T, H}, DType::fp32);
      for (int64_t i = 0; i < T * H; ++i) add.ptr<float>()[i] = 1.0f;
      fin.addend = add;
    }
    pf->finalize(fin);
    for (int64_t i = 0; i < T * H; ++i) outs[static_cast<size_t>(r)].push_back(bf16_bits_to_float(out.ptr<uint16_t>()[i]));
  });
  std::vector<float> all;
  for (const auto& o : outs) all.insert(all.end(), o.begin(), o.end());
  return all;
}

TEST(OneRounding, TwoRankCancellationThroughTheDispatchInterface) {
  for (const Mode& m : all_modes()) {
    const std::vector<float> got = run_cancellation(m, false);
    ASSERT_FALSE(got.empty()) << m.describe();
    const float want = m.two_roundings() ? 0.0f : kTiny;
    for (float v : got) ASSERT_EQ(v, want) << m.describe();
  }
}

TEST(OneRounding, AddendJoinsTheFp32SumBeforeTheRounding) {
  // Routed: 2^-9 (rank 0) + -1 (rank 1) = -(1 - 2^-9), a bf16 tie that rounds to -1; + addend 1.
  for (const Mode& m : all_modes()) {
    const std::vector<float> got = run_cancellation(m, true);
    ASSERT_FALSE(got.empty()) << m.describe();
    // Flat partial_bf16 rounds the routed sum before the addend joins; ll's partials are exact in bf16
    // here (2^-9 and -1), and its addend joins before its one rounding in every mode.
    const float want = m.backend != "ll" && m.two_roundings() ? 0.0f : kTiny;
    for (float v : got) ASSERT_EQ(v, want) << m.describe();
  }
}

// The hierarchical ll / ht (two nodes of one rank): the nodes' partials come back rounded to bf16
// (hier.h, "Numerics"), so the routed cancellation across nodes rounds twice (1 + 2^-9 -> 1, then 0);
// FinalizeArgs::addend joins the cross-node fp32 sum before its one rounding, so the separate shared
// expert adds no rounding: 2^-9 + -1 + 1 returns 2^-9 (the node partials 2^-9 and -1 are exact in bf16).
TEST(OneRounding, HierarchicalAddendJoinsTheCrossNodeSum) {
  std::vector<Mode> modes;
  for (LlCombine l : {LlCombine::column, LlCombine::partial_fp32, LlCombine::partial_bf16}) modes.push_back({"ll", FlatCombine::partial_fp32, l});
  for (FlatCombine f : {FlatCombine::partial_fp32, FlatCombine::partial_bf16}) modes.push_back({"ht", f});
  for (const Mode& m : modes) {
    const std::vector<float> routed = run_cancellation(m, false, 1);
    ASSERT_FALSE(routed.empty()) << m.describe();
    for (float v : routed) ASSERT_EQ(v, 0.0f) << m.describe() << ": the routed sum across nodes rounds twice";
    const std::vector<float> got = run_cancellation(m, true, 1);
    ASSERT_FALSE(got.empty()) << m.describe();
    for (float v : got) ASSERT_EQ(v, kTiny) << m.describe() << ": the addend joins the cross-node sum";
  }
}

TEST(OneRounding, RandomDataWithinOneUlpOfTheOneRoundingReference) {
  for (const char* name : {"naive", "allgather_reducescatter", "all2allv", "ht", "ll"}) {
    for (int R : {2, 4}) {
      Case c;
      c.R = R;
      c.E = 16;
      c.K = 6;
      c.H = 64;
      c.cap = 24;
      c.seed = 7 + R;
      c.shared = true;
      c.flat_combine = FlatCombine::partial_fp32;
      c.ll_combine = LlCombine::partial_fp32;
      const std::vector<RankInput> in = make_inputs(c);
      const auto res = run_layer(name, c, {in});
      expect_matches_oracle(name, c, in, res);  // bit-equal to the per-rank fp32-partial oracle
      int64_t total = 0, far = 0, exact = 0;
      for (int r = 0; r < c.R; ++r) {
        const Tensor ref = oracle_out(c, in[static_cast<size_t>(r)], r, /*flat=*/false);  // no-EP, column order, one rounding
        const Tensor& out = res[static_cast<size_t>(r)].out;
        for (int64_t i = 0; i < out.numel(); ++i) {
          const int a = out.ptr<uint16_t>()[i], b = ref.ptr<uint16_t>()[i];
          // bf16 bits of same-signed values differ by the ulps between them.
          const bool same_sign = (a & 0x8000) == (b & 0x8000);
          const int ulps = same_sign ? std::abs(a - b) : (a & 0x7fff) + (b & 0x7fff);
          far += ulps > 1;
          exact += ulps == 0;
          ++total;
        }
      }
      ASSERT_GT(total, 0);
      EXPECT_LE(static_cast<double>(far), 1e-3 * static_cast<double>(total)) << name << " R=" << R << ": " << far << " of " << total
                                                                               << " elements more than 1 ulp from the reference";
      std::printf("[ one rounding ] %-24s R=%d: %lld of %lld elements bit-equal to the no-EP reference, %lld beyond 1 ulp\n", name, R,
                  static_cast<long long>(exact), static_cast<long long>(total), static_cast<long long>(far));
    }
  }
}

TEST(OneRounding, FlatCombineIsNamedAndChecked) {
  EXPECT_EQ(parse_flat_combine("partial_fp32", "x"), FlatCombine::partial_fp32);
  EXPECT_EQ(parse_flat_combine("partial_bf16", "x"), FlatCombine::partial_bf16);
  EXPECT_NE(invalid_argument_message([] { parse_flat_combine("bf16", "flat.combine"); }).find("two roundings"), std::string::npos);
  EXPECT_EQ(DispatchConfig{}.flat_combine, FlatCombine::partial_fp32);  // one rounding by default
  // A bf16 expert_out under partial_fp32 is refused by name on every rank.
  auto groups = make_cpu_groups(2, 20.0);
  std::vector<std::string> msgs(2);
  run_ranks(groups, [&](int r) {
    DispatchConfig cfg;
    cfg.hidden = 8;
    cfg.num_experts = 2;
    cfg.top_k = 1;
    cfg.num_max_dispatch_tokens_per_rank = 2;
    auto pf = make_prepare_finalize("all2allv", groups[static_cast<size_t>(r)], cfg);
    Tensor x = Tensor::zeros({1, 8}, DType::bf16), idx = Tensor::zeros({1, 1}, DType::int32), w = Tensor::zeros({1, 1}, DType::fp32);
    PrepareResult p = pf->prepare({x, idx, w});
    Tensor eo = Tensor::zeros({p.num_recv_tokens, 8}, DType::bf16), out = Tensor::empty({1, 8}, DType::bf16);
    msgs[static_cast<size_t>(r)] = invalid_argument_message([&] { pf->finalize({eo, out}); });
  });
  EXPECT_NE(msgs[0].find("expert_out.dtype"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[0].find("partial_fp32"), std::string::npos) << msgs[0];
  EXPECT_NE(msgs[1].find("no InvalidArgument"), 0u) << msgs[1];
}

/// An expert whose output is c * 16 in every element for x = e_0 (x[0] = 1, the rest 0): gate row 0 =
/// 16 e_0 and up row 0 = e_0 give g = 16, u = 1, h_0 = round_bf16(silu(16)) = 16 (silu(16) = 16 - 2e-6),
/// the other rows 0; down column 0 = c. Every value and product is exact in bf16 and fp32.
std::shared_ptr<const ExpertWeights> scaled_expert(int64_t H, int64_t I, float c) {
  Tensor gate_up = Tensor::zeros({2 * I, H}, DType::fp32), down = Tensor::zeros({H, I}, DType::fp32);
  gate_up.ptr<float>()[0] = 16.0f;      // gate row 0
  gate_up.ptr<float>()[I * H] = 1.0f;   // up row 0
  for (int64_t h = 0; h < H; ++h) down.ptr<float>()[h * I] = c;
  return ExpertWeights::from_float(WeightFormat::bf16, gate_up, down);
}

// The layer: ModularMoE with a separate shared expert on every CPU backend at R = 2. Every token selects
// expert 0 (rank 0, gives 2^-9) and expert 1 (rank 1, gives -1) with weight 1; the shared expert gives 1
// (no gate). One rounding (the shared rows join the combine's fp32 sum as FinalizeArgs::addend) returns
// 2^-9 + (-1) + 1 = 2^-9; the Flat backends' two-roundings opt-in (flat_combine partial_bf16) rounds the
// routed sum -1 + 2^-9 to -1 first and returns 0. ll adds the addend to its fp32 sum in every
// ll_combine mode (each rank's partial, 2^-9 or -1, is exact in bf16), so it returns 2^-9 in each.
TEST(OneRounding, LayerWithASeparateSharedExpertRoundsOnce) {
  const int R = 2, E = 2, T = 4;
  const int64_t H = 128, I = 8;
  auto w = std::make_shared<MoEWeights>();
  w->config.name = "one-rounding";
  w->config.hidden = H;
  w->config.intermediate = I;
  w->config.router.num_experts = E;
  w->config.router.top_k = 2;
  w->config.num_shared_experts = 1;
  w->config.shared_intermediate = I;
  w->router_weight = Tensor::zeros({E, H}, DType::fp32);
  w->experts = {scaled_expert(H, I, kTiny / 16.0f), scaled_expert(H, I, -1.0f / 16.0f)};
  w->shared = scaled_expert(H, I, 1.0f / 16.0f);
  struct LayerMode {
    Mode m;
    float want;
  };
  std::vector<LayerMode> modes;
  for (const Mode& m : all_modes()) modes.push_back({m, m.backend != "ll" && m.two_roundings() ? 0.0f : kTiny});
  for (const LayerMode& lm : modes) {
    SCOPED_TRACE(lm.m.describe());
    auto groups = make_cpu_groups(R, 20.0);
    std::vector<std::vector<float>> outs(R);
    run_ranks(groups, [&](int r) {
      DispatchConfig cfg;
      cfg.num_max_dispatch_tokens_per_rank = T;
      cfg.flat_combine = lm.m.flat;
      cfg.ll_combine = lm.m.ll;
      ModularMoEOptions o;
      o.shared_mode = SharedExpertMode::separate;
      ModularMoE layer(w, groups[static_cast<size_t>(r)], lm.m.backend, cfg, Config{}, o);
      Tensor x = Tensor::zeros({T, H}, DType::bf16), idx = Tensor::empty({T, 2}, DType::int32), wts = Tensor::empty({T, 2}, DType::fp32);
      for (int t = 0; t < T; ++t) {
        x.ptr<uint16_t>()[t * H] = float_to_bf16_bits(1.0f);
        for (int k = 0; k < 2; ++k) idx.ptr<int32_t>()[t * 2 + k] = k, wts.ptr<float>()[t * 2 + k] = 1.0f;
      }
      Tensor out = Tensor::empty({T, H}, DType::bf16);
      poison(out);
      layer.forward_routed(x, idx, wts, out);
      EXPECT_EQ(layer.counters().shared_separate, 1);
      for (int64_t i = 0; i < T * H; ++i) outs[static_cast<size_t>(r)].push_back(bf16_bits_to_float(out.ptr<const uint16_t>()[i]));
    });
    for (int r = 0; r < R; ++r) {
      int64_t wrong = 0;
      for (float v : outs[static_cast<size_t>(r)]) wrong += v != lm.want;
      EXPECT_EQ(wrong, 0) << "rank " << r << ": want " << lm.want << ", first " << outs[static_cast<size_t>(r)][0];
    }
  }
}

}  // namespace
}  // namespace epx::test

// Every dispatch backend (registry order) x awkward routing cases on CPU ranks: the layer built
// from prepare -> experts -> finalize must equal the no-EP computation (BEHAVIOUR.md), also with the
// library's CPU experts and ll's partial combine modes. Errors on one rank: dispatch_errors_test.cpp; the
// padded form: dispatch_padded_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/error.h"

using namespace epx;
using namespace epx::test;

namespace {

class Backend : public ::testing::TestWithParam<std::string> {};

void check_case(const std::string& name, const Case& c, int iterations = 1) {
  const auto in = make_inputs(c);
  const auto res = run_layer(name, c, {in}, iterations);
  expect_matches_oracle(name, c, in, res);
  // Byte accounting: every rank's valid selections; the rows received over all ranks equal the
  // rank-deduplicated rows sent (dedup backends) or R x all tokens (gather backends).
  int64_t dedup_rows = 0, recv_rows = 0, all_tokens = 0;
  for (int r = 0; r < c.R; ++r) {
    int64_t valid = 0;
    for (int64_t t = 0; t < c.tokens(r); ++t)
      for (int k = 0; k < c.K; ++k) valid += id_at(in[static_cast<size_t>(r)], t, c.K, k) >= 0;
    EXPECT_EQ(res[static_cast<size_t>(r)].stats.num_valid_selections, valid) << name << " rank " << r;
    dedup_rows += res[static_cast<size_t>(r)].stats.num_rank_dedup_rows;
    recv_rows += res[static_cast<size_t>(r)].num_recv_tokens;
    all_tokens += c.tokens(r);
  }
  if (name == "all2allv" || name == "ht") {
    EXPECT_EQ(recv_rows, dedup_rows) << name << " " << c.describe();
    for (int r = 0; r < c.R; ++r) EXPECT_EQ(res[static_cast<size_t>(r)].rows_without_local_selection, 0) << "-1 must move nothing";
  }
  if (name == "naive" || name == "allgather_reducescatter") {
    int ranks_with_experts = 0;
    for (int r = 0; r < c.R; ++r) ranks_with_experts += num_local_experts(c.config(), c.R, r) > 0;
    EXPECT_EQ(recv_rows, ranks_with_experts * all_tokens);
  }
}

}  // namespace

TEST_P(Backend, RanksAndUnevenExpertSplits) {
  for (int R : {1, 2, 3, 4, 8}) {
    Case c;
    c.R = R;
    c.E = R == 1 ? 5 : 2 * R + 1;  // E % R != 0
    c.K = 3;
    c.cap = 9;
    c.seed = static_cast<uint64_t>(R);
    for (int r = 0; r < R; ++r) c.T.push_back((r * 5 + 3) % 10);  // includes 0, odd, and cap
    check_case(GetParam(), c);
  }
}

TEST_P(Backend, FewerExpertsThanRanks) {
  Case c;
  c.R = 4;
  c.E = 3;  // rank 3 holds no expert: it receives nothing, and its expert output is never read
  c.K = 2;
  c.T = {3, 0, 5, 4};
  check_case(GetParam(), c);
}

TEST_P(Backend, ZeroTokensEverywhere) {
  Case c;
  c.R = 3;
  c.E = 6;
  c.T = {0, 0, 0};
  check_case(GetParam(), c);
}

TEST_P(Backend, TopKOneAndTopKAll) {
  Case c;
  c.R = 3;
  c.E = 5;
  c.K = 1;
  c.masked = 0.0;
  check_case(GetParam(), c);
  c.K = 5;  // K = E: every expert, every rank
  c.seed = 2;
  check_case(GetParam(), c);
  c.masked = 0.4;
  c.seed = 3;
  check_case(GetParam(), c);
}

TEST_P(Backend, MaskedDuplicatesAndSkew) {
  Case c;
  c.R = 4;
  c.E = 9;
  c.K = 4;
  c.masked = 0.3;
  c.dups = true;  // the same expert twice in a row's top-k adds twice
  c.cap = 12;
  check_case(GetParam(), c);
  c.dups = false;
  c.masked = 1.0;  // nothing selected at all: zero rows back
  check_case(GetParam(), c);
  c.masked = 0.0;
  c.zipf = 1.5;
  c.idx64 = true;
  check_case(GetParam(), c);
}

TEST_P(Backend, Hidden7168) {
  Case c;
  c.R = 2;
  c.E = 6;
  c.K = 4;
  c.H = 7168;
  c.cap = 4;
  c.T = {3, 2};
  check_case(GetParam(), c);
}

TEST_P(Backend, Fp8Dispatch) {
  Case c;
  c.R = 3;
  c.E = 7;
  c.K = 3;
  c.H = 256;
  c.cap = 6;
  c.dtype = DType::fp8_e4m3;
  check_case(GetParam(), c);
  c.ue8m0 = true;
  c.seed = 5;
  check_case(GetParam(), c);
}

TEST_P(Backend, SharedRoute) {
  Case c;
  c.R = 3;
  c.E = 7;
  c.K = 3;  // 2 routed + the shared column
  c.shared = true;
  c.T = {5, 0, 7};
  check_case(GetParam(), c);
  c.dtype = DType::fp8_e4m3;
  c.H = 128;
  c.dups = true;
  check_case(GetParam(), c);
}

TEST_P(Backend, RepeatedCallsOnOneObject) {
  // Static buffers (ll) and cached layouts (ht) must not leak state between calls: rounds
  // alternate between two different inputs, ending on the second.
  Case c;
  c.R = 3;
  c.E = 8;
  c.K = 3;
  c.cap = 8;
  Case c2 = c;
  c2.seed = 9;
  c2.T = {8, 1, 0};
  const auto a = make_inputs(c), b = make_inputs(c2);
  const auto res = run_layer(GetParam(), c, {a, a, b, b}, 4);
  expect_matches_oracle(GetParam(), c2, b, res);
}

TEST_P(Backend, RankOrderInvariance) {
  // The result for a batch of tokens does not depend on which rank holds it.
  Case c;
  c.R = 4;
  c.E = 10;
  c.K = 3;
  c.dups = true;
  c.shared = false;
  const auto in = make_inputs(c);
  const std::vector<int> perm = {2, 0, 3, 1};
  std::vector<RankInput> moved(in.size());
  Case cp = c;
  cp.T.clear();
  for (int r = 0; r < c.R; ++r) {
    moved[static_cast<size_t>(r)] = in[static_cast<size_t>(perm[static_cast<size_t>(r)])];
    cp.T.push_back(c.tokens(perm[static_cast<size_t>(r)]));
  }
  const auto res = run_layer(GetParam(), c, {in});
  const auto res_moved = run_layer(GetParam(), cp, {moved});
  for (int r = 0; r < c.R; ++r)
    EXPECT_EQ(count_bit_diffs(res_moved[static_cast<size_t>(r)].out, res[static_cast<size_t>(perm[static_cast<size_t>(r)])].out), 0)
        << GetParam() << " rank " << r;
}

TEST_P(Backend, RealSwigluExpertsMatchDirectComputation) {
  // The backend with the library's CPU experts (make_experts_cpu, bf16 SwiGLU weights) against the
  // direct sum over each token's experts (expert_mlp_cpu on the wire rows), bf16 and fp8 dispatch.
  const std::string name = GetParam();
  for (DType dt : {DType::bf16, DType::fp8_e4m3}) {
    Case c;
    c.R = 3;
    c.E = 7;
    c.K = 3;
    c.H = 128;
    c.cap = 6;
    c.T = {6, 0, 3};
    c.dups = true;
    c.dtype = dt;
    const int64_t I = 64;
    std::vector<std::shared_ptr<const ExpertWeights>> weights;
    for (int e = 0; e < c.E; ++e) weights.push_back(ExpertWeights::random(WeightFormat::bf16, c.H, I, 1000 + static_cast<uint64_t>(e)));
    const auto in = make_inputs(c);
    auto groups = make_cpu_groups(c.R, 20.0);
    std::vector<Tensor> outs(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], c.config());
      const ExpertRange range = expert_range(c.E, c.R, r);
      auto experts = make_experts_cpu({weights.begin() + range.begin, weights.begin() + range.end});
      const RankInput& ri = in[static_cast<size_t>(r)];
      PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor eo = Tensor::empty(shape, DType::bf16);
      poison(eo);
      experts->apply(p.experts_input(), eo);
      outs[static_cast<size_t>(r)] = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      pf->finalize({eo, outs[static_cast<size_t>(r)]});
    });
    for (int r = 0; r < c.R; ++r) {
      const RankInput& ri = in[static_cast<size_t>(r)];
      Tensor ref = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
      std::vector<float> y(static_cast<size_t>(c.H));
      for (int64_t t = 0; t < ri.x.size(0); ++t) {
        const std::vector<float> x = wire_row(c, ri, t);
        std::vector<float> acc(static_cast<size_t>(c.H), 0.0f);
        for (int k = 0; k < c.K; ++k) {
          const int32_t e = id_at(ri, t, c.K, k);
          if (e < 0) continue;
          expert_mlp_cpu(*weights[static_cast<size_t>(e)], x.data(), 1, y.data());
          for (int64_t i = 0; i < c.H; ++i) acc[static_cast<size_t>(i)] += ri.topk_weights.ptr<float>()[t * c.K + k] * y[static_cast<size_t>(i)];
        }
        for (int64_t i = 0; i < c.H; ++i) ref.ptr<uint16_t>()[t * c.H + i] = float_to_bf16_bits(acc[static_cast<size_t>(i)]);
      }
      if (ri.x.size(0) > 0) {
        EXPECT_LT(rel_l2_error(outs[static_cast<size_t>(r)], ref), 1e-2) << name << " rank " << r << " " << c.describe();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Backend, ::testing::ValuesIn(backend_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(DispatchLl, PartialCombineModesMatchTheirOracles) {
  // LlCombine::partial_fp32 / partial_bf16 (expert-side partial reduction): bit for bit the
  // per-rank-partial oracle (fp32 partials unrounded, or rounded to bf16), within bf16 noise of the
  // no-EP reference; over ranks, uneven splits, a rank without experts, shared route, duplicates,
  // fp8, -1 selections, T = 0 and repeated calls (both parities).
  for (LlCombine mode : {LlCombine::partial_fp32, LlCombine::partial_bf16}) {
    for (int R : {1, 2, 3, 4}) {
      Case c;
      c.R = R;
      c.E = 2 * R + 1;
      c.K = 3;
      c.cap = 9;
      c.masked = 0.25;
      c.seed = static_cast<uint64_t>(R) + 40;
      c.ll_combine = mode;
      for (int r = 0; r < R; ++r) c.T.push_back((r * 5 + 3) % 10);
      check_case("ll", c, 3);
    }
    Case f;  // rank 3 holds no expert
    f.R = 4, f.E = 3, f.K = 2, f.T = {3, 0, 5, 4}, f.ll_combine = mode;
    check_case("ll", f);
    Case s;  // shared route, duplicates, fp8
    s.R = 3, s.E = 6, s.K = 4, s.shared = true, s.dups = true, s.dtype = DType::fp8_e4m3, s.H = 256, s.T = {5, 0, 7};
    s.masked = 0.3, s.ll_combine = mode;
    check_case("ll", s);
    Case a = s, b = s;  // alternating inputs on one object, ending on the second
    b.seed = 77, b.T = {1, 7, 0};
    const auto ia = make_inputs(a), ib = make_inputs(b);
    expect_matches_oracle("ll", b, ib, run_layer("ll", a, {ia, ib, ia, ib}, 4));
  }
}

TEST(DispatchLl, CombineModeNames) {
  EXPECT_EQ(parse_ll_combine("partial_fp32", "ll.combine"), LlCombine::partial_fp32);
  EXPECT_STREQ(ll_combine_name(LlCombine::partial_bf16), "partial_bf16");
  try {
    parse_ll_combine("rank", "ll.combine");
    FAIL() << "no throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("ll.combine = \"rank\""), std::string::npos) << e.what();
  }
}

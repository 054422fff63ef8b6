// The padded form (DispatchConfig::use_worst_case_sizing) of naive, allgather_reducescatter and all2allv on
// CPU ranks: equal to the dynamic form at different counts per rank, num_tokens selecting the real rows of a
// padded x, a count above the bound refused on every rank before anything moves, a capacity required.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "dispatch_harness.h"
#include "epx/config.h"
#include "epx/error.h"

using namespace epx;
using namespace epx::test;

// ---- the padded form (DispatchConfig::use_worst_case_sizing) of naive, agrs and all2allv --------------

namespace {

/// One round of `name` in its padded form: rank r passes x with rows(r) rows of which num_tokens(r) take
/// part (as a [1] int32 num_tokens when num_tokens(r) >= 0, else all). Returns out and N per rank.
/// The first n rows of t as a new CPU tensor.
Tensor head_rows(const Tensor& t, int64_t n) {
  std::vector<int64_t> shape = {n, t.size(1)};
  Tensor out = Tensor::empty(shape, t.dtype());
  if (n > 0) std::memcpy(out.data(), t.data(), static_cast<size_t>(n * t.size(1) * dtype_size(t.dtype())));
  return out;
}

struct PaddedRank {
  Tensor out;
  int64_t num_recv = 0;
  int64_t padding_rows_ok = 0;  ///< padding rows with every topk_idx -1 and weights 0
};
std::vector<PaddedRank> run_padded(const std::string& name, const Case& c, const std::vector<RankInput>& in,
                                   const std::vector<int64_t>& device_count) {
  auto groups = make_cpu_groups(c.R, 20.0);
  std::vector<PaddedRank> res(static_cast<size_t>(c.R));
  DispatchConfig cfg = c.config();
  cfg.use_worst_case_sizing = true;
  run_ranks(groups, [&](int r) {
    auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], cfg);
    EXPECT_TRUE(pf->capabilities().graph_safe) << name;
    std::vector<int> ids;
    const ExpertRange range = expert_range(c.E, c.R, r);
    for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
    if (c.shared) ids.push_back(c.E);
    TestExperts experts(ids, c.H);
    const RankInput& ri = in[static_cast<size_t>(r)];
    DispatchArgs a{ri.x, ri.topk_idx, ri.topk_weights};
    Tensor count = Tensor::empty({1}, DType::int32);
    if (device_count[static_cast<size_t>(r)] >= 0) {
      count.ptr<int32_t>()[0] = static_cast<int32_t>(device_count[static_cast<size_t>(r)]);
      a.num_tokens = count.view();
    }
    PrepareResult p = pf->prepare(a);
    PaddedRank& pr = res[static_cast<size_t>(r)];
    pr.num_recv = p.num_recv_tokens;
    for (int64_t n = 0; n < p.x.shape[0]; ++n) {
      bool pad = true;
      for (int k = 0; k < c.K; ++k) pad = pad && p.topk_idx.ptr<const int32_t>()[n * c.K + k] < 0 && p.topk_weights.ptr<const float>()[n * c.K + k] == 0.0f;
      pr.padding_rows_ok += pad;
    }
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor expert_out = Tensor::empty(shape, c.expert_out_dtype(p.layout));
    poison(expert_out);
    if (!ids.empty()) experts.apply(p.experts_input(), expert_out, {});
    pr.out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
    poison(pr.out);
    pf->finalize({expert_out, pr.out});
  });
  return res;
}

}  // namespace

TEST(PaddedForm, EqualsTheDynamicFormAtDifferentCountsPerRank) {
  for (const std::string name : {"naive", "allgather_reducescatter", "all2allv"}) {
    for (const bool fp8 : {false, true}) {
      for (const bool shared : {false, true}) {
        Case c;
        c.R = 4;
        c.E = 10;
        c.K = shared ? 4 : 3;
        c.H = fp8 ? 256 : 64;
        c.cap = 7;
        c.T = {7, 0, 3, 5};  // an idle rank, a full one, two in between
        c.dtype = fp8 ? DType::fp8_e4m3 : DType::bf16;
        c.shared = shared;
        c.masked = 0.2;
        c.flat_combine = FlatCombine::partial_fp32;
        const auto in = make_inputs(c);
        const auto dyn = run_layer(name, c, {in});
        const auto pad = run_padded(name, c, in, {-1, -1, -1, -1});
        for (int r = 0; r < c.R; ++r) {
          const auto& pr = pad[static_cast<size_t>(r)];
          EXPECT_EQ(count_bit_diffs(pr.out, dyn[static_cast<size_t>(r)].out), 0) << name << " rank " << r << " " << c.describe();
          const bool none = num_local_experts(c.config(), c.R, r) == 0;
          EXPECT_EQ(pr.num_recv, none ? 0 : c.R * c.cap) << name << " rank " << r;
          // Real rows: every token (gather) or the rank-deduplicated rows (all2allv); the rest is padding.
          if (name != "all2allv") {
            EXPECT_EQ(pr.padding_rows_ok, none ? 0 : c.R * c.cap - (7 + 0 + 3 + 5)) << name << " rank " << r;
          } else {
            EXPECT_EQ(pr.padding_rows_ok, pr.num_recv - dyn[static_cast<size_t>(r)].num_recv_tokens) << name << " rank " << r;
          }
        }
      }
    }
  }
}

TEST(PaddedForm, NumTokensSelectsTheRealRowsOfAPaddedX) {
  for (const std::string name : {"naive", "allgather_reducescatter", "all2allv"}) {
    Case c;
    c.R = 3;
    c.E = 6;
    c.K = 2;
    c.H = 64;
    c.cap = 6;
    c.T = {6, 6, 6};
    c.flat_combine = FlatCombine::partial_fp32;
    const auto in = make_inputs(c);
    const std::vector<int64_t> real = {2, 6, 0};
    const auto pad = run_padded(name, c, in, real);
    // The dynamic form on the first real[r] rows of the same inputs.
    std::vector<RankInput> cut(in.size());
    Case cc = c;
    cc.T = real;
    for (int r = 0; r < c.R; ++r) {
      const RankInput& ri = in[static_cast<size_t>(r)];
      const int64_t n = real[static_cast<size_t>(r)];
      cut[static_cast<size_t>(r)] = {head_rows(ri.x, n), head_rows(ri.topk_idx, n), head_rows(ri.topk_weights, n)};
    }
    const auto dyn = run_layer(name, cc, {cut});
    for (int r = 0; r < c.R; ++r) {
      const int64_t n = real[static_cast<size_t>(r)];
      const Tensor got = head_rows(pad[static_cast<size_t>(r)].out, n);
      EXPECT_EQ(count_bit_diffs(got, dyn[static_cast<size_t>(r)].out), 0) << name << " rank " << r;
    }
  }
}

TEST(PaddedForm, ACountAboveTheBoundIsRefusedOnEveryRankBeforeAnythingMoves) {
  for (const std::string name : {"naive", "allgather_reducescatter", "all2allv"}) {
    Case c;
    c.R = 3;
    c.E = 6;
    c.K = 2;
    c.H = 64;
    c.cap = 4;
    c.T = {4, 5, 2};  // rank 1 is above the bound
    const auto in = make_inputs(c);
    DispatchConfig cfg = c.config();
    cfg.use_worst_case_sizing = true;
    auto groups = make_cpu_groups(c.R, 20.0);
    std::vector<std::string> what(static_cast<size_t>(c.R));
    run_ranks(groups, [&](int r) {
      auto pf = make_prepare_finalize(name, groups[static_cast<size_t>(r)], cfg);
      const RankInput& ri = in[static_cast<size_t>(r)];
      try {
        (void)pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      } catch (const InvalidArgument& e) {
        what[static_cast<size_t>(r)] = e.what();
      }
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_NE(what[static_cast<size_t>(r)].find("num_max_dispatch_tokens_per_rank = 4"), std::string::npos) << name << " rank " << r << ": " << what[static_cast<size_t>(r)];
      if (r != 1) {
        EXPECT_NE(what[static_cast<size_t>(r)].find("rank 1"), std::string::npos) << what[static_cast<size_t>(r)];
      }
    }
    // A device count above x.shape[0]: refused on every rank too.
    Case c2 = c;
    c2.T = {4, 4, 4};
    const auto in2 = make_inputs(c2);
    auto groups2 = make_cpu_groups(c.R, 20.0);
    std::vector<int> threw(static_cast<size_t>(c.R), 0);
    run_ranks(groups2, [&](int r) {
      auto pf = make_prepare_finalize(name, groups2[static_cast<size_t>(r)], cfg);
      const RankInput& ri = in2[static_cast<size_t>(r)];
      Tensor count = Tensor::empty({1}, DType::int32);
      count.ptr<int32_t>()[0] = r == 2 ? 5 : 3;
      DispatchArgs a{ri.x, ri.topk_idx, ri.topk_weights};
      a.num_tokens = count.view();
      try {
        (void)pf->prepare(a);
      } catch (const InvalidArgument&) {
        threw[static_cast<size_t>(r)] = 1;
      }
    });
    for (int r = 0; r < c.R; ++r) EXPECT_EQ(threw[static_cast<size_t>(r)], 1) << name << " rank " << r;
  }
}

TEST(PaddedForm, NeedsACapacity) {
  auto groups = make_cpu_groups(1);
  DispatchConfig cfg;
  cfg.hidden = 64;
  cfg.num_experts = 2;
  cfg.top_k = 1;
  cfg.use_worst_case_sizing = true;
  EXPECT_THROW(make_prepare_finalize("allgather_reducescatter", groups[0], cfg), InvalidArgument);
}

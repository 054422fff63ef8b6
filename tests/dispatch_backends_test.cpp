// Every dispatch backend (registry order) x awkward routing cases on CPU ranks: the layer built
// from prepare -> experts -> finalize must equal the no-EP computation (BEHAVIOUR.md), and bad
// input on one rank must make every rank throw, never hang.
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

// ---- errors: raised on every rank, before any write, never a hang ------------------------------

namespace {

struct RankError {
  std::string type = "none", what;
};

/// Runs `fn(rank, pf)` on every rank of a fresh group with backend `name`; collects what each threw.
template <class Fn>
std::vector<RankError> errors_on_ranks(const std::string& name, const Case& c, Fn fn) {
  auto groups = make_cpu_groups(c.R, 10.0);
  std::vector<RankError> errs(static_cast<size_t>(c.R));
  const auto t0 = std::chrono::steady_clock::now();
  run_ranks(groups, [&](int r) {
    try {
      fn(r, groups[static_cast<size_t>(r)]);
    } catch (const InvalidArgument& e) {
      errs[static_cast<size_t>(r)] = {"InvalidArgument", e.what()};
    } catch (const Unsupported& e) {
      errs[static_cast<size_t>(r)] = {"Unsupported", e.what()};
    } catch (const CommError& e) {
      errs[static_cast<size_t>(r)] = {"CommError", e.what()};
    } catch (const Timeout& e) {
      errs[static_cast<size_t>(r)] = {"Timeout", e.what()};
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << "an error path waited for a timeout";
  return errs;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_P(Backend, CapacityOverflowOnOneRankThrowsOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 3;
  c.cap = 8;
  c.T = {4, 9, 2};  // rank 1 exceeds the capacity
  const auto in = make_inputs(c);
  Case ok = c;
  ok.T = {4, 8, 2};
  const auto in_ok = make_inputs(ok);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    try {
      pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    } catch (const InvalidArgument&) {
      // The object stays usable: a good call afterwards works on every rank.
      const RankInput& good = in_ok[static_cast<size_t>(r)];
      PrepareResult p = pf->prepare({good.x, good.topk_idx, good.topk_weights});
      std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
      Tensor eo = Tensor::zeros(shape, DType::bf16), out = Tensor::empty({good.x.size(0), c.H}, DType::bf16);
      pf->finalize({eo, out});
      throw;
    }
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r;
    EXPECT_TRUE(contains(errs[r].what, "num_tokens = 9")) << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, "num_max_dispatch_tokens_per_rank = 8")) << errs[r].what;
    if (r != 1) {
      EXPECT_TRUE(contains(errs[r].what, "rank 1")) << errs[r].what;
    }
  }
  EXPECT_EQ(errs[1].what, name + ".prepare: num_tokens = 9: must be <= num_max_dispatch_tokens_per_rank = 8 (fixed at create; split the batch)");
}

TEST_P(Backend, BadIdsDtypesAndShapesThrowOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  c.E = 6;
  const auto in = make_inputs(c);
  // (what rank 1 gets wrong, the text its error must contain)
  const std::vector<std::pair<int, std::string>> faults = {
      {0, "topk_idx[1, 0] = 6"}, {1, "topk_idx[1, 0] = -2"}, {2, "x.dtype = fp32"}, {3, "x.shape[1] = 16"}, {4, "topk_weights.shape"}};
  for (const auto& [fault, text] : faults) {
    const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      auto pf = make_prepare_finalize(name, g, c.config());
      RankInput ri = in[static_cast<size_t>(r)];
      Tensor x = ri.x, idx = Tensor::empty({ri.topk_idx.size(0), c.K}, DType::int32), w = ri.topk_weights;
      std::memcpy(idx.data(), ri.topk_idx.data(), static_cast<size_t>(idx.nbytes()));
      if (r == 1) {
        if (fault == 0) idx.ptr<int32_t>()[2] = c.E;  // E without shared_route
        if (fault == 1) idx.ptr<int32_t>()[2] = -2;
        if (fault == 2) x = Tensor::zeros({x.size(0), c.H}, DType::fp32);
        if (fault == 3) x = Tensor::zeros({x.size(0), 2 * c.H}, DType::bf16);
        if (fault == 4) w = Tensor::zeros({x.size(0), c.K + 1}, DType::fp32);
      }
      pf->prepare({x, idx, w});
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " fault " << fault << " rank " << r;
      EXPECT_TRUE(contains(errs[r].what, text)) << errs[r].what;
    }
  }
}

TEST_P(Backend, BadFinalizeArgsThrowOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::zeros(shape, DType::bf16);
    Tensor out = Tensor::empty({ri.x.size(0) + (r == 0 ? 1 : 0), c.H}, DType::bf16);  // rank 0: one row too many
    pf->finalize({eo, out});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r;
    EXPECT_TRUE(contains(errs[r].what, "out.shape")) << errs[r].what;
  }
}

TEST_P(Backend, FinalizeTwiceOnOneRankIsNamedOnEveryRank) {
  // Every rank makes the same sequence of calls (dispatch.h). Here rank 0 finalizes its prepare twice (which is
  // fine when every rank does it) while rank 1 moves on to its next prepare: both ranks throw InvalidArgument
  // naming the two calls that met (not a collective's "bytes_per_rank must agree" or a timeout).
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
    std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
    Tensor eo = Tensor::zeros(shape, DType::bf16);
    Tensor out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
    pf->finalize({eo, out});
    if (r == 0) pf->finalize({eo, out});
    else pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r << ": " << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, name + ".finalize on rank 0") && contains(errs[r].what, name + ".prepare on rank 1") &&
                contains(errs[r].what, "same sequence of calls"))
        << name << " rank " << r << ": " << errs[r].what;
  }
}

TEST_P(Backend, ConfigDisagreementAndBadConfig) {
  const std::string name = GetParam();
  Case c;
  c.R = 3;
  auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    if (r == 2) cfg.hidden = 16;
    make_prepare_finalize(name, g, cfg);
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "CommError");
    EXPECT_EQ(errs[r].what, name + ".create: hidden = 8 on rank 0 but 16 on rank 2: all ranks must agree");
  }
  for (const auto& [field, text] : std::vector<std::pair<int, std::string>>{
           {0, "hidden = 7"}, {1, "hidden = 64: must be a multiple of 128"}, {2, "top_k = 0"}, {3, "num_experts = 0"}}) {
    errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      DispatchConfig cfg = c.config();
      if (field == 0) cfg.hidden = 7;
      if (field == 1) cfg.hidden = 64, cfg.dispatch_dtype = DType::fp8_e4m3;
      if (field == 2) cfg.top_k = 0;
      if (field == 3) cfg.num_experts = 0;
      make_prepare_finalize(name, g, cfg);
    });
    for (int r = 0; r < c.R; ++r) EXPECT_TRUE(errs[r].type == "InvalidArgument" && contains(errs[r].what, text)) << errs[r].what;
  }
}

TEST_P(Backend, OutOfRuleConfigStructIsRefusedOnEveryRank) {
  // A Config built in C++ (fields set directly, not through Config::set / JSON / EPX_*) reaches the
  // backends' launch settings unchecked: ll.combine_wait "flags" ran a mode nobody asked for, ht.chunk_rows = 0 divided by
  // zero in ht's CUDA combine. make_prepare_finalize(name, group, cfg, config) must refuse it with the rule
  // validate() names, on every rank (also when only one rank's Config is bad), before anything is built; the
  // group stays usable.
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  for (const bool only_rank1 : {false, true}) {
    const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
      Config bad;
      if (!only_rank1 || r == 1) bad.ll_combine_wait = "flags", bad.ht_chunk_rows = 0;
      try {
        make_prepare_finalize(name, g, c.config(), bad);
      } catch (const InvalidArgument&) {
        // Nothing held is lost: the same group then builds the backend and runs a round.
        auto pf = make_prepare_finalize(name, g, c.config(), Config{});
        const RankInput& ri = in[static_cast<size_t>(r)];
        PrepareResult p = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::zeros(shape, DType::bf16), out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        pf->finalize({eo, out});
        throw;
      }
    });
    for (int r = 0; r < c.R; ++r) {
      EXPECT_EQ(errs[r].type, "InvalidArgument") << name << " rank " << r << (only_rank1 ? " (rank 1 bad)" : "");
      if (!only_rank1 || r == 1)
        EXPECT_TRUE(contains(errs[r].what, "config: ll.combine_wait = flags: must be flag or data")) << errs[r].what;
      else
        EXPECT_TRUE(contains(errs[r].what, "rank 1")) << errs[r].what;
    }
  }
}

TEST_P(Backend, SharedRouteRulesThrowOnAllRanksAndKeepWhatWasHeld) {
  // FHMoE routes (issue 6): with shared_route, exactly top_k = K+1 columns, the shared id E in the
  // last column only, and the last column E or -1. Rank 1 breaks one rule per round: every rank
  // throws InvalidArgument naming the entry, the value and the rule, before anything moves; the
  // prepare made before the bad call still finalizes to the oracle, and a good call after it works.
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  c.E = 6;
  c.K = 3;  // 2 routed columns + the shared route
  c.shared = true;
  c.masked = 0.0;
  c.T = {4, 5};
  const auto in = make_inputs(c);
  const std::string E = std::to_string(c.E);
  // (what rank 1 gets wrong, texts its error must contain)
  const std::vector<std::pair<int, std::vector<std::string>>> faults = {
      {0, {"topk_idx.shape[1] = 2", "must equal top_k = 3 with shared_route", "shared route column"}},  // the routed columns only
      {1, {"topk_weights.shape[1] = 4", "must equal top_k = 3 with shared_route"}},                       // one weight column too many
      {2, {"topk_idx[1, 2] = 1", "must be num_experts = " + E + " (the shared route) or -1", "not a routed expert's"}},  // shared id missing
      {3, {"topk_idx[1, 0] = " + E, "belongs in the last column (k = 2) only"}},                          // shared id first, routed last
      {4, {"topk_idx[1, 1] = " + E, "a routed expert id in [0, num_experts = " + E + ")"}},                // shared id also in a routed column
      {5, {"topk_idx[1, 2] = " + std::to_string(c.E + 1), "the shared route"}},                            // past the shared id
      {6, {"topk_idx[1, 2] = -2", "the shared route"}}};
  for (const auto& [fault, texts] : faults) {
    std::vector<Tensor> held(static_cast<size_t>(c.R)), after(static_cast<size_t>(c.R));
    const auto errs = errors_on_ranks(name, c, [&, fault = fault](int r, std::shared_ptr<Group> g) {
      auto pf = make_prepare_finalize(name, g, c.config());
      std::vector<int> ids;
      const ExpertRange range = expert_range(c.E, c.R, r);
      for (int e = range.begin; e < range.end; ++e) ids.push_back(e);
      ids.push_back(c.E);
      TestExperts experts(ids, c.H);
      const RankInput& ri = in[static_cast<size_t>(r)];
      auto finalize_into = [&](const PrepareResult& p, Tensor& out) {
        std::vector<int64_t> shape(p.x.shape.begin(), p.x.shape.begin() + p.x.ndim);
        Tensor eo = Tensor::empty(shape, DType::bf16);
        poison(eo);
        experts.apply(p.experts_input(), eo, {});
        out = Tensor::empty({ri.x.size(0), c.H}, DType::bf16);
        poison(out);
        pf->finalize({eo, out});
      };
      const PrepareResult p0 = pf->prepare({ri.x, ri.topk_idx, ri.topk_weights});
      const int64_t T = ri.x.size(0);
      int kc = c.K, wc = c.K;
      if (r == 1 && fault == 0) kc = wc = c.K - 1;
      if (r == 1 && fault == 1) wc = c.K + 1;
      Tensor idx = Tensor::empty({T, kc}, DType::int32), w = Tensor::empty({T, wc}, DType::fp32);
      for (int64_t t = 0; t < T; ++t) {
        for (int k = 0; k < kc; ++k) idx.ptr<int32_t>()[t * kc + k] = id_at(ri, t, c.K, k);
        for (int k = 0; k < wc; ++k) w.ptr<float>()[t * wc + k] = k < c.K ? ri.topk_weights.ptr<const float>()[t * c.K + k] : 1.0f;
      }
      int32_t* row1 = idx.ptr<int32_t>() + 1 * kc;
      if (r == 1 && fault == 2) row1[2] = 1;
      if (r == 1 && fault == 3) std::swap(row1[0], row1[2]);
      if (r == 1 && fault == 4) row1[1] = c.E;
      if (r == 1 && fault == 5) row1[2] = c.E + 1;
      if (r == 1 && fault == 6) row1[2] = -2;
      try {
        pf->prepare({ri.x, idx, w});
      } catch (const InvalidArgument&) {
        finalize_into(p0, held[static_cast<size_t>(r)]);  // the earlier prepare is still there
        finalize_into(pf->prepare({ri.x, ri.topk_idx, ri.topk_weights}), after[static_cast<size_t>(r)]);
        throw;
      }
    });
    for (int r = 0; r < c.R; ++r) {
      const std::string what = name + " fault " + std::to_string(fault) + " rank " + std::to_string(r);
      EXPECT_EQ(errs[r].type, "InvalidArgument") << what << ": " << errs[r].what;
      for (const auto& text : texts) EXPECT_TRUE(contains(errs[r].what, text)) << what << ": " << errs[r].what << " lacks " << text;
      ASSERT_TRUE(held[r].defined() && after[r].defined()) << what;
      const Tensor want = oracle_out(c, in[static_cast<size_t>(r)], r, name != "ll", name != "ll");
      EXPECT_EQ(count_bit_diffs(held[r], want), 0) << what << " (finalize of the prepare before the bad call)";
      EXPECT_EQ(count_bit_diffs(after[r], want), 0) << what << " (a good call after it)";
    }
  }
  // The rules hold routes that fit them: -1 in the last column (shared expert not fused) and -1 in
  // routed columns are valid (make_inputs masks every 5th token's shared column).
  Case ok = c;
  ok.masked = 0.3;
  ok.T = {9, 7};
  const auto in_ok = make_inputs(ok);
  expect_matches_oracle(name, ok, in_ok, run_layer(name, ok, {in_ok}));
}

INSTANTIATE_TEST_SUITE_P(AllBackends, Backend, ::testing::ValuesIn(backend_names()),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(DispatchRegistry, NamesAndUnknownBackend) {
  EXPECT_EQ(backend_names(), (std::vector<std::string>{"naive", "allgather_reducescatter", "all2allv", "ll", "ht"}));
  Case c;
  c.R = 2;
  const auto errs = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize("deepep", g, c.config()); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errs[r].type, "InvalidArgument");
    EXPECT_TRUE(contains(errs[r].what, "naive, allgather_reducescatter, all2allv, ll, ht")) << errs[r].what;
  }
  // A rank asking for another backend than its peers is a disagreement, not a hang.
  const auto mixed = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize(r ? "ll" : "ht", g, c.config()); });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(mixed[r].type, "CommError") << mixed[r].what;
  // The disagreement names the values as the caller wrote them (backend and dtype names, not enum indices).
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(mixed[r].what, "backend = ht on rank 0 but ll on rank 1: all ranks must agree")) << mixed[r].what;
  const auto dtypes = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.hidden = 128;
    if (r == 1) cfg.dispatch_dtype = DType::fp8_e4m3;
    make_prepare_finalize("naive", g, cfg);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_EQ(dtypes[r].what, "naive.create: dispatch_dtype = bf16 on rank 0 but fp8_e4m3 on rank 1: all ranks must agree") << dtypes[r].what;
  const auto combine = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) {
    DispatchConfig cfg = c.config();
    cfg.ll_combine = r ? LlCombine::partial_bf16 : LlCombine::partial_fp32;
    make_prepare_finalize("naive", g, cfg);
  });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(combine[r].what, "ll_combine = partial_fp32 on rank 0 but partial_bf16 on rank 1")) << combine[r].what;
  const auto unknown = errors_on_ranks("naive", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize(r ? "deepep" : "naive", g, c.config()); });
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(contains(unknown[r].what, "backend = naive on rank 0 but an unknown name on rank 1")) << unknown[r].what;
}

TEST(DispatchRegistry, LlNeedsACapacity) {
  Case c;
  c.R = 2;
  c.cap = 0;
  const auto errs = errors_on_ranks("ll", c, [&](int r, std::shared_ptr<Group> g) { make_prepare_finalize("ll", g, c.config()); });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(contains(errs[r].what, "num_max_dispatch_tokens_per_rank = 0")) << errs[r].what;
  // Dynamic backends accept 0 = no limit.
  Case d = c;
  d.T = {40, 3};
  const auto in = make_inputs(d);
  expect_matches_oracle("all2allv", d, in, run_layer("all2allv", d, {in}));
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

TEST_P(Backend, TensorsOnAnotherDeviceAreUnsupportedOnAllRanks) {
  const std::string name = GetParam();
  Case c;
  c.R = 2;
  const auto in = make_inputs(c);
  const auto errs = errors_on_ranks(name, c, [&](int r, std::shared_ptr<Group> g) {
    auto pf = make_prepare_finalize(name, g, c.config());
    const RankInput& ri = in[static_cast<size_t>(r)];
    TensorView x = ri.x.view();
    if (r == 0) {
      x.device = Device::cuda(0);  // never dereferenced: rejected before any read
      EXPECT_TRUE(pf->why_unsupported({x, ri.topk_idx, ri.topk_weights}).has_value());
    }
    EXPECT_EQ(pf->why_unsupported({ri.x, ri.topk_idx, ri.topk_weights}), std::nullopt);
    pf->prepare({x, ri.topk_idx, ri.topk_weights});
  });
  for (int r = 0; r < c.R; ++r) {
    EXPECT_EQ(errs[r].type, "Unsupported") << errs[r].what;
    EXPECT_TRUE(contains(errs[r].what, "cuda:0")) << errs[r].what;
  }
}

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
